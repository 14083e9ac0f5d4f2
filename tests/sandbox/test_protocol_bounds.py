"""The host side of the executor protocol against a hostile stream (no engine needed): a length header
is checked against the cap before anything is buffered, docker frames are never buffered whole, and a
reply that breaks the protocol makes ``exec`` return a result instead of raising."""

from __future__ import annotations

import json
import socket
import struct
import threading
import tracemalloc

import pytest

from agentrl.sandbox.executor_client import (
    DockerAttachTransport,
    ExecutorClient,
    ProtocolError,
    Transport,
)
from agentrl.sandbox.executor_sandbox import ExecutorSandbox


class Scripted(Transport):
    """Replies with fixed bytes, then as much filler as asked for."""

    def __init__(self, head: bytes, filler: int = 0):
        self.chunks = [head] + [b"x" * 65536] * (filler // 65536)

    def send(self, data: bytes) -> None:
        pass

    def recv(self, timeout: float) -> bytes:
        return self.chunks.pop(0) if self.chunks else b""

    def close(self) -> None:
        pass


def frame(obj) -> bytes:
    body = json.dumps(obj).encode()
    return struct.pack(">I", len(body)) + body


def test_a_4_gib_length_header_is_refused_before_any_allocation():
    tracemalloc.start()
    client = ExecutorClient(Scripted(struct.pack(">I", 2**32 - 1), filler=64 * 2**20))
    with pytest.raises(ProtocolError, match="at most"):
        client.run(["true"], timeout=5, stdin=None, env={}, cwd="/", limit=65536)
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert peak < 4 * 2**20 and client.broken


@pytest.mark.parametrize("reply", [
    {"stdout": "", "stderr": ""},  # no exit_code: the KeyError of issue 21
    {"exit_code": "0", "stdout": "", "stderr": "", "stdout_total": 0, "stderr_total": 0, "timed_out": False,
     "oom_killed": False, "duration_s": 0},
    {"exit_code": 0, "stdout": "not base64!", "stderr": "", "stdout_total": 0, "stderr_total": 0,
     "timed_out": False, "oom_killed": False, "duration_s": 0},
    [1, 2, 3],
])
def test_malformed_replies_break_the_connection(reply):
    client = ExecutorClient(Scripted(frame(reply)))
    with pytest.raises(ProtocolError):
        client.run(["true"], timeout=5, stdin=None, env={}, cwd="/", limit=100)
    assert client.broken


def test_bytes_beyond_the_reply_are_a_violation():
    ok = {"pid": 1}
    client = ExecutorClient(Scripted(frame(ok) + frame(ok)))
    with pytest.raises(ProtocolError, match="not the executor's alone"):
        client.call({"op": "ping"}, 5)


def test_docker_frames_stream_without_buffering_the_announced_size():
    host, peer = socket.socketpair()
    payload = frame({"pid": 7})

    def serve():
        peer.sendall(struct.pack(">BxxxL", 2, 2**32 - 1) + b"e" * (8 * 2**20))  # a huge stderr frame
        peer.close()

    threading.Thread(target=serve, daemon=True).start()
    transport = DockerAttachTransport(host)
    tracemalloc.start()
    while transport.recv(5):
        pass
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert peak < 2 * 2**20 and len(transport.stderr_tail) == 4096
    host2, peer2 = socket.socketpair()
    peer2.sendall(struct.pack(">BxxxL", 1, len(payload)) + payload)
    assert ExecutorClient(DockerAttachTransport(host2)).call({"op": "ping"}, 5) == {"pid": 7}


class _FakeSandbox(ExecutorSandbox):
    """An executor sandbox whose executor sends ``reply`` (the shared exec path, no container)."""

    def __init__(self, reply: bytes):
        super().__init__()
        self.reply = reply
        self.launched = 0

    def start(self) -> None:
        pass

    def close(self) -> None:
        self._closed = True

    def _launch_executor(self) -> ExecutorClient:
        self.launched += 1
        return ExecutorClient(Scripted(self.reply))

    def _force_kill_processes(self) -> None:
        pass

    def _runtime_alive(self) -> bool:
        return True

    def read_file(self, path, *, max_bytes=None):
        raise NotImplementedError

    def write_files(self, files, *, mode=0o644):
        raise NotImplementedError


@pytest.mark.parametrize("reply", [frame({"stdout": "Rk9SR0VE"}), struct.pack(">I", 2**32 - 1), b"\x00\x00",
                                   frame({"error": "KeyError: 'argv'"})])
def test_exec_never_raises_for_a_hostile_stream(reply):
    sb = _FakeSandbox(reply)
    r = sb.exec("echo hi", timeout=1)
    assert r.exit_code in (-1, 137) and "FORGED" not in r.stdout and r.stderr.startswith("sandbox: "), r
    assert not sb.healthy()
