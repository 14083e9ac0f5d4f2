"""FastAPI app speaking SGLang's native HTTP API (0.5.23) over an :class:`~agentrl.engine.engine.Engine`.

Errors are ``{"error": {"message": ...}}`` with a 4xx status (400 bad input, 401 no or wrong secret,
409 out-of-order weights, 501 unsupported, 503 memory released); the engine keeps serving after any of them.

Weight-update and control routes (everything that changes weights, memory, pausing, the cache or other
clients' requests) require ``Authorization: Bearer <secret>`` (:mod:`agentrl.engine.auth`); without a
configured secret they refuse every call. Generation, scoring (``/token_logprobs``), health and information
routes stay open (none changes the engine): the router, rollout clients and a distillation teacher use them.

Streaming (``"stream": true``): Server-Sent Events ``data: {...}\\n\\n`` per generated token, each chunk
cumulative (full text, output_ids and log-probs so far, as SGLang without incremental streaming), then
``data: [DONE]\\n\\n``.
"""

from __future__ import annotations

import asyncio
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING, Any

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response

from agentrl.engine.generation import FastGenerate, Generation, attach, wait_done
from agentrl.engine.http_common import SecretGuard, error_response, read_json
from agentrl.engine.protocol import BadRequest, SamplingParams
from agentrl.engine.scheduler import Sequence

if TYPE_CHECKING:
    from agentrl.engine.engine import Engine

VERSION = "0.5.23-agentrl"


def create_app(engine: Engine, *, secret: str | None = None) -> FastAPI:
    """Build the app; ``engine`` is started/stopped with the app's lifespan. ``secret``: what control
    routes require as a bearer token (``None``: they refuse every call)."""
    from agentrl.engine.score_routes import ScoreRoutes
    from agentrl.engine.weight_routes import WeightRoutes

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        engine.start()
        try:
            yield
        finally:
            engine.shutdown()

    app = FastAPI(title="agentrl embedded engine", lifespan=lifespan)
    app.state.engine = engine

    async def on_bad_request(_: Request, exc: BadRequest) -> JSONResponse:
        return error_response(engine, str(exc), exc.status)

    app.add_exception_handler(BadRequest, on_bad_request)
    generation = Generation(engine)
    app.add_middleware(FastGenerate, handler=generation.generate_fast, on_bad_request=generation.bad_request)
    app.include_router(generation.router())
    app.include_router(InfoRoutes(engine).router())
    app.include_router(ScoreRoutes(engine).router())
    guarded = [Depends(SecretGuard(secret))]
    app.include_router(ControlRoutes(engine).router(), dependencies=guarded)
    app.include_router(WeightRoutes(engine).router(), dependencies=guarded)
    return app


class InfoRoutes:
    """Health and information routes (open: the router and rollout clients use them)."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine

    def router(self) -> APIRouter:
        router = APIRouter()
        for path, handler in [("/health", self.health), ("/health_generate", self.health_generate),
                              ("/model_info", self.model_info), ("/get_model_info", self.model_info),
                              ("/server_info", self.server_info), ("/get_server_info", self.server_info),
                              ("/get_load", self.get_load), ("/metrics", self.metrics),
                              ("/get_weight_version", self.get_weight_version),
                              ("/weights_checksum", self.weights_checksum)]:
            router.add_api_route(path, handler, methods=["GET"])
        return router

    async def health(self):
        return Response(status_code=200)

    async def health_generate(self):
        """One greedy token through the scheduler (a paused or memory-released engine is alive on purpose;
        SGLang would stall here)."""
        engine = self.engine
        if engine.scheduler.paused or engine.memory_released:
            return Response(status_code=200)
        seq = Sequence(prompt_ids=[0], params=SamplingParams(max_new_tokens=1, temperature=0.0))
        event = attach(seq, asyncio.get_running_loop())
        engine.scheduler.submit(seq)
        try:
            await asyncio.wait_for(wait_done(seq, event), timeout=30)
        except TimeoutError:
            engine.scheduler.abort(seq.rid)
            return error_response(engine, "health_generate timed out", 503)
        return Response(status_code=200)

    async def model_info(self) -> dict[str, Any]:
        engine = self.engine
        config = engine.runner.model.config
        return {
            "model_path": engine.model_path,
            "tokenizer_path": engine.model_path,
            "is_generation": True,
            "preferred_sampling_params": None,
            "weight_version": engine.weight_version,
            "has_image_understanding": False,
            "has_audio_understanding": False,
            "model_type": getattr(config, "model_type", None),
            "architectures": getattr(config, "architectures", None),
        }

    async def server_info(self) -> dict[str, Any]:
        import torch

        engine = self.engine
        cfg, runner = engine.config, engine.runner
        return {
            "model_path": engine.model_path,
            "tokenizer_path": engine.model_path,
            "served_model_name": engine.model_path,
            "host": cfg.host,
            "port": cfg.port,
            "dtype": cfg.dtype,
            "device": str(runner.device),
            "cpu_threads": torch.get_num_threads(),
            "tp_size": 1,
            "dp_size": 1,
            "pp_size": 1,
            "context_length": runner.context_length,
            "max_running_requests": cfg.max_batch_size,
            "max_total_num_tokens": cfg.prefix_cache_tokens,
            "max_req_input_len": runner.context_length - 1,
            "is_embedding": False,
            "skip_tokenizer_init": False,
            "weight_version": engine.weight_version,
            "internal_states": [self.internal_state()],
            "version": VERSION,
            "engine": "agentrl-embedded",
        }

    def internal_state(self) -> dict[str, Any]:
        engine = self.engine
        step = engine.scheduler.last_step_time
        return {
            "weight_version": engine.weight_version,
            "last_gen_throughput": len(engine.scheduler.running) / step if step > 0 else 0.0,
            "paused": engine.scheduler.paused,
            "memory_released": sorted(engine.memory_released),
            **engine.scheduler.load(),
            # counters of the worker's time and events since start (Scheduler.stats): benchmarks difference them
            "step_stats": engine.scheduler.stats(),
        }

    async def get_load(self) -> list[dict[str, Any]]:
        return [{"dp_rank": 0, **self.engine.scheduler.load()}]

    async def metrics(self):
        engine = self.engine
        load = engine.scheduler.load()
        engine.metrics.running.set(load["num_running_reqs"])
        engine.metrics.waiting.set(load["num_waiting_reqs"])
        data, content_type = engine.metrics.render()
        return Response(data, media_type=content_type)

    async def get_weight_version(self) -> dict[str, Any]:
        return {"weight_version": self.engine.weight_version}

    async def weights_checksum(self):
        if self.engine.memory_released & {"weights"}:
            return error_response(self.engine, "weights are released; call /resume_memory_occupation", 503)
        return await asyncio.to_thread(self.engine.checksum)


class ControlRoutes:
    """Cache, abort, pause and version routes (behind the secret, which :func:`create_app` adds)."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine

    def router(self) -> APIRouter:
        router = APIRouter()
        router.add_api_route("/flush_cache", self.flush_cache, methods=["GET", "POST"])
        for path, handler in [("/abort_request", self.abort_request), ("/pause_generation", self.pause_generation),
                              ("/continue_generation", self.continue_generation),
                              ("/update_weight_version", self.update_weight_version)]:
            router.add_api_route(path, handler, methods=["POST"])
        return router

    async def flush_cache(self):
        await asyncio.to_thread(self.engine.flush_cache)
        return Response("Cache flushed.\n", status_code=200)

    async def abort_request(self, request: Request) -> dict[str, Any]:
        body = await read_json(request)
        rid, abort_all = body.get("rid"), bool(body.get("abort_all", False))
        if not abort_all and not (isinstance(rid, str) and rid):
            raise BadRequest("give 'rid' (a string) or 'abort_all': true")
        n = self.engine.scheduler.abort(rid, abort_all=abort_all)
        return {"success": True, "num_aborted": n}

    async def pause_generation(self, request: Request) -> dict[str, Any]:
        body = await read_json(request, optional=True)
        mode = body.get("mode", "abort")
        if mode not in ("abort", "in_place", "retract"):
            raise BadRequest(f"unknown pause mode {mode!r}; use 'abort', 'in_place' or 'retract'")
        await asyncio.to_thread(self.engine.scheduler.pause, mode)
        return {"success": True, "message": f"Generation paused ({mode})."}

    async def continue_generation(self) -> dict[str, Any]:
        await asyncio.to_thread(self.engine.scheduler.resume)
        return {"success": True, "message": "Generation continued."}

    async def update_weight_version(self, request: Request) -> dict[str, Any]:
        body = await read_json(request)
        version = body.get("new_version", body.get("weight_version"))
        if not isinstance(version, str | int) or isinstance(version, bool) or version == "":
            raise BadRequest("give 'new_version' (a non-empty string)")
        if body.get("abort_all_requests", True):  # SGLang's UpdateWeightVersionReqInput default
            self.engine.scheduler.abort(abort_all=True, message="Abort by update_weight_version")
        await asyncio.to_thread(self.engine.set_weight_version, str(version))
        return {"success": True, "message": "Weight version updated.", "new_version": str(version)}
