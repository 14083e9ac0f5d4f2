"""Task files: the one JSONL reader of ``agentrl eval`` / ``agentrl rollout --tasks`` and of a run's ``data``."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def read_jsonl(path: str | Path) -> list[dict[str, Any]]:
    """The JSON objects of a JSONL file, one per non-blank line; a ``ValueError`` naming the file and the line
    of the first one that is not a JSON object, or why the file cannot be read."""
    try:
        lines = Path(path).read_text().splitlines()
    except OSError as err:
        raise ValueError(f"{path}: {err.strerror or err}") from None
    rows = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as err:
            raise ValueError(f"{path} line {number}: not JSON ({err.msg})") from None
        if not isinstance(row, dict):
            raise ValueError(f"{path} line {number}: a task must be a JSON object, got {type(row).__name__}")
        rows.append(row)
    return rows
