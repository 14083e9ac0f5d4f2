"""External agents train through the gateway: real agent processes (``examples/openai_agent/agent.py``, the
official ``openai`` client, no agentrl) play the arithmetic task against the gateway in training mode, with a
scripted policy behind it (so rewards are known exactly); the samples go through the batch proof. Then the
ways an agent misbehaves (crash, hang, exit, a child left behind, a missing finish call) and what the run
does about each; and ``agentrl train`` end to end through the agents."""

from __future__ import annotations

import asyncio
import json
import os
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
from agentrl.run.external_agents import (  # noqa: E402
    AgentsFailing,
    ExternalAgents,
    ExternalAgentSettings,
)

pytestmark = pytest.mark.timeout(180)

ROOT = Path(__file__).resolve().parents[2]
AGENT = ROOT / "examples" / "openai_agent" / "agent.py"
TOKENIZER_DIR = ROOT / "tests" / "assets" / "tiny_tokenizer"


def call(name: str, **arguments: int) -> str:
    return f'<tool_call>{{"name": "{name}", "arguments": {json.dumps(arguments)}}}</tool_call>'


class Policy:
    """A scripted policy per session: ``add`` then ``submit`` of the sum, off by one in the sessions whose
    index in the group is odd (so each group has rewards 1 and 0)."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.policies: dict[str, ScriptedPolicy] = {}
        self.sampling: list[dict] = []

    async def __call__(self, ids, *, session_id, sampling_params=None):
        self.sampling.append(dict(sampling_params or {}))
        if session_id not in self.policies:
            wrong = int(session_id.rsplit("-", 1)[1]) % 2

            def script(prompt: str, turn: int) -> str:
                a, b = map(int, re.findall(r"What is (\d+)\+(\d+)\?", prompt)[-1])
                return call("add", a=a, b=b) if turn == 0 else call("submit", answer=a + b + wrong)

            self.policies[session_id] = ScriptedPolicy(self.tokenizer, script)
        return await self.policies[session_id](ids, session_id=session_id, sampling_params=sampling_params)


def model_dir(tmp_path: Path) -> Path:
    """The tiny tokenizer plus a config.json (the gateway reads the context length from it)."""
    import shutil

    out = tmp_path / "model"
    if out.exists():
        return out
    shutil.copytree(TOKENIZER_DIR, out)
    (out / "config.json").write_text(json.dumps({"max_position_embeddings": 512}))
    return out


def pool(tmp_path: Path, command: str, **settings) -> ExternalAgents:
    return ExternalAgents(ExternalAgentSettings(command=command, **settings), model_dir(tmp_path),
                          log_dir=tmp_path / "logs", cwd=str(ROOT))


async def play(agents: ExternalAgents, tasks, n: int, *, temperature: float = 0.7):
    """``n`` episodes per task, each played through the agents' per-episode function (as the run's pool
    does); the result's summary carries the agent counts of these episodes (``agents``)."""
    from transformers import AutoTokenizer

    from agentrl.envs.loop import generate_rollout

    tokenizer = AutoTokenizer.from_pretrained(agents.model_dir)
    policy = Policy(tokenizer)
    manager = RecordingTrajectoryManager()
    agents.metrics()  # counts from here on
    result = await generate_rollout(ArithmeticToolEnv, tasks, policy, ChatRenderer(tokenizer), n_samples_per_task=n,
                                    concurrency=64, sampling_params={"temperature": temperature, "max_new_tokens": 40},
                                    trajectory_manager=manager, max_context_tokens=512, episode_fn=agents.episode)
    agents.raise_if_failing()
    counts = {k.removeprefix("rollout/agents/"): v for k, v in agents.metrics().items()}
    result.summary = lambda summary=result.summary: {**summary(), "agents": counts}
    return result, manager, policy


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie is dead
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except OSError:
        return False


def agent_pids(agents: ExternalAgents) -> list[int]:
    return [c.proc.pid for c in agents.copies if c.proc is not None]


@pytest.mark.parametrize("session_id_from,flag", [("base_url", "none"), ("user", "user"), ("header", "header")])
def test_agents_play_groups_that_prove_and_score_by_the_env(tmp_path, session_id_from, flag) -> None:
    marker = f"agentrl-test-{os.getpid()}-{session_id_from}"
    agents = pool(tmp_path, f"{sys.executable} {AGENT} --session-id-in {flag}", copies=3,
                  session_id_from=session_id_from, env={"AGENTRL_TEST_MARK": marker})
    tasks = make_tasks(4, seed=1, multi_turn=True)

    async def main():
        try:
            result, manager, policy = await play(agents, tasks, 4)
            env = agents.copies[0].env
            pids = agent_pids(agents)
            assert sorted(processes_with(marker)) == sorted(pids)  # the scan the end-to-end test relies on
        finally:
            await agents.stop()
        return result, manager, policy, env, pids

    result, manager, policy, env, pids = asyncio.run(main())
    episodes = result.episodes
    assert [e.metrics.error for e in episodes] == [None] * 16
    # The environment replayed the model's calls: the right sum after add scores 1, the off-by-one 0.
    for group in result.groups:
        assert [e.metrics.reward for e in group] == [1.0, 0.0, 1.0, 0.0]
        assert len({e.group_id for e in group}) == 1
    assert all(e.metrics.turns == 2 and e.metrics.tool_calls == 2 for e in episodes)
    groups = [[s for e in g for s in e.samples] for g in result.groups]
    kept, proof, refusals = prove_groups(groups, manager.emitted)
    assert refusals == [] and proof["verify/samples"] == 16 and sum(map(len, kept)) == 16
    assert all(unproven_trained_tokens(s) == 0 and s.trained_tokens > 0 for g in kept for s in g)
    # The run's sampling replaced the agent's (it sent none); every turn of the 16 episodes went through.
    assert len(policy.sampling) == 32 and all(p["temperature"] == 0.7 and p["max_new_tokens"] <= 40
                                              for p in policy.sampling)
    summary = result.summary()
    assert summary["agents"]["episodes"] == 16 and summary["agents"]["starts"] == 3
    assert "AGENTRL_ENGINE_SECRET" not in env and env["OPENAI_API_KEY"] == agents.api_key
    assert env["OPENAI_BASE_URL"] == (f"{agents.url}/agents/0/v1" if session_id_from == "base_url"
                                      else f"{agents.url}/v1")
    assert len(pids) == 3 and not any(alive(p) for p in pids)
    shown = episodes[0].messages  # the transcript the agent sent, plus the last reply
    assert shown[0] == {"role": "system", "content": "Answer with a tool call."} and shown[-1]["tool_calls"]


def test_the_example_agent_sends_the_environment_s_own_prompt_and_tools() -> None:
    """The warm model was trained on the environment's rendering: the agent's prompt must be the same bytes."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("openai_agent", AGENT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    env = ArithmeticToolEnv()
    messages = env.reset({"a": 12, "b": 30, "answer": 42, "multi_turn": True})
    assert json.dumps(module.TOOLS) == json.dumps(ArithmeticToolEnv.tool_schemas())
    assert messages[0] == {"role": "system", "content": module.SYSTEM_PROMPT}
    import ast

    tree = ast.parse(AGENT.read_text())
    imported = {alias.name.split(".")[0] for node in ast.walk(tree) if isinstance(node, ast.Import)
                for alias in node.names}
    imported |= {node.module.split(".")[0] for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) and node.module}
    assert "openai" in imported and not imported - {"openai", "__future__"} - set(sys.stdlib_module_names)


def test_the_gateway_serves_only_open_episodes_and_requires_the_run_s_key(tmp_path) -> None:
    agents = pool(tmp_path, f"{sys.executable} {AGENT}", copies=1)

    async def main():
        await agents.start()
        try:
            keyed = openai.AsyncOpenAI(base_url=f"{agents.url}/v1", api_key=agents.api_key, max_retries=0)
            with pytest.raises(openai.BadRequestError, match="unknown episode"):
                await keyed.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}],
                                                    user="made-up")
            slot = openai.AsyncOpenAI(base_url=f"{agents.url}/agents/0/v1", api_key=agents.api_key, max_retries=0)
            with pytest.raises(openai.BadRequestError, match="no open episode"):
                await slot.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}])
            wrong = openai.AsyncOpenAI(base_url=f"{agents.url}/v1", api_key="guess", max_retries=0)
            with pytest.raises(openai.AuthenticationError):
                await wrong.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}], user="x")
        finally:
            await agents.stop()

    asyncio.run(main())


def test_finish_call_rewards_come_from_the_agent(tmp_path) -> None:
    agents = pool(tmp_path, f"{sys.executable} {AGENT} --reward-self", copies=2, reward_from="finish_call")

    async def main():
        try:
            return await play(agents, make_tasks(2, seed=2, multi_turn=True), 2)
        finally:
            await agents.stop()

    result, manager, _ = asyncio.run(main())
    # The agent judged its own answers: right sum 1, off by one 0 (here it agrees with the env).
    assert [[e.metrics.reward for e in g] for g in result.groups] == [[1.0, 0.0], [1.0, 0.0]]
    assert all(e.samples and e.samples[0].reward == e.metrics.reward for e in result.episodes)


def test_finish_call_mode_fails_episodes_without_one(tmp_path) -> None:
    agents = pool(tmp_path, f"{sys.executable} {AGENT}", copies=2, reward_from="finish_call")

    async def main():
        try:
            return await play(agents, make_tasks(1, seed=3, multi_turn=True), 2)
        finally:
            await agents.stop()

    result, manager, _ = asyncio.run(main())
    assert [e.metrics.error_type for e in result.episodes] == ["NoFinishCall", "NoFinishCall"]
    assert all(not e.samples for e in result.episodes) and not manager.sessions  # dropped, nothing trained


def write_agent(tmp_path: Path, name: str, body: str) -> str:
    path = tmp_path / name
    path.write_text("import json, os, sys, time\n" + body)
    return f"{sys.executable} {path}"


def test_a_crashing_agent_is_counted_and_restarted_and_the_rest_train(tmp_path) -> None:
    # Crashes on its first task (a marker file says it did); every later start is the real agent.
    crash_once = write_agent(tmp_path, "crash_once.py", f"""
try:  # the first process to start (and only it) crashes on its task
    os.close(os.open({str(tmp_path / 'crashed')!r}, os.O_CREAT | os.O_EXCL))
except FileExistsError:
    pass
else:
    sys.stdin.readline(); sys.exit(3)
sys.argv = [{str(AGENT)!r}]
exec(compile(open({str(AGENT)!r}).read(), {str(AGENT)!r}, 'exec'))
""")
    agents = pool(tmp_path, crash_once, copies=2)

    async def main():
        try:
            return await play(agents, make_tasks(2, seed=4, multi_turn=True), 2)
        finally:
            await agents.stop()

    result, manager, _ = asyncio.run(main())
    errors = [e.metrics.error_type for e in result.episodes]
    assert errors.count("AgentCrashed") == 1 and errors.count(None) == 3
    counts = result.summary()["agents"]
    assert counts["crashes"] == 1 and counts["restarts"] == 1 and counts["episodes"] == 3


def test_a_hanging_agent_times_out_and_a_crash_loop_fails_the_step_with_its_log(tmp_path) -> None:
    hang = write_agent(tmp_path, "hang.py", "sys.stdin.readline(); print('thinking', file=sys.stderr, flush=True)\n"
                                            "time.sleep(600)\n")
    agents = pool(tmp_path, hang, copies=2, episode_timeout_s=1.0, max_consecutive_failures=3)

    async def main():
        try:
            with pytest.raises(AgentsFailing, match=r"[34] agent failures in a row") as caught:
                await play(agents, make_tasks(2, seed=5, multi_turn=True), 2)
            return caught.value, agent_pids(agents)
        finally:
            await agents.stop()

    err, pids = asyncio.run(main())
    assert "ran past 1.0 s" in str(err) and "thinking" in str(err)  # the agent's own stderr, from its log
    assert agents.counts["timeouts"] >= 3
    assert not any(alive(p) for p in pids)


def test_a_dropped_session_fails_its_episode_and_turns_past_the_env_limit_are_refused(tmp_path) -> None:
    # Asks the model six times whatever it says (the env allows four replies); with --drop it gives up
    # its session instead (DELETE /sessions/<id>).
    stubborn = write_agent(tmp_path, "stubborn.py", """
import urllib.request
import openai
client = openai.OpenAI(max_retries=0)
for line in sys.stdin:
    task = json.loads(line)
    refused = []
    for _ in range(6):
        try:
            client.chat.completions.create(model='m', messages=[{'role': 'user', 'content': task['prompt']}],
                                           user=task['session_id'])
        except openai.BadRequestError as err:
            refused.append(err.code)
    if '--drop' in sys.argv:
        request = urllib.request.Request(os.environ['OPENAI_BASE_URL'].rsplit('/v1', 1)[0] + '/sessions/'
                                         + task['session_id'], method='DELETE',
                                         headers={'authorization': 'Bearer ' + os.environ['OPENAI_API_KEY']})
        urllib.request.build_opener(urllib.request.ProxyHandler({})).open(request).read()
    print(json.dumps(refused), flush=True)
""")

    async def run(command):
        agents = pool(tmp_path, command, copies=1, session_id_from="user")
        try:
            return await play(agents, make_tasks(1, seed=7, multi_turn=True), 1)
        finally:
            await agents.stop()

    result, manager, policy = asyncio.run(run(stubborn))
    (episode,) = result.episodes
    assert episode.metrics.error is None and episode.metrics.turns == ArithmeticToolEnv.max_turns == 4
    assert str(episode.metrics.stop_reason) == "max_turns" and len(policy.sampling) == 4
    assert episode.samples and all(unproven_trained_tokens(s) == 0 for s in episode.samples)

    result, manager, _ = asyncio.run(run(stubborn + " --drop"))
    (episode,) = result.episodes
    assert episode.metrics.error_type == "EpisodeDropped" and not episode.samples and not manager.sessions


def test_one_shot_agents_and_their_children_leave_no_process(tmp_path) -> None:
    # Each start runs one task and exits 0 (an agent of one task per process), leaving a child behind.
    pid_file = tmp_path / "children"
    one_shot = write_agent(tmp_path, "one_shot.py", f"""
import subprocess
child = subprocess.Popen(['sleep', '600'])
open({str(pid_file)!r}, 'a').write(str(child.pid) + '\\n')
sys.stdin.readline()
sys.exit(0)
""")
    agents = pool(tmp_path, one_shot, copies=2)

    async def main():
        try:
            return await play(agents, make_tasks(2, seed=6, multi_turn=True), 2)
        finally:
            await agents.stop()

    result, _, _ = asyncio.run(main())
    assert [e.metrics.error for e in result.episodes] == [None] * 4
    assert all(e.metrics.turns == 0 and not e.samples for e in result.episodes)  # it never asked the model
    assert result.summary()["agents"]["exits"] == 4
    children = [int(p) for p in pid_file.read_text().split()]
    assert len(children) >= 4 and not any(alive(p) for p in children)


def test_config_checks_the_agent_section_before_anything_starts(tmp_path) -> None:
    from pydantic import ValidationError

    from agentrl.run.config import load_config

    with pytest.raises(ValidationError, match="neither on PATH nor a file"):
        load_config(None, ["--external_agent.command", "no-such-agent-binary --flag"])
    with pytest.raises(ValidationError, match="not valid shell words"):
        load_config(None, ["--external_agent.command", "python 'unclosed"])
    with pytest.raises(ValidationError, match="cannot be combined with rollout.episode_function"):
        load_config(None, ["--external_agent.command", "python agent.py",
                           "--rollout.episode_function", "agentrl.envs.loop:run_episode"])
    with pytest.raises(ValidationError, match="rollout_function became the per-episode episode_function"):
        load_config(None, ["--rollout.rollout_function", "agentrl.envs.loop:generate_rollout"])
    with pytest.raises(ValidationError, match="episodes of schedule 'sync' or 'async'"):
        load_config(None, ["--external_agent.command", "python agent.py", "--schedule", "fully_async"])
    cfg = load_config(ROOT / "examples" / "openai_agent" / "config.yaml")
    assert cfg.external_agent.command.endswith("agent.py") and cfg.external_agent.reward_from == "env"


def processes_with(marker: str) -> list[int]:
    """Pids whose environment holds ``marker`` (the run's agents carry it in theirs)."""
    found = []
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit():
            try:
                if marker.encode() in (proc / "environ").read_bytes() and alive(int(proc.name)):
                    found.append(int(proc.name))
            except OSError:
                continue
    return found


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_agentrl_train_runs_through_the_external_agents_and_leaves_none_behind(tmp_path) -> None:
    import uuid

    from agentrl.run.cli import main

    marker = f"agentrl-test-{uuid.uuid4().hex}"
    out = tmp_path / "run"
    # Toy size, no warm-up: the tiny untrained model scores 0, so every group is kept (keep_all) to train.
    small = ["--output-dir", str(out), "--steps", "2", "--cache_dir", str(tmp_path / "cache"), "--expert", "null",
             "--group_filter", "agentrl.rollout.buffer:keep_all", "--rollout.num_engines", "1",
             "--rollout.prompts_per_step", "2", "--rollout.samples_per_prompt", "4", "--rollout.max_new_tokens", "16",
             "--eval.num_tasks", "4", "--external_agent.copies", "2",
             "--external_agent.env", json.dumps({"AGENTRL_TEST_MARK": marker})]
    os.chdir(ROOT)  # the config's command is relative to the repository
    assert main([str(ROOT / "examples" / "openai_agent" / "config.yaml"), *small]) == 0
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "step" in r]
    assert [r["step"] for r in steps] == [0, 1, 2] and all("eval_accuracy" in r for r in (steps[0], steps[2]))
    for r in steps[1:]:
        assert r["rollout/episodes"] == 8 and r["rollout/agents/episodes"] == 8 and r["rollout/failed"] == 0
        assert r["train/n_samples"] >= 8 and r["rollout/trained_tokens"] > 0
        assert r["rollout/unproven_trained_tokens"] == 0 and r["verify/refused"] == 0 and r["verify/samples"] >= 8
    assert sorted(p.name for p in (out / "logs").glob("agent-*.log")) == ["agent-0.log", "agent-1.log"]
    assert processes_with(marker) == []
