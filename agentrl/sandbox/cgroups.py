"""Memory / pids / CPU limits for bubblewrap sandboxes through cgroups (v1 or v2), where writable.

Docker does this itself; bubblewrap does not, so the bwrap backend creates one cgroup per sandbox and
starts bwrap inside it. Pages written to the sandbox's tmpfs count against its memory limit.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import time
from pathlib import Path

from agentrl.sandbox.limits import SandboxLimits

log = logging.getLogger(__name__)

CGROUP_ROOT = Path("/sys/fs/cgroup")
_PERIOD_US = 100_000


class SandboxCgroup:
    """The cgroup directories of one sandbox; ``create`` returns False (and logs) when unavailable."""

    def __init__(self, name: str, limits: SandboxLimits, root: Path = CGROUP_ROOT):
        self.name = name
        self.limits = limits
        self.root = root
        self.dirs: list[Path] = []
        self.version: int | None = None

    @classmethod
    def existing(cls, name: str, root: Path = CGROUP_ROOT) -> SandboxCgroup:
        """The cgroup directories a sandbox called ``name`` left behind (for gc)."""
        cg = cls(name, SandboxLimits(), root)
        candidates = [root / ctrl / "agentrl" / name for ctrl in ("memory", "pids", "cpu")]
        cg.dirs = [d for d in [*candidates, root / "agentrl" / name] if d.is_dir()]
        return cg

    def create(self) -> bool:
        try:
            if (self.root / "cgroup.controllers").exists():
                self._create_v2()
            elif (self.root / "memory").is_dir():
                self._create_v1()
            else:
                raise OSError("no cgroup hierarchy mounted")
        except OSError as exc:
            log.warning("bubblewrap sandbox %s runs WITHOUT memory/pids/cpu limits: cgroups not writable (%s)",
                        self.name, exc)
            self.remove()
            return False
        return True

    def _create_v1(self) -> None:
        lim = self.limits
        mem = self.root / "memory" / "agentrl" / self.name
        mem.mkdir(parents=True)
        self.dirs.append(mem)
        (mem / "memory.limit_in_bytes").write_text(str(lim.memory_bytes))
        memsw = mem / "memory.memsw.limit_in_bytes"
        if memsw.exists():  # only when the kernel accounts swap
            memsw.write_text(str(lim.memory_bytes))
        pids = self.root / "pids" / "agentrl" / self.name
        pids.mkdir(parents=True)
        self.dirs.append(pids)
        (pids / "pids.max").write_text(str(lim.pids))
        cpu = self.root / "cpu" / "agentrl" / self.name
        if (self.root / "cpu").is_dir():
            cpu.mkdir(parents=True)
            self.dirs.append(cpu)
            (cpu / "cpu.cfs_period_us").write_text(str(_PERIOD_US))
            (cpu / "cpu.cfs_quota_us").write_text(str(int(lim.cpus * _PERIOD_US)))
        self.version = 1

    def _create_v2(self) -> None:
        lim = self.limits
        parent = self.root / "agentrl"
        parent.mkdir(exist_ok=True)
        with contextlib.suppress(OSError):
            (parent / "cgroup.subtree_control").write_text("+memory +pids +cpu")
        d = parent / self.name
        d.mkdir()
        self.dirs.append(d)
        (d / "memory.max").write_text(str(lim.memory_bytes))
        with contextlib.suppress(OSError):
            (d / "memory.swap.max").write_text("0")
        (d / "pids.max").write_text(str(lim.pids))
        (d / "cpu.max").write_text(f"{int(lim.cpus * _PERIOD_US)} {_PERIOD_US}")
        self.version = 2

    @property
    def procs_files(self) -> list[str]:
        return [str(d / "cgroup.procs") for d in self.dirs]

    @property
    def oom_file(self) -> str | None:
        """The file whose ``oom_kill N`` line counts OOM kills in this sandbox."""
        if self.version == 1:
            return str(self.dirs[0] / "memory.oom_control")
        if self.version == 2:
            return str(self.dirs[0] / "memory.events")
        return None

    def kill_all(self) -> None:
        for d in self.dirs:
            with contextlib.suppress(OSError, ValueError):
                for pid in (d / "cgroup.procs").read_text().split():
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(int(pid), signal.SIGKILL)

    def remove(self) -> None:
        self.kill_all()
        for d in self.dirs:
            for _ in range(50):  # rmdir fails with EBUSY until the killed processes are reaped
                try:
                    d.rmdir()
                    break
                except FileNotFoundError:
                    break
                except OSError:
                    time.sleep(0.02)
        self.dirs = []
