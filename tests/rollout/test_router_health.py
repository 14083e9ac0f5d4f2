"""Dead engines leave the router within seconds (smg's own probing and agentrl's EngineWatch), and come
back when restarting is asked for."""

from __future__ import annotations

import asyncio
import time

import pytest

from agentrl.rollout.client import RolloutClient
from agentrl.rollout.router import EngineWatch, SmgRouter

pytestmark = pytest.mark.timeout(300)


def _seconds_until(predicate, timeout: float) -> float:
    start = time.monotonic()
    while not predicate():
        assert time.monotonic() - start < timeout, f"not within {timeout} s"
        time.sleep(0.1)
    return time.monotonic() - start


def test_smg_marks_a_dead_worker_unhealthy_within_seconds(stub_engines):
    """Without agentrl's watch: smg's probing (every second, 3 failures) instead of its ~142 s."""
    dead, alive = stub_engines(2)
    with SmgRouter([dead.url, alive.url]) as router:
        dead.kill()
        took = _seconds_until(lambda: not any(w.is_healthy for w in router.workers() if w.url == dead.url), 15)
        assert took < 8
        assert [w.url for w in router.workers() if w.is_healthy] == [alive.url]


async def _generate_all(url: str, n: int) -> list:
    async with RolloutClient(url) as client:
        return await asyncio.gather(*(client.generate([1, 5, 6], {"max_new_tokens": 1}, session_id=f"h-{i}")
                                      for i in range(n)))


@pytest.mark.slow
def test_watch_removes_a_killed_engine_and_restarts_it(tiny_model_dir):
    from agentrl.engine.launch import EngineProcess

    engines = [EngineProcess(tiny_model_dir, threads=1).start() for _ in range(2)]
    events: list[tuple[str, str]] = []
    try:
        for e in engines:
            e.wait_healthy(180)
        with SmgRouter([e.url for e in engines]) as router:
            victim, survivor = engines
            watch = EngineWatch(router, engines, on_event=lambda url, what: events.append((url, what))).start()
            try:
                victim.kill()  # SIGKILL: no goodbye
                took = _seconds_until(lambda: router.worker_id(victim.url) is None
                                      or all(w.status != "ready" for w in router.workers() if w.url == victim.url), 10)
                assert took < 4 and (victim.url, "removed") in events
                assert all(len(r.turn.output_ids) == 1 for r in asyncio.run(_generate_all(router.url, 8)))
            finally:
                watch.stop()
            # with restart: the same engine comes back on its port and serves again
            watch = EngineWatch(router, engines, restart=True, startup_timeout=180,
                                on_event=lambda url, what: events.append((url, what)))
            watch.removed.add(victim.url)
            watch.start()
            try:
                _seconds_until(lambda: (victim.url, "restarted") in events, 200)
                ready = {w.url for w in router.workers() if w.status == "ready" and w.is_healthy}
                assert ready == {victim.url, survivor.url} and victim.alive
            finally:
                watch.stop()
    finally:
        for e in engines:
            e.stop()
