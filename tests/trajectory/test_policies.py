"""The decision table, case by case, on small hand-written sessions (token ids are arbitrary ints)."""

from __future__ import annotations

import asyncio

import pytest

from agentrl.trajectory import TrajectoryManager, TurnRecord, trained_turns, verify_session

SYS, USER = {"role": "system", "content": "s"}, {"role": "user", "content": "q"}


def asst(i):
    return {"role": "assistant", "content": f"a{i}"}


def tool(i):
    return {"role": "tool", "content": f"r{i}"}


def lp(n, base=-0.5):
    return [base - j / 10 for j in range(n)]


class Chat:
    """Drives a manager through one session: `turn(prompt, output)` with a linear message history."""

    def __init__(self, manager, sid="s"):
        self.m, self.sid, self.history, self.i = manager, sid, [SYS, USER], 0

    def turn(self, prompt, output, finish="stop", messages=None, version="v0"):
        messages = list(self.history if messages is None else messages)
        outcome = self.m.record_turn(
            self.sid,
            turn=TurnRecord(prompt, output, lp(len(output)), finish, version),
            prompt_messages=messages,
            response_message=asst(self.i),
        )
        self.history = [*messages, asst(self.i), tool(self.i)]
        self.i += 1
        return outcome

    def finish(self, **kw):
        turns = self.m.turns(self.sid)
        samples = self.m.get_trajectory(self.sid, **kw)
        verify_session(samples, turns)
        return samples


# Session skeleton: P0 = [1,2,3]; O0 = [10,11,12]; tool [20]; P1 = P0+O0+[20,1]; O1 = [13,14]; ...
P0, O0 = [1, 2, 3], [10, 11, 12]
P1 = P0 + O0 + [20, 1]
O1 = [13, 14]
HELD1 = P1 + O1  # 10 tokens; O1 sits at positions 8, 9


def _three_turns(policy, p2, threshold=1024):
    chat = Chat(TrajectoryManager(policy=policy, fork_threshold_tokens=threshold))
    assert chat.turn(P0, O0) == "new"
    assert chat.turn(P1, O1) == "clean"
    outcome = chat.turn(p2, [15, 16])
    return outcome, chat.finish(reward=1.0)


def test_clean_session_is_one_fully_trained_sample():
    outcome, (s,) = _three_turns("realign", HELD1 + [21, 1])
    assert outcome == "clean"
    assert s.tokens == HELD1 + [21, 1, 15, 16]
    assert s.response_start == 3
    assert s.loss_mask == [1, 1, 1, 0, 0, 1, 1, 0, 0, 1, 1]
    assert s.rollout_logprobs[:3] == lp(3) and s.rollout_logprobs[-2:] == lp(2)
    assert [p.source for p in s.provenance] == ["prompt"] * 3 + ["model"] * 3 + ["context"] * 2 + [
        "model"
    ] * 2 + ["context"] * 2 + ["model"] * 2
    assert s.metadata["drift"]["clean"] == 2 and s.metadata["trained_turns"] == [0, 1, 2]
    assert s.status == "completed" and s.reward == 1.0


# The latest response [13, 14] re-tokenizes as [99]: drift at position 8, 2 held tokens drifted.
DRIFT_LATEST = P1 + [99] + [21, 1]


@pytest.mark.parametrize(
    ("policy", "threshold", "outcome", "n_samples", "trained"),
    [
        ("realign", 1024, "realigned", 1, [[0, 2]]),
        ("realign", 1, "forked", 2, [[0, 1], [2]]),  # 2 drifted tokens > threshold 1
        ("fork", 1024, "forked", 2, [[0, 1], [2]]),
        ("truncate", 1024, "cut", 1, [[0, 2]]),
    ],
)
def test_drift_inside_latest_response(policy, threshold, outcome, n_samples, trained):
    got, samples = _three_turns(policy, DRIFT_LATEST, threshold)
    assert got == outcome
    assert len(samples) == n_samples
    assert [sorted(trained_turns(s)) for s in samples] == trained
    if outcome != "forked":
        (s,) = samples
        assert s.tokens == DRIFT_LATEST + [15, 16]
        sources = [p.source for p in s.provenance]
        assert sources[8] == "realigned_prompt" and s.loss_mask[8 - 3] == 0
        assert s.metadata["drift_points"] == [{"turn": 2, "position": 8, "outcome": outcome}]
    else:
        first, second = samples
        assert first.tokens == HELD1 and sum(first.loss_mask) == 5
        assert second.tokens == DRIFT_LATEST + [15, 16] and second.response_start == len(DRIFT_LATEST)
        assert second.metadata["forked"] and second.loss_mask == [1, 1]


# An earlier response O0 = [10, 11, 12] re-tokenizes as [10, 98]: drift at position 4.
DRIFT_EARLIER = P0 + [10, 98] + [20, 1] + O1 + [21, 1]


@pytest.mark.parametrize(
    ("policy", "outcome", "trained", "tokens_trained"),
    [
        ("realign", "forked", [[0, 1], [2]], 7),
        ("fork", "forked", [[0, 1], [2]], 7),
        # truncate: the cut lands inside turn 0 (un-trained); turn 1 lies wholly after it (lost).
        ("truncate", "cut", [[2]], 2),
    ],
)
def test_drift_inside_an_earlier_response(policy, outcome, trained, tokens_trained):
    got, samples = _three_turns(policy, DRIFT_EARLIER)
    assert got == outcome
    assert [sorted(trained_turns(s)) for s in samples] == trained
    assert sum(sum(s.loss_mask) for s in samples) == tokens_trained
    if policy == "truncate":
        (s,) = samples
        assert s.metadata["untrained_turns"] == [0, 1]
        prov = list(s.provenance)
        # [10] is still turn 0's token at its sampled position but untrained; [98] replaced [11].
        assert prov[3] == ("model", 0, "v0") and prov[4] == ("realigned_prompt", 2, None)
        assert s.loss_mask[:2] == [0, 0]


def test_drift_inside_the_first_prompt():
    drift_prompt = [1, 7, 3] + O0 + [20, 1] + O1 + [21, 1]
    for policy, n in (("realign", 2), ("fork", 2), ("truncate", 1)):
        got, samples = _three_turns(policy, drift_prompt)
        assert len(samples) == n
        if policy == "truncate":
            assert got == "cut"
            assert samples[0].metadata["lost_turns"] == [0, 1]
            assert samples[0].response_start == len(drift_prompt)


def test_rewind_and_branch_give_several_samples_and_train_shared_turns_once():
    chat = Chat(TrajectoryManager())
    chat.turn(P0, O0)
    chat.turn(P1, O1)
    # Retry turn 1 from the same messages: a branch off turn 0, a new sample.
    assert chat.turn(P1, [17, 18], messages=[SYS, USER, asst(0), tool(0)]) == "branched"
    # Continue the first branch after turn 1 (its messages name asst(1)).
    assert (
        chat.turn(HELD1 + [21, 1], [19], messages=[SYS, USER, asst(0), tool(0), asst(1), tool(1)]) == "clean"
    )
    # A summarised history: no recorded response on the path, tokens do not extend: a new sample.
    assert chat.turn([5, 6], [30], messages=[{"role": "user", "content": "summary"}]) == "branched"
    samples = chat.finish()
    assert [s.metadata["turns"] for s in samples] == [[0, 1, 3], [2], [4]]
    assert [sorted(trained_turns(s)) for s in samples] == [[0, 1, 3], [2], [4]]
    # The shared turn 0 appears in the branch as untrained context of its prompt.
    branch = samples[1]
    assert branch.tokens[:6] == P0 + O0 and branch.response_start == len(P1)


def test_token_extension_is_accepted_when_messages_were_reformatted():
    chat = Chat(TrajectoryManager())
    chat.turn(P0, O0)
    other = [SYS, USER, {"role": "assistant", "content": "a0 (reformatted)"}, tool(0)]
    assert chat.turn(P1, O1, messages=other) == "clean"
    (s,) = chat.finish()
    assert sorted(trained_turns(s)) == [0, 1]


def test_max_sample_tokens_cuts_and_flags():
    chat = Chat(TrajectoryManager())
    chat.turn(P0, O0)
    chat.turn(P1, O1)
    (s,) = chat.finish(max_sample_tokens=9)
    assert s.tokens == HELD1[:9]
    assert s.metadata["truncated"] and s.status == "truncated"
    assert s.loss_mask == [1, 1, 1, 0, 0, 1]  # kept outputs stay trained, as with finish_reason=length


@pytest.mark.parametrize(
    ("finish", "status"), [("stop", "completed"), ("length", "truncated"), ("abort", "aborted")]
)
def test_status_follows_the_last_turn(finish, status):
    chat = Chat(TrajectoryManager())
    chat.turn(P0, O0, finish=finish)
    (s,) = chat.finish()
    assert s.status == status


@pytest.mark.parametrize(
    ("finish", "stop_reason", "status"),
    [("stop", "max_turns", "truncated"), ("stop", "done", "completed"), ("abort", "max_turns", "aborted")],
)
def test_a_limit_that_ended_the_episode_truncates_its_samples(finish, stop_reason, status):
    chat = Chat(TrajectoryManager())
    chat.turn(P0, O0, finish=finish)
    (s,) = chat.m.get_trajectory("s", stop_reason=stop_reason)
    assert s.status == status and s.metadata["stop_reason"] == stop_reason


def test_an_unknown_stop_reason_is_refused_and_keeps_the_session():
    chat = Chat(TrajectoryManager())
    chat.turn(P0, O0)
    with pytest.raises(ValueError, match="not a valid StopReason"):
        chat.m.get_trajectory("s", stop_reason="bored")
    with pytest.raises(ValueError, match="stop_reason"):
        chat.m.get_trajectory("s", extra_metadata={"stop_reason": "done"})
    assert chat.m.has_session("s")


def test_empty_outputs_and_metadata():
    chat = Chat(TrajectoryManager())
    chat.turn(P0, [])
    chat.turn(P0 + [20, 1], [4], version="v7")
    (s,) = chat.m.get_trajectory("s", reward=0.5, extra_metadata={"task": "t1"}, group_id=3)
    assert s.loss_mask == [0, 0, 1] and s.group_id == 3 and s.metadata["task"] == "t1"
    assert s.metadata["weight_versions"] == ["v7"] and s.provenance[-1] == ("model", 1, "v7")


def test_stats_count_outcomes_across_sessions():
    manager = TrajectoryManager()
    for sid, p2 in (("a", HELD1 + [21, 1]), ("b", DRIFT_LATEST), ("c", DRIFT_EARLIER)):
        chat = Chat(manager, sid)
        chat.turn(P0, O0)
        chat.turn(P1, O1)
        chat.turn(p2, [15])
        chat.finish()
    stats = manager.stats
    assert stats["new"] == 3 and stats["clean"] == 4 and stats["realigned"] == 1 and stats["forked"] == 1
    assert stats["samples"] == 4 and stats["turns_untrained"] == 1 and stats["tokens_untrained"] == 2


def test_concurrent_asyncio_sessions_stay_separate():
    manager = TrajectoryManager()

    async def episode(k: int):
        chat = Chat(manager, f"s{k}")
        prompt = [1, 2, k]
        for t in range(4):
            output = [100 + k, 200 + t]
            chat.turn(prompt, output)
            await asyncio.sleep(0)  # interleave with the other episodes
            prompt = prompt + output + [3, 1]
        return chat.finish(reward=float(k))

    async def main():
        return await asyncio.gather(*(episode(k) for k in range(20)))

    results = asyncio.run(main())
    for k, (s,) in enumerate(results):
        assert s.session_id == f"s{k}" and s.reward == k
        assert s.tokens[2] == k and sum(s.loss_mask) == 8
    assert manager.sessions == []


def test_a_message_edited_in_place_is_noticed():
    """The tree reuses keys of unchanged history objects; replacing a sent message's content is a branch."""
    manager = TrajectoryManager(policy="realign")
    a0, t0, a1 = asst(0), tool(0), asst(1)
    history = [SYS, USER]
    manager.record_turn(
        "s", turn=TurnRecord(P0, O0, lp(3), "stop"), prompt_messages=history, response_message=a0
    )
    history += [a0, t0]
    manager.record_turn(
        "s", turn=TurnRecord(P1, O1, lp(2), "stop"), prompt_messages=history, response_message=a1
    )
    t0["content"] = "edited tool result"  # the agent rewrites an old tool result in place
    edited = P0 + O0 + [77, 1] + O1 + [21, 1]  # its tokens changed inside turn 1's context
    history += [a1, tool(1)]
    outcome = manager.record_turn(
        "s", turn=TurnRecord(edited, [5], lp(1), "stop"), prompt_messages=history, response_message=asst(2)
    )
    assert outcome == "branched"  # a stale key would have continued turn 1's sample and forked on drift
    turns = manager.turns("s")
    samples = manager.get_trajectory("s")
    verify_session(samples, turns)
    assert [s.metadata["turns"] for s in samples] == [[0, 1], [2]]
