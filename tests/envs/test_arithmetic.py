"""The arithmetic environment of the CPU demo: tasks, splits, reward, tool rule, expert chats."""

from __future__ import annotations

import asyncio

import pytest

from agentrl.envs.arithmetic import ArithmeticEnv, ArithmeticToolEnv, expert_messages, make_tasks
from agentrl.envs.formats import HermesFormat, ToolCall
from agentrl.envs.loop import run_episode
from agentrl.envs.scripted import ScriptedPolicy

FMT = HermesFormat()


def test_tasks_are_deterministic_in_range_and_splits_disjoint():
    assert make_tasks(50, seed=1) == make_tasks(50, seed=1) != make_tasks(50, seed=2)
    train = {(t["a"], t["b"]) for t in make_tasks(3000, seed=0)}
    held = {(t["a"], t["b"]) for t in make_tasks(3000, seed=0, split="heldout")}
    assert train.isdisjoint(held) and len(held) > 500
    assert all(10 <= a <= 99 and 10 <= b <= 99 for a, b in train | held)
    assert all(t["answer"] == t["a"] + t["b"] for t in make_tasks(20))
    with pytest.raises(ValueError, match="split"):
        make_tasks(1, split="test")


@pytest.mark.parametrize("multi_turn", [False, True])
def test_expert_chat_is_exactly_what_the_loop_trains(multi_turn, tokenizer, renderer):
    """Supervised warm-up data and RL samples agree token for token: the expert chat rendered once
    equals the sample the loop builds when a policy replays the expert's replies."""
    env_cls = ArithmeticToolEnv if multi_turn else ArithmeticEnv
    task = make_tasks(1, seed=4, multi_turn=multi_turn)[0]
    messages = expert_messages(task)
    replies = [m["content"] for m in messages if m["role"] == "assistant"]
    policy = ScriptedPolicy(tokenizer, replies)
    result = asyncio.run(run_episode(env_cls(), task, policy, renderer, session_id="e"))
    assert result.metrics.reward == 1.0 and result.metrics.turns == len(replies)
    [sample] = result.samples
    rendered = renderer.render(messages, env_cls.tool_schemas(), add_generation_prompt=False)
    assert rendered.ids[: len(sample.tokens)] == sample.tokens
    assert tokenizer.decode(rendered.ids[len(sample.tokens):]) == "\n"
    response_mask = rendered.assistant_mask[sample.response_start: len(sample.tokens)]
    assert response_mask == sample.loss_mask
    assert len(rendered.ids) < 450  # fits the tiny model's 512 positions with room to spare


def test_reward_rules():
    task = make_tasks(1)[0]


    env = ArithmeticEnv()
    env.task = task
    env.reset(task)
    assert env.reward() == 0.0  # nothing submitted
    asyncio.run(env.call_tool(ToolCall("submit", {"answer": task["answer"]})))
    assert env.reward() == 1.0 and env.done
    tool_env = ArithmeticToolEnv()
    tool_env.task = task
    tool_env.reset(task)
    asyncio.run(tool_env.call_tool(ToolCall("submit", {"answer": task["answer"]})))
    assert tool_env.reward() == 0.0  # right answer, but add was never called
    tool_env = ArithmeticToolEnv()
    tool_env.task = task
    tool_env.reset(task)
    assert asyncio.run(tool_env.call_tool(ToolCall("add", {"a": task["a"], "b": task["b"]}))) == str(task["answer"])
    asyncio.run(tool_env.call_tool(ToolCall("submit", {"answer": task["answer"]})))
    assert tool_env.reward() == 1.0


def test_wrong_answer_scores_zero(tokenizer, renderer):
    task = make_tasks(1, seed=8)[0]
    policy = ScriptedPolicy(tokenizer, [FMT.render_calls([ToolCall("submit", {"answer": task["answer"] + 1})])])
    result = asyncio.run(run_episode(ArithmeticEnv(), task, policy, renderer, session_id="w"))
    assert result.metrics.reward == 0.0 and result.metrics.stop_reason == "done"
