"""Helpers for weight-sync tests: a trainer stand-in and engine checks (imported by tests and conftest).

The trainer stand-in is the HF model itself with a plain torch AdamW step (what matters to the sync path
is that every parameter's bits change the way an optimizer changes them, not who computed the step).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import torch

from agentrl.engine.auth import auth_headers, run_secret
from agentrl.engine.weight_loading import weights_checksum
from agentrl.weights.delta_sync import DeltaSync
from agentrl.weights.engines import CallResult


class Trainer:
    """HF model + AdamW: ``step()`` changes (nearly) every parameter's bits, like a real update."""

    def __init__(self, model_dir: Path, *, lr: float = 1e-3, seed: int = 0) -> None:
        from transformers import AutoModelForCausalLM

        torch.manual_seed(seed)
        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=lr)
        self.gen = torch.Generator().manual_seed(seed)

    def step(self) -> None:
        ids = torch.randint(3, self.model.config.vocab_size, (2, 24), generator=self.gen)
        loss = self.model(input_ids=ids, labels=ids).loss
        loss.backward()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)

    def named_tensors(self) -> list[tuple[str, torch.Tensor]]:
        return [(n, p.detach()) for n, p in self.model.named_parameters()]

    def checksum(self) -> str:
        return weights_checksum(self.named_tensors())["total"]

    def logprobs(self, prompt: list[int], output: list[int]) -> list[float]:
        with torch.no_grad():
            logits = self.model(input_ids=torch.tensor([prompt + output])).logits[0]
        lp = torch.log_softmax(logits.float(), dim=-1)
        return [lp[len(prompt) - 1 + i, t].item() for i, t in enumerate(output)]


def engine_checksum(url: str) -> dict:
    response = httpx.get(url + "/weights_checksum", timeout=60)
    response.raise_for_status()
    return response.json()


def control_post(url: str, body: dict) -> httpx.Response:
    """POST to an engine's control route with the run's secret, as agentrl's own processes do."""
    return httpx.post(url, json=body, timeout=30, headers=auth_headers(run_secret()))


def assert_engines_equal(urls: list[str], trainer: Trainer, version: str) -> None:
    expected = trainer.checksum()
    for url in urls:
        got = engine_checksum(url)
        assert got["weight_version"] == version, f"{url} reports {got['weight_version']!r}"
        assert got["total"] == expected, f"{url} holds other bits than the trainer after {version}"


def generate(url: str, prompt: list[int], n: int = 8) -> dict:
    body = {
        "input_ids": prompt,
        "sampling_params": {"max_new_tokens": n, "temperature": 0.0},
        "return_logprob": True,
    }
    response = httpx.post(url + "/generate", json=body, timeout=60)
    response.raise_for_status()
    return response.json()


def corrupt(payload: bytes) -> bytes:
    bad = bytearray(payload)
    bad[len(bad) // 2] ^= 0x40
    return bytes(bad)


class CorruptingDeltaSync(DeltaSync):
    """Flips one byte of every delta payload on its way to the engines (over any transport)."""

    def deliver(self, payload: bytes, body: dict[str, Any]) -> tuple[list[CallResult], int]:
        return super().deliver(corrupt(payload), body)
