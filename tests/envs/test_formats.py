"""Tool-call parsers and renderers: round trips, edge cases, malformed calls, per-tokenizer selection."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from agentrl.envs.formats import (
    HermesFormat,
    Llama3JsonFormat,
    ToolCall,
    format_for,
    get_tool_call_format,
    register_tool_call_format,
)

json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-10**6, 10**6) | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=3),
    max_leaves=8,
)
calls = st.lists(
    st.builds(ToolCall, name=st.from_regex(r"[a-z_][a-z0-9_]{0,12}", fullmatch=True),
              arguments=st.dictionaries(st.text(max_size=8), json_values, max_size=4)),
    min_size=1, max_size=3,
)


@settings(max_examples=30, deadline=None)
@given(calls=calls, before=st.text(max_size=20).filter(lambda s: "tool_call>" not in s))
def test_hermes_round_trip(calls, before):
    fmt = HermesFormat()
    parsed = fmt.parse(before + fmt.render_calls(calls))
    assert [(c.name, c.arguments) for c in parsed.calls] == [(c.name, c.arguments) for c in calls]
    assert parsed.errors == [] and parsed.content == before.strip()


@settings(max_examples=20, deadline=None)
@given(calls=calls)
def test_llama3_round_trip(calls):
    fmt = Llama3JsonFormat()
    parsed = fmt.parse(fmt.render_calls(calls))
    assert [(c.name, c.arguments) for c in parsed.calls] == [(c.name, c.arguments) for c in calls]
    assert parsed.errors == []


def test_hermes_render_matches_chat_template_text():
    text = HermesFormat().render_calls([ToolCall("submit", {"answer": 85})])
    assert text == '<tool_call>{"name": "submit", "arguments": {"answer": 85}}</tool_call>'


@pytest.mark.parametrize(
    "text, n_calls, error",
    [
        ('<tool_call>{"name": "f", "arguments": {"x": 1}</tool_call>', 0, "not valid JSON"),
        ('<tool_call>{"name": "f", "arguments": {"x": 1}}', 0, "unterminated <tool_call>"),
        ("<tool_call>[1, 2]</tool_call>", 0, "must be a JSON object"),
        ('<tool_call>{"arguments": {}}</tool_call>', 0, 'no "name"'),
        ('<tool_call>{"name": "f", "arguments": [1]}</tool_call>', 0, "must be a JSON object, got list"),
        ('<tool_call>{"name": "f", "arguments": "not json"}</tool_call>', 0, "got the string"),
        ('done</tool_call> <tool_call>{"name": "f"}</tool_call>', 1, "without a matching"),
        ('<tool_call>{"name": "f"}</tool_call><tool_call>oops</tool_call>', 1, "not valid JSON"),
        ("<tool_call></tool_call>", 0, "not valid JSON"),
    ],
)
def test_hermes_malformed_calls_become_errors(text, n_calls, error):
    parsed = HermesFormat().parse(text)
    assert len(parsed.calls) == n_calls
    assert len(parsed.errors) == 1 and error in parsed.errors[0]


def test_hermes_accepts_parameters_key_string_arguments_and_whitespace():
    parsed = HermesFormat().parse(
        'Let me add.\n<tool_call>\n{"name": "add", "parameters": {"a": 1}}\n</tool_call>\n'
        '<tool_call>{"name": "sub", "arguments": "{\\"a\\": 2}"}</tool_call>'
    )
    assert [(c.name, c.arguments) for c in parsed.calls] == [("add", {"a": 1}), ("sub", {"a": 2})]
    assert parsed.content == "Let me add." and parsed.errors == []


def test_plain_text_has_no_calls_and_no_errors():
    parsed = HermesFormat().parse("The answer is 4.")
    assert parsed.calls == [] and parsed.errors == [] and parsed.content == "The answer is 4."


def test_llama3_plain_text_and_bad_json():
    assert Llama3JsonFormat().parse("Hello there").calls == []
    bad = Llama3JsonFormat().parse('<|python_tag|>{"name": "f", "parameters": {')
    assert bad.calls == [] and "not valid JSON" in bad.errors[0]


def test_selection_from_tokenizer_template_and_registry(tokenizer):
    assert isinstance(format_for(tokenizer), HermesFormat)

    class Llamaish:
        chat_template = "{% if message.role == 'ipython' %}<|python_tag|>{% endif %}"

    assert isinstance(format_for(Llamaish()), Llama3JsonFormat)
    register_tool_call_format("my_format", HermesFormat)
    assert isinstance(get_tool_call_format("my_format"), HermesFormat)
    with pytest.raises(ValueError, match="unknown tool-call format 'nope'; known:"):
        get_tool_call_format("nope")


def test_openai_tool_call_shape_renders_back_to_the_same_text(renderer):
    call = ToolCall("add", {"a": 1, "b": "<|im_end|>"})
    entry = call.to_openai("call_0")
    assert entry == {"id": "call_0", "type": "function",
                     "function": {"name": "add", "arguments": '{"a": 1, "b": "<|im_end|>"}'}}
    as_text = renderer.render([{"role": "user", "content": "q"},
                               {"role": "assistant", "content": HermesFormat().render_calls([call])}])
    as_calls = renderer.render([{"role": "user", "content": "q"},
                                {"role": "assistant", "content": None, "tool_calls": [entry]}])
    assert as_text.ids == as_calls.ids  # a replayed OpenAI history re-tokenizes like the raw reply
    assert as_text.assistant_mask == as_calls.assistant_mask and sum(as_calls.assistant_mask) > 10
