"""The torch.distributed side of ``/init_weights_update_group`` + ``/update_weights_from_distributed``.

The trainer is rank 0 and broadcasts each tensor; the engine joins as ``rank_offset`` (its only TP
rank) and receives. The group is a *custom* process group (not the default one), created exactly like
SGLang's ``init_custom_process_group``: a rendezvous store behind ``PrefixStore(group_name)``, so a
trainer that already has its own default group can join too. Both sides must create the group with
:func:`init_custom_process_group` (or SGLang's identical helper). Backend: ``gloo`` on CPU, ``nccl`` on
CUDA (the request may name one; on a CPU engine ``nccl`` is replaced by ``gloo``).

``/update_weights_from_distributed`` body: ``{"names": [...], "dtypes": ["bfloat16", ...], "shapes":
[[...], ...], "group_name": ..., "flush_cache": true, "weight_version": ...}``; rank 0 broadcasts the
tensors in that order, one ``broadcast`` per tensor.

``/update_weights_from_delta_distributed`` (agentrl's delta over the same group): body ``{"group_name",
"nbytes", "base_version", "weight_version"}``; rank 0 broadcasts one ``uint8`` tensor of ``nbytes``
holding an :mod:`agentrl.engine.delta` payload, which the engine then verifies and applies.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch


def init_custom_process_group(
    backend: str,
    init_method: str,
    *,
    world_size: int,
    rank: int,
    group_name: str,
    timeout: timedelta = timedelta(minutes=10),
    store: Any = None,
):
    """Create a process group outside the default one (SGLang's helper); returns the group handle.
    ``store``: rank 0's rendezvous store, already listening (:func:`listening_store`), in place of
    the one ``init_method`` would open."""
    from torch.distributed.distributed_c10d import (
        Backend,
        PrefixStore,
        _new_process_group_helper,
        _world,
        rendezvous,
    )

    if store is None:
        store, rank, world_size = next(rendezvous(init_method, rank, world_size, timeout=timeout))
    store.set_timeout(timeout)
    store = PrefixStore(group_name, store)
    pg, _ = _new_process_group_helper(
        world_size, rank, [], Backend(backend), store, group_name=group_name, timeout=timeout
    )
    _world.pg_group_ranks[pg] = {i: i for i in range(world_size)}
    return pg


def listening_store(host: str, *, world_size: int, timeout: timedelta):
    """Rank 0's rendezvous store on a port the OS picks as it binds (``store.port``): a port chosen free
    beforehand can be taken by another process before the store binds it (EADDRINUSE)."""
    from torch.distributed import TCPStore

    return TCPStore(host, 0, world_size, True, timeout=timeout, wait_for_workers=False, multi_tenant=True)


def broadcast(tensor: torch.Tensor, group, *, src: int = 0) -> None:
    """Broadcast in ``group`` without needing a default process group."""
    from torch.distributed import BroadcastOptions

    opts = BroadcastOptions()
    opts.rootRank = src
    opts.rootTensor = 0
    group.broadcast([tensor], opts).wait()


@dataclass
class GroupSpec:
    master_address: str
    master_port: int
    rank_offset: int
    world_size: int
    group_name: str
    backend: str

    @classmethod
    def parse(cls, body: dict[str, Any], *, device) -> GroupSpec:
        try:
            spec = cls(
                master_address=str(body["master_address"]),
                master_port=int(body["master_port"]),
                rank_offset=int(body.get("rank_offset", 1)),
                world_size=int(body["world_size"]),
                group_name=str(body.get("group_name", "weight_update_group")),
                backend=str(body.get("backend") or ("nccl" if device.type == "cuda" else "gloo")),
            )
        except KeyError as exc:
            raise ValueError(f"missing field {exc.args[0]!r} (need master_address, master_port, world_size)") from None
        except (TypeError, ValueError) as exc:
            raise ValueError(f"bad init_weights_update_group field: {exc}") from None
        if device.type != "cuda" and spec.backend == "nccl":
            spec.backend = "gloo"
        if not 0 < spec.rank_offset < spec.world_size:
            raise ValueError(f"rank_offset {spec.rank_offset} must be in [1, world_size={spec.world_size})")
        return spec


def init_group(spec: GroupSpec):
    return init_custom_process_group(
        spec.backend,
        f"tcp://{spec.master_address}:{spec.master_port}",
        world_size=spec.world_size,
        rank=spec.rank_offset,
        group_name=spec.group_name,
    )


def destroy_group(group) -> None:
    import torch.distributed as dist

    # the group may already be broken (peer gone); dropping the handle suffices then
    with contextlib.suppress(Exception):
        dist.destroy_process_group(group)


@dataclass
class BroadcastSpec:
    names: list[str]
    dtypes: list[str]
    shapes: list[list[int]]
    group_name: str

    @classmethod
    def parse(cls, body: dict[str, Any]) -> BroadcastSpec:
        import torch

        names, dtypes, shapes = body.get("names"), body.get("dtypes"), body.get("shapes")
        if body.get("load_format") not in (None, "auto"):
            raise ValueError(f"load_format {body.get('load_format')!r} is not supported for distributed updates")
        if not (isinstance(names, list) and isinstance(dtypes, list) and isinstance(shapes, list)):
            raise ValueError("give 'names', 'dtypes' and 'shapes' as lists")
        if not names or not len(names) == len(dtypes) == len(shapes):
            raise ValueError(f"names/dtypes/shapes differ in length: {len(names)}/{len(dtypes)}/{len(shapes)}")
        for d in dtypes:
            if not isinstance(getattr(torch, str(d).removeprefix("torch."), None), torch.dtype):
                raise ValueError(f"unknown dtype {d!r}")
        for s in shapes:
            if not isinstance(s, list) or not all(isinstance(x, int) and x >= 0 for x in s):
                raise ValueError(f"bad shape {s!r}")
        return cls([str(n) for n in names], [str(d) for d in dtypes], shapes, str(body.get("group_name", "weight_update_group")))

    def empty_tensors(self, device: str = "meta") -> dict[str, torch.Tensor]:
        import torch

        return {
            n: torch.empty(s, dtype=getattr(torch, d.removeprefix("torch.")), device=device)
            for n, d, s in zip(self.names, self.dtypes, self.shapes, strict=False)
        }


def receive_broadcast(group, spec: BroadcastSpec, device) -> dict[str, torch.Tensor]:
    """Receive every tensor of ``spec`` from rank 0 (blocking; run it in a thread)."""
    tensors = spec.empty_tensors(device=str(device))
    for t in tensors.values():
        broadcast(t, group, src=0)
    return tensors


@dataclass
class PayloadSpec:
    """Body of ``/update_weights_from_delta_distributed``: rank 0 broadcasts ``nbytes`` of one payload.

    ``{"group_name": ..., "nbytes": N, "base_version": ..., "weight_version": ...}``; the bytes travel as
    one ``uint8`` tensor of ``nbytes`` elements (one collective, whatever the payload's content).
    """

    group_name: str
    nbytes: int

    @classmethod
    def parse(cls, body: dict[str, Any]) -> PayloadSpec:
        nbytes = body.get("nbytes")
        # bool is an int subclass; True bytes is a caller bug, not a size
        if not isinstance(nbytes, int) or isinstance(nbytes, bool) or nbytes <= 0:
            raise ValueError(f"give 'nbytes': the payload size in bytes, a positive integer (got {nbytes!r})")
        return cls(str(body.get("group_name", "weight_update_group")), nbytes)


def broadcast_bytes(payload: bytes, group, device) -> None:
    """Rank 0: send ``payload`` to every member of ``group`` as one ``uint8`` tensor on ``device``."""
    import torch

    tensor = torch.frombuffer(bytearray(payload), dtype=torch.uint8).to(device)
    broadcast(tensor, group, src=0)


def receive_bytes(group, spec: PayloadSpec, device) -> bytes:
    """Receive ``spec.nbytes`` bytes broadcast by rank 0 (blocking; run it in a thread)."""
    import torch

    tensor = torch.empty(spec.nbytes, dtype=torch.uint8, device=device)
    broadcast(tensor, group, src=0)
    return tensor.cpu().numpy().tobytes()
