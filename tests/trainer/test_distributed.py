"""TP=2 and DP=2 on two gloo processes (one torchrun launch) agree with TP=1 in this process."""

from __future__ import annotations

import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
from trainer_samples import synthetic_samples

from agentrl.engine.launch import free_port

warnings.filterwarnings("ignore")
HERE = Path(__file__).parent
REPO = HERE.parent.parent


def _qwen3_untied(path: Path) -> Path:
    """Untied embeddings (output_layer sharded separately) and q/k norms, head_dim != hidden/heads."""
    from transformers import AutoModelForCausalLM, Qwen3Config

    cfg = Qwen3Config(vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=24,
                      max_position_embeddings=128, tie_word_embeddings=False)
    torch.manual_seed(2)
    model = AutoModelForCausalLM.from_config(cfg).to(torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
    model.save_pretrained(path, safe_serialization=True)
    return path


@pytest.fixture(scope="module")
def dist_results(tmp_path_factory):
    from agentrl.models.tiny import make_tiny_model

    root = tmp_path_factory.mktemp("dist")
    tiny = make_tiny_model(root / "tiny", seed=0)
    qwen3 = _qwen3_untied(root / "qwen3")
    env = {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
           "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr", "127.0.0.1",
           "--master_port", str(free_port()), str(HERE / "dist_worker.py"), str(root), str(tiny), str(qwen3)]
    proc = subprocess.run(cmd, env=env, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return tiny, qwen3, torch.load(root / "results.pt", weights_only=False)


def test_tp2_logits_match_hf_and_export_is_exact(dist_results):
    tiny, qwen3, res = dist_results
    for d in (str(tiny), str(qwen3)):
        assert res["logit_diff"][d] < 1e-5, (d, res["logit_diff"][d])
        assert res["export_equal"][d], d


def test_tp2_and_dp2_match_tp1(dist_results):
    from agentrl.trainer.actor import MegatronTrainer
    from agentrl.trainer.trainer_config import TrainerConfig

    tiny, _, res = dist_results
    batch = synthetic_samples(n_groups=2, per_group=4, seed=3)
    trainer = MegatronTrainer(tiny, TrainerConfig(optimizer="sgd", lr=1.0, max_tokens_per_microbatch=64, attention="sdpa"))
    lp = trainer.compute_logprobs(batch)
    for a, b in zip(lp, res["tp2_logprobs"], strict=True):
        assert max(abs(x - y) for x, y in zip(a, b, strict=True)) < 1e-5
    ref = trainer.train_step(batch)
    weights = dict(trainer.export_hf_named_tensors())
    for layout in ("tp2", "dp2"):
        got = res[f"{layout}_metrics"]
        for key in ("loss", "entropy", "clip_frac", "grad_norm"):
            assert got[key] == pytest.approx(ref[key], abs=1e-5), (layout, key, got[key], ref[key])
        diff = max((res[f"{layout}_weights"][k] - w).abs().max().item() for k, w in weights.items())
        assert diff < 1e-5, (layout, diff)
    distopt = res["dp2_distopt_metrics"]
    for key in ("loss", "entropy", "grad_norm"):  # measured before the (Adam) update
        assert distopt[key] == pytest.approx(ref[key], abs=1e-5), (key, distopt[key], ref[key])
