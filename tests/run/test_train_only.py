"""`agentrl train --train-only`: GRPO steps through Ray trainer actors on saved Samples, without engines."""

from __future__ import annotations

import json
import random

from agentrl.rollout.buffer import save_samples_jsonl
from agentrl.run.cli import main
from agentrl.trajectory import Provenance, Sample, TokenProvenance


def _samples(n_groups: int, per_group: int, seed: int = 0) -> list[Sample]:
    rng = random.Random(seed)
    out = []
    for g in range(n_groups):
        for i in range(per_group):
            prompt, resp = [rng.randrange(3, 1000) for _ in range(6)], [rng.randrange(3, 1000) for _ in range(5)]
            prov = [TokenProvenance("prompt", 0, None)] * 6 + [TokenProvenance("model", 0, "0")] * 5
            out.append(Sample(tokens=prompt + resp, response_start=6, loss_mask=[1] * 5,
                              rollout_logprobs=[-6.9] * 5, provenance=Provenance.from_entries(prov),
                              reward=float(i % 2) if g else 1.0, group_id=f"g{g}"))
    return out


def test_train_only_trains_on_saved_groups_and_drops_zero_variance_ones(tmp_path) -> None:
    path = tmp_path / "samples.jsonl"
    save_samples_jsonl(_samples(n_groups=3, per_group=4), path)  # group g0 has all rewards 1.0
    out = tmp_path / "run"
    assert main(["--train-only", str(path), "--output-dir", str(out), "--cache_dir", str(tmp_path / "cache"),
                 "--steps", "5", "--rollout.prompts_per_step", "1", "--trainer.lr", "1e-3"]) == 0
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]  # two groups with reward variance, one per step
    assert all(r["train/groups_dropped"] == 1 for r in rows)
    assert all(r["train/n_samples"] == 4 and r["train/n_tokens"] == 20 for r in rows)
    assert all(r.get("train/skipped", 0.0) == 0.0 and r["train/grad_norm"] > 0 for r in rows)
