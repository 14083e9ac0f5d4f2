"""Run by tests/trainer/test_lora_tp.py under ``torchrun --nproc_per_node 2`` (gloo, CPU): a TP=2 LoRA
trainer takes two SGD steps, saves and reloads a checkpoint; rank 0 writes what it saw to OUT/results.pt."""

from __future__ import annotations

import sys
import warnings
from pathlib import Path

warnings.filterwarnings("ignore")


def run(model_dir: str, out: Path) -> None:
    import torch
    import torch.distributed as dist

    sys.path.insert(0, str(Path(__file__).parent))
    from test_lora_tp import BATCHES, CONFIG

    from agentrl.trainer.actor import MegatronTrainer
    from agentrl.trainer.trainer_config import TrainerConfig

    trainer = MegatronTrainer(model_dir, TrainerConfig(tp_size=2, **CONFIG))
    results = {"init": [(n, a.clone(), b.clone()) for n, a, b in trainer.export_adapter_tensors()]}
    results["metrics"] = [trainer.train_step(batch) for batch in BATCHES()]
    results["logprobs"] = trainer.compute_logprobs(BATCHES()[0])
    results["adapters"] = [(n, a.clone(), b.clone()) for n, a, b in trainer.export_adapter_tensors()]
    results["merged"] = dict(trainer.export_hf_named_tensors())
    step = trainer.save_checkpoint(out / "ckpt" / "step-2")
    fresh = MegatronTrainer(model_dir, TrainerConfig(tp_size=2, **CONFIG))
    fresh.load_checkpoint(step)
    results["reloaded"] = [(n, a.clone(), b.clone()) for n, a, b in fresh.export_adapter_tensors()]
    if dist.get_rank() == 0:
        torch.save(results, out / "results.pt")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    run(sys.argv[2], Path(sys.argv[1]))
