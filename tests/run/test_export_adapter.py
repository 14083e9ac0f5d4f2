"""A LoRA run's checkpoint: it resumes (adapters, optimizer), ``agentrl export`` writes merged HF weights that
transformers loads, and ``--adapter`` a PEFT dir that ``peft`` puts on the base model; all give the
trainer's logits."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

from agentrl.run.export import main
from agentrl.trainer.checkpoint import MANIFEST

sys.path.insert(0, str(Path(__file__).parent.parent / "trainer"))
from trainer_samples import synthetic_samples  # noqa: E402

IDS = torch.tensor([[1, 17, 300, 5, 9, 42, 2, 7, 600, 11]])


def _run_config(trainer: dict):
    from agentrl.run.config import RunConfig

    return RunConfig.model_validate({"env": "agentrl.envs.arithmetic:ArithmeticToolEnv",
                                     "tasks": "agentrl.envs.arithmetic:make_tasks", "trainer": trainer})


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory):
    """A run dir with one checkpoint of a rank-4 LoRA trainer after two large steps."""
    from agentrl.models.tiny import make_tiny_model
    from agentrl.trainer.actor import MegatronTrainer

    root = tmp_path_factory.mktemp("lora_run")
    model = make_tiny_model(root / "tiny", seed=0)
    cfg = _run_config({"lr": 3e-2, "max_tokens_per_microbatch": 256, "attention": "sdpa",
                       "lora": {"rank": 4, "alpha": 8, "target_modules": ["q_proj", "v_proj", "o_proj", "down_proj"]}})
    run = root / "run"
    run.mkdir()
    (run / "config.json").write_text(cfg.model_dump_json())
    (run / "metrics.jsonl").write_text(json.dumps({"step": 0, "model_dir": str(model)}) + "\n")
    trainer = MegatronTrainer(model, cfg.trainer)
    for seed in (3, 4):
        trainer.train_step(synthetic_samples(n_groups=2, per_group=4, seed=seed))
    step = trainer.save_checkpoint(run / "checkpoints" / "step-2", {"weight_version": 2})
    return model, cfg, trainer, Path(step)


def _trainer_logits(trainer) -> torch.Tensor:
    pos = torch.arange(IDS.shape[1])[None]
    with torch.no_grad():
        return trainer.gpt(IDS, pos, None)[0].float()


def test_resume_restores_adapters_and_optimizer(lora_run):
    from agentrl.trainer.actor import MegatronTrainer

    model, cfg, trainer, step = lora_run
    fresh = MegatronTrainer(model, cfg.trainer)
    assert fresh.load_checkpoint(step) == {"weight_version": 2} and fresh.step == 2
    for (n1, a1, b1), (n2, a2, b2) in zip(trainer.export_adapter_tensors(), fresh.export_adapter_tensors(), strict=True):
        assert n1 == n2 and torch.equal(a1, a2) and torch.equal(b1, b2)
    assert sum(1 for _ in fresh.export_adapter_tensors()) == 2 * 4  # 2 layers x 4 targets
    # Adam's moments came back too: one more step from either lands on the same adapters.
    batch = synthetic_samples(n_groups=2, per_group=4, seed=5)
    assert trainer.train_step(batch)["loss"] == fresh.train_step(batch)["loss"]
    for (_, a1, b1), (_, a2, b2) in zip(trainer.export_adapter_tensors(), fresh.export_adapter_tensors(), strict=True):
        assert torch.equal(a1, a2) and torch.equal(b1, b2)


def test_merged_export_and_peft_adapter_give_the_trainers_logits(lora_run, tmp_path, capsys):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from agentrl.trainer.actor import MegatronTrainer

    model, cfg, _, step = lora_run
    saved = MegatronTrainer(model, cfg.trainer)
    saved.load_checkpoint(step)
    expected = _trainer_logits(saved)
    assert main([str(step), str(tmp_path / "merged")]) == 0
    assert main([str(step), str(tmp_path / "adapter"), "--adapter"]) == 0
    out = [json.loads(line) for line in capsys.readouterr().out.splitlines() if line.startswith("{")]
    assert out == [{"hf_dir": str(tmp_path / "merged")}, {"adapter_dir": str(tmp_path / "adapter")}]

    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged", dtype=torch.float32).eval()
    base = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
    peft_model = PeftModel.from_pretrained(base, tmp_path / "adapter").eval()
    with torch.no_grad():
        got = {"merged": merged(IDS).logits[0], "peft": peft_model(IDS).logits[0]}
    # fp32; the merged weights round W + s B A once, peft adds x A^T B^T s beside W, as the trainer does
    for name, logits in got.items():
        assert (logits - expected).abs().max().item() < 1e-4, name
    with torch.no_grad(), peft_model.disable_adapter():
        off = peft_model(IDS).logits[0]
    assert (off - expected).abs().max().item() > 1e-2  # the adapters are what moved the logits


def test_adapter_export_of_a_full_run_is_one_line(lora_run, tmp_path, capsys):
    model = lora_run[0]
    run = tmp_path / "full"
    (run / "checkpoints").mkdir(parents=True)
    (run / "config.json").write_text(_run_config({"attention": "sdpa"}).model_dump_json())
    (run / "metrics.jsonl").write_text(json.dumps({"step": 0, "model_dir": str(model)}) + "\n")
    target = run / "checkpoints" / "step-2"
    target.mkdir()
    (target / MANIFEST).write_text(json.dumps({"files": {}}))  # refused before any weight is read
    assert main([str(target), str(tmp_path / "out"), "--adapter"]) == 2
    err = capsys.readouterr().err
    assert "trainer.lora is off" in err and err.count("\n") == 1


def test_lora_turns_the_default_delta_sync_into_adapters_over_the_same_transport():
    cfg = _run_config({"lora": {"rank": 8}})
    assert cfg.sync_mode == "adapter" and cfg.sync_options.transport == "disk"
    from agentrl.run.config import RunConfig

    base = {"env": "agentrl.envs.arithmetic:ArithmeticToolEnv", "tasks": "agentrl.envs.arithmetic:make_tasks"}
    kept = RunConfig.model_validate({**base, "trainer": {"lora": {"rank": 8}}, "sync_mode": "full"})
    assert kept.sync_mode == "full"  # asked for: the merged dense weights
    assert _run_config({}).sync_mode == "delta"
    with pytest.raises(ValueError, match="snapshot_budget_bytes"):  # delta's own option has no meaning here
        RunConfig.model_validate({**base, "trainer": {"lora": {"rank": 8}},
                                  "sync_options": {"snapshot_budget_bytes": 10}})
    with pytest.raises(ValueError, match="trainer.lora.rank"):
        RunConfig.model_validate({**base, "sync_mode": "adapter"})
