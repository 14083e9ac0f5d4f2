"""Benchmark 1: rollout client + smg router overhead against an engine stub that answers instantly.

For concurrency 1 / 32 / 256 it measures req/s and p50/p99 latency of one ``/generate`` call
(32 prompt ids, 1 new token, ``return_logprob``) for each client, sent directly to the stub and
through a real smg router:

- ``aiohttp``: a raw pooled ``aiohttp.ClientSession`` (the floor for aiohttp);
- ``httpx``: a tuned ``httpx.AsyncClient`` (HTTP/1.1, keep-alive pool as large as the concurrency,
  no env proxies);
- ``RolloutClient``: agentrl's client (aiohttp inside; routing-key header, parsing, retry loop).

"Added p50" is the p50 of a configuration minus the p50 of raw aiohttp direct at the same concurrency.
Targets (2 cores): >= 2,000 req/s and <= 1 ms added p50 for RolloutClient through smg.

Wall-clock numbers depend on what else runs on the machine, so each cell also records the CPU time
spent per request by the client process, the stub and the smg router (from /proc), and the load
average. ``cpu_capacity_req_per_s`` = 2 cores / (client + router + stub CPU per request): the rate two
otherwise idle cores could sustain for that configuration.

    python benchmarks/client_bench.py [--requests 3000] [--out benchmarks/results/client_bench.json]

``--serve``: instead, ``agentrl serve --engines N`` on the tiny model (real engines behind smg) under
``--serve-requests`` requests at ``--serve-concurrency``, for each setup of ``--serve-setups``
(``N`` engines, or ``N:CPUS`` to give them CPUS cores to split: ``2:4`` reproduces torch's default of
one thread per core in each engine), each repeated and interleaved so drifting machine load hits every
setup alike; writes ``benchmarks/results/serve_engines.json``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import shlex
import statistics
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from agentrl.rollout.client import ROUTING_KEY_HEADER, RolloutClient  # noqa: E402
from agentrl.rollout.router import SmgRouter, free_port  # noqa: E402

PROMPT = list(range(1, 33))
PARAMS = {"max_new_tokens": 1}


def _body(i: int) -> bytes:
    return json.dumps({"input_ids": PROMPT, "sampling_params": PARAMS, "return_logprob": True,
                       "rid": f"b{i}"}).encode()


def _cpu_seconds(pid: int | None) -> float:
    """utime + stime of a process from /proc (0.0 if unknown); pid None means this process."""
    if pid is None:
        return time.process_time()
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def _drive(send, n_requests: int, concurrency: int) -> dict:
    """Run n_requests through ``send(i)`` with ``concurrency`` workers; latency of each call in ms."""
    latencies: list[float] = []
    counter = iter(range(n_requests))

    async def worker() -> None:
        for i in counter:
            t0 = time.perf_counter()
            await send(i)
            latencies.append((time.perf_counter() - t0) * 1e3)

    for i in range(min(concurrency, 50)):  # warm the connection pool
        await send(-1 - i)
    t0 = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    wall = time.perf_counter() - t0
    latencies.sort()
    return {
        "requests": n_requests,
        "req_per_s": round(n_requests / wall, 1),
        "p50_ms": round(statistics.median(latencies), 3),
        "p99_ms": round(latencies[min(len(latencies) - 1, int(0.99 * len(latencies)))], 3),
    }


async def bench_aiohttp(url: str, n: int, concurrency: int) -> dict:
    import aiohttp

    connector = aiohttp.TCPConnector(limit=max(concurrency, 100))
    async with aiohttp.ClientSession(connector=connector) as session:
        target = url + "/generate"
        headers = {"Content-Type": "application/json"}

        async def send(i: int) -> None:
            headers_i = {**headers, ROUTING_KEY_HEADER: f"s{i % 512}"}
            async with session.post(target, data=_body(i), headers=headers_i) as resp:
                json.loads(await resp.read())
                assert resp.status == 200

        return await _drive(send, n, concurrency)


async def bench_httpx(url: str, n: int, concurrency: int) -> dict:
    import httpx

    limits = httpx.Limits(max_connections=max(concurrency, 100), max_keepalive_connections=max(concurrency, 100))
    async with httpx.AsyncClient(limits=limits, http2=False, trust_env=False, timeout=60.0) as client:
        target = url + "/generate"

        async def send(i: int) -> None:
            resp = await client.post(target, content=_body(i), headers={
                "Content-Type": "application/json", ROUTING_KEY_HEADER: f"s{i % 512}"})
            json.loads(resp.content)
            assert resp.status_code == 200

        return await _drive(send, n, concurrency)


async def bench_rollout_client(url: str, n: int, concurrency: int) -> dict:
    async with RolloutClient(url, max_connections=max(concurrency, 100)) as client:

        async def send(i: int) -> None:
            res = await client.generate(PROMPT, PARAMS, session_id=f"s{i % 512}")
            assert len(res.turn.output_ids) == 1

        return await _drive(send, n, concurrency)


CLIENTS = {"aiohttp": bench_aiohttp, "httpx": bench_httpx, "RolloutClient": bench_rollout_client}


def _wait_ok(url: str, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    while True:
        try:
            with opener.open(url, timeout=1) as r:
                if r.status == 200:
                    return
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)


def _serve_once(model_dir: Path, engines: int, cpus: int | None, args: argparse.Namespace) -> dict:
    port = free_port()
    cmd = [sys.executable, "-m", "agentrl.cli", "serve", "--model", str(model_dir), "--engines", str(engines),
           "--port", str(port)] + (["--cpus", str(cpus)] if cpus else [])
    proc = subprocess.Popen(cmd, cwd=REPO, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL, text=True, start_new_session=True)
    try:
        url = proc.stdout.readline().strip()  # printed once every engine and the router are healthy
        if not url:
            raise RuntimeError(f"agentrl serve exited with {proc.wait()}")
        params = {"max_new_tokens": args.serve_new_tokens, "ignore_eos": True}

        async def run() -> dict:
            async with RolloutClient(url, max_connections=max(args.serve_concurrency, 100)) as client:

                async def send(i: int) -> None:
                    res = await client.generate(PROMPT, params, session_id=f"s{i % 512}")
                    assert len(res.turn.output_ids) == args.serve_new_tokens

                return await _drive(send, args.serve_requests, args.serve_concurrency)

        return asyncio.run(run())
    finally:
        proc.send_signal(2)  # Ctrl-C: serve stops its engines and router
        proc.wait(timeout=60)


def serve_bench(args: argparse.Namespace) -> int:
    import tempfile

    from agentrl.engine.launch import threads_per_engine
    from agentrl.models.tiny import make_tiny_model

    setups = [(int(a), int(b) if b else None) for a, _, b in (s.partition(":") for s in args.serve_setups)]
    rows: list[dict] = []
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = make_tiny_model(Path(tmp) / "model", seed=0)
        for rep in range(args.serve_repeats):
            for engines, cpus in setups if rep % 2 == 0 else setups[::-1]:
                result = _serve_once(model_dir, engines, cpus, args)
                row = {"engines": engines, "cpus": cpus or len(os.sched_getaffinity(0)),
                       "threads_per_engine": threads_per_engine(engines, cpus), "repeat": rep, **result,
                       "load_avg_1m": round(os.getloadavg()[0], 2)}
                rows.append(row)
                print(f"  {row}", file=sys.stderr)
    summary = []
    for engines, cpus in setups:
        mine = [r for r in rows if r["engines"] == engines and r["cpus"] == (cpus or len(os.sched_getaffinity(0)))]
        rates = sorted(r["req_per_s"] for r in mine)
        summary.append({"engines": engines, "cpus": mine[0]["cpus"], "threads_per_engine": mine[0]["threads_per_engine"],
                        "req_per_s_min": rates[0], "req_per_s_median": statistics.median(rates),
                        "req_per_s_max": rates[-1], "p50_ms_median": statistics.median(r["p50_ms"] for r in mine)})
    print("| engines | cores | threads/engine | req/s (min / median / max) | p50 ms (median) |")
    print("|---|---|---|---|---|")
    for r in summary:
        print(f"| {r['engines']} | {r['cpus']} | {r['threads_per_engine']} | {r['req_per_s_min']:.0f} / "
              f"{r['req_per_s_median']:.0f} / {r['req_per_s_max']:.0f} | {r['p50_ms_median']:.1f} |")
    out = Path(args.out if args.out != str(DEFAULT_OUT) else REPO / "benchmarks" / "results" / "serve_engines.json")
    out.write_text(json.dumps({
        "benchmark": "serve_engines",
        "description": (f"agentrl serve --engines N on the tiny model: {args.serve_requests} requests "
                        f"({len(PROMPT)} prompt ids, {args.serve_new_tokens} new tokens) at concurrency "
                        f"{args.serve_concurrency} through smg with RolloutClient"),
        "machine": {"cpus": os.cpu_count(), "affinity": len(os.sched_getaffinity(0)),
                    "python": platform.python_version()},
        "summary": summary, "rows": rows,
    }, indent=2) + "\n")
    print(f"wrote {out}")
    return 0


DEFAULT_OUT = REPO / "benchmarks" / "results" / "client_bench.json"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=2000, help="requests per cell at concurrency >= 32")
    parser.add_argument("--requests-httpx", type=int, default=500,
                        help="requests per httpx cell at concurrency >= 32 (it is ~10x slower)")
    parser.add_argument("--requests-c1", type=int, default=600, help="requests per cell at concurrency 1")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 32, 256])
    parser.add_argument("--clients", nargs="+", default=list(CLIENTS), choices=list(CLIENTS))
    parser.add_argument("--router-args", default="", help="extra `smg launch` flags, one shell-quoted string")
    parser.add_argument("--paths", nargs="+", default=["direct", "smg"], choices=["direct", "smg"])
    parser.add_argument("--out", default=str(DEFAULT_OUT))
    parser.add_argument("--serve", action="store_true", help="benchmark `agentrl serve` engines instead")
    parser.add_argument("--serve-setups", nargs="+", default=["1", "2", "2:4"])
    parser.add_argument("--serve-requests", type=int, default=300)
    parser.add_argument("--serve-concurrency", type=int, default=64)
    parser.add_argument("--serve-new-tokens", type=int, default=1)
    parser.add_argument("--serve-repeats", type=int, default=3)
    args = parser.parse_args(argv)
    if args.serve:
        return serve_bench(args)

    port = free_port()
    stub = subprocess.Popen([sys.executable, str(REPO / "benchmarks" / "stub_engine.py"), "--port", str(port)],
                            stdin=subprocess.DEVNULL, start_new_session=True)
    rows: list[dict] = []
    try:
        stub_url = f"http://127.0.0.1:{port}"
        _wait_ok(stub_url + "/health")
        with SmgRouter([stub_url], extra_args=shlex.split(args.router_args)) as router:
            targets = {p: {"direct": stub_url, "smg": router.url}[p] for p in args.paths}
            for concurrency in args.concurrency:
                for path, url in targets.items():
                    for name in args.clients:
                        n = args.requests_c1 if concurrency == 1 else (
                            args.requests_httpx if name == "httpx" else args.requests)
                        pids = {"client": None, "stub": stub.pid, "router": router.pid}
                        cpu0 = {k: _cpu_seconds(p) for k, p in pids.items()}
                        result = asyncio.run(CLIENTS[name](url, n, concurrency))
                        cpu_us = {f"cpu_us_per_req_{k}": round((_cpu_seconds(p) - cpu0[k]) / n * 1e6, 1)
                                  for k, p in pids.items()}
                        if path == "direct":
                            cpu_us["cpu_us_per_req_router"] = 0.0  # the router only saw health checks
                        total_us = sum(cpu_us.values())
                        rows.append({"client": name, "path": path, "concurrency": concurrency, **result, **cpu_us,
                                     "cpu_capacity_req_per_s": round(2 * 1e6 / total_us) if total_us else None,
                                     "load_avg_1m": round(os.getloadavg()[0], 2)})
                        print(f"  {name:<13} {path:<6} c={concurrency:<4} {result}", file=sys.stderr)
    finally:
        stub.kill()
        stub.wait()

    floor = {r["concurrency"]: r["p50_ms"] for r in rows if r["client"] == "aiohttp" and r["path"] == "direct"}
    for r in rows:
        r["added_p50_ms"] = round(r["p50_ms"] - floor.get(r["concurrency"], r["p50_ms"]), 3) \
            if r["concurrency"] in floor else None

    header = (f"{'client':<14}{'path':<8}{'conc':>5}{'req/s':>9}{'p50 ms':>9}{'p99 ms':>9}{'+p50 ms':>9}"
              f"{'cli us':>8}{'smg us':>8}{'stub us':>8}{'2-core cap':>11}{'load':>6}")
    print(header)
    print("-" * len(header))
    for r in rows:
        added = "" if r["added_p50_ms"] is None else f"{r['added_p50_ms']:+.3f}"
        print(f"{r['client']:<14}{r['path']:<8}{r['concurrency']:>5}{r['req_per_s']:>9.0f}"
              f"{r['p50_ms']:>9.3f}{r['p99_ms']:>9.3f}{added:>9}{r['cpu_us_per_req_client']:>8.0f}"
              f"{r['cpu_us_per_req_router']:>8.0f}{r['cpu_us_per_req_stub']:>8.0f}"
              f"{r['cpu_capacity_req_per_s'] or 0:>11}{r['load_avg_1m']:>6.1f}")

    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({
        "benchmark": "client_bench",
        "description": "client + smg router overhead against an instant stub engine",
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version(),
                    "load_avg_at_end": os.getloadavg()},
        "targets": {"req_per_s": 2000, "added_p50_ms": 1.0},
        "router_args": args.router_args,
        "rows": rows,
    }, indent=2) + "\n")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
