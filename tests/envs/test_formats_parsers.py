"""Each format's parser on its own: malformed calls become readable errors (never an exception, never a
silent final answer), round trips of render_calls -> parse, typed XML values, the plug-in path, reasoning."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from agentrl.envs.formats import (
    BUILTIN_FORMATS,
    GptOssFormat,
    ParsedResponse,
    ThinkParser,
    ToolCall,
    detect_foreign_calls,
    get_tool_call_format,
    with_tools,
)

DS = {"B": "<｜tool▁calls▁begin｜>", "b": "<｜tool▁call▁begin｜>", "s": "<｜tool▁sep｜>", "e": "<｜tool▁call▁end｜>",
      "E": "<｜tool▁calls▁end｜>"}
KIMI = "<|tool_calls_section_begin|><|tool_call_begin|>{id}<|tool_call_argument_begin|>{args}<|tool_call_end|>" \
       "<|tool_calls_section_end|>"

# (format, reply, calls that still parse, a piece of the one error message)
MALFORMED = [
    ("qwen3_coder", "<tool_call>\n<function=f>\n<parameter=x>\n1\n</parameter>\n</tool_call>", 0, "unterminated <function=f>"),
    ("qwen3_coder", "<tool_call>\n{\"name\": \"f\"}\n</tool_call>", 0, "holds no <function=NAME>"),
    ("qwen3_coder", "<tool_call>\n<function=f>\n</function>", 1, "unterminated <tool_call>"),
    ("qwen3_coder", "<tool_call>\n<function=>\n</function>\n</tool_call>", 0, "needs a function name"),
    ("qwen3_coder", "<function=f>\n<parameter=a>\n1\n</parameter>\n<parameter=a>\n2\n</parameter>\n</function>", 0,
     "given twice"),
    ("mistral", '[TOOL_CALLS][{"name": "f", "arguments": {"x": 1}]', 0, "not valid JSON"),
    ("mistral", "[TOOL_CALLS] I will call f", 0, "must be followed by a JSON list"),
    ("mistral", '[TOOL_CALLS][{"arguments": {}}]', 0, 'no "name"'),
    ("mistral", "[TOOL_CALLS][]", 0, "empty list"),
    ("mistral", '[TOOL_CALLS]f[ARGS]{"x": ', 0, "not valid JSON"),
    ("deepseek_v3", "{B}{b}function{s}f\n```json\n{{\"x\": 1\n```{e}{E}", 0, "not valid JSON"),
    ("deepseek_v3", "{B}{b}function{s}f\n```json\n{{}}\n```{E}", 0, "unterminated"),
    ("deepseek_v3", "{B}{b}function f {{}}{e}{E}", 0, "needs <｜tool▁sep｜>"),
    ("deepseek_v3", "{B}{b}function{s}f {{\"x\": 1}}{e}{E}", 0, "```json fence"),
    ("deepseek_v3", "{B}{b}function{s}\n```json\n{{}}\n```{e}{E}", 0, "no function name"),
    ("glm45", "<tool_call>f\n<arg_key>x</arg_key>\n</tool_call>", 0, "has no <arg_value>"),
    ("glm45", '<tool_call>{"name": "f", "arguments": {}}</tool_call>', 0, "not JSON"),
    ("glm45", "<tool_call>\n<arg_key>x</arg_key><arg_value>1</arg_value></tool_call>", 0, "function name"),
    ("glm45", "<tool_call>f\n<arg_key>x</arg_key>\n<arg_value>1</arg_value>", 0, "unterminated <tool_call>"),
    ("glm45", "<tool_call>f<arg_key>x</arg_key><arg_value>1</arg_value> junk</tool_call>", 0, "unexpected text"),
    ("kimi_k2", KIMI.format(id="functions.f:0", args='{"x": 1'), 0, "not valid JSON"),
    ("kimi_k2", KIMI.format(id="functions.f:0", args="[1, 2]"), 0, "must be a JSON object"),
    ("kimi_k2", "<|tool_calls_section_begin|><|tool_call_begin|>functions.f:0{}<|tool_call_end|>", 0,
     "needs <|tool_call_argument_begin|>"),
    ("kimi_k2", KIMI.format(id="", args="{}"), 0, "functions.NAME:INDEX"),
    ("kimi_k2", "<|tool_call_begin|>functions.f:0<|tool_call_argument_begin|>{}", 0, "unterminated"),
    ("gpt_oss", "<|channel|>commentary to=functions.f <|constrain|>json<|message|>{\"x\": <|call|>", 0,
     "not valid JSON"),
    ("gpt_oss", "<|channel|>commentary to=functions. json<|message|>{}<|call|>", 0, "no function name"),
    ("gpt_oss", "<|channel|>commentary to=functions.f json<|message|>\"just text\"<|call|>", 0,
     "must be a JSON object"),
    ("gpt_oss", "<|channel|>analysis<|message|>thinking<|end|><|start|>assistant<|channel|>commentary "
     "to=functions.f", 0, "without <|message|>"),
    ("hermes", '<tool_call>{"name": "f", "arguments": {"x": 1}</tool_call>', 0, "not valid JSON"),
    ("llama3_json", '<|python_tag|>{"name": "f", "parameters": {', 0, "not valid JSON"),
]


@pytest.mark.parametrize("name, text, n_calls, error", MALFORMED)
def test_a_malformed_call_is_one_readable_error(name, text, n_calls, error):
    text = text.format(**DS) if name == "deepseek_v3" else text
    parsed = get_tool_call_format(name).parse(text)
    assert len(parsed.calls) == n_calls
    assert len(parsed.errors) == 1 and error in parsed.errors[0], parsed.errors


@pytest.mark.parametrize("name", sorted(BUILTIN_FORMATS))
@pytest.mark.parametrize("text", ["The answer is 4.", "", "Use <b>bold</b> and [brackets] {braces}."])
def test_plain_text_is_content_with_no_calls_and_no_errors(name, text):
    parsed = get_tool_call_format(name).parse(text)
    assert parsed == ParsedResponse(content=text.strip())
    assert not get_tool_call_format(name).looks_like_call(text)


@pytest.mark.parametrize("name", sorted(BUILTIN_FORMATS))
@pytest.mark.parametrize("junk", ["<tool_call>", "</tool_call>", "[TOOL_CALLS]", "<function=", "<|call|>",
                                  "<|message|>", "<｜tool▁call▁begin｜>", "<|tool_call_begin|>", "<arg_key>",
                                  "<|channel|>", "to=functions.", "{\"name\": 1}", "\x00\ud800"])
def test_no_fragment_makes_a_parser_raise(name, junk):
    for text in (junk, "x" + junk, junk + "x" + junk, junk * 3):
        assert isinstance(get_tool_call_format(name).parse(text), ParsedResponse)


# ---- round trips --------------------------------------------------------------------------------------

json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-10**6, 10**6) | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=3),
    max_leaves=8,
)
names = st.from_regex(r"[a-z_][a-z0-9_]{0,12}", fullmatch=True)
call_lists = st.lists(st.builds(ToolCall, name=names, arguments=st.dictionaries(st.text(max_size=8), json_values,
                                                                                 max_size=4)),
                      min_size=1, max_size=3)
JSON_FORMATS = ["hermes", "qwen3", "llama3_json", "mistral", "deepseek_v3", "kimi_k2", "gpt_oss"]


@pytest.mark.parametrize("name", JSON_FORMATS)
@settings(max_examples=25, deadline=None)
@given(calls=call_lists)
def test_json_formats_round_trip(name, calls):
    fmt = get_tool_call_format(name)
    parsed = fmt.parse(fmt.render_calls(calls))
    assert [(c.name, c.arguments) for c in parsed.calls] == [(c.name, c.arguments) for c in calls]
    assert parsed.errors == [] and parsed.content == ""


# Text an XML value can hold: anything but the closing tags (a model cannot write those inside a value either).
xml_text = st.text(max_size=20).filter(lambda s: "</" not in s and "<parameter=" not in s and "<arg_" not in s)
typed = st.one_of(
    st.tuples(st.just("string"), xml_text),
    st.tuples(st.just("integer"), st.integers(-10**6, 10**6)),
    st.tuples(st.just("number"), st.floats(allow_nan=False, allow_infinity=False)),
    st.tuples(st.just("boolean"), st.booleans()),
    st.tuples(st.just("object"), st.dictionaries(st.text(max_size=5), json_values, max_size=3)),
    st.tuples(st.just("array"), st.lists(json_values, max_size=3)),
)
xml_calls = st.lists(st.tuples(names, st.dictionaries(st.from_regex(r"[a-z]{1,6}", fullmatch=True), typed,
                                                      max_size=4)), min_size=1, max_size=3,
                     unique_by=lambda c: c[0])


@pytest.mark.parametrize("name", ["qwen3_coder", "glm45"])
@settings(max_examples=30, deadline=None)
@given(spec=xml_calls)
def test_xml_formats_round_trip_with_the_tool_schemas(name, spec):
    """With the schemas the text values are read back as the declared types ("7" stays a string)."""
    tools = [{"type": "function", "function": {"name": tool, "parameters": {
        "type": "object", "properties": {k: {"type": kind} for k, (kind, _) in args.items()}}}} for tool, args in spec]
    calls = [ToolCall(tool, {k: v for k, (_, v) in args.items()}) for tool, args in spec]
    fmt = with_tools(get_tool_call_format(name), tools)
    parsed = fmt.parse(fmt.render_calls(calls))
    assert [(c.name, c.arguments) for c in parsed.calls] == [(c.name, c.arguments) for c in calls]
    assert parsed.errors == []


@pytest.mark.parametrize("name", ["qwen3_coder", "glm45"])
def test_xml_values_without_schemas_and_a_value_of_the_wrong_type(name):
    fmt = get_tool_call_format(name)
    text = fmt.render_calls([ToolCall("f", {"n": 7, "s": "seven", "d": {"k": [1]}, "q": '"quoted"'})])
    assert fmt.parse(text).calls[0].arguments == {"n": 7, "s": "seven", "d": {"k": [1]}, "q": '"quoted"'}
    typed = with_tools(fmt, [{"name": "f", "parameters": {"properties": {"n": {"type": "integer"}}}}])
    bad = typed.parse(fmt.render_calls([ToolCall("f", {"n": "seven"})]))
    assert bad.calls == [] and bad.errors == ["parameter 'n' of 'f' must be integer, got 'seven'"]


def test_qwen3_coder_reads_the_python_literals_its_template_writes():
    fmt = with_tools(get_tool_call_format("qwen3_coder"), [{"type": "function", "function": {
        "name": "f", "parameters": {"properties": {"flag": {"type": "boolean"}, "opt": {"type": ["integer", "null"]}}}}}])
    text = fmt.render_calls([ToolCall("f", {"flag": True, "opt": None})])
    assert "True" in text and "None" in text  # str(True), str(None), as the template's "| string" writes them
    assert fmt.parse(text).calls[0].arguments == {"flag": True, "opt": None}


def test_qwen3_coder_bare_function_block_and_text_before_the_call():
    parsed = get_tool_call_format("qwen3_coder").parse(
        "I will count.\n<function=count_words>\n<parameter=text>\nhello\n</parameter>\n</function>")
    assert [(c.name, c.arguments) for c in parsed.calls] == [("count_words", {"text": "hello"})]
    assert parsed.content == "I will count." and parsed.errors == []


# ---- formats as the model writes them (not only as templates re-render them) ----------------------------

def test_gpt_oss_generation_with_analysis_preamble_and_call():
    reply = ("<|channel|>analysis<|message|>Need the weather.<|end|><|start|>assistant<|channel|>commentary "
             'to=functions.get_weather <|constrain|>json<|message|>{"city": "Paris"}')  # <|call|> dropped as stop
    parsed = GptOssFormat().parse(reply)
    assert [(c.name, c.arguments) for c in parsed.calls] == [("get_weather", {"city": "Paris"})]
    assert parsed.reasoning == "Need the weather." and parsed.content == "" and parsed.errors == []
    final = GptOssFormat().parse("<|channel|>analysis<|message|>2+2<|end|><|start|>assistant<|channel|>final"
                                 "<|message|>It is 4.")
    assert final == ParsedResponse(content="It is 4.", reasoning="2+2")


def test_mistral_v11_calls_and_deepseek_v31_layout():
    m = get_tool_call_format("mistral").parse('Sure.[TOOL_CALLS]add[ARGS]{"a": 1}[TOOL_CALLS]f[CALL_ID]abc123def'
                                              '[ARGS]{}')
    assert [(c.name, c.arguments) for c in m.calls] == [("add", {"a": 1}), ("f", {})] and m.content == "Sure."
    with_eos = get_tool_call_format("mistral").parse('[TOOL_CALLS][{"name": "f", "arguments": {}}]</s>')
    assert with_eos.content == "" and [c.name for c in with_eos.calls] == ["f"]
    d = get_tool_call_format("deepseek_v3").parse("{B}{b}add{s}{{\"a\": 1}}{e}{E}".format(**DS))
    assert [(c.name, c.arguments) for c in d.calls] == [("add", {"a": 1})] and d.errors == []


def test_kimi_ids_without_namespace_or_index():
    parsed = get_tool_call_format("kimi_k2").parse(KIMI.format(id="add:3", args="{}") + KIMI.format(id="f", args="{}"))
    assert [c.name for c in parsed.calls] == ["add", "f"] and parsed.errors == []


# ---- the issue: a call in another family's syntax is flagged, not taken for an answer ------------------

def test_the_issue_replies_parsed_as_hermes():
    coder = "<tool_call>\n<function=count_words>\n<parameter=text>\nhi there\n</parameter>\n</function>\n</tool_call>"
    parsed = get_tool_call_format("hermes").parse(coder)
    assert parsed.calls == [] and "not valid JSON" in parsed.errors[0]
    assert detect_foreign_calls(coder, "hermes") == ["qwen3_coder"]
    for reply, family in [('[TOOL_CALLS][{"name": "count_words", "arguments": {"text": "hi"}}]', "mistral"),
                          ("{B}{b}function{s}count_words\n```json\n{{}}\n```{e}{E}".format(**DS), "deepseek_v3")]:
        plain = get_tool_call_format("hermes").parse(reply)
        assert plain.calls == [] and plain.errors == []  # hermes alone would take it for an answer ...
        assert detect_foreign_calls(reply, "hermes") == [family]  # ... so the loop asks detect_foreign_calls


def test_detect_foreign_calls_names_nothing_for_a_plain_answer_or_own_syntax():
    for name in BUILTIN_FORMATS:
        assert detect_foreign_calls("The answer is 42.", name) == []
    qwen3 = get_tool_call_format("qwen3")
    assert detect_foreign_calls(qwen3.render_calls([ToolCall("f", {})]), qwen3) == []  # Qwen3 is Hermes syntax


# ---- choosing a format --------------------------------------------------------------------------------

class _Upper:
    name = "upper"

    def parse(self, text: str) -> ParsedResponse:
        return ParsedResponse(content=text.upper())

    def render_calls(self, calls: list[ToolCall]) -> str:
        return ""


UPPER = _Upper()


def test_get_tool_call_format_by_path_instance_and_errors():
    assert get_tool_call_format("test_formats_parsers:_Upper").parse("a").content == "A"
    assert get_tool_call_format("test_formats_parsers:UPPER") is UPPER
    assert get_tool_call_format(UPPER) is UPPER
    assert get_tool_call_format("agentrl.envs.formats.glm:Glm45Format").name == "glm45"
    with pytest.raises(ValueError, match="unknown tool-call format 'nope'; known:"):
        get_tool_call_format("nope")
    with pytest.raises(ImportError, match="not found"):
        get_tool_call_format("no_such_module:Format")
    with pytest.raises(TypeError, match="no parse"):
        get_tool_call_format("test_formats_parsers:pytest")


# ---- reasoning ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("parser, text, reasoning, content", [
    (ThinkParser(), "<think>\nplan\n</think>\n\nanswer", "plan", "answer"),
    (ThinkParser(), "no thinking here", "", "no thinking here"),
    (ThinkParser(), "<think>cut off while thin", "cut off while thin", ""),
    (ThinkParser(), "plan</think>answer", "plan", "answer"),  # the prompt opened the block (DeepSeek-R1)
    (ThinkParser(starts_inside=True), "still thinking", "still thinking", ""),
    (ThinkParser(starts_inside=True), "plan\n</think>\nanswer", "plan", "answer"),
    (ThinkParser(), "<think>a</think>x<think>b</think>y", "a\nb", "xy"),
    (ThinkParser(), "<think></think>\n<tool_call>", "", "<tool_call>"),
])
def test_think_parser_splits_reasoning_from_content(parser, text, reasoning, content):
    assert parser.split(text) == (reasoning, content)


def test_think_parser_unterminated_and_calls_inside_reasoning_are_not_run():
    assert ThinkParser().is_unterminated("<think>abc") and not ThinkParser().is_unterminated("<think>a</think>b")
    assert ThinkParser(starts_inside=True).is_unterminated("abc") and not ThinkParser().is_unterminated("abc")
    hermes = get_tool_call_format("hermes")
    draft = '<think>maybe <tool_call>{"name": "rm", "arguments": {}}</tool_call>?</think>No call needed.'
    parsed = ThinkParser().parse(draft, hermes)
    assert parsed.calls == [] and parsed.content == "No call needed." and "rm" in parsed.reasoning
