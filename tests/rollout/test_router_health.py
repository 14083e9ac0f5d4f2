"""A dead engine leaves the router within seconds by smg's own probing. agentrl's EngineWatch (removal, and
restarting when asked) is tested on real engines in test_router_engine.py, on that file's fleet."""

from __future__ import annotations

import pytest
from rollout_helpers import seconds_until

from agentrl.rollout.router import SmgRouter

pytestmark = pytest.mark.timeout(300)


def test_smg_marks_a_dead_worker_unhealthy_within_seconds(stub_engines):
    """Without agentrl's watch: smg's probing (every second, 3 failures) instead of its ~142 s."""
    dead, alive = stub_engines(2)
    with SmgRouter([dead.url, alive.url]) as router:
        dead.kill()
        took = seconds_until(lambda: not any(w.is_healthy for w in router.workers() if w.url == dead.url), 15)
        assert took < 8
        assert [w.url for w in router.workers() if w.is_healthy] == [alive.url]
