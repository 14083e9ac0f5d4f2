"""Broadcast mode: a process group between the trainer (rank 0) and the engines, one call per bucket.

On the first sync the sender opens a custom process group (not the default one, so a trainer that has
its own torch.distributed world can still do this) with every engine via ``/init_weights_update_group``
-- engine ``i`` joins as rank ``1 + i`` -- using the same helper the engine uses
(:func:`agentrl.engine.weight_group.init_custom_process_group`, SGLang's). Each sync then groups the
tensors into buckets of ``bucket_bytes`` and, per bucket, posts ``/update_weights_from_distributed``
(names, dtypes, shapes) to every engine while broadcasting the bucket's tensors from rank 0 in that
order. ``gloo`` on CPU (tested here), ``nccl`` when the tensors are on the GPU.

The engine protocol broadcasts tensor by tensor (SGLang's default ``load_format``); a flattened
one-collective-per-bucket variant needs engine support (SGLang's ``flattened_bucket``).
An engine that refuses a bucket before joining its broadcast leaves rank 0 waiting until the group
timeout (``group_timeout_s``); then the sync fails and the group is torn down.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import timedelta
from typing import TYPE_CHECKING, Any

from agentrl.engine.launch import free_port
from agentrl.weights.bucket import DEFAULT_BUCKET_BYTES, plan_buckets, unique_named_tensors
from agentrl.weights.engines import collect, raise_errors
from agentrl.weights.sync import SyncReport, WeightSync, WeightSyncError, full_bytes

if TYPE_CHECKING:
    import torch


class BroadcastSync(WeightSync):
    """``broadcast`` mode (see module doc). ``backend``: ``gloo``/``nccl`` (default: by tensor device)."""

    mode = "broadcast"

    def __init__(
        self,
        engine_urls: Sequence[str],
        *,
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
        backend: str | None = None,
        master_address: str = "127.0.0.1",
        master_port: int | None = None,
        group_name: str = "agentrl_weight_sync",
        group_timeout_s: float = 600.0,
        flush_cache: bool = True,
        timeout: float = 600.0,
        router_url: str | None = None,
    ) -> None:
        super().__init__(engine_urls, timeout=timeout, router_url=router_url)
        self.bucket_bytes = bucket_bytes
        self.backend = backend
        self.master_address = master_address
        self.master_port = master_port
        self.group_name = group_name
        self.group_timeout = timedelta(seconds=group_timeout_s)
        self.flush_cache = flush_cache
        self.group: Any = None
        self.group_backend: str | None = None

    def backend_for(self, tensors: list[tuple[str, torch.Tensor]]) -> str:
        """The configured backend, else ``nccl`` for CUDA tensors and ``gloo`` otherwise."""
        return self.backend or ("nccl" if tensors and tensors[0][1].is_cuda else "gloo")

    def ensure_group(self, backend: str) -> Any:
        """The open process group with every engine (opened on first use); rank 0 is this process."""
        if self.group is None:
            self._open_group(backend)
        return self.group

    def _open_group(self, backend: str) -> None:
        from agentrl.engine.weight_group import init_custom_process_group

        port = self.master_port or free_port(self.master_address)
        world_size = 1 + len(self.engine_urls)
        futures = [
            self.engines.submit(
                url,
                "/init_weights_update_group",
                {
                    "master_address": self.master_address,
                    "master_port": port,
                    "rank_offset": 1 + i,
                    "world_size": world_size,
                    "group_name": self.group_name,
                    "backend": backend,
                },
            )
            for i, url in enumerate(self.engine_urls)
        ]
        try:
            self.group = init_custom_process_group(
                backend,
                f"tcp://{self.master_address}:{port}",
                world_size=world_size,
                rank=0,
                group_name=self.group_name,
                timeout=self.group_timeout,
            )
        finally:
            results = collect(self.engine_urls, futures)
        self.group_backend = backend
        raise_errors(results)

    def _push(self, tensors: list[tuple[str, torch.Tensor]], weight_version: str) -> SyncReport:
        return self.push(tensors, weight_version)

    def push(self, tensors: list[tuple[str, torch.Tensor]], weight_version: str) -> SyncReport:
        """Broadcast every tensor to every engine as ``weight_version`` (also a delta sync's full sync)."""
        from agentrl.engine.weight_group import broadcast

        unique = unique_named_tensors(tensors)
        backend = self.backend_for(unique)
        try:
            self.ensure_group(backend)
            buckets = plan_buckets(unique, bucket_bytes=self.bucket_bytes)
            sent = 0
            for i, bucket in enumerate(buckets):
                last = i == len(buckets) - 1
                body = {
                    "names": [n for n, _ in bucket],
                    "dtypes": [str(t.dtype).removeprefix("torch.") for _, t in bucket],
                    "shapes": [list(t.shape) for _, t in bucket],
                    "group_name": self.group_name,
                    "flush_cache": self.flush_cache and last,
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
        return SyncReport(
            self.mode,
            weight_version,
            sent,
            full_bytes(tensors),
            0.0,
            details={"backend": backend, "buckets": len(buckets), "world_size": 1 + len(self.engine_urls)},
        )

    def close_group(self) -> None:
        """Tear the group down on both sides (the next sync opens a new one); errors are ignored."""
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
        try:
            self.close_group()
        finally:
            super().close()
