"""Every request agentrl sends to an engine, checked against SGLang 0.5.23's own request definitions.

SGLang cannot run here, and its ``sglang/srt/managers/io_struct.py`` does not import from a ``--no-deps``
install of the wheel (it imports msgspec, zmq, torch and SGLang's scheduler modules), so the fields are
pinned from its source: ``assets/sglang_0.5.23_requests.json`` holds, for each route agentrl calls, the
request class ``sglang/srt/entrypoints/http_server.py`` parses the body into and that class's fields
(name, annotation, required) from ``io_struct.py``, plus ``SamplingParams``' fields
(``sglang/srt/sampling/sampling_params.py``) and every route path. :func:`derive_pins` made it from the
wheel (``pip download sglang==0.5.23 --no-deps``, unzipped); with ``AGENTRL_SGLANG_SRC`` pointing at such
an unzipped wheel, :func:`test_the_pins_are_what_the_sglang_source_says` re-derives and compares.

The requests are not written by hand: agentrl's real senders (rollout client, disk / tensor / broadcast
weight syncs, the smg router's RL fan-out for pause / continue / memory / cache / weight version) talk to a
real embedded engine through a recording proxy, and each recorded request must be one SGLang would
accept: a known route and method, no field SGLang does not define, every required field, and values of
the annotated types. A payload SGLang would reject fails here.
"""

from __future__ import annotations

import ast
import asyncio
import json
import os
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

PINS = json.loads((Path(__file__).parent / "assets" / "sglang_0.5.23_requests.json").read_text())


# ------------------------------------------------------------------------------------------------ pins


def derive_pins(root: Path, version: str = "0.5.23") -> dict[str, Any]:
    """The pinned JSON from an unzipped sglang wheel at ``root`` (see module doc)."""
    def fields(name: str, classes: dict[str, ast.ClassDef]) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for base in classes[name].bases:
            if ast.unparse(base) in classes:
                out.update(fields(ast.unparse(base), classes))
        for st in classes[name].body:
            if isinstance(st, ast.AnnAssign) and isinstance(st.target, ast.Name) and not ast.unparse(st.annotation).startswith("ClassVar"):
                out[st.target.id] = {"annotation": ast.unparse(st.annotation), "required": st.value is None}
        return out

    io = ast.parse((root / "sglang/srt/managers/io_struct.py").read_text())
    classes = {n.name: n for n in io.body if isinstance(n, ast.ClassDef)}
    http = ast.parse((root / "sglang/srt/entrypoints/http_server.py").read_text())
    routes, all_routes = {}, {}
    for fn in http.body:
        if not isinstance(fn, ast.AsyncFunctionDef | ast.FunctionDef):
            continue
        for dec in fn.decorator_list:
            if not (isinstance(dec, ast.Call) and dec.args and isinstance(dec.args[0], ast.Constant)
                    and str(dec.args[0].value).startswith("/")):
                continue
            path = dec.args[0].value
            methods = [ast.literal_eval(k.value) for k in dec.keywords if k.arg == "methods"]
            verbs = methods[0] if methods else [dec.func.attr.upper()]
            all_routes.setdefault(path, set()).update(verbs)
            if path not in WANTED:
                continue
            anns = {a.arg: ast.unparse(a.annotation) for a in fn.args.args if a.annotation is not None}
            body = next((c for ann in anns.values() for c in classes if ann == c or ann.startswith(f"Annotated[{c},")), None)
            query = [a.arg for a in fn.args.args if a.arg not in ("obj", "request", "raw_request")
                     and (a.annotation is None or ast.unparse(a.annotation) not in classes)]
            routes[path] = {"methods": verbs, "body": body, "query": query}
    sp = ast.parse((root / "sglang/srt/sampling/sampling_params.py").read_text())
    sp_classes = {n.name: n for n in sp.body if isinstance(n, ast.ClassDef)}
    return {"sglang_version": version, "source": PINS["source"], "routes": routes,
            "requests": {c: fields(c, classes) for c in sorted({r["body"] for r in routes.values() if r["body"]})},
            "sampling_params": fields("SamplingParams", sp_classes),
            "all_routes": {p: sorted(m) for p, m in sorted(all_routes.items())}}


WANTED = sorted(PINS["routes"])


@pytest.mark.skipif(not os.environ.get("AGENTRL_SGLANG_SRC"), reason="set AGENTRL_SGLANG_SRC to an unzipped sglang 0.5.23 wheel")
def test_the_pins_are_what_the_sglang_source_says() -> None:
    assert derive_pins(Path(os.environ["AGENTRL_SGLANG_SRC"])) == PINS


# ------------------------------------------------------------------------------------------------ types


def conforms(value: Any, annotation: str) -> bool:
    """Whether a JSON ``value`` fits a (string) type annotation of SGLang's source; names it does not
    define here (its own aliases) accept anything."""
    return _fits(value, ast.parse(annotation, mode="eval").body)


def _fits(value: Any, node: ast.expr) -> bool:
    if isinstance(node, ast.Constant) and node.value is None:
        return value is None
    if isinstance(node, ast.Name):
        simple = {"str": lambda v: isinstance(v, str), "int": lambda v: isinstance(v, int) and not isinstance(v, bool),
                  "float": lambda v: isinstance(v, int | float) and not isinstance(v, bool),
                  "bool": lambda v: isinstance(v, bool), "dict": lambda v: isinstance(v, dict),
                  "bytes": lambda v: isinstance(v, str), "Any": lambda v: True}
        return simple.get(node.id, lambda v: True)(value)
    if isinstance(node, ast.Subscript):
        head = ast.unparse(node.value)
        args = node.slice.elts if isinstance(node.slice, ast.Tuple) else [node.slice]
        if head == "Optional":
            return value is None or _fits(value, args[0])
        if head == "Union":
            return any(_fits(value, a) for a in args)
        if head == "Annotated":
            return _fits(value, args[0])
        if head in ("List", "list", "Set", "Sequence"):
            return isinstance(value, list) and all(_fits(v, args[0]) for v in value)
        if head in ("Dict", "dict"):
            return isinstance(value, dict) and all(_fits(k, args[0]) and _fits(v, args[1]) for k, v in value.items())
        if head == "Literal":
            return value in [ast.literal_eval(a) for a in args]
    return True


def violations(method: str, path: str, body: Any) -> list[str]:
    """What SGLang 0.5.23 would refuse (or silently drop) in this request; empty when it conforms."""
    if path not in PINS["all_routes"]:
        return [f"{path}: no such SGLang route"]
    if method not in PINS["all_routes"][path]:
        return [f"{path}: SGLang takes {PINS['all_routes'][path]}, not {method}"]
    route = PINS["routes"].get(path)
    if route is None or method == "GET":
        return [] if body in (None, {}) else [f"{method} {path}: SGLang reads no body here, got {body}"]
    if route["body"] is None:
        return [] if body in (None, {}) else [f"{path}: SGLang reads no body, got {sorted(body)}"]
    spec = PINS["requests"][route["body"]]
    if not isinstance(body, dict):
        return [f"{path}: body {body!r} is not a JSON object"]
    problems = [f"{path}: {route['body']} has no field {k!r}" for k in body if k not in spec]
    problems += [f"{path}: required field {k!r} missing" for k, f in spec.items() if f["required"] and k not in body]
    problems += [f"{path}: {k}={body[k]!r} is not {spec[k]['annotation']}" for k in body
                 if k in spec and not conforms(body[k], spec[k]["annotation"])]
    if path == "/generate" and isinstance(body.get("sampling_params"), dict):
        sp = PINS["sampling_params"]
        problems += [f"/generate: SamplingParams has no {k!r}" for k in body["sampling_params"] if k not in sp]
        problems += [f"/generate: sampling_params.{k}={v!r} is not {sp[k]['annotation']}"
                     for k, v in body["sampling_params"].items() if k in sp and not conforms(v, sp[k]["annotation"])]
    return problems


def test_the_checker_refuses_what_sglang_would() -> None:
    assert violations("POST", "/update_weights_from_disk", {"model_path": "/m", "weight_version": "3"}) == []
    assert violations("POST", "/update_weights_from_disk", {"weight_version": "3"}) == [
        "/update_weights_from_disk: required field 'model_path' missing"]
    assert violations("POST", "/update_weights_from_disk", {"model_path": "/m", "checksum": "x"}) == [
        "/update_weights_from_disk: UpdateWeightFromDiskReqInput has no field 'checksum'"]
    assert violations("POST", "/init_weights_update_group", {"master_address": "h", "master_port": "1", "rank_offset": 1,
                                                              "world_size": 2}) == [
        "/init_weights_update_group: master_port='1' is not int"]
    assert violations("POST", "/pause_generation", {"mode": "later"}) == [
        "/pause_generation: mode='later' is not Literal['abort', 'retract', 'in_place']"]
    assert violations("POST", "/generate", {"input_ids": [1], "sampling_params": {"seed": 1}}) == [
        "/generate: SamplingParams has no 'seed'"]
    assert violations("POST", "/update_weights_from_delta", {}) == ["/update_weights_from_delta: no such SGLang route"]
    assert violations("GET", "/update_weights_from_disk", None) == [
        "/update_weights_from_disk: SGLang takes ['POST'], not GET"]


# ------------------------------------------------------------------------------------------------ recording


class RecordingProxy:
    """A reverse proxy in a thread: records (method, path, JSON body) and forwards to ``target``."""

    def __init__(self, target: str) -> None:
        import uvicorn
        from starlette.applications import Starlette
        from starlette.requests import Request
        from starlette.responses import Response
        from starlette.routing import Route

        from agentrl.engine.launch import free_port

        self.target = target
        self.seen: list[tuple[str, str, Any, str]] = []  # method, path, JSON body, user agent
        client = httpx.AsyncClient(timeout=600)

        async def forward(request: Request) -> Response:
            raw = await request.body()
            try:
                body = json.loads(raw) if raw else None
            except ValueError:
                body = raw
            self.seen.append((request.method, request.url.path, body, request.headers.get("user-agent", "")))
            headers = {k: v for k, v in request.headers.items() if k.lower() in ("authorization", "content-type")}
            answer = await client.request(request.method, target + request.url.path, params=request.query_params,
                                          content=raw, headers=headers)
            return Response(answer.content, status_code=answer.status_code,
                            media_type=answer.headers.get("content-type"))

        app = Starlette(routes=[Route("/{path:path}", forward, methods=["GET", "POST", "PUT", "DELETE"])])
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def __enter__(self) -> RecordingProxy:
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            assert time.monotonic() < deadline and self.thread.is_alive(), "proxy did not start"
            time.sleep(0.02)
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)


@pytest.fixture(scope="module")
def recorded(tmp_path_factory):
    """Every request agentrl's senders made to one engine (through the proxy, directly and via smg)."""
    from safetensors.torch import load_file

    from agentrl.engine.launch import EngineProcess
    from agentrl.engine.weight_loading import write_checksum_manifest
    from agentrl.models.tiny import make_tiny_model
    from agentrl.rollout.client import RolloutClient
    from agentrl.rollout.router import SmgRouter
    from agentrl.weights.sync import make_sync

    root = tmp_path_factory.mktemp("conformance")
    model = make_tiny_model(root / "m", seed=0)
    write_checksum_manifest(model, [model / "model.safetensors"])  # what the engine's disk route requires
    tensors = list(load_file(str(model / "model.safetensors")).items())
    with EngineProcess(model, threads=1) as engine, RecordingProxy(engine.url) as proxy:
        async def generate() -> None:
            async with RolloutClient(proxy.url) as client:
                await client.generate_turn([1, 5, 7], session_id="s", sampling_params={"temperature": 1.0, "max_new_tokens": 4})
                await client.generate([1, 5], {"temperature": 0.0, "max_new_tokens": 2, "top_p": 0.9, "top_k": 5,
                                               "stop": ["</tool_call>"]}, session_id="t")
                await client.abort("some-rid")

        asyncio.run(generate())
        for mode, options in (("disk", {}), ("tensor", {}), ("tensor", {"transport": "safetensors"}), ("broadcast", {})):
            with make_sync(mode, [proxy.url], **options) as sync:
                sync.sync(tensors, f"{mode}-{len(proxy.seen)}")
        with SmgRouter([proxy.url]) as router:
            router.pause("abort")
            router.pause("retract")
            router.continue_()
            router.fanout("release_memory_occupation", {})  # what a colocated run sends around training
            router.fanout("resume_memory_occupation", {})
            router.update_weights_from_disk(str(model), "from-disk")
            router.update_weight_version("v9")
            router.flush_cache()
        return list(proxy.seen)


def test_every_request_agentrl_sends_is_one_sglang_accepts(recorded) -> None:
    posted = {path for method, path, _, _ in recorded if method != "GET"}
    # The senders really ran: each SGLang route agentrl uses was exercised.
    assert {"/generate", "/abort_request", "/update_weights_from_disk", "/update_weights_from_tensor",
            "/init_weights_update_group", "/update_weights_from_distributed", "/destroy_weights_update_group",
            "/pause_generation", "/continue_generation", "/release_memory_occupation", "/resume_memory_occupation",
            "/update_weight_version", "/flush_cache"} <= posted
    # smg's own probes of its worker (GET /version, /get_load, ...) are the router's business; every POST
    # (agentrl's bodies, also those smg fans out) and every GET agentrl's Python clients make is checked.
    ours = [(m, p, b) for m, p, b, agent in recorded
            if m != "GET" or agent.lower().startswith(("python-httpx", "python-urllib", "python/", "aiohttp"))]
    assert any(m == "GET" and p == "/server_info" for m, p, _ in ours)  # the weight-version reads were seen
    problems = [p for method, path, body in ours for p in violations(method, path, body)]
    assert not problems, "\n".join(problems)
