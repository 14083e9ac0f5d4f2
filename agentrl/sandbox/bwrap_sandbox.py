"""A sandbox in bubblewrap namespaces, for machines without a reachable Docker engine.

Same interface and executor as :class:`DockerSandbox`. The executor runs as PID 1 of a fresh
user/pid/net/ipc/uts/cgroup namespace set (``--as-pid-1``: a command's ``kill -9 -1``, ``kill -9 1`` or
SIGSTOP cannot reach it), as uid 1000 with no capabilities, non-dumpable (its fds are out of reach).
That uid is an unprivileged host uid (nobody when the caller is root), never host root; bwrap's
stderr is a pipe to the host, not a host file. The host's /usr is bind-mounted read-only, /work, /tmp
and /dev/shm are size-limited tmpfs, /dev holds only the standard nodes and is read-only, there is
no network, and the seccomp filter of :mod:`agentrl.sandbox.seccomp` is on. Without libseccomp the
backend refuses to start unless ``allow_unconfined=True`` (and says so). Memory/pids/CPU limits come
from a per-sandbox cgroup when cgroups are writable (a warning is logged otherwise). Difference from
Docker: the image is the host's /usr (``image`` is not used), and if the executor itself dies
(OOM-killed, or stuck past the grace period) the namespace and its tmpfs work dir go with it.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import subprocess
import sys
import uuid
from collections.abc import Mapping
from pathlib import Path

from agentrl.sandbox.base import SandboxError, work_path
from agentrl.sandbox.cgroups import SandboxCgroup
from agentrl.sandbox.executor_client import EXECUTOR_SOURCE, ExecutorClient, PipeTransport
from agentrl.sandbox.executor_sandbox import AGENT_UID, BASE_ENV, ExecutorSandbox
from agentrl.sandbox.host_files import read_regular_file
from agentrl.sandbox.labels import sandbox_labels
from agentrl.sandbox.limits import SandboxLimits
from agentrl.sandbox.registry import track, untrack
from agentrl.sandbox.seccomp import filter_program, seccomp_problem

log = logging.getLogger(__name__)

BWRAP_ROOT = Path("/tmp/agentrl-bwrap")
_OWNER_FILE = "owner.json"
# Enter the cgroups first (that needs root), then drop to the unprivileged host uid the sandbox maps
# to, then become bwrap: every process of the sandbox starts inside the cgroups and off host root.
_LAUNCH = """
import os, sys
for f in os.environ["AGENTRL_CGROUP_PROCS"].split():
    with open(f, "w") as fh:
        fh.write(str(os.getpid()))
uid = int(os.environ["AGENTRL_HOST_UID"])
if os.geteuid() != uid:
    os.setgroups([])
    os.setresgid(uid, uid, uid)
    os.setresuid(uid, uid, uid)
os.execvp(sys.argv[1], sys.argv[1:])
"""
UNPRIVILEGED_HOST_UID = 65534  # what the sandbox uid maps to when the caller is root


def host_uid() -> int:
    """The host uid bubblewrap runs as: the caller's own, or nobody instead of root."""
    return UNPRIVILEGED_HOST_UID if os.geteuid() == 0 else os.geteuid()


def bwrap_available() -> bool:
    """True when ``bwrap`` is installed and can create the namespaces this backend needs."""
    exe = shutil.which("bwrap")
    if exe is None:
        return False
    probe = subprocess.run([exe, "--unshare-all", "--ro-bind", "/usr", "/usr", "--symlink", "usr/bin", "/bin",
                            "--symlink", "usr/lib", "/lib", "--symlink", "usr/lib64", "/lib64", "--",
                            "/usr/bin/true"], capture_output=True, timeout=30)
    return probe.returncode == 0


def read_owner_labels(directory: Path) -> dict[str, str]:
    try:
        return json.loads((directory / _OWNER_FILE).read_text())
    except (OSError, ValueError):
        return {}


def remove_bwrap_dir(directory: Path) -> None:
    """Kill what is left of a bubblewrap sandbox (every process in its cgroups) and delete its files."""
    SandboxCgroup.existing(directory.name).remove()
    shutil.rmtree(directory, ignore_errors=True)


class BwrapSandbox(ExecutorSandbox):
    """One bubblewrap namespace set. ``with BwrapSandbox() as sb: sb.exec("ls", timeout=5)``."""

    def __init__(self, *, limits: SandboxLimits | None = None, labels: Mapping[str, str] | None = None,
                 role: str = "sandbox", read_only_mounts: Mapping[str, str] | None = None,
                 python: str = "/usr/bin/python3", image: str | None = None, allow_unconfined: bool = False):
        super().__init__(limits)
        self.allow_unconfined = allow_unconfined
        if image is not None:
            log.warning("BwrapSandbox ignores image=%r: it runs on the host's read-only /usr", image)
        self.python = python
        self.name = f"agentrl-bw-{uuid.uuid4().hex[:12]}"
        self.dir = BWRAP_ROOT / self.name
        self._labels = sandbox_labels(role, dict(labels or {}))
        self._ro_mounts = dict(read_only_mounts or {})
        self._cgroup = SandboxCgroup(self.name, self.limits)
        self._proc: subprocess.Popen | None = None
        self._child_pid: int | None = None  # the executor, PID 1 inside, as the host numbers it
        self._started = False
        self.limited = False  # whether cgroup limits are in force

    def start(self) -> None:
        with self._lock:
            if self._started:
                return
            if self._closed:
                raise SandboxError("sandbox is closed")
            if shutil.which("bwrap") is None:
                raise SandboxError("bubblewrap is not installed (apt-get install bubblewrap)")
            problem = seccomp_problem()
            if problem and not self.allow_unconfined:
                raise SandboxError(f"bubblewrap sandbox refused: no seccomp filter ({problem}); pass "
                                   "allow_unconfined=True to run without one")
            if problem:
                log.warning("bubblewrap sandbox %s runs WITHOUT seccomp: %s", self.name, problem)
            self.dir.mkdir(parents=True, exist_ok=True)
            (self.dir / _OWNER_FILE).write_text(json.dumps(self._labels))
            track(self)
            self.limited = self._cgroup.create()
            self._started = True
            try:
                self._executor = self._launch_executor()
                self._executor.call({"op": "ping"}, 30.0)
            except Exception as exc:
                self.close()
                raise SandboxError(f"could not start bubblewrap: {exc}; stderr: {self._stderr_tail()}") from exc

    def _stderr_tail(self) -> str:
        proc = self._proc
        if proc is None or proc.stderr is None:
            return ""
        with contextlib.suppress(OSError, TypeError):
            os.set_blocking(proc.stderr.fileno(), False)
            return (proc.stderr.read(4096) or b"").decode(errors="replace")
        return ""

    def _bwrap_argv(self, seccomp_fd: int | None, info_fd: int) -> list[str]:
        lim = self.limits
        argv = ["bwrap", "--unshare-all", "--new-session", "--as-pid-1", "--hostname", "sandbox",
                "--uid", str(AGENT_UID), "--gid", str(AGENT_UID), "--cap-drop", "ALL", "--clearenv",
                "--ro-bind", "/usr", "/usr"]
        for link in ("bin", "lib", "lib64", "sbin"):
            if Path("/usr", link).exists():
                argv += ["--symlink", f"usr/{link}", f"/{link}"]
        for etc in ("/etc/alternatives", "/etc/ld.so.cache", "/etc/localtime"):
            if Path(etc).exists():
                argv += ["--ro-bind", etc, etc]
        argv += ["--proc", "/proc", "--dev", "/dev",
                 "--size", str(lim.tmp_bytes), "--perms", "1777", "--tmpfs", "/dev/shm", "--mqueue", "/dev/mqueue",
                 "--remount-ro", "/dev",  # only the standard nodes, no writable tmpfs of half the RAM
                 "--size", str(lim.tmp_bytes), "--perms", "1777", "--tmpfs", "/tmp",
                 "--size", str(lim.work_bytes), "--perms", "0755", "--tmpfs", "/work", "--chdir", "/work"]
        if self._cgroup.oom_file:
            argv += ["--ro-bind", self._cgroup.oom_file, "/run/agentrl/oom_control"]
        for target, source in self._ro_mounts.items():
            argv += ["--ro-bind", source, target]
        argv += ["--remount-ro", "/"]  # the root tmpfs bwrap builds: only /work and /tmp stay writable
        for key, value in BASE_ENV.items():
            argv += ["--setenv", key, value]
        if seccomp_fd is not None:
            argv += ["--seccomp", str(seccomp_fd)]
        argv += ["--info-fd", str(info_fd)]
        return [*argv, "--", self.python, "-c", EXECUTOR_SOURCE, "--contained"]

    def _launch_executor(self) -> ExecutorClient:
        if self._proc is not None:
            self._kill_proc()
        env = {"PATH": BASE_ENV["PATH"], "AGENTRL_CGROUP_PROCS": " ".join(self._cgroup.procs_files),
               "AGENTRL_HOST_UID": str(host_uid())}
        seccomp_fd = None
        if seccomp_problem() is None:
            seccomp_fd = os.memfd_create("agentrl-seccomp", 0)
            os.write(seccomp_fd, filter_program())
            os.lseek(seccomp_fd, 0, os.SEEK_SET)
        info_r, info_w = os.pipe()
        fds = (info_w,) if seccomp_fd is None else (info_w, seccomp_fd)
        try:
            self._proc = subprocess.Popen([sys.executable, "-c", _LAUNCH, *self._bwrap_argv(seccomp_fd, info_w)],
                                          stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                          env=env, start_new_session=True, pass_fds=fds)
        finally:
            for fd in fds:
                os.close(fd)
        with os.fdopen(info_r, "rb") as info:
            # bwrap writes the JSON once its child exists and closes the fd; EOF alone means it failed.
            raw = info.read(65536)
        try:
            self._child_pid = int(json.loads(raw)["child-pid"])
        except (ValueError, KeyError, TypeError):
            self._child_pid = None
        return ExecutorClient(PipeTransport(self._proc))

    def export_file(self, path: str, *, max_bytes: int) -> bytes:
        """The file read by the host through the executor's root, one component at a time without
        following links (absolute links there would resolve against the host's root)."""
        parts = work_path(self.workdir, path).split("/")
        if self._child_pid is None or not self._runtime_alive():
            raise SandboxError("sandbox is not running")
        return read_regular_file(f"/proc/{self._child_pid}/root{self.workdir}", parts, max_bytes=max_bytes,
                                 path=path)

    def _kill_proc(self) -> None:
        proc, self._proc = self._proc, None
        if proc is None:
            return
        with contextlib.suppress(OSError):
            proc.kill()
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=10)
        for stream in (proc.stdin, proc.stdout, proc.stderr):
            with contextlib.suppress(OSError, AttributeError):
                stream.close()

    def _force_kill_processes(self) -> None:
        self._kill_proc()
        self._cgroup.kill_all()

    def _runtime_alive(self) -> bool:
        return self._started and not self._closed

    def close(self) -> None:
        with self._lock:
            if self._closed and not self._started:
                return
            self._closed = True
            self._drop_executor()
            self._kill_proc()
            self._cgroup.remove()
            shutil.rmtree(self.dir, ignore_errors=True)
            self._started = False
            untrack(self)

    def __repr__(self) -> str:
        return f"BwrapSandbox({self.name})"
