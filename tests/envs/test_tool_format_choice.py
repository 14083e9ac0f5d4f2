"""Choosing the tool-call format and the chat-template kwargs: in config (validated at load), on the
environment, per call; a reply in another format than the chosen one, or malformed, is an ill-formed turn
answered with a tool message naming the expected format; reasoning never reaches tools or the env."""

from __future__ import annotations

import asyncio
import copy
import json
import shutil
from pathlib import Path

import pytest
from pydantic import ValidationError

from agentrl.envs import Environment, tool
from agentrl.envs.arithmetic import ArithmeticEnv, ArithmeticToolEnv, make_tasks
from agentrl.envs.environment import choose_tool_format
from agentrl.envs.formats import HermesFormat, Llama3JsonFormat, ToolCall
from agentrl.envs.loop import generate_rollout, run_episode
from agentrl.envs.render import ChatRenderer
from agentrl.envs.scripted import ScriptedPolicy
from agentrl.rollout.settings import RolloutSettings
from agentrl.run.config import RunConfig, load_config
from agentrl.trajectory import verify_session

HERMES, LLAMA = HermesFormat(), Llama3JsonFormat()
ASSETS = Path(__file__).resolve().parents[1] / "assets"
QWEN3_CONFIG, TINY_TOKENIZER = ASSETS / "qwen3" / "tokenizer_config.json", ASSETS / "tiny_tokenizer"
TASK = {"a": 12, "b": 34, "answer": 46, "multi_turn": False}


def play(env, policy, renderer, **kw):
    return asyncio.run(run_episode(env, TASK, policy, renderer, session_id="s", **kw))


def tool_messages(result):
    return [m["content"] for m in result.messages if m["role"] == "tool"]


def test_choose_tool_format_by_name_path_object_or_template(tokenizer):
    assert isinstance(choose_tool_format("auto", tokenizer), HermesFormat)  # the tiny template writes <tool_call>
    assert isinstance(choose_tool_format(None, tokenizer), HermesFormat)
    assert isinstance(choose_tool_format("llama3_json", tokenizer), Llama3JsonFormat)
    assert isinstance(choose_tool_format("agentrl.envs.formats:Llama3JsonFormat", tokenizer), Llama3JsonFormat)
    assert choose_tool_format(LLAMA, tokenizer) is LLAMA
    with pytest.raises(ValueError, match="unknown tool-call format 'hermse'.*hermes"):
        choose_tool_format("hermse", tokenizer)


def test_a_call_in_another_format_is_ill_formed_not_a_final_answer(tokenizer, renderer):
    llama_submit = LLAMA.render_calls([ToolCall("submit", {"answer": 46})])
    policy = ScriptedPolicy(tokenizer, [llama_submit, HERMES.render_calls([ToolCall("submit", {"answer": 46})])])
    result = play(ArithmeticEnv(), policy, renderer)
    m = result.metrics
    assert (m.turns, m.ill_formed_turns, m.foreign_format_turns, m.tool_calls) == (2, 1, 1, 1)
    assert (m.stop_reason, m.reward) == ("done", 1.0)  # the second, hermes reply was run and ended it
    first = tool_messages(result)[0]
    assert "llama3_json format" in first and "nothing was run" in first
    assert 'hermes format, e.g. <tool_call>{"name": "submit", "arguments": {"answer": "..."}}</tool_call>' in first
    [sample] = result.samples
    assert sample.metadata["turn_metadata"][0]["foreign_formats"] == ["llama3_json"]
    verify_session(result.samples, policy.turns["s"])


def test_the_environment_chooses_its_format_and_a_call_argument_overrides_it(tokenizer, renderer):
    class LlamaArithmetic(ArithmeticEnv):
        tool_format = "llama3_json"

    hermes_submit = HERMES.render_calls([ToolCall("submit", {"answer": 46})])
    llama_submit = LLAMA.render_calls([ToolCall("submit", {"answer": 46})])
    result = play(LlamaArithmetic(), ScriptedPolicy(tokenizer, [hermes_submit, llama_submit]), renderer)
    assert (result.metrics.foreign_format_turns, result.metrics.reward, result.metrics.turns) == (1, 1.0, 2)
    first = tool_messages(result)[0]
    assert "hermes" in first.split(" format")[0] and "llama3_json format, e.g. " in first
    assert '{"name": "submit", "parameters": {"answer": "..."}}' in first

    # run_episode's tool_format (what the run's rollout.tool_format becomes) wins over the env's.
    result = play(LlamaArithmetic(), ScriptedPolicy(tokenizer, [hermes_submit]), renderer, tool_format="hermes")
    assert (result.metrics.foreign_format_turns, result.metrics.reward, result.metrics.turns) == (0, 1.0, 1)


def test_a_malformed_call_names_the_expected_format(tokenizer, renderer):
    policy = ScriptedPolicy(tokenizer, ['<tool_call>{"name": "add", "arguments": {"a": 1,</tool_call>',
                                        '<tool_call>{"name": "add"'])
    env = ArithmeticToolEnv()
    env.max_turns = 2
    result = play(env, policy, renderer)
    bad_json, unterminated = tool_messages(result)
    hint = 'hermes format, e.g. <tool_call>{"name": "submit", "arguments": {"answer": "..."}}</tool_call>'
    assert bad_json.startswith("Error: tool call is not valid JSON") and hint in bad_json
    assert unterminated.startswith("Error: unterminated <tool_call>") and hint in unterminated
    assert result.metrics.ill_formed_turns == 2 and result.metrics.stop_reason == "max_turns"


def test_plain_text_is_still_a_final_answer(tokenizer, renderer):
    result = play(ArithmeticEnv(), ScriptedPolicy(tokenizer, ["The answer is 46."]), renderer)
    m = result.metrics
    assert (m.ill_formed_turns, m.foreign_format_turns, m.stop_reason, m.turns) == (0, 0, "no_tool_call", 1)


class Recording(ArithmeticEnv):
    """Keeps what on_text_response was given; nudges once."""

    def on_text_response(self, text):
        self.seen = [*getattr(self, "seen", []), text]
        if len(self.seen) == 1:
            return [{"role": "user", "content": "Use the submit tool."}]
        return super().on_text_response(text)


@pytest.fixture(scope="module")
def thinking_tokenizer(tokenizer):
    """The tiny vocabulary with Qwen3's real chat template: the reply may open with a <think> block."""
    tok = copy.deepcopy(tokenizer)
    tok.chat_template = json.loads(QWEN3_CONFIG.read_text())["chat_template"]
    return tok


def test_reasoning_is_split_off_before_tools_and_the_env_see_the_reply(thinking_tokenizer):
    renderer = ChatRenderer(thinking_tokenizer)
    assert renderer.reasoning_parser() is not None and not renderer.reasoning_parser().starts_inside
    draft = HERMES.render_calls([ToolCall("submit", {"answer": 0})])
    script = [f"<think>I could send {draft} but let me check.</think>\n\nIt is 46.",
              "<think>The tool: " + HERMES.render_calls([ToolCall("submit", {"answer": 1})]) + "</think>"
              + HERMES.render_calls([ToolCall("submit", {"answer": 46})])]
    env = Recording()
    policy = ScriptedPolicy(thinking_tokenizer, script)
    result = asyncio.run(run_episode(env, TASK, policy, renderer, session_id="t"))
    assert env.seen == ["It is 46."]  # the draft call inside the reasoning was neither run nor shown
    assert (result.metrics.tool_calls, result.metrics.reward, env.submitted) == (1, 1.0, 46)
    # The history keeps the raw reply (reasoning included): the next prompt re-tokenizes what was sampled.
    assert result.messages[2]["content"] == script[0]


def test_a_generation_prompt_that_opens_the_block_means_the_reply_starts_inside_it(tokenizer):
    tok = copy.deepcopy(tokenizer)
    tok.chat_template = tokenizer.chat_template.replace(
        "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}",
        "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n<think>\\n' }}{%- endif %}")
    assert tok.chat_template != tokenizer.chat_template
    parser = ChatRenderer(tok).reasoning_parser()
    assert parser.starts_inside
    assert parser.split("plan: call add\n</think>\n\nDone.") == ("plan: call add", "Done.")
    assert ChatRenderer(tokenizer).reasoning_parser() is None  # no <think> in the template: no parser


def test_generate_rollout_resolves_a_format_name_before_any_episode(tokenizer, renderer):
    policy = ScriptedPolicy(tokenizer, [LLAMA.render_calls([ToolCall("submit", {"answer": 46})])])
    result = asyncio.run(generate_rollout(ArithmeticEnv, [TASK], policy, renderer, tool_format="llama3_json"))
    assert result.summary()["reward_mean"] == 1.0 and result.summary()["foreign_format_turn_rate"] == 0.0
    with pytest.raises(ValueError, match="unknown tool-call format"):
        asyncio.run(generate_rollout(ArithmeticEnv, [TASK], policy, renderer, tool_format="nope"))
    assert not policy.turns["nope"]  # nothing was generated


# ---- config ------------------------------------------------------------------------------------

def test_rollout_settings_validate_format_kwargs_and_mode_at_load():
    s = RolloutSettings(tool_format="qwen3", chat_template_kwargs={"enable_thinking": False}, prompt_mode="append")
    assert (s.tool_format, s.chat_template_kwargs, s.prompt_mode) == ("qwen3", {"enable_thinking": False}, "append")
    assert RolloutSettings().tool_format is None and RolloutSettings().prompt_mode is None
    with pytest.raises(ValidationError, match="tool_format[\\s\\S]*unknown tool-call format 'hermse'"):
        RolloutSettings(tool_format="hermse")
    with pytest.raises(ValidationError, match="tool_format[\\s\\S]*no_such_module_xyz"):
        RolloutSettings(tool_format="no_such_module_xyz:Format")
    with pytest.raises(ValidationError, match="tool_format[\\s\\S]*has no parse"):
        RolloutSettings(tool_format="collections:OrderedDict")
    with pytest.raises(ValidationError, match="chat_template_kwargs[\\s\\S]*'tools'"):
        RolloutSettings(chat_template_kwargs={"tools": []})
    with pytest.raises(ValidationError, match="prompt_mode"):
        RolloutSettings(prompt_mode="incremental")


def test_run_config_names_the_bad_key_before_anything_starts():
    with pytest.raises(ValidationError, match="rollout.tool_format"):
        load_config(None, ["--rollout.tool_format", "hermse"])
    cfg = load_config(None, ["--rollout.tool_format", "llama3_json", "--rollout.prompt_mode", "append",
                             "--rollout.chat_template_kwargs", '{"enable_thinking": false}'])
    assert cfg.rollout.chat_template_kwargs == {"enable_thinking": False}
    assert RunConfig().rollout.tool_format is None  # every existing config stays valid


class MisspelledFormatEnv(ArithmeticEnv):
    tool_format = "lama3_json"


def test_an_environment_with_an_unknown_format_fails_at_config_load():
    path = f"{__name__}:MisspelledFormatEnv"
    with pytest.raises(ValidationError, match="MisspelledFormatEnv.tool_format.*unknown tool-call format 'lama3_json'"):
        RunConfig(env=path)
    assert RunConfig(env=path, rollout={"tool_format": "hermes"}).rollout.tool_format == "hermes"  # overridden


def test_an_environment_with_an_unknown_prompt_mode_fails_when_defined():
    with pytest.raises(ValueError, match="Bad.prompt_mode must be one of \\['rerender', 'append'\\]"):
        type("Bad", (Environment,), {"prompt_mode": "incremental"})
    with pytest.raises(ValueError, match="prompt_mode must be one of"):
        play(ArithmeticEnv(), None, None, prompt_mode="incremental")


def test_chat_template_kwargs_reach_the_template_and_clashes_are_refused(tokenizer):
    tok = copy.deepcopy(tokenizer)
    tok.chat_template = tokenizer.chat_template.replace(
        "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}",
        "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
        "{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}"
        "{%- endif %}{%- endif %}")
    chat = [{"role": "user", "content": "hi"}]
    assert ChatRenderer(tok, enable_thinking=False).render(chat).text.endswith("<think>\n\n</think>\n\n")
    assert ChatRenderer(tok).render(chat).text.endswith("assistant\n")
    with pytest.raises(ValueError, match="may not set \\['add_generation_prompt'\\]"):
        ChatRenderer(tok, add_generation_prompt=False)


# ---- the rollout manager: train and eval episodes get the config --------------------------------

class ScriptedClient:
    def __init__(self, policy):
        self.generate_turn = policy


class Adder(Environment):
    """Single turn; answers with ``submit``."""

    max_turns = 2

    def reset(self, task):
        self.submitted = None
        return [{"role": "user", "content": f"What is {task['a']}+{task['b']}?"}]

    @tool
    def submit(self, answer: int) -> str:
        """Submit.

        Args:
            answer: the sum.
        """
        self.submitted, self.done = answer, True
        return "ok"

    def reward(self):
        return float(self.submitted == self.task["answer"])


def test_rollout_manager_applies_the_settings_to_train_and_eval_episodes(tmp_path, tokenizer):
    from agentrl.rollout.manager import RolloutManager

    for f in TINY_TOKENIZER.iterdir():  # the manager reads the tokenizer and the context length, no weights
        shutil.copy(f, tmp_path / f.name)
    (tmp_path / "config.json").write_text('{"max_position_embeddings": 512}')
    settings = RolloutSettings(tool_format="llama3_json", prompt_mode="append",
                               chat_template_kwargs={"enable_thinking": False})
    manager = RolloutManager(tmp_path, Adder, settings, secret="t")
    assert manager.renderer.chat_template_kwargs == {"enable_thinking": False}
    env = manager.env_factory()
    assert (env.tool_format, env.prompt_mode) == ("llama3_json", "append")
    assert (Adder.tool_format, Adder.prompt_mode) == ("auto", "rerender")  # the class is left as it was

    # A hermes reply is foreign under llama3_json in training and in evaluation alike.
    tasks = make_tasks(2, seed=3)
    hermes = ScriptedPolicy(tokenizer, lambda prompt, i: HERMES.render_calls([ToolCall("submit", {"answer": 0})]))
    manager.client = lambda: ScriptedClient(hermes)
    batch = asyncio.run(manager.rollout(tasks, 2))
    assert batch.metrics["rollout/foreign_format_turn_rate"] == 1.0
    assert asyncio.run(manager.evaluate(tasks))["eval_accuracy"] == 0.0
    right = {str(t["a"]) + "+" + str(t["b"]): t["answer"] for t in tasks}

    def answer(prompt, i):
        key = next(k for k in right if k in prompt)
        return LLAMA.render_calls([ToolCall("submit", {"answer": right[key]})])

    manager.client = lambda: ScriptedClient(ScriptedPolicy(tokenizer, answer))
    assert asyncio.run(manager.evaluate(tasks))["eval_accuracy"] == 1.0


def test_a_formats_own_reasoning_channel_is_kept_from_the_env(tokenizer, renderer):
    class Harmony(Recording):
        tool_format = "gpt_oss"

    reply = ("<|channel|>analysis<|message|>maybe {\"name\": \"submit\"}<|end|>"
             "<|start|>assistant<|channel|>final<|message|>It is 46.")
    env = Harmony()
    result = asyncio.run(run_episode(env, TASK, ScriptedPolicy(tokenizer, [reply, "done"]), renderer, session_id="h"))
    assert env.seen[0] == "It is 46." and result.metrics.foreign_format_turns == 0
