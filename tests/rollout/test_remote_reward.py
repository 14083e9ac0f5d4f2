"""A remote reward against a real local HTTP server: scores join the components, transient failures are
retried, and anything else fails the episode (counted, dropped) — never a made-up reward."""

from __future__ import annotations

import asyncio
import threading
import time
from pathlib import Path

import pytest
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse

from agentrl.engine.launch import free_port
from agentrl.envs import generate_rollout
from agentrl.envs.arithmetic import ArithmeticEnv, make_tasks
from agentrl.envs.scripted import ScriptedPolicy
from agentrl.rollout.remote_reward import (
    RemoteReward,
    RemoteRewardError,
    RemoteRewardSettings,
    with_remote_reward,
)

CALLS: dict[str, int] = {}


def _app() -> FastAPI:
    app = FastAPI()

    @app.post("/score")
    async def score(request: Request):
        body = await request.json()
        CALLS["score"] = CALLS.get("score", 0) + 1
        CALLS["last_messages"] = len(body["messages"])
        return {"reward": 0.25 + body["reward_components"].get("env", 0.0)}

    @app.post("/flaky")
    async def flaky():
        CALLS["flaky"] = CALLS.get("flaky", 0) + 1
        return JSONResponse({"reward": 0.5}) if CALLS["flaky"] >= 3 else PlainTextResponse("busy", status_code=503)

    @app.post("/slow")
    async def slow():
        await asyncio.sleep(2)
        return {"reward": 1.0}

    @app.post("/nan")
    async def nan():
        return PlainTextResponse('{"reward": NaN}', media_type="application/json")

    @app.post("/huge")
    async def huge():  # finite as a float64, inf in the trainer's float32
        return PlainTextResponse('{"reward": 1e39}', media_type="application/json")

    @app.post("/refuse")
    async def refuse():
        return PlainTextResponse("bad episode", status_code=422)

    @app.post("/down")
    async def down():
        CALLS["down"] = CALLS.get("down", 0) + 1
        return PlainTextResponse("oops", status_code=500)

    return app


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(Path(__file__).resolve().parents[1] / "assets" / "tiny_tokenizer")


@pytest.fixture(scope="module")
def renderer(tokenizer):
    from agentrl.envs.render import ChatRenderer

    return ChatRenderer(tokenizer)


@pytest.fixture(scope="module")
def server():
    port = free_port()
    srv = uvicorn.Server(uvicorn.Config(_app(), host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=srv.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not srv.started and time.monotonic() < deadline:
        time.sleep(0.05)
    yield f"http://127.0.0.1:{port}"
    srv.should_exit = True
    thread.join(10)


def _score(url: str, **kw) -> float:
    remote = RemoteReward(RemoteRewardSettings(url=url, backoff_s=0.01, **kw))

    async def go() -> float:
        try:
            return await remote.score({"a": 1}, [{"role": "user", "content": "hi"}], {"env": 1.0})
        finally:
            await remote.aclose()

    return asyncio.run(go())


def test_a_score_comes_back_and_transient_failures_are_retried(server) -> None:
    assert _score(server + "/score") == 1.25
    CALLS.pop("flaky", None)
    assert _score(server + "/flaky", retries=2) == 0.5 and CALLS["flaky"] == 3


@pytest.mark.parametrize(("path", "kw", "fragment"), [
    ("/slow", {"timeout_s": 0.3, "retries": 1}, "after 2 attempts"),
    ("/nan", {}, "not a finite number"),
    ("/huge", {}, "reward must be within"),
    ("/refuse", {"retries": 3}, "refused the episode: HTTP 422"),
    ("/down", {"retries": 1}, "HTTP 500"),
    ("/missing", {}, "refused the episode: HTTP 404"),
])
def test_no_usable_reward_is_an_error_never_a_made_up_value(server, path, kw, fragment) -> None:
    with pytest.raises(RemoteRewardError, match=fragment):
        _score(server + path, **kw)


def test_a_down_endpoint_fails_the_episode_counted_and_dropped(server, tokenizer, renderer) -> None:
    tasks = make_tasks(2, seed=3)
    policy = ScriptedPolicy(tokenizer, ['<tool_call>{"name": "submit", "arguments": {"answer": 1}}</tool_call>'])

    def run(path: str):
        remote = RemoteReward(RemoteRewardSettings(url=server + path, retries=0, backoff_s=0.0))
        return asyncio.run(generate_rollout(with_remote_reward(ArithmeticEnv, remote), tasks, policy, renderer,
                                            n_samples_per_task=2))

    scored = run("/score")
    assert len(scored.samples) == 4 and CALLS["last_messages"] >= 2
    assert all(s.metadata["reward_components"] == {"env": 0.0, "remote": 0.25} and s.reward == 0.25
               for s in scored.samples)
    failed = run("/down")
    summary = failed.summary()
    assert failed.samples == [] and summary["failed"] == 4
    assert summary["failure_reasons"] == {"RemoteRewardError": 4}
    assert summary["reward_mean"] == 0.0  # over no scored episode: no reward was made up for the failed ones
