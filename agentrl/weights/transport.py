"""How a sync's bytes travel to the engines: the :class:`Transport` interface, its typed options, and the
registry of built-in transports.

A transport carries one or more payload kinds (:attr:`Transport.carries`): ``"full"`` (named tensors, the
whole model) and ``"delta"`` (one opaque :mod:`agentrl.engine.delta` payload). The payload -- *what* is
sent -- is the :class:`~agentrl.weights.sync.WeightSync` subclass; it hands its tensors or bytes to
``sync.via``, the transport. Each transport declares its options as a pydantic model (:attr:`Transport.Options`,
a :class:`TransportOptions` whose ``transport`` field names it: the discriminator a config's ``sync_options``
is dispatched on) and, as class attributes, what placement needs to know (:attr:`Transport.host_local`,
:attr:`Transport.needs_rendezvous`), so nothing outside a transport's own module compares its name.

A new built-in transport is one module under :mod:`agentrl.weights.transports` plus its line in
:data:`TRANSPORTS`. A transport of your own is a :class:`Transport` subclass named by path
(``transport="pkg.mod:MyTransport"``) wherever a built-in name is accepted; its ``Options`` are validated
when the config loads. Whether control calls go to each engine or through an smg router's RL fan-out
(``router_url=``) is the engine client's business (:mod:`agentrl.weights.engines`).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

from pydantic import Field

from agentrl.plugins import resolve
from agentrl.settings import Settings
from agentrl.weights.engines import CallResult, EngineClient

if TYPE_CHECKING:
    import torch

# name -> "module:Class"; a new built-in transport is one module and one line here
TRANSPORTS: dict[str, str] = {
    "disk": "agentrl.weights.transports.disk:DiskTransport",
    "tensor": "agentrl.weights.transports.tensor:TensorTransport",
    "broadcast": "agentrl.weights.transports.broadcast:BroadcastTransport",
}
DEFAULT_TRANSPORT = "disk"


class WeightSyncError(RuntimeError):
    """A sync did not complete; engines may hold their old weights (each engine update is atomic)."""


class TransportOptions(Settings):
    """The options of a transport; ``transport`` names it (a built-in name or ``module:Class``)."""

    transport: str = Field(DEFAULT_TRANSPORT, description="how the weights travel: "
                           f"{', '.join(TRANSPORTS)} or module:Class (a Transport subclass)")
    flush_cache: bool = Field(True, description="engines drop their prefix cache after loading")


@dataclass
class Sent:
    """What one full send delivered: bytes each engine received, the engines reached, transport details."""

    bytes_sent: int
    engines: list[str]
    details: dict[str, Any] = field(default_factory=dict)


class Transport(ABC):
    """Moves a payload to the engines; ``engines`` is the sync's client (direct or through the router).

    ``carries``: the payload kinds it can move. ``Options``: its typed options (``self.options``).
    ``host_local``: it reaches only engines on the sender's host (shared memory, a local directory);
    ``needs_rendezvous``: engines connect back to ``options.master_address`` on the sender's host.
    ``send_full`` raises :class:`WeightSyncError` unless every engine it was given took the weights;
    ``send_delta`` never raises for an engine's refusal (the payload decides what a refusal means) and
    returns one answer per engine.
    """

    name: ClassVar[str] = ""
    carries: ClassVar[frozenset[str]] = frozenset({"full"})
    Options: ClassVar[type[TransportOptions]] = TransportOptions
    host_local: ClassVar[bool] = False
    needs_rendezvous: ClassVar[bool] = False

    def __init__(self, engines: EngineClient, options: TransportOptions | None = None, **values: Any) -> None:
        """``options`` as validated, or its fields as keyword arguments (validated here)."""
        if options is not None and values:
            raise TypeError("give a transport its options or their values, not both")
        self.engines = engines
        self.options = options if options is not None else self.Options.model_validate({"transport": self.label(), **values})

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if cls.needs_rendezvous and "master_address" not in cls.Options.model_fields:
            raise TypeError(f"{cls.__name__} needs a rendezvous: its Options must have a master_address field")

    @classmethod
    def label(cls) -> str:
        """The transport's name in reports and errors (its class name for one without a ``name``)."""
        return cls.name or cls.__name__

    @classmethod
    def reaches_other_hosts(cls, options: TransportOptions) -> bool:
        """Whether engines on other hosts than the sender's can receive over it with ``options``."""
        return not cls.host_local

    @abstractmethod
    def send_full(self, tensors: list[tuple[str, torch.Tensor]], weight_version: str, urls: Sequence[str]) -> Sent:
        """Load ``tensors`` as ``weight_version`` into the engines at ``urls`` (a collective may reach all)."""

    def send_delta(self, payload: bytes, body: dict[str, Any]) -> list[CallResult]:
        """Hand a delta ``payload`` to every engine with ``body`` (``weight_version``, ``base_version``)."""
        raise NotImplementedError(f"the {self.label()} transport cannot carry delta payloads")

    def close(self) -> None:  # noqa: B027  (a transport that holds nothing need not override it)
        """Release what the transport holds (files, groups, buffers); called once by the sync."""


def transport_class(spec: str | type[Transport]) -> type[Transport]:
    """The transport class of ``spec``: a built-in name, a ``module:Class`` path, or the class itself."""
    return resolve(spec, TRANSPORTS, what="weight-sync transport", base=Transport)


def builtin_transports() -> dict[str, type[Transport]]:
    """Every registered transport class by name (their modules are light: torch loads when a sync runs)."""
    return {name: transport_class(name) for name in TRANSPORTS}


def class_path(cls: type) -> str:
    """``module:Qualname`` of ``cls``: how a resolved class travels to another process."""
    return f"{cls.__module__}:{cls.__qualname__}"
