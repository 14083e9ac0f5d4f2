"""FastAPI app speaking SGLang's native HTTP API (0.5.23) over an :class:`~agentrl.engine.engine.Engine`.

Errors are ``{"error": {"message": ...}}`` with a 4xx status (400 bad input, 401 no or wrong secret,
409 out-of-order weights, 501 unsupported, 503 memory released); the engine keeps serving after any of them.

Weight-update and control routes (everything that changes weights, memory, pausing, the cache or other
clients' requests) require ``Authorization: Bearer <secret>`` (:mod:`agentrl.engine.auth`); without a
configured secret they refuse every call. Generation, health and information routes stay open: the
router and rollout clients use them.

Streaming (``"stream": true``): Server-Sent Events ``data: {...}\\n\\n`` per generated token, each chunk
cumulative (full text, output_ids and log-probs so far, as SGLang without incremental streaming), then
``data: [DONE]\\n\\n``.
"""

from __future__ import annotations

import asyncio
import json
import time
from typing import TYPE_CHECKING, Annotated, Any

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

from agentrl.engine.auth import SECRET_ENV, secret_matches
from agentrl.engine.protocol import BadRequest, GenerateRequest, SamplingParams
from agentrl.engine.scheduler import Sequence

if TYPE_CHECKING:
    from agentrl.engine.engine import Engine

VERSION = "0.5.23-agentrl"

# Module level: the app's closures are annotated as strings (PEP 563), which FastAPI resolves here.
BearerToken = Annotated[HTTPAuthorizationCredentials | None, Depends(HTTPBearer(auto_error=False))]


def create_app(engine: Engine, *, secret: str | None = None) -> FastAPI:
    """Build the app; ``engine`` is started/stopped with the app's lifespan. ``secret``: what control
    routes require as a bearer token (``None``: they refuse every call)."""
    from contextlib import asynccontextmanager

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        engine.start()
        try:
            yield
        finally:
            engine.shutdown()

    app = FastAPI(title="agentrl embedded engine", lifespan=lifespan)
    app.state.engine = engine

    def error(message: str, status: int = 400) -> JSONResponse:
        if 400 <= status < 500:
            engine.metrics.bad_requests.inc()
        headers = {"WWW-Authenticate": "Bearer"} if status == 401 else None
        return JSONResponse({"error": {"message": message, "code": status}}, status_code=status, headers=headers)

    async def require_secret(credentials: BearerToken) -> None:
        if secret is None:
            raise BadRequest(f"control routes are disabled: this engine was started without a secret "
                             f"(set {SECRET_ENV})", 401)
        if credentials is None or not secret_matches(credentials.credentials, secret):
            raise BadRequest("this route needs the run's secret as 'Authorization: Bearer <secret>'", 401)

    control = APIRouter(dependencies=[Depends(require_secret)])

    @app.exception_handler(BadRequest)
    async def _bad_request(_: Request, exc: BadRequest) -> JSONResponse:
        return error(str(exc), exc.status)

    async def read_json(request: Request, *, optional: bool = False) -> Any:
        raw = await request.body()
        if not raw.strip():
            if optional:
                return {}
            raise BadRequest("empty request body: a JSON object is required")
        try:
            body = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise BadRequest(f"malformed JSON body: {exc}") from None
        if not isinstance(body, dict) and not optional:
            raise BadRequest("the request body must be a JSON object")
        return body if isinstance(body, dict) else {}

    def run_blocking(fn, *args, **kwargs):
        return asyncio.to_thread(fn, *args, **kwargs)

    # ---- generation ---------------------------------------------------------------------------
    def build_sequences(req: GenerateRequest) -> list[Sequence]:
        runner = engine.runner
        seqs = []
        for i, (prompt, sp) in enumerate(zip(req.prompts, req.sampling, strict=False)):
            ids = runner.tokenizer(prompt).input_ids if isinstance(prompt, str) else prompt
            if not ids:
                raise BadRequest("empty prompt: the text tokenizes to no tokens")
            bad = [t for t in ids if not 0 <= t < runner.vocab_size]
            if bad:
                raise BadRequest(f"token id(s) out of vocabulary [0, {runner.vocab_size}): {bad[:8]}")
            if len(ids) >= runner.context_length:
                raise BadRequest(
                    f"the input ({len(ids)} tokens) is longer than the model's context length "
                    f"({runner.context_length} tokens)"
                )
            room = runner.context_length - len(ids)
            if sp.max_new_tokens > room:  # SGLang clamps rather than refuses
                sp = SamplingParams(**{**sp.__dict__, "max_new_tokens": room})
            for j in range(sp.n):
                rid = req.rids[i]
                if rid is not None and sp.n > 1:
                    rid = f"{rid}-{j}"
                seq = Sequence(prompt_ids=list(ids), params=sp, stream=req.stream)
                if rid is not None:
                    seq.rid = rid
                if sp.sampling_seed is not None:
                    import torch

                    seq.generator = torch.Generator(device=runner.device).manual_seed(sp.sampling_seed + j)
                seqs.append(seq)
        return seqs

    def result(seq: Sequence, return_logprob: bool, upto: int | None = None) -> dict[str, Any]:
        """The answer as it stands (``upto``: as it stood after that many tokens, not finished yet)."""
        n = min(len(seq.output_ids), len(seq.output_logprobs)) if upto is None else upto
        output_ids = seq.output_ids[:n]
        reason = seq.finish_reason if upto is None else None
        text_ids = output_ids
        if reason and reason.get("type") == "stop" and isinstance(reason.get("matched"), int) and not seq.params.no_stop_trim:
            text_ids = output_ids[:-1]
        text = engine.runner.tokenizer.decode(text_ids, skip_special_tokens=seq.params.skip_special_tokens)
        if reason and isinstance(reason.get("matched"), str) and not seq.params.no_stop_trim:
            cut = text.find(reason["matched"])
            if cut >= 0:
                text = text[:cut]
        meta: dict[str, Any] = {
            "id": seq.rid,
            "finish_reason": reason,
            "prompt_tokens": len(seq.prompt_ids),
            "completion_tokens": n,
            "cached_tokens": seq.cached_tokens,
            "weight_version": seq.weight_version,
            "e2e_latency": time.monotonic() - seq.created,
        }
        if return_logprob:
            meta["output_token_logprobs"] = [[lp, tok, None] for lp, tok in zip(seq.output_logprobs[:n], output_ids, strict=False)]
        return {"text": text, "output_ids": output_ids, "meta_info": meta}

    def attach(seq: Sequence, loop: asyncio.AbstractEventLoop) -> asyncio.Event:
        event = asyncio.Event()
        seq.loop, seq.notify = loop, event.set
        return event

    async def wait_finished(seqs: list[Sequence], events: list[asyncio.Event], request: Request) -> None:
        pending = {asyncio.ensure_future(_wait_done(s, e)) for s, e in zip(seqs, events, strict=False)}
        try:
            while pending:
                done, pending = await asyncio.wait(pending, timeout=1.0)
                if pending and await request.is_disconnected():
                    for s in seqs:
                        if not s.finished:
                            engine.scheduler.abort(s.rid, message="client disconnected")
        finally:
            for task in pending:
                task.cancel()

    def submit(req: GenerateRequest) -> tuple[list[Sequence], list[asyncio.Event]]:
        seqs = build_sequences(req)
        loop = asyncio.get_running_loop()
        events = [attach(s, loop) for s in seqs]
        for s in seqs:
            engine.metrics.requests.inc()
            engine.scheduler.submit(s)
        return seqs, events

    def answer(req: GenerateRequest, seqs: list[Sequence]) -> Any:
        results = [result(s, req.return_logprob) for s in seqs]
        return results if (req.batched or len(results) > 1) else results[0]

    @app.post("/generate")
    async def generate(request: Request):
        body = await read_json(request)
        req = GenerateRequest.parse(body)
        if engine.memory_released:
            return error(f"memory released ({sorted(engine.memory_released)}); call /resume_memory_occupation", 503)
        seqs, events = submit(req)
        if req.stream:
            return StreamingResponse(stream(seqs[0], events[0], req.return_logprob), media_type="text/event-stream")
        await wait_finished(seqs, events, request)
        # Already JSON types: a JSONResponse skips FastAPI's jsonable_encoder walk (~0.1-0.2 ms per answer).
        return JSONResponse(answer(req, seqs))

    async def generate_fast(body: bytes, disconnected: asyncio.Future) -> tuple[int, Any] | None:
        """``/generate`` without FastAPI's request machinery (:class:`FastGenerate`): (status, JSON body),
        or None for a streaming request, which the route above serves."""
        if not body.strip():
            raise BadRequest("empty request body: a JSON object is required")
        try:
            parsed = json.loads(body)
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise BadRequest(f"malformed JSON body: {exc}") from None
        if not isinstance(parsed, dict):
            raise BadRequest("the request body must be a JSON object")
        req = GenerateRequest.parse(parsed)
        if req.stream:
            return None
        if engine.memory_released:
            message = f"memory released ({sorted(engine.memory_released)}); call /resume_memory_occupation"
            engine.metrics.bad_requests.inc()
            return 503, {"error": {"message": message, "code": 503}}
        seqs, events = submit(req)
        waiting = asyncio.ensure_future(asyncio.gather(*(_wait_done(s, e) for s, e in zip(seqs, events, strict=True))))
        try:
            await asyncio.wait([waiting, disconnected], return_when=asyncio.FIRST_COMPLETED)
            if not waiting.done():  # the client went away: its sequences stop; answer nobody
                for s in seqs:
                    if not s.finished:
                        engine.scheduler.abort(s.rid, message="client disconnected")
                await waiting
        finally:
            waiting.cancel()
        return 200, answer(req, seqs)

    def bad_request(exc: BadRequest) -> tuple[int, Any]:
        if 400 <= exc.status < 500:
            engine.metrics.bad_requests.inc()
        return exc.status, {"error": {"message": str(exc), "code": exc.status}}

    app.add_middleware(FastGenerate, handler=generate_fast, on_bad_request=bad_request)

    async def stream(seq: Sequence, event: asyncio.Event, return_logprob: bool):
        sent = 0
        try:
            while True:
                await event.wait()
                event.clear()
                finished = seq.finished
                total = min(len(seq.output_ids), len(seq.output_logprobs))
                # one chunk per token, also when several landed before this coroutine ran
                for upto in range(sent + 1, total):
                    yield f"data: {json.dumps(result(seq, return_logprob, upto))}\n\n"
                if total > sent or finished:
                    yield f"data: {json.dumps(result(seq, return_logprob, None if finished else total))}\n\n"
                    sent = total
                if finished:
                    break
            yield "data: [DONE]\n\n"
        finally:
            if not seq.finished:
                engine.scheduler.abort(seq.rid, message="client disconnected")

    # ---- health and info ----------------------------------------------------------------------
    @app.get("/health")
    async def health():
        return Response(status_code=200)

    @app.get("/health_generate")
    async def health_generate():
        # a paused (or memory-released) engine is alive on purpose; SGLang would stall here
        if engine.scheduler.paused or engine.memory_released:
            return Response(status_code=200)
        seq = Sequence(prompt_ids=[0], params=SamplingParams(max_new_tokens=1, temperature=0.0))
        event = attach(seq, asyncio.get_running_loop())
        engine.scheduler.submit(seq)
        try:
            await asyncio.wait_for(_wait_done(seq, event), timeout=30)
        except TimeoutError:
            engine.scheduler.abort(seq.rid)
            return error("health_generate timed out", 503)
        return Response(status_code=200)

    def model_info() -> dict[str, Any]:
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

    @app.get("/model_info")
    @app.get("/get_model_info")
    async def get_model_info():
        return model_info()

    @app.get("/server_info")
    @app.get("/get_server_info")
    async def server_info():
        import torch

        cfg = engine.config
        runner = engine.runner
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
            "internal_states": [
                {
                    "weight_version": engine.weight_version,
                    "last_gen_throughput": _throughput(engine),
                    "paused": engine.scheduler.paused,
                    "memory_released": sorted(engine.memory_released),
                    **engine.scheduler.load(),
                }
            ],
            "version": VERSION,
            "engine": "agentrl-embedded",
        }

    @app.get("/get_load")
    async def get_load():
        return [{"dp_rank": 0, **engine.scheduler.load()}]

    @app.get("/metrics")
    async def metrics():
        load = engine.scheduler.load()
        engine.metrics.running.set(load["num_running_reqs"])
        engine.metrics.waiting.set(load["num_waiting_reqs"])
        data, content_type = engine.metrics.render()
        return Response(data, media_type=content_type)

    @app.get("/get_weight_version")
    async def get_weight_version():
        return {"weight_version": engine.weight_version}

    @app.get("/weights_checksum")
    async def weights_checksum():
        if engine.memory_released & {"weights"}:
            return error("weights are released; call /resume_memory_occupation", 503)
        return await run_blocking(engine.checksum)

    # ---- control ------------------------------------------------------------------------------
    @control.api_route("/flush_cache", methods=["GET", "POST"])
    async def flush_cache():
        await run_blocking(engine.flush_cache)
        return Response("Cache flushed.\n", status_code=200)

    @control.post("/abort_request")
    async def abort_request(request: Request):
        body = await read_json(request)
        rid, abort_all = body.get("rid"), bool(body.get("abort_all", False))
        if not abort_all and not (isinstance(rid, str) and rid):
            raise BadRequest("give 'rid' (a string) or 'abort_all': true")
        n = engine.scheduler.abort(rid, abort_all=abort_all)
        return {"success": True, "num_aborted": n}

    @control.post("/pause_generation")
    async def pause_generation(request: Request):
        body = await read_json(request, optional=True)
        mode = body.get("mode", "abort")
        if mode not in ("abort", "in_place", "retract"):
            raise BadRequest(f"unknown pause mode {mode!r}; use 'abort', 'in_place' or 'retract'")
        await run_blocking(engine.scheduler.pause, mode)
        return {"success": True, "message": f"Generation paused ({mode})."}

    @control.post("/continue_generation")
    async def continue_generation(request: Request):
        await run_blocking(engine.scheduler.resume)
        return {"success": True, "message": "Generation continued."}

    @control.post("/update_weight_version")
    async def update_weight_version(request: Request):
        body = await read_json(request)
        version = body.get("new_version", body.get("weight_version"))
        if not isinstance(version, str | int) or isinstance(version, bool) or version == "":
            raise BadRequest("give 'new_version' (a non-empty string)")
        if body.get("abort_all_requests", True):  # SGLang's UpdateWeightVersionReqInput default
            engine.scheduler.abort(abort_all=True, message="Abort by update_weight_version")
        await run_blocking(engine.set_weight_version, str(version))
        return {"success": True, "message": "Weight version updated.", "new_version": str(version)}

    from agentrl.engine.weight_routes import add_weight_routes

    add_weight_routes(control, engine, read_json=read_json, error=error)
    app.include_router(control)  # after every control route is declared: include_router copies them
    return app


class FastGenerate:
    """ASGI middleware serving ``POST /generate`` itself: the body read whole, ``handler`` awaited, the JSON
    answer sent; FastAPI's routing, request object and response classes are skipped (they cost the engine
    as much CPU per one-token request as the model did). A client that disconnects aborts its sequences, as
    the route does. A streaming request is handed to the app with its body replayed."""

    def __init__(self, app: Any, handler: Any, on_bad_request: Any) -> None:
        self.app, self.handler, self.on_bad_request = app, handler, on_bad_request

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or scope["path"] != "/generate" or scope["method"] != "POST":
            await self.app(scope, receive, send)
            return
        chunks, more = [], True
        while more:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            chunks.append(message.get("body", b""))
            more = message.get("more_body", False)
        body = b"".join(chunks)
        loop = asyncio.get_running_loop()
        disconnected = loop.create_future()

        async def watch() -> None:
            while (await receive())["type"] != "http.disconnect":
                pass
            if not disconnected.done():
                disconnected.set_result(None)

        watcher = asyncio.ensure_future(watch())
        try:
            try:
                answered = await self.handler(body, disconnected)
            except BadRequest as exc:
                answered = self.on_bad_request(exc)
        finally:
            watcher.cancel()
        if answered is None:  # streaming: the app serves it from the same body
            replayed = False

            async def replay() -> dict:
                nonlocal replayed
                if not replayed:
                    replayed = True
                    return {"type": "http.request", "body": body, "more_body": False}
                return await receive()

            await self.app(scope, replay, send)
            return
        status, content = answered
        payload = json.dumps(content, ensure_ascii=False, allow_nan=False, separators=(",", ":")).encode()
        await send({"type": "http.response.start", "status": status,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(payload)).encode())]})
        await send({"type": "http.response.body", "body": payload})


async def _wait_done(seq: Sequence, event: asyncio.Event) -> None:
    while not seq.finished:
        await event.wait()
        event.clear()


def _throughput(engine: Engine) -> float:
    step = engine.scheduler.last_step_time
    return len(engine.scheduler.running) / step if step > 0 else 0.0
