"""Embedded engine throughput: generated tokens/s at concurrency 1/16/64 on the tiny model, and the
speed-up from prefix (KV) reuse on 8-turn sessions. End to end over HTTP against ``python -m
agentrl.engine`` subprocesses (aiohttp client).

    python3 benchmarks/engine_bench.py [--model DIR] [--num-threads N] [--quick]

Prints a table and writes ``benchmarks/results/engine_bench.json``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import sys
import tempfile
import time
from pathlib import Path

RESULTS = Path(__file__).parent / "results" / "engine_bench.json"


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process (all its threads) from /proc: load-independent cost."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def _post(session, url: str, body: dict) -> dict:
    async with session.post(url + "/generate", json=body) as resp:
        if resp.status != 200:
            raise RuntimeError(f"HTTP {resp.status}: {await resp.text()}")
        return await resp.json()


async def throughput(url: str, pid: int, concurrency: int, n_requests: int, prompt_len: int, new_tokens: int, seed: int) -> dict:
    """``n_requests`` fresh random prompts, ``concurrency`` in flight; generated tokens per second."""
    import aiohttp

    rng = random.Random(seed)
    prompts = [[1] + [rng.randrange(3, 1000) for _ in range(prompt_len - 1)] for _ in range(n_requests)]
    queue = list(prompts)
    tokens = 0

    async def worker(session) -> None:
        nonlocal tokens
        while queue:
            prompt = queue.pop()
            out = await _post(session, url, {"input_ids": prompt, "sampling_params": {
                "max_new_tokens": new_tokens, "temperature": 1.0, "ignore_eos": True}})
            tokens += out["meta_info"]["completion_tokens"]

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=3600)) as session:
        await _post(session, url, {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 2}})  # warm-up
        t0, c0 = time.perf_counter(), cpu_seconds(pid)
        await asyncio.gather(*(worker(session) for _ in range(concurrency)))
        wall, cpu = time.perf_counter() - t0, cpu_seconds(pid) - c0
    return {"concurrency": concurrency, "requests": n_requests, "tokens": tokens, "seconds": wall,
            "tokens_per_s": tokens / wall, "engine_cpu_s": cpu, "tokens_per_engine_cpu_s": tokens / cpu}


async def sessions(url: str, pid: int, n_sessions: int, turns: int, system_len: int, user_len: int, new_tokens: int, seed: int) -> dict:
    """``n_sessions`` concurrent multi-turn sessions; each turn's prompt extends the last prompt + output."""
    import aiohttp

    rng = random.Random(seed)
    cached = prompt_tokens = 0
    turn_latencies: list[float] = []

    async def run(session) -> None:
        nonlocal cached, prompt_tokens
        prompt = [1] + [rng.randrange(3, 1000) for _ in range(system_len - 1)]
        for _ in range(turns):
            prompt = prompt + [rng.randrange(3, 1000) for _ in range(user_len)]
            t = time.perf_counter()
            out = await _post(session, url, {"input_ids": prompt, "sampling_params": {
                "max_new_tokens": new_tokens, "temperature": 1.0, "ignore_eos": True}})
            turn_latencies.append(time.perf_counter() - t)
            cached += out["meta_info"]["cached_tokens"]
            prompt_tokens += out["meta_info"]["prompt_tokens"]
            prompt = prompt + out["output_ids"]

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=3600)) as session:
        await session.post(url + "/flush_cache")
        t0, c0 = time.perf_counter(), cpu_seconds(pid)
        await asyncio.gather(*(run(session) for _ in range(n_sessions)))
        wall, cpu = time.perf_counter() - t0, cpu_seconds(pid) - c0
    turn_latencies.sort()
    return {"sessions": n_sessions, "turns": turns, "seconds": wall, "engine_cpu_s": cpu, "prompt_tokens": prompt_tokens,
            "cached_tokens": cached, "cached_fraction": cached / prompt_tokens,
            "turn_p50_s": turn_latencies[len(turn_latencies) // 2]}


def main(argv: list[str] | None = None) -> int:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from agentrl.engine.launch import EngineProcess

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", help="model directory (default: a fresh tiny model)")
    p.add_argument("--num-threads", type=int, default=None, help="torch threads in the engine")
    p.add_argument("--quick", action="store_true", help="fewer requests (smoke run)")
    p.add_argument("--out", default=str(RESULTS))
    args = p.parse_args(argv)

    tmp = tempfile.TemporaryDirectory()
    model = args.model
    if model is None:
        from agentrl.models.tiny import make_tiny_model

        model = str(make_tiny_model(Path(tmp.name) / "tiny", seed=0))
    extra = ["--max-batch-size", "64"] + (["--num-threads", str(args.num_threads)] if args.num_threads else [])
    scale = 1 if args.quick else 3
    prompt_len, new_tokens = 32, 64
    results: dict = {"model": "tiny" if args.model is None else model, "prompt_len": prompt_len, "new_tokens": new_tokens,
                     "cpu_count": os.cpu_count(), "loadavg_start": os.getloadavg(), "num_threads": args.num_threads}

    with EngineProcess(model, extra_args=extra) as eng:
        eng.wait_healthy(300)
        rows = []
        for c in (1, 16, 64):
            n = max(4 * scale, c * scale) if c > 1 else 4 * scale
            rows.append(asyncio.run(throughput(eng.url, eng.pid, c, n, prompt_len, new_tokens, seed=c)))
        results["throughput"] = rows
        session_kw = dict(n_sessions=8, turns=8, system_len=40, user_len=20, new_tokens=28, seed=7)
        with_cache = asyncio.run(sessions(eng.url, eng.pid, **session_kw))
    with EngineProcess(model, extra_args=[*extra, "--prefix-cache-tokens", "0"]) as eng:
        eng.wait_healthy(300)
        without_cache = asyncio.run(sessions(eng.url, eng.pid, **session_kw))
    results["sessions"] = {"with_prefix_cache": with_cache, "without_prefix_cache": without_cache,
                           "speedup_wall": without_cache["seconds"] / with_cache["seconds"],
                           "speedup_engine_cpu": without_cache["engine_cpu_s"] / with_cache["engine_cpu_s"],
                           "config": session_kw}
    results["loadavg_end"] = os.getloadavg()

    print(f"\nengine throughput (tiny model, prompt {prompt_len}, {new_tokens} new tokens, T=1)")
    print(f"{'concurrency':>11} | {'requests':>8} | {'tokens/s (wall)':>15} | {'tokens / engine CPU-s':>21} | {'seconds':>7}")
    for r in rows:
        print(f"{r['concurrency']:>11} | {r['requests']:>8} | {r['tokens_per_s']:>15.0f} | "
              f"{r['tokens_per_engine_cpu_s']:>21.0f} | {r['seconds']:>7.2f}")
    s = results["sessions"]
    print("\n8 sessions x 8 turns | wall s | engine CPU s | turn p50 ms | cached prompt tokens")
    for name, r in (("with prefix cache", with_cache), ("without", without_cache)):
        print(f"{name:>20} | {r['seconds']:>6.2f} | {r['engine_cpu_s']:>12.2f} | {r['turn_p50_s'] * 1000:>11.0f} | "
              f"{r['cached_fraction']:>6.0%}")
    print(f"speed-up from prefix reuse: x{s['speedup_wall']:.2f} wall, x{s['speedup_engine_cpu']:.2f} engine CPU")
    print(f"load average start/end: {results['loadavg_start']} / {results['loadavg_end']} on {os.cpu_count()} CPUs")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
