"""A run whose episodes all fail the same way stops after ALL_FAILED_STEPS steps with that error."""

from __future__ import annotations

import pytest

from agentrl.run.failure_watch import ALL_FAILED_STEPS, AllEpisodesFailedError, FailureWatch


def _step(episodes: int, **failures: int) -> dict[str, float]:
    return {"rollout/episodes": float(episodes), "rollout/failed": float(sum(failures.values())),
            **{f"rollout/failure_reasons/{k}": float(v) for k, v in failures.items()}}


def test_all_failed_the_same_way_stops_on_the_bounded_step():
    watch = FailureWatch()
    for step in range(1, ALL_FAILED_STEPS):
        watch.observe(step, _step(8, KeyError=8))
    with pytest.raises(AllEpisodesFailedError, match=rf"steps 1-{ALL_FAILED_STEPS} failed with KeyError \(8 of 8"):
        watch.observe(ALL_FAILED_STEPS, _step(8, KeyError=8))


@pytest.mark.parametrize("interruption", [
    _step(8, KeyError=7),  # one episode succeeded
    _step(8, KeyError=4, TimeoutError=4),  # failing two ways: not one cause
    _step(8, TimeoutError=8),  # a different failure restarts the count
    _step(0),  # a step without episodes says nothing
])
def test_any_other_step_restarts_the_count(interruption):
    watch = FailureWatch()
    steps = [_step(8, KeyError=8)] * (ALL_FAILED_STEPS - 1) + [interruption] + [_step(8, KeyError=8)] * (ALL_FAILED_STEPS - 1)
    for step, metrics in enumerate(steps, 1):
        watch.observe(step, metrics)


def test_the_watch_lives_on_its_session():
    class Session:
        pass

    run = Session()
    assert FailureWatch.of(run) is FailureWatch.of(run)
    with pytest.raises(ValueError, match="patience"):
        FailureWatch(0)
