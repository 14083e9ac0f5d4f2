"""SmgRouter + RolloutClient against the real smg binary and fast stub engines (benchmarks/stub_engine.py).

The stubs run no model; they count requests per routing key, so affinity, fail-over, run-time
registration and RL fan-out can be checked quickly. The same behaviours against real embedded engines
are in test_router_engine.py.
"""

from __future__ import annotations

import asyncio
import os
import socket
import time

import pytest
from rollout_helpers import http_json

from agentrl.rollout.client import GenerateRequestError, RolloutClient
from agentrl.rollout.router import FanoutError, RouterError, SmgRouter

pytestmark = pytest.mark.timeout(120)


def _sessions_per_engine(stubs, prefix: str) -> list[set[str]]:
    return [{k for k in s.stats()["per_key"] if k.startswith(prefix)} for s in stubs]


async def _episodes(url: str, prefix: str, n_sessions: int, n_turns: int, **client_kw):
    """n_sessions concurrent episodes; each turn's prompt extends the previous prompt + output."""
    async with RolloutClient(url, **client_kw) as client:

        async def episode(i: int):
            prompt = [1, 10 + i % 50, 3]
            turns = []
            for _ in range(n_turns):
                res = await client.generate(prompt, {"max_new_tokens": 2}, session_id=f"{prefix}-{i}")
                turns.append(res)
                prompt = [*prompt, *res.turn.output_ids, 7, 8]
            return turns

        return await asyncio.gather(*(episode(i) for i in range(n_sessions))), client.retries


def test_router_starts_lists_workers_and_stops(stub_engines):
    stubs = stub_engines(2)
    router = SmgRouter([s.url for s in stubs])
    cmd = router.command()
    assert cmd[cmd.index("--policy") + 1] == "manual"
    assert cmd[cmd.index("--assignment-mode") + 1] == "min_group"
    assert "--enable-rl" in cmd
    with router:
        assert router.alive
        workers = router.workers()
        assert sorted(w.url for w in workers) == sorted(s.url for s in stubs)
        assert all(w.status == "ready" and w.is_healthy for w in workers)
        pid = router.pid
    assert not router.alive
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)
    # The port is free again: a new listener can bind it (TIME_WAIT connections allowed).
    with socket.socket() as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("127.0.0.1", router.port))


def test_sessions_stay_on_one_engine_and_cached_tokens_grow(stub_engines):
    stubs = stub_engines(3)
    with SmgRouter([s.url for s in stubs]) as router:
        episodes, _ = asyncio.run(_episodes(router.url, "aff", n_sessions=50, n_turns=4))
    per_engine = _sessions_per_engine(stubs, "aff-")
    # Every session is on exactly one engine, all 50 are accounted for, and min_group spreads them.
    assert sum(len(s) for s in per_engine) == 50
    assert set.union(*per_engine) == {f"aff-{i}" for i in range(50)}
    assert all(len(s) >= 5 for s in per_engine), [len(s) for s in per_engine]
    for s in stubs:
        assert all(v == 4 for k, v in s.stats()["per_key"].items() if k.startswith("aff-"))
    for turns in episodes:
        cached = [t.cached_tokens for t in turns]
        assert cached[0] <= 2 and all(b > a for a, b in zip(cached, cached[1:], strict=False)), cached
        assert all(len(t.turn.output_logprobs) == len(t.turn.output_ids) == 2 for t in turns)


def test_engine_added_at_run_time_receives_new_sessions_and_removed_one_none(stub_engines):
    first, second, late = stub_engines(3)
    with SmgRouter([first.url, second.url]) as router:
        asyncio.run(_episodes(router.url, "before", 20, 1))
        worker_id = router.add_worker(late.url + "/")  # trailing slash is normalised
        assert worker_id and router.worker_id(late.url) == worker_id
        asyncio.run(_episodes(router.url, "after", 30, 2))
        assert len(_sessions_per_engine([late], "after-")[0]) >= 5
        assert not _sessions_per_engine([late], "before-")[0]

        router.remove_worker(late.url)
        assert late.url not in [w.url for w in router.workers()]
        served = late.stats()["requests"]
        episodes, _ = asyncio.run(_episodes(router.url, "gone", 20, 2))
        assert len(episodes) == 20 and late.stats()["requests"] == served


def test_killed_engine_mid_run_loses_no_episode(stub_engines):
    stubs = stub_engines(3)
    victim_sessions: set[str] = set()
    with SmgRouter([s.url for s in stubs]) as router:

        async def run():
            task = asyncio.create_task(_episodes(router.url, "kill", 40, 6, backoff=0.02, max_backoff=0.2))
            while not victim_sessions:  # kill once the victim has started serving sessions
                await asyncio.sleep(0.02)
                victim_sessions.update(k for k in stubs[0].stats()["per_key"] if k.startswith("kill-"))
            stubs[0].kill()
            return await task

        episodes, _ = asyncio.run(run())
    assert len(episodes) == 40 and all(len(t) == 6 for t in episodes)
    survivors = _sessions_per_engine(stubs[1:], "kill-")
    # The victim's sessions continued on a live engine; every session has its last turns somewhere alive.
    assert victim_sessions <= set.union(*survivors)
    assert set.union(*survivors) == {f"kill-{i}" for i in range(40)}


def test_rl_fanout_pause_update_continue_reaches_every_engine(stub_engines, tmp_path):
    stubs = stub_engines(2)
    with SmgRouter([s.url for s in stubs]) as router:
        answer = router.pause()
        assert answer["succeeded"] == 2 and all(s.stats()["paused"] for s in stubs)

        async def during_pause():
            async with RolloutClient(router.url) as client:
                task = asyncio.create_task(client.generate([1, 2], {"max_new_tokens": 1}, session_id="p"))
                await asyncio.sleep(0.3)
                assert not task.done()  # held by the paused engine
                await asyncio.to_thread(router.update_weights_from_disk, str(tmp_path), "step-7")
                await asyncio.to_thread(router.continue_)
                return await asyncio.wait_for(task, 10)

        result = asyncio.run(during_pause())
        assert result.turn.weight_version == "step-7"
        assert [s.stats()["weight_version"] for s in stubs] == ["step-7", "step-7"]
        assert not any(s.stats()["paused"] for s in stubs)

        router.update_weight_version("step-8")
        assert [s.stats()["weight_version"] for s in stubs] == ["step-8", "step-8"]


def test_fanout_failure_is_reported_not_swallowed(stub_engines, tmp_path):
    stubs = stub_engines(2)
    with SmgRouter([s.url for s in stubs]) as router:
        # The engine rejects a bodyless weight update (no model_path): a per-worker 400.
        with pytest.raises(FanoutError, match="failed on 2 worker"):
            router.fanout("update_weights_from_disk", {})
        partial = router.fanout("update_weights_from_disk", {}, allow_partial=True)
        assert len(partial["failed"]) == 2
        with pytest.raises(RouterError, match="invalid_selector|HTTP 4"):
            router.fanout("pause_generation", selector="not a selector")
        assert [s.stats()["weight_version"] for s in stubs] == ["default", "default"]


def test_bad_worker_and_bad_requests_get_clear_errors(stub_engines):
    (stub,) = stub_engines(1)
    with SmgRouter([stub.url]) as router:
        t0 = time.monotonic()
        with pytest.raises(RouterError, match="not ready"):
            router.add_worker("http://127.0.0.1:9", timeout=1.5)
        assert time.monotonic() - t0 < 10
        time.sleep(0.3)
        assert [w.url for w in router.workers()] == [stub.url]  # no pending registration left behind
        with pytest.raises(RouterError, match="no worker with url"):
            router.remove_worker("http://127.0.0.1:9")

        async def bad():
            async with RolloutClient(router.url) as client:
                with pytest.raises(GenerateRequestError) as err:
                    await client.generate([1, 2], {"max_new_tokens": 0}, session_id="bad")
                assert err.value.status == 400 and "max_new_tokens" in err.value.message
                assert client.retries == 0
                ok = await client.generate([1, 2], {"max_new_tokens": 1}, session_id="bad")
                assert ok.turn.output_ids == (3,)

        asyncio.run(bad())
    with pytest.raises(RouterError, match="enable_rl"):
        SmgRouter([], enable_rl=False).fanout("pause_generation")


def test_router_that_cannot_start_reports_its_log():
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        router = SmgRouter([], port=busy.getsockname()[1])
        with pytest.raises(RouterError) as err:
            router.start(timeout=20)
    assert not router.alive
    assert "smg" in str(err.value)


def test_client_abort_reaches_engine_through_router(stub_engines):
    """smg has no /abort_request route: the client falls back to the RL fan-out."""
    stubs = stub_engines(2)
    with SmgRouter([s.url for s in stubs]) as router:
        router.pause()

        async def cancel_one():
            async with RolloutClient(router.url) as client:
                task = asyncio.create_task(
                    client.generate([5, 6], {"max_new_tokens": 1}, session_id="c", rid="rid-to-abort"))
                await asyncio.sleep(0.3)
                task.cancel()
                with pytest.raises(asyncio.CancelledError):
                    await task

        asyncio.run(cancel_one())
        router.continue_()
        assert all("rid-to-abort" in s.stats()["aborted_rids"] for s in stubs)
        assert http_json(stubs[0].url + "/stub_stats")["paused"] is False


def test_fanout_drops_an_unreachable_engine_instead_of_failing(stub_engines, tmp_path):
    dead, alive = stub_engines(2)
    with SmgRouter([dead.url, alive.url]) as router:
        dead.kill()
        answer = router.update_weights_from_disk(str(tmp_path), "v2")
        assert answer["succeeded"] == 1 and answer["dropped"] == [dead.url] and answer["failed"] == []
        assert alive.stats()["weight_version"] == "v2"
        # It missed the update, so it is deregistered: draining at once, gone after smg's drain settle.
        assert all(w.status != "ready" for w in router.workers() if w.url == dead.url)
        deadline = time.monotonic() + 20
        while router.worker_id(dead.url) is not None and time.monotonic() < deadline:
            time.sleep(0.2)
        assert [w.url for w in router.workers()] == [alive.url]
        assert router.pause()["dropped"] == []
        router.continue_()
        with pytest.raises(FanoutError):
            router.fanout("update_weights_from_disk", {}, drop_unreachable=False)
