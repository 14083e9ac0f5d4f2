"""pass@k's unbiased estimator (Chen et al. 2021) and the per-family summary with confidence intervals."""

from __future__ import annotations

import itertools
import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from agentrl.rollout.passk import (
    ALL,
    flat_metrics,
    headline,
    ks_up_to,
    mean_ci,
    pass_at_k,
    run_metrics,
    summarize,
)


@st.composite
def n_c_k(draw):
    n = draw(st.integers(1, 60))
    return n, draw(st.integers(0, n)), draw(st.integers(1, n))


@given(n_c_k())
def test_pass_at_k_is_one_minus_the_binomial_ratio(nck) -> None:
    n, c, k = nck
    exact = 1.0 - math.comb(n - c, k) / math.comb(n, k)
    assert pass_at_k(n, c, k) == pytest.approx(exact, abs=1e-12)  # a product of floats, not the exact ratio


@given(n_c_k())
def test_pass_at_k_grows_with_k_and_with_passes(nck) -> None:
    n, c, k = nck
    value = pass_at_k(n, c, k)
    assert 0.0 <= value <= 1.0
    if k < n:
        assert pass_at_k(n, c, k + 1) >= value - 1e-12
    if c < n:
        assert pass_at_k(n, c + 1, k) >= value - 1e-12


@given(st.integers(1, 60).flatmap(lambda n: st.tuples(st.just(n), st.integers(0, n))))
def test_pass_at_1_is_the_pass_rate_and_the_ends_are_exact(nc) -> None:
    n, c = nc
    assert pass_at_k(n, c, 1) == pytest.approx(c / n, abs=1e-12)
    assert pass_at_k(n, 0, 1) == 0.0
    assert pass_at_k(n, n, n) == 1.0
    assert pass_at_k(n, c, n) == (1.0 if c else 0.0)


@given(st.lists(st.booleans(), min_size=1, max_size=8), st.integers(1, 8))
def test_pass_at_k_is_the_mean_over_every_draw_of_k(outcomes, k) -> None:
    """Unbiased by construction: the average, over all k-subsets, of "some episode of the subset passed"."""
    n = len(outcomes)
    k = min(k, n)
    subsets = list(itertools.combinations(outcomes, k))
    assert pass_at_k(n, sum(outcomes), k) == pytest.approx(sum(any(s) for s in subsets) / len(subsets), abs=1e-12)


@pytest.mark.parametrize("n, c, k", [(0, 0, 1), (4, 5, 1), (4, -1, 1), (4, 2, 0), (4, 2, 5)])
def test_impossible_counts_are_refused(n, c, k) -> None:
    with pytest.raises(ValueError, match="pass@k needs"):
        pass_at_k(n, c, k)


def test_ks_reported() -> None:
    assert ks_up_to(1) == [1]
    assert ks_up_to(4) == [1, 2, 4]
    assert ks_up_to(6) == [1, 2, 4, 6]
    with pytest.raises(ValueError):
        ks_up_to(0)


@given(st.lists(st.floats(0, 1), min_size=1, max_size=50))
def test_the_interval_holds_the_mean_inside_the_range(values) -> None:
    mean, lo, hi = mean_ci(values)
    assert 0.0 <= lo <= mean + 1e-12 and mean - 1e-12 <= hi <= 1.0


def test_summary_per_family_with_failed_episodes() -> None:
    rewards = [[1.0, 0.0, 0.0, 0.0], [0.0, 0.0, None, 0.0], [1.0, 1.0, 1.0, 1.0]]
    out = summarize(rewards, ["add", "add", "mul"])
    assert set(out) == {ALL, "add", "mul"}
    assert out["add"]["pass@1"] == pytest.approx((0.25 + 0.0) / 2)
    assert out["add"]["pass@4"] == pytest.approx(0.5)
    assert out["mul"]["pass@2"] == 1.0 and out["mul"]["pass@2_ci_low"] == 1.0  # one task: no width
    assert out[ALL]["pass@4"] == pytest.approx(2 / 3)
    assert out[ALL]["failed_episodes"] == 1.0 and out["add"]["failed_episodes"] == 1.0
    assert out[ALL]["mean@4"] == pytest.approx((0.25 + 0.0 + 1.0) / 3)  # a failed episode scores 0
    assert out[ALL]["pass@4_ci_low"] < out[ALL]["pass@4"] < out[ALL]["pass@4_ci_high"]


def test_threshold_decides_a_pass() -> None:
    assert summarize([[0.6, 0.4]], [ALL], threshold=0.5)[ALL]["pass@1"] == pytest.approx(0.5)
    assert summarize([[0.6, 0.4]], [ALL])[ALL]["pass@2"] == 0.0


@pytest.mark.parametrize("rewards, families", [([], []), ([[1.0]], []), ([[1.0], [1.0, 0.0]], ["a", "b"]), ([[]], ["a"])])
def test_ragged_or_empty_input_is_refused(rewards, families) -> None:
    with pytest.raises(ValueError):
        summarize(rewards, families)


def test_metric_names_of_a_run_and_of_the_command() -> None:
    result = {"greedy": summarize([[1.0], [0.0]], ["a", "b"]), "sampled": summarize([[1.0, 0.0], [0.0, 0.0]], ["a", "b"])}
    row = run_metrics(result)
    assert row["eval_accuracy"] == 0.5 and row["eval_episodes"] == 2.0
    assert row["eval/sampled/pass@2"] == 0.5 and row["eval/sampled/a/pass@2"] == 1.0
    assert row["eval/greedy/b/pass@1"] == 0.0
    assert flat_metrics(result).keys() <= row.keys()
    top = headline(result)
    assert top["pass@1"] == 0.25 and top["pass@2"] == 0.5 and top["greedy_accuracy"] == 0.5


def test_the_run_config_names_the_evaluation() -> None:
    from agentrl.run.config import load_config

    cfg = load_config(None, ["--eval.k", "4", "--rollout.temperature", "0.3", "--eval.family_key", "kind"])
    assert cfg.eval.passk(cfg.rollout.temperature) == {"k": 4, "temperature": 0.3, "family_key": "kind", "threshold": 1.0}
    assert load_config(None, ["--eval.temperature", "0.9"]).eval.passk(0.3)["temperature"] == 0.9
    with pytest.raises(ValueError, match="eval.k"):
        load_config(None, ["--eval.k", "0"])
