"""rollout.judge on real engines: the policy is the tiny model's embedded engine; the judge is an embedded engine
of its own (the null model's scripted verdicts through the real server: PASS, FAIL or no verdict, chosen by the
marker "~" in the judge prompt), or the policy's own engines (random text: no verdict). Verdicts are parsed,
unscorable episodes counted and dropped, and no judge token is in any sample's trained tokens."""

from __future__ import annotations

import asyncio
import json

import pytest

from agentrl.envs.arithmetic import ArithmeticEnv
from agentrl.rollout.judge import Judge, JudgeError, JudgeSettings, judge_prompt, parse_verdict
from agentrl.rollout.manager import RolloutManager
from agentrl.rollout.model_engines import ModelEngines
from agentrl.rollout.settings import RolloutSettings

TEMPLATE = "{task[hint]} is the hint"  # the policy's random text never reaches the null judge's marker count


@pytest.fixture(scope="module")
def null_script(tiny_model_dir, tmp_path_factory) -> str:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    ids = [tok(text, add_special_tokens=False).input_ids for text in ("PASS", "FAIL", "no idea")]
    (marker,) = tok("~", add_special_tokens=False).input_ids
    path = tmp_path_factory.mktemp("judge") / "script.json"
    path.write_text(json.dumps({"replies": ids, "marker": marker}))
    return str(path)


def _judge(tiny_model_dir, null_script, **kw) -> JudgeSettings:
    return JudgeSettings(model=str(tiny_model_dir), engine_args=["--null-model", null_script], prompt_template=TEMPLATE, **kw)


def _tasks(hint: str) -> dict:
    return {"a": 12, "b": 30, "answer": 42, "hint": hint}


def test_verdicts_parsed_failures_counted_and_no_judge_token_trained(tiny_model_dir, null_script) -> None:
    settings = RolloutSettings(num_engines=1, max_new_tokens=8, temperature=1.0,
                               judge=_judge(tiny_model_dir, null_script, batch_wait_ms=200.0))
    with RolloutManager(tiny_model_dir, ArithmeticEnv, settings) as manager:
        assert manager.judge.urls and not set(manager.judge.urls) & set(manager.engine_urls)  # its own engine

        async def go():
            try:
                return await manager.rollout([_tasks(""), _tasks("~"), _tasks("~~")], 2)
            finally:
                await manager.aclose_client()

        batch = asyncio.run(go())
        judge = manager.judge
    by_hint = {}
    for e in batch.episodes:
        by_hint.setdefault(e.task["hint"], []).append(e)
    assert [e.samples[0].metadata["reward_components"]["judge"] for e in by_hint[""]] == [1.0, 1.0]
    assert [e.samples[0].metadata["reward_components"]["judge"] for e in by_hint["~"]] == [0.0, 0.0]
    assert all(not e.samples and e.metrics.error_type == "JudgeError" for e in by_hint["~~"])  # dropped, no reward
    assert batch.metrics["rollout/failure_reasons/JudgeError"] == 2.0
    assert judge.counts["prompts"] == 6 and judge.counts["requests"] <= 6
    samples = [s for g in batch.groups for s in g]
    assert len(samples) == 4
    # Every trained token is an output token of a policy turn (proved), and all of them are the policy's
    # generated tokens: nothing of the judge's prompt or reply entered a sample.
    assert batch.metrics["rollout/unproven_trained_tokens"] == 0.0
    generated = sum(e.metrics.generated_tokens for e in batch.episodes if e.samples)
    assert sum(s.trained_tokens for s in samples) == generated


def test_the_policy_engines_as_judge_give_no_verdict_so_every_episode_is_dropped(tiny_model_dir) -> None:
    settings = RolloutSettings(num_engines=1, max_new_tokens=6, judge=JudgeSettings(max_new_tokens=4, timeout_s=60))
    with RolloutManager(tiny_model_dir, ArithmeticEnv, settings) as manager:
        assert manager.judge.urls == manager.engine_urls

        async def go():
            try:
                return await manager.rollout([_tasks("")], 3)
            finally:
                await manager.aclose_client()

        batch = asyncio.run(go())
    assert batch.groups == [] and batch.metrics["rollout/failure_reasons/JudgeError"] == 3.0


@pytest.fixture(scope="module")
def null_judge(tiny_model_dir, null_script):
    engines = ModelEngines(str(tiny_model_dir), engine_args=["--null-model", null_script]).start()
    yield engines
    engines.stop()


def _started(urls, tiny_model_dir, **kw) -> Judge:
    """A judge on ``urls`` as if they were the policy's engines (the module's null judge engine, or none)."""
    from transformers import AutoTokenizer

    settings = JudgeSettings(prompt_template=TEMPLATE, **kw)
    return Judge(settings).start(urls, AutoTokenizer.from_pretrained(tiny_model_dir), 256)


def test_prompts_share_requests_up_to_the_batch_size(null_judge, tiny_model_dir) -> None:
    judge = _started(null_judge.urls, tiny_model_dir, batch_size=2, batch_wait_ms=1000.0)

    async def go():
        try:
            return await asyncio.gather(*(judge.score(_tasks(h), []) for h in ["", "~", "", "~", ""]))
        finally:
            await judge.aclose()

    assert asyncio.run(asyncio.wait_for(go(), 30)) == [1.0, 0.0, 1.0, 0.0, 1.0]
    assert judge.counts == {"requests": 3, "prompts": 5}  # two full batches, then the last one on the timer


@pytest.mark.parametrize("kw, urls, fragment", [
    ({"timeout_s": 1e-4}, None, "no verdict within"),
    ({}, ["http://127.0.0.1:9"], "ClientConnectorError"),
])
def test_no_answer_is_a_judge_error(null_judge, tiny_model_dir, kw, urls, fragment) -> None:
    judge = _started(urls or null_judge.urls, tiny_model_dir, batch_wait_ms=0.0, **kw)

    async def go():
        try:
            await judge.score(_tasks(""), [])
        finally:
            await judge.aclose()

    with pytest.raises(JudgeError, match=fragment):
        asyncio.run(go())


def test_a_prompt_too_long_for_the_judge_is_a_judge_error(tiny_model_dir) -> None:
    from transformers import AutoTokenizer

    judge = Judge(JudgeSettings()).start(["http://127.0.0.1:9"], AutoTokenizer.from_pretrained(tiny_model_dir), 64)
    with pytest.raises(JudgeError, match="do not fit"):
        judge.prompt_ids(_tasks(""), [{"role": "user", "content": "x " * 200}])


@pytest.mark.parametrize("reply, kw, value", [
    ("PASS", {}, 1.0), ("the answer is wrong. FAIL.", {}, 0.0), ("FAIL then PASS", {}, 0.0),
    ("Score: 0.75", {"verdict": "score"}, 0.75), ("score=1", {"verdict": "score"}, 1.0),
    ("7/10", {"verdict": "score", "pattern": r"(\d+)/10", "score_max": 10.0}, 7.0),
])
def test_verdicts(reply, kw, value) -> None:
    assert parse_verdict(reply, JudgeSettings(**kw)) == value


@pytest.mark.parametrize("reply, kw", [
    ("PASSED", {}), ("pass", {}), ("", {}), ("Score: 1.5", {"verdict": "score"}), ("Score: -1", {"verdict": "score"}),
    ("no number", {"verdict": "score"}), ("yes", {"pattern": r"(yes)"}),
])
def test_no_verdict_is_a_judge_error(reply, kw) -> None:
    with pytest.raises(JudgeError):
        parse_verdict(reply, JudgeSettings(**kw))


@pytest.mark.parametrize("kw, fragment", [
    ({"prompt_template": "{reward}"}, "not among"), ({"prompt_template": "{"}, "not a format string"),
    ({"prompt_template": "{}"}, "not among"), ({"pattern": "(a)(b)"}, "exactly one group"),
    ({"pattern": "("}, "not a regular expression"), ({"score_min": 1.0, "score_max": 1.0}, "below score_max"),
    ({"model": "/no/such/dir"}, "is not a directory"), ({"batch_size": 0}, "batch_size"),
    ({"verdict": "score", "score_max": 1e39}, "reward limit"), ({"score_min": -1e308}, "reward limit"),
])
def test_bad_settings_are_refused_at_load(kw, fragment) -> None:
    with pytest.raises(ValueError, match=fragment):
        JudgeSettings(**kw)


def test_the_prompt_holds_task_conversation_and_answer() -> None:
    messages = [{"role": "user", "content": "What is 1+2?"}, {"role": "assistant", "content": "3"},
                {"role": "tool", "content": "ok"}]
    text = judge_prompt("{task}|{conversation}|{answer}|{task[a]}", {"a": 1}, messages)
    assert text == '{"a": 1}|user: What is 1+2?\nassistant: 3\ntool: ok|3|1'


def test_a_template_field_the_task_lacks_is_a_judge_error() -> None:
    with pytest.raises(JudgeError, match="does not fit the episode"):
        judge_prompt("{task[hint]}", {"a": 1}, [])
