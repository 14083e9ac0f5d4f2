"""A sandbox in bubblewrap namespaces, for machines without a reachable Docker engine.

Same interface and executor as :class:`DockerSandbox`. The executor runs as PID 1 of a fresh
user/pid/net/ipc/uts/cgroup namespace set (``--as-pid-1``: a command's ``kill -9 -1`` or ``kill -9 1``
cannot reach it), as uid 1000 with no capabilities; the host's /usr is bind-mounted read-only, /work and
/tmp are size-limited tmpfs, there is no network. Memory/pids/CPU limits come from a per-sandbox cgroup
when cgroups are writable (a warning is logged otherwise). Difference from Docker: the image is the
host's /usr (``image`` is not used), and if the executor itself dies (OOM-killed, or stuck past the
grace period) the namespace and its tmpfs work dir go with it; the next command starts a fresh one.
"""

from __future__ import annotations

import contextlib
import json
import logging
import shutil
import subprocess
import uuid
from collections.abc import Mapping
from pathlib import Path

from agentrl.sandbox.base import SandboxError
from agentrl.sandbox.cgroups import SandboxCgroup
from agentrl.sandbox.executor_client import EXECUTOR_SOURCE, ExecutorClient, PipeTransport
from agentrl.sandbox.executor_sandbox import AGENT_UID, BASE_ENV, ExecutorSandbox
from agentrl.sandbox.labels import sandbox_labels
from agentrl.sandbox.limits import SandboxLimits
from agentrl.sandbox.registry import track, untrack

log = logging.getLogger(__name__)

BWRAP_ROOT = Path("/tmp/agentrl-bwrap")
_OWNER_FILE = "owner.json"
# Enter the cgroups first, then become bwrap, so every process of the sandbox starts inside them.
_ENTER_CGROUPS = 'for f in $AGENTRL_CGROUP_PROCS; do echo $$ > "$f" || exit 99; done; exec "$@"'


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
                 python: str = "/usr/bin/python3", image: str | None = None):
        super().__init__(limits)
        if image is not None:
            log.warning("BwrapSandbox ignores image=%r: it runs on the host's read-only /usr", image)
        self.python = python
        self.name = f"agentrl-bw-{uuid.uuid4().hex[:12]}"
        self.dir = BWRAP_ROOT / self.name
        self._labels = sandbox_labels(role, dict(labels or {}))
        self._ro_mounts = dict(read_only_mounts or {})
        self._cgroup = SandboxCgroup(self.name, self.limits)
        self._proc: subprocess.Popen | None = None
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
        with contextlib.suppress(OSError):
            return (self.dir / "stderr.log").read_text(errors="replace")[-2000:]
        return ""

    def _bwrap_argv(self) -> list[str]:
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
                 "--size", str(lim.tmp_bytes), "--perms", "1777", "--tmpfs", "/tmp",
                 "--size", str(lim.work_bytes), "--perms", "0755", "--tmpfs", "/work", "--chdir", "/work"]
        if self._cgroup.oom_file:
            argv += ["--ro-bind", self._cgroup.oom_file, "/run/agentrl/oom_control"]
        for target, source in self._ro_mounts.items():
            argv += ["--ro-bind", source, target]
        argv += ["--remount-ro", "/"]  # the root tmpfs bwrap builds: only /work and /tmp stay writable
        for key, value in BASE_ENV.items():
            argv += ["--setenv", key, value]
        return [*argv, "--", self.python, "-c", EXECUTOR_SOURCE]

    def _launch_executor(self) -> ExecutorClient:
        if self._proc is not None:
            self._kill_proc()
        env = {"PATH": BASE_ENV["PATH"], "AGENTRL_CGROUP_PROCS": " ".join(self._cgroup.procs_files)}
        stderr = open(self.dir / "stderr.log", "ab")  # noqa: SIM115 - handed to the child
        try:
            self._proc = subprocess.Popen(["sh", "-c", _ENTER_CGROUPS, "sh", *self._bwrap_argv()],
                                          stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=stderr,
                                          env=env, start_new_session=True)
        finally:
            stderr.close()
        return ExecutorClient(PipeTransport(self._proc))

    def _kill_proc(self) -> None:
        proc, self._proc = self._proc, None
        if proc is None:
            return
        with contextlib.suppress(OSError):
            proc.kill()
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=10)
        for stream in (proc.stdin, proc.stdout):
            with contextlib.suppress(OSError):
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
