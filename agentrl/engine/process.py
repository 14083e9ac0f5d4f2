"""Server child processes that never outlive the process that started them, with logs where the run wants.

Every server agentrl starts (embedded engine, real SGLang, the smg router) goes through
:func:`start_tied_process`: its own session (so a stop signals the server and every child it forked) and,
on Linux, ``PR_SET_PDEATHSIG=SIGKILL`` (so it dies even when its parent is SIGKILLed and no cleanup
runs). The kernel sends that signal when the *thread* that started the child exits, so start servers from
a thread that lives as long as they should (the main thread, an actor's thread).
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from types import FrameType

_PR_SET_PDEATHSIG = 1
# Resolved here, in the parent: the child between fork and exec should do as little as possible.
_prctl = ctypes.CDLL(None, use_errno=True).prctl if sys.platform.startswith("linux") else None


def log_file(log_dir: str | Path | None, name: str) -> Path:
    """``log_dir/name`` (``log_dir`` created if needed), or a fresh temp file ``agentrl-<name stem>-*.log``."""
    if log_dir is not None:
        path = Path(log_dir)
        path.mkdir(parents=True, exist_ok=True)
        return path / name
    fd, tmp = tempfile.mkstemp(prefix=f"agentrl-{Path(name).stem}-", suffix=".log")
    os.close(fd)
    return Path(tmp)


def _die_with(parent_pid: int) -> Callable[[], None]:
    def preexec() -> None:  # in the child, after fork (and after setsid), before exec
        if _prctl is not None and _prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0) != 0:
            os._exit(126)  # could not tie the child to its parent: refuse to run untied
        if os.getppid() != parent_pid:  # the parent died before prctl took effect
            os._exit(126)

    return preexec


def start_tied_process(command: Sequence[str], *, log_path: str | Path,
                       env: Mapping[str, str] | None = None) -> subprocess.Popen[bytes]:
    """Start ``command`` in its own session, stdout and stderr appended to ``log_path``; the kernel SIGKILLs
    it when the calling thread exits (so whenever this process dies). ``env`` replaces the environment."""
    with open(log_path, "ab") as log:  # the child keeps its own descriptor
        return subprocess.Popen(
            list(command), stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            env=None if env is None else dict(env), start_new_session=True, preexec_fn=_die_with(os.getpid()),
        )


def signal_group(proc: subprocess.Popen, sig: int) -> None:
    """Send ``sig`` to ``proc``'s process group (its session, see :func:`start_tied_process`), if any is left."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, sig)


def _exited(proc: subprocess.Popen, timeout: float) -> bool:
    """Wait up to ``timeout`` s for ``proc`` to exit *without reaping it*: while it is a zombie its pid,
    and so its process-group id, cannot be reused, so a later ``killpg`` reaches only its own group."""
    deadline = time.monotonic() + timeout
    while True:
        if proc.returncode is not None:
            return True
        try:
            if os.waitid(os.P_PID, proc.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None:
                return True
        except ChildProcessError:  # reaped elsewhere
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.02)


def stop_process_group(proc: subprocess.Popen | None,
                       steps: Sequence[tuple[int, float]] = ((signal.SIGTERM, 10.0),)) -> None:
    """Signal ``proc``'s group with each ``(signal, seconds to wait)`` in turn until ``proc`` exits, then
    SIGKILL whatever is left in the group (children of the server) and reap ``proc``. Idempotent."""
    if proc is None:
        return
    for sig, wait_s in steps:
        if _exited(proc, 0):
            break
        signal_group(proc, sig)
        if _exited(proc, wait_s):
            break
    else:
        if not _exited(proc, 0):
            signal_group(proc, signal.SIGKILL)
            _exited(proc, 10.0)
    signal_group(proc, signal.SIGKILL)  # stragglers; the leader is a zombie at most, so the group is ours
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=10.0)


def exit_on_sigterm() -> None:
    """Make SIGTERM raise ``SystemExit(143)`` in the main thread, so ``with`` blocks and ``finally`` clauses
    (e.g. :meth:`agentrl.rollout.manager.RolloutManager.shutdown`) run as they do on Ctrl-C. Call it from
    the main thread."""

    def handler(signum: int, frame: FrameType | None) -> None:
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, handler)
