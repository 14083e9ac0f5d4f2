"""The ``broadcast`` transport: a process group between the trainer (rank 0) and every engine.

On first use the transport opens a custom process group (not the default one, so a trainer that has its
own torch.distributed world can still do this) with every engine via ``/init_weights_update_group`` --
engine ``i`` joins as rank ``1 + i`` -- using the same helper the engine uses
(:func:`agentrl.engine.weight_group.init_custom_process_group`, SGLang's). ``gloo`` on CPU (tested here),
``nccl`` when the tensors are on the GPU.

* Full weights: the tensors go in buckets of ``bucket_bytes``; per bucket, ``/update_weights_from_distributed``
  (names, dtypes, shapes) is posted to every engine while rank 0 broadcasts the bucket's tensors in that
  order (SGLang's default tensor-by-tensor ``load_format``; a flattened one-collective-per-bucket variant
  needs engine support, SGLang's ``flattened_bucket``).
* Delta payloads: ``/update_weights_from_delta_distributed`` (``group_name``, ``nbytes``, ``base_version``,
  ``weight_version``) is posted to every engine and the payload is broadcast as one ``uint8`` tensor.

A collective needs every member, so a full send reaches every engine even when asked for some. An
engine that refuses a call before joining the collective (no such group, a malformed body) leaves
rank 0 waiting until the group timeout (``group_timeout_s``); then the send fails and the group is torn
down (the next send opens a new one).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from datetime import timedelta
from typing import TYPE_CHECKING, Any, Literal

from pydantic import Field

from agentrl.weights.bucket import DEFAULT_BUCKET_BYTES, plan_buckets
from agentrl.weights.engines import CallResult, collect, raise_errors
from agentrl.weights.transport import Sent, Transport, TransportOptions, WeightSyncError

if TYPE_CHECKING:
    import torch


class BroadcastOptions(TransportOptions):
    """Options of the ``broadcast`` transport."""

    bucket_bytes: int = Field(DEFAULT_BUCKET_BYTES, ge=1, description="bytes of tensors per update request")
    backend: Literal["gloo", "nccl"] | None = Field(None, description="null: nccl for CUDA tensors, else gloo")
    master_address: str = Field("127.0.0.1", description="the rendezvous address engines connect to (on a cluster: "
                                "trainer rank 0's node unless set)")
    master_port: int | None = Field(None, ge=1, le=65535, description="the rendezvous port (null: a free one)")
    group_name: str | None = Field(None, description="null: one per transport, so a group left behind by a crashed "
                                   "sender never blocks a new one")
    group_timeout_s: float = Field(600.0, gt=0, description="how long a collective may wait for every member")


class BroadcastTransport(Transport):
    """``broadcast`` (see module doc)."""

    name = "broadcast"
    carries = frozenset({"full", "delta"})
    Options = BroadcastOptions
    needs_rendezvous = True

    def __init__(self, engines: Any, options: BroadcastOptions | None = None, **values: Any) -> None:
        super().__init__(engines, options, **values)
        self.group_name = self.options.group_name or f"agentrl_weights_{os.getpid()}_{id(self):x}"
        self.group_timeout = timedelta(seconds=self.options.group_timeout_s)
        self.group: Any = None
        self.group_backend: str | None = None
        self._last_backend = self.options.backend or "gloo"  # for a delta, which has no tensors to tell the device

    def backend_for(self, tensors: list[tuple[str, torch.Tensor]]) -> str:
        """The configured backend, else ``nccl`` for CUDA tensors and ``gloo`` otherwise."""
        return self.options.backend or ("nccl" if tensors and tensors[0][1].is_cuda else "gloo")

    def ensure_group(self, backend: str) -> Any:
        """The open process group with every engine (opened on first use); rank 0 is this process."""
        if self.group is None:
            self._open_group(backend)
        return self.group

    def _open_group(self, backend: str) -> None:
        from agentrl.engine.weight_group import init_custom_process_group, listening_store

        urls = self.engines.urls
        world_size = 1 + len(urls)
        store = None
        address = self.options.master_address
        if self.options.master_port:
            port = self.options.master_port
        else:
            store = listening_store(address, world_size=world_size, timeout=self.group_timeout)
            port = store.port
        futures = [
            self.engines.submit(
                url,
                "/init_weights_update_group",
                {
                    "master_address": address,
                    "master_port": port,
                    "rank_offset": 1 + i,
                    "world_size": world_size,
                    "group_name": self.group_name,
                    "backend": backend,
                },
            )
            for i, url in enumerate(urls)
        ]
        try:
            self.group = init_custom_process_group(
                backend,
                f"tcp://{address}:{port}",
                world_size=world_size,
                rank=0,
                group_name=self.group_name,
                timeout=self.group_timeout,
                store=store,
            )
        finally:
            results = collect(urls, futures)
        self.group_backend = backend
        raise_errors(results)

    def send_full(self, tensors: list[tuple[str, torch.Tensor]], weight_version: str, urls: Sequence[str]) -> Sent:
        from agentrl.engine.weight_group import broadcast

        backend = self._last_backend = self.backend_for(tensors)
        try:
            self.ensure_group(backend)
            buckets = plan_buckets(tensors, bucket_bytes=self.options.bucket_bytes)
            sent = 0
            for i, bucket in enumerate(buckets):
                last = i == len(buckets) - 1
                body = {
                    "names": [n for n, _ in bucket],
                    "dtypes": [str(t.dtype).removeprefix("torch.") for _, t in bucket],
                    "shapes": [list(t.shape) for _, t in bucket],
                    "group_name": self.group_name,
                    "flush_cache": self.options.flush_cache and last,
                    "weight_version": weight_version if last else None,
                }
                answers = self.engines.submit_all("/update_weights_from_distributed", body)
                for _, t in bucket:
                    broadcast(t.detach().contiguous(), self.group, src=0)
                    sent += t.numel() * t.element_size()
                raise_errors(answers())
        except Exception as exc:
            self.close_group()
            raise WeightSyncError(f"broadcast sync of {weight_version!r} failed: {exc}") from exc
        details = {"backend": backend, "buckets": len(buckets), "world_size": 1 + len(self.engines.urls)}
        return Sent(sent, list(self.engines.urls), details)

    def send_delta(self, payload: bytes, body: dict[str, Any]) -> list[CallResult]:
        from agentrl.engine.weight_group import broadcast_bytes

        group = self.ensure_group(self._last_backend)
        body = {**body, "group_name": self.group_name, "nbytes": len(payload)}
        answers = self.engines.submit_all("/update_weights_from_delta_distributed", body)
        try:
            # Every engine joins the broadcast before judging the payload (rank 0 would stall otherwise).
            broadcast_bytes(payload, group, _device_for(self.group_backend))
        except Exception as exc:
            self.close_group()
            raise WeightSyncError(f"broadcasting the delta failed: {exc}") from exc
        results = answers()
        if any(r.error is not None and not r.error.rejected for r in results):
            self.close_group()  # an engine failed inside the collective: the group is not trusted
        return results

    def close_group(self) -> None:
        """Tear the group down on both sides (the next send opens a new one); errors are ignored."""
        if self.group is None:
            return
        from agentrl.engine.weight_group import destroy_group

        # Both sides at once: destroying an NCCL communicator waits for the peers to destroy theirs, so
        # waiting for the engines' answer first deadlocks (seen on 2 H200s; gloo does not wait).
        answers = self.engines.submit_all("/destroy_weights_update_group", {"group_name": self.group_name})
        destroy_group(self.group)
        answers()
        self.group = None
        self.group_backend = None

    def close(self) -> None:
        self.close_group()


def _device_for(backend: str | None) -> Any:
    """Where the payload tensor must live for ``backend`` (NCCL only moves CUDA tensors)."""
    import torch

    if backend == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")
