"""Stop a local Ray cluster whose driver died without ``ray.shutdown()`` (SIGKILL, OOM killer).

``ray.init(address="local")`` starts gcs_server, raylet, dashboard, monitors and the raylet's agents and
workers; none of them notice the driver's death, so a SIGKILLed ``agentrl train`` left them running (with
its engines and trainer ranks). :func:`watch` starts one small process per local cluster, in its own
session (a kill of the driver's process group spares it), that waits for the driver to exit and then stops
every process of *that* Ray session: Ray's programs whose arguments name the session dir, the raylet's
workers and agents (they rename themselves ``ray::...`` but keep their logs open there), and all their
descendants (engines, sandboxes). Other sessions, other users' Ray included, are never touched. After a clean shutdown it finds
nothing and exits.

Run as ``python -m agentrl.run.ray_watchdog DRIVER_PID SESSION_DIR``.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import select
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil

TERM_GRACE_S = 3.0  # SIGTERM first: a raylet stops its workers itself; what remains then gets SIGKILL
KILL_ROUNDS = 20  # a raylet killed mid-spawn may leave a worker that shows up in a later scan


_watchdogs: list[subprocess.Popen] = []  # held, so no ResourceWarning says a running child was dropped


def watch(session_dir: str) -> subprocess.Popen:
    """Start the watchdog of this driver's local Ray session ``session_dir`` (its one line goes to stderr)."""
    proc = subprocess.Popen([sys.executable, "-m", "agentrl.run.ray_watchdog", str(os.getpid()), session_dir],
                            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, start_new_session=True)
    _watchdogs.append(proc)
    return proc


def _ray_package_dir() -> str:
    spec = importlib.util.find_spec("ray")  # found, not imported: the watchdog stays small
    return str(Path(spec.origin).parent) if spec is not None and spec.origin else "/nonexistent/ray"


def _of_session(proc: psutil.Process, session_dir: str, ray_dir: str) -> bool:
    """A Ray service started for ``session_dir`` (Ray's own program, the dir in its arguments) or a worker
    or agent of it (``ray::...``, files open there). A ``tail -f`` of its log is neither."""
    try:
        cmd = proc.cmdline()
        if cmd and cmd[0].startswith("ray::"):
            return any(f.path.startswith(session_dir) for f in proc.open_files())
        return any(a.startswith(ray_dir) for a in cmd[:2]) and any(session_dir in a for a in cmd)
    except psutil.Error:  # gone, or not ours to read: not ours to kill either
        return False


def session_processes(session_dir: str) -> list[psutil.Process]:
    """This user's processes of the Ray session ``session_dir``, with their descendants."""
    me, uid, ray_dir = os.getpid(), os.getuid(), _ray_package_dir()
    found: dict[int, psutil.Process] = {}
    for proc in psutil.process_iter(["uids"]):
        if proc.pid == me or proc.info["uids"] is None or proc.info["uids"].real != uid:
            continue
        if proc.pid not in found and _of_session(proc, session_dir, ray_dir):
            found[proc.pid] = proc
            with contextlib.suppress(psutil.Error):
                found.update((c.pid, c) for c in proc.children(recursive=True) if c.pid != me)
    return list(found.values())


def stop_session(session_dir: str) -> int:
    """SIGTERM every process of the session, SIGKILL what is left after :data:`TERM_GRACE_S`; the count."""
    procs = session_processes(session_dir)
    for proc in procs:
        with contextlib.suppress(psutil.Error):  # exited since the scan
            proc.terminate()
    _, alive = psutil.wait_procs(procs, timeout=TERM_GRACE_S)
    for _ in range(KILL_ROUNDS):
        for proc in alive:
            with contextlib.suppress(psutil.Error):  # exited since the scan
                proc.kill()
        psutil.wait_procs(alive, timeout=0.5)
        alive = session_processes(session_dir)
        if not alive:
            break
    return len(procs)


def _wait_for_exit(pid: int) -> None:
    # A pidfd names this very process (no pid reuse); checked against the parent, which the driver is until
    # it dies, so the pidfd cannot belong to a successor that took a dead driver's pid.
    fd = os.pidfd_open(pid)
    try:
        if os.getppid() == pid:
            select.select([fd], [], [])
    finally:
        os.close(fd)


def main(argv: list[str]) -> int:
    pid, session_dir = int(argv[0]), str(Path(argv[1]).resolve())
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a terminal's Ctrl-C is for the driver; this outlives it
    _wait_for_exit(pid)
    time.sleep(0.5)  # a clean shutdown has just stopped its processes; the rest is what the death left
    stopped = stop_session(session_dir)
    if stopped:
        print(f"agentrl: the driver (pid {pid}) died; stopped {stopped} process(es) of its Ray session {session_dir}",
              file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
