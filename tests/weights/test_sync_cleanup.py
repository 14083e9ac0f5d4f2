"""Senders that own their tmpfs directory remove it even when never closed (RAM-backed /dev/shm)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

SCRIPT = """
from agentrl.weights.delta_sync import DeltaSync
from agentrl.weights.disk_sync import DiskSync
senders = [DiskSync(["http://127.0.0.1:9"]), DeltaSync(["http://127.0.0.1:9"])]
for s in senders:
    (s.root / "marker").write_bytes(b"x")
    print(s.root)
"""


def test_unclosed_senders_leave_no_directories() -> None:
    out = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=120, check=True)
    roots = [Path(line) for line in out.stdout.split()]
    assert len(roots) == 2
    assert not any(r.exists() for r in roots)


def test_closed_sender_keeps_a_directory_it_was_given(tmp_path) -> None:
    from agentrl.weights.disk_sync import DiskSync

    DiskSync(["http://127.0.0.1:9"], directory=tmp_path / "w").close()
    assert (tmp_path / "w").is_dir()
