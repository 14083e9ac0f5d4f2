"""``agentrl export CHECKPOINT OUT_DIR``: a run's Megatron checkpoint as a HF model dir (safetensors,
config, tokenizer, chat template) that ``AutoModelForCausalLM.from_pretrained`` and ``agentrl serve`` load.
A LoRA run's export merges its adapters into the weights; ``--adapter`` writes the adapters alone as a
PEFT adapter dir (``adapter_config.json``, ``adapter_model.safetensors``) for
``peft.PeftModel.from_pretrained(base, DIR)`` on the starting model.

The checkpoint is read in one process (a 1-rank trainer; checkpoints reshard across data-parallel sizes).
Its run directory says which model it trained: ``config.json`` (the trainer settings) and the step-0 row
of ``metrics.jsonl`` (the starting model dir, whose config and tokenizer the export copies).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

    from agentrl.trainer.lora import LoraConfig


class ExportError(ValueError):
    """The checkpoint or its run directory does not say what to export."""


def starting_model_dir(run_dir: Path) -> Path:
    metrics = run_dir / "metrics.jsonl"
    if not metrics.exists():
        raise ExportError(f"{run_dir}: no metrics.jsonl, so the model this checkpoint trained is unknown")
    for line in metrics.read_text().splitlines():
        row = json.loads(line) if line.strip() else {}
        if row.get("step") == 0 and "model_dir" in row:
            model_dir = Path(row["model_dir"])
            if not (model_dir / "config.json").exists():
                raise ExportError(f"the starting model {model_dir} (from {metrics}) is gone")
            return model_dir
    raise ExportError(f"{metrics} has no step-0 row naming the starting model dir")


def require_manifest(checkpoint: Path) -> None:
    """ExportError unless ``checkpoint`` holds its checksum manifest: without it no damaged byte can be
    found, and an export is a model someone will serve."""
    from agentrl.trainer.checkpoint import MANIFEST

    if not checkpoint.is_dir():
        raise ExportError(f"{checkpoint} is not a checkpoint directory")
    if not (checkpoint / MANIFEST).is_file():
        raise ExportError(f"{checkpoint} has no {MANIFEST}, so its weights cannot be verified; pass "
                          "--no-verify to export them unverified")


def save_peft_adapter(adapters: Iterable[tuple[str, torch.Tensor, torch.Tensor]], lora: LoraConfig,
                      base_model_dir: Path, out_dir: str | Path) -> Path:
    """``(hf_module, A, B)`` adapters (``B`` unscaled) as a PEFT LoRA adapter dir on ``base_model_dir``."""
    from safetensors.torch import save_file

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tensors = {}
    for module, a, b in adapters:
        tensors[f"base_model.model.{module}.lora_A.weight"] = a.detach().contiguous().cpu()
        tensors[f"base_model.model.{module}.lora_B.weight"] = b.detach().contiguous().cpu()
    save_file(tensors, str(out / "adapter_model.safetensors"), metadata={"format": "pt"})
    config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": str(base_model_dir),
              "r": lora.rank, "lora_alpha": lora.alpha, "lora_dropout": lora.dropout, "bias": "none",
              "target_modules": sorted(lora.target_modules), "fan_in_fan_out": False, "inference_mode": True}
    (out / "adapter_config.json").write_text(json.dumps(config, indent=2) + "\n")
    return out


def export_checkpoint(checkpoint: str | Path, out_dir: str | Path, *, verify: bool = True,
                      adapter: bool = False) -> Path:
    """Write the policy saved in ``checkpoint`` (``RUN/checkpoints/step-N``) as a HF dir at ``out_dir``
    (``adapter``: a LoRA run's adapters as a PEFT dir); ``verify=False`` exports a checkpoint without its
    manifest (the load then only warns)."""
    from agentrl.run.config import RunConfig
    from agentrl.trainer.actor import MegatronTrainer
    from agentrl.weights.convert import save_hf_checkpoint

    checkpoint = Path(checkpoint)
    if verify:
        require_manifest(checkpoint)
    run_dir = checkpoint.resolve().parent.parent
    if not (run_dir / "config.json").exists():
        raise ExportError(f"{checkpoint} is not inside a run directory (no {run_dir / 'config.json'})")
    cfg = RunConfig.model_validate_json((run_dir / "config.json").read_text())
    if adapter and not cfg.trainer.lora.enabled:
        raise ExportError(f"{run_dir} trained the full model (trainer.lora is off): there is no adapter to export")
    model_dir = starting_model_dir(run_dir)
    # The optimizer state is not needed for the weights; no reference model either.
    trainer_cfg = cfg.trainer.model_copy(update={"loss": cfg.trainer.loss.model_copy(update={"kl_coef": 0.0})})
    trainer = MegatronTrainer(model_dir, trainer_cfg, temperature=cfg.rollout.temperature)
    trainer.load_checkpoint(checkpoint)
    if adapter:
        return save_peft_adapter(trainer.export_adapter_tensors(), cfg.trainer.lora, model_dir, out_dir)
    return save_hf_checkpoint(trainer.export_hf_named_tensors(), model_dir, out_dir)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="agentrl export", description=__doc__)
    parser.add_argument("checkpoint", help="RUN_DIR/checkpoints/step-N")
    parser.add_argument("out_dir", help="where the HF model dir is written")
    parser.add_argument("--no-verify", action="store_true",
                        help="export a checkpoint that has no checksum manifest (its bytes are not checked)")
    parser.add_argument("--adapter", action="store_true",
                        help="a LoRA run: write its adapters as a PEFT adapter dir instead of merged weights")
    args = parser.parse_args(argv)
    try:
        out = export_checkpoint(args.checkpoint, args.out_dir, verify=not args.no_verify, adapter=args.adapter)
    except (ValueError, FileNotFoundError) as err:  # ExportError, CheckpointError (corrupt, incomplete)
        print(f"agentrl export: {err}", file=sys.stderr)
        return 2
    print(json.dumps({"adapter_dir" if args.adapter else "hf_dir": str(out)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
