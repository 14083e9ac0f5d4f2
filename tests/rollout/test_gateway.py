"""The OpenAI-compatible gateway driven by the official ``openai`` client, with a scripted policy behind it.

The scripted policy (``agentrl.envs.scripted.ScriptedPolicy``) "samples" known reply texts through the
real tiny tokenizer, so tool-call parsing, OpenAI ``tool_calls`` round trips, drift per policy,
streaming and bad input are checked exactly; ``test_gateway_engine.py`` runs the same gateway in front
of a real engine behind smg.
"""

from __future__ import annotations

import json
import threading
import time
import urllib.request
from pathlib import Path

import pytest

openai = pytest.importorskip("openai")

from agentrl.envs.scripted import ScriptedPolicy  # noqa: E402
from agentrl.rollout.gateway import Gateway, create_app, main  # noqa: E402
from agentrl.rollout.router import free_port  # noqa: E402
from agentrl.trajectory import MODEL, Sample, TurnRecord, verify_session  # noqa: E402

pytestmark = pytest.mark.timeout(120)

TOKENIZER_DIR = Path(__file__).resolve().parents[1] / "assets" / "tiny_tokenizer"
_NO_PROXY = urllib.request.build_opener(urllib.request.ProxyHandler({}))

ADD_TOOL = {"type": "function", "function": {
    "name": "add", "description": "Add two numbers.",
    "parameters": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                   "required": ["a", "b"]}}}
CALL = '<tool_call>{"name": "add", "arguments": {"a": 2, "b": 3}}</tool_call>'  # the template's own spacing
COMPACT_CALL = '<tool_call>{"name":"add","arguments":{"a":2,"b":3}}</tool_call>'  # re-renders differently
QUESTION = [{"role": "system", "content": "Use tools."}, {"role": "user", "content": "What is 2+3?"}]


class ServerThread:
    """A uvicorn server for ``app`` in a daemon thread on a free 127.0.0.1 port."""

    def __init__(self, app) -> None:
        import uvicorn

        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def __enter__(self) -> ServerThread:
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("gateway server did not start")
            time.sleep(0.02)
        return self

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(15)


def post(url: str, body: object = None, raw: bytes | None = None) -> tuple[int, dict]:
    data = raw if raw is not None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method="POST", headers={"content-type": "application/json"})
    try:
        with _NO_PROXY.open(req, timeout=30) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())


def finish(url: str, session: str, reward: float = 1.0) -> tuple[list[Sample], list[TurnRecord]]:
    status, body = post(f"{url}/sessions/{session}/finish", {"reward": reward, "return_turns": True})
    assert status == 200, body
    turns = [TurnRecord(**t) for t in body["turns"]]
    return [Sample.from_dict(s) for s in body["samples"]], turns


def trained_text(tokenizer, sample: Sample) -> str:
    ids = [t for t, m in zip(sample.tokens[sample.response_start:], sample.loss_mask, strict=True) if m]
    return tokenizer.decode(ids, skip_special_tokens=False)


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(TOKENIZER_DIR)


@pytest.fixture
def served(tokenizer):
    """``served(script, policy=..., context_length=...)`` -> (base URL, openai client, gateway, policy)."""
    started: list[ServerThread] = []

    def start(script, *, policy: str = "realign", context_length: int | None = None):
        from transformers import AutoTokenizer

        # The policy gets its own tokenizer: the gateway tokenizes in a worker thread, and a fast tokenizer
        # toggles shared state per call (split_special_tokens), so one instance must not serve two threads.
        scripted = ScriptedPolicy(AutoTokenizer.from_pretrained(TOKENIZER_DIR), script)
        gateway = Gateway(tokenizer, scripted, policy=policy, context_length=context_length, model_name="tiny")
        server = ServerThread(create_app(gateway)).__enter__()
        started.append(server)
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0,
                               http_client=openai.DefaultHttpxClient(trust_env=False))
        return server.url, client, gateway, scripted

    yield start
    for server in started:
        server.__exit__()


def test_tool_call_turns_round_trip_clean_and_only_model_tokens_train(served, tokenizer):
    url, client, gateway, _ = served([CALL, "The answer is 5."])
    messages = list(QUESTION)
    raw = client.chat.completions.with_raw_response.create(model="tiny", messages=messages, tools=[ADD_TOOL],
                                                           user="ep-1")
    first = raw.parse()
    assert raw.headers["x-session-id"] == "ep-1" and raw.headers["x-agentrl-outcome"] == "new"
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.function.name == "add" and json.loads(call.function.arguments) == {"a": 2, "b": 3}
    assert call.id.startswith("call_")
    assert first.usage.completion_tokens == len(gateway.manager.turns("ep-1")[0].output_ids)

    messages += [choice.message, {"role": "tool", "tool_call_id": call.id, "content": "5"}]
    raw = client.chat.completions.with_raw_response.create(model="tiny", messages=messages, tools=[ADD_TOOL],
                                                           user="ep-1")
    second = raw.parse()
    assert raw.headers["x-agentrl-outcome"] == "clean" and raw.headers["x-agentrl-turn"] == "1"
    assert second.choices[0].message.content == "The answer is 5." and second.choices[0].finish_reason == "stop"
    assert second.choices[0].message.tool_calls is None

    samples, turns = finish(url, "ep-1", reward=1.0)
    verify_session(samples, turns)
    (sample,) = samples
    assert sample.reward == 1.0 and sample.session_id == "ep-1"
    assert sample.metadata["turns"] == [0, 1] and sample.metadata["use_tool"] is True
    # Exactly the two sampled replies are trained; the tool result "5" and the template around it are not.
    assert trained_text(tokenizer, sample) == CALL + "<|im_end|>" + "The answer is 5." + "<|im_end|>"
    for token, prov, mask in zip(sample.tokens[sample.response_start:], sample.provenance[sample.response_start:],
                                 sample.loss_mask, strict=True):
        assert mask == 0 or prov.source == MODEL, (token, prov)
    tool_text = tokenizer.decode(sample.tokens, skip_special_tokens=False)
    assert "<tool_response>\n5\n</tool_response>" in tool_text


@pytest.mark.parametrize(("policy", "outcome", "n_samples"),
                         [("realign", "realigned", 1), ("fork", "forked", 2), ("truncate", "cut", 1)])
def test_replayed_tool_calls_that_re_render_differently_drift_per_policy(served, policy, outcome, n_samples):
    # The model wrote compact JSON; the template renders the echoed tool_calls with spaces: the next prompt
    # does not extend what was sampled, inside the latest response.
    url, client, _, _ = served([COMPACT_CALL, "5"], policy=policy)
    messages = list(QUESTION)
    first = client.chat.completions.create(model="tiny", messages=messages, tools=[ADD_TOOL], user="s")
    call = first.choices[0].message.tool_calls[0]
    messages += [first.choices[0].message, {"role": "tool", "tool_call_id": call.id, "content": "5"}]
    raw = client.chat.completions.with_raw_response.create(model="tiny", messages=messages, tools=[ADD_TOOL], user="s")
    assert raw.headers["x-agentrl-outcome"] == outcome
    samples, turns = finish(url, "s")
    verify_session(samples, turns)
    assert len(samples) == n_samples
    trained = sorted(t for s in samples for t in s.metadata["trained_turns"])
    assert trained == ([0, 1] if policy == "fork" else [1])  # realign/truncate un-train the drifted reply


def test_rewritten_history_starts_a_new_sample_and_nothing_is_trained_twice(served):
    url, client, gateway, _ = served(["first answer", "second", "third"])
    messages = [{"role": "user", "content": "hi"}]
    a = client.chat.completions.create(model="tiny", messages=messages, user="rw")
    messages += [a.choices[0].message, {"role": "user", "content": "more"}]
    client.chat.completions.create(model="tiny", messages=messages, user="rw")
    # The agent edits its first reply (e.g. a summariser rewrote it) and asks again.
    edited = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "an edited answer"},
              {"role": "user", "content": "more"}]
    raw = client.chat.completions.with_raw_response.create(model="tiny", messages=edited, user="rw")
    assert raw.headers["x-agentrl-outcome"] == "branched"
    samples, turns = finish(url, "rw")
    verify_session(samples, turns)
    assert [s.metadata["turns"] for s in samples] == [[0, 1], [2]]
    assert samples[1].metadata["branched"] is True
    assert gateway.manager.stats["branched"] == 1
    # The same through the Python API.
    client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], user="py")
    (sample,) = gateway.finish_session("py", 0.25, group_id=7)
    assert sample.reward == 0.25 and sample.group_id == 7 and sample.session_id == "py"


def test_streaming_text_and_tool_calls_in_openai_chunks(served):
    url, client, _, _ = served(["Hello there, streaming world!", CALL])
    stream = client.chat.completions.create(model="tiny", messages=QUESTION, tools=[ADD_TOOL], user="st",
                                            stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    deltas = [c.choices[0].delta.content for c in chunks if c.choices and c.choices[0].delta.content]
    assert "".join(deltas) == "Hello there, streaming world!" and len(deltas) > 1
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens > 0

    messages = [*QUESTION, {"role": "assistant", "content": "Hello there, streaming world!"},
                {"role": "user", "content": "add them"}]
    chunks = list(client.chat.completions.create(model="tiny", messages=messages, tools=[ADD_TOOL], user="st",
                                                 stream=True))
    calls = [tc for c in chunks for tc in (c.choices[0].delta.tool_calls or [])]
    assert len(calls) == 1 and calls[0].function.name == "add" and calls[0].index == 0
    assert json.loads(calls[0].function.arguments) == {"a": 2, "b": 3}
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    samples, turns = finish(url, "st")
    verify_session(samples, turns)
    assert samples[0].metadata["outcomes"] == ["new", "clean"]


def test_concurrent_sessions_are_recorded_apart(served, tokenizer):
    import asyncio

    url, _, gateway, _ = served(lambda prompt, turn: f"reply {turn} to {prompt.split('user')[-1].strip()[:12]}")

    async def agent(client, index: int) -> None:
        messages = [{"role": "user", "content": f"task {index}"}]
        for _ in range(2):
            reply = await client.chat.completions.create(model="tiny", messages=messages, user=f"c{index}")
            messages += [reply.choices[0].message, {"role": "user", "content": "go on"}]

    async def main_() -> None:
        async with openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0,
                                      http_client=openai.DefaultAsyncHttpxClient(trust_env=False)) as client:
            await asyncio.gather(*(agent(client, i) for i in range(8)))

    asyncio.run(main_())
    assert sorted(gateway.manager.sessions) == sorted(f"c{i}" for i in range(8))
    for i in range(8):
        samples, turns = finish(url, f"c{i}")
        verify_session(samples, turns)
        assert len(samples) == 1 and samples[0].metadata["outcomes"] == ["new", "clean"]
        text = tokenizer.decode(samples[0].tokens, skip_special_tokens=False)
        assert f"task {i}" in text and all(f"task {j}" not in text for j in range(8) if j != i)


def test_malformed_tool_call_comes_back_as_text_and_is_counted(served):
    bad = '<tool_call>{"name": "add", "arguments": {"a": 2,</tool_call>'
    url, client, _, _ = served([bad])
    reply = client.chat.completions.create(model="tiny", messages=QUESTION, tools=[ADD_TOOL], user="bad")
    assert reply.choices[0].message.content == bad and reply.choices[0].message.tool_calls is None
    assert reply.choices[0].finish_reason == "stop"
    samples, turns = finish(url, "bad")
    verify_session(samples, turns)
    assert samples[0].metadata["turn_metadata"] == [{"tool_calls": [], "malformed_calls": 1}]


def test_without_tools_a_tool_call_text_is_plain_content(served):
    url, client, _, _ = served([CALL])
    reply = client.chat.completions.create(model="tiny", messages=QUESTION, user="plain")
    assert reply.choices[0].message.content == CALL and reply.choices[0].message.tool_calls is None


def test_session_header_wins_logprobs_sampling_params_and_models(served):
    url, client, gateway, scripted = served(["ok"], context_length=512)
    reply = client.chat.completions.create(model="tiny", messages=QUESTION, user="ignored", logprobs=True,
                                           temperature=0.5, top_p=0.9, max_tokens=7, seed=3, stop=["\n\n"],
                                           extra_headers={"X-Session-Id": "from-header"})
    assert gateway.manager.sessions == ["from-header"]
    turn = gateway.manager.turns("from-header")[0]
    assert [e.logprob for e in reply.choices[0].logprobs.content] == list(turn.output_logprobs)
    assert scripted.sampling_params[-1] == {"temperature": 0.5, "top_p": 0.9, "stop": ["\n\n"],
                                            "sampling_seed": 3, "max_new_tokens": 7}
    assert [m.id for m in client.models.list().data] == ["tiny"]
    status, body = post(url + "/chat/completions", {"model": "tiny", "messages": QUESTION, "user": "no-v1"})
    assert status == 200 and body["choices"][0]["message"]["content"] == "ok" and "no-v1" in gateway.manager.sessions
    reply = client.chat.completions.create(model="tiny", messages=QUESTION, user="defaults")
    # without max_tokens the reply may use the rest of the context
    assert scripted.sampling_params[-1] == {"temperature": 1.0, "max_new_tokens": 512 - len(turn.prompt_ids)}


def test_bad_requests_get_clear_errors_and_the_gateway_keeps_serving(served):
    url, client, gateway, _ = served(["ok"], context_length=64)
    cases = [
        (dict(messages=QUESTION), "no session id"),
        (dict(messages=[{"role": "wizard", "content": "x"}], user="e"), "role must be one of"),
        (dict(messages=QUESTION, user="e", n=2), "n=2 is not supported"),
        (dict(messages=QUESTION, user="e", tools=[ADD_TOOL], tool_choice="required"), "tool_choice"),
        (dict(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}], user="e"),
         "only text content parts"),
        (dict(messages=[{"role": "assistant", "tool_calls": [{"id": "1", "type": "function"}]}], user="e"),
         "a tool call must be"),
        (dict(messages=[{"role": "user", "content": "x" * 400}], user="e"), "the model's context is 64"),
    ]
    for kwargs, message in cases:
        with pytest.raises(openai.BadRequestError) as info:
            client.chat.completions.create(model="tiny", **kwargs)
        assert message in info.value.message, (kwargs, info.value.message)
    with pytest.raises(openai.UnprocessableEntityError, match="messages"):
        client.chat.completions.create(model="tiny", messages=[], user="e")
    status, body = post(url + "/v1/chat/completions", raw=b"{not json")
    assert status == 422 and "invalid request" in body["error"]["message"]
    status, body = post(url + "/v1/chat/completions", {"model": "tiny", "messages": QUESTION, "temperature": -1,
                                                       "user": "e"})
    assert status == 422 and "temperature" in body["error"]["message"]
    assert not gateway.manager.sessions  # nothing was recorded by a refused request

    with _NO_PROXY.open(url + "/sessions", timeout=10) as resp:
        listed = json.loads(resp.read())
    assert listed["sessions"] == [] and listed["stats"]["new"] == 0
    status, body = post(url + "/sessions/nobody/finish", {"reward": 1.0})
    assert status == 404 and "unknown session 'nobody'" in body["error"]["message"]
    client.chat.completions.create(model="tiny", messages=QUESTION, user="fine")
    for bad in ({"reward": "high"}, {"reward": True}, {}, {"reward": 1, "extra": 2}):
        status, body = post(url + "/sessions/fine/finish", bad)
        assert status == 422, (bad, body)
    status, body = post(url + "/sessions/fine/finish", {"reward": 1.0, "metadata": {"turns": []}})
    assert status == 400 and "may not override" in body["error"]["message"]
    status, body = post(url + "/sessions/fine/finish", {"reward": {"pass": 1.0}, "group_id": "g"})
    assert status == 200 and body["samples"][0]["reward"] == {"pass": 1.0} and body["samples"][0]["group_id"] == "g"
    assert "turns" not in body
    status, body = post(url + "/sessions/fine/finish", {"reward": 1.0})
    assert status == 404 and "already" in body["error"]["message"]


def test_unreachable_engines_answer_503_and_record_nothing(tokenizer):
    from agentrl.rollout.client import RolloutClient

    client = RolloutClient(f"http://127.0.0.1:{free_port()}", max_retries=1, backoff=0.01)
    gateway = Gateway(tokenizer, client.generate_turn, model_name="tiny")
    with ServerThread(create_app(gateway, on_shutdown=client.aclose)) as server:
        status, body = post(server.url + "/v1/chat/completions", {"model": "tiny", "messages": QUESTION, "user": "u"})
        assert status == 503 and "failed 2 times" in body["error"]["message"]
        assert body["error"]["type"] == "engine_unavailable" and not gateway.manager.sessions


@pytest.mark.parametrize(("argv", "message"), [
    (["--router", "http://127.0.0.1:1", "--model", "/nonexistent"], "is not a directory"),
    (["--router", "http://127.0.0.1:1", "--model", "{tmp}"], "has no config.json"),
    (["--router", "127.0.0.1:1", "--model", "{model}"], "--router must be an http(s) URL"),
    (["--router", "http://127.0.0.1:1", "--model", "{model}", "--policy", "sideways"], "unknown drift policy"),
    (["--router", "http://127.0.0.1:1", "--model", "{model}", "--port", "0"], "--port must be in"),
])
def test_cli_bad_arguments_exit_2_with_a_clear_message(argv, message, tmp_path, capsys):
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_text("{}")
    argv = [a.format(tmp=tmp_path, model=tmp_path / "m") for a in argv]
    assert main(argv) == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("reward", [float("nan"), float("inf"), {"pass": 1.0, "style": float("-inf")}], ids=repr)
def test_a_non_finite_finish_is_a_clear_400_and_the_session_survives_it(served, reward):
    url, client, gateway, _ = served(["The answer is 5."])
    client.chat.completions.create(model="tiny", messages=QUESTION, user="nan")
    # Python's json writes the literal NaN / Infinity tokens a careless client sends.
    raw = json.dumps({"reward": reward, "return_turns": True}).encode()
    assert b"NaN" in raw or b"Infinity" in raw
    status, body = post(f"{url}/sessions/nan/finish", raw=raw)
    assert status == 400 and body["error"]["code"] == "non_finite_reward" and body["error"]["param"] == "reward"
    assert "must be a finite number" in body["error"]["message"] and "still open" in body["error"]["message"]
    status, body = post(f"{url}/sessions/nan/finish", {"reward": 1.0, "metadata": {"score": float("nan")}})
    assert status == 400 and "metadata must not hold NaN" in body["error"]["message"]
    assert gateway.manager.sessions == ["nan"]
    samples, turns = finish(url, "nan", reward=0.5)  # the corrected finish gets the whole trajectory
    assert [s.reward for s in samples] == [0.5]
    verify_session(samples, turns)


# ---- tool-call format, reasoning_content, chat_template_kwargs ----------------------------------------
THINKING_HEADER = ("{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
                   "{%- if enable_thinking is defined and enable_thinking %}{{- '<think>\\n' }}{%- endif %}{%- endif %}")


@pytest.fixture(scope="module")
def thinking_dir(tmp_path_factory):
    """The tiny tokenizer with a Qwen3-like template: ``enable_thinking`` opens a ``<think>`` block."""
    import shutil

    out = tmp_path_factory.mktemp("thinking") / "tok"
    shutil.copytree(TOKENIZER_DIR, out)
    template = (out / "chat_template.jinja").read_text()
    plain_header = "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
    assert plain_header in template
    (out / "chat_template.jinja").write_text(template.replace(plain_header, THINKING_HEADER))
    return out


@pytest.fixture
def serve_gateway():
    """``serve_gateway(tokenizer_dir, script, **gateway_kwargs)`` -> (openai client, gateway, policy)."""
    from transformers import AutoTokenizer

    started: list[ServerThread] = []

    def start(tokenizer_dir, script, **kwargs):
        scripted = ScriptedPolicy(AutoTokenizer.from_pretrained(tokenizer_dir), script)
        gateway = Gateway(AutoTokenizer.from_pretrained(tokenizer_dir), scripted, model_name="tiny", **kwargs)
        server = ServerThread(create_app(gateway)).__enter__()
        started.append(server)
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0,
                               http_client=openai.DefaultHttpxClient(trust_env=False))
        return client, gateway, scripted

    yield start
    for server in started:
        server.__exit__()


def test_tool_format_flag_chooses_the_call_syntax(serve_gateway):
    llama_call = '{"name": "add", "parameters": {"a": 2, "b": 3}}'
    client, gateway, _ = serve_gateway(TOKENIZER_DIR, [llama_call], tool_format="llama3_json")
    reply = client.chat.completions.create(model="tiny", messages=QUESTION, tools=[ADD_TOOL], user="l").choices[0]
    assert gateway.tool_format.name == "llama3_json"
    assert reply.finish_reason == "tool_calls" and json.loads(reply.message.tool_calls[0].function.arguments) == {"a": 2, "b": 3}
    client, gateway, _ = serve_gateway(TOKENIZER_DIR, [llama_call])  # the template's own (Hermes): plain text
    reply = client.chat.completions.create(model="tiny", messages=QUESTION, tools=[ADD_TOOL], user="h").choices[0]
    assert gateway.tool_format.name == "hermes" and reply.message.tool_calls is None
    assert reply.message.content == llama_call


def test_reasoning_comes_back_as_reasoning_content_and_drafts_inside_it_are_not_calls(serve_gateway, thinking_dir):
    draft = '<tool_call>{"name": "add", "arguments": {"a": 9, "b": 9}}</tool_call>'
    script = [f"<think>2 plus 3; maybe {draft}</think>{CALL}", "<think>done</think>The answer is 5."]
    client, gateway, _ = serve_gateway(thinking_dir, script)  # auto: the template thinks in <think> blocks
    first = client.chat.completions.create(model="tiny", messages=QUESTION, tools=[ADD_TOOL], user="r").choices[0]
    assert first.message.model_extra["reasoning_content"] == f"2 plus 3; maybe {draft}"
    (call,) = first.message.tool_calls  # the draft inside the reasoning is not run
    assert json.loads(call.function.arguments) == {"a": 2, "b": 3} and first.message.content is None
    history = [*QUESTION, first.message, {"role": "tool", "tool_call_id": call.id, "content": "5"}]
    stream = client.chat.completions.create(model="tiny", messages=history, tools=[ADD_TOOL], user="r", stream=True)
    deltas = [c.choices[0].delta for c in stream if c.choices]
    assert [d.model_extra.get("reasoning_content") for d in deltas if d.model_extra.get("reasoning_content")] == ["done"]
    assert "".join(d.content or "" for d in deltas) == "The answer is 5."
    # The turn recorded is what was sampled, reasoning included (the split is only how the agent sees it).
    turns = gateway.manager.turns("r")
    assert gateway.tokenizer.decode(turns[0].output_ids).startswith("<think>2 plus 3; maybe <tool_call>")
    verify_session(gateway.finish_session("r", 1.0), turns)

    client, _, _ = serve_gateway(thinking_dir, script, reasoning="none")  # off: the model's text as it is
    raw = client.chat.completions.create(model="tiny", messages=QUESTION, user="n").choices[0].message
    assert raw.content == script[0] and "reasoning_content" not in (raw.model_extra or {})


def test_chat_template_kwargs_reach_the_template_per_gateway_and_per_request(serve_gateway, thinking_dir):
    client, gateway, policy = serve_gateway(thinking_dir, ["2 plus 3</think>The answer is 5."],
                                            chat_template_kwargs={"enable_thinking": True})
    reply = client.chat.completions.create(model="tiny", messages=QUESTION, user="k").choices[0].message
    prompt = policy.tokenizer.decode(policy.turns["k"][0].prompt_ids, skip_special_tokens=False)
    assert prompt.endswith("<|im_start|>assistant\n<think>\n")
    # The prompt opened the block, so the reply starts inside it.
    assert reply.model_extra["reasoning_content"] == "2 plus 3" and reply.content == "The answer is 5."
    client.chat.completions.create(model="tiny", messages=QUESTION, user="k2",
                                   extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    prompt = policy.tokenizer.decode(policy.turns["k2"][0].prompt_ids, skip_special_tokens=False)
    assert prompt.endswith("<|im_start|>assistant\n")


@pytest.mark.parametrize(("argv", "message"), [
    (["--tool-format", "smoke-signals"], "unknown tool-call format"),
    (["--chat-template-kwargs", "[1]"], "must be a JSON object"),
    (["--chat-template-kwargs", "{nope"], "not JSON"),
    (["--reasoning-parser", "maybe"], "invalid choice"),
])
def test_cli_format_and_template_flags_refuse_bad_values(argv, message, tmp_path, capsys):
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_text("{}")
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        (tmp_path / "m" / name).write_bytes((TOKENIZER_DIR / name).read_bytes())
    try:
        code = main(["--router", "http://127.0.0.1:1", "--model", str(tmp_path / "m"), *argv])
    except SystemExit as exit_:  # argparse's own refusals
        code = exit_.code
    assert code == 2
    assert message in capsys.readouterr().err
