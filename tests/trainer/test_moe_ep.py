"""Expert parallelism 2 over the two data-parallel ranks of a gloo torchrun launch: each rank holds half the
experts, and log-probs, the step and the exported weights equal one process holding them all."""

from __future__ import annotations

import os
import subprocess
import sys
import warnings
from pathlib import Path

import torch
from trainer_samples import synthetic_samples

from agentrl.engine.launch import free_port

warnings.filterwarnings("ignore")
HERE = Path(__file__).parent
REPO = HERE.parent.parent


def test_ep2_matches_one_process(tmp_path):
    from agentrl.models.tiny import make_tiny_model
    from agentrl.trainer.actor import MegatronTrainer
    from agentrl.trainer.trainer_config import TrainerConfig

    model = make_tiny_model(tmp_path / "moe", seed=0, arch="qwen3_moe")
    env = {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
           "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr", "127.0.0.1",
           "--master_port", str(free_port()), str(HERE / "moe_ep_worker.py"), str(model), str(tmp_path / "ep2.pt")]
    proc = subprocess.run(cmd, env=env, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    ep2 = torch.load(tmp_path / "ep2.pt", weights_only=False)
    assert ep2["local_experts_per_layer"] == 4  # 8 experts over 2 ranks

    trainer = MegatronTrainer(model, TrainerConfig(optimizer="sgd", lr=1.0, max_tokens_per_microbatch=64))
    batch = synthetic_samples(n_groups=2, per_group=4, seed=3)
    for a, b in zip(trainer.compute_logprobs(batch), ep2["logprobs"], strict=True):
        assert max(abs(x - y) for x, y in zip(a, b, strict=True)) < 1e-5  # fp32; expert outputs summed apart
    ref = trainer.train_step(batch)
    assert abs(ref["loss"] - ep2["metrics"]["loss"]) < 1e-5
    weights = dict(trainer.export_hf_named_tensors())
    assert set(weights) == set(ep2["weights"])
    for name, w in weights.items():
        assert (w - ep2["weights"][name]).abs().max().item() < 1e-5, name
