"""Read a run directory: the step files of samples (indexed by byte offset, so a step of 10k samples is
read once and one sample is fetched by a seek), the metrics log and the checkpoint list.

A bad line (a run killed mid-write, a hand-edited file) never hides the rest: it is skipped and reported
as a one-line error naming the file and line.
"""

from __future__ import annotations

import hashlib
import json
import re
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from agentrl.trajectory.sample import Sample

STEP_FILE = re.compile(r"step-(\d+)\.jsonl")


class RunDirError(ValueError):
    """The path is not a run directory, or a file of it cannot be read."""


def total_reward(reward: Any) -> float:
    """A sample's reward as one number: a dict reward (components) counts as the sum of its values."""
    if isinstance(reward, dict):
        return float(sum(reward.values()))
    return float(reward)


def task_key(sample: dict[str, Any]) -> str:
    """Which task a sample answers: a short hash of its first prompt's tokens (same prompt, same task)."""
    prompt = sample["tokens"][: sample["response_start"]]
    return hashlib.sha1(json.dumps(prompt).encode()).hexdigest()[:12]


def _chat_text(messages: list[Any]) -> str:
    return "\n".join(f"{m.get('role', '?')}: {m.get('content', '')}" for m in messages if isinstance(m, dict))


@dataclass(frozen=True)
class SampleSummary:
    """What the list, the filters and the side-by-side need of one sample, without its tokens."""

    index: int
    session_id: str
    group_id: str | None
    reward: float
    status: str
    stop_reason: str | None
    outcomes: tuple[str, ...]
    task: str
    question: str
    tokens: int
    trained: int
    text: str  # the chat, lower-cased, for search

    def public(self) -> dict[str, Any]:
        return {k: v for k, v in self.__dict__.items() if k != "text"}


def summarize(index: int, data: dict[str, Any]) -> SampleSummary:
    """The summary of a sample dict (``Sample.from_dict`` has already accepted it)."""
    meta = data.get("metadata") or {}
    messages = meta.get("messages") or []
    users = [m.get("content", "") for m in messages if isinstance(m, dict) and m.get("role") == "user"]
    return SampleSummary(
        index=index, session_id=str(data.get("session_id", "")),
        group_id=None if data.get("group_id") is None else str(data["group_id"]),
        reward=total_reward(data.get("reward", 0.0)), status=str(data.get("status", "")),
        stop_reason=None if meta.get("stop_reason") is None else str(meta["stop_reason"]),
        outcomes=tuple(str(o) for o in meta.get("outcomes") or ()), task=task_key(data),
        question=str(users[0]) if users else "", tokens=len(data["tokens"]), trained=sum(data["loss_mask"]),
        text=_chat_text(messages).lower())


@dataclass
class StepIndex:
    """One step file read once: a summary and the byte offset of every good line, the errors of the bad."""

    path: Path
    stamp: tuple[int, int]  # (mtime_ns, size): a rewritten file is read again
    summaries: list[SampleSummary] = field(default_factory=list)
    offsets: list[int] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)


def _parse_line(path: Path, number: int, line: bytes) -> dict[str, Any]:
    """One JSONL line as a validated sample dict; a ValueError names the file and the line."""
    try:
        data = json.loads(line)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        reason = "cut short (the run stopped mid-write?)" if not line.endswith(b"\n") else "not JSON"
        raise ValueError(f"{path.name}:{number}: {reason} ({getattr(exc, 'msg', exc)})") from None
    try:
        Sample.from_dict(data)
    except (TypeError, ValueError, KeyError, IndexError) as exc:
        raise ValueError(f"{path.name}:{number}: not a sample ({exc})") from None
    return data


def index_step(path: Path) -> StepIndex:
    stat = path.stat()
    index = StepIndex(path, (stat.st_mtime_ns, stat.st_size))
    offset = 0
    with path.open("rb") as f:
        for number, line in enumerate(f, 1):
            start, offset = offset, offset + len(line)
            if not line.strip():
                continue
            try:
                data = _parse_line(path, number, line)
            except ValueError as exc:
                index.errors.append(str(exc))
                continue
            index.summaries.append(summarize(len(index.offsets), data))
            index.offsets.append(start)
    return index


class RunDir:
    """A run's output directory, read lazily: a step is indexed the first time it is asked for."""

    def __init__(self, root: str | Path) -> None:
        self.root = Path(root)
        if not self.root.is_dir():
            raise RunDirError(f"{self.root}: no such run directory")
        if not any((self.root / name).exists() for name in ("samples", "metrics.jsonl", "checkpoints")):
            raise RunDirError(f"{self.root}: not a run directory (no samples/, metrics.jsonl or checkpoints/)")
        self._indexes: dict[int, StepIndex] = {}
        self._lock = threading.Lock()

    def step_paths(self) -> dict[int, Path]:
        folder = self.root / "samples"
        found = [(STEP_FILE.fullmatch(p.name), p) for p in folder.glob("step-*.jsonl")] if folder.is_dir() else []
        return dict(sorted((int(m.group(1)), p) for m, p in found if m and p.is_file()))

    def steps(self) -> list[int]:
        return list(self.step_paths())

    def index(self, step: int) -> StepIndex:
        """The (cached) index of ``step``'s file; KeyError if the run logged no samples at that step."""
        path = self.step_paths().get(step)
        if path is None:
            raise KeyError(f"no samples for step {step} (steps with samples: {self.steps() or 'none'})")
        stat = path.stat()
        with self._lock:
            cached = self._indexes.get(step)
            if cached is None or cached.stamp != (stat.st_mtime_ns, stat.st_size):
                cached = self._indexes[step] = index_step(path)
        return cached

    def indexed(self, step: int) -> StepIndex | None:
        """The index of ``step`` if it was read already (no file is read here)."""
        with self._lock:
            return self._indexes.get(step)

    def sample(self, step: int, index: int) -> dict[str, Any]:
        """Sample ``index`` (among the step's good lines) as a dict; IndexError if there is none."""
        found = self.index(step)
        if not 0 <= index < len(found.offsets):
            raise IndexError(f"step {step} has {len(found.offsets)} samples; there is no sample {index}")
        with found.path.open("rb") as f:
            f.seek(found.offsets[index])
            return _parse_line(found.path, index + 1, f.readline())

    def metrics(self) -> tuple[list[dict[str, Any]], list[str]]:
        """The rows of metrics.jsonl and a one-line error per line that is not a JSON object."""
        path = self.root / "metrics.jsonl"
        rows: list[dict[str, Any]] = []
        errors: list[str] = []
        if not path.is_file():
            return rows, errors
        for number, line in enumerate(path.read_text(encoding="utf-8", errors="replace").splitlines(), 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                errors.append(f"metrics.jsonl:{number}: not JSON ({exc.msg})")
                continue
            if isinstance(row, dict):
                rows.append(row)
            else:
                errors.append(f"metrics.jsonl:{number}: not a JSON object")
        return rows, errors

    def checkpoints(self) -> dict[str, Any]:
        """The complete ``checkpoints/step-N`` directories and the one ``latest`` points at."""
        folder = self.root / "checkpoints"
        if not folder.is_dir():
            return {"steps": [], "latest": None}
        steps = sorted(int(p.name[5:]) for p in folder.glob("step-*") if p.is_dir() and p.name[5:].isdigit())
        pointer = folder / "latest"
        latest = pointer.read_text(errors="replace").strip() if pointer.is_file() else None
        return {"steps": steps, "latest": latest}

    def tokenizer_dir(self) -> Path | None:
        """A tokenizer the run saved (``hf/final`` or ``hf/best``), to show each token's text."""
        for name in ("final", "best"):
            candidate = self.root / "hf" / name
            if (candidate / "tokenizer.json").is_file():
                return candidate
        return None
