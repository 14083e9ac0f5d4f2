"""Invariants 1-6 of the trajectory contract, property-tested over hypothesis-generated sessions."""

from __future__ import annotations

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st
from trajectory_sim import SETTINGS, simulate

from agentrl.trajectory import (
    MODEL,
    SOURCES,
    Provenance,
    ProvenanceError,
    Sample,
    TokenProvenance,
    TrajectoryManager,
    verify,
    verify_session,
)

POLICIES = st.sampled_from(["realign", "fork", "truncate"])


def _run(data, *, allow_drift=True, allow_branch=True):
    policy = data.draw(POLICIES, label="policy")
    manager = TrajectoryManager(
        policy=policy, fork_threshold_tokens=data.draw(st.integers(0, 6), label="threshold")
    )
    session = simulate(data, manager, allow_drift=allow_drift, allow_branch=allow_branch)
    budget = data.draw(st.sampled_from([0, 0, 0, 5, 12, 30]), label="max_sample_tokens")
    samples = manager.get_trajectory("s", reward=1.0, max_sample_tokens=budget)
    return policy, session, samples, budget


def check_contract(samples: list[Sample], turns) -> None:
    """Invariants 1, 2, 3 and 5, checked here without using verify()."""
    trained_where: dict[int, int] = {}
    for index, s in enumerate(samples):
        n, rs = len(s.tokens), s.response_start
        # 3. lengths agree
        assert len(s.loss_mask) == len(s.rollout_logprobs) == n - rs
        assert len(s.provenance) == n
        positions_by_turn: dict[int, list[int]] = {}
        for i in range(rs, n):
            prov = s.provenance[i]
            if s.loss_mask[i - rs] != 1:
                assert s.loss_mask[i - rs] == 0
                continue
            # 2. only model tokens are ever trained
            assert prov.source == MODEL, (i, prov)
            # 1. a recorded output token, at its sampled position, with its sampled log-prob
            rec = turns[prov.turn]
            j = i - len(rec.prompt_ids)
            assert 0 <= j < len(rec.output_ids)
            assert tuple(s.tokens[: len(rec.prompt_ids)]) == rec.prompt_ids
            assert tuple(s.tokens[len(rec.prompt_ids) : i + 1]) == rec.output_ids[: j + 1]
            assert s.rollout_logprobs[i - rs] == (rec.output_logprobs[j] if rec.output_logprobs else 0.0)
            # the version that drew this very token (a resumed turn's tail: the next version's)
            spans = rec.weight_version_spans or ((0, rec.weight_version),)
            assert prov.weight_version == [v for start, v in spans if start <= j][-1]
            positions_by_turn.setdefault(prov.turn, []).append(j)
        # 5. a turn is trained at most once: one sample, each of its output offsets once
        for turn, offsets in positions_by_turn.items():
            assert turn not in trained_where, (
                f"turn {turn} trained in samples {trained_where[turn]} and {index}"
            )
            trained_where[turn] = index
            assert offsets == list(range(len(offsets)))
        # no non-model source carries a trained bit
        for run in s.provenance.runs:
            if run.source != MODEL:
                assert not any(s.loss_mask[max(run.start, rs) - rs : max(run.end, rs) - rs])


@SETTINGS
@given(st.data())
def test_invariants_1_2_3_5_hold_for_every_session(data):
    _, session, samples, _ = _run(data)
    assert samples
    check_contract(samples, session.turns)


@SETTINGS
@given(st.data())
def test_invariant_4_exact_extension_loses_nothing(data):
    policy, session, samples, budget = _run(data, allow_drift=False, allow_branch=False)
    assert len(samples) == 1
    (s,) = samples
    assert s.metadata["outcomes"][1:] == ["clean"] * (len(session.turns) - 1)
    last = session.turns[-1]
    assert tuple(s.tokens) == (last.prompt_ids + last.output_ids)[: budget or None]
    if budget == 0:
        assert sum(s.loss_mask) == sum(len(t.output_ids) for t in session.turns)
        assert s.metadata["trained_turns"] == [i for i, t in enumerate(session.turns) if t.output_ids]
    check_contract(samples, session.turns)


@SETTINGS
@given(st.data())
def test_invariant_6_verify_accepts_every_emitted_sample(data):
    _, session, samples, _ = _run(data)
    verify_session(samples, session.turns)
    for s in samples:  # and after a JSON round trip
        copy = Sample.from_json(s.to_json())
        assert copy == s
        verify(copy, session.turns)


def _corrupt(data, s: Sample, n_turns: int) -> tuple[Sample, int, str]:
    d = s.to_dict()
    n, rs = len(s.tokens), s.response_start
    kinds = ["token", "source", "turn", "weight_version"] + (["mask", "logprob"] if n > rs else [])
    kind = data.draw(st.sampled_from(kinds), label="corruption")
    i = data.draw(st.integers(rs if kind in ("mask", "logprob") else 0, n - 1), label="position")
    entries = list(s.provenance)
    if kind == "token":
        d["tokens"][i] = d["tokens"][i] + data.draw(st.integers(1, 5), label="delta")
    elif kind == "mask":
        d["loss_mask"][i - rs] = 1 - d["loss_mask"][i - rs]
    elif kind == "logprob":
        old = d["rollout_logprobs"][i - rs]
        d["rollout_logprobs"][i - rs] = data.draw(st.floats(-20, 0).filter(lambda x: x != old), label="lp")
    else:
        source, turn, wv = entries[i]
        if kind == "source":
            source = data.draw(st.sampled_from([x for x in SOURCES if x != source]), label="source")
        elif kind == "turn":
            turn = data.draw(st.integers(0, n_turns + 1).filter(lambda x: x != entries[i].turn), label="turn")
        else:
            wv = data.draw(st.sampled_from([x for x in (None, "v0", "v1", "v9") if x != wv]), label="wv")
        entries[i] = TokenProvenance(source, turn, wv)
        d["provenance"] = Provenance.from_entries(entries).to_list()
    return Sample.from_dict(d), i, kind


@SETTINGS
@given(st.data())
def test_invariant_6_verify_rejects_every_single_token_corruption(data):
    _, session, samples, _ = _run(data)
    candidates = [s for s in samples if s.tokens]
    s = data.draw(st.sampled_from(candidates), label="sample")
    bad, i, kind = _corrupt(data, s, len(session.turns))
    with pytest.raises(ProvenanceError) as info:
        verify(bad, session.turns)
    assert info.value.index == i, (kind, str(info.value))


@SETTINGS
@given(st.data())
def test_fork_policy_trains_every_sampled_turn(data):
    manager = TrajectoryManager(policy="fork")
    session = simulate(data, manager)
    samples = manager.get_trajectory("s")
    check_contract(samples, session.turns)
    trained = sum(sum(s.loss_mask) for s in samples)
    assert trained == sum(len(t.output_ids) for t in session.turns)


@SETTINGS
@given(st.data())
def test_realign_policy_only_realigns_inside_the_latest_response(data):
    threshold = data.draw(st.integers(0, 6), label="threshold")
    manager = TrajectoryManager(policy="realign", fork_threshold_tokens=threshold)
    session = simulate(data, manager)
    samples = manager.get_trajectory("s")
    for s in samples:
        assert "cut" not in s.metadata["outcomes"]
        for point in s.metadata["drift_points"]:
            assert point["outcome"] == "realigned"
            k = s.metadata["turns"].index(point["turn"])
            prev = session.turns[s.metadata["turns"][k - 1]]
            held = len(prev.prompt_ids) + len(prev.output_ids)
            assert len(prev.prompt_ids) <= point["position"] < held
            assert held - point["position"] <= threshold
    check_contract(samples, session.turns)


def test_logprobs_are_exact_floats_after_json_round_trip():
    manager = TrajectoryManager()
    from agentrl.trajectory import TurnRecord

    lps = [-1e-12, -math.pi, -123.456789012345678, float("-inf")]
    manager.record_turn(
        "s",
        turn=TurnRecord([5, 6], [7, 8, 9, 10], lps, "stop"),
        prompt_messages=[{"role": "user", "content": "q"}],
        response_message={"role": "assistant", "content": "a"},
    )
    (s,) = manager.get_trajectory("s")
    assert Sample.from_json(s.to_json()).rollout_logprobs == lps


def _walk_and_runs(sample, turns):
    """verify()'s two provers on one sample: the token walk's trained turns (or its error) and the run check's."""
    import importlib

    verify_module = importlib.import_module("agentrl.trajectory.verify")  # the package's ``verify`` is the function

    order, recs = verify_module._merged_turns(sample, turns)
    replay = verify_module._replay(sample, order, recs)
    by_runs = verify_module._verified_by_runs(sample, replay)
    try:
        walked = {replay.owner[i] for i in range(len(sample.tokens)) if verify_module._check_token(sample, replay, i)}
    except ProvenanceError as exc:
        walked = exc
    return walked, by_runs


@SETTINGS
@given(st.data())
def test_the_run_check_accepts_every_emitted_sample_and_no_corruption(data):
    """verify()'s fast path (a run at a time) agrees with its token walk: it proves every sample the manager
    emits, with the same trained turns, and refuses every single-token corruption (the walk then names it)."""
    _, session, samples, _ = _run(data)
    for s in samples:
        walked, by_runs = _walk_and_runs(s, session.turns)
        assert by_runs is not None and by_runs == walked
    candidates = [s for s in samples if s.tokens]
    bad, _, kind = _corrupt(data, data.draw(st.sampled_from(candidates), label="sample"), len(session.turns))
    try:
        walked, by_runs = _walk_and_runs(bad, session.turns)
    except ProvenanceError:  # refused before either prover (metadata, layout)
        return
    assert isinstance(walked, ProvenanceError) and by_runs is None, kind
