"""Senders that made their own tmpfs directory remove it on close, on GC, at exit, and after a crash."""

from __future__ import annotations

import gc
import os
import subprocess
import sys
from pathlib import Path

import pytest

from agentrl.weights.delta_sync import DeltaSync
from agentrl.weights.sync import DiskSync, make_sync
from agentrl.weights.transports.disk import TEMP_PREFIX

DEAD = ["http://127.0.0.1:9"]
SHM = Path("/dev/shm")
ON_SHM = SHM.is_dir() and os.access(SHM, os.W_OK)

SCRIPT = """
from agentrl.weights.delta_sync import DeltaSync
from agentrl.weights.sync import DiskSync
senders = [DiskSync(["http://127.0.0.1:9"]), DeltaSync(["http://127.0.0.1:9"])]
for s in senders:
    (s.root / "marker").write_bytes(b"x")
    print(s.root)
"""


def mine() -> set[Path]:
    """This process's weight directories in /dev/shm (other processes may be making their own)."""
    return set(SHM.glob(f"{TEMP_PREFIX}{os.getpid()}-*"))


def test_unclosed_senders_leave_no_directories() -> None:
    out = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=120, check=True)
    roots = [Path(line) for line in out.stdout.split()]
    assert len(roots) == 2
    assert not any(r.exists() for r in roots)


@pytest.mark.skipif(not ON_SHM, reason="/dev/shm is not writable here")
@pytest.mark.parametrize(("mode", "options"), [("disk", {}), ("delta", {}), ("full", {"transport": "disk"})])
def test_close_removes_the_shm_directory_the_sync_made_and_is_idempotent(mode, options) -> None:
    before = mine()
    sync = make_sync(mode, DEAD, **options)
    root = sync.root
    assert root is not None and root.parent == SHM and root.name.startswith(TEMP_PREFIX)
    (root / "v-1").mkdir()
    (root / "v-1" / "model.safetensors").write_bytes(b"x" * 1024)
    sync.close()
    sync.close()
    assert not root.exists()
    assert mine() <= before


@pytest.mark.skipif(not ON_SHM, reason="/dev/shm is not writable here")
def test_garbage_collection_removes_the_directory() -> None:
    sync = DeltaSync(DEAD)
    root = sync.root
    assert root is not None and root.is_dir()
    del sync
    gc.collect()
    assert not root.exists()


def test_a_directory_left_by_a_dead_process_is_removed_by_the_next_sync(tmp_path) -> None:
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True,
                          check=True).stdout.strip()
    orphan = (SHM if ON_SHM else Path(tmp_path)) / f"{TEMP_PREFIX}{dead}-abc"
    orphan.mkdir()
    (orphan / "model.safetensors").write_bytes(b"x")
    alive = (SHM if ON_SHM else Path(tmp_path)) / f"{TEMP_PREFIX}{os.getpid()}-keep"
    alive.mkdir()
    try:
        if ON_SHM:
            DiskSync(DEAD).close()
        else:
            from agentrl.weights.transports.disk import remove_orphans

            remove_orphans(Path(tmp_path))
        assert not orphan.exists() and alive.is_dir()
    finally:
        alive.rmdir()


def test_closed_sender_keeps_a_directory_it_was_given(tmp_path) -> None:
    DiskSync(["http://127.0.0.1:9"], directory=tmp_path / "w").close()
    assert (tmp_path / "w").is_dir()


def test_a_transport_without_files_has_no_root() -> None:
    with make_sync("delta", DEAD, transport="broadcast") as sync:
        assert sync.root is None
