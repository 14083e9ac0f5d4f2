"""A weight sync is a payload (what is sent) over a transport (how it travels); the factory by name.

A sender takes HF-named tensors (``Iterable[tuple[str, torch.Tensor]]``, e.g. from
``MegatronTrainer.export_hf_named_tensors()`` or ``model.named_parameters()``) and a new
``weight_version``; when :meth:`WeightSync.sync` returns, every engine holds those bits and reports that
version in ``/server_info`` (checked), so each sampled token's ``weight_version`` names the weights that
produced it.

Payloads are :class:`WeightSync` subclasses: ``full`` (:class:`FullSync`, every tensor) and ``delta``
(:class:`~agentrl.weights.delta_sync.DeltaSync`, the changed bits, zstd-compressed). Each takes
``transport=`` (:mod:`agentrl.weights.transport`: ``disk``, ``tensor``, ``broadcast`` or a path of your
own) and the options of both, validated together by :func:`sync_options` (one flat model: the payload's
``Options`` and the transport's, so an unknown key names the nearest valid one). The historical mode
names are full-weight presets: ``disk``, ``tensor`` and ``broadcast`` are ``full`` over that transport.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from functools import cache
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

from pydantic import Field, create_model

from agentrl.plugins import load_object, resolve
from agentrl.settings import Settings
from agentrl.weights.bucket import unique_named_tensors
from agentrl.weights.engines import EngineCallError, EngineClient
from agentrl.weights.transport import (
    DEFAULT_TRANSPORT,
    Transport,
    TransportOptions,
    WeightSyncError,
    builtin_transports,
    class_path,
    transport_class,
)

if TYPE_CHECKING:
    import torch

__all__ = ["MODES", "FullSync", "PayloadOptions", "SyncReport", "TransportOptions", "WeightSync", "WeightSyncError",
           "full_bytes", "make_sync", "options_model", "payload_class", "sync_options"]

MODES: dict[str, str] = {
    "full": "agentrl.weights.sync:FullSync",
    "delta": "agentrl.weights.delta_sync:DeltaSync",
    "adapter": "agentrl.weights.adapter_sync:AdapterSync",
    # historical names: full weights over the transport of the same name
    "disk": "agentrl.weights.sync:DiskSync",
    "tensor": "agentrl.weights.transports.tensor:TensorSync",
    "broadcast": "agentrl.weights.sync:BroadcastSync",
}


class PayloadOptions(Settings):
    """Options every payload takes (a payload's own ``Options`` add to them)."""

    timeout: float = Field(600.0, gt=0, description="seconds one engine call may take")
    router_url: str | None = Field(None, description="an smg router (--enable-rl) in front of the engines: update calls "
                                                     "that are the same for every engine go through its RL fan-out")


@dataclass
class SyncReport:
    """What one sync cost. ``bytes_sent``: payload bytes each engine received (file, shared memory,
    HTTP body or collective); ``full_bytes``: the raw size of all tensors; ``seconds``: wall time
    including the engines' acknowledgement. ``details`` always names the ``payload`` and ``transport``."""

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


class WeightSync:
    """Base of every payload: owns the engine client and the transport (``via``); subclasses implement
    :meth:`_push`.

    ``transport``: a name of :data:`agentrl.weights.transport.TRANSPORTS`, a ``module:Class`` path or a
    :class:`~agentrl.weights.transport.Transport` subclass (default :attr:`default_transport`); ``values``:
    the fields of the payload's and the transport's options (:func:`sync_options`), or ``options`` as
    validated. ``self.options`` is both at once (one model deriving from each).
    """

    payload: ClassVar[str] = ""  # the kind the transport must carry ("full", "delta"); "" checks nothing
    Options: ClassVar[type[PayloadOptions]] = PayloadOptions
    default_transport: ClassVar[str] = DEFAULT_TRANSPORT
    needs_engine: ClassVar[str | None] = None  # the /server_info ``engine`` whose routes it needs (None: any)

    def __init__(self, engine_urls: Sequence[str], *, transport: str | type[Transport] | None = None,
                 options: PayloadOptions | None = None, **values: Any) -> None:
        if options is None:
            options = sync_options(type(self), values if transport is None else {**values, "transport": transport})
        self.options = options
        self._closed = False
        self.engines = EngineClient(engine_urls, timeout=options.timeout, router_url=options.router_url)
        try:
            self.via = transport_class(options.transport)(self.engines, options)
        except BaseException:
            self.engines.close()
            raise

    @classmethod
    def label(cls) -> str:
        return cls.payload or cls.__name__

    @classmethod
    def normalize(cls, values: dict[str, Any]) -> dict[str, Any]:
        """``values`` in today's spelling (a preset maps an old one); the default: as given."""
        return values

    @classmethod
    def check_carried(cls, transport: type[Transport]) -> None:
        """Raise ``ValueError`` unless ``transport`` carries this payload, naming the transports that do."""
        if cls.payload and cls.payload not in transport.carries:
            able = sorted(n for n, c in builtin_transports().items() if cls.payload in c.carries)
            raise ValueError(f"the {transport.label()} transport cannot carry {cls.payload} payloads; choose from {able}")

    @property
    def engine_urls(self) -> list[str]:
        return list(self.engines.urls)

    @property
    def transport(self) -> str:
        """The transport's name (its class name for one without a ``name``)."""
        return self.via.label()

    @property
    def mode(self) -> str:
        """The name in reports: the payload's; for full weights the transport's (``disk``, ``tensor``, ...)."""
        return self.transport if self.payload == "full" else self.payload

    @property
    def root(self) -> Path | None:
        """The directory the transport writes into; ``None`` when it writes no files."""
        return getattr(self.via, "root", None)

    def sync(self, named_tensors: Iterable[tuple[str, torch.Tensor]], weight_version: str) -> SyncReport:
        """Push ``named_tensors`` to every engine as ``weight_version``; checks the engines' versions."""
        if self._closed:
            raise WeightSyncError("this weight sync is closed")
        weight_version = str(weight_version)
        tensors = unique_named_tensors(named_tensors)
        start = time.perf_counter()
        report = self._push(tensors, weight_version)
        checking = time.perf_counter()
        # engines that answered the update with the version they now hold need not be asked again
        self.check_versions(weight_version, reported=report.details.get("engine_versions"))
        report.seconds = time.perf_counter() - start
        report.details["check_versions_s"] = round(report.seconds - (checking - start), 6)
        report.mode = self.mode
        report.full_bytes = self.full_size(tensors)
        report.engines = self.engine_urls
        report.details.update(payload=self.payload, transport=self.transport)
        return report

    def full_size(self, tensors: list[tuple[str, torch.Tensor]]) -> int:
        """``SyncReport.full_bytes``: what sending every tensor of the policy costs (here: ``tensors``)."""
        return full_bytes(tensors)

    def _push(self, tensors: list[tuple[str, torch.Tensor]], weight_version: str) -> SyncReport:
        """Send the tensors (tied aliases already dropped) and set the version on every engine; ``seconds``,
        ``mode``, ``full_bytes`` and ``engines`` are filled in by :meth:`sync`."""
        raise NotImplementedError

    def push_full(
        self, tensors: list[tuple[str, torch.Tensor]], weight_version: str, urls: Sequence[str] | None = None
    ) -> SyncReport:
        """Full weights to the engines at ``urls`` (default: all) over the transport."""
        sent = self.via.send_full(tensors, weight_version, self.engine_urls if urls is None else list(urls))
        return SyncReport(self.mode, weight_version, sent.bytes_sent, full_bytes(tensors), 0.0,
                          engines=sent.engines, details=dict(sent.details))

    def check_versions(self, weight_version: str, urls: Sequence[str] | None = None,
                       reported: dict[str, str] | None = None) -> None:
        """Raise unless every engine at ``urls`` (default: all) holds ``weight_version``. ``reported``: versions
        the engines gave in their answers to the update (read after it applied); only the engines missing
        from it are asked (``/server_info``)."""
        targets = self.engine_urls if urls is None else list(urls)
        reported = reported if isinstance(reported, dict) else {}
        versions = {u: str(reported[u]) for u in targets if reported.get(u) is not None}
        missing = [u for u in targets if u not in versions]
        if missing:
            try:
                versions.update(self.engines.weight_versions(missing))
            except EngineCallError as exc:
                raise WeightSyncError(f"could not read engine weight versions: {exc}") from exc
        wrong = {u: v for u, v in versions.items() if v != weight_version}
        if wrong:
            raise WeightSyncError(f"engines report other weight versions than {weight_version!r}: {wrong}")

    def close(self) -> None:
        """Release the transport (its temp files, group, buffers) and the client; a second call does nothing."""
        if self._closed:
            return
        self._closed = True
        try:
            self.via.close()
        finally:
            self.engines.close()

    def __enter__(self) -> WeightSync:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class FullSync(WeightSync):
    """The ``full`` payload: every tensor, every sync, over any transport."""

    payload = "full"

    def _push(self, tensors: list[tuple[str, torch.Tensor]], weight_version: str) -> SyncReport:
        return self.push_full(tensors, weight_version)


class Preset(FullSync):
    """A historical mode name: full weights over the transport of the same name (``default_transport``)."""

    def __init__(self, engine_urls: Sequence[str], **values: Any) -> None:
        super().__init__(engine_urls, options=sync_options(type(self), values))

    @classmethod
    def check_carried(cls, transport: type[Transport]) -> None:
        if transport is not transport_class(cls.default_transport):
            raise ValueError(f"sync_mode {cls.default_transport!r} sends full weights over the {cls.default_transport} "
                             f"transport, not {transport.label()}; use sync_mode 'full' for that")


class DiskSync(Preset):
    """The ``disk`` mode: full weights over the disk transport."""

    default_transport = "disk"


class BroadcastSync(Preset):
    """The ``broadcast`` mode: full weights over the broadcast transport."""

    default_transport = "broadcast"


def full_bytes(tensors: Iterable[tuple[str, torch.Tensor]]) -> int:
    return sum(t.numel() * t.element_size() for _, t in tensors)


def payload_class(mode: str | type[WeightSync]) -> type[WeightSync]:
    """The payload class of ``mode``: a name of :data:`MODES`, a ``module:Class`` path, or the class."""
    return resolve(mode, MODES, what="weight-sync mode", base=WeightSync)


def make_sync(mode: str | type[WeightSync], engine_urls: Sequence[str], **options: Any) -> WeightSync:
    """The sender for ``mode``: a payload (``full``, ``delta``), a historical name (``disk``, ``tensor``,
    ``broadcast``: full weights over that transport), or a ``module:Class`` path of your own
    :class:`WeightSync` subclass. ``options`` go to its constructor, e.g. ``transport="broadcast"``."""
    return payload_class(mode)(engine_urls, **options)


def sync_options(mode: str | type[WeightSync], values: Mapping[str, Any] | PayloadOptions) -> PayloadOptions:
    """``values`` (a config's ``sync_options``) validated for ``mode``: the transport is the one ``transport``
    names (default: the payload's), and every other key must be an option of the payload or of that
    transport -- an unknown one is refused naming the nearest valid key, or the transport it belongs to.
    Already validated options are returned as they are. Loads the payload and transport classes (their
    modules are light), so a bad name or path fails here."""
    payload = payload_class(mode)
    if isinstance(values, PayloadOptions):
        return values
    values = payload.normalize(dict(values))
    spec = values.get("transport", payload.default_transport)
    transport = transport_class(spec)
    payload.check_carried(transport)
    named = spec if isinstance(spec, str) else class_path(spec)
    return options_model(payload, transport).model_validate({**values, "transport": named})


@cache
def options_model(payload: type[WeightSync], transport: type[Transport]) -> type[PayloadOptions]:
    """The flat options model of ``payload`` over ``transport`` (both ``Options`` in one); a key of another
    built-in transport or payload is explained as that one's."""
    model = create_model(f"sync_options ({payload.label()} over {transport.label()})",
                         __base__=(transport.Options, payload.Options), __module__=__name__)
    owners = [(f"{name} transport", cls.Options) for name, cls in builtin_transports().items()]
    owners += [(f"{name} payload", load_object(path).Options) for name, path in MODES.items()]
    model.moved_keys = {key: f"{key!r} is an option of the {owner}" for owner, options in reversed(owners)
                        for key in options.model_fields if key not in model.model_fields}
    return model

