"""The one-step-off ``async`` loop and ``fully_async`` end to end at toy size (warm-up, smg, embedded
engine, Megatron, weight sync): every step row says how stale its trained tokens were, every trained
token is proven, and the staleness is what each schedule promises."""

from __future__ import annotations

import json

import pytest

from agentrl.run.cli import main

pytestmark = [pytest.mark.timeout(900), pytest.mark.slow]

CONFIG = "examples/arithmetic/config.yaml"


def small(cache) -> list[str]:
    """The warm-up settings are conftest.py's arith_small ones: the same cache key, so its warm model."""
    return ["--cache_dir", str(cache), "--warmup.max_steps", "4", "--warmup.check_every", "2",
            "--warmup.num_conversations", "64", "--rollout.num_engines", "1", "--rollout.prompts_per_step", "2",
            "--rollout.samples_per_prompt", "4", "--rollout.max_new_tokens", "16", "--eval.every", "100",
            "--eval.num_tasks", "8", "--group_filter", "agentrl.rollout.buffer:keep_all", "--log_samples", "0"]


def step_rows(out) -> list[dict]:
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    # the shared cache's warm model (its warm-up settings kept in step): only the cached history rows
    assert all(r.get("cached") for r in rows if "warmup_step" in r)
    return [r for r in rows if "step" in r and r["step"] > 0]


@pytest.fixture(scope="module")
def cache(arith_first_run):
    return arith_first_run["cache"]  # the warm model of test_train_loop.py's first run (conftest.py): no warm-up here


def test_one_step_off_async_loop_trains_every_batch_one_version_late(tmp_path, cache) -> None:
    out = tmp_path / "async"
    assert main([CONFIG, "--output-dir", str(out), "--steps", "3", "--schedule", "async", *small(cache)]) == 0
    rows = step_rows(out)
    assert [r["step"] for r in rows] == [1, 2, 3]
    # one step off: the first batch was sampled by the weights it trains, every later one a version behind
    assert [r["rollout/staleness_max"] for r in rows] == [0.0, 1.0, 1.0]
    for r in rows:
        assert r["rollout/unproven_trained_tokens"] == 0 and r["verify/refused"] == 0
        assert r["rollout/episodes"] == 8 and r["train/n_samples"] >= 8


def test_fully_async_loop_keeps_the_staleness_bound_with_aborted_turns(tmp_path, cache) -> None:
    out = tmp_path / "fully_async"
    assert main([CONFIG, "--output-dir", str(out), "--steps", "4", "--schedule", "fully_async", "--max_staleness", "1",
                 "--partial_rollout", "abort", "--rollout.concurrency", "16", *small(cache)]) == 0
    rows = step_rows(out)
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    for r in rows:
        assert 0 <= r["rollout/staleness_max"] <= 1  # the bound, per trained token
        assert r["rollout/unproven_trained_tokens"] == 0 and r["verify/refused"] == 0
        assert r["rollout/groups_considered"] == 2 and r["train/n_samples"] >= 8
        lags = {k: v for k, v in r.items() if k.startswith("rollout/staleness_hist/")}
        assert set(lags) <= {"rollout/staleness_hist/0", "rollout/staleness_hist/1"}
        assert sum(lags.values()) == r["rollout/trained_tokens"]  # every trained token has a known version
    assert "eval_accuracy" in rows[-1]
