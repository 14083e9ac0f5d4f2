"""Checkpoints appear only when complete and are verified before loading: flipped or missing bytes, a
save killed with SIGKILL, saving over an earlier attempt."""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import time
import warnings
from pathlib import Path

import pytest
import torch
from trainer_samples import synthetic_samples

from agentrl.trainer import checkpoint
from agentrl.trainer.actor import MegatronTrainer
from agentrl.trainer.checkpoint import MANIFEST, CheckpointError
from agentrl.trainer.trainer_config import TrainerConfig

warnings.filterwarnings("ignore")
HERE = Path(__file__).parent
REPO = HERE.parent.parent


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    from agentrl.models.tiny import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("tiny") / "model", seed=0)


@pytest.fixture(scope="module")
def trainer(tiny_dir):
    t = MegatronTrainer(tiny_dir, TrainerConfig(lr=1e-3))
    t.train_step(synthetic_samples(n_groups=2, per_group=4, seed=1))
    return t


@pytest.fixture(scope="module")
def saved(trainer, tmp_path_factory):
    """A checkpoint after one Adam step; the trainer is still at that state."""
    return trainer.save_checkpoint(tmp_path_factory.mktemp("ckpt") / "step-1", {"weight_version": 1})


def _weights(trainer) -> dict[str, torch.Tensor]:
    return {n: w.clone() for n, w in trainer.export_hf_named_tensors()}


def _unchanged(trainer, before) -> bool:
    return all(torch.equal(w, before[n]) for n, w in trainer.export_hf_named_tensors())


def _files(path: Path) -> list[Path]:
    return sorted(f for f in path.iterdir() if f.name != MANIFEST)


def test_the_manifest_lists_every_file_of_the_checkpoint(saved):
    import json

    names = {f.name for f in _files(saved)}
    assert {"common.pt", "metadata.json", ".metadata"} <= names and any(n.endswith(".distcp") for n in names)
    assert set(json.loads((saved / MANIFEST).read_text())["files"]) == names
    assert [p.name for p in saved.parent.iterdir()] == ["step-1"]  # no temp sibling left


def test_a_flipped_byte_anywhere_is_refused_naming_the_file(saved, trainer, tmp_path):
    path = Path(shutil.copytree(saved, tmp_path / "step-1"))
    before = _weights(trainer)
    for file in _files(path):
        raw = file.read_bytes()
        for offset in sorted({0, len(raw) // 3, len(raw) // 2, len(raw) - 1}):
            flipped = bytearray(raw)
            flipped[offset] ^= 0x01
            file.write_bytes(bytes(flipped))
            with pytest.raises(CheckpointError, match=rf"corrupt: .*{re.escape(file.name)} does not match the checksum"):
                trainer.load_checkpoint(path)
        file.write_bytes(raw)
    assert _unchanged(trainer, before) and trainer.step == 1
    assert trainer.load_checkpoint(path) == {"weight_version": 1}  # restored bytes verify again


def test_truncated_missing_or_grown_files_are_refused_naming_the_file(saved, trainer, tmp_path):
    path = Path(shutil.copytree(saved, tmp_path / "step-1"))
    before = _weights(trainer)
    for file in _files(path):
        raw = file.read_bytes()
        kind = "shard file" if file.suffix == ".distcp" else "file"
        file.write_bytes(raw[: len(raw) // 2])
        with pytest.raises(CheckpointError,
                           match=rf"incomplete: {kind} {re.escape(file.name)} has {len(raw) // 2} of {len(raw)} bytes"):
            trainer.load_checkpoint(path)
        file.write_bytes(raw + b"\0")
        with pytest.raises(CheckpointError, match=rf"corrupt: {kind} {re.escape(file.name)} does not match"):
            trainer.load_checkpoint(path)
        file.unlink()
        with pytest.raises(CheckpointError, match=rf"incomplete: {kind} {re.escape(file.name)} is missing"):
            trainer.load_checkpoint(path)
        file.write_bytes(raw)
    assert _unchanged(trainer, before)


def test_a_damaged_manifest_is_refused(saved, trainer, tmp_path):
    path = Path(shutil.copytree(saved, tmp_path / "step-1"))
    manifest = path / MANIFEST
    text = manifest.read_text()
    digit = re.search(r'"size": (\d)', text)
    manifest.write_text(text[: digit.start(1)] + str((int(digit.group(1)) + 1) % 10) + text[digit.end(1):])
    with pytest.raises(CheckpointError, match=f"its {MANIFEST} is corrupt"):
        trainer.load_checkpoint(path)
    manifest.write_text(text[:-10])
    with pytest.raises(CheckpointError, match=f"its {MANIFEST} is unreadable"):
        trainer.load_checkpoint(path)


def test_a_checkpoint_from_before_manifests_loads_with_a_warning(saved, trainer, tmp_path):
    path = Path(shutil.copytree(saved, tmp_path / "step-1"))
    (path / MANIFEST).unlink()
    with pytest.warns(UserWarning, match="cannot be verified"):
        assert trainer.load_checkpoint(path) == {"weight_version": 1}


@pytest.mark.parametrize("atomic_swap", [True, False], ids=["renameat2", "two-renames"])
def test_saving_over_an_earlier_attempt_replaces_it_and_removes_leftovers(tiny_dir, tmp_path, monkeypatch,
                                                                          atomic_swap):
    if not atomic_swap:
        monkeypatch.setattr(checkpoint, "_exchange", lambda a, b: False)
    first = MegatronTrainer(tiny_dir, TrainerConfig(lr=1e-3))
    first.save_checkpoint(tmp_path / "step-0", {"attempt": 1})
    # What killed saves leave: a temp sibling with partial files, a swapped-out old one.
    for leftover in ("step-0.tmp-123", "step-0.old-456"):
        (tmp_path / leftover).mkdir()
        (tmp_path / leftover / "__0_0.distcp").write_bytes(b"partial")
    (tmp_path / "step-00.tmp-1").mkdir()  # another checkpoint's name: not this save's business
    second = MegatronTrainer(tiny_dir, TrainerConfig(lr=1e-3))
    second.train_step(synthetic_samples(n_groups=2, per_group=4, seed=3))
    second.save_checkpoint(tmp_path / "step-0", {"attempt": 2})
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-0", "step-00.tmp-1"]
    assert first.load_checkpoint(tmp_path / "step-0") == {"attempt": 2}
    assert first.step == 1
    assert all(torch.equal(w, dict(second.export_hf_named_tensors())[n]) for n, w in first.export_hf_named_tensors())


def test_a_directory_that_is_no_checkpoint_is_never_replaced(trainer, tmp_path):
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("keep me")
    with pytest.raises(FileExistsError, match="is not a checkpoint"):
        trainer.save_checkpoint(tmp_path / "mine")
    assert (tmp_path / "mine" / "notes.txt").read_text() == "keep me"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mine"]


def test_save_and_load_start_no_process(trainer, tiny_dir, tmp_path, monkeypatch):
    """A child forked while another thread (Ray's, a tracker's) holds a lock can wait forever, and the save with
    it; Megatron's spawned results Manager cost the first save ~2 s and outlived it."""
    import multiprocessing.util

    from megatron.core.dist_checkpointing.strategies import filesystem_async

    def no_child(*args, **kwargs):
        raise AssertionError("the checkpoint save or load started a process")

    before = _weights(trainer)
    restored = MegatronTrainer(tiny_dir, TrainerConfig(lr=1e-3))
    monkeypatch.setattr(os, "fork", no_child)
    monkeypatch.setattr(multiprocessing.util, "spawnv_passfds", no_child)  # spawn and forkserver start here
    monkeypatch.setattr(filesystem_async, "_results_queue", None)  # as in a fresh process: nothing cached
    path = trainer.save_checkpoint(tmp_path / "step-1", {"weight_version": 4})
    assert restored.load_checkpoint(path) == {"weight_version": 4}
    assert _unchanged(restored, before)


def test_a_shard_write_that_fails_fails_the_save_and_leaves_no_step(trainer, tmp_path, monkeypatch):
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    def disk_full(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(filesystem_async, "_write_item", disk_full)
    with pytest.raises(OSError, match="No space left on device"):
        trainer.save_checkpoint(tmp_path / "step-1", {"weight_version": 5})
    assert not (tmp_path / "step-1").exists()


# ---------------------------------------------------------------------------------------------- kill -9


def _start_worker(tiny: Path, root: Path, mode: str) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), str(HERE), os.environ.get("PYTHONPATH", "")]),
           "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
    # Its own process group: Megatron's spawned manager dies with it.
    return subprocess.Popen([sys.executable, str(HERE / "checkpoint_worker.py"), str(tiny), str(root), mode],
                            env=env, cwd=REPO, start_new_session=True, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT)


def _kill_when(proc: subprocess.Popen, ready, timeout: float = 240.0) -> None:
    deadline = time.monotonic() + timeout
    try:
        while not ready():
            if proc.poll() is not None:
                pytest.fail(f"worker exited with {proc.returncode}: {proc.stdout.read().decode()[-3000:]}")
            if time.monotonic() > deadline:
                pytest.fail("worker never reached the point to kill it at")
            time.sleep(0.001)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        proc.stdout.close()


def _temp_with_shards(root: Path) -> bool:
    return any(d.name.startswith("step-2.tmp-") and any(d.glob("*.distcp")) for d in root.iterdir() if d.is_dir())


def _after_the_kill(root: Path, tiny: Path) -> None:
    """The earlier checkpoint loads as saved, and the next save of the killed step succeeds."""
    trainer = MegatronTrainer(tiny, TrainerConfig(lr=1e-3))
    assert trainer.load_checkpoint(root / "step-1") == {"weight_version": 1}
    want = torch.load(root / "step-1.weights.pt")
    assert all(torch.equal(w, want[n]) for n, w in trainer.export_hf_named_tensors())
    if (root / "step-2").exists():  # an earlier complete attempt: still whole
        assert set(trainer.load_checkpoint(root / "step-2")) == {"weight_version"}
    trainer.train_step(synthetic_samples(n_groups=2, per_group=4, seed=9))
    trainer.save_checkpoint(root / "step-2", {"weight_version": 9})
    assert not [p.name for p in root.iterdir() if ".tmp-" in p.name or ".old-" in p.name]
    assert MegatronTrainer(tiny, TrainerConfig(lr=1e-3)).load_checkpoint(root / "step-2") == {"weight_version": 9}


@pytest.fixture(scope="module")
def kill_workers(tiny_dir, tmp_path_factory):
    """Both kill -9 workers, started together when the first of their tests begins: the second one's
    imports, first step and step-1 save run beside the first test (its ``loop`` waits for ``ROOT/go``)."""
    roots = {mode: tmp_path_factory.mktemp(mode) for mode in ("pause-before-seal", "loop")}
    procs = {mode: _start_worker(tiny_dir, root, mode) for mode, root in roots.items()}
    yield {mode: (procs[mode], root) for mode, root in roots.items()}
    for proc in procs.values():
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            proc.stdout.close()


def test_kill_9_before_the_manifest_leaves_no_step_and_the_next_save_succeeds(tiny_dir, kill_workers):
    proc, root = kill_workers["pause-before-seal"]
    _kill_when(proc, lambda: (root / "paused").exists())
    assert not (root / "step-2").exists()
    assert _temp_with_shards(root)
    _after_the_kill(root, tiny_dir)


def test_kill_9_while_replacing_an_earlier_attempt_keeps_it_and_the_next_save_succeeds(tiny_dir, kill_workers):
    proc, root = kill_workers["loop"]
    (root / "go").write_text("")
    _kill_when(proc, lambda: (root / "saved-2").exists() and _temp_with_shards(root))
    assert (root / "step-2").is_dir()
    _after_the_kill(root, tiny_dir)
