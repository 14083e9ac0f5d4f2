"""Checkpoints before the first optimizer step, the distributed optimizer's checkpoints, and bad checkpoints."""

from __future__ import annotations

import warnings

import pytest
import torch
from trainer_samples import synthetic_samples

from agentrl.trainer.actor import MegatronTrainer
from agentrl.trainer.checkpoint import OPTIMIZER_NOT_STEPPED, OPTIMIZER_SAVED, CheckpointError, write_manifest
from agentrl.trainer.trainer_config import TrainerConfig

warnings.filterwarnings("ignore")

BATCHES = [synthetic_samples(n_groups=2, per_group=4, seed=s) for s in (11, 12, 13)]
LAYOUTS = {
    "adam": dict(),
    "adam-distributed": dict(use_distributed_optimizer=True),
    "adam-bf16": dict(dtype="bfloat16"),
    "adam-distributed-bf16": dict(use_distributed_optimizer=True, dtype="bfloat16"),
    "sgd": dict(optimizer="sgd", lr=1e-2),
}


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    from agentrl.models.tiny import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("tiny") / "model", seed=0)


def _config(layout: str) -> TrainerConfig:
    # Weight decay and an LR schedule make every optimizer step depend on Adam's state and step count.
    base = dict(lr=1e-3, weight_decay=0.1, lr_warmup_steps=1, lr_decay_steps=10, lr_decay_style="cosine", min_lr=1e-4)
    return TrainerConfig(**{**base, **LAYOUTS[layout]})


def _common(path):
    from megatron.core import dist_checkpointing

    return dist_checkpointing.load_common_state_dict(str(path))


def _assert_same_run(got: MegatronTrainer, want: MegatronTrainer, batches) -> None:
    for batch in batches:
        assert got.train_step(batch) == want.train_step(batch)
        want_weights = dict(want.export_hf_named_tensors())
        for name, w in got.export_hf_named_tensors():
            assert torch.equal(w, want_weights[name]), name


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_checkpoint_before_the_first_step_resumes_like_the_uninterrupted_run(tiny_dir, tmp_path, layout):
    cfg = _config(layout)
    a = MegatronTrainer(tiny_dir, cfg)
    a.save_checkpoint(tmp_path / "step-0", extra_state={"buffer_cursor": 0, "weight_version": 0})
    rng_after_save = torch.rand(3)
    stateful = layout != "sgd"  # SGD without momentum has no per-parameter state at any step
    assert _common(tmp_path / "step-0")["optimizer_state"] == (OPTIMIZER_NOT_STEPPED if stateful else OPTIMIZER_SAVED)

    # The loading trainer has moved away from the checkpoint: other weights, Adam moments, step count.
    b = MegatronTrainer(tiny_dir, cfg)
    b.train_step(BATCHES[2])
    assert b.step == 1
    extra = b.load_checkpoint(tmp_path / "step-0")
    assert extra == {"buffer_cursor": 0, "weight_version": 0}
    assert b.step == 0 and b.scheduler.num_steps == 0
    assert torch.equal(torch.rand(3), rng_after_save)
    # The next two steps (the second one reads the state the first one created) are the uninterrupted run's.
    _assert_same_run(b, a, BATCHES[:2])


@pytest.mark.parametrize("layout", ["adam-distributed", "adam-distributed-bf16", "sgd"])
def test_checkpoint_after_a_step_resumes_like_the_uninterrupted_run(tiny_dir, tmp_path, layout):
    # Plain Adam is covered by test_trainer.py::test_resume_gives_the_same_next_step.
    cfg = _config(layout)
    a = MegatronTrainer(tiny_dir, cfg)
    a.train_step(BATCHES[0])
    a.save_checkpoint(tmp_path / "step-1", extra_state={"weight_version": 1})
    assert _common(tmp_path / "step-1")["optimizer_state"] == OPTIMIZER_SAVED
    b = MegatronTrainer(tiny_dir, cfg)
    assert b.load_checkpoint(tmp_path / "step-1") == {"weight_version": 1}
    assert b.step == 1
    _assert_same_run(b, a, BATCHES[1:2])


# ---------------------------------------------------------------------------------------------- bad checkpoints


@pytest.fixture(scope="module")
def stepped_checkpoint(tiny_dir, tmp_path_factory):
    """A checkpoint after one Adam step and the trainer (still at that state) that wrote it."""
    trainer = MegatronTrainer(tiny_dir, _config("adam"))
    trainer.train_step(BATCHES[0])
    path = tmp_path_factory.mktemp("ckpt") / "step-1"
    trainer.save_checkpoint(path, extra_state={"weight_version": 1})
    return path, trainer


def _copy(src, dst):
    import shutil

    shutil.copytree(src, dst)
    return dst


def _reseal(path):
    """A consistent manifest for a deliberately altered copy, so the checks behind the manifest's are reached."""
    write_manifest(path)
    return path


def _weights(trainer):
    return {n: w.clone() for n, w in trainer.export_hf_named_tensors()}


def test_missing_or_non_checkpoint_directories_are_rejected(stepped_checkpoint, tmp_path):
    _, trainer = stepped_checkpoint
    before = _weights(trainer)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        trainer.load_checkpoint(tmp_path / "nope")
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="not a dist_checkpointing checkpoint"):
        trainer.load_checkpoint(tmp_path / "empty")
    assert all(torch.equal(w, before[n]) for n, w in trainer.export_hf_named_tensors())
    assert trainer.step == 1


def test_corrupt_checkpoints_give_a_clear_error(stepped_checkpoint, tmp_path):
    path, trainer = stepped_checkpoint
    no_common = _copy(path, tmp_path / "no_common")
    (no_common / "common.pt").unlink()
    _reseal(no_common)
    with pytest.raises(CheckpointError, match="cannot read its common state"):
        trainer.load_checkpoint(no_common)

    # A save that died: shard files missing or short. Rejected before any parameter is overwritten.
    before = _weights(trainer)
    damages = {"is missing": lambda f: f.unlink(), "has 100 of": lambda f: f.write_bytes(f.read_bytes()[:100]),
               "no_index": None}
    for what, damage in damages.items():
        broken = _copy(path, tmp_path / what.replace(" ", "_"))
        if damage is None:
            (broken / ".metadata").unlink()
            _reseal(broken)
            with pytest.raises(CheckpointError, match=r"cannot read its shard index"):
                trainer.load_checkpoint(broken)
        else:
            damage(sorted(broken.glob("*.distcp"))[-1])
            with pytest.raises(CheckpointError, match=rf"incomplete: shard file __\d_\d.distcp {what}"):
                trainer.load_checkpoint(broken)
        assert all(torch.equal(w, before[n]) for n, w in trainer.export_hf_named_tensors()), what
    assert trainer.step == 1

    not_ours = _copy(path, tmp_path / "not_ours")
    common = torch.load(not_ours / "common.pt", weights_only=False)
    torch.save({k: v for k, v in common.items() if k != "extra_state"}, not_ours / "common.pt")
    _reseal(not_ours)
    with pytest.raises(CheckpointError, match=r"lacks \['extra_state'\]"):
        trainer.load_checkpoint(not_ours)


def test_a_checkpoint_without_the_optimizer_state_it_promises_is_rejected(stepped_checkpoint, tmp_path, tiny_dir):
    path, trainer = stepped_checkpoint
    dropped = _copy(path, tmp_path / "dropped")
    common = torch.load(dropped / "common.pt", weights_only=False)
    torch.save({k: v for k, v in common.items() if k != "optimizer"}, dropped / "common.pt")
    _reseal(dropped)
    with pytest.raises(CheckpointError, match="says its optimizer state was saved, but it has none"):
        trainer.load_checkpoint(dropped)

    # What the previous save_checkpoint wrote before the first step: an optimizer section with empty
    # state and no optimizer_state marker. Loading it needs Adam moments the checkpoint does not have.
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.mapping import ShardedObject

    from agentrl.trainer.cpu_shims import cuda_to_cpu

    fresh = MegatronTrainer(tiny_dir, _config("adam"))
    old = tmp_path / "old-step-0"
    old.mkdir()
    with cuda_to_cpu():
        model_sd = fresh.gpt.sharded_state_dict()
        dist_checkpointing.save({
            "model": model_sd, "optimizer": fresh.optimizer.sharded_state_dict(model_sd),
            "rng": ShardedObject("rng_state", {}, (1,), (0,), replica_id=0),
            "scheduler": fresh.scheduler.state_dict(), "step": 0, "extra_state": {},
        }, str(old))
    before = _weights(trainer)
    with pytest.raises(CheckpointError, match="has no optimizer tensors"):
        trainer.load_checkpoint(old)
    assert all(torch.equal(w, before[n]) for n, w in trainer.export_hf_named_tensors())
