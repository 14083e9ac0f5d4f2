"""The ``ep`` part of two_rank_worker.py (2 gloo ranks) for test_moe_ep.py: a tiny Qwen3-MoE trained with
expert parallelism 2."""

from __future__ import annotations

import sys
import warnings
from pathlib import Path

import torch
import torch.distributed as dist

warnings.filterwarnings("ignore")
sys.path.insert(0, str(Path(__file__).parent))
from trainer_samples import synthetic_samples  # noqa: E402


def main(model_dir: str, out: str) -> None:
    from agentrl.trainer.actor import MegatronTrainer
    from agentrl.trainer.trainer_config import TrainerConfig

    trainer = MegatronTrainer(model_dir, TrainerConfig(optimizer="sgd", lr=1.0, max_tokens_per_microbatch=64,
                                                       moe={"expert_parallel_size": 2}))
    local = [n for n in trainer.gpt.state_dict() if n.startswith("decoder.layers.0.mlp.experts.local_experts.")
             and n.endswith("linear_fc1.weight")]
    batch = synthetic_samples(n_groups=2, per_group=4, seed=3)
    logprobs = trainer.compute_logprobs(batch)
    metrics = trainer.train_step(batch)
    weights = dict(trainer.export_hf_named_tensors())  # every rank iterates: the experts are all-gathered
    if dist.get_rank() == 0:
        torch.save({"local_experts_per_layer": len(local), "logprobs": logprobs, "metrics": metrics,
                    "weights": weights}, out)
    dist.barrier()
