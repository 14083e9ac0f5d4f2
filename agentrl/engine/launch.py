"""Start and stop ``python -m agentrl.engine`` as a child process tied to this one (see
:mod:`agentrl.engine.process`), its log in a file."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Mapping, Sequence
from pathlib import Path

from agentrl.engine.process import log_file, signal_group, start_tied_process, stop_process_group


def free_ports(n: int, host: str = "127.0.0.1") -> list[int]:
    """``n`` distinct TCP ports the OS reports free right now (a race remains until servers bind them)."""
    socks = [socket.socket(socket.AF_INET, socket.SOCK_STREAM) for _ in range(n)]
    try:
        for sock in socks:  # all bound at once, so the OS hands out n different ports
            sock.bind((host, 0))
        return [int(sock.getsockname()[1]) for sock in socks]
    finally:
        for sock in socks:
            sock.close()


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port the OS reports free right now (a tiny race remains until the server binds it)."""
    return free_ports(1, host)[0]


class EngineStartError(RuntimeError):
    """The engine process exited or did not become healthy in time (the message holds its log tail)."""


class EngineProcess:
    """One embedded engine server process; it dies with the process that started it, even by SIGKILL.

    Its stdout and stderr go to :attr:`log_path`: ``log_path`` if given, else ``log_dir/engine-<port>.log``,
    else a fresh temp file.

    >>> with EngineProcess(model_dir) as eng:   # starts and waits for /health
    ...     requests.post(eng.url + "/generate", json=...)
    """

    def __init__(
        self,
        model_dir: str | Path,
        *,
        port: int | None = None,
        host: str = "127.0.0.1",
        dtype: str = "float32",
        extra_args: Sequence[str] = (),
        env: Mapping[str, str] | None = None,
        log_path: str | Path | None = None,
        log_dir: str | Path | None = None,
    ) -> None:
        self.model_dir = str(model_dir)
        self.host = host
        self.port = port if port is not None else free_port(host)
        self.dtype = dtype
        self.extra_args = list(extra_args)
        self.env = dict(env) if env is not None else None
        self.log_path = Path(log_path) if log_path is not None else log_file(log_dir, f"engine-{self.port}.log")
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None else None

    def command(self) -> list[str]:
        return [
            sys.executable, "-m", "agentrl.engine", "--model", self.model_dir, "--host", self.host,
            "--port", str(self.port), "--dtype", self.dtype, *self.extra_args,
        ]

    def start(self) -> EngineProcess:
        if self.alive:
            return self
        self.proc = start_tied_process(self.command(), log_path=self.log_path, env={**os.environ, **(self.env or {})})
        return self

    def log_tail(self, n_chars: int = 4000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-n_chars:]
        except OSError:
            return ""

    def wait_healthy(self, timeout: float = 60) -> EngineProcess:
        """Block until ``GET /health`` answers 200; raise :class:`EngineStartError` on exit or timeout."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if not self.alive:
                code = None if self.proc is None else self.proc.returncode
                raise EngineStartError(f"engine exited with code {code} before becoming healthy:\n{self.log_tail()}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2) as resp:
                    if resp.status == 200:
                        return self
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(0.1)
        raise EngineStartError(f"engine at {self.url} not healthy after {timeout} s:\n{self.log_tail()}")

    def stop(self, timeout: float = 10) -> None:
        """SIGTERM the process group, SIGKILL it after ``timeout`` s (and any stragglers in it)."""
        stop_process_group(self.proc, ((signal.SIGTERM, timeout), (signal.SIGKILL, timeout)))

    def kill(self) -> None:
        """SIGKILL at once (simulates a crashed engine in failure tests)."""
        if self.proc is None:
            return
        signal_group(self.proc, signal.SIGKILL)
        self.proc.wait(timeout=10)

    def __enter__(self) -> EngineProcess:
        self.start()
        try:
            self.wait_healthy()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
