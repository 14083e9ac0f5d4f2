"""Start and stop ``python -m agentrl.engine`` as a child process tied to this one (see
:mod:`agentrl.engine.process`), its log in a file, the run's secret in its environment and its CPU
thread count set."""

from __future__ import annotations

import ipaddress
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

from agentrl.engine.auth import SECRET_ENV, run_secret
from agentrl.engine.process import log_file, signal_group, start_tied_process, stop_process_group

# Thread-pool sizes torch's CPU kernels (OpenMP, MKL) read at import: set before the child imports torch.
_THREAD_ENV = ("OMP_NUM_THREADS", "MKL_NUM_THREADS")


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


def is_loopback(host: str) -> bool:
    """Whether binding ``host`` serves this machine only (``localhost`` or a loopback address)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def non_loopback_warning(host: str) -> str | None:
    """A warning for a server about to bind ``host`` where other machines can reach it, else ``None``."""
    if is_loopback(host):
        return None
    return (f"binding {host}: other machines can reach this server; its control routes are guarded only "
            f"by the run's secret, sent in clear HTTP")


def threads_per_engine(num_engines: int, cpus: int | None = None) -> int:
    """CPU threads for each of ``num_engines`` engines sharing ``cpus`` cores (default: the cores this
    process may run on), at least 1. Oversubscribed torch thread pools spin against each other: two
    engines on two cores with torch's default threads served 10-20x fewer requests than one engine."""
    total = cpus if cpus is not None else len(os.sched_getaffinity(0))
    return max(1, total // max(1, num_engines))


class EngineStartError(RuntimeError):
    """The engine process exited or did not become healthy in time (the message holds its log tail)."""


class EngineProcess:
    """One embedded engine server process; it dies with the process that started it, even by SIGKILL.

    Its stdout and stderr go to :attr:`log_path`: ``log_path`` if given, else ``log_dir/engine-<port>.log``,
    else a fresh temp file. ``secret`` (default: :func:`~agentrl.engine.auth.run_secret`) guards its
    control routes; ``threads`` sets its torch, OpenMP and MKL thread counts (default: torch's choice).

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
        secret: str | None = None,
        threads: int | None = None,
    ) -> None:
        if threads is not None and threads < 1:
            raise ValueError(f"threads must be >= 1, got {threads}")
        self.model_dir = str(model_dir)
        self.host = host
        self.secret = secret or run_secret()
        self.threads = threads
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
        threads = ["--num-threads", str(self.threads)] if self.threads is not None else []
        return [
            sys.executable, "-m", "agentrl.engine", "--model", self.model_dir, "--host", self.host,
            "--port", str(self.port), "--dtype", self.dtype, *threads, *self.extra_args,
        ]

    def child_env(self) -> dict[str, str]:
        """The child's environment: ours, the thread counts, then ``env``, then the secret."""
        threads = {k: str(self.threads) for k in _THREAD_ENV} if self.threads is not None else {}
        return {**os.environ, **threads, **(self.env or {}), SECRET_ENV: self.secret}

    def start(self) -> EngineProcess:
        """Start the process (again, on the same port, if it exited); does not wait for health."""
        if self.alive:
            return self
        self.proc = start_tied_process(self.command(), log_path=self.log_path, env=self.child_env())
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


class ExternalEngine:
    """A server agentrl did not start (``agentrl serve``, SGLang), with :class:`EngineProcess`'s API:
    :meth:`wait_healthy` checks that it answers ``GET /health`` and takes the run's ``secret`` on
    ``/server_info`` (kept as :attr:`info`); :meth:`start` and :meth:`stop` leave it alone."""

    def __init__(self, url: str, *, secret: str | None = None) -> None:
        self.url = url.rstrip("/")
        self.secret = secret or run_secret()
        self.info: dict | None = None

    @property
    def alive(self) -> bool:  # not ours to watch: EngineWatch's health probes decide
        return True

    pid = None

    def start(self) -> ExternalEngine:
        return self

    def stop(self, timeout: float = 10) -> None:
        """Nothing: agentrl never stops a server it did not start."""

    def kill(self) -> None:
        """Nothing (see :meth:`stop`)."""

    def wait_healthy(self, timeout: float = 15) -> ExternalEngine:
        """Block until ``/health`` answers 200, then read ``/server_info`` with the secret; raise
        :class:`EngineStartError` naming the url when it does not answer or refuses the secret."""
        import json

        from agentrl.engine.auth import auth_headers

        opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
        deadline = time.monotonic() + timeout
        last = "no answer"
        while True:
            try:
                with opener.open(self.url + "/health", timeout=2) as resp:
                    if resp.status == 200:
                        break
                    last = f"HTTP {resp.status}"
            except urllib.error.HTTPError as exc:
                last = f"HTTP {exc.code}"
            except (urllib.error.URLError, OSError) as exc:
                last = f"{type(exc).__name__}: {getattr(exc, 'reason', exc)}"
            if time.monotonic() > deadline:
                raise EngineStartError(f"engine {self.url} (rollout.engine_urls) does not answer GET /health "
                                       f"after {timeout:g} s: {last}; is the server running and reachable from here?")
            time.sleep(0.2)
        request = urllib.request.Request(self.url + "/server_info", headers=auth_headers(self.secret))
        try:
            with opener.open(request, timeout=10) as resp:
                self.info = json.loads(resp.read() or b"{}")
        except urllib.error.HTTPError as exc:
            if exc.code in (401, 403):
                raise EngineStartError(
                    f"engine {self.url} refused the run's secret (HTTP {exc.code} on /server_info): start it with the "
                    f"same secret, ${SECRET_ENV} for agentrl serve or --api-key for SGLang, and set ${SECRET_ENV} "
                    "to it where agentrl train runs") from None
            raise EngineStartError(f"engine {self.url}: GET /server_info failed with HTTP {exc.code}") from None
        except (urllib.error.URLError, OSError, ValueError) as exc:
            raise EngineStartError(f"engine {self.url}: GET /server_info failed: {exc}") from None
        return self

    def where(self) -> dict:
        """Where it runs, as far as agentrl knows: its url (it is not on a bundle of this run)."""
        return {"url": self.url, "external": True, "node_id": None, "node_ip": None, "gpu_ids": None,
                "engine": (self.info or {}).get("engine") or "sglang"}
