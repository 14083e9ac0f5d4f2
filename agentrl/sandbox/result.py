"""What one command run in a sandbox produced, and the per-stream output cap that keeps it small."""

from __future__ import annotations

from dataclasses import dataclass

DEFAULT_OUTPUT_LIMIT = 64 * 1024


@dataclass(frozen=True)
class ExecResult:
    """Outcome of one command.

    ``exit_code`` is the command's status (128+N when killed by signal N; -1 when the sandbox itself
    died). ``timed_out`` means the timeout killed it, ``oom_killed`` that the kernel's OOM killer did.
    ``truncated`` is True when either stream produced more than the output cap; the kept bytes are the
    first ``output_limit`` of each stream, decoded as UTF-8 with replacement.
    """

    exit_code: int
    stdout: str
    stderr: str
    timed_out: bool
    oom_killed: bool
    duration_s: float
    truncated: bool

    @property
    def ok(self) -> bool:
        """The command ran to completion with status 0."""
        return self.exit_code == 0 and not self.timed_out and not self.oom_killed


class CappedOutput:
    """Collects one stream, keeping the first ``limit`` bytes and counting (not storing) the rest."""

    __slots__ = ("limit", "_chunks", "_kept", "total")

    def __init__(self, limit: int = DEFAULT_OUTPUT_LIMIT):
        if limit < 0:
            raise ValueError(f"output limit must be >= 0, got {limit}")
        self.limit = limit
        self._chunks: list[bytes] = []
        self._kept = 0
        self.total = 0

    def add(self, data: bytes) -> None:
        self.total += len(data)
        room = self.limit - self._kept
        if room > 0:
            piece = data[:room]
            self._chunks.append(piece)
            self._kept += len(piece)

    @property
    def truncated(self) -> bool:
        return self.total > self.limit

    def text(self) -> str:
        return b"".join(self._chunks).decode("utf-8", errors="replace")
