"""Every format against its model's real chat template (vendored under agentrl/models/assets/chat_templates):
the template, rendered by transformers' own renderer, writes an assistant tool-call turn; the format parses
that text back to the same calls, and ``render_calls`` writes the same bytes. The helpers above the tests are
shared with the other ``test_formats_*`` files."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from agentrl.envs.formats import (
    BUILTIN_FORMATS,
    KimiK2Format,
    MistralFormat,
    ThinkParser,
    ToolCall,
    detect_foreign_calls,
    format_for,
    get_tool_call_format,
    think_parser_for,
)

TEMPLATES = Path(__file__).resolve().parents[2] / "agentrl" / "models" / "assets" / "chat_templates"
BOS, EOS = "<BOS>", "</s>"

CALL_SETS: dict[str, list[tuple[str, dict[str, Any]]]] = {
    "one": [("count_words", {"text": "hello world"})],
    "several": [("get_weather", {"city": "Paris"}), ("add", {"a": 2, "b": 40}), ("search", {"query": "x"})],
    "nested": [("configure", {"config": {"layers": [1, 2, {"deep": {"x": None, "y": [True, False]}}],
                                         "name": "n"}, "scale": 3.5})],
    "quotes_unicode": [("write", {"text": 'He said "hi" \\ and \'bye\'\nnew line: Zürich 東京 🚀',
                                  "path": "a/b.txt"})],
}


@dataclass(frozen=True)
class TemplateCase:
    """How one vendored template writes an assistant tool-call turn."""

    template: str  # file stem under TEMPLATES
    fmt: str  # the format name that parses it
    content: Any = ""  # the assistant message's "content" next to its tool_calls ("omit": no key)
    one_call_per_message: bool = False  # the template renders only tool_calls[0] (several: several messages)
    arguments_as_string: bool = False  # the template concatenates tool_call.function.arguments as text
    turn_end: str = ""  # what the template writes after the calls to end the turn (eos / end token)
    thinks: bool = False  # the template writes a <think> block before the calls
    ids: Any = None  # (index, call) -> the tool_call id the template needs
    turn_separator: str = ""  # one_call_per_message: what the template writes between those turns, if they
    #                           are separate replies (Llama) rather than one reply of several messages (gpt-oss)
    extra: dict[str, Any] = field(default_factory=dict)


CASES = {
    "qwen3": TemplateCase("qwen3", "qwen3", turn_end="<|im_end|>\n", thinks=True),
    "llama3_1": TemplateCase("llama3_1", "llama3_json", one_call_per_message=True, turn_end="<|eot_id|>",
                             turn_separator="<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n"),
    "qwen3_coder": TemplateCase("qwen3_coder", "qwen3_coder", turn_end="<|im_end|>\n"),
    "mistral": TemplateCase("mistral", "mistral", turn_end=EOS, ids=lambda i, c: MistralFormat.call_id(i)),
    "deepseek_v3": TemplateCase("deepseek_v3", "deepseek_v3", content=None, turn_end="<｜end▁of▁sentence｜>"),
    "deepseek_r1": TemplateCase("deepseek_r1", "deepseek_v3", content=None, arguments_as_string=True),
    "glm46": TemplateCase("glm46", "glm45", thinks=True),
    "kimi_k2": TemplateCase("kimi_k2", "kimi_k2", thinks=True, turn_end="<|im_end|>",
                            ids=lambda i, c: KimiK2Format.call_id(c[0], i)),
    "gpt_oss": TemplateCase("gpt_oss", "gpt_oss", content="omit", one_call_per_message=True, turn_end="<|call|>"),
}


def template_text(name: str) -> str:
    return (TEMPLATES / f"{name}.jinja").read_text(encoding="utf-8")


def render(template: str, messages: list[dict[str, Any]], *, add_generation_prompt: bool) -> str:
    """The chat rendered by transformers' own chat-template renderer (its globals and filters)."""
    from transformers.utils.chat_template_utils import render_jinja_template

    (text,), _ = render_jinja_template([messages], chat_template=template_text(template),
                                       add_generation_prompt=add_generation_prompt, bos_token=BOS, eos_token=EOS)
    return text


def assistant_messages(case: TemplateCase, calls: list[tuple[str, dict[str, Any]]]) -> list[dict[str, Any]]:
    """The OpenAI-style assistant message(s) carrying ``calls``, as this template wants them."""
    entries = []
    for i, call in enumerate(calls):
        name, arguments = call
        entry = {"type": "function", "function": {
            "name": name, "arguments": json.dumps(arguments, ensure_ascii=False) if case.arguments_as_string
            else arguments}}
        if case.ids is not None:
            entry["id"] = case.ids(i, call)
        entries.append(entry)
    groups = [[e] for e in entries] if case.one_call_per_message else [entries]
    messages = []
    for group in groups:
        message: dict[str, Any] = {"role": "assistant", "tool_calls": group}
        if case.content != "omit":
            message["content"] = case.content
        messages.append(message)
    return messages


def rendered_reply(case: TemplateCase, calls: list[tuple[str, dict[str, Any]]]) -> str:
    """The text the template writes for the assistant turn(s) holding ``calls``: the whole chat rendered,
    minus the prompt a generation would have started from."""
    user = [{"role": "user", "content": "hello"}]
    full = render(case.template, user + assistant_messages(case, calls), add_generation_prompt=False)
    prompt = render(case.template, user, add_generation_prompt=True)
    if full.startswith(prompt):
        return full[len(prompt):]
    # DeepSeek templates write "<｜Assistant｜>" (and whitespace) differently at the generation prompt.
    marker = "<｜Assistant｜>"
    assert marker in full, f"{case.template}: the prompt is not a prefix of the chat"
    return full.split(marker, 1)[1]


def without_template_indentation(text: str) -> str:
    """vLLM's DeepSeek template leaks its own indentation (runs of spaces, a trailing newline) between the
    special tokens; the model's reply has none."""
    return re.sub(r" {2,}", "", text).rstrip("\n")


def expected(calls: list[tuple[str, dict[str, Any]]]) -> list[ToolCall]:
    return [ToolCall(name, arguments) for name, arguments in calls]


def pairs(calls: list[ToolCall]) -> list[tuple[str, dict[str, Any]]]:
    return [(c.name, c.arguments) for c in calls]


def replies(case: TemplateCase, calls: list[tuple[str, dict[str, Any]]]) -> list[str]:
    """The model replies the rendered turn(s) stand for, each without its end-of-turn token."""
    reply = rendered_reply(case, calls).removesuffix(case.turn_end)
    return reply.split(case.turn_separator) if case.turn_separator else [reply]


# ---- the tests -----------------------------------------------------------------------------------------

def _parse(case: TemplateCase, reply: str):
    fmt = get_tool_call_format(case.fmt)
    return ThinkParser().parse(reply, fmt) if case.thinks else fmt.parse(reply)


@pytest.mark.parametrize("call_set", sorted(CALL_SETS))
@pytest.mark.parametrize("case_name", sorted(CASES))
def test_a_turn_the_real_template_renders_parses_back_to_its_calls(case_name, call_set):
    case, calls = CASES[case_name], CALL_SETS[call_set]
    parsed = [_parse(case, reply) for reply in replies(case, calls)]
    assert [pair for p in parsed for pair in pairs(p.calls)] == calls
    assert all(p.errors == [] and p.content == "" and p.reasoning == "" for p in parsed)


@pytest.mark.parametrize("call_set", sorted(CALL_SETS))
@pytest.mark.parametrize("case_name", sorted(set(CASES) - {"deepseek_r1"}))
def test_render_calls_writes_the_bytes_of_the_real_template(case_name, call_set):
    """render_calls is what the template writes after its generation prompt (and the think block), up to
    the end-of-turn token the engine stops on."""
    case, calls = CASES[case_name], CALL_SETS[call_set]
    fmt = get_tool_call_format(case.fmt)
    turns = [[call] for call in calls] if case.turn_separator else [calls]
    texts = replies(case, calls)
    if case_name == "deepseek_v3":
        texts = [without_template_indentation(t).removesuffix(case.turn_end) for t in texts]
    if case.thinks:  # the template's empty reasoning block of a turn without reasoning
        strip = "\n<think></think>" if case_name == "glm46" else "<think></think>" if case_name == "kimi_k2" \
            else "<think>\n\n</think>\n\n"
        assert all(t.startswith(strip) for t in texts)
        texts = [t.removeprefix(strip) for t in texts]
    assert [fmt.render_calls(expected(turn)) for turn in turns] == texts


def test_deepseek_r1_template_quirk_single_call_without_section_end_still_parses():
    # The R1-Distill template closes the section only after a second call; the parser does not need it.
    reply = rendered_reply(CASES["deepseek_r1"], CALL_SETS["one"])
    assert "<｜tool▁calls▁end｜>" not in reply
    parsed = get_tool_call_format("deepseek_v3").parse(reply)
    assert pairs(parsed.calls) == CALL_SETS["one"] and parsed.errors == [] and parsed.content == ""


def test_llama31_template_refuses_several_calls_in_one_message():
    from jinja2.exceptions import TemplateError

    case = TemplateCase("llama3_1", "llama3_json")
    messages = [{"role": "user", "content": "q"}] + assistant_messages(case, CALL_SETS["several"])
    with pytest.raises(TemplateError, match="single tool-calls"):
        render("llama3_1", messages, add_generation_prompt=False)


@pytest.mark.parametrize("case_name", sorted(CASES))
def test_each_template_is_recognised_and_no_other_format_claims_its_calls(case_name):
    case = CASES[case_name]
    fmt = format_for(template_text(case.template))
    assert fmt.name == case.fmt
    reply = rendered_reply(case, CALL_SETS["several"])
    syntax = "hermes" if case.fmt == "qwen3" else case.fmt
    assert detect_foreign_calls(reply, fmt) == []
    for other in BUILTIN_FORMATS.keys() - {syntax}:  # chosen wrongly, the reply is flagged as a call in this template's syntax
        assert syntax in detect_foreign_calls(reply, other)


@pytest.mark.parametrize("case_name", sorted(CASES))
def test_a_call_in_a_foreign_syntax_never_passes_as_a_final_answer(case_name):
    """Parsed by the wrong format a call is a malformed call or plain text; in the second case
    detect_foreign_calls names the syntax, so the turn can be flagged as ill-formed instead."""
    case = CASES[case_name]
    (reply,) = replies(case, CALL_SETS["one"])
    syntax = "hermes" if case.fmt == "qwen3" else case.fmt
    for other in BUILTIN_FORMATS.keys() - {syntax}:
        parsed = get_tool_call_format(other).parse(reply)
        assert parsed.calls == [] or pairs(parsed.calls) == CALL_SETS["one"]
        assert parsed.errors or syntax in detect_foreign_calls(reply, other) or parsed.calls


def test_think_parser_for_each_template():
    assert think_parser_for(template_text("qwen3")) == ThinkParser()
    assert think_parser_for(template_text("glm46")) == ThinkParser()
    assert think_parser_for(template_text("mistral")) is None
    assert think_parser_for(template_text("gpt_oss")) is None  # harmony: the analysis channel instead
    opened = "{{'<｜Assistant｜><think>\\n'}}"
    assert think_parser_for(opened) == ThinkParser(starts_inside=True)


def test_qwen3_reply_with_reasoning_and_text_before_the_calls():
    calls = CALL_SETS["several"]
    messages = [{"role": "user", "content": "hello"},
                {"role": "assistant", "content": "Let me look.", "reasoning_content": "Three tools needed.",
                 "tool_calls": [{"type": "function", "function": {"name": n, "arguments": a}} for n, a in calls]}]
    prompt = render("qwen3", messages[:1], add_generation_prompt=True)
    reply = render("qwen3", messages, add_generation_prompt=False)[len(prompt):].removesuffix("<|im_end|>\n")
    parsed = ThinkParser().parse(reply, get_tool_call_format("qwen3"))
    assert pairs(parsed.calls) == calls
    assert parsed.reasoning == "Three tools needed." and parsed.content == "Let me look." and parsed.errors == []
