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
from fastapi.responses import JSONResponse

from agentrl.engine.engine import WeightUpdateError
from agentrl.engine.memory import MemoryStateError
from agentrl.engine.protocol import BadRequest

if TYPE_CHECKING:
    from agentrl.engine.engine import Engine


def _fail(error, message: str, status: int = 400):
    resp = error(message, status)
    # SGLang's update endpoints answer {"success": false, "message": ...}; keep both shapes
    import json

    body = json.loads(resp.body)
    body.update({"success": False, "message": message})
    return JSONResponse(body, status_code=status)


def add_weight_routes(app: APIRouter, engine: Engine, *, read_json, error) -> None:
    """Declare the weight and memory routes on ``app`` (the app's secret-guarded control router)."""
    def prepare(body: dict[str, Any]) -> None:
        if body.get("abort_all_requests"):
            engine.scheduler.abort(abort_all=True, message="Abort by weight update")

    @app.post("/update_weights_from_disk")
    async def update_weights_from_disk(request: Request):
        body = await read_json(request)
        model_path = body.get("model_path")
        if not isinstance(model_path, str) or not model_path:
            raise BadRequest("give 'model_path' (a local model directory)")
        if body.get("load_format") not in (None, "auto", "safetensors"):
            raise BadRequest(f"load_format {body['load_format']!r} is not supported; use 'auto'")
        prepare(body)
        from agentrl.engine.weight_loading import read_checkpoint

        try:
            tensors = await asyncio.to_thread(read_checkpoint, model_path)
            await asyncio.to_thread(
                engine.apply_weights,
                tensors,
                weight_version=body.get("weight_version"),
                flush_cache=body.get("flush_cache", True),
                require_all=True,
                method="disk",
                model_path=model_path,
            )
        except (FileNotFoundError, WeightUpdateError, ValueError, OSError) as exc:
            return _fail(error, f"Failed to update weights from disk: {exc}. Rolled back to the old weights.")
        return {"success": True, "message": "Succeeded to update model weights.", "num_paused_requests": 0}

    from agentrl.engine.weight_loading import FlatLayoutCache

    flat_cache = FlatLayoutCache()  # the kept CUDA layout's views and checked copy plan (one sender's)

    def apply_flat(payload: str, body: dict[str, Any]) -> dict[str, float]:
        """A ``flat_buckets`` update, in one worker hop; the engine's timings (see the route)."""
        from agentrl.engine.weight_loading import CopyPlan, deserialize_flat_buckets

        start = time.perf_counter()
        received = deserialize_flat_buckets(payload, flat_cache)
        timings = {"ipc_open_s": time.perf_counter() - start}
        if received.tensors:
            checking = time.perf_counter()
            model = getattr(engine.runner, "model", None)
            cached = flat_cache.get(received.layout) if received.layout is not None else None
            plan = cached.plan if cached is not None and cached.model is model else None
            if plan is None or not plan.still_fits():
                engine.check_weights(received.tensors, require_all=False)
                targets = model.state_dict(keep_vars=True) if model is not None else engine.runner.named_tensors()
                plan = CopyPlan(targets, received.tensors)
            timings["check_s"] = time.perf_counter() - checking
            timings |= engine.apply_copy(plan, weight_version=body.get("weight_version"),
                                         flush_cache=body.get("flush_cache", True), method="tensor")
            kept = received.layout is not None and all(t.device.type == "cuda" for t in received.keyed.values())
            if kept and model is not None:  # only CUDA buckets stay mapped (keep_buffers), so only they are cached
                entry = flat_cache.put(received)
                entry.plan, entry.model = plan, model
        elif body.get("weight_version") is not None:  # an empty flat payload may still set the version
            engine.set_weight_version(body["weight_version"])
        engine.keep_buffers(received.owner, received.keyed, drop=received.drop_kept)
        if flat_cache.owner is not None and flat_cache.owner not in engine.kept_buffers:
            flat_cache.clear()  # the engine let go of that sender's buffers: so does the cache
        return timings

    @app.post("/update_weights_from_tensor")
    async def update_weights_from_tensor(request: Request):
        body = await read_json(request)
        payloads = body.get("serialized_named_tensors")
        if not isinstance(payloads, list) or not payloads or not all(isinstance(p, str) for p in payloads):
            raise BadRequest("give 'serialized_named_tensors': a list with one base64 string per TP rank")
        if len(payloads) != 1:
            raise BadRequest(f"the embedded engine has one TP rank; got {len(payloads)} payloads")
        fmt = body.get("load_format")
        prepare(body)
        from agentrl.engine.weight_loading import FLAT_BUCKETS, deserialize_named_tensors

        try:
            if fmt == FLAT_BUCKETS:
                timings = await asyncio.to_thread(apply_flat, payloads[0], body)
            else:
                start = time.perf_counter()
                tensors = await asyncio.to_thread(deserialize_named_tensors, payloads[0], fmt)
                timings = {"ipc_open_s": time.perf_counter() - start}
                timings |= await asyncio.to_thread(
                    engine.apply_weights,
                    tensors,
                    weight_version=body.get("weight_version"),
                    flush_cache=body.get("flush_cache", True),
                    method="tensor",
                )
        except (WeightUpdateError, ValueError) as exc:
            return _fail(error, f"Failed to update weights from tensor: {exc}")
        # ``timings`` (seconds; agentrl's addition to SGLang's answer): unpickling and opening the handles,
        # checking, waiting for the worker, copying in (until on the device) and setting the version.
        # ``weight_version`` (also agentrl's): the version held once this update is in, so a sender need
        # not ask ``/server_info`` again.
        return {"success": True, "message": "Succeeded to update model weights.",
                "timings": {k: round(v, 6) for k, v in timings.items()}, "weight_version": engine.weight_version}

    @app.post("/init_weights_update_group")
    async def init_weights_update_group(request: Request):
        from agentrl.engine.weight_group import GroupSpec, init_group

        body = await read_json(request)
        try:
            spec = GroupSpec.parse(body, device=engine.runner.device)
        except ValueError as exc:
            raise BadRequest(str(exc)) from None
        try:
            group = await asyncio.to_thread(init_group, spec)
        except Exception as exc:  # rendezvous failures come as RuntimeError/DistError
            return _fail(error, f"Failed to init weights update group: {exc}")
        engine.weight_groups[spec.group_name] = group
        return {"success": True, "message": "Succeeded to initialize custom process group."}

    def group_request(body: dict, spec_type: Any) -> tuple[Any, Any]:
        """The parsed body of a call that joins a group's broadcast, and that open group (400 otherwise)."""
        try:
            spec = spec_type.parse(body)
        except ValueError as exc:
            raise BadRequest(str(exc)) from None
        group = engine.weight_groups.get(spec.group_name)
        if group is None:
            raise BadRequest(f"no weights update group {spec.group_name!r}; call /init_weights_update_group first")
        return spec, group

    @app.post("/update_weights_from_distributed")
    async def update_weights_from_distributed(request: Request):
        from agentrl.engine.weight_group import BroadcastSpec, receive_broadcast

        body = await read_json(request)
        spec, group = group_request(body, BroadcastSpec)
        prepare(body)
        try:
            # check before receiving, so a bad call fails fast instead of in the middle of the broadcast
            engine.check_weights(spec.empty_tensors(), require_all=False)
            tensors = await asyncio.to_thread(receive_broadcast, group, spec, engine.runner.device)
            await asyncio.to_thread(
                engine.apply_weights,
                tensors,
                weight_version=body.get("weight_version"),
                flush_cache=body.get("flush_cache", True),
                method="distributed",
            )
        except (WeightUpdateError, ValueError) as exc:
            return _fail(error, f"Failed to update weights from distributed: {exc}")
        except RuntimeError as exc:
            return _fail(error, f"Broadcast failed: {exc}", 500)
        return {"success": True, "message": "Succeeded to update parameter online from distributed."}

    @app.post("/destroy_weights_update_group")
    async def destroy_weights_update_group(request: Request):
        from agentrl.engine.weight_group import destroy_group

        body = await read_json(request, optional=True)
        name = body.get("group_name", "weight_update_group")
        group = engine.weight_groups.pop(name, None)
        if group is None:
            raise BadRequest(f"no weights update group {name!r}")
        await asyncio.to_thread(destroy_group, group)
        return {"success": True, "message": "Succeeded to destroy custom process group."}

    def out_of_order(base: Any):
        """A 409 answer when the delta's base is not the engine's version, else ``None``."""
        if base is not None and str(base) != engine.weight_version:
            return _fail(
                error,
                f"out-of-order delta: based on version {base!r}, the engine holds {engine.weight_version!r}",
                409,
            )
        return None

    async def apply_delta_payload(body: dict[str, Any], payload: bytes):
        import agentrl.engine.delta as delta

        prepare(body)
        try:
            version = await asyncio.to_thread(engine.apply_delta, payload, weight_version=body.get("weight_version"))
        except WeightUpdateError as exc:
            return _fail(error, str(exc))
        except ValueError as exc:
            status = 409 if isinstance(exc, delta.DeltaVersionError) else 400
            return _fail(error, f"delta rejected, old weights kept: {exc}", status)
        return {"success": True, "message": "Succeeded to apply the weight delta.", "weight_version": version}

    @app.post("/update_weights_from_delta")
    async def update_weights_from_delta(request: Request):
        body = await read_json(request)
        path = body.get("path")
        if not isinstance(path, str) or not path:
            raise BadRequest("give 'path' (a delta file readable by the engine)")
        rejected = out_of_order(body.get("base_version"))
        if rejected is not None:
            return rejected
        try:
            payload = await asyncio.to_thread(_read_bytes, path)
        except OSError as exc:
            raise BadRequest(f"cannot read delta file {path!r}: {exc}") from None
        return await apply_delta_payload(body, payload)

    @app.post("/update_weights_from_delta_distributed")
    async def update_weights_from_delta_distributed(request: Request):
        from agentrl.engine.weight_group import PayloadSpec, receive_bytes

        body = await read_json(request)
        spec, group = group_request(body, PayloadSpec)
        # Receive before judging the payload: rank 0 is already broadcasting, and an engine that left
        # the collective would stall it (and every other engine) until the group timeout.
        try:
            payload = await asyncio.to_thread(receive_bytes, group, spec, engine.runner.device)
        except RuntimeError as exc:
            return _fail(error, f"Broadcast failed: {exc}", 500)
        rejected = out_of_order(body.get("base_version"))
        if rejected is not None:
            return rejected
        return await apply_delta_payload(body, payload)

    @app.post("/release_memory_occupation")
    async def release_memory_occupation(request: Request):
        body = await read_json(request, optional=True)
        try:
            await asyncio.to_thread(engine.release_memory, _tags(body))
        except MemoryStateError as exc:
            return _fail(error, str(exc))
        return {"success": True, "message": "Memory released."}

    @app.post("/resume_memory_occupation")
    async def resume_memory_occupation(request: Request):
        body = await read_json(request, optional=True)
        try:
            await asyncio.to_thread(engine.resume_memory, _tags(body))
        except MemoryStateError as exc:
            return _fail(error, str(exc))
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
