"""Talks to :mod:`agentrl.sandbox.executor` over a byte stream (a docker exec socket or a pipe pair)."""

from __future__ import annotations

import base64
import contextlib
import json
import os
import select
import socket
import struct
import subprocess
import time
from collections.abc import Mapping
from pathlib import Path

from agentrl.sandbox.result import ExecResult

EXECUTOR_SOURCE = Path(__file__).with_name("executor.py").read_text()
# Extra seconds the client waits beyond a command's own timeout before declaring the executor stuck.
CLIENT_GRACE_S = 10.0


class ExecutorGone(RuntimeError):
    """The executor process exited or its stream broke (e.g. the command killed it)."""


class ExecutorStuck(RuntimeError):
    """The executor did not answer within the command timeout plus a grace period."""


class Transport:
    """A bidirectional byte stream to one executor."""

    def send(self, data: bytes) -> None:
        raise NotImplementedError

    def recv(self, timeout: float) -> bytes:
        """Protocol bytes (b'' at EOF); raises TimeoutError."""
        raise NotImplementedError

    def close(self) -> None:
        raise NotImplementedError


class DockerAttachTransport(Transport):
    """A hijacked ``docker exec`` connection: stdin raw, stdout/stderr multiplexed in 8-byte-header frames.

    The socket is read directly (not through the HTTP response's buffer): the executor writes nothing
    before its first request, so nothing can sit in that buffer.
    """

    def __init__(self, sock: socket.socket):
        self._sock = sock
        self._raw = bytearray()
        self.stderr_tail = b""

    def send(self, data: bytes) -> None:
        self._sock.settimeout(30.0)
        self._sock.sendall(data)

    def recv(self, timeout: float) -> bytes:
        deadline = time.monotonic() + timeout
        while True:
            while len(self._raw) >= 8:
                stream, size = struct.unpack(">BxxxL", self._raw[:8])
                if len(self._raw) < 8 + size:
                    break
                payload = bytes(self._raw[8:8 + size])
                del self._raw[:8 + size]
                if stream == 1:
                    return payload
                self.stderr_tail = (self.stderr_tail + payload)[-4096:]
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError
            self._sock.settimeout(remaining)
            try:
                chunk = self._sock.recv(262144)
            except TimeoutError:
                raise
            except OSError:
                return b""
            if not chunk:
                return b""
            self._raw += chunk

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self._sock.close()


class PipeTransport(Transport):
    """The stdin/stdout pipes of a local subprocess that runs the executor."""

    def __init__(self, proc: subprocess.Popen):
        self.proc = proc

    def send(self, data: bytes) -> None:
        fd = self.proc.stdin.fileno()
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]

    def recv(self, timeout: float) -> bytes:
        fd = self.proc.stdout.fileno()
        ready, _, _ = select.select([fd], [], [], max(0.0, timeout))
        if not ready:
            raise TimeoutError
        return os.read(fd, 262144)

    def close(self) -> None:
        for stream in (self.proc.stdin, self.proc.stdout):
            with contextlib.suppress(OSError):
                stream.close()


class ExecutorClient:
    """Request/response calls to one executor; one call at a time."""

    def __init__(self, transport: Transport):
        self.transport = transport
        self._buf = bytearray()
        self.broken = False

    def call(self, request: Mapping, timeout: float) -> dict:
        if self.broken:
            raise ExecutorGone("executor connection already broken")
        body = json.dumps(request).encode()
        try:
            self.transport.send(struct.pack(">I", len(body)) + body)
        except OSError as exc:
            self.broken = True
            raise ExecutorGone(f"cannot send to executor: {exc}") from exc
        deadline = time.monotonic() + timeout
        while True:
            if len(self._buf) >= 4:
                size = struct.unpack(">I", self._buf[:4])[0]
                if len(self._buf) >= 4 + size:
                    msg = json.loads(bytes(self._buf[4:4 + size]))
                    del self._buf[:4 + size]
                    if "error" in msg:
                        raise RuntimeError(f"executor rejected the request: {msg['error']}")
                    return msg
            try:
                chunk = self.transport.recv(max(0.0, deadline - time.monotonic()))
            except TimeoutError as exc:
                self.broken = True
                raise ExecutorStuck(f"no answer from the executor within {timeout:.1f}s") from exc
            if not chunk:
                self.broken = True
                raise ExecutorGone("executor stream closed")
            self._buf += chunk

    def run(self, argv: list[str], *, timeout: float, stdin: bytes | None, env: Mapping[str, str],
            cwd: str, limit: int, python_code: str | None = None) -> ExecResult:
        """Run argv (or, with ``python_code``, that code in a fork of the executor's interpreter)."""
        msg = self.call({"op": "run", "argv": argv, "timeout": timeout, "cwd": cwd, "env": dict(env),
                         "limit": limit, "stdin": base64.b64encode(stdin).decode() if stdin is not None else None,
                         "python_code": python_code}, timeout + CLIENT_GRACE_S)
        return ExecResult(
            exit_code=int(msg["exit_code"]),
            stdout=base64.b64decode(msg["stdout"]).decode("utf-8", errors="replace"),
            stderr=base64.b64decode(msg["stderr"]).decode("utf-8", errors="replace"),
            timed_out=bool(msg["timed_out"]), oom_killed=bool(msg["oom_killed"]),
            duration_s=float(msg["duration_s"]),
            truncated=msg["stdout_total"] > limit or msg["stderr_total"] > limit)

    def close(self) -> None:
        self.broken = True
        self.transport.close()


def executor_lost_result(started: float, *, timed_out: bool, why: str) -> ExecResult:
    """The result reported when a command took the executor down with it (or it got stuck)."""
    return ExecResult(exit_code=137, stdout="", stderr=f"sandbox: {why}\n", timed_out=timed_out,
                      oom_killed=False, duration_s=time.monotonic() - started, truncated=False)
