"""examples/judge_arithmetic: the config loads with its judge (the stand-in that make_judge.py builds), refuses a
judge dir that is not there before anything starts, and the stand-in's greedy reply to a real judge prompt is a
verdict the config's pattern parses (1.0), while the weight 0 keeps it out of the training reward."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from agentrl.envs.rewards import combine_reward
from agentrl.rollout.judge import judge_prompt, parse_verdict

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "judge_arithmetic"
CONFIG = str(EXAMPLE / "config.yaml")


@pytest.fixture(scope="module")
def judge_dir(tmp_path_factory) -> Path:
    spec = importlib.util.spec_from_file_location("make_judge", EXAMPLE / "make_judge.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.make_always_pass_judge(tmp_path_factory.mktemp("judge") / "model")


def test_the_config_loads_with_its_judge(judge_dir) -> None:
    from agentrl.run.config import load_config

    cfg = load_config(CONFIG, ["--rollout.judge.model", str(judge_dir)])
    judge = cfg.rollout.judge
    assert judge is not None and judge.model == str(judge_dir) and judge.verdict == "pass_fail"
    assert cfg.rollout.reward_weights == {"judge": 0.0}
    assert combine_reward({"env": 1.0, judge.name: 1.0}, cfg.rollout.reward_weights)[0] == 1.0  # 1 + 0 x 1


def test_a_missing_judge_dir_is_refused_at_load(tmp_path) -> None:
    from agentrl.run.config import load_config

    with pytest.raises(ValueError, match="rollout.judge.model"):
        load_config(CONFIG, ["--rollout.judge.model", str(tmp_path / "nope")])


def test_the_stand_in_judge_replies_a_verdict_the_pattern_parses(judge_dir) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from agentrl.run.config import load_config

    settings = load_config(CONFIG, ["--rollout.judge.model", str(judge_dir)]).rollout.judge
    tokenizer, model = AutoTokenizer.from_pretrained(judge_dir), AutoModelForCausalLM.from_pretrained(judge_dir)
    messages = [{"role": "user", "content": "What is 12+30?"}, {"role": "assistant", "content": "42"}]
    text = judge_prompt(settings.prompt_template, {"a": 12, "b": 30, "answer": 42}, messages)
    rendered = tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=False, add_generation_prompt=True)
    ids = tokenizer(rendered, add_special_tokens=False, return_tensors="pt").input_ids
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=settings.max_new_tokens, do_sample=False)
    reply = tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True)
    assert reply == " pass"
    assert parse_verdict(reply, settings) == 1.0
