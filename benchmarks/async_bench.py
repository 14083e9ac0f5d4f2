"""sync vs async vs fully_async on a long-tail workload: trained episodes per minute, idle fractions,
held-out accuracy after equal wall time, staleness.

The workload is :class:`agentrl.envs.latency.LongTailArithmeticEnv`: the multi-turn arithmetic task
whose ``add`` tool sleeps a lognormal time (median 1 s, log-std 1.2, cap 30 s: mean ~2 s, p99 ~16 s),
as remote tools and sandboxes do. The same warm model (``--model-path``, or the tiny model's supervised
warm-up, cached in ``--cache-dir``), the same settings and the same GRPO wall-time budget (``--minutes``)
for each loop, run one after the other as ``agentrl train`` processes.

Measured, per loop:
- ``episodes_per_minute``: trained samples (one per episode unless an episode forked) per GRPO minute,
  over every step but the last (whose row includes the final evaluation);
- ``trainer_idle_fraction``: 1 - (train + weight sync seconds) / GRPO wall time;
- ``engine_idle_fraction``: share of ``/get_load`` polls (every 0.25 s) that found the engine with no request;
- ``eval_accuracy_start`` / ``eval_accuracy_end``: greedy held-out accuracy at step 0 and after the budget;
- staleness: the largest version lag of a trained token, the token-weighted mean lag, the lag histogram.

    python benchmarks/async_bench.py --minutes 2      # writes benchmarks/results/async_bench.json
    python benchmarks/async_bench.py --minutes 2 --model-path .cache/agentrl/warm-<key>   # skip the warm-up
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import threading
import time
import urllib.request
from collections import Counter
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
LOOPS = ("sync", "async", "fully_async")


def overrides(args: argparse.Namespace, loop: str) -> list[str]:
    """The one set of settings every loop runs with; only ``--loop`` differs."""
    return [
        "--env", "agentrl.envs.latency:LongTailArithmeticEnv", "--schedule", loop,
        "--cache_dir", str(args.cache_dir), "--steps", "100000", "--max_minutes", str(args.minutes),
        "--max_staleness", str(args.max_staleness), "--partial_rollout", args.partial_rollout,
        "--rollout.num_engines", "1", "--rollout.prompts_per_step", "8", "--rollout.samples_per_prompt", "8",
        "--rollout.concurrency", "64", "--rollout.max_new_tokens", "40",
        # one torch thread: on 2 cores shared with a trainer (and here other jobs) more threads spin
        "--rollout.engine_args", '["--num-threads", "1"]',
        "--eval.every", "100000", "--eval.num_tasks", str(args.eval_tasks),
        *(["--trainer.lr", str(args.lr), "--trainer.lr_warmup_steps", "5", "--trainer.lr_decay_style", "constant"]
          if args.lr is not None else []),
        "--trainer.loss.importance_weights", "tis", "--log_samples", "0",
        *(["--model.path", str(args.model_path), "--expert", "null"] if args.model_path else []),
    ]


class EngineIdleMeter(threading.Thread):
    """Polls the run's engines' ``/get_load`` (ports read from ``logs/engine-<port>.log``) once GRPO
    started (the step-0 row is in metrics.jsonl), until stopped."""

    def __init__(self, out: Path, period_s: float = 0.25) -> None:
        super().__init__(daemon=True)
        self.out, self.period_s = out, period_s
        self.polls = Counter()
        self.stopped = threading.Event()
        self.opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))

    def grpo_started(self) -> bool:
        path = self.out / "metrics.jsonl"
        return path.exists() and any('"step": 0' in line for line in path.read_text().splitlines())

    def run(self) -> None:
        while not self.stopped.is_set() and not self.grpo_started():
            self.stopped.wait(0.5)
        ports = [int(m.group(1)) for p in (self.out / "logs").glob("engine-*.log")
                 if (m := re.fullmatch(r"engine-(\d+)\.log", p.name))]
        while not self.stopped.wait(self.period_s):
            for port in ports:
                try:
                    with self.opener.open(f"http://127.0.0.1:{port}/get_load", timeout=2) as resp:
                        load = json.loads(resp.read())[0]
                    self.polls["idle" if load["num_reqs"] == 0 else "busy"] += 1
                except (OSError, ValueError, KeyError, IndexError):
                    pass  # the run is stopping

    def idle_fraction(self) -> float | None:
        n = self.polls["idle"] + self.polls["busy"]
        return self.polls["idle"] / n if n else None


def summarise(out: Path, loop: str, engine_idle: float | None, wall_s: float) -> dict[str, Any]:
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    steps = [r for r in rows if "step" in r]
    start, trained = steps[0], [r for r in steps if r["step"] > 0]
    # Rates over the steps before the last: the last row also holds the final held-out evaluation.
    timed = trained[:-1]
    grpo_s = timed[-1]["elapsed_s"] - start["elapsed_s"] if timed else 0.0
    samples = sum(r.get("train/n_samples", 0.0) for r in timed)
    busy = sum(r.get("train/seconds", 0.0) + r.get("sync/seconds", 0.0) for r in timed)
    hist: Counter[str] = Counter()
    for r in trained:
        hist.update({k.removeprefix("rollout/staleness_hist/"): v for k, v in r.items()
                     if k.startswith("rollout/staleness_hist/")})
    tokens = sum(hist.values())
    generated = sum(r.get("rollout/tokens_generated", 0.0) for r in trained)
    discarded = sum(r.get("rollout/tokens_discarded", 0.0) for r in trained)
    return {
        "loop": loop, "steps": len(trained), "grpo_seconds": round(grpo_s, 1), "process_seconds": round(wall_s, 1),
        "trained_episodes": samples, "episodes_per_minute": round(samples / (grpo_s / 60), 2) if grpo_s else 0.0,
        "episodes_generated": sum(r.get("rollout/episodes", 0.0) for r in timed),
        "generated_episodes_per_minute": round(sum(r.get("rollout/episodes", 0.0) for r in timed) / (grpo_s / 60), 2)
        if grpo_s else 0.0,
        "trainer_idle_fraction": round(1 - busy / grpo_s, 3) if grpo_s else None,
        "engine_idle_fraction": None if engine_idle is None else round(engine_idle, 3),
        "eval_accuracy_start": start.get("eval_accuracy"), "eval_accuracy_end": trained[-1].get("eval_accuracy") if trained else None,
        "staleness_max": max((r.get("rollout/staleness_max", 0.0) for r in trained), default=0.0),
        "staleness_mean": round(sum(int(k) * v for k, v in hist.items() if k.isdigit()) / tokens, 3) if tokens else 0.0,
        "staleness_hist_tokens": dict(sorted(hist.items())),
        "stale_groups_dropped": sum(r.get("rollout/stale_groups", 0.0) for r in trained),
        "turns_aborted": sum(r.get("rollout/turns_aborted", 0.0) for r in trained),
        "tokens_generated": generated,
        "tokens_discarded": discarded,
        # drawn, thrown away at a weight update (abort) and drawn again: what resume saves
        "regenerated_token_fraction": round(discarded / generated, 4) if generated else None,
        "unproven_trained_tokens": sum(r.get("rollout/unproven_trained_tokens", 0.0) for r in trained),
        "verify_refused": sum(r.get("verify/refused", 0.0) for r in trained),
        "seconds_per_step": round(grpo_s / len(timed), 2) if timed else None,
    }


def run_loop(args: argparse.Namespace, loop: str, attempts: int = 3) -> dict[str, Any]:
    """One loop's run; a run that died before its first GRPO step (Ray's head timing out on a loaded
    machine, as seen here) is started again, up to ``attempts`` times."""
    for attempt in range(1, attempts + 1):
        try:
            return run_once(args, loop)
        except RunFailed as failed:
            started_grpo = (args.runs_dir / loop / "metrics.jsonl").exists() and '"step": 1' in (
                args.runs_dir / loop / "metrics.jsonl").read_text()
            if started_grpo or attempt == attempts:
                raise SystemExit(str(failed)) from None
            print(f"async_bench: {failed}; starting it again", flush=True)
    raise AssertionError("unreachable")


class RunFailed(RuntimeError):
    pass


def ray_env() -> dict[str, str]:
    """No token auth on the benchmark's own loopback head: other jobs here rewrite ~/.ray/auth_token."""
    import os

    return {**os.environ, "RAY_AUTH_MODE": "disabled"}


class RayHead:
    """One local Ray head for every run (``ray start --head --block``, this process's child): on this
    loaded machine a run's own ``ray.init`` often missed Ray's fixed 30 s raylet deadline. Started again
    until it comes up; stopped by signalling its own process group."""

    def __init__(self, log: Path, num_cpus: int = 4, attempts: int = 5) -> None:
        import os
        import signal

        from agentrl.engine.launch import free_port

        self.log, self.os, self.signal = log, os, signal
        for _ in range(attempts):
            self.address = f"127.0.0.1:{free_port()}"
            with log.open("a") as f:
                self.proc = subprocess.Popen(
                    ["ray", "start", "--head", "--block", "--port", self.address.split(":")[1],
                     f"--num-cpus={num_cpus}", "--include-dashboard=false", "--disable-usage-stats"],
                    stdout=f, stderr=subprocess.STDOUT, start_new_session=True, env=ray_env())
            deadline = time.monotonic() + 180
            while time.monotonic() < deadline and self.proc.poll() is None:
                if "Ray runtime started" in log.read_text():
                    return
                time.sleep(1)
            self.stop()
            print("async_bench: the Ray head did not start; trying again", flush=True)
        raise SystemExit(f"async_bench: no Ray head after {attempts} attempts; see {log}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.os.killpg(self.proc.pid, self.signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.os.killpg(self.proc.pid, self.signal.SIGKILL)
        self.log.write_text(self.log.read_text().replace("Ray runtime started", "Ray runtime was started"))


def run_once(args: argparse.Namespace, loop: str) -> dict[str, Any]:
    out = args.runs_dir / loop
    cmd = [sys.executable, "-m", "agentrl.run.cli", str(args.config), "--output-dir", str(out), "--overwrite",
           *overrides(args, loop)]
    if args.ray_address:  # engines stay the rollout actor's children, as in a local run
        cmd += ["--ray.address", args.ray_address, "--ray.place_engines", "false"]
    meter = EngineIdleMeter(out)
    meter.start()
    started = time.monotonic()
    log = (args.runs_dir / f"{loop}.log").open("a")
    print(f"async_bench: {loop}: {' '.join(cmd)}", flush=True)
    try:
        proc = subprocess.run(cmd, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, timeout=args.minutes * 60 + 1800,
                              env=ray_env())
    finally:
        meter.stopped.set()
        meter.join(5)
        log.close()
    if proc.returncode != 0:
        raise RunFailed(f"async_bench: the {loop} run failed (exit {proc.returncode}); see {args.runs_dir / f'{loop}.log'}")
    return summarise(out, loop, meter.idle_fraction(), time.monotonic() - started)


def table(results: dict[str, dict[str, Any]]) -> str:
    cols = [("loop", "loop"), ("steps", "steps"), ("trained episodes/min", "episodes_per_minute"),
            ("generated/min", "generated_episodes_per_minute"), ("x sync", "speedup_vs_sync"),
            ("trainer idle", "trainer_idle_fraction"), ("engine idle", "engine_idle_fraction"),
            ("acc start", "eval_accuracy_start"), ("acc end", "eval_accuracy_end"),
            ("stale max", "staleness_max"), ("stale mean", "staleness_mean"), ("s/step", "seconds_per_step")]
    lines = ["| " + " | ".join(c for c, _ in cols) + " |", "|" + "---|" * len(cols)]
    for r in results.values():
        lines.append("| " + " | ".join(str(r.get(k)) for _, k in cols) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--minutes", type=float, default=2.0, help="GRPO wall-time budget of each loop")
    p.add_argument("--loops", default=",".join(LOOPS))
    p.add_argument("--config", type=Path, default=REPO / "examples" / "arithmetic" / "config.yaml")
    p.add_argument("--cache-dir", type=Path, default=REPO / ".cache" / "agentrl")
    p.add_argument("--runs-dir", type=Path, default=REPO / "runs" / "async_bench")
    p.add_argument("--max-staleness", type=int, default=2)
    p.add_argument("--partial-rollout", default="continue", choices=["continue", "abort", "resume"])
    p.add_argument("--eval-tasks", type=int, default=100)
    p.add_argument("--lr", type=float, default=None,
                   help="a constant rate after 5 warm-up steps instead of the config's schedule (the main job's: 3e-4, "
                        "20 warm-up steps, cosine). The 2-minute runs at a constant 1e-4 / 3e-4 "
                        "(benchmarks/results/async_bench_*2min*.json) were too short for the schedule to matter: "
                        "every loop was still in Adam's sign-like first steps, so the loop with the most steps moved "
                        "the most and lost the most accuracy")
    p.add_argument("--model-path", type=Path, default=None,
                   help="an already warmed-up tiny model dir (e.g. a warm-* dir of an arithmetic run's cache): "
                        "no warm-up; without it the first run warms the tiny model up (cached in --cache-dir)")
    p.add_argument("--output", type=Path, default=REPO / "benchmarks" / "results" / "async_bench.json")
    p.add_argument("--own-ray", action="store_true", help="let each run start its own local Ray (no shared head)")
    args = p.parse_args(argv)
    args.runs_dir.mkdir(parents=True, exist_ok=True)
    head = None if args.own_ray else RayHead(args.runs_dir / "ray_head.log")
    args.ray_address = None if head is None else head.address
    try:
        results = {loop: run_loop(args, loop) for loop in args.loops.split(",")}
    finally:
        if head is not None:
            head.stop()
    base = results.get("sync", {}).get("episodes_per_minute")
    for r in results.values():
        r["speedup_vs_sync"] = round(r["episodes_per_minute"] / base, 2) if base else None
    print(table(results))
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps({
        "workload": "agentrl.envs.latency:LongTailArithmeticEnv (add tool: lognormal median 1 s, sigma 1.2, cap 30 s)",
        "minutes": args.minutes, "settings": overrides(args, "<loop>"), "config": str(args.config.relative_to(REPO)),
        "model": str(args.model_path) if args.model_path else "warm-up of the tiny model (cached)",
        "machine": "2 shared CPU cores", "loops": results, "table": table(results)}, indent=2) + "\n")
    print(f"async_bench: wrote {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
