"""Credit plug-ins: a success does not credit its fumbled tool calls; loss masks can only lose ones."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from agentrl.envs import run_episode
from agentrl.envs.arithmetic import ArithmeticToolEnv, make_tasks
from agentrl.envs.formats import HermesFormat, ToolCall
from agentrl.envs.render import ChatRenderer
from agentrl.envs.scripted import ScriptedPolicy
from agentrl.trainer.credit import withhold_positive_credit_from_ill_formed_turns as withhold

TOKENIZER_DIR = Path(__file__).resolve().parents[1] / "assets" / "tiny_tokenizer"
FMT = HermesFormat()


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(TOKENIZER_DIR)


def episode(tokenizer, replies):
    """One arithmetic episode played by ``replies``; its sample and the policy's recorded turns."""
    task = make_tasks(1, multi_turn=True)[0]
    script = [r(task) if callable(r) else r for r in replies]
    policy = ScriptedPolicy(tokenizer, script)
    result = asyncio.run(run_episode(ArithmeticToolEnv(), task, policy, ChatRenderer(tokenizer), session_id="s"))
    [sample] = result.samples
    return sample, result


def add(task, **override):
    return FMT.render_calls([ToolCall("add", {"a": task["a"], "b": task["b"], **override})])


def submit(task):
    return FMT.render_calls([ToolCall("submit", {"answer": task["answer"]})])


def trained_turns(sample) -> dict[int, int]:
    counts: dict[int, int] = {}
    for m, prov in zip(sample.loss_mask, sample.provenance[sample.response_start:], strict=True):
        counts[prov.turn] = counts.get(prov.turn, 0) + m
    return {t: n for t, n in counts.items() if n}


FUMBLES = {
    "bad JSON": '<tool_call>{"name": "add", "arguments": {"a": 1, </tool_call>',
    "refused argument": lambda task: add(task, a="one"),  # parses, but the environment rejects it
}


@pytest.mark.parametrize("fumble", FUMBLES)
def test_a_success_does_not_credit_its_fumbled_turn(tokenizer, fumble):
    sample, result = episode(tokenizer, [FUMBLES[fumble], add, submit])
    assert result.metrics.reward == 1.0 and result.metrics.ill_formed_turns == 1
    assert [m["ill_formed"] for m in sample.metadata["turn_metadata"]] == [True, False, False]
    before = trained_turns(sample)
    assert set(before) == {0, 1, 2}

    [credited] = withhold([sample], [0.9])
    assert trained_turns(credited) == {1: before[1], 2: before[2]}
    assert sample.trained_tokens == sum(before.values())  # the input sample is not modified
    # Below the group's mean the fumble keeps its tokens, so the loss still pushes it down.
    [debited] = withhold([sample], [-0.4])
    assert debited is sample


def test_clean_successes_and_dict_samples(tokenizer):
    clean, _ = episode(tokenizer, [add, submit])
    assert withhold([clean], [1.0]) == [clean]
    fumbled, _ = episode(tokenizer, [FUMBLES["bad JSON"], add, submit])
    as_dict = fumbled.to_dict()  # what crosses a process boundary
    [credited] = withhold([as_dict], [1.0])
    [expected] = withhold([fumbled], [1.0])
    assert credited["loss_mask"] == expected.loss_mask != fumbled.loss_mask
    assert as_dict["loss_mask"] == fumbled.loss_mask


def test_the_trainer_refuses_a_credit_rule_that_adds_training(tokenizer):
    pytest.importorskip("torch")
    from agentrl.trainer.actor import _narrowed

    sample, _ = episode(tokenizer, [FUMBLES["bad JSON"], add, submit])
    narrowed = withhold([sample], [1.0])
    assert _narrowed([sample], narrowed) == narrowed
    with pytest.raises(ValueError, match="only withhold"):
        _narrowed(narrowed, [sample])  # gives the fumbled turn its ones back
    with pytest.raises(ValueError, match="returned 0 samples for 1"):
        _narrowed([sample], [])
