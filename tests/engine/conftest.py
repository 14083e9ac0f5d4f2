"""Fixtures: a tiny model on disk and a real engine server (uvicorn in a thread) on a free port."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import httpx
import pytest

from agentrl.engine.auth import auth_headers, run_secret
from agentrl.engine.launch import free_port


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> Path:
    from agentrl.models.tiny import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("tiny") / "model", seed=0)


@pytest.fixture(scope="session")
def tiny_model_b(tmp_path_factory) -> Path:
    """Same architecture, other weights (seed 1): the target of weight updates."""
    from agentrl.models.tiny import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("tiny_b") / "model", seed=1)


class ServerThread:
    """An Engine + FastAPI app served by uvicorn in a background thread of the test process."""

    def __init__(self, model_dir: Path, **config) -> None:
        import uvicorn

        from agentrl.engine.engine import Engine, EngineConfig
        from agentrl.engine.server import create_app

        self.port = free_port()
        self.secret = run_secret()  # the test process's, as EngineProcess uses
        self.engine = Engine(EngineConfig(model_path=str(model_dir), port=self.port, **config))
        app = create_app(self.engine, secret=self.secret)
        self.server = uvicorn.Server(
            uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning", access_log=False)
        )
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.url = f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> ServerThread:
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("engine server did not start")
            time.sleep(0.02)
        return self

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=15)


@pytest.fixture(scope="module")
def server(tiny_model):
    with ServerThread(tiny_model) as s:
        yield s


@pytest.fixture()
def client(server):
    """An HTTP client of ``server`` that presents the run's secret (the engine's own processes do)."""
    with httpx.Client(base_url=server.url, timeout=60, headers=auth_headers(server.secret)) as c:
        yield c


@pytest.fixture()
def anonymous(server):
    """An HTTP client of ``server`` without the secret: any local process."""
    with httpx.Client(base_url=server.url, timeout=60) as c:
        yield c


@pytest.fixture(scope="session")
def hf_model(tiny_model):
    """The same checkpoint loaded by plain transformers: the log-prob reference."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
    return model.eval()


@pytest.fixture(scope="session")
def hf_logprobs():
    """``f(model, prompt, output, temperature=1)``: log_softmax(logits / temperature) of each output token,
    one plain forward."""
    import torch

    def compute(model, prompt: list[int], output: list[int], temperature: float = 1.0) -> list[float]:
        ids = torch.tensor([prompt + output])
        with torch.no_grad():
            logits = model(input_ids=ids).logits[0].float()
        logprobs = torch.log_softmax(logits / temperature, dim=-1)
        positions = range(len(prompt) - 1, len(prompt) + len(output) - 1)
        return [logprobs[p, t].item() for p, t in zip(positions, output, strict=True)]

    return compute


@pytest.fixture(scope="session")
def server_thread() -> type[ServerThread]:
    """The class itself, for tests that start servers with their own options (``import conftest`` would
    bind whichever test folder's conftest the suite imported first)."""
    return ServerThread
