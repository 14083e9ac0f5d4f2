"""The interface every sandbox backend implements, with its async counterparts.

A sandbox is one isolated place where an episode's commands run: a work dir (``workdir``, the cwd of
every command) that persists between commands, no network, capped memory/CPU/processes, a non-root user.
Backends implement the five blocking primitives; everything else (python helper, async, context
managers) lives here once.
"""

from __future__ import annotations

import abc
import posixpath
from collections.abc import Mapping, Sequence

from agentrl.sandbox.blocking import run_blocking
from agentrl.sandbox.limits import SandboxLimits
from agentrl.sandbox.result import ExecResult

Command = str | Sequence[str]
# Code longer than this goes through a file instead of `python3 -c` (Linux caps one argv string at 128 KiB).
_MAX_INLINE_CODE = 96 * 1024


class SandboxError(RuntimeError):
    """The sandbox could not be created or used (engine unreachable, image missing, container gone)."""


class SpecialFileError(OSError):
    """The path names a symlink, FIFO, socket or device, not a regular file."""


class Sandbox(abc.ABC):
    """Base class: backends implement ``start``, ``close``, ``_exec``, ``write_files``, ``read_file``,
    ``reset`` and ``alive``; ``healthy`` runs ``echo ok``."""

    workdir: str = "/work"
    python: str = "python3"

    def __init__(self, limits: SandboxLimits | None = None):
        self.limits = limits or SandboxLimits()
        self.exec_count = 0

    # ---- backend primitives -------------------------------------------------------------------
    @abc.abstractmethod
    def start(self) -> None:
        """Create the isolated environment; a no-op when already started."""

    @abc.abstractmethod
    def close(self) -> None:
        """Destroy it and everything in it; safe to call twice."""

    @abc.abstractmethod
    def _exec(self, argv: list[str], *, timeout: float, stdin: bytes | None,
              env: Mapping[str, str] | None) -> ExecResult:
        """Run argv in the work dir under the limits; never raises for a failing/hostile command."""

    @abc.abstractmethod
    def write_files(self, files: Mapping[str, str | bytes], *, mode: int = 0o644) -> None:
        """Write files (paths relative to the work dir; parents created)."""

    @abc.abstractmethod
    def read_file(self, path: str, *, max_bytes: int | None = None) -> bytes:
        """Return a file's bytes (at most ``max_bytes``); FileNotFoundError when absent."""

    @abc.abstractmethod
    def reset(self) -> None:
        """Kill every process of the previous user and empty every place it could write."""

    def export_file(self, path: str, *, max_bytes: int) -> bytes:
        """A regular file's bytes, read without the sandbox's own server (by the engine or the host):
        what graders use. SpecialFileError for a link, FIFO or socket; ValueError when larger than
        ``max_bytes``; FileNotFoundError / IsADirectoryError as for ``read_file``."""
        raise NotImplementedError(f"{type(self).__name__} cannot export files without its own server")

    @property
    @abc.abstractmethod
    def alive(self) -> bool:
        """Whether the sandbox can still run commands."""

    # ---- shared behaviour ---------------------------------------------------------------------
    def exec(self, cmd: Command, *, timeout: float, stdin: str | bytes | None = None,
             env: Mapping[str, str] | None = None) -> ExecResult:
        """Run ``cmd`` (a shell string, or an argv list run without a shell) with a hard timeout in
        seconds; ``stdin`` is fed to it and then closed."""
        argv = as_argv(cmd)
        if not timeout or timeout <= 0:
            raise ValueError(f"timeout must be a positive number of seconds, got {timeout!r}")
        data = stdin.encode() if isinstance(stdin, str) else stdin
        self.start()
        self.exec_count += 1
        return self._exec(argv, timeout=float(timeout), stdin=data, env=env)

    def run_python(self, code: str, *, timeout: float, stdin: str | bytes | None = None) -> ExecResult:
        """Run a Python program with the sandbox's python3."""
        if len(code.encode()) <= _MAX_INLINE_CODE:
            return self.exec([self.python, "-c", code], timeout=timeout, stdin=stdin)
        name = ".agentrl_run.py"
        self.write_files({name: code})
        return self.exec([self.python, name], timeout=timeout, stdin=stdin)

    def healthy(self) -> bool:
        """True when the sandbox runs a trivial command correctly."""
        if not self.alive:
            return False
        try:
            res = self.exec(["echo", "ok"], timeout=10)
        except Exception:
            return False
        return res.exit_code == 0 and res.stdout == "ok\n"

    def __enter__(self):
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ---- async counterparts (run in the bounded sandbox thread pool) ---------------------------
    async def astart(self) -> None:
        await run_blocking(self.start)

    async def aclose(self) -> None:
        await run_blocking(self.close)

    async def aexec(self, cmd: Command, *, timeout: float, stdin: str | bytes | None = None,
                    env: Mapping[str, str] | None = None) -> ExecResult:
        return await run_blocking(self.exec, cmd, timeout=timeout, stdin=stdin, env=env)

    async def arun_python(self, code: str, *, timeout: float, stdin: str | bytes | None = None) -> ExecResult:
        return await run_blocking(self.run_python, code, timeout=timeout, stdin=stdin)

    async def awrite_files(self, files: Mapping[str, str | bytes], *, mode: int = 0o644) -> None:
        await run_blocking(self.write_files, files, mode=mode)

    async def aread_file(self, path: str, *, max_bytes: int | None = None) -> bytes:
        return await run_blocking(self.read_file, path, max_bytes=max_bytes)

    async def areset(self) -> None:
        await run_blocking(self.reset)

    async def __aenter__(self):
        await self.astart()
        return self

    async def __aexit__(self, *exc) -> None:
        await self.aclose()


def as_argv(cmd: Command) -> list[str]:
    """A shell string becomes ``sh -c``; a sequence is used as argv. Rejects empty commands."""
    if isinstance(cmd, str):
        if not cmd.strip():
            raise ValueError("empty command")
        return ["sh", "-c", cmd]
    argv = [str(a) for a in cmd]
    if not argv or not argv[0]:
        raise ValueError(f"empty argv: {cmd!r}")
    if any("\0" in a for a in argv):
        raise ValueError("NUL byte in a command argument")
    return argv


def work_path(workdir: str, path: str) -> str:
    """Resolve ``path`` (relative, or absolute inside ``workdir``) to a normalised path relative to
    ``workdir``; ValueError for anything that would land outside it."""
    if not isinstance(path, str) or not path or "\0" in path:
        raise ValueError(f"bad file path {path!r}")
    full = posixpath.normpath(posixpath.join(workdir, path))
    root = workdir.rstrip("/")
    if full == root or not full.startswith(root + "/"):
        raise ValueError(f"path {path!r} is outside the sandbox work dir {workdir}")
    return full[len(root) + 1:]
