"""Routing records (MoE engines): a TurnRecord validates and keeps the experts of each output token, a Sample
carries them for its trained tokens only, JSON round trips keep them, and verify() proves them."""

from __future__ import annotations

import pytest

from agentrl.trajectory import ProvenanceError, Sample, TrajectoryManager, TurnRecord, verify

MSG = [{"role": "user", "content": "q"}]


def _answer(output_ids, routed):
    return {"output_ids": output_ids, "meta_info": {
        "finish_reason": {"type": "stop"}, "weight_version": "v1", "routed_experts": routed,
        "output_token_logprobs": [[-0.5, t, None] for t in output_ids]}}


def test_generate_answer_routing_is_parsed_and_round_trips():
    rec = TurnRecord.from_generate_response([1, 2], _answer([7, 8], [[0, 3, 1, 2], [5, 4, 6, 7]]))
    assert rec.routed_experts == ((0, 3, 1, 2), (5, 4, 6, 7))
    assert TurnRecord.from_dict(rec.to_dict()) == rec
    plain = TurnRecord.from_generate_response([1, 2], _answer([7, 8], None))
    assert plain.routed_experts is None and "routed_experts" not in plain.to_dict()


@pytest.mark.parametrize(("routed", "error"), [
    ([[0, 1]], "2 output ids"),  # one entry short
    ([[0, 1], [2]], "same"),  # ragged
    ([[0, 1], [-1, 2]], "negative"),
    ([[0, 1], [1.0, 2]], "int"),
    ([[], []], "non-zero"),
    ("0,1", "list of expert-id lists"),
])
def test_bad_routing_is_refused(routed, error):
    with pytest.raises((ValueError, TypeError), match=error):
        TurnRecord([1, 2], [7, 8], [-0.5, -0.5], "stop", routed_experts=routed)


def _session():
    manager = TrajectoryManager()
    first = TurnRecord([1, 2, 3], [7, 8], [-0.1, -0.2], "stop", routed_experts=[[0, 1], [2, 3]])
    second = TurnRecord([1, 2, 3, 7, 8, 4, 5], [9], [-0.3], "stop", routed_experts=[[4, 5]])
    for rec in (first, second):
        manager.record_turn("s", turn=rec, prompt_messages=MSG, response_message={"role": "assistant", "content": "a"})
    return manager, [first, second]


def test_sample_carries_routing_for_trained_tokens_only():
    manager, turns = _session()
    (sample,) = manager.get_trajectory("s")
    # response: 7 8 (turn 0, trained), 4 5 (context, not trained), 9 (turn 1, trained)
    assert sample.loss_mask == [1, 1, 0, 0, 1]
    assert sample.routed_experts == [[0, 1], [2, 3], None, None, [4, 5]]
    verify(sample, turns)
    again = Sample.from_json(sample.to_json())
    assert again.routed_experts == sample.routed_experts
    verify(again, turns)


def test_verify_refuses_forged_or_misplaced_routing():
    manager, turns = _session()
    (sample,) = manager.get_trajectory("s")
    sample.routed_experts[1] = [3, 2]
    with pytest.raises(ProvenanceError, match="routed experts"):
        verify(sample, turns)
    sample.routed_experts[1], sample.routed_experts[2] = [2, 3], [0, 0]  # a context token with routing
    with pytest.raises(ProvenanceError, match="routed experts"):
        verify(sample, turns)
    sample.routed_experts = sample.routed_experts[:-1]
    with pytest.raises(ProvenanceError, match="must cover"):
        verify(sample, turns)


def test_sample_without_routing_is_unchanged():
    manager = TrajectoryManager()
    manager.record_turn("s", turn=TurnRecord([1, 2], [7], [-0.1], "stop"), prompt_messages=MSG,
                        response_message={"role": "assistant", "content": "a"})
    (sample,) = manager.get_trajectory("s")
    assert sample.routed_experts is None and "routed_experts" not in sample.to_dict()


def test_sample_dict_with_bad_routing_is_refused():
    manager, _ = _session()
    (sample,) = manager.get_trajectory("s")
    data = sample.to_dict()
    with pytest.raises(ValueError, match="inconsistent lengths"):
        Sample.from_dict({**data, "routed_experts": data["routed_experts"][:-1]})
    with pytest.raises(ValueError, match="routed_experts must be"):
        Sample.from_dict({**data, "routed_experts": [[0, "1"]] * 5})
