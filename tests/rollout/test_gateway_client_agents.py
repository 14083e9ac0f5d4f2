"""The client agents of ``examples/client_agents`` (the OpenAI Agents SDK with its default Responses model,
the ``anthropic`` SDK, and LangGraph over ``langchain-openai``) as real external-agent processes against the
gateway in training mode, each through its own protocol under its slot's base URL, with a scripted policy
behind it (so the rewards are known): groups score by the environment's replay, every sample proves with 0
unproven trained tokens, and the model sees exactly the prompt of the in-process environment (the warm
model was trained on it). Also: the slot routes of Responses and Messages refuse a slot without an episode
in their protocol's error shape."""

from __future__ import annotations

import asyncio
import json
import re
import sys
from pathlib import Path

import pytest

openai = pytest.importorskip("openai")

from agentrl.envs.arithmetic import ArithmeticToolEnv, make_tasks  # noqa: E402
from agentrl.envs.render import ChatRenderer  # noqa: E402
from agentrl.envs.scripted import ScriptedPolicy  # noqa: E402
from agentrl.rollout.proof import RecordingTrajectoryManager, prove_groups  # noqa: E402
from agentrl.run.actors import unproven_trained_tokens  # noqa: E402
from agentrl.run.external_agents import ExternalAgents, ExternalAgentSettings  # noqa: E402

pytestmark = pytest.mark.timeout(180)

ROOT = Path(__file__).resolve().parents[2]
AGENTS = ROOT / "examples" / "client_agents"
TOKENIZER_DIR = ROOT / "tests" / "assets" / "tiny_tokenizer"
# agent script -> the packages it needs (the test skips when one is missing)
CLIENTS = {"agents_sdk_agent.py": ("agents",), "anthropic_agent.py": ("anthropic",),
           "langgraph_agent.py": ("langgraph", "langchain_openai")}


def call(name: str, **arguments: int) -> str:
    return f'<tool_call>{{"name": "{name}", "arguments": {json.dumps(arguments)}}}</tool_call>'


class Policy:
    """Per session: ``add`` then ``submit`` of the sum, off by one when the session's index is odd; keeps
    the first prompt of every session."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.policies: dict[str, ScriptedPolicy] = {}
        self.first_prompts: dict[str, list[int]] = {}

    async def __call__(self, ids, *, session_id, sampling_params=None):
        if session_id not in self.policies:
            wrong = int(session_id.rsplit("-", 1)[1]) % 2
            self.first_prompts[session_id] = list(ids)

            def script(prompt: str, turn: int) -> str:
                a, b = map(int, re.findall(r"What is (\d+)\+(\d+)\?", prompt)[-1])
                return call("add", a=a, b=b) if turn == 0 else call("submit", answer=a + b + wrong)

            self.policies[session_id] = ScriptedPolicy(self.tokenizer, script)
        return await self.policies[session_id](ids, session_id=session_id, sampling_params=sampling_params)


def model_dir(tmp_path: Path) -> Path:
    import shutil

    out = tmp_path / "model"
    shutil.copytree(TOKENIZER_DIR, out)
    (out / "config.json").write_text(json.dumps({"max_position_embeddings": 512}))
    return out


async def play(agents: ExternalAgents, tasks, n: int):
    from transformers import AutoTokenizer

    from agentrl.envs.loop import generate_rollout

    tokenizer = AutoTokenizer.from_pretrained(agents.model_dir)
    policy = Policy(tokenizer)
    manager = RecordingTrajectoryManager()
    result = await generate_rollout(ArithmeticToolEnv, tasks, policy, ChatRenderer(tokenizer), n_samples_per_task=n,
                                    concurrency=8, sampling_params={"temperature": 0.7, "max_new_tokens": 40},
                                    trajectory_manager=manager, max_context_tokens=512, episode_fn=agents.episode)
    agents.raise_if_failing()
    return result, manager, policy, tokenizer


@pytest.mark.parametrize("script", list(CLIENTS))
def test_client_agents_train_through_their_protocol_with_proven_samples(tmp_path, script) -> None:
    for package in CLIENTS[script]:
        pytest.importorskip(package)
    agents = ExternalAgents(ExternalAgentSettings(command=f"{sys.executable} {AGENTS / script}", copies=1),
                            model_dir(tmp_path), log_dir=tmp_path / "logs", cwd=str(ROOT))
    tasks = make_tasks(2, seed=4, multi_turn=True)

    async def main():
        try:
            return await play(agents, tasks, 2)
        finally:
            await agents.stop()

    result, manager, policy, tokenizer = asyncio.run(main())
    logs = "".join(p.read_text() for p in (tmp_path / "logs").glob("agent-*.log"))
    assert [e.metrics.error for e in result.episodes] == [None] * 4, logs
    for group in result.groups:  # the env replayed the model's calls: right sum after add 1, off by one 0
        assert [e.metrics.reward for e in group] == [1.0, 0.0], logs
    assert all(e.metrics.turns == 2 and e.metrics.tool_calls == 2 for e in result.episodes)
    groups = [[s for e in g for s in e.samples] for g in result.groups]
    kept, proof, refusals = prove_groups(groups, manager.emitted)
    assert refusals == [] and proof["verify/samples"] == 4 and sum(map(len, kept)) == 4
    assert all(unproven_trained_tokens(s) == 0 and s.trained_tokens > 0 for g in kept for s in g)
    assert all(s.metadata["outcomes"][-1] == "clean" for g in kept for s in g)  # one sample, both replies train
    # The model saw the in-process environment's own prompt, byte for byte.
    renderer = ChatRenderer(tokenizer)
    for session, ids in policy.first_prompts.items():
        task = next(e.task for e in result.episodes if e.session_id == session)
        env = ArithmeticToolEnv()
        assert ids == renderer.render(env.reset(task), env.tool_schemas()).ids, tokenizer.decode(ids)


def test_slot_routes_of_responses_and_messages_need_an_open_episode(tmp_path) -> None:
    anthropic = pytest.importorskip("anthropic")
    agents = ExternalAgents(ExternalAgentSettings(command=f"{sys.executable} {AGENTS / 'anthropic_agent.py'}"),
                            model_dir(tmp_path), log_dir=tmp_path / "logs", cwd=str(ROOT))

    async def main():
        await agents.start()
        try:
            responses = openai.AsyncOpenAI(base_url=f"{agents.url}/agents/0/v1", api_key=agents.api_key,
                                           max_retries=0)
            with pytest.raises(openai.BadRequestError, match="no open episode") as err:
                await responses.responses.create(model="m", input="hi")
            assert err.value.body["code"] == "no_open_episode"
            messages = anthropic.AsyncAnthropic(base_url=f"{agents.url}/agents/0", api_key=agents.api_key,
                                                max_retries=0)
            with pytest.raises(anthropic.BadRequestError, match="no open episode") as err:
                await messages.messages.create(model="m", max_tokens=8, messages=[{"role": "user", "content": "hi"}])
            assert err.value.body["type"] == "error" and err.value.body["error"]["type"] == "invalid_request_error"
            wrong = anthropic.AsyncAnthropic(base_url=f"{agents.url}/agents/0", api_key="guess", max_retries=0)
            with pytest.raises(anthropic.AuthenticationError):
                await wrong.messages.create(model="m", max_tokens=8, messages=[{"role": "user", "content": "hi"}])
            # A malformed body under a slot path: 400 in the route's own protocol, before any episode lookup.
            import httpx

            async with httpx.AsyncClient(trust_env=False, headers={"x-api-key": agents.api_key}) as raw:
                bad = await raw.post(f"{agents.url}/agents/0/v1/messages", json={"model": "m", "max_tokens": "many",
                                                                               "messages": []})
                assert bad.status_code == 400 and bad.json()["type"] == "error", bad.text
                assert "max_tokens" in bad.json()["error"]["message"]
                bad = await raw.post(f"{agents.url}/agents/0/v1/responses", json={"model": "m", "input": 7})
                assert bad.status_code == 400 and set(bad.json()["error"]) == {"message", "type", "param", "code"}
        finally:
            await agents.stop()

    asyncio.run(main())
