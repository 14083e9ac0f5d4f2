"""The session's one two-rank torchrun launch (tests/trainer/two_rank_worker.py), shared by
test_distributed.py, test_checkpoint_dist.py and test_moe_ep.py; it runs only the parts whose files were
collected, so a single file's run pays for its own part alone."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).parent
REPO = HERE.parent.parent
PARTS = {"test_distributed.py": "dist", "test_checkpoint_dist.py": "ckpt", "test_moe_ep.py": "ep"}


def _qwen3_untied(path: Path) -> Path:
    """Untied embeddings (output_layer sharded separately) and q/k norms, head_dim != hidden/heads."""
    import torch
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


@pytest.fixture(scope="session")
def two_ranks(request, tmp_path_factory) -> dict:
    """Runs the launch; returns ROOT and the model dirs: ``{"root", "tiny", "qwen3", "moe"}`` (those used)."""
    from agentrl.engine.launch import free_port
    from agentrl.models.tiny import make_tiny_model

    wanted = {PARTS[Path(str(item.fspath)).name] for item in request.session.items
              if Path(str(item.fspath)).name in PARTS}
    root = tmp_path_factory.mktemp("two_ranks")
    out: dict = {"root": root}
    parts = []
    if wanted & {"dist", "ckpt"}:
        out["tiny"] = make_tiny_model(root / "tiny", seed=0)
    if "dist" in wanted:
        out["qwen3"] = _qwen3_untied(root / "qwen3")
        parts.append(f"dist={out['tiny']},{out['qwen3']}")
    if "ckpt" in wanted:
        parts.append(f"ckpt={out['tiny']}")
    if "ep" in wanted:
        out["moe"] = make_tiny_model(root / "moe", seed=0, arch="qwen3_moe")
        parts.append(f"ep={out['moe']}")
    for sub in ("dist", "ckpt"):
        (root / sub).mkdir()
    env = {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
           "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr", "127.0.0.1",
           "--master_port", str(free_port()), str(HERE / "two_rank_worker.py"), str(root), *parts]
    proc = subprocess.run(cmd, env=env, cwd=REPO, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return out
