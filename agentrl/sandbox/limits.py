"""Resource limits shared by every sandbox backend."""

from __future__ import annotations

import re
from dataclasses import dataclass

from agentrl.sandbox.result import DEFAULT_OUTPUT_LIMIT

_SIZE = re.compile(r"^\s*(\d+)\s*([kmg]?)b?\s*$", re.I)
_UNIT = {"": 1, "k": 1024, "m": 1024**2, "g": 1024**3}


def parse_size(value: str | int) -> int:
    """'512m' / '64k' / 1048576 -> bytes; raises ValueError on anything else."""
    if isinstance(value, int) and not isinstance(value, bool):
        if value <= 0:
            raise ValueError(f"size must be positive, got {value}")
        return value
    m = _SIZE.match(str(value))
    if not m or int(m.group(1)) <= 0:
        raise ValueError(f"bad size {value!r}: expected e.g. 512m, 64k, 1g or a positive byte count")
    return int(m.group(1)) * _UNIT[m.group(2).lower()]


@dataclass(frozen=True)
class SandboxLimits:
    """Per-sandbox limits. Sizes accept '512m'-style strings or byte counts.

    ``memory`` caps RAM and swap together (no swap); ``work_size`` and ``tmp_size`` are the tmpfs sizes
    of the work dir and /tmp (their pages count against ``memory`` too); ``output_limit`` is the number
    of bytes kept per stream of each command.
    """

    memory: str | int = "512m"
    cpus: float = 1.0
    pids: int = 64
    work_size: str | int = "64m"
    tmp_size: str | int = "16m"
    output_limit: int = DEFAULT_OUTPUT_LIMIT

    def __post_init__(self) -> None:
        for name in ("memory", "work_size", "tmp_size"):
            parse_size(getattr(self, name))
        if not self.cpus > 0:
            raise ValueError(f"cpus must be > 0, got {self.cpus}")
        if self.pids < 8:
            raise ValueError(f"pids must be >= 8 (the shell, timeout and the command need some), got {self.pids}")
        if self.output_limit < 0:
            raise ValueError(f"output_limit must be >= 0, got {self.output_limit}")

    @property
    def memory_bytes(self) -> int:
        return parse_size(self.memory)

    @property
    def work_bytes(self) -> int:
        return parse_size(self.work_size)

    @property
    def tmp_bytes(self) -> int:
        return parse_size(self.tmp_size)
