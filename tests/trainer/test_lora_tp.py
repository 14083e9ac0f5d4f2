"""LoRA under tensor parallelism: two gloo ranks (one torchrun launch) with column-parallel A replicated /
B split and row-parallel A split / B replicated train the same adapters as one rank in this process, and
their checkpoint reloads every rank's slice."""

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
# SGD with lr 1 (clipped at norm 1): the adapters' change is their gradient, so adapters compare gradients.
# Two steps: the first trains only B (B = 0 gives A no gradient), the second A through the new B.
CONFIG = dict(optimizer="sgd", lr=1.0, max_tokens_per_microbatch=64, attention="sdpa",
              lora={"rank": 4, "alpha": 8.0})


def BATCHES() -> list[list[dict]]:  # noqa: N802 (a constant the worker imports; fresh dicts each call)
    return [synthetic_samples(n_groups=2, per_group=4, seed=s) for s in (3, 4)]


@pytest.fixture(scope="module")
def tp2(tmp_path_factory):
    from agentrl.models.tiny import make_tiny_model

    root = tmp_path_factory.mktemp("lora_tp")
    tiny = make_tiny_model(root / "tiny", seed=0)
    env = {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
           "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr", "127.0.0.1",
           "--master_port", str(free_port()), str(HERE / "lora_tp_worker.py"), str(root), str(tiny)]
    proc = subprocess.run(cmd, env=env, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return tiny, torch.load(root / "results.pt", weights_only=False)


@pytest.fixture(scope="module")
def tp1(tp2):
    from agentrl.trainer.actor import MegatronTrainer
    from agentrl.trainer.trainer_config import TrainerConfig

    trainer = MegatronTrainer(tp2[0], TrainerConfig(**CONFIG))
    metrics = [trainer.train_step(batch) for batch in BATCHES()]
    return trainer, metrics


def test_tp2_lora_trains_the_same_adapters_as_tp1(tp2, tp1):
    _, res = tp2
    trainer, metrics = tp1
    for got, ref in zip(res["metrics"], metrics, strict=True):
        for key in ("loss", "entropy", "grad_norm"):  # fp32; TP sums the same products in another order
            assert got[key] == pytest.approx(ref[key], abs=1e-5), (key, got[key], ref[key])
    adapters = list(trainer.export_adapter_tensors())
    assert [n for n, _, _ in adapters] == [n for n, _, _ in res["adapters"]]
    for (name, a, b), (_, a2, b2) in zip(adapters, res["adapters"], strict=True):
        assert a.shape == a2.shape and b.shape == b2.shape, name
        assert (a - a2).abs().max() < 1e-5 and (b - b2).abs().max() < 1e-5, name
        assert b.abs().max() > 0, name  # trained (non-vacuous)
    trained_a = {n: a for n, a, _ in adapters}
    assert any((trained_a[n] - a).abs().max() > 0 for n, a, _ in res["init"])  # step 2 trained A through B
    lp = trainer.compute_logprobs(BATCHES()[0])
    for x, y in zip(lp, res["logprobs"], strict=True):
        assert max(abs(p - q) for p, q in zip(x, y, strict=True)) < 1e-5
    merged = dict(trainer.export_hf_named_tensors())
    assert max((res["merged"][k] - w).abs().max().item() for k, w in merged.items()) < 1e-5


def test_tp2_checkpoint_holds_every_ranks_slice(tp2):
    _, res = tp2
    for (name, a, b), (_, a2, b2) in zip(res["adapters"], res["reloaded"], strict=True):
        assert torch.equal(a, a2) and torch.equal(b, b2), name

