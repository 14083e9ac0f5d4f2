"""`agentrl train examples/search_r1/config.yaml` at toy size: warm-up on expert chats, two GRPO steps with
real BM25 searches through the engines, held-out exact match and search calls per episode in the rows."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

pytest.importorskip("countryinfo")
pytest.importorskip("bm25s")

from agentrl.run.cli import main  # noqa: E402

pytestmark = [pytest.mark.timeout(900), pytest.mark.slow]

REPO = Path(__file__).resolve().parents[2]
CONFIG = REPO / "examples" / "search_r1" / "config.yaml"


def test_the_example_trains_two_grpo_steps(tmp_path, monkeypatch) -> None:
    # The Ray actors import examples.search_r1 too: they inherit the environment, not this sys.path.
    monkeypatch.setenv("PYTHONPATH", f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    out = tmp_path / "run"
    toy = ["--cache_dir", str(tmp_path / "cache"), "--steps", "2", "--warmup.max_steps", "4",
           "--warmup.check_every", "2", "--warmup.num_conversations", "32", "--warmup.batch_size", "8",
           "--rollout.num_engines", "1", "--rollout.prompts_per_step", "2", "--rollout.samples_per_prompt", "4",
           "--eval.every", "2", "--eval.num_tasks", "4"]
    assert main([str(CONFIG), "--output-dir", str(out), *toy]) == 0
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "step" in r]
    assert [r["step"] for r in steps] == [0, 1, 2]
    assert "eval_accuracy" in steps[0] and "eval_accuracy" in steps[2]  # step 0 is the warm model
    assert 0 <= steps[2]["eval_accuracy"] <= 1 and steps[2]["eval_episodes"] == 4
    for r in steps[1:]:
        assert r["rollout/episodes"] == 8 and r["rollout/failed"] == 0
        assert r["rollout/unproven_trained_tokens"] == 0
        assert r["rollout/tool_calls_mean"] >= 0  # searches per episode (search is the only tool)
    assert (out / "reward_curve.png").stat().st_size > 0
