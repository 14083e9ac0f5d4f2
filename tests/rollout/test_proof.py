"""Where the batch is built, every Sample is re-proved against its turn records; a tampered one is
refused with a counted reason and never reaches the buffer. Tested as an attacker would tamper."""

from __future__ import annotations

import dataclasses

import pytest

from agentrl.rollout.proof import RecordingTrajectoryManager, prove_groups
from agentrl.trajectory import Sample, TurnRecord

USER = {"role": "user", "content": "q"}
ANSWER = {"role": "assistant", "content": "a"}
TOOL = {"role": "tool", "content": "t"}


def _session(manager: RecordingTrajectoryManager, session_id: str, group: str) -> list[Sample]:
    # Two turns whose prompts extend each other exactly: one sample, both turns trained.
    first = TurnRecord(prompt_ids=(1, 5, 6), output_ids=(7, 8, 2), output_logprobs=(-0.1, -0.2, -0.3),
                       finish_reason="stop", weight_version="3")
    manager.record_turn(session_id, turn=first, prompt_messages=[USER], response_message=ANSWER)
    second = TurnRecord(prompt_ids=(1, 5, 6, 7, 8, 2, 9, 9), output_ids=(4, 2), output_logprobs=(-0.5, -0.6),
                        finish_reason="stop", weight_version="3")
    manager.record_turn(session_id, turn=second, prompt_messages=[USER, ANSWER, TOOL], response_message=ANSWER)
    return manager.get_trajectory(session_id, reward=1.0, group_id=group)


@pytest.fixture()
def batch() -> tuple[list[list[Sample]], RecordingTrajectoryManager]:
    manager = RecordingTrajectoryManager()
    groups = [[s for sid in ("a", "b") for s in _session(manager, f"{g}-{sid}", g)] for g in ("g0", "g1")]
    return groups, manager


def test_an_honest_batch_passes_whole_and_reports_its_cost(batch) -> None:
    groups, manager = batch
    kept, metrics, messages = prove_groups(groups, manager.emitted)
    assert kept == groups and messages == []
    assert metrics["verify/samples"] == 4 and metrics["verify/refused"] == 0 and metrics["verify/seconds"] >= 0


def _tamper(sample: Sample, **changes) -> Sample:
    return dataclasses.replace(sample, **changes)


@pytest.mark.parametrize("attack", ["train_a_tool_token", "forge_a_logprob", "swap_a_token", "drop_records"])
def test_a_tampered_sample_is_refused_counted_and_its_group_keeps_the_rest(batch, attack) -> None:
    groups, manager = batch
    victim = groups[0][1]
    records = dict(manager.emitted)
    if attack == "train_a_tool_token":  # the tool result tokens 9, 9 sit at response offsets 3, 4
        mask = list(victim.loss_mask)
        mask[3] = 1
        groups[0][1] = _tamper(victim, loss_mask=mask)
    elif attack == "forge_a_logprob":
        groups[0][1] = _tamper(victim, rollout_logprobs=[-0.01] + list(victim.rollout_logprobs[1:]))
    elif attack == "swap_a_token":
        groups[0][1] = _tamper(victim, tokens=victim.tokens[:-2] + [3] + victim.tokens[-1:])
    else:
        del records[victim.session_id]
    kept, metrics, messages = prove_groups(groups, records)
    assert metrics["verify/refused"] == 1 and len(messages) == 1 and victim.session_id in messages[0]
    reasons = [k for k in metrics if k.startswith("verify/refused/")]
    assert len(reasons) == 1 and metrics[reasons[0]] == 1
    assert [len(g) for g in kept] == [1, 2]
    assert all(s.session_id != victim.session_id for g in kept for s in g)


def test_a_group_whose_every_sample_is_refused_is_dropped(batch) -> None:
    groups, _ = batch
    kept, metrics, _ = prove_groups(groups, {})
    assert kept == [] and metrics["verify/refused"] == 4
