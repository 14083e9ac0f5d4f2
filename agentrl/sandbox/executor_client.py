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


class ExecutorError(RuntimeError):
    """The executor could not serve a call; the sandbox drops it and starts a fresh one."""


class ExecutorGone(ExecutorError):
    """The executor process exited or its stream broke (e.g. the command killed it)."""


class ExecutorStuck(ExecutorError):
    """The executor did not answer within the command timeout plus a grace period."""


class ProtocolError(ExecutorGone):
    """A reply that breaks the protocol (oversized frame, bad JSON, missing fields): the stream is dropped."""


class ExecutorRejected(ExecutorError):
    """The executor answered with an error for this request (and keeps serving)."""


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

    Frames are passed on as they arrive, never buffered whole, so a frame header's length costs no
    memory; only the last 4 KiB of stderr are kept. The socket is read directly (not through the HTTP
    response's buffer): the executor writes nothing before its first request, so nothing can sit there.
    """

    _CHUNK = 262144

    def __init__(self, sock: socket.socket):
        self._sock = sock
        self._raw = bytearray()  # at most one header plus one socket read
        self._stream = 0
        self._left = 0  # payload bytes of the current frame not yet passed on
        self.stderr_tail = b""

    def send(self, data: bytes) -> None:
        self._sock.settimeout(30.0)
        self._sock.sendall(data)

    def recv(self, timeout: float) -> bytes:
        deadline = time.monotonic() + timeout
        while True:
            if self._left == 0 and len(self._raw) >= 8:
                self._stream, self._left = struct.unpack(">BxxxL", self._raw[:8])
                del self._raw[:8]
                if self._stream not in (1, 2):
                    raise ProtocolError(f"unknown docker stream {self._stream}")
            if self._left and self._raw:
                payload = bytes(self._raw[:self._left])
                del self._raw[:len(payload)]
                self._left -= len(payload)
                if self._stream == 1:
                    return payload
                self.stderr_tail = (self.stderr_tail + payload)[-4096:]
                continue
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError
            self._sock.settimeout(remaining)
            try:
                chunk = self._sock.recv(self._CHUNK)
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


# Replies other than command output and file reads are small; anything bigger breaks the protocol.
CONTROL_REPLY_CAP = 64 * 1024
_RESULT_FIELDS = {"exit_code": int, "stdout": str, "stderr": str, "stdout_total": int, "stderr_total": int,
                  "timed_out": bool, "oom_killed": bool, "duration_s": (int, float)}


def b64_size(n: int) -> int:
    """Length of ``n`` bytes in base64."""
    return 4 * ((n + 2) // 3)


class ExecutorClient:
    """Request/response calls to one executor; one call at a time. Every reply is bounded before it is
    buffered (``max_reply`` bytes) and checked before it is used; a violation breaks the connection."""

    def __init__(self, transport: Transport):
        self.transport = transport
        self._buf = bytearray()
        self.broken = False

    def call(self, request: Mapping, timeout: float, *, max_reply: int = CONTROL_REPLY_CAP) -> dict:
        if self.broken:
            raise ExecutorGone("executor connection already broken")
        try:
            return self._call(request, timeout, max_reply)
        except ExecutorError as exc:
            if not isinstance(exc, ExecutorRejected):
                self.broken = True
            raise

    def _call(self, request: Mapping, timeout: float, max_reply: int) -> dict:
        body = json.dumps(request).encode()
        try:
            self.transport.send(struct.pack(">I", len(body)) + body)
        except OSError as exc:
            raise ExecutorGone(f"cannot send to executor: {exc}") from exc
        deadline = time.monotonic() + timeout
        size = None
        while True:
            if size is None and len(self._buf) >= 4:
                size = struct.unpack(">I", self._buf[:4])[0]
                if size > max_reply:
                    raise ProtocolError(f"reply of {size} bytes announced, at most {max_reply} allowed")
            if size is not None and len(self._buf) >= 4 + size:
                if len(self._buf) > 4 + size:
                    raise ProtocolError("bytes after the reply: the stream is not the executor's alone")
                try:
                    msg = json.loads(bytes(self._buf[4:]))
                except ValueError as exc:
                    raise ProtocolError(f"reply is not JSON: {exc}") from exc
                self._buf.clear()
                if not isinstance(msg, dict):
                    raise ProtocolError("reply is not a JSON object")
                if "error" in msg:
                    raise ExecutorRejected(f"executor rejected the request: {msg['error']}")
                return msg
            try:
                chunk = self.transport.recv(max(0.0, deadline - time.monotonic()))
            except TimeoutError as exc:
                raise ExecutorStuck(f"no answer from the executor within {timeout:.1f}s") from exc
            if not chunk:
                raise ExecutorGone("executor stream closed")
            if size is not None and len(self._buf) + len(chunk) > 4 + size:
                raise ProtocolError("bytes after the reply: the stream is not the executor's alone")
            self._buf += chunk

    def run(self, argv: list[str], *, timeout: float, stdin: bytes | None, env: Mapping[str, str],
            cwd: str, limit: int, python_code: str | None = None, private: bool = False) -> ExecResult:
        """Run argv (or, with ``python_code``, that code in a fork of the executor's zygote; ``private``:
        in a process no other process of the agent can open, for the host's own checks)."""
        msg = self.call({"op": "run", "argv": argv, "timeout": timeout, "cwd": cwd, "env": dict(env),
                         "limit": limit, "stdin": base64.b64encode(stdin).decode() if stdin is not None else None,
                         "python_code": python_code, "private": private}, timeout + CLIENT_GRACE_S,
                        max_reply=2 * b64_size(limit) + 1024)
        bad = [k for k, kind in _RESULT_FIELDS.items() if not isinstance(msg.get(k), kind)]
        if bad:
            self.broken = True
            raise ProtocolError(f"run reply lacks {bad}")
        try:
            out, err = base64.b64decode(msg["stdout"], validate=True), base64.b64decode(msg["stderr"], validate=True)
        except ValueError as exc:
            self.broken = True
            raise ProtocolError(f"run reply output is not base64: {exc}") from exc
        return ExecResult(
            exit_code=msg["exit_code"], stdout=out[:limit].decode("utf-8", errors="replace"),
            stderr=err[:limit].decode("utf-8", errors="replace"), timed_out=msg["timed_out"],
            oom_killed=msg["oom_killed"], duration_s=float(msg["duration_s"]),
            truncated=msg["stdout_total"] > limit or msg["stderr_total"] > limit)

    def close(self) -> None:
        self.broken = True
        self.transport.close()


def executor_lost_result(started: float, *, timed_out: bool, why: str) -> ExecResult:
    """The result reported when a command took the executor down with it (or it got stuck)."""
    return ExecResult(exit_code=137, stdout="", stderr=f"sandbox: {why}\n", timed_out=timed_out,
                      oom_killed=False, duration_s=time.monotonic() - started, truncated=False)
