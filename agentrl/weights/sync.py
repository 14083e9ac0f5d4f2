"""The common interface of every weight-sync mode, and a factory by mode name.

A sender takes HF-named tensors (``Iterable[tuple[str, torch.Tensor]]``, e.g. from
``MegatronTrainer.export_hf_named_tensors()`` or ``model.named_parameters()``) and a new
``weight_version``; when :meth:`WeightSync.sync` returns, every engine holds those bits and reports that
version in ``/server_info`` (checked), so each sampled token's ``weight_version`` names the weights that
produced it.

Modes (one module each): ``disk`` (:mod:`agentrl.weights.disk_sync`), ``tensor``
(:mod:`agentrl.weights.tensor_sync`), ``broadcast`` (:mod:`agentrl.weights.broadcast_sync`), ``delta``
(:mod:`agentrl.weights.delta_sync`).
"""

from __future__ import annotations

import importlib
import time
from abc import ABC, abstractmethod
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

from agentrl.weights.engines import EngineCallError, EngineClient

if TYPE_CHECKING:
    import torch

MODES = {
    "disk": "agentrl.weights.disk_sync:DiskSync",
    "tensor": "agentrl.weights.tensor_sync:TensorSync",
    "broadcast": "agentrl.weights.broadcast_sync:BroadcastSync",
    "delta": "agentrl.weights.delta_sync:DeltaSync",
}


@dataclass
class SyncReport:
    """What one sync cost. ``bytes_sent``: payload bytes each engine received (file, shared memory,
    HTTP body or collective); ``full_bytes``: the raw size of all tensors; ``seconds``: wall time
    including the engines' acknowledgement."""

    mode: str
    weight_version: str
    bytes_sent: int
    full_bytes: int
    seconds: float
    engines: list[str] = field(default_factory=list)
    fallback: str | None = None  # why a delta sync sent full weights instead, if it did
    details: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


class WeightSyncError(RuntimeError):
    """A sync did not complete; engines may hold their old weights (each engine update is atomic)."""


class WeightSync(ABC):
    """Base of every mode: owns the engine client; subclasses implement :meth:`_push`.

    ``router_url``: an smg router (``--enable-rl``) in front of the engines; update calls that are the
    same for every engine then go through its RL fan-out (:mod:`agentrl.weights.engines`).
    """

    mode: str = ""

    def __init__(self, engine_urls: Sequence[str], *, timeout: float = 600.0, router_url: str | None = None) -> None:
        self.engines = EngineClient(engine_urls, timeout=timeout, router_url=router_url)

    @property
    def engine_urls(self) -> list[str]:
        return list(self.engines.urls)

    def sync(self, named_tensors: Iterable[tuple[str, torch.Tensor]], weight_version: str) -> SyncReport:
        """Push ``named_tensors`` to every engine as ``weight_version``; checks the engines' versions."""
        weight_version = str(weight_version)
        tensors = list(named_tensors)
        start = time.perf_counter()
        report = self._push(tensors, weight_version)
        self.check_versions(weight_version)
        report.seconds = time.perf_counter() - start
        report.engines = self.engine_urls
        return report

    @abstractmethod
    def _push(self, tensors: list[tuple[str, torch.Tensor]], weight_version: str) -> SyncReport:
        """Send the tensors and set the version on every engine; ``seconds`` is filled in by :meth:`sync`."""

    def check_versions(self, weight_version: str, urls: Sequence[str] | None = None) -> None:
        try:
            versions = self.engines.weight_versions(urls)
        except EngineCallError as exc:
            raise WeightSyncError(f"could not read engine weight versions: {exc}") from exc
        wrong = {u: v for u, v in versions.items() if v != weight_version}
        if wrong:
            raise WeightSyncError(f"engines report other weight versions than {weight_version!r}: {wrong}")

    def close(self) -> None:
        self.engines.close()

    def __enter__(self) -> WeightSync:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def full_bytes(tensors: Iterable[tuple[str, torch.Tensor]]) -> int:
    return sum(t.numel() * t.element_size() for _, t in tensors)


def make_sync(mode: str, engine_urls: Sequence[str], **options: Any) -> WeightSync:
    """Build the sender for ``mode`` (``disk``, ``tensor``, ``broadcast``, ``delta``) or a dotted
    ``module:Class`` path of a custom :class:`WeightSync` subclass."""
    target = MODES.get(mode, mode)
    if ":" not in target:
        raise ValueError(f"unknown weight-sync mode {mode!r}; choose from {sorted(MODES)} or give module:Class")
    module_name, cls_name = target.split(":")
    cls = getattr(importlib.import_module(module_name), cls_name)
    return cls(engine_urls, **options)
