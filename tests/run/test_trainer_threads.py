"""How many torch threads a CPU trainer rank gets (:func:`agentrl.run.actors.training_cpu_threads`)."""

from __future__ import annotations

import pytest

from agentrl.run.actors import training_cpu_threads


def test_sync_loop_on_this_machine_shares_its_cores_between_the_ranks() -> None:
    # The engines wait while a sync step trains, so the ranks may use every core.
    assert training_cpu_threads("sync", 1, 0, "local", cpus=2) == 2
    assert training_cpu_threads("sync", 2, 0, "local", cpus=8) == 4
    assert training_cpu_threads("sync", 3, 0, "local", cpus=2) == 1  # never below one


@pytest.mark.parametrize(("loop", "gpus", "cluster"), [
    ("async", 0, "local"),  # the engines generate the next batch while the ranks train
    ("fully_async", 0, "local"),
    ("sync", 1, "local"),  # GPU ranks: the host threads only launch kernels
    ("sync", 0, "connected"),  # a cluster's node count is not this machine's
])
def test_otherwise_ray_decides(loop: str, gpus: int, cluster: str) -> None:
    assert training_cpu_threads(loop, 1, gpus, cluster, cpus=2) is None


def test_default_is_the_cores_this_process_may_use() -> None:
    import os

    assert training_cpu_threads("sync", 1, 0, "local") == len(os.sched_getaffinity(0))
