"""The gateway in front of the real stack: an embedded engine on the tiny model behind the smg router,
driven by the official ``openai`` client; and ``agentrl gateway`` as a command.

The tiny model is random-init, so its replies are arbitrary text: tool-call *parsing* is covered by
``test_gateway.py`` (scripted policy); here the history carries OpenAI ``tool_calls`` written by the agent
(a few-shot example), which must render through the template as prompt tokens and never train.
"""

from __future__ import annotations

import subprocess
import sys

import pytest
from rollout_helpers import REPO, wait_http_ok
from test_gateway import ADD_TOOL, ServerThread, finish, openai, post

from agentrl.rollout.gateway import build_gateway, create_app
from agentrl.rollout.router import SmgRouter, free_port
from agentrl.trajectory import MODEL, verify_session

pytestmark = [pytest.mark.timeout(300), pytest.mark.slow]

FEW_SHOT = [
    {"role": "system", "content": "You can add numbers."},
    {"role": "user", "content": "What is 1+1?"},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_0", "type": "function", "function": {"name": "add", "arguments": '{"a": 1, "b": 1}'}}]},
    {"role": "tool", "tool_call_id": "call_0", "content": "2"},
    {"role": "assistant", "content": "1+1 is 2."},
    {"role": "user", "content": "What is 2+3?"},
]


@pytest.fixture(scope="module")
def stack(tiny_model_dir):
    from agentrl.engine.launch import EngineProcess

    engine = EngineProcess(tiny_model_dir).start()
    router = None
    try:
        engine.wait_healthy(180)
        router = SmgRouter([engine.url]).start()
        gateway, client = build_gateway(router.url, tiny_model_dir, policy="realign")
        with ServerThread(create_app(gateway, on_shutdown=client.aclose)) as server:
            yield router, gateway, server
    finally:
        if router is not None:
            router.stop()
        engine.stop()


def _client(url: str):
    return openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0,
                         http_client=openai.DefaultHttpxClient(trust_env=False))


def test_agent_turns_through_engine_and_router_yield_verified_samples(stack):
    _, gateway, server = stack
    client = _client(server.url)
    messages = list(FEW_SHOT)
    params = dict(model="tiny", tools=[ADD_TOOL], max_tokens=12, temperature=1.0, user="ep-engine")

    first = client.chat.completions.create(messages=messages, logprobs=True, **params)
    reply = first.choices[0]
    assert reply.finish_reason in ("stop", "length", "tool_calls")
    turn0 = gateway.manager.turns("ep-engine")[0]
    assert first.usage.prompt_tokens == len(turn0.prompt_ids) and first.usage.completion_tokens == len(turn0.output_ids)
    assert [e.logprob for e in reply.logprobs.content] == list(turn0.output_logprobs)  # served = recorded
    messages += [reply.message, {"role": "user", "content": "And 3+4?"}]

    second = client.chat.completions.create(messages=messages, **params)
    messages += [second.choices[0].message, {"role": "user", "content": "Thanks."}]

    streamed = client.chat.completions.create(messages=messages, stream=True, **params)
    text = "".join(c.choices[0].delta.content or "" for c in streamed if c.choices)
    turn2 = gateway.manager.turns("ep-engine")[2]
    if not reply.message.tool_calls:
        assert text == gateway.renderer.decode_response(list(turn2.output_ids))

    # A rewritten history: the agent drops its second exchange and asks something else.
    rewritten = [*messages[:len(FEW_SHOT) + 1], {"role": "user", "content": "Start over: 5+5?"}]
    client.chat.completions.create(messages=rewritten, **params)

    samples, turns = finish(server.url, "ep-engine", reward=0.5)
    verify_session(samples, turns)  # every trained token is a served output token with its sampled log-prob
    assert len(turns) == 4 and sum(len(s.metadata["turns"]) for s in samples) == 4
    assert all(s.reward == 0.5 and s.session_id == "ep-engine" for s in samples)
    first_sample = samples[0]
    # The few-shot tool call, the tool result and every message the agent wrote are prompt, never trained.
    prefix = first_sample.response_start
    assert prefix == len(turns[0].prompt_ids) and all(p.source != MODEL for p in first_sample.provenance[:prefix])
    for sample in samples:
        rs = sample.response_start
        for prov, mask in zip(sample.provenance[rs:], sample.loss_mask, strict=True):
            assert mask == 0 or prov.source == MODEL
    trained = {t for s in samples for t in s.metadata["trained_turns"]}
    assert trained, "no turn was trained"
    stats = gateway.manager.stats
    assert stats["new"] == 1 and stats["branched"] + stats["forked"] + stats["realigned"] >= 1


def test_sessions_are_independent_and_finish_consumes(stack):
    _, gateway, server = stack
    client = _client(server.url)
    with pytest.raises(openai.BadRequestError, match="engine rejected the request"):  # the engine's 400, relayed
        client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "x"}], stop=[""],
                                       user="refused")
    assert "refused" not in gateway.manager.sessions
    for session in ("a", "b"):
        client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": session}],
                                       max_tokens=4, user=session)
    def content(seed, i):
        return client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "seed"}],
                                              max_tokens=12, temperature=1.0, seed=seed,
                                              user=f"seed-{seed}-{i}").choices[0].message.content

    assert content(5, 0) == content(5, 1)  # the seed reaches the engine through smg
    assert content(None, 0) != content(None, 1)  # (a near-uniform random model: unseeded replies differ)
    for seed in (5, None):
        for i in range(2):
            gateway.finish_session(f"seed-{seed}-{i}", 0.0)
    samples_a, turns_a = finish(server.url, "a")
    verify_session(samples_a, turns_a)
    assert gateway.manager.sessions == ["b"]
    status, body = post(f"{server.url}/sessions/a/finish", {"reward": 1.0})
    assert status == 404 and "unknown session 'a'" in body["error"]["message"]
    samples_b, turns_b = finish(server.url, "b")
    verify_session(samples_b, turns_b)


def test_agentrl_gateway_command_serves_the_acceptance_interface(stack, tiny_model_dir):
    router, _, _ = stack
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "agentrl.cli", "gateway", "--router", router.url, "--model", str(tiny_model_dir),
         "--port", str(port), "--policy", "fork"],
        cwd=REPO, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
        start_new_session=True)
    try:
        url = f"http://127.0.0.1:{port}"
        wait_http_ok(url + "/health", timeout=120, proc=proc)
        client = _client(url)
        assert [m.id for m in client.models.list().data] == [tiny_model_dir.name]
        reply = client.chat.completions.create(model=tiny_model_dir.name, messages=[{"role": "user", "content": "hi"}],
                                               max_tokens=5, user="cli-session")
        assert reply.usage.completion_tokens >= 1
        samples, turns = finish(url, "cli-session", reward=1.0)
        verify_session(samples, turns)
        assert samples[0].reward == 1.0 and samples[0].metadata["turns"] == [0]
    finally:
        proc.terminate()
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)
