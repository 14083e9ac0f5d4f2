"""The part of a sandbox that is the same for every backend: commands, files and reset all go through
the in-sandbox executor (:mod:`agentrl.sandbox.executor`); a backend only says how to launch it,
how to hard-kill everything when it hangs, and whether its container/namespace still exists."""

from __future__ import annotations

import abc
import base64
import threading
import time
from collections.abc import Mapping

from agentrl.sandbox.base import Sandbox, SandboxError, SpecialFileError, work_path
from agentrl.sandbox.executor_client import (
    ExecutorClient,
    ExecutorError,
    ExecutorGone,
    ExecutorStuck,
    b64_size,
    executor_lost_result,
)
from agentrl.sandbox.result import ExecResult

AGENT_UID = 1000
BASE_ENV = {
    "PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
    "HOME": "/work",
    "LANG": "C.UTF-8",
    "TMPDIR": "/tmp",
    "PYTHONDONTWRITEBYTECODE": "1",
}
DEFAULT_READ_LIMIT = 16 * 1024 * 1024
_FILE_OP_TIMEOUT = 60.0
# A reset takes milliseconds; one that does not answer (an executor a leftover SIGSTOPped) gets the
# sandbox replaced instead of holding the pool.
_RESET_TIMEOUT = 10.0
# Every place besides the work dir a command can write, with its mode; reset empties them all and
# restores the modes (tests/sandbox/test_isolation.py proves it).
WRITABLE_DIRS = {"/tmp": 0o1777, "/dev/shm": 0o1777, "/dev/mqueue": 0o1777}
WORKDIR_MODE = 0o755
# The health probe creates and removes a file in the work dir as the agent: a sandbox whose work dir a
# previous episode made unusable (chmod 000) fails it.
_PROBE = ("import os\nfd = os.open('.agentrl-probe', os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600)\n"
          "os.close(fd)\nos.unlink('.agentrl-probe')\nprint('ok')\n")


class ExecutorSandbox(Sandbox):
    """Shared implementation; subclasses implement ``start``/``close`` plus the three hooks below."""

    def __init__(self, limits=None):
        super().__init__(limits)
        self._executor: ExecutorClient | None = None
        self._lock = threading.RLock()  # one operation at a time per sandbox
        self._closed = False
        self._gone_reason: str | None = None

    # ---- backend hooks ------------------------------------------------------------------------
    @abc.abstractmethod
    def _launch_executor(self) -> ExecutorClient:
        """Start a fresh executor inside the sandbox (as the agent uid) and return a client for it."""

    @abc.abstractmethod
    def _force_kill_processes(self) -> None:
        """Kill every agent process, the executor included, without its help."""

    @abc.abstractmethod
    def _runtime_alive(self) -> bool:
        """Whether the container / namespace that holds the work dir still exists."""

    # ---- executor plumbing ------------------------------------------------------------------
    def _client(self) -> ExecutorClient:
        if self._closed:
            raise SandboxError("sandbox is closed")
        if self._executor is None or self._executor.broken:
            if self._executor is not None:
                self._executor.close()
                self._executor = None
            if not self._runtime_alive():
                self._gone_reason = "sandbox container is no longer running"
                raise SandboxError(self._gone_reason)
            self._executor = self._launch_executor()
            self._executor.call({"op": "ping"}, 30.0)
        return self._executor

    def _drop_executor(self) -> None:
        if self._executor is not None:
            self._executor.close()
            self._executor = None

    @property
    def alive(self) -> bool:
        return not self._closed and self._gone_reason is None and self._runtime_alive()

    def healthy(self) -> bool:
        """The runtime exists, the executor answers (relaunched if it had died) and a command run as the
        agent can create and remove a file in the work dir. No process of the agent can answer for
        the executor, so a leftover cannot fake this."""
        if self._closed or self._gone_reason is not None:
            return False
        try:
            with self._lock:
                self._client()
                res = self._exec([self.python, "-c", "<probe>"], timeout=10.0, stdin=None, env=None,
                                 python_code=_PROBE, private=True)
        except Exception:
            self._drop_executor()
            return False
        return res.exit_code == 0 and res.stdout == "ok\n"

    def run_python(self, code: str, *, timeout: float, stdin: str | bytes | None = None,
                   fresh_interpreter: bool = False) -> ExecResult:
        """Run Python code. By default in a fork of the executor's zygote, an already started interpreter
        that never held an episode's bytes (~1-3 ms to start instead of ~20 ms; same isolation, limits,
        timeout and output cap; the only visible difference is a few stdlib modules already imported). ``fresh_interpreter=True`` runs
        ``python3 -c`` instead."""
        if fresh_interpreter:
            return super().run_python(code, timeout=timeout, stdin=stdin)
        if not timeout or timeout <= 0:
            raise ValueError(f"timeout must be a positive number of seconds, got {timeout!r}")
        data = stdin.encode() if isinstance(stdin, str) else stdin
        self.start()
        self.exec_count += 1
        return self._exec([self.python, "-c", "<forked>"], timeout=float(timeout), stdin=data, env=None,
                          python_code=code)

    def _exec(self, argv: list[str], *, timeout: float, stdin: bytes | None,
              env: Mapping[str, str] | None, python_code: str | None = None, private: bool = False) -> ExecResult:
        started = time.monotonic()
        with self._lock:
            try:
                client = self._client()
            except (SandboxError, ExecutorError) as exc:
                self._drop_executor()
                return ExecResult(exit_code=-1, stdout="", stderr=f"sandbox: {exc}\n", timed_out=False,
                                  oom_killed=False, duration_s=time.monotonic() - started, truncated=False)
            try:
                return client.run(argv, timeout=timeout, stdin=stdin, env={**BASE_ENV, **(env or {})},
                                  cwd=self.workdir, limit=self.limits.output_limit, python_code=python_code,
                                  private=private)
            except ExecutorGone:
                # The command killed every process of the agent uid, the executor included; the
                # container survives (its keep-alive runs as another uid) and the next call relaunches.
                self._drop_executor()
                if not self._runtime_alive():
                    self._gone_reason = "sandbox container is no longer running"
                    return ExecResult(exit_code=-1, stdout="", stderr=f"sandbox: {self._gone_reason}\n",
                                      timed_out=False, oom_killed=False,
                                      duration_s=time.monotonic() - started, truncated=False)
                return executor_lost_result(started, timed_out=False,
                                            why="the command killed the sandbox executor")
            except ExecutorStuck:
                self._force_kill_processes()
                self._drop_executor()
                return executor_lost_result(started, timed_out=True,
                                            why="no answer within timeout + grace; every process was killed")
            except ExecutorError as exc:  # a reply that broke the protocol, or a refused request
                self._drop_executor()
                return executor_lost_result(started, timed_out=False, why=f"executor failed: {exc}")

    def _call(self, request: dict, timeout: float = _FILE_OP_TIMEOUT, max_reply: int = 64 * 1024) -> dict:
        with self._lock:
            self.start()
            try:
                return self._client().call(request, timeout, max_reply=max_reply)
            except ExecutorError as exc:
                if not self._executor or self._executor.broken:
                    self._drop_executor()
                raise SandboxError(f"sandbox executor failed during {request['op']}: {exc}") from exc

    def write_files(self, files: Mapping[str, str | bytes], *, mode: int = 0o644) -> None:
        entries = []
        for path, content in files.items():
            rel = work_path(self.workdir, path)
            data = content.encode() if isinstance(content, str) else bytes(content)
            entries.append([f"{self.workdir}/{rel}", base64.b64encode(data).decode(), mode])
        if entries:
            try:
                self._call({"op": "write", "files": entries})
            except SandboxError as exc:
                raise SandboxError(f"write_files failed: {exc}") from exc

    def read_file(self, path: str, *, max_bytes: int | None = None) -> bytes:
        rel = work_path(self.workdir, path)
        limit = DEFAULT_READ_LIMIT if max_bytes is None else int(max_bytes)
        if limit < 0:
            raise ValueError(f"max_bytes must be >= 0, got {max_bytes}")
        msg = self._call({"op": "read", "path": f"{self.workdir}/{rel}", "max_bytes": limit},
                         max_reply=b64_size(limit) + 1024)
        if msg.get("missing"):
            raise FileNotFoundError(f"{path} does not exist in the sandbox")
        if msg.get("isdir"):
            raise IsADirectoryError(f"{path} is a directory")
        if msg.get("denied"):
            raise PermissionError(f"{path} is not readable by the sandbox user")
        if msg.get("special"):
            raise SpecialFileError(f"{path} is a link, FIFO or socket, not a regular file")
        if not isinstance(msg.get("data"), str):
            raise SandboxError(f"bad read reply for {path}")
        return base64.b64decode(msg["data"])[:limit]

    def reset(self) -> None:
        """Kill every agent process, remove its SysV IPC objects, empty the work dir and every other
        writable place (/tmp, /dev/shm, /dev/mqueue) and give the work dir back its mode; SandboxError
        when any of it could not be done (the pool then replaces the sandbox)."""
        paths = [[self.workdir, WORKDIR_MODE], *([d, m] for d, m in WRITABLE_DIRS.items())]
        msg = self._call({"op": "reset", "paths": paths}, _RESET_TIMEOUT)
        if msg.get("ok") is not True:
            raise SandboxError(f"reset failed: {msg.get('why')}")
        self.exec_count = 0
