"""The gateway's Responses (``/v1/responses``) and Anthropic Messages (``/v1/messages``) routes, driven by the
real ``openai``, ``anthropic`` and ``openai-agents`` clients with a scripted policy behind the gateway: every
turn is recorded on the same session store as chat completions, the recorded samples verify, streamed
text equals non-streamed text and the recorded tokens, bad bodies get that protocol's own 4xx and keep the
session, and one recorded session per protocol trains a step."""

from __future__ import annotations

import json

import pytest

openai = pytest.importorskip("openai")
anthropic = pytest.importorskip("anthropic")

from test_gateway import ADD_TOOL, CALL, QUESTION, TOKENIZER_DIR, ServerThread, finish, post  # noqa: E402

from agentrl.envs.scripted import ScriptedPolicy  # noqa: E402
from agentrl.rollout.gateway import Gateway, create_app  # noqa: E402
from agentrl.trajectory import MODEL, verify_session  # noqa: E402
from agentrl.trajectory.sample import REWARD_LIMIT  # noqa: E402

pytestmark = pytest.mark.timeout(120)

ANSWER = "The answer is 5."
SYSTEM = QUESTION[0]["content"]
ASK = QUESTION[1]["content"]
ANTHROPIC_ADD = {"name": "add", "description": ADD_TOOL["function"]["description"],
                 "input_schema": ADD_TOOL["function"]["parameters"]}
RESPONSES_ADD = {"type": "function", "name": "add", "description": ADD_TOOL["function"]["description"],
                 "parameters": ADD_TOOL["function"]["parameters"]}


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(TOKENIZER_DIR)


@pytest.fixture
def gateway_url(tokenizer):
    """``gateway_url(script, **gateway_kwargs)`` -> (base URL, gateway)."""
    from transformers import AutoTokenizer

    started: list[ServerThread] = []

    def start(script, **kwargs):
        scripted = ScriptedPolicy(AutoTokenizer.from_pretrained(TOKENIZER_DIR), script)
        gateway = Gateway(tokenizer, scripted, model_name="tiny", **kwargs)
        server = ServerThread(create_app(gateway)).__enter__()
        started.append(server)
        return server.url, gateway

    yield start
    for server in started:
        server.__exit__()


def anthropic_client(url: str, session: str | None = None, api_key: str = "unused"):
    headers = {"X-Session-Id": session} if session else None
    return anthropic.Anthropic(base_url=url, api_key=api_key, max_retries=0, default_headers=headers,
                               http_client=anthropic.DefaultHttpxClient(trust_env=False))


def openai_client(url: str, session: str | None = None):
    headers = {"X-Session-Id": session} if session else None
    return openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, default_headers=headers,
                         http_client=openai.DefaultHttpxClient(trust_env=False))


def recorded_reply(tokenizer, gateway, session: str, turn: int) -> str:
    ids = list(gateway.manager.turns(session)[turn].output_ids)
    return tokenizer.decode(ids, skip_special_tokens=False).removesuffix("<|im_end|>")


def assert_model_tokens_train(sample) -> None:
    for prov, mask in zip(sample.provenance[sample.response_start:], sample.loss_mask, strict=True):
        assert mask == 0 or prov.source == MODEL


# ---- Anthropic Messages ---------------------------------------------------------------------------------
def anthropic_tool_episode(client, session: str):
    """ask -> tool_use -> tool_result -> answer, through ``client.messages.create``."""
    first = client.messages.create(model="tiny", max_tokens=64, system=SYSTEM, tools=[ANTHROPIC_ADD],
                                   messages=[{"role": "user", "content": ASK}], metadata={"user_id": session})
    (use,) = [b for b in first.content if b.type == "tool_use"]
    messages = [{"role": "user", "content": ASK},
                {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in first.content]},
                {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "5"}]}]
    raw = client.messages.with_raw_response.create(model="tiny", max_tokens=64, system=SYSTEM, tools=[ANTHROPIC_ADD],
                                                   messages=messages, metadata={"user_id": session})
    return first, raw


def test_anthropic_tool_use_round_trip_records_a_clean_proven_session(gateway_url, tokenizer):
    url, gateway = gateway_url([CALL, ANSWER])
    first, raw = anthropic_tool_episode(anthropic_client(url), "an-1")
    assert first.stop_reason == "tool_use" and first.role == "assistant" and first.type == "message"
    (use,) = first.content
    assert use.type == "tool_use" and use.name == "add" and use.input == {"a": 2, "b": 3}
    assert first.usage.output_tokens == len(gateway.manager.turns("an-1")[0].output_ids)
    assert raw.headers["x-agentrl-outcome"] == "clean" and raw.headers["x-agentrl-turn"] == "1"
    second = raw.parse()
    assert second.stop_reason == "end_turn" and [b.text for b in second.content] == [ANSWER]
    samples, turns = finish(url, "an-1")
    verify_session(samples, turns)
    (sample,) = samples
    assert_model_tokens_train(sample)
    text = tokenizer.decode(sample.tokens, skip_special_tokens=False)
    assert SYSTEM in text and "<tool_response>\n5\n</tool_response>" in text


def test_anthropic_stream_equals_the_plain_reply_and_the_recorded_tokens(gateway_url, tokenizer):
    reply = "Hello there, streaming world, in many small pieces!"
    url, gateway = gateway_url([reply, reply, CALL])
    client = anthropic_client(url, session="an-st")
    plain = client.messages.create(model="tiny", max_tokens=64, messages=[{"role": "user", "content": ASK}])
    with client.messages.stream(model="tiny", max_tokens=64, messages=[{"role": "user", "content": ASK}]) as stream:
        pieces = list(stream.text_stream)
        final = stream.get_final_message()
    assert len(pieces) > 1 and "".join(pieces) == plain.content[0].text == final.content[0].text == reply
    assert recorded_reply(tokenizer, gateway, "an-st", 1) == reply and final.stop_reason == "end_turn"
    with client.messages.stream(model="tiny", max_tokens=64, tools=[ANTHROPIC_ADD],
                                messages=[{"role": "user", "content": ASK}]) as stream:
        final = stream.get_final_message()
    assert final.stop_reason == "tool_use" and final.content[0].input == {"a": 2, "b": 3}
    samples, turns = finish(url, "an-st")
    verify_session(samples, turns)


def test_anthropic_bad_bodies_get_anthropic_errors_and_the_session_is_kept(gateway_url):
    url, gateway = gateway_url([ANSWER])
    client = anthropic_client(url, session="an-bad")
    client.messages.create(model="tiny", max_tokens=16, messages=[{"role": "user", "content": ASK}])
    image = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AAAA"}}
    bad = [
        ({"model": "tiny", "max_tokens": 8, "messages": [{"role": "user", "content": [image]}]}, "'image'"),
        ({"model": "tiny", "max_tokens": 8, "messages": [{"role": "tool", "content": "5"}]}, "role"),
        ({"model": "tiny", "max_tokens": 8, "extra_body": {"top_k": 5}, "messages": [{"role": "user", "content": "x"}]}, "top_k"),
        ({"model": "tiny", "max_tokens": 8, "tools": [{"type": "web_search_20250305", "name": "web_search"}],
          "messages": [{"role": "user", "content": "x"}]}, "tools[0]"),
        ({"model": "tiny", "max_tokens": 8, "tool_choice": {"type": "any"},
          "messages": [{"role": "user", "content": "x"}]}, "tool_choice"),
        # a chat-completions body on the Messages route (a tool message is not an Anthropic role)
        ({"model": "tiny", "max_tokens": 8, "messages": [{"role": "system", "content": "x"}]}, "role"),
    ]
    for body, named in bad:
        with pytest.raises(anthropic.BadRequestError) as caught:
            client.messages.create(**body)
        assert caught.value.status_code == 400
        assert caught.value.body["type"] == "error" and caught.value.body["error"]["type"] == "invalid_request_error"
        assert named in caught.value.body["error"]["message"], (body, caught.value.body)
    for raw in (b"{not json", json.dumps({"model": "tiny", "messages": [{"role": "user", "content": ASK}]}).encode(),
                json.dumps({"model": "tiny", "messages": QUESTION}).encode()):  # no max_tokens; a chat body
        status, body = post(url + "/v1/messages", raw=raw)
        assert status == 400 and body["type"] == "error" and body["error"]["type"] == "invalid_request_error", body
    assert "max_tokens" in body["error"]["message"]
    with pytest.raises(anthropic.BadRequestError, match="metadata.user_id"):  # no session id at all
        anthropic_client(url).messages.create(model="tiny", max_tokens=8, messages=[{"role": "user", "content": "x"}])
    assert gateway.manager.turn_count("an-bad") == 1
    samples, turns = finish(url, "an-bad")
    verify_session(samples, turns)


def test_anthropic_client_key_is_checked_in_anthropic_shape(tokenizer):
    from transformers import AutoTokenizer

    gateway = Gateway(tokenizer, ScriptedPolicy(AutoTokenizer.from_pretrained(TOKENIZER_DIR), [ANSWER]),
                      model_name="tiny", api_key="sekret")
    with ServerThread(create_app(gateway)) as server:
        with pytest.raises(anthropic.AuthenticationError) as caught:
            anthropic_client(server.url, "k", api_key="wrong").messages.create(
                model="tiny", max_tokens=8, messages=[{"role": "user", "content": "x"}])
        assert caught.value.body["error"]["type"] == "authentication_error"
        reply = anthropic_client(server.url, "k", api_key="sekret").messages.create(
            model="tiny", max_tokens=8, messages=[{"role": "user", "content": "x"}])
        assert reply.content[0].text == ANSWER


# ---- OpenAI Responses -----------------------------------------------------------------------------------
def test_responses_function_calls_chain_by_previous_response_id_and_by_full_input(gateway_url, tokenizer):
    url, gateway = gateway_url([CALL, ANSWER])
    client = openai_client(url)
    first = client.responses.create(model="tiny", instructions=SYSTEM, input=ASK, tools=[RESPONSES_ADD], user="rs-1")
    (call,) = first.output
    assert first.status == "completed" and call.type == "function_call" and call.name == "add"
    assert json.loads(call.arguments) == {"a": 2, "b": 3} and first.usage.output_tokens > 0
    raw = client.responses.with_raw_response.create(
        model="tiny", instructions=SYSTEM, previous_response_id=first.id, tools=[RESPONSES_ADD],
        input=[{"type": "function_call_output", "call_id": call.call_id, "output": "5"}])
    assert raw.headers["x-session-id"] == "rs-1" and raw.headers["x-agentrl-outcome"] == "clean"
    assert raw.parse().output_text == ANSWER
    samples, turns = finish(url, "rs-1")
    verify_session(samples, turns)
    assert_model_tokens_train(samples[0])
    assert "<tool_response>\n5\n</tool_response>" in tokenizer.decode(samples[0].tokens, skip_special_tokens=False)

    # The same conversation with the whole history as input items (what a stateless agent sends).
    first = client.responses.create(model="tiny", instructions=SYSTEM, input=ASK, tools=[RESPONSES_ADD], user="rs-2")
    items = [{"role": "user", "content": ASK}, *[o.model_dump(exclude_none=True) for o in first.output],
             {"type": "function_call_output", "call_id": first.output[0].call_id, "output": "5"}]
    raw = client.responses.with_raw_response.create(model="tiny", instructions=SYSTEM, input=items,
                                                    tools=[RESPONSES_ADD], user="rs-2")
    assert raw.headers["x-agentrl-outcome"] == "clean"
    verify_session(*finish(url, "rs-2"))


def test_responses_reasoning_items_come_back_and_replay_into_the_session(gateway_url):
    url, gateway = gateway_url(["<think>2 plus 3</think>" + ANSWER, "ok"], reasoning="think")
    client = openai_client(url, session="rs-think")
    first = client.responses.create(model="tiny", input=ASK)
    reasoning, message = first.output
    assert reasoning.type == "reasoning" and reasoning.content[0].text == "2 plus 3"
    assert message.type == "message" and first.output_text == ANSWER
    items = [{"role": "user", "content": ASK}, *[o.model_dump(exclude_none=True) for o in first.output],
             {"role": "user", "content": "thanks"}]
    client.responses.create(model="tiny", input=items)
    replayed = gateway.manager.turns("rs-think")
    assert len(replayed) == 2
    verify_session(*finish(url, "rs-think"))


def test_responses_stream_equals_the_plain_reply_and_the_recorded_tokens(gateway_url, tokenizer):
    reply = "Hello there, streaming world, in many small pieces!"
    url, gateway = gateway_url([reply, reply, reply, CALL])
    client = openai_client(url, session="rs-st")
    plain = client.responses.create(model="tiny", input=ASK)
    events = list(client.responses.create(model="tiny", input=ASK, stream=True))
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] == "response.completed"
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = [e.delta for e in events if e.type == "response.output_text.delta"]
    assert len(deltas) > 1 and "".join(deltas) == plain.output_text == reply
    assert events[-1].response.output_text == reply
    with client.responses.stream(model="tiny", input=ASK) as stream:
        final = stream.get_final_response()
    assert final.output_text == reply == recorded_reply(tokenizer, gateway, "rs-st", 2)
    events = list(client.responses.create(model="tiny", input=ASK, tools=[RESPONSES_ADD], stream=True))
    done = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert len(done) == 1 and json.loads(done[0].arguments) == {"a": 2, "b": 3}
    verify_session(*finish(url, "rs-st"))


def test_responses_bad_bodies_get_openai_errors_and_the_session_is_kept(gateway_url):
    url, gateway = gateway_url([ANSWER])
    client = openai_client(url, session="rs-bad")
    client.responses.create(model="tiny", input=ASK)
    bad = [
        ({"model": "tiny", "messages": QUESTION}, "input"),  # a chat-completions body on the Responses route
        ({"model": "tiny", "input": [{"type": "input_image", "image_url": "x"}]}, "input_image"),
        ({"model": "tiny", "input": [{"role": "user", "content": [{"type": "input_file", "file_id": "f"}]}]},
         "input_file"),
        ({"model": "tiny", "input": ASK, "previous_response_id": "resp_nope"}, "resp_nope"),
        ({"model": "tiny", "input": ASK, "tools": [{"type": "web_search"}]}, "tools[0]"),
        ({"model": "tiny", "input": [{"type": "function_call", "name": "add"}]}, "call_id"),
        ({"model": "tiny", "input": ASK, "text": {"format": {"type": "json_object"}}}, "text.format"),
    ]
    for body, named in bad:
        status, answer = post(url + "/v1/responses", {**body, "user": "rs-bad"})
        assert status == 400 and set(answer["error"]) == {"message", "type", "param", "code"}, answer
        assert named in answer["error"]["message"] + str(answer["error"]["param"]), (body, answer)
    with pytest.raises(openai.BadRequestError, match="previous_response_not_found|not known"):
        client.responses.create(model="tiny", input=ASK, previous_response_id="resp_gone")
    assert gateway.manager.turn_count("rs-bad") == 1
    verify_session(*finish(url, "rs-bad"))


def test_openai_agents_sdk_runs_an_agent_with_a_tool_through_the_gateway(gateway_url):
    agents = pytest.importorskip("agents")
    url, gateway = gateway_url([CALL, ANSWER])
    agents.set_tracing_disabled(True)

    @agents.function_tool
    def add(a: int, b: int) -> int:
        """Add two numbers."""
        return a + b

    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0,
                                default_headers={"X-Session-Id": "agent-1"},
                                http_client=openai.DefaultAsyncHttpxClient(trust_env=False))
    model = agents.OpenAIResponsesModel(model="tiny", openai_client=client)
    agent = agents.Agent(name="adder", instructions=SYSTEM, tools=[add], model=model)
    result = agents.Runner.run_sync(agent, ASK, max_turns=4)
    assert result.final_output == ANSWER
    outputs = [item.output for item in result.new_items if item.type == "tool_call_output_item"]
    assert outputs == [5]
    samples, turns = finish(url, "agent-1")
    verify_session(samples, turns)
    assert samples[0].metadata["outcomes"] == ["new", "clean"]


def test_openai_agents_sdk_streams_the_same_text(gateway_url):
    agents = pytest.importorskip("agents")
    url, gateway = gateway_url(["Hello there, streaming world!"])
    agents.set_tracing_disabled(True)
    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0,
                                default_headers={"X-Session-Id": "agent-st"},
                                http_client=openai.DefaultAsyncHttpxClient(trust_env=False))
    agent = agents.Agent(name="talker", model=agents.OpenAIResponsesModel(model="tiny", openai_client=client))

    async def run() -> tuple[str, str]:
        from openai.types.responses import ResponseTextDeltaEvent

        streamed = agents.Runner.run_streamed(agent, ASK)
        deltas = [e.data.delta async for e in streamed.stream_events()
                  if e.type == "raw_response_event" and isinstance(e.data, ResponseTextDeltaEvent)]
        return "".join(deltas), streamed.final_output

    import asyncio

    text, final = asyncio.run(run())
    assert text == final == "Hello there, streaming world!"
    verify_session(*finish(url, "agent-st"))


# ---- finish rewards -----------------------------------------------------------------------------------
@pytest.mark.parametrize(("reward", "code"), [
    ("1e39", "reward_out_of_range"), ("-1e308", "reward_out_of_range"), ("NaN", "non_finite_reward"),
    ("1" + "0" * 400, "reward_out_of_range"), ('{"pass": 1e39}', "reward_out_of_range"),
    ('{"pass": -1e400}', "non_finite_reward"), ("Infinity", "non_finite_reward")], ids=lambda r: r[:12])
def test_finish_refuses_rewards_the_trainer_cannot_hold_and_keeps_the_session(gateway_url, reward, code):
    url, gateway = gateway_url([ANSWER])
    openai_client(url).chat.completions.create(model="tiny", messages=QUESTION, user="rw")
    status, body = post(url + "/sessions/rw/finish", raw=f'{{"reward": {reward}}}'.encode())
    assert status == 400, body
    assert body["error"]["param"] == "reward" and body["error"]["code"] == code
    assert "reward" in body["error"]["message"] and "still open" in body["error"]["message"]
    assert gateway.manager.sessions == ["rw"]
    samples, turns = finish(url, "rw", reward=-REWARD_LIMIT)  # the edge itself is accepted
    assert samples[0].reward == -REWARD_LIMIT
    verify_session(samples, turns)


# ---- one recorded session per protocol trains a step ------------------------------------------------
def test_one_recorded_session_per_protocol_trains_a_step(gateway_url, tiny_model_dir):
    import torch

    from agentrl.trainer.actor import MegatronTrainer
    from agentrl.trainer.trainer_config import TrainerConfig

    url, _ = gateway_url([CALL, ANSWER])
    trainer = MegatronTrainer(tiny_model_dir, TrainerConfig(lr=1e-2))
    for protocol in ("chat", "responses", "messages"):
        batch = []
        for session, reward in ((f"{protocol}-good", 1.0), (f"{protocol}-bad", 0.0)):
            if protocol == "messages":
                anthropic_tool_episode(anthropic_client(url), session)
            elif protocol == "responses":
                client = openai_client(url, session)
                first = client.responses.create(model="tiny", input=ASK, tools=[RESPONSES_ADD])
                client.responses.create(model="tiny", previous_response_id=first.id, tools=[RESPONSES_ADD], input=[
                    {"type": "function_call_output", "call_id": first.output[0].call_id, "output": "5"}])
            else:
                client = openai_client(url, session)
                first = client.chat.completions.create(model="tiny", messages=QUESTION, tools=[ADD_TOOL])
                message = first.choices[0].message
                client.chat.completions.create(model="tiny", tools=[ADD_TOOL], messages=[
                    *QUESTION, message, {"role": "tool", "tool_call_id": message.tool_calls[0].id, "content": "5"}])
            samples, turns = finish(url, session, reward=reward)
            verify_session(samples, turns)
            batch += [{**s.to_dict(), "group_id": protocol} for s in samples]
        before = {n: w.clone() for n, w in trainer.export_hf_named_tensors()}
        metrics = trainer.train_step(batch)
        assert metrics["n_samples"] == 2.0 and metrics.get("skipped", 0.0) == 0.0, (protocol, metrics)
        assert any(not torch.equal(w, before[n]) for n, w in trainer.export_hf_named_tensors()), protocol
