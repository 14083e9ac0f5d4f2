"""``/generate``: requests turned into scheduler sequences, awaited, and answered (whole or streamed).

:class:`Generation` holds the steps, each a method of its own; :class:`FastGenerate` serves the non-streaming
route below FastAPI (its routing, request object and response classes cost as much CPU per one-token request as
the model did); :meth:`Generation.router` declares the FastAPI route that serves streaming requests.
"""

from __future__ import annotations

import asyncio
import json
import time
from typing import TYPE_CHECKING, Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, StreamingResponse

from agentrl.engine.http_common import error_body, error_response, parse_json_object, read_json
from agentrl.engine.protocol import BadRequest, GenerateRequest, SamplingParams
from agentrl.engine.scheduler import Sequence

if TYPE_CHECKING:
    from agentrl.engine.engine import Engine


class Generation:
    """The generation handlers of one engine."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine

    def router(self) -> APIRouter:
        router = APIRouter()
        router.add_api_route("/generate", self.generate, methods=["POST"])
        return router

    # ---- requests in ---------------------------------------------------------------------------
    def prompt_ids(self, prompt: str | list[int]) -> list[int]:
        """A prompt's token ids, checked against the vocabulary and the context length."""
        runner = self.engine.runner
        ids = runner.tokenizer(prompt).input_ids if isinstance(prompt, str) else prompt
        if not ids:
            raise BadRequest("empty prompt: the text tokenizes to no tokens")
        bad = [t for t in ids if not 0 <= t < runner.vocab_size]
        if bad:
            raise BadRequest(f"token id(s) out of vocabulary [0, {runner.vocab_size}): {bad[:8]}")
        if len(ids) >= runner.context_length:
            raise BadRequest(f"the input ({len(ids)} tokens) is longer than the model's context length "
                             f"({runner.context_length} tokens)")
        return list(ids)

    def build_sequences(self, req: GenerateRequest) -> list[Sequence]:
        """One sequence per prompt and sample (``n``); ``max_new_tokens`` clamped to the room left, as SGLang."""
        runner = self.engine.runner
        if req.return_routed_experts and not getattr(runner, "moe_layers", 0):
            raise BadRequest("return_routed_experts needs a mixture-of-experts model; this one is dense")
        seqs = []
        for i, (prompt, sp) in enumerate(zip(req.prompts, req.sampling, strict=False)):
            ids = self.prompt_ids(prompt)
            room = runner.context_length - len(ids)
            if sp.max_new_tokens > room:  # SGLang clamps rather than refuses
                sp = SamplingParams(**{**sp.__dict__, "max_new_tokens": room})
            for j in range(sp.n):
                rid = req.rids[i]
                if rid is not None and sp.n > 1:
                    rid = f"{rid}-{j}"
                seq = Sequence(prompt_ids=list(ids), params=sp, stream=req.stream,
                               routed_experts=[] if req.return_routed_experts else None)
                if rid is not None:
                    seq.rid = rid
                if sp.sampling_seed is not None:
                    import torch

                    seq.generator = torch.Generator(device=runner.device).manual_seed(sp.sampling_seed + j)
                seqs.append(seq)
        return seqs

    def submit(self, req: GenerateRequest) -> tuple[list[Sequence], list[asyncio.Event]]:
        """Queue the request's sequences; each gets an event the scheduler sets as it makes progress."""
        seqs = self.build_sequences(req)
        loop = asyncio.get_running_loop()
        events = [attach(s, loop) for s in seqs]
        for s in seqs:
            self.engine.metrics.requests.inc()
            self.engine.scheduler.submit(s)
        return seqs, events

    def memory_released_message(self) -> str | None:
        released = self.engine.memory_released
        return f"memory released ({sorted(released)}); call /resume_memory_occupation" if released else None

    # ---- answers out ---------------------------------------------------------------------------
    def result(self, seq: Sequence, return_logprob: bool, upto: int | None = None) -> dict[str, Any]:
        """The answer as it stands (``upto``: as it stood after that many tokens, not finished yet)."""
        n = min(len(seq.output_ids), len(seq.output_logprobs)) if upto is None else upto
        output_ids = seq.output_ids[:n]
        reason = seq.finish_reason if upto is None else None
        meta: dict[str, Any] = {
            "id": seq.rid,
            "finish_reason": reason,
            "prompt_tokens": len(seq.prompt_ids),
            "completion_tokens": n,
            "cached_tokens": seq.cached_tokens,
            "weight_version": seq.weight_version,
            # the version each output token was drawn under: [first index, version] per run of one version
            "weight_version_spans": [span for span in seq.version_spans if span[0] < n] or [[0, seq.weight_version]],
            "e2e_latency": time.monotonic() - seq.created,
        }
        if seq.routed_experts is not None:  # MoE: one flat layers x top-k list of expert ids per output token
            meta["routed_experts"] = seq.routed_experts[:n]
        if return_logprob:
            meta["output_token_logprobs"] = [[lp, tok, None] for lp, tok in zip(seq.output_logprobs[:n], output_ids, strict=False)]
        return {"text": self.text(seq, output_ids, reason), "output_ids": output_ids, "meta_info": meta}

    def text(self, seq: Sequence, output_ids: list[int], reason: dict[str, Any] | None) -> str:
        """The detokenized output, the matched stop token or string trimmed unless ``no_stop_trim``."""
        trim = reason is not None and not seq.params.no_stop_trim
        text_ids = output_ids
        if trim and reason.get("type") == "stop" and isinstance(reason.get("matched"), int):
            text_ids = output_ids[:-1]
        text = self.engine.runner.tokenizer.decode(text_ids, skip_special_tokens=seq.params.skip_special_tokens)
        if trim and isinstance(reason.get("matched"), str):
            cut = text.find(reason["matched"])
            if cut >= 0:
                text = text[:cut]
        return text

    def answer(self, req: GenerateRequest, seqs: list[Sequence]) -> Any:
        results = [self.result(s, req.return_logprob) for s in seqs]
        return results if (req.batched or len(results) > 1) else results[0]

    def abort_unfinished(self, seqs: list[Sequence]) -> None:
        for s in seqs:
            if not s.finished:
                self.engine.scheduler.abort(s.rid, message="client disconnected")

    # ---- the handlers --------------------------------------------------------------------------
    async def generate(self, request: Request):
        """``POST /generate`` through FastAPI: what :class:`FastGenerate` hands on (streaming requests)."""
        req = GenerateRequest.parse(await read_json(request))
        released = self.memory_released_message()
        if released:
            return error_response(self.engine, released, 503)
        seqs, events = self.submit(req)
        if req.stream:
            return StreamingResponse(self.stream(seqs[0], events[0], req.return_logprob), media_type="text/event-stream")
        await self.wait_finished(seqs, events, request)
        # Already JSON types: a JSONResponse skips FastAPI's jsonable_encoder walk (~0.1-0.2 ms per answer).
        return JSONResponse(self.answer(req, seqs))

    async def wait_finished(self, seqs: list[Sequence], events: list[asyncio.Event], request: Request) -> None:
        pending = {asyncio.ensure_future(wait_done(s, e)) for s, e in zip(seqs, events, strict=False)}
        try:
            while pending:
                done, pending = await asyncio.wait(pending, timeout=1.0)
                if pending and await request.is_disconnected():
                    self.abort_unfinished(seqs)
        finally:
            for task in pending:
                task.cancel()

    async def generate_fast(self, body: bytes, disconnected: asyncio.Future) -> tuple[int, Any] | None:
        """``/generate`` without FastAPI's request machinery (:class:`FastGenerate`): (status, JSON body),
        or None for a streaming request, which :meth:`generate` serves."""
        req = GenerateRequest.parse(parse_json_object(body))
        if req.stream:
            return None
        released = self.memory_released_message()
        if released:
            self.engine.metrics.bad_requests.inc()
            return 503, error_body(released, 503)
        seqs, events = self.submit(req)
        waiting = asyncio.ensure_future(asyncio.gather(*(wait_done(s, e) for s, e in zip(seqs, events, strict=True))))
        try:
            await asyncio.wait([waiting, disconnected], return_when=asyncio.FIRST_COMPLETED)
            if not waiting.done():  # the client went away: its sequences stop; answer nobody
                self.abort_unfinished(seqs)
                await waiting
        finally:
            waiting.cancel()
        return 200, self.answer(req, seqs)

    def bad_request(self, exc: BadRequest) -> tuple[int, Any]:
        if 400 <= exc.status < 500:
            self.engine.metrics.bad_requests.inc()
        return exc.status, error_body(str(exc), exc.status)

    async def stream(self, seq: Sequence, event: asyncio.Event, return_logprob: bool):
        """Server-sent events: one cumulative chunk per token, then ``[DONE]``; a gone client aborts ``seq``."""
        sent = 0
        try:
            while True:
                await event.wait()
                event.clear()
                finished = seq.finished
                total = min(len(seq.output_ids), len(seq.output_logprobs))
                # one chunk per token, also when several landed before this coroutine ran
                for upto in range(sent + 1, total):
                    yield f"data: {json.dumps(self.result(seq, return_logprob, upto))}\n\n"
                if total > sent or finished:
                    yield f"data: {json.dumps(self.result(seq, return_logprob, None if finished else total))}\n\n"
                    sent = total
                if finished:
                    break
            yield "data: [DONE]\n\n"
        finally:
            if not seq.finished:
                self.engine.scheduler.abort(seq.rid, message="client disconnected")


def attach(seq: Sequence, loop: asyncio.AbstractEventLoop) -> asyncio.Event:
    """An event the scheduler sets (thread-safely, on ``loop``) whenever ``seq`` makes progress."""
    event = asyncio.Event()
    seq.loop, seq.notify = loop, event.set
    return event


async def wait_done(seq: Sequence, event: asyncio.Event) -> None:
    while not seq.finished:
        await event.wait()
        event.clear()


class FastGenerate:
    """ASGI middleware serving ``POST /generate`` itself: the body read whole, ``handler`` awaited, the JSON
    answer sent; FastAPI's routing, request object and response classes are skipped. A client that disconnects
    aborts its sequences, as the route does. A streaming request is handed to the app with its body replayed."""

    def __init__(self, app: Any, handler: Any, on_bad_request: Any) -> None:
        self.app, self.handler, self.on_bad_request = app, handler, on_bad_request

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or scope["path"] != "/generate" or scope["method"] != "POST":
            await self.app(scope, receive, send)
            return
        body = await self.read_body(receive)
        if body is None:
            return
        answered = await self.answer(body, receive)
        if answered is None:  # streaming: the app serves it from the same body
            await self.app(scope, replaying(body, receive), send)
            return
        status, content = answered
        payload = json.dumps(content, ensure_ascii=False, allow_nan=False, separators=(",", ":")).encode()
        await send({"type": "http.response.start", "status": status,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(payload)).encode())]})
        await send({"type": "http.response.body", "body": payload})

    @staticmethod
    async def read_body(receive: Any) -> bytes | None:
        """The whole request body, or None when the client left before sending it."""
        chunks, more = [], True
        while more:
            message = await receive()
            if message["type"] == "http.disconnect":
                return None
            chunks.append(message.get("body", b""))
            more = message.get("more_body", False)
        return b"".join(chunks)

    async def answer(self, body: bytes, receive: Any) -> tuple[int, Any] | None:
        """The handler's answer, with a future it sees resolve if the client disconnects meanwhile."""
        disconnected = asyncio.get_running_loop().create_future()

        async def watch() -> None:
            while (await receive())["type"] != "http.disconnect":
                pass
            if not disconnected.done():
                disconnected.set_result(None)

        watcher = asyncio.ensure_future(watch())
        try:
            return await self.handler(body, disconnected)
        except BadRequest as exc:
            return self.on_bad_request(exc)
        finally:
            watcher.cancel()


def replaying(body: bytes, receive: Any) -> Any:
    """An ASGI ``receive`` that yields ``body`` once, then what ``receive`` yields."""
    replayed = False

    async def replay() -> dict:
        nonlocal replayed
        if not replayed:
            replayed = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replay
