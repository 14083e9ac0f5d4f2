"""How a sync's bytes travel to the engines: the :class:`Transport` interface and the built-in names.

A transport carries one or more payload kinds (:attr:`Transport.carries`): ``"full"`` (named tensors, the
whole model) and ``"delta"`` (one opaque :mod:`agentrl.engine.delta` payload). The payload -- *what* is
sent -- is the :class:`~agentrl.weights.sync.WeightSync` subclass; it hands its tensors or bytes to
``sync.via``, the transport. Built-in transports (one module each):

* ``disk`` (:mod:`agentrl.weights.disk_sync`): files on tmpfs or any shared directory; full and delta.
* ``tensor`` (:mod:`agentrl.weights.tensor_sync`): ``/update_weights_from_tensor`` with shared-memory or
  CUDA IPC handles, or safetensors bytes in the body; full only.
* ``broadcast`` (:mod:`agentrl.weights.broadcast_sync`): a process group with every engine; full and delta.

A transport of your own is one module with a :class:`Transport` subclass, named by path
(``transport="pkg.mod:MyTransport"``) wherever a built-in name is accepted. Whether control calls go to
each engine or through an smg router's RL fan-out (``router_url=``) is the engine client's business
(:mod:`agentrl.weights.engines`), so every transport can use the router.
"""

from __future__ import annotations

import inspect
from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

from agentrl.plugins import load_object, resolve
from agentrl.weights.engines import CallResult, EngineClient

if TYPE_CHECKING:
    import torch

TRANSPORTS: dict[str, str] = {
    "disk": "agentrl.weights.disk_sync:DiskTransport",
    "tensor": "agentrl.weights.tensor_sync:TensorTransport",
    "broadcast": "agentrl.weights.broadcast_sync:BroadcastTransport",
}


class WeightSyncError(RuntimeError):
    """A sync did not complete; engines may hold their old weights (each engine update is atomic)."""


@dataclass
class Sent:
    """What one full send delivered: bytes each engine received, the engines reached, transport details."""

    bytes_sent: int
    engines: list[str]
    details: dict[str, Any] = field(default_factory=dict)


class Transport(ABC):
    """Moves a payload to the engines; ``engines`` is the sync's client (direct or through the router).

    ``carries``: the payload kinds it can move. ``send_full`` raises :class:`WeightSyncError` unless every
    engine it was given took the weights; ``send_delta`` never raises for an engine's refusal (the payload
    decides what a refusal means) and returns one answer per engine.
    """

    name: ClassVar[str] = ""
    carries: ClassVar[frozenset[str]] = frozenset({"full"})

    def __init__(self, engines: EngineClient) -> None:
        self.engines = engines

    @abstractmethod
    def send_full(self, tensors: list[tuple[str, torch.Tensor]], weight_version: str, urls: Sequence[str]) -> Sent:
        """Load ``tensors`` as ``weight_version`` into the engines at ``urls`` (a collective may reach all)."""

    def send_delta(self, payload: bytes, body: dict[str, Any]) -> list[CallResult]:
        """Hand a delta ``payload`` to every engine with ``body`` (``weight_version``, ``base_version``)."""
        raise NotImplementedError(f"the {self.name} transport cannot carry delta payloads")

    def close(self) -> None:  # noqa: B027  (a transport that holds nothing need not override it)
        """Release what the transport holds (files, groups, buffers); called once by the sync."""


def build_transport(spec: str | type[Transport], engines: EngineClient, *, payload: str,
                    options: Mapping[str, Any]) -> Transport:
    """The transport ``spec`` (a built-in name, a ``module:Class`` path or a class) made for ``engines``.

    Raises ``ValueError`` when it cannot carry ``payload`` or does not take one of ``options``."""
    cls = resolve(spec, TRANSPORTS, what=f"{payload or 'weight-sync'} transport", base=Transport)
    if payload and payload not in cls.carries:
        able = sorted(n for n, c in _builtin_classes().items() if payload in c.carries)
        raise ValueError(f"the {cls.name or cls.__name__} transport cannot carry {payload} payloads; choose from {able}")
    unknown = [key for key in options if not _accepts(cls, key)]
    if unknown:
        hints = [f"{key!r} is an option of the {' / '.join(_owners(key)) or 'no built-in'} transport" for key in unknown]
        raise ValueError(f"the {cls.name or cls.__name__} transport takes no option {unknown}; " + "; ".join(hints))
    return cls(engines, **options)


def _builtin_classes() -> dict[str, type[Transport]]:
    return {name: load_object(path) for name, path in TRANSPORTS.items()}


def _accepts(cls: type, key: str) -> bool:
    params = inspect.signature(cls).parameters
    return key in params or any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())


def _owners(key: str) -> list[str]:
    return [name for name, cls in _builtin_classes().items() if key in inspect.signature(cls).parameters]
