"""Sandbox exec throughput and latency: cold run (fresh container per exec) vs warm pool exec at pool
sizes 1/4/8, container start cost, memory per warm container; optionally all 164 HumanEval problems
through the grader (canonical must pass, broken must fail).

    python3 benchmarks/sandbox_bench.py [--execs 200] [--cold 10] [--backend docker] [--humaneval]

Prints a table and writes benchmarks/results/sandbox_bench.json. Targets (warm pool, trivial Python
snippet; issue 21): >= 200 exec/s and p50 < 5 ms at pool size 1, an episode cycle (acquire with its
health check, one exec, release with its reset) p50 < 60 ms. The machine's load average is recorded
with every run: on 2 shared cores it moves these numbers more than any change.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from agentrl.sandbox import SandboxPool  # noqa: E402
from agentrl.sandbox.backend import make_sandbox  # noqa: E402

SNIPPET = "print(sum(range(10)))"
TARGET_RATE, TARGET_P50_MS, TARGET_CYCLE_P50_MS = 200.0, 5.0, 60.0


def pct(values: list[float], q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, int(q * len(s)))]


def summarize(latencies: list[float], wall: float) -> dict:
    return {"n": len(latencies), "exec_per_s": len(latencies) / wall, "p50_ms": 1000 * pct(latencies, 0.5),
            "p90_ms": 1000 * pct(latencies, 0.9), "p99_ms": 1000 * pct(latencies, 0.99),
            "mean_ms": 1000 * statistics.fmean(latencies)}


def bench_cold(backend: str, n: int) -> dict:
    """A fresh sandbox per exec: start, run the snippet, close."""
    lat, starts, closes = [], [], []
    t_all = time.perf_counter()
    for _ in range(n):
        t0 = time.perf_counter()
        sb = make_sandbox(backend)
        sb.start()
        t1 = time.perf_counter()
        r = sb.run_python(SNIPPET, timeout=30)
        t2 = time.perf_counter()
        sb.close()
        t3 = time.perf_counter()
        assert r.stdout == "45\n", r
        lat.append(t3 - t0)
        starts.append(t1 - t0)
        closes.append(t3 - t2)
    out = summarize(lat, time.perf_counter() - t_all)
    out.update(start_p50_ms=1000 * pct(starts, 0.5), close_p50_ms=1000 * pct(closes, 0.5))
    return out


def _proc_cpu_s(pid: int) -> float:
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return 0.0


def _engine_pids(container_ids: list[str]) -> dict[str, list[int]]:
    """dockerd, containerd and the shims of these containers (for CPU accounting)."""
    found: dict[str, list[int]] = {"dockerd": [], "containerd": [], "shim": []}
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            comm = (proc / "comm").read_text().strip()
            cmd = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue
        if comm in ("dockerd", "containerd"):
            found[comm].append(int(proc.name))
        elif comm.startswith("containerd-shim") and any(c in cmd for c in container_ids):
            found["shim"].append(int(proc.name))
    return found


def _cpu_snapshot(backend: str, pool: SandboxPool) -> dict[str, float]:
    """CPU seconds used so far by each party of an exec: this client, the engine, the sandboxes."""
    snap = {"client": time.process_time()}
    if backend == "docker":
        ids = [sb.container_id for sb in list(pool._all)]
        for name, pids in _engine_pids(ids).items():
            snap[name] = sum(_proc_cpu_s(p) for p in pids)
        snap["in_container"] = sum((_read_int(Path("/sys/fs/cgroup/cpuacct/docker") / c / "cpuacct.usage") or 0)
                                   for c in ids) / 1e9
    return snap


def bench_warm(backend: str, size: int, n: int) -> dict:
    """``size`` concurrent episodes, each looping execs on its warm sandbox, ``n`` execs in total."""
    with SandboxPool(size=size, backend=backend) as pool:
        t_warm = time.perf_counter()
        for _ in range(size):  # one untimed exec each (first-use costs)
            with pool.session() as sb:
                sb.run_python(SNIPPET, timeout=30)
        warm_check_s = time.perf_counter() - t_warm
        lat: list[float] = []
        lock = threading.Lock()
        per_worker = [n // size + (1 if i < n % size else 0) for i in range(size)]

        def worker(k: int) -> None:
            with pool.session() as sb:
                for _ in range(k):
                    t0 = time.perf_counter()
                    r = sb.run_python(SNIPPET, timeout=30)
                    dt = time.perf_counter() - t0
                    assert r.stdout == "45\n", r
                    with lock:
                        lat.append(dt)

        threads = [threading.Thread(target=worker, args=(k,)) for k in per_worker]
        cpu0 = _cpu_snapshot(backend, pool)
        t0 = time.perf_counter()
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        wall = time.perf_counter() - t0
        cpu1 = _cpu_snapshot(backend, pool)
        cpu_ms = {k: 1000 * (cpu1[k] - cpu0[k]) / n for k in cpu0}
        # Episode cycle: acquire (health check) + one exec + release (reset).
        cycles = []
        for _ in range(20):
            t1 = time.perf_counter()
            with pool.session() as sb:
                sb.run_python(SNIPPET, timeout=30)
            cycles.append(time.perf_counter() - t1)
        memory = warm_memory(pool) if backend == "docker" else {}
    out = summarize(lat, wall)
    total = sum(cpu_ms.values())
    out.update(size=size, episode_cycle_p50_ms=1000 * pct(cycles, 0.5), first_use_s=warm_check_s,
               cpu_ms_per_exec=cpu_ms, cpu_ms_per_exec_total=total,
               cpu_bound_exec_per_s_2_cores=2000 / total if total else None, **memory)
    return out


def _read_int(path: Path) -> int | None:
    try:
        return int(path.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None


def warm_memory(pool: SandboxPool) -> dict:
    """Per warm container: cgroup memory (RSS of keep-alive + init + executor, and total incl. tmpfs/cache)
    and the host-side containerd shim."""
    ids = [sb.container_id for sb in list(pool._all)]
    rss, usage, shim = [], [], []
    for cid in ids:
        cg = Path("/sys/fs/cgroup/memory/docker") / cid
        stat = {}
        try:
            for line in (cg / "memory.stat").read_text().splitlines():
                k, v = line.split()
                stat[k] = int(v)
        except OSError:
            continue
        rss.append(stat.get("total_rss", stat.get("rss", 0)))
        usage.append(_read_int(cg / "memory.usage_in_bytes") or 0)
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            cmd = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode()
            if "containerd-shim" in cmd and any(cid in cmd for cid in ids):
                for line in (proc / "status").read_text().splitlines():
                    if line.startswith("VmRSS:"):
                        shim.append(int(line.split()[1]) * 1024)
        except OSError:
            continue
    mib = 2**20
    return {"container_rss_mib": statistics.fmean(rss) / mib if rss else None,
            "container_cgroup_usage_mib": statistics.fmean(usage) / mib if usage else None,
            "shim_rss_mib": statistics.fmean(shim) / mib if shim else None}


def bench_humaneval(backend: str, concurrency: int) -> dict:
    from agentrl.sandbox.grader import Grader
    from agentrl.sandbox.humaneval import broken_completion, humaneval_files, load_problems

    problems = list(load_problems().values())
    grader = Grader(backend=backend, timeout=30)
    t0 = time.perf_counter()
    good = grader.grade_many([humaneval_files(p, p["canonical_solution"]) for p in problems], concurrency=concurrency)
    bad = grader.grade_many([humaneval_files(p, broken_completion(p)) for p in problems], concurrency=concurrency)
    wall = time.perf_counter() - t0
    return {"problems": len(problems), "canonical_passed": sum(v.passed for v in good),
            "broken_failed": sum(not v.passed for v in bad),
            "canonical_failures": [(p["task_id"], v.reason) for p, v in zip(problems, good, strict=True) if not v.passed],
            "broken_passes": [p["task_id"] for p, v in zip(problems, bad, strict=True) if v.passed],
            "wall_s": wall, "grades_per_s": 2 * len(problems) / wall}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--backend", default="docker", choices=["docker", "bwrap"])
    ap.add_argument("--execs", type=int, default=200, help="warm execs per pool size")
    ap.add_argument("--cold", type=int, default=10, help="cold runs")
    ap.add_argument("--sizes", default="1,4,8")
    ap.add_argument("--also-bwrap", action="store_true", help="add warm bwrap rows (sizes 1 and 4)")
    ap.add_argument("--humaneval", action="store_true", help="grade all 164 canonical + broken solutions")
    ap.add_argument("--out", default=str(ROOT / "benchmarks/results/sandbox_bench.json"))
    args = ap.parse_args(argv)

    results: dict = {"backend": args.backend, "snippet": SNIPPET, "cpus": os.cpu_count(),
                     "loadavg_start": os.getloadavg()[0], "targets": {"exec_per_s": TARGET_RATE, "p50_ms": TARGET_P50_MS,
                                                             "episode_cycle_p50_ms": TARGET_CYCLE_P50_MS}}
    results["cold"] = bench_cold(args.backend, args.cold)
    results["warm"] = [bench_warm(args.backend, int(s), args.execs) for s in args.sizes.split(",")]
    if args.also_bwrap and args.backend != "bwrap":
        results["warm_bwrap"] = [bench_warm("bwrap", s, args.execs) for s in (1, 4)]
    if args.humaneval:
        results["humaneval"] = bench_humaneval(args.backend, concurrency=2)
    results["loadavg_end"] = os.getloadavg()[0]
    # The targets are for one episode at a time: with ``size`` episodes sharing 2 cores a call waits for
    # the others (p50 ~ size / rate), so p50 < 5 ms at size 4 would need 800 exec/s.
    for w in results["warm"]:
        w["meets_target"] = (w["exec_per_s"] >= TARGET_RATE and w["p50_ms"] < TARGET_P50_MS
                             and w["episode_cycle_p50_ms"] < TARGET_CYCLE_P50_MS) if w["size"] == 1 else None
    results["meets_target"] = all(w["meets_target"] for w in results["warm"] if w["size"] == 1)

    c = results["cold"]
    print(f"backend={args.backend}  cpus={results['cpus']}  load avg {results['loadavg_start']:.1f} -> "
          f"{results['loadavg_end']:.1f}")
    print(f"{'mode':<22}{'exec/s':>8}{'p50 ms':>9}{'p90 ms':>9}{'p99 ms':>9}")
    print(f"{'cold run (start+exec+rm)':<22}{c['exec_per_s']:>8.1f}{c['p50_ms']:>9.0f}{c['p90_ms']:>9.0f}{c['p99_ms']:>9.0f}")
    for name, rows in (("warm", results["warm"]), ("warm bwrap", results.get("warm_bwrap", []))):
        for w in rows:
            print(f"{name + ' pool size ' + str(w['size']):<22}{w['exec_per_s']:>8.1f}{w['p50_ms']:>9.1f}"
                  f"{w['p90_ms']:>9.1f}{w['p99_ms']:>9.1f}   episode cycle p50 {w['episode_cycle_p50_ms']:.0f} ms, "
                  f"CPU {w['cpu_ms_per_exec_total']:.1f} ms/exec "
                  f"({', '.join(f'{k} {v:.1f}' for k, v in w['cpu_ms_per_exec'].items())})")
    print(f"container start p50 {c['start_p50_ms']:.0f} ms, close p50 {c['close_p50_ms']:.0f} ms")
    mem = results["warm"][-1]
    if mem.get("container_rss_mib") is not None:
        print(f"memory per warm container: {mem['container_rss_mib']:.1f} MiB RSS in the container "
              f"({mem['container_cgroup_usage_mib']:.1f} MiB cgroup usage incl. cache), "
              f"+ {mem['shim_rss_mib'] or 0:.1f} MiB containerd shim on the host")
    if "humaneval" in results:
        h = results["humaneval"]
        print(f"HumanEval: {h['canonical_passed']}/{h['problems']} canonical passed, {h['broken_failed']}/"
              f"{h['problems']} broken failed, {h['wall_s']:.0f} s ({h['grades_per_s']:.2f} grades/s)")
    print(f"targets (>= {TARGET_RATE:.0f} exec/s, p50 < {TARGET_P50_MS:.0f} ms, cycle p50 < "
          f"{TARGET_CYCLE_P50_MS:.0f} ms): "
          + ", ".join(f"size {w['size']} {'met' if w['meets_target'] else 'NOT met'}" for w in results["warm"]
                      if w["meets_target"] is not None) + " (the targets are for pool size 1)")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(results, indent=2) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
