"""Weight-update and memory endpoints (SGLang names and bodies, plus agentrl's delta extension).

All of them set ``weight_version`` when given one and are atomic: the tensors are received and checked
completely before the worker copies them in between two forward passes; any failure answers 4xx and
leaves the old weights and version. Blocking work runs in threads, so the event loop keeps serving
``/health`` and ``/generate`` meanwhile.

Responses are SGLang's ``{"success": bool, "message": str}`` (failures also carry the 4xx status).
"""

from __future__ import annotations

import asyncio
import time
from typing import TYPE_CHECKING, Any

from fastapi import APIRouter, Request

from agentrl.engine.engine import WeightUpdateError
from agentrl.engine.http_common import failure_response, read_json
from agentrl.engine.memory import MemoryStateError
from agentrl.engine.protocol import BadRequest

if TYPE_CHECKING:
    from agentrl.engine.engine import Engine

SUCCEEDED = "Succeeded to update model weights."


class WeightRoutes:
    """The weight and memory handlers of one engine (behind the secret, which the app adds)."""

    def __init__(self, engine: Engine) -> None:
        from agentrl.engine.lora import AdapterMerger
        from agentrl.engine.weight_loading import FlatLayoutCache

        self.engine = engine
        self.flat_cache = FlatLayoutCache()  # the kept CUDA layout's views and checked copy plan (one sender's)
        self.adapters = AdapterMerger()  # LoRA updates: merged from the base copy (agentrl.engine.lora)

    def router(self) -> APIRouter:
        router = APIRouter()
        for handler in [self.update_weights_from_disk, self.update_weights_from_tensor,
                        self.init_weights_update_group, self.update_weights_from_distributed,
                        self.destroy_weights_update_group, self.update_weights_from_delta,
                        self.update_weights_from_delta_distributed, self.release_memory_occupation,
                        self.resume_memory_occupation]:
            router.add_api_route(f"/{handler.__name__}", handler, methods=["POST"])
        return router

    def fail(self, message: str, status: int = 400):
        return failure_response(self.engine, message, status)

    def prepare(self, body: dict[str, Any]) -> None:
        if body.get("abort_all_requests"):
            self.engine.scheduler.abort(abort_all=True, message="Abort by weight update")

    async def apply(self, tensors: dict[str, Any], body: dict[str, Any], method: str, **kwargs: Any) -> dict[str, float]:
        """``tensors`` copied in (in a worker thread) under the body's ``weight_version`` / ``flush_cache``;
        LoRA adapters (:mod:`agentrl.engine.lora`) are merged into dense weights first."""
        from agentrl.engine.lora import is_adapter_update

        adapters = is_adapter_update(tensors)
        if adapters:
            tensors = await asyncio.to_thread(self.adapters.merge, self.engine.runner.named_tensors(), tensors,
                                              self.engine.weight_writes)
            kwargs["require_all"] = False
        timings = await asyncio.to_thread(self.engine.apply_weights, tensors, weight_version=body.get("weight_version"),
                                          flush_cache=body.get("flush_cache", True), method=method, **kwargs)
        if adapters:
            self.adapters.merged_at = self.engine.weight_writes
        else:
            self.adapters.forget()
        return timings

    # ---- full weights -------------------------------------------------------------------------
    async def update_weights_from_disk(self, request: Request):
        """An HF model directory, checked against its checksum manifest; a directory without one only with
        ``"allow_missing_manifest": true`` (its bytes are then loaded unchecked)."""
        from agentrl.engine.weight_loading import read_checkpoint

        body = await read_json(request)
        model_path = body.get("model_path")
        if not isinstance(model_path, str) or not model_path:
            raise BadRequest("give 'model_path' (a local model directory)")
        if body.get("load_format") not in (None, "auto", "safetensors"):
            raise BadRequest(f"load_format {body['load_format']!r} is not supported; use 'auto'")
        unchecked = body.get("allow_missing_manifest", False)
        if not isinstance(unchecked, bool):
            raise BadRequest("'allow_missing_manifest' must be true or false")
        self.prepare(body)
        try:
            tensors = await asyncio.to_thread(read_checkpoint, model_path, require_manifest=not unchecked)
            await self.apply(tensors, body, "disk", require_all=True, model_path=model_path)
        except (FileNotFoundError, WeightUpdateError, ValueError, OSError) as exc:
            return self.fail(f"Failed to update weights from disk: {exc}. Rolled back to the old weights.")
        return {"success": True, "message": SUCCEEDED, "num_paused_requests": 0}

    async def update_weights_from_tensor(self, request: Request):
        """Serialized tensors (or ``flat_buckets``); answers the engine's ``timings`` and new ``weight_version``."""
        from agentrl.engine.weight_loading import FLAT_BUCKETS, deserialize_named_tensors

        body = await read_json(request)
        payloads = body.get("serialized_named_tensors")
        if not isinstance(payloads, list) or not payloads or not all(isinstance(p, str) for p in payloads):
            raise BadRequest("give 'serialized_named_tensors': a list with one base64 string per TP rank")
        if len(payloads) != 1:
            raise BadRequest(f"the embedded engine has one TP rank; got {len(payloads)} payloads")
        fmt = body.get("load_format")
        self.prepare(body)
        try:
            if fmt == FLAT_BUCKETS:
                timings = await asyncio.to_thread(self.apply_flat, payloads[0], body)
            else:
                start = time.perf_counter()
                tensors = await asyncio.to_thread(deserialize_named_tensors, payloads[0], fmt)
                timings = {"ipc_open_s": time.perf_counter() - start}
                timings |= await self.apply(tensors, body, "tensor")
        except (WeightUpdateError, ValueError) as exc:
            return self.fail(f"Failed to update weights from tensor: {exc}")
        # ``timings`` (seconds; agentrl's addition to SGLang's answer): unpickling and opening the handles,
        # checking, waiting for the worker, copying in (until on the device) and setting the version.
        # ``weight_version`` (also agentrl's): the version held once this update is in, so a sender need
        # not ask ``/server_info`` again.
        return {"success": True, "message": SUCCEEDED,
                "timings": {k: round(v, 6) for k, v in timings.items()}, "weight_version": self.engine.weight_version}

    def apply_flat(self, payload: str, body: dict[str, Any]) -> dict[str, float]:
        """A ``flat_buckets`` update, in one worker hop; the engine's timings (see the route)."""
        from agentrl.engine.weight_loading import deserialize_flat_buckets

        engine, flat_cache = self.engine, self.flat_cache
        start = time.perf_counter()
        received = deserialize_flat_buckets(payload, flat_cache)
        timings = {"ipc_open_s": time.perf_counter() - start}
        if received.tensors:
            timings |= self.copy_flat(received, body)
        elif body.get("weight_version") is not None:  # an empty flat payload may still set the version
            engine.set_weight_version(body["weight_version"])
        engine.keep_buffers(received.owner, received.keyed, drop=received.drop_kept)
        if flat_cache.owner is not None and flat_cache.owner not in engine.kept_buffers:
            flat_cache.clear()  # the engine let go of that sender's buffers: so does the cache
        return timings

    def copy_flat(self, received: Any, body: dict[str, Any]) -> dict[str, float]:
        """Copy received flat buckets in, through the cached copy plan when it still fits."""
        from agentrl.engine.weight_loading import CopyPlan

        engine, flat_cache = self.engine, self.flat_cache
        checking = time.perf_counter()
        model = getattr(engine.runner, "model", None)
        cached = flat_cache.get(received.layout) if received.layout is not None else None
        plan = cached.plan if cached is not None and cached.model is model else None
        if plan is None or not plan.still_fits():
            engine.check_weights(received.tensors, require_all=False)
            targets = model.state_dict(keep_vars=True) if model is not None else engine.runner.named_tensors()
            plan = CopyPlan(targets, received.tensors)
        timings = {"check_s": time.perf_counter() - checking}
        timings |= engine.apply_copy(plan, weight_version=body.get("weight_version"),
                                     flush_cache=body.get("flush_cache", True), method="tensor")
        kept = received.layout is not None and all(t.device.type == "cuda" for t in received.keyed.values())
        if kept and model is not None:  # only CUDA buckets stay mapped (keep_buffers), so only they are cached
            entry = flat_cache.put(received)
            entry.plan, entry.model = plan, model
        return timings

    # ---- broadcast groups ---------------------------------------------------------------------
    async def init_weights_update_group(self, request: Request):
        from agentrl.engine.weight_group import GroupSpec, init_group

        body = await read_json(request)
        try:
            spec = GroupSpec.parse(body, device=self.engine.runner.device)
        except ValueError as exc:
            raise BadRequest(str(exc)) from None
        try:
            group = await asyncio.to_thread(init_group, spec)
        except Exception as exc:  # rendezvous failures come as RuntimeError/DistError
            return self.fail(f"Failed to init weights update group: {exc}")
        self.engine.weight_groups[spec.group_name] = group
        return {"success": True, "message": "Succeeded to initialize custom process group."}

    def group_request(self, body: dict, spec_type: Any) -> tuple[Any, Any]:
        """The parsed body of a call that joins a group's broadcast, and that open group (400 otherwise)."""
        try:
            spec = spec_type.parse(body)
        except ValueError as exc:
            raise BadRequest(str(exc)) from None
        group = self.engine.weight_groups.get(spec.group_name)
        if group is None:
            raise BadRequest(f"no weights update group {spec.group_name!r}; call /init_weights_update_group first")
        return spec, group

    async def update_weights_from_distributed(self, request: Request):
        from agentrl.engine.weight_group import BroadcastSpec, receive_broadcast

        body = await read_json(request)
        spec, group = self.group_request(body, BroadcastSpec)
        self.prepare(body)
        try:
            # check before receiving, so a bad call fails fast instead of in the middle of the broadcast
            self.engine.check_weights(spec.empty_tensors(), require_all=False)
            tensors = await asyncio.to_thread(receive_broadcast, group, spec, self.engine.runner.device)
            await self.apply(tensors, body, "distributed")
        except (WeightUpdateError, ValueError) as exc:
            return self.fail(f"Failed to update weights from distributed: {exc}")
        except RuntimeError as exc:
            return self.fail(f"Broadcast failed: {exc}", 500)
        return {"success": True, "message": "Succeeded to update parameter online from distributed."}

    async def destroy_weights_update_group(self, request: Request):
        from agentrl.engine.weight_group import destroy_group

        body = await read_json(request, optional=True)
        name = body.get("group_name", "weight_update_group")
        group = self.engine.weight_groups.pop(name, None)
        if group is None:
            raise BadRequest(f"no weights update group {name!r}")
        await asyncio.to_thread(destroy_group, group)
        return {"success": True, "message": "Succeeded to destroy custom process group."}

    # ---- deltas -------------------------------------------------------------------------------
    def out_of_order(self, base: Any):
        """A 409 answer when the delta's base is not the engine's version, else ``None``."""
        held = self.engine.weight_version
        if base is not None and str(base) != held:
            return self.fail(f"out-of-order delta: based on version {base!r}, the engine holds {held!r}", 409)
        return None

    async def apply_delta_payload(self, body: dict[str, Any], payload: bytes):
        import agentrl.engine.delta as delta

        self.prepare(body)
        try:
            version = await asyncio.to_thread(self.engine.apply_delta, payload, weight_version=body.get("weight_version"))
        except WeightUpdateError as exc:
            return self.fail(str(exc))
        except ValueError as exc:
            status = 409 if isinstance(exc, delta.DeltaVersionError) else 400
            return self.fail(f"delta rejected, old weights kept: {exc}", status)
        return {"success": True, "message": "Succeeded to apply the weight delta.", "weight_version": version}

    async def update_weights_from_delta(self, request: Request):
        body = await read_json(request)
        path = body.get("path")
        if not isinstance(path, str) or not path:
            raise BadRequest("give 'path' (a delta file readable by the engine)")
        rejected = self.out_of_order(body.get("base_version"))
        if rejected is not None:
            return rejected
        try:
            payload = await asyncio.to_thread(_read_bytes, path)
        except OSError as exc:
            raise BadRequest(f"cannot read delta file {path!r}: {exc}") from None
        return await self.apply_delta_payload(body, payload)

    async def update_weights_from_delta_distributed(self, request: Request):
        from agentrl.engine.weight_group import PayloadSpec, receive_bytes

        body = await read_json(request)
        spec, group = self.group_request(body, PayloadSpec)
        # Receive before judging the payload: rank 0 is already broadcasting, and an engine that left
        # the collective would stall it (and every other engine) until the group timeout.
        try:
            payload = await asyncio.to_thread(receive_bytes, group, spec, self.engine.runner.device)
        except RuntimeError as exc:
            return self.fail(f"Broadcast failed: {exc}", 500)
        rejected = self.out_of_order(body.get("base_version"))
        if rejected is not None:
            return rejected
        return await self.apply_delta_payload(body, payload)

    # ---- memory -------------------------------------------------------------------------------
    async def release_memory_occupation(self, request: Request):
        body = await read_json(request, optional=True)
        try:
            await asyncio.to_thread(self.engine.release_memory, _tags(body))
        except MemoryStateError as exc:
            return self.fail(str(exc))
        if "weights" in self.engine.memory_released:  # the LoRA base copy leaves the device with the weights
            await asyncio.to_thread(self.adapters.release)
        return {"success": True, "message": "Memory released."}

    async def resume_memory_occupation(self, request: Request):
        body = await read_json(request, optional=True)
        try:
            await asyncio.to_thread(self.engine.resume_memory, _tags(body))
        except MemoryStateError as exc:
            return self.fail(str(exc))
        if "weights" not in self.engine.memory_released:
            await asyncio.to_thread(self.adapters.resume, self.engine.runner.device)
        return {"success": True, "message": "Memory resumed."}


def _tags(body: dict[str, Any]) -> list[str] | None:
    tags = body.get("tags")
    if tags is None:
        return None
    if not isinstance(tags, list) or not all(isinstance(t, str) for t in tags):
        raise BadRequest("'tags' must be a list of strings")
    return tags


def _read_bytes(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read()
