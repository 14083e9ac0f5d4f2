"""The engine's state behind the HTTP layer: model runner, scheduler, prefix cache, weight version.

Every weight change goes through :meth:`Engine.apply_weights`: tensors are fully received and checked
(names, shapes) first, then copied in by the worker thread between two forward passes, so a failed
update leaves the old weights and version, and no forward pass ever sees half-updated weights.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from agentrl.engine.metrics import EngineMetrics
from agentrl.engine.prefix_cache import PrefixCache
from agentrl.engine.scheduler import MAX_BATCH_SIZE, Scheduler

if TYPE_CHECKING:
    import torch

    from agentrl.engine.model_runner import ModelRunner


@dataclass
class EngineConfig:
    model_path: str
    dtype: str = "float32"
    device: str | None = None
    max_batch_size: int = MAX_BATCH_SIZE
    max_prefill_tokens: int = 8192  # new (uncached) prompt tokens prefilled together in one forward
    admit_wait_ratio: float = 4.0  # waiting requests join a busy batch in groups: scheduler.py's docstring
    prefix_cache_tokens: int = 65536
    weight_version: str = "default"
    host: str = "127.0.0.1"
    port: int = 30000
    enable_memory_saver: bool = False
    static_kv: bool | None = None  # fixed KV buffers + CUDA-graph decode steps; None: on CUDA
    fused_ops: bool | None = None  # compiled RMSNorm / RoPE / SiLU gate (fused_ops.py); None: on CUDA
    lean_decode: bool | None = None  # CPU decode steps by cpu_decode.py; None: on the CPU when the model is supported


class WeightUpdateError(ValueError):
    """A weight update was refused; the engine keeps its old weights and version."""


class Engine:
    """Owns everything stateful; the FastAPI app (``server.py``) is a thin layer over it."""

    def __init__(self, config: EngineConfig, runner: ModelRunner | None = None) -> None:
        from agentrl.engine.model_runner import ModelRunner

        self.config = config
        self.model_path = config.model_path
        self.runner = runner or ModelRunner(
            config.model_path, dtype=config.dtype, device=config.device, memory_saver=config.enable_memory_saver,
            static_kv=config.static_kv, fused_ops=config.fused_ops,
        )
        from agentrl.engine.model_runner import decode_bucket

        self.runner.static_rows = decode_bucket(config.max_batch_size)  # static KV buffers: no regrowth
        self.decoder = None  # cpu_decode.LeanDecoder: decode steps and the running batch, in the runner's place
        if config.lean_decode is not False and self.runner.device.type == "cpu" and not self.runner.static_kv:
            from agentrl.engine.cpu_decode import LeanDecoder

            self.decoder = LeanDecoder.for_model(self.runner.model, self.runner.dtype, self.runner.device,
                                                 rows=config.max_batch_size)
            if self.decoder is None and config.lean_decode:
                raise ValueError(f"lean_decode: {config.model_path} is not a model cpu_decode.py decodes")
        self.weight_version = config.weight_version
        self.weight_writes = 0  # copies and deltas into the model so far (a merged LoRA base is valid for one)
        self.metrics = EngineMetrics()
        self.prefix_cache = PrefixCache(config.prefix_cache_tokens)
        self.scheduler = Scheduler(
            self.runner,
            self.prefix_cache,
            self.metrics,
            max_batch_size=config.max_batch_size,
            max_prefill_tokens=config.max_prefill_tokens,
            weight_version=lambda: self.weight_version,
            decoder=self.decoder,
            admit_wait_ratio=config.admit_wait_ratio,
        )
        self.memory_released: set[str] = set()
        self._offloaded: dict[str, Any] | None = None
        self.weight_groups: dict[str, Any] = {}
        # flat CUDA buckets kept open by sender and key, so the next sync hits torch's IPC handle cache.
        # The memory is the sender's persistent staging (not ours), so releasing memory keeps them; the
        # sender drops them when it closes (``drop_kept``), else they stay mapped until the engine exits.
        self.kept_buffers: dict[str, dict[str, torch.Tensor]] = {}
        self._update_lock = threading.Lock()  # one weight update at a time

    def start(self) -> None:
        # every batch size's decode step captured before serving (CUDA graphs), not inside the first requests
        capture = getattr(self.runner, "capture_decode_steps", None)
        if capture is not None:
            capture(self.scheduler.batch)
        self.scheduler.start()

    def shutdown(self) -> None:
        self.scheduler.shutdown()

    # ---- weights ------------------------------------------------------------------------------
    def check_weights(self, tensors: Mapping[str, torch.Tensor], *, require_all: bool) -> None:
        """Raise :class:`WeightUpdateError` unless ``tensors`` fit the model (names, shapes)."""
        if self.memory_released & {"weights", "all"}:
            raise WeightUpdateError("weights are released (release_memory_occupation); resume them first")
        known = self.runner.named_tensors()
        unknown = sorted(set(tensors) - set(known))
        if unknown:
            raise WeightUpdateError(f"unknown parameter name(s): {', '.join(unknown[:8])}")
        for name, t in tensors.items():
            if tuple(t.shape) != tuple(known[name].shape):
                raise WeightUpdateError(
                    f"shape mismatch for {name}: got {tuple(t.shape)}, model has {tuple(known[name].shape)}"
                )
            if t.is_floating_point() != known[name].is_floating_point():
                raise WeightUpdateError(f"dtype mismatch for {name}: got {t.dtype}, model has {known[name].dtype}")
        if require_all:
            missing = [n for n, _ in self.runner.named_parameters() if n not in tensors]
            if missing:
                raise WeightUpdateError(f"checkpoint lacks parameter(s): {', '.join(missing[:8])}")

    def apply_weights(
        self,
        tensors: Mapping[str, torch.Tensor],
        *,
        weight_version: str | None,
        flush_cache: bool = True,
        require_all: bool = False,
        method: str,
        model_path: str | None = None,
    ) -> dict[str, float]:
        """Check, then copy ``tensors`` into the model between two steps; set the version. Blocking.

        Returns seconds spent: ``check_s``, ``wait_s`` (until the worker ran the copy), ``copy_s`` (until
        the copies landed on the device: senders may reuse the source memory afterwards), ``version_s``."""
        import time

        start = time.perf_counter()
        self.check_weights(tensors, require_all=require_all)
        checked = {"check_s": time.perf_counter() - start}
        return checked | self.apply_copy(lambda: copy_into(self.runner.named_tensors(), tensors),
                                         weight_version=weight_version, flush_cache=flush_cache, method=method,
                                         model_path=model_path)

    def apply_copy(
        self,
        copy: Callable[[], None],
        *,
        weight_version: str | None,
        flush_cache: bool = True,
        method: str,
        model_path: str | None = None,
    ) -> dict[str, float]:
        """The second half of :meth:`apply_weights`: run ``copy()`` -- writes already checked against this
        model, which must have landed on the device when it returns -- in the worker between two steps,
        then set the version. Returns ``wait_s``, ``copy_s`` and ``version_s``. Blocking."""
        import time

        timings: dict[str, float] = {}
        queued = time.perf_counter()

        def op() -> None:
            began = time.perf_counter()
            timings["wait_s"] = began - queued
            if self.memory_released & {"weights", "all"}:
                raise WeightUpdateError("weights are released (release_memory_occupation); resume them first")
            copy()
            self.weight_writes += 1
            copied = time.perf_counter()
            timings["copy_s"] = copied - began
            if weight_version is not None:
                self.weight_version = str(weight_version)
            if model_path is not None:
                self.model_path = model_path
            if flush_cache:
                self.prefix_cache.clear()
            self.metrics.weight_updates.labels(method=method).inc()
            timings["version_s"] = time.perf_counter() - copied

        with self._update_lock:
            self.scheduler.call(op).result()
        return timings

    def keep_buffers(self, owner: str, keyed: Mapping[str, torch.Tensor], *, drop: bool = False) -> None:
        """Hold ``owner``'s CUDA buffers by key (replacing those of the same key); ``drop``: let go of all.

        Only the latest owner's are held: a sender that was replaced without closing must not keep its
        staging memory pinned here for good."""
        if drop:
            self.kept_buffers.pop(owner, None)
        cuda = {k: t for k, t in keyed.items() if t.device.type == "cuda"}
        if cuda:
            if owner not in self.kept_buffers:
                self.kept_buffers.clear()
            self.kept_buffers.setdefault(owner, {}).update(cuda)

    def apply_delta(self, payload: bytes, *, weight_version: str | None) -> str:
        """Apply an ``agentrl.engine.delta`` payload in the worker thread; return the new version."""
        from agentrl.engine import delta

        if self.memory_released & {"weights", "all"}:
            raise WeightUpdateError("weights are released (release_memory_occupation); resume them first")

        def op() -> str:
            header = delta.apply_delta(self.runner.named_tensors(), payload, base_version=self.weight_version)
            self.weight_writes += 1
            self.weight_version = str(weight_version if weight_version is not None else header.new_version)
            self.prefix_cache.clear()
            self.metrics.weight_updates.labels(method="delta").inc()
            return self.weight_version

        with self._update_lock:
            return self.scheduler.call(op).result()

    def set_weight_version(self, version: str) -> None:
        def op() -> None:
            self.weight_version = str(version)

        self.scheduler.call(op).result()

    def flush_cache(self) -> None:
        self.scheduler.call(self.prefix_cache.clear).result()

    def checksum(self) -> dict[str, Any]:
        from agentrl.engine.weight_loading import weights_checksum

        def op() -> dict[str, Any]:
            result = weights_checksum(self.runner.named_parameters())
            result["weight_version"] = self.weight_version
            return result

        return self.scheduler.call(op).result()

    # ---- memory occupation --------------------------------------------------------------------
    def release_memory(self, tags: list[str] | None) -> None:
        from agentrl.engine.memory import release

        def op() -> None:
            release(self, set(tags or ["weights", "kv_cache"]))
            if self.runner.static_kv and self.memory_released & {"kv_cache", "cuda_graph"}:
                # the static decode buffers are KV memory, the captured steps graph memory (nothing in flight)
                if "kv_cache" in self.memory_released:
                    self.scheduler.batch = self.runner.empty_batch()
                self.runner.release_static()
            elif self.decoder is not None and "kv_cache" in self.memory_released:
                self.scheduler.batch = self.decoder.empty_batch()  # no rows run now: drop the slot buffers

        self.scheduler.call(op).result()

    def resume_memory(self, tags: list[str] | None) -> None:
        from agentrl.engine.memory import resume

        def op() -> None:
            resume(self, set(tags or ["weights", "kv_cache"]))

        self.scheduler.call(op).result()


def copy_into(known: Mapping[str, torch.Tensor], tensors: Mapping[str, torch.Tensor]) -> None:
    """Copy each of ``tensors`` into ``known[name]`` (bitwise when dtypes match): one fused
    ``_foreach_copy_`` per (device, dtype) group instead of a kernel launch per tensor, then wait for
    the device, so the sources may be reused once this returns."""
    import torch

    groups: dict[tuple[Any, Any], tuple[list[torch.Tensor], list[torch.Tensor]]] = {}
    devices = set()
    with torch.no_grad():
        for name, src in tensors.items():
            dst = known[name]
            devices.add(dst.device)
            if src.device == dst.device and src.dtype == dst.dtype:
                dsts, srcs = groups.setdefault((dst.device, dst.dtype), ([], []))
                dsts.append(dst)
                srcs.append(src)
            else:
                dst.copy_(src.to(device=dst.device, dtype=dst.dtype))
        for dsts, srcs in groups.values():
            torch._foreach_copy_(dsts, srcs)
    for device in devices:
        if device.type == "cuda":
            torch.cuda.synchronize(device)
