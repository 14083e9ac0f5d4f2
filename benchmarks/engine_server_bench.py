"""The engine in-process against the same engine behind ``python -m agentrl.engine`` (HTTP): output tok/s and
the host's CPU per decode step and per generated token, same client code on both sides.

Workloads (issue 40): ``long`` (``--prompt-len`` 512 in / ``--new-tokens`` 256 out), ``short`` (64-token
replies) and ``sessions`` (3-turn sessions, each turn's prompt the last prompt + reply + 64 new tokens),
each at every ``--concurrency`` with that many requests (sessions) in flight and ``max_batch_size`` set to it.
The in-process side submits scheduler sequences from an asyncio loop in this process (what a request costs
without HTTP); the HTTP side posts ``/generate`` with aiohttp. Host CPU is the engine process's user+system
time (in-process: this process, client included); decode steps are the engine's batch-size histogram count.

    python3 benchmarks/engine_server_bench.py --null-model --out /tmp/esb.json    # CPU: scripted model
    python3 benchmarks/engine_server_bench.py --device cuda --shape qwen2-0.5b --out $OUT/engine_server.json

``--null-model`` serves a tiny model's tokenizer with :mod:`agentrl.engine.null_model` (every forward a lookup),
so the numbers are the host's cost alone. Prints a table and writes JSON.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import sys
import tempfile
import threading
import time
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).parent))
from engine_bench import cpu_seconds  # noqa: E402

Generate = Callable[[list[int], int], Awaitable[dict]]  # (prompt ids, new tokens) -> /generate's answer


def workloads(args) -> list[dict]:
    return [
        {"name": "long", "prompt_len": args.prompt_len, "new_tokens": args.new_tokens, "turns": 1},
        {"name": "short", "prompt_len": args.prompt_len, "new_tokens": 64, "turns": 1},
        {"name": "sessions", "prompt_len": args.prompt_len // 2, "new_tokens": 64, "turns": 3, "user_len": 64},
    ]


async def drive(generate: Generate, concurrency: int, load: dict, vocab: int, seed: int) -> dict:
    """``concurrency`` clients, each one request (``turns`` > 1: one session); tokens and wall seconds."""
    rng = random.Random(seed)
    tokens = cached = 0

    async def client() -> None:
        nonlocal tokens, cached
        prompt = [rng.randrange(3, vocab) for _ in range(load["prompt_len"])]
        for _ in range(load["turns"]):
            out = await generate(prompt, load["new_tokens"])
            tokens += out["meta_info"]["completion_tokens"]
            cached += out["meta_info"]["cached_tokens"]
            prompt = prompt + out["output_ids"] + [rng.randrange(3, vocab) for _ in range(load.get("user_len", 0))]

    t0 = time.perf_counter()
    await asyncio.gather(*(client() for _ in range(concurrency)))
    return {"tokens": tokens, "seconds": time.perf_counter() - t0, "cached_tokens": cached}


def row(load: dict, concurrency: int, side: str, run: dict, cpu_s: float, steps: int) -> dict:
    return {"workload": load["name"], "concurrency": concurrency, "side": side, **run,
            "tokens_per_s": run["tokens"] / run["seconds"], "decode_steps": steps, "host_cpu_s": cpu_s,
            "host_ms_per_step": 1000 * cpu_s / max(steps, 1), "host_us_per_token": 1e6 * cpu_s / max(run["tokens"], 1)}


# ---- in-process --------------------------------------------------------------------------------------
def in_process_generate(engine) -> Generate:
    from agentrl.engine.generation import attach, wait_done
    from agentrl.engine.protocol import SamplingParams
    from agentrl.engine.scheduler import Sequence

    async def generate(prompt: list[int], new_tokens: int) -> dict:
        seq = Sequence(prompt_ids=list(prompt), params=SamplingParams(max_new_tokens=new_tokens, ignore_eos=True))
        event = attach(seq, asyncio.get_running_loop())
        engine.scheduler.submit(seq)
        await wait_done(seq, event)
        return {"output_ids": seq.output_ids, "meta_info": {"completion_tokens": len(seq.output_ids),
                                                            "cached_tokens": seq.cached_tokens}}

    return generate


def _histogram_count(registry) -> float:
    for family in registry.collect():
        if family.name == "agentrl_engine_batch_size":
            return next(s.value for s in family.samples if s.name.endswith("_count"))
    raise KeyError("agentrl_engine_batch_size")


def run_in_process(args, model_dir: str, runner_factory, concurrency: int, loads: list[dict]) -> list[dict]:
    from engine_gpu_bench import step_split, write_trace

    from agentrl.engine.engine import Engine, EngineConfig

    engine = Engine(EngineConfig(model_dir, dtype=args.dtype, device=args.device, max_batch_size=concurrency,
                                 max_prefill_tokens=args.max_prefill_tokens, admit_wait_ratio=args.admit_wait_ratio,
                                 prefix_cache_tokens=args.prefix_cache_tokens,
                                 lean_decode=False if args.null_model else None),
                    runner=runner_factory())
    engine.start()
    try:
        generate = in_process_generate(engine)
        asyncio.run(drive(generate, concurrency, {**loads[0], "new_tokens": 4, "turns": 1}, args.vocab, seed=0))  # warm
        rows = []
        for i, load in enumerate(loads):
            steps0, cpu0 = _histogram_count(engine.metrics.registry), time.process_time()
            admissions0, stats0 = engine.scheduler.admissions, engine.scheduler.stats()
            if args.trace_dir:
                engine.scheduler.trace = []
            run = asyncio.run(drive(generate, concurrency, load, args.vocab, seed=1 + i))
            rows.append(row(load, concurrency, "in-process", run, time.process_time() - cpu0,
                            int(_histogram_count(engine.metrics.registry) - steps0)))
            rows[-1]["admissions"] = engine.scheduler.admissions - admissions0
            rows[-1]["split"] = step_split(stats0, engine.scheduler.stats(), run["seconds"])
            if args.trace_dir:
                write_trace(Path(args.trace_dir) / f"trace_in-process_{load['name']}_c{concurrency}.json",
                            engine.scheduler.trace)
                engine.scheduler.trace = None
        return rows
    finally:
        engine.shutdown()
        del engine
        _free_device(args.device)


# ---- over HTTP ---------------------------------------------------------------------------------------
def _steps_from_metrics(text: str) -> int:
    """The batch-size histogram's count (one per decode step) in ``GET /metrics``'s text."""
    match = re.search(r"^agentrl_engine_batch_size_count(?:\{[^}]*\})? ([0-9.e+]+)$", text, re.M)
    if match is None:
        raise KeyError("agentrl_engine_batch_size_count not in /metrics")
    return int(float(match.group(1)))


class ThreadClient:
    """``/generate`` and ``/metrics`` over one keep-alive ``http.client`` connection per thread: the stdlib
    stand-in where aiohttp is not installed (the GPU machine's carried wheels lack it)."""

    def __init__(self, url: str) -> None:
        from urllib.parse import urlsplit

        self.address = urlsplit(url).netloc
        self.local = threading.local()

    def request(self, method: str, path: str, body: dict | None = None) -> tuple[int, bytes]:
        import http.client

        conn = getattr(self.local, "conn", None)
        if conn is None:
            conn = self.local.conn = http.client.HTTPConnection(self.address, timeout=3600)
        data = None if body is None else json.dumps(body).encode()
        conn.request(method, path, body=data, headers={"content-type": "application/json"})
        resp = conn.getresponse()
        return resp.status, resp.read()


async def http_runs(url: str, pid: int, concurrency: int, loads: list[dict], vocab: int) -> list[dict]:
    try:
        import aiohttp
    except ImportError:
        aiohttp = None
    if aiohttp is None:
        client = ThreadClient(url)
        asyncio.get_running_loop().set_default_executor(ThreadPoolExecutor(concurrency + 2))

        async def request(method: str, path: str, body: dict | None = None) -> tuple[int, bytes]:
            return await asyncio.to_thread(client.request, method, path, body)

        return await _http_rows(request, pid, concurrency, loads, vocab)
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=3600), connector=connector) as session:

        async def request(method: str, path: str, body: dict | None = None) -> tuple[int, bytes]:
            async with session.request(method, url + path, json=body) as resp:
                return resp.status, await resp.read()

        return await _http_rows(request, pid, concurrency, loads, vocab)


async def _http_rows(request, pid: int, concurrency: int, loads: list[dict], vocab: int) -> list[dict]:
    async def generate(prompt: list[int], new_tokens: int) -> dict:
        body = {"input_ids": prompt, "sampling_params": {"max_new_tokens": new_tokens, "ignore_eos": True}}
        status, data = await request("POST", "/generate", body)
        if status != 200:
            raise RuntimeError(f"HTTP {status}: {data[:300]!r}")
        return json.loads(data)

    async def steps() -> int:
        return _steps_from_metrics((await request("GET", "/metrics"))[1].decode())

    async def stats() -> dict:
        return json.loads((await request("GET", "/server_info"))[1])["internal_states"][0]["step_stats"]

    from engine_gpu_bench import step_split

    await drive(generate, concurrency, {**loads[0], "new_tokens": 4, "turns": 1}, vocab, seed=0)  # warm
    rows = []
    for i, load in enumerate(loads):
        steps0, cpu0, stats0 = await steps(), cpu_seconds(pid), await stats()
        run = await drive(generate, concurrency, load, vocab, seed=1 + i)
        rows.append(row(load, concurrency, "http", run, cpu_seconds(pid) - cpu0, await steps() - steps0))
        rows[-1]["split"] = step_split(stats0, await stats(), run["seconds"])
    return rows


def run_http(args, model_dir: str, concurrency: int, loads: list[dict]) -> list[dict]:
    from agentrl.engine.launch import EngineProcess

    extra = ["--max-batch-size", str(concurrency), "--max-prefill-tokens", str(args.max_prefill_tokens),
             "--admit-wait-ratio", str(args.admit_wait_ratio), "--prefix-cache-tokens", str(args.prefix_cache_tokens)]
    if args.device:
        extra += ["--device", args.device]
    if args.null_model:
        extra += ["--null-model", args.null_model]
    with EngineProcess(model_dir, dtype=args.dtype, extra_args=extra, log_dir=args.trace_dir) as eng:
        eng.wait_healthy(300)
        return asyncio.run(http_runs(eng.url, eng.pid, concurrency, loads, args.vocab))


def _free_device(device: str | None) -> None:
    import gc

    gc.collect()
    if device and device.startswith("cuda"):
        import torch

        torch.cuda.empty_cache()


# ---- main --------------------------------------------------------------------------------------------
def prepare(args, root: Path) -> tuple[str, Callable[[], object]]:
    """The model directory and a factory for the in-process runner (None: the engine loads the model)."""
    if args.null_model:
        from agentrl.engine.null_model import NullRunner, NullScript
        from agentrl.models.tiny import make_tiny_model

        model_dir = str(make_tiny_model(root / "tiny", seed=0, max_position_embeddings=4096))
        script = root / "null.json"
        reply = [random.Random(0).randrange(3, 200) for _ in range(max(args.new_tokens, 64))]
        script.write_text(json.dumps({"replies": [reply], "marker": 1}))
        args.null_model, args.vocab = str(script), 200
        return model_dir, lambda: NullRunner(model_dir, NullScript.load(script))
    from engine_gpu_bench import build_model_dir

    context = args.prompt_len + 3 * (64 + 64) + args.new_tokens + 64
    model_dir = str(build_model_dir(args.shape, args.dtype, root, context, args.device))
    return model_dir, lambda: None


def print_table(rows: list[dict]) -> None:
    print(f"{'workload':>8} | {'c':>4} | {'side':>10} | {'tok/s':>9} | {'steps':>6} | {'host ms/step':>12} | "
          f"{'host us/tok':>11} | {'http/in-proc':>12}")
    base = {(r["workload"], r["concurrency"]): r for r in rows if r["side"] == "in-process"}
    for r in rows:
        ref = base.get((r["workload"], r["concurrency"]))
        ratio = f"{r['tokens_per_s'] / ref['tokens_per_s']:.0%}" if ref and r["side"] == "http" else ""
        print(f"{r['workload']:>8} | {r['concurrency']:>4} | {r['side']:>10} | {r['tokens_per_s']:>9.0f} | "
              f"{r['decode_steps']:>6} | {r['host_ms_per_step']:>12.2f} | {r['host_us_per_token']:>11.1f} | {ratio:>12}")
    from engine_gpu_bench import SPLIT_HEADER, split_line

    print(SPLIT_HEADER)
    for r in rows:
        if "split" in r:
            print(split_line(f"{r['workload']} c={r['concurrency']} {r['side']}", r["split"]))


def write(args, rows: list[dict]) -> None:
    result = {"mode": "null-model" if args.null_model else f"{args.device} {args.shape} {args.dtype}",
              "admit_wait_ratio": args.admit_wait_ratio, "cpu_count": os.cpu_count(), "loadavg": os.getloadavg(),
              "rows": rows}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--null-model", action="store_true", help="CPU: the scripted null model (host cost alone)")
    p.add_argument("--device", default=None, help="cuda (with --shape); default cpu for --null-model")
    p.add_argument("--shape", default="qwen2-0.5b", help="benchmarks/trainer_bench.py SHAPES key (GPU mode)")
    p.add_argument("--dtype", default=None, help="default: bfloat16 on CUDA, float32 else")
    p.add_argument("--concurrency", type=int, nargs="+", default=[128, 256])
    p.add_argument("--prompt-len", type=int, default=512)
    p.add_argument("--new-tokens", type=int, default=256)
    p.add_argument("--max-prefill-tokens", type=int, default=65536)
    p.add_argument("--admit-wait-ratio", type=float, default=4.0, help="the engine's (0: admit before every step)")
    p.add_argument("--prefix-cache-tokens", type=int, default=65536, help="the engine's prefix KV cache budget")
    p.add_argument("--trace-dir", default=None, help="in-process: write the scheduler's per-step trace of each run here")
    p.add_argument("--workloads", nargs="+", default=["long", "short", "sessions"])
    p.add_argument("--sides", nargs="+", default=["in-process", "http"])
    p.add_argument("--out", default="benchmarks/results/engine_server_bench.json")
    args = p.parse_args(argv)
    if not args.null_model and not args.device:
        p.error("give --null-model (CPU) or --device cuda")
    args.dtype = args.dtype or ("bfloat16" if (args.device or "").startswith("cuda") else "float32")
    args.vocab = 1000
    loads = [w for w in workloads(args) if w["name"] in args.workloads]
    rows: list[dict] = []
    with tempfile.TemporaryDirectory() as tmp:
        model_dir, runner_factory = prepare(args, Path(tmp))
        for c in args.concurrency:
            if "in-process" in args.sides:
                rows += run_in_process(args, model_dir, runner_factory, c, loads)
            if "http" in args.sides:
                rows += run_http(args, model_dir, c, loads)
            print_table(rows)
            write(args, rows)  # after each concurrency: a run cut short keeps what it measured
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
