"""``MCPEnvironment`` through the real agent loop, with the stdio MCP server of ``examples/mcp_arithmetic``:
the server's ``tools/list`` reaches the prompt, calls go through ``tools/call``, each episode has its own
server process, and a dead server fails its episode clearly."""

from __future__ import annotations

import asyncio
import json

import pytest

pytest.importorskip("mcp")

from agentrl.envs.arithmetic import make_tasks  # noqa: E402
from agentrl.envs.loop import run_episode  # noqa: E402
from agentrl.envs.mcp import MCPServerError  # noqa: E402
from agentrl.envs.scripted import ScriptedPolicy  # noqa: E402
from examples.mcp_arithmetic.env import MCPArithmeticEnv  # noqa: E402

pytestmark = pytest.mark.timeout(120)


def call(name: str, **arguments) -> str:
    return f'<tool_call>{json.dumps({"name": name, "arguments": arguments})}</tool_call>'


def test_episodes_use_the_server_s_tools_and_score_by_the_env(tokenizer, renderer):
    tasks = make_tasks(2, seed=3, multi_turn=True)
    results = []
    for i, task in enumerate(tasks):
        wrong = i == 1  # the second episode submits a wrong sum
        replies = [call("add", a=task["a"], b=task["b"]), call("submit", answer=task["answer"] + int(wrong))]
        env = MCPArithmeticEnv()
        result = asyncio.run(run_episode(env, task, ScriptedPolicy(tokenizer, replies), renderer, session_id=f"m{i}"))
        results.append(result)
        assert env.mcp_calls == ["add"] and env._stack is None  # the server's session ended with the episode
        names = [t["function"]["name"] for t in env.tool_schemas()]
        assert names == ["submit", "add"]
        add = env.tool_schemas()[1]["function"]
        assert add["description"] == "Add two numbers." and set(add["parameters"]["properties"]) == {"a", "b"}
    assert [r.metrics.reward for r in results] == [1.0, 0.0]
    (sample,) = results[0].samples
    text = tokenizer.decode(sample.tokens, skip_special_tokens=False)
    assert f"<tool_response>\n{tasks[0]['answer']}\n</tool_response>" in text  # the server's answer
    assert "add(a, b)" in text.split("<|im_start|>user")[0]  # the server's tool is in the system prompt


def test_a_bad_call_is_a_message_for_the_model_not_a_failure(tokenizer, renderer):
    task = make_tasks(1, seed=5, multi_turn=True)[0]
    replies = [call("add", a="x", b=1), call("add", a=task["a"], b=task["b"]), call("submit", answer=task["answer"])]
    result = asyncio.run(run_episode(MCPArithmeticEnv(), task, ScriptedPolicy(tokenizer, replies), renderer,
                                     session_id="bad"))
    assert result.metrics.reward == 1.0
    tool_texts = [m["content"] for m in result.messages if m["role"] == "tool"]
    assert "failed" in tool_texts[0] and tool_texts[1] == str(task["answer"])


def test_a_dead_server_fails_its_episode_clearly(tokenizer, renderer):
    task = make_tasks(1, seed=6, multi_turn=True)[0]
    class Crashing(MCPArithmeticEnv):
        mcp_command = [*MCPArithmeticEnv.mcp_command, "--with-crash"]

    env = Crashing()
    with pytest.raises(MCPServerError, match="crash"):
        asyncio.run(run_episode(env, task, ScriptedPolicy(tokenizer, [call("crash")]), renderer, session_id="dead"))
    assert env._stack is None

    class Missing(MCPArithmeticEnv):
        mcp_command = ["/nonexistent/mcp-server"]

    with pytest.raises(MCPServerError, match="did not start"):
        asyncio.run(run_episode(Missing(), task, ScriptedPolicy(tokenizer, ["x"]), renderer, session_id="none"))


def test_a_streamable_http_server_serves_the_same_tools(tokenizer, renderer):
    import threading
    import time

    import uvicorn

    from agentrl.rollout.router import free_port
    from examples.mcp_arithmetic.server import server as mcp_server

    port = free_port()
    http = uvicorn.Server(uvicorn.Config(mcp_server.streamable_http_app(), host="127.0.0.1", port=port,
                                         log_level="warning"))
    thread = threading.Thread(target=http.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not http.started and time.monotonic() < deadline:
        time.sleep(0.02)

    class OverHTTP(MCPArithmeticEnv):
        mcp_command = None
        mcp_url = f"http://127.0.0.1:{port}/mcp"

    try:
        task = make_tasks(1, seed=7, multi_turn=True)[0]
        replies = [call("add", a=task["a"], b=task["b"]), call("submit", answer=task["answer"])]
        env = OverHTTP()
        result = asyncio.run(run_episode(env, task, ScriptedPolicy(tokenizer, replies), renderer, session_id="h"))
        assert result.metrics.reward == 1.0 and env.mcp_calls == ["add"]
    finally:
        http.should_exit = True
        thread.join(15)


def test_process_lifetime_shares_one_server_and_replaces_a_dead_one(tokenizer, renderer):
    from agentrl.envs.mcp import MCPServerSettings, SharedServer

    class Shared(MCPArithmeticEnv):
        mcp_command = [*MCPArithmeticEnv.mcp_command, "--with-crash"]
        mcp_lifetime = "process"

    tasks = make_tasks(4, seed=8, multi_turn=True)

    def episode(task, name, replies=None):
        replies = replies or [call("add", a=task["a"], b=task["b"]), call("submit", answer=task["answer"])]
        env = Shared()
        return env, run_episode(env, task, ScriptedPolicy(tokenizer, replies), renderer, session_id=name)

    async def main():
        pairs = [episode(t, f"s{i}") for i, t in enumerate(tasks[:3])]
        results = await asyncio.gather(*(run for _, run in pairs))  # concurrent calls on one connection
        envs = [env for env, _ in pairs]
        first = envs[0]._session
        assert all(env._session is first for env in envs) and len(SharedServer._open) == 1
        dead_env, dead = episode(tasks[3], "dead", [call("crash")])
        with pytest.raises(MCPServerError, match="crash"):
            await dead
        after_env, after = episode(tasks[3], "after")
        result = await after  # the next episode starts the server afresh
        assert after_env._session is not first and after_env.mcp_calls == ["add"]
        broken = envs[0]._shared  # its holder task was cancelled when the new connection replaced it
        for _ in range(200):
            if broken.task.done():
                break
            await asyncio.sleep(0.05)
        assert broken.task.done() and not after_env._shared.task.done()
        return [r.metrics.reward for r in results] + [result.metrics.reward]

    assert asyncio.run(main()) == [1.0] * 4
    env = MCPArithmeticEnv()
    MCPServerSettings(command=["python3", "examples/mcp_arithmetic/server.py"], lifetime="process").apply(env)
    assert env.mcp_lifetime == "process" and MCPArithmeticEnv.mcp_lifetime == "episode"
    with pytest.raises(ValueError, match="lifetime"):
        MCPServerSettings(command=["python3", "examples/mcp_arithmetic/server.py"], lifetime="run")
