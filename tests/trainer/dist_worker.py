"""The ``dist`` part of tests/trainer/two_rank_worker.py (``torchrun --nproc_per_node 2``, gloo, CPU), for
tests/trainer/test_distributed.py.

One launch checks, in order: TP=2 logits vs HF, TP=2 export of HF tensors, one TP=2 train step; then the
parallel state is rebuilt as DP=2 and the same step runs again. Rank 0 saves everything to OUT/results.pt.
"""

from __future__ import annotations

import sys
import warnings
from pathlib import Path

warnings.filterwarnings("ignore")


def _full_logits(trainer, ids):
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state

    pos = torch.arange(ids.shape[1])[None].expand_as(ids)
    with torch.no_grad():
        local = trainer.gpt(ids, pos, None)
    parts = [torch.empty_like(local) for _ in range(trainer.tp_size)]
    dist.all_gather(parts, local.contiguous(), group=parallel_state.get_tensor_model_parallel_group())
    return torch.cat(parts, dim=-1)


def run(model_dirs: list[str], out: Path) -> None:
    import torch
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM

    sys.path.insert(0, str(Path(__file__).parent))
    from trainer_samples import synthetic_samples

    from agentrl.trainer.actor import MegatronTrainer
    from agentrl.trainer.trainer_config import TrainerConfig

    results: dict = {"logit_diff": {}, "export_equal": {}}
    batch = synthetic_samples(n_groups=2, per_group=4, seed=3)
    # SGD with lr 1: the weight change is the (clipped) gradient, so weights compare gradients.
    cfg = dict(optimizer="sgd", lr=1.0, max_tokens_per_microbatch=64, attention="sdpa")
    for d in model_dirs:
        trainer = MegatronTrainer(d, TrainerConfig(tp_size=2, **cfg))
        ids = torch.randint(0, trainer.shape.vocab_size, (2, 21), generator=torch.Generator().manual_seed(0))
        hf = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval()
        with torch.no_grad():
            ref = hf(ids).logits
        results["logit_diff"][d] = (_full_logits(trainer, ids) - ref).abs().max().item()
        exported = dict(trainer.export_hf_named_tensors())
        hf_sd = hf.state_dict()
        results["export_equal"][d] = all(torch.equal(exported[k], hf_sd[k]) for k in exported)

    d = model_dirs[0]
    trainer = MegatronTrainer(d, TrainerConfig(tp_size=2, **cfg))
    results["tp2_logprobs"] = trainer.compute_logprobs(batch)
    results["tp2_metrics"] = trainer.train_step(batch)
    results["tp2_weights"] = dict(trainer.export_hf_named_tensors())

    trainer = MegatronTrainer(d, TrainerConfig(tp_size=1, **cfg))  # world 2 -> DP=2
    assert trainer.dp_size == 2
    results["dp2_metrics"] = trainer.train_step(batch)
    results["dp2_weights"] = dict(trainer.export_hf_named_tensors())

    # Megatron's distributed optimizer (Adam only; grads reduce-scattered over gloo): same loss and norm.
    dist_cfg = dict(cfg, optimizer="adam", lr=1e-3, use_distributed_optimizer=True)
    results["dp2_distopt_metrics"] = MegatronTrainer(d, TrainerConfig(**dist_cfg)).train_step(batch)

    if dist.get_rank() == 0:
        torch.save(results, out / "results.pt")
    dist.barrier()
