"""``partial_rollout: resume``: at a weight update the pool has the engines retract the turns in flight (their
tokens kept, nothing generated again) instead of draining or aborting them; episodes all come out."""

from __future__ import annotations

import asyncio

from tests.run.test_async_pool import ScriptedEngine, make_pool, renderer, train_steps  # noqa: F401 - fixture


def test_resume_retracts_turns_in_flight_and_regenerates_nothing(renderer) -> None:  # noqa: F811 - the fixture
    engine = ScriptedEngine(renderer.tokenizer, gen_s=0.03)
    modes: list[str] = []
    control = engine.control
    engine.control = lambda mode: (modes.append(mode), control(mode))[1]
    pool = make_pool(renderer, engine, batches=3, partial_rollout="resume", max_staleness=100)

    async def go():
        try:
            return await train_steps(pool, engine, steps=3)
        finally:
            await pool.close()

    batches = asyncio.run(go())
    assert set(modes) == {"retract", ""}
    assert pool.counts["turns_aborted"] == 0
    assert sum(m["rollout/tokens_discarded"] for _, _, m in batches) == 0
    assert sum(m["rollout/tokens_generated"] for _, _, m in batches) > 0
    assert all(len(groups) == 4 for _, groups, _ in batches)
