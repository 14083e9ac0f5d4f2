"""Fixtures for weight-sync tests: a tiny model, real engine processes (shared by the session), a trainer."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from weights_sync_helpers import Trainer

from agentrl.engine.launch import EngineProcess

N_ENGINES = 2


@pytest.fixture(scope="session", autouse=True)
def one_torch_thread() -> Iterator[None]:
    """Tiny tensors: extra intra-op threads only contend with the engines for the two cores."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    from agentrl.models.tiny import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("tiny") / "model", seed=0)


@pytest.fixture(scope="session")
def engines(tiny_model_dir) -> Iterator[list[EngineProcess]]:
    """Two engine processes on the tiny model, shared by all weight tests (started in parallel).

    Every test begins with a full sync of its own trainer, so no test depends on what another left."""
    # One thread per engine: two engines and the test process share two cores in CI.
    procs = [EngineProcess(tiny_model_dir, env={"OMP_NUM_THREADS": "1"}) for _ in range(N_ENGINES)]
    try:
        for p in procs:
            p.start()
        for p in procs:
            p.wait_healthy(timeout=120)
        yield procs
    finally:
        for p in procs:
            p.stop()


@pytest.fixture(scope="session")
def engine_urls(engines) -> list[str]:
    return [e.url for e in engines]


@pytest.fixture()
def trainer(tiny_model_dir) -> Trainer:
    return Trainer(tiny_model_dir)


