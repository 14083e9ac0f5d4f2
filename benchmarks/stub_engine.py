"""An engine stub that answers instantly, for the client/router overhead benchmark and fast router tests.

It speaks just enough of SGLang's native HTTP API for the smg router to accept it as a worker
(``/health``, ``/server_info`` and ``/model_info`` with a *local* ``model_path``) and for the rollout
client to use it (``/generate`` with ``meta_info``, pause/continue, weight-version updates, abort).
It runs no model: ``output_ids`` are ``[last_prompt_id + 1, ...]`` modulo the vocabulary, log-probs are
``-0.5`` each, and ``cached_tokens`` is the prefix shared with the previous prompt of the same routing key
on this worker (a toy per-session prefix cache, O(prompt) per request, so affinity can be observed). ``GET /stub_stats`` reports what it served, per routing key.

    python benchmarks/stub_engine.py --port 30001 [--host 127.0.0.1] [--model-path DIR]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import tempfile
from collections import Counter

from aiohttp import web

VOCAB_SIZE = 1024
ROUTING_KEY_HEADER = "X-SMG-Routing-Key"


class StubEngine:
    """State of one stub worker: counters, a toy prefix cache, weight version, pause flag."""

    def __init__(self, model_path: str, port: int) -> None:
        self.model_path = model_path
        self.port = port
        self.weight_version = "default"
        self.requests = 0
        self.per_key: Counter[str] = Counter()
        self.last_prompt: dict[str, list[int]] = {}  # toy per-session prefix cache
        self.resumed = asyncio.Event()
        self.resumed.set()
        self.aborted_rids: list[str] = []

    def cached_prefix(self, key: str, ids: list[int]) -> int:
        prev = self.last_prompt.get(key, ())
        n = 0
        for a, b in zip(prev, ids, strict=False):
            if a != b:
                break
            n += 1
        # An SGLang radix cache never reports the whole prompt as cached: the last token is recomputed.
        return min(n, max(len(ids) - 1, 0))

    async def generate(self, request: web.Request) -> web.Response:
        try:
            body = json.loads(await request.read())
        except ValueError as exc:
            return _error(400, f"malformed JSON: {exc}")
        ids = body.get("input_ids")
        if not isinstance(ids, list) or not ids or not all(isinstance(t, int) for t in ids):
            return _error(400, "input_ids must be a non-empty list of ints")
        if any(not 0 <= t < VOCAB_SIZE for t in ids):
            return _error(400, f"token id out of vocabulary [0, {VOCAB_SIZE})")
        params = body.get("sampling_params") or {}
        n_new = int(params.get("max_new_tokens", 1))
        if n_new <= 0:
            return _error(400, "max_new_tokens must be > 0")
        await self.resumed.wait()
        self.requests += 1
        key = request.headers.get(ROUTING_KEY_HEADER, "")
        self.per_key[key] += 1
        cached = self.cached_prefix(key, ids)
        self.last_prompt[key] = ids
        out = [(ids[-1] + 1 + i) % VOCAB_SIZE for i in range(n_new)]
        meta = {
            "id": body.get("rid") or f"stub-{self.requests}",
            "finish_reason": {"type": "length", "length": n_new},
            "prompt_tokens": len(ids),
            "completion_tokens": n_new,
            "cached_tokens": cached,
            "weight_version": self.weight_version,
            "e2e_latency": 0.0,
        }
        if body.get("return_logprob"):
            meta["output_token_logprobs"] = [[-0.5, t, None] for t in out]
        return web.json_response({"text": "", "output_ids": out, "meta_info": meta})

    async def server_info(self, request: web.Request) -> web.Response:
        return web.json_response(
            {
                "model_path": self.model_path,
                "tokenizer_path": self.model_path,
                "served_model_name": "stub",
                "port": self.port,
                "weight_version": self.weight_version,
                "version": "stub",
            }
        )

    async def model_info(self, request: web.Request) -> web.Response:
        return web.json_response(
            {
                "model_path": self.model_path,
                "tokenizer_path": self.model_path,
                "is_generation": True,
                "weight_version": self.weight_version,
            }
        )

    async def health(self, request: web.Request) -> web.Response:
        return web.Response(text="")

    async def get_load(self, request: web.Request) -> web.Response:
        return web.json_response([{"dp_rank": 0, "num_reqs": 0, "num_waiting_reqs": 0, "num_tokens": 0}])

    async def pause(self, request: web.Request) -> web.Response:
        self.resumed.clear()
        return web.json_response({"success": True, "message": "paused"})

    async def resume(self, request: web.Request) -> web.Response:
        self.resumed.set()
        return web.json_response({"success": True, "message": "continued"})

    async def update_weights_from_disk(self, request: web.Request) -> web.Response:
        body = await _json_or_empty(request)
        if not body.get("model_path"):
            return _error(400, "model_path is required")
        if body.get("weight_version") is not None:
            self.weight_version = str(body["weight_version"])
        return web.json_response({"success": True, "message": "updated", "num_paused_requests": 0})

    async def update_weight_version(self, request: web.Request) -> web.Response:
        body = await _json_or_empty(request)
        self.weight_version = str(body.get("new_version", self.weight_version))
        return web.json_response({"success": True, "message": "updated"})

    async def abort_request(self, request: web.Request) -> web.Response:
        body = await _json_or_empty(request)
        self.aborted_rids.append(str(body.get("rid", "")))
        return web.json_response({"success": True})

    async def flush_cache(self, request: web.Request) -> web.Response:
        self.last_prompt.clear()
        return web.Response(text="Cache flushed.")

    async def stats(self, request: web.Request) -> web.Response:
        return web.json_response(
            {
                "port": self.port,
                "requests": self.requests,
                "per_key": dict(self.per_key),
                "weight_version": self.weight_version,
                "paused": not self.resumed.is_set(),
                "aborted_rids": self.aborted_rids,
            }
        )


async def _json_or_empty(request: web.Request) -> dict:
    raw = await request.read()
    return json.loads(raw) if raw else {}


def _error(status: int, message: str) -> web.Response:
    return web.json_response({"error": {"message": message, "code": status}}, status=status)


def build_app(model_path: str, port: int) -> web.Application:
    engine = StubEngine(model_path, port)
    app = web.Application()
    app.add_routes(
        [
            web.get("/health", engine.health),
            web.get("/health_generate", engine.health),
            web.post("/generate", engine.generate),
            web.get("/server_info", engine.server_info),
            web.get("/get_server_info", engine.server_info),
            web.get("/model_info", engine.model_info),
            web.get("/get_model_info", engine.model_info),
            web.get("/get_load", engine.get_load),
            web.post("/pause_generation", engine.pause),
            web.post("/continue_generation", engine.resume),
            web.post("/update_weights_from_disk", engine.update_weights_from_disk),
            web.post("/update_weight_version", engine.update_weight_version),
            web.post("/abort_request", engine.abort_request),
            web.post("/flush_cache", engine.flush_cache),
            web.get("/stub_stats", engine.stats),
        ]
    )
    return app


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--model-path", default=None, help="local dir reported as model_path (default: a temp dir)")
    args = parser.parse_args(argv)
    model_path = args.model_path or tempfile.mkdtemp(prefix="stub-model-")
    os.makedirs(model_path, exist_ok=True)
    web.run_app(build_app(model_path, args.port), host=args.host, port=args.port, print=None,
                access_log=None)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
