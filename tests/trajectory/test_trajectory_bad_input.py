"""Bad input gets a clear exception, and no session (this one or another) changes."""

from __future__ import annotations

import subprocess
import sys

import pytest

from agentrl.trajectory import (
    DriftPolicy,
    Sample,
    TrajectoryManager,
    TurnRecord,
    UnknownSessionError,
    make_policy,
)

SYSTEM = {"role": "system", "content": "sys"}
USER = {"role": "user", "content": "q"}
ANSWER = {"role": "assistant", "content": "a"}


def _record(**overrides):
    fields = {
        "prompt_ids": [1, 2, 3],
        "output_ids": [4, 5],
        "output_logprobs": [-0.5, -0.25],
        "finish_reason": "stop",
    }
    fields.update(overrides)
    return TurnRecord(**fields)


@pytest.mark.parametrize(
    ("overrides", "error", "match"),
    [
        ({"output_logprobs": [-0.5]}, ValueError, "1 entries for 2 output ids"),
        ({"output_logprobs": [-0.5, -0.1, -0.2]}, ValueError, "3 entries for 2 output ids"),
        ({"prompt_ids": []}, ValueError, "prompt_ids is empty"),
        ({"prompt_ids": [1, 2.0]}, TypeError, r"prompt_ids\[1\] must be an int token id, got float"),
        ({"prompt_ids": [1, True]}, TypeError, r"prompt_ids\[1\] must be an int token id, got bool"),
        ({"output_ids": ["4", 5]}, TypeError, r"output_ids\[0\] must be an int token id, got str"),
        ({"output_ids": [4, -5]}, ValueError, r"output_ids\[1\] is not a valid token id \(-5\)"),
        ({"prompt_ids": [1, 2**40]}, ValueError, r"prompt_ids\[1\] is not a valid token id"),
        ({"prompt_ids": "123"}, TypeError, "sequence of int token ids, got str"),
        ({"output_logprobs": [-0.5, "x"]}, TypeError, r"output_logprobs\[1\] must be a float"),
        ({"output_logprobs": [-0.5, float("nan")]}, ValueError, r"output_logprobs\[1\] is NaN"),
        ({"finish_reason": ""}, TypeError, "finish_reason"),
        ({"finish_reason": {"type": "stop"}}, TypeError, "finish_reason"),
        ({"weight_version": 3}, TypeError, "weight_version must be a str"),
    ],
)
def test_turn_record_rejects_bad_fields(overrides, error, match):
    with pytest.raises(error, match=match):
        _record(**overrides)


@pytest.mark.parametrize(
    ("spans", "error", "match"),
    [
        ([], ValueError, "weight_version_spans is empty"),
        ([[1, "0"]], ValueError, "must start at token 0, the first starts at 1"),
        ([[0, "0"], [0, "1"]], ValueError, "starts must strictly increase: 0 after 0"),
        ([[0, "0"], [1, "0"], [1, "1"]], ValueError, "starts must strictly increase: 1 after 1"),  # not hidden by a merge
        ([[0, "0"], [2, "1"]], ValueError, r"weight_version_spans\[1\] starts at 2, outside the 2 output ids"),
        ([[0, "0"], [-1, "1"]], ValueError, "strictly increase: -1 after 0"),
        ([[0, "1"], [1, "0"]], ValueError, "go back from version '1' to '0' at token 1"),
        ([[0, "2"], [1, "warmup"], [1, "1"]], ValueError, "strictly increase"),
        ([[0, 0]], TypeError, r"weight_version_spans\[0\] version must be a str, got int"),
        ([[0.0, "0"]], TypeError, "start must be an int, got float"),
        ([[True, "0"]], TypeError, "start must be an int, got bool"),
        ([[0, "0", "extra"]], ValueError, r"must be a \[start, version\] pair"),
        (["0a"], ValueError, r"must be a \[start, version\] pair"),
        ({"0": "0"}, TypeError, "list of \\[start, version\\] pairs, got dict"),
        ("00", TypeError, "got str"),
        (7, TypeError, "got int"),
    ],
)
def test_turn_record_rejects_bad_weight_version_spans(spans, error, match):
    with pytest.raises(error, match=match):
        _record(weight_version="1", weight_version_spans=spans)


def test_weight_version_spans_give_each_output_token_its_version():
    rec = _record(output_ids=[4, 5, 6], output_logprobs=[], weight_version="1", weight_version_spans=[[0, "0"], [2, "1"]])
    assert [rec.version_at(j) for j in range(3)] == ["0", "0", "1"]
    assert rec.version_runs() == ((0, 2, "0"), (2, 3, "1"))
    # a label version has no order, a step-number one may follow it; equal neighbours are one run
    lab = _record(weight_version="3", weight_version_spans=[[0, "default"], [1, "3"]])
    assert lab.weight_version_spans == ((0, "default"), (1, "3"))
    assert _record(weight_version="1", weight_version_spans=[[0, "0"], [1, "0"]]).weight_version_spans == ((0, "0"),)
    # one run of the turn's own version is the plain record; an empty output has the one run [0, v]
    assert _record(weight_version="1", weight_version_spans=[[0, "1"]]) == _record(weight_version="1")
    assert _record(output_ids=[], output_logprobs=[], weight_version="1",
                   weight_version_spans=[[0, "1"]]).weight_version_spans is None
    with pytest.raises(ValueError, match="outside the 0 output ids"):
        _record(output_ids=[], output_logprobs=[], weight_version="1", weight_version_spans=[[0, "0"], [1, "1"]])


def test_turn_record_is_frozen_and_stores_tuples():
    rec = _record(output_logprobs=[-1, -0.25])
    assert rec.prompt_ids == (1, 2, 3) and rec.output_ids == (4, 5)
    assert rec.output_logprobs == (-1.0, -0.25) and type(rec.output_logprobs[0]) is float
    with pytest.raises(AttributeError):
        rec.prompt_ids = (9,)
    assert _record(output_logprobs=[]).output_logprobs == ()


def test_turn_record_json_round_trip():
    import json

    rec = _record(weight_version="3")
    assert TurnRecord.from_dict(json.loads(json.dumps(rec.to_dict()))) == rec
    resumed = _record(weight_version="3", weight_version_spans=[[0, "2"], [1, "3"]])
    assert TurnRecord.from_dict(json.loads(json.dumps(resumed.to_dict()))) == resumed != rec
    with pytest.raises(ValueError, match="1 entries for 2 output ids"):
        TurnRecord.from_dict({**rec.to_dict(), "output_logprobs": [-1.0]})


def test_turn_record_from_sglang_generate_body():
    body = {
        "text": "hi",
        "output_ids": [7, 8],
        "meta_info": {
            "finish_reason": {"type": "length", "length": 2},
            "weight_version": 3,
            "output_token_logprobs": [[-0.1, 7, None], [-0.2, 8, None]],
        },
    }
    rec = TurnRecord.from_generate_response([1, 2], body)
    assert rec == TurnRecord((1, 2), (7, 8), (-0.1, -0.2), "length", "3")
    body["meta_info"]["weight_version_spans"] = [[0, "2"], [1, "3"]]  # the agentrl engine's resumed turn
    assert TurnRecord.from_generate_response([1, 2], body).weight_version_spans == ((0, "2"), (1, "3"))
    body["meta_info"]["weight_version_spans"] = [[0, "2"], [5, "3"]]
    with pytest.raises(ValueError, match="starts at 5, outside the 2 output ids"):
        TurnRecord.from_generate_response([1, 2], body)
    body["meta_info"]["weight_version_spans"] = None
    body["meta_info"]["output_token_logprobs"][1][1] = 9
    with pytest.raises(ValueError, match="differ from output_ids"):
        TurnRecord.from_generate_response([1, 2], body)


def _manager_with_two_sessions(policy="realign"):
    manager = TrajectoryManager(policy=policy)
    for sid in ("keep", "bad"):
        manager.record_turn(sid, turn=_record(), prompt_messages=[SYSTEM, USER], response_message=ANSWER)
    return manager


def _snapshot(manager, sid):
    return [s.to_dict() for s in TrajectoryManager.get_trajectory(_clone(manager), sid)]


def _clone(manager):
    import copy

    return copy.deepcopy(manager)


@pytest.mark.parametrize(
    ("kwargs", "error"),
    [
        ({"turn": ([1, 2, 3], [4], [-0.1], "stop")}, TypeError),
        ({"prompt_messages": "hello"}, TypeError),
        ({"prompt_messages": [SYSTEM, "user: q"]}, TypeError),
        ({"response_message": "a"}, TypeError),
        ({"metadata": ["not", "a", "mapping"]}, TypeError),
    ],
)
def test_record_turn_rejects_bad_input_and_touches_nothing(kwargs, error):
    manager = _manager_with_two_sessions()
    before = {sid: _snapshot(manager, sid) for sid in ("keep", "bad")}
    stats = manager.stats
    call = {
        "turn": _record(prompt_ids=[1, 2, 3, 4, 5, 6]),
        "prompt_messages": [SYSTEM, USER, ANSWER, USER],
        "response_message": ANSWER,
    }
    call.update(kwargs)
    with pytest.raises(error):
        manager.record_turn("bad", **call)
    assert manager.turn_count("bad") == 1 and manager.turn_count("keep") == 1
    assert {sid: _snapshot(manager, sid) for sid in ("keep", "bad")} == before
    assert manager.stats == stats


@pytest.mark.parametrize("session_id", ["", None, 3, ("a",)])
def test_record_turn_rejects_bad_session_ids(session_id):
    manager = _manager_with_two_sessions()
    with pytest.raises(TypeError, match="session_id"):
        manager.record_turn(session_id, turn=_record(), prompt_messages=[USER], response_message=ANSWER)
    assert manager.sessions == ["keep", "bad"]


def test_unknown_sessions_raise_a_clear_error():
    manager = _manager_with_two_sessions()
    for call in (
        lambda: manager.get_trajectory("nope"),
        lambda: manager.drop_session("nope"),
        lambda: manager.turn_count("nope"),
        lambda: manager.turns("nope"),
    ):
        with pytest.raises(UnknownSessionError, match="unknown session 'nope'"):
            call()
    assert not manager.has_session("nope")
    assert isinstance(UnknownSessionError("x"), KeyError)
    assert manager.sessions == ["keep", "bad"]


def test_sessions_are_consumed_once_and_others_survive():
    manager = _manager_with_two_sessions()
    assert len(manager.get_trajectory("bad", reward=1.0)) == 1
    with pytest.raises(UnknownSessionError, match="already consumed"):
        manager.get_trajectory("bad")
    manager.drop_session("keep")
    assert not manager.has_session("keep")
    with pytest.raises(UnknownSessionError):
        manager.drop_session("keep")


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"reward": "1.0"}, TypeError, "reward"),
        ({"reward": True}, TypeError, "reward"),
        ({"extra_metadata": [("a", 1)]}, TypeError, "extra_metadata"),
        ({"extra_metadata": {"turns": [0]}}, ValueError, r"override .*'turns'"),
        ({"max_sample_tokens": -1}, ValueError, "max_sample_tokens"),
        ({"max_sample_tokens": 2.5}, ValueError, "max_sample_tokens"),
    ],
)
def test_get_trajectory_rejects_bad_arguments_without_consuming(kwargs, error, match):
    manager = _manager_with_two_sessions()
    with pytest.raises(error, match=match):
        manager.get_trajectory("bad", **kwargs)
    assert manager.has_session("bad") and manager.turn_count("bad") == 1
    assert len(manager.get_trajectory("bad")) == 1


class _Broken(DriftPolicy):
    def decide(self, drift):
        return "explode"


def test_a_policy_returning_nonsense_is_reported_and_changes_nothing():
    manager = _manager_with_two_sessions(policy=_Broken())
    drifted = _record(prompt_ids=[1, 2, 3, 4, 9, 7])  # held is 1 2 3 4 5: drift inside the response
    with pytest.raises(ValueError, match="returned 'explode'"):
        manager.record_turn(
            "bad", turn=drifted, prompt_messages=[SYSTEM, USER, ANSWER, USER], response_message=ANSWER
        )
    assert manager.turn_count("bad") == 1


@pytest.mark.parametrize(
    ("policy", "error"),
    [("nope", ValueError), (3, TypeError), ("agentrl.trajectory.sample:Sample", TypeError)],
)
def test_bad_policies(policy, error):
    with pytest.raises(error):
        make_policy(policy)
    with pytest.raises(ValueError, match="fork_threshold_tokens"):
        TrajectoryManager(fork_threshold_tokens=-1)


def test_policy_plugin_by_dotted_path():
    assert make_policy("agentrl.trajectory.policies:ForkPolicy").name == "fork"


@pytest.mark.parametrize(
    ("mutate", "match"),
    [
        (lambda d: d.pop("tokens"), "lacks"),
        (lambda d: d.update(response_start=99), "response_start"),
        (lambda d: d["loss_mask"].pop(), "inconsistent lengths"),
        (lambda d: d.update(provenance=[[0, 2, "prompt", 0, None], [3, 5, "model", 0, None]]), "contiguous"),
        (lambda d: d.update(provenance=[[0, 5, "bogus", 0, None]]), "unknown provenance source"),
    ],
)
def test_sample_from_dict_rejects_malformed_input(mutate, match):
    manager = _manager_with_two_sessions()
    (sample,) = manager.get_trajectory("keep")
    data = sample.to_dict()
    mutate(data)
    with pytest.raises((ValueError, TypeError), match=match):
        Sample.from_dict(data)


def test_importing_the_contract_does_not_import_torch():
    code = "import sys, agentrl.trajectory; sys.exit(1 if 'torch' in sys.modules or 'transformers' in sys.modules else 0)"
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0


@pytest.mark.parametrize(
    ("turns", "match"),
    [
        (None, "non-empty list"),
        ([], "non-empty list"),
        ([-1], "non-empty list"),
        ([0, 0], "repeats"),
        ([5], "not recorded"),
    ],
)
def test_verify_rejects_bad_turn_lists(turns, match):
    from agentrl.trajectory import ProvenanceError, verify

    manager = _manager_with_two_sessions()
    records = manager.turns("keep")
    (sample,) = manager.get_trajectory("keep")
    verify(sample, records)
    sample.metadata["turns"] = turns
    with pytest.raises(ProvenanceError, match=match):
        verify(sample, records)


def test_provenance_written_with_the_old_realigned_source_name_still_loads():
    from agentrl.trajectory.provenance import REALIGNED_PROMPT, Provenance

    old = Provenance([(0, 2, "prompt", 0, None), (2, 3, "realigned", 1, None)])
    assert old[2].source == REALIGNED_PROMPT == "realigned_prompt"
    with pytest.raises(ValueError, match="unknown provenance source"):
        Provenance([(0, 1, "realignd", 0, None)])
