"""Where a main-job GRPO step's wall time goes: ``agentrl train`` for a few minutes, then seconds per phase.

    python3 benchmarks/main_job_profile.py [--config examples/arithmetic/config.yaml] [--minutes 1.5]
                                           [--cache-dir C] [--out-dir D] [--json R.json] [-- extra overrides]

Phases per step, from the run's own metric rows: rollout (``rollout/seconds``), train (``train/seconds``:
the Ray call of every rank), weight sync (``sync/seconds``), the evaluation and the checkpoint (incl. the
best-policy export) every ``eval.every`` steps (``eval/seconds``, ``checkpoint/seconds``: shown per step,
i.e. divided by the steps between them), and ``other``: the rest of the step's ``elapsed_s`` (the driver's
Ray calls, the metric row, sample logs). The warm-up and the step-0 evaluation are not counted. In an
overlapping loop (``--loop async``) rollout and train run at once, so the phases add up to more than the step
and ``other`` goes negative.

CPU seconds per step by process kind (engines, trainer ranks, the rollout actor, the smg router, the driver,
Ray's own processes), from the run's process tree sampled every second from the step-0 row to the end, and
``busy_cores``: all of it over the wall time (what the machine's cores were used for while GRPO ran); both
measured up to the last step row.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PHASES = {"rollout": "rollout/seconds", "train": "train/seconds", "sync": "sync/seconds",
          "eval": "eval/seconds", "checkpoint": "checkpoint/seconds"}


def profile(rows: list[dict]) -> dict:
    steps = [r for r in rows if isinstance(r.get("step"), int) and "elapsed_s" in r]
    start = next(r for r in steps if r["step"] == 0)
    steps = [r for r in steps if r["step"] > 0]
    wall = steps[-1]["elapsed_s"] - start["elapsed_s"]
    n = len(steps)
    out = {"steps": n, "wall_s": round(wall, 2), "s_per_step": round(wall / n, 3)}
    known = 0.0
    for name, key in PHASES.items():
        total = sum(r.get(key, 0.0) for r in steps)
        known += total
        out[name] = round(total / n, 3)
    out["other"] = round((wall - known) / n, 3)
    out["trained_tokens_per_step"] = round(sum(r.get("train/n_tokens", 0.0) for r in steps) / n)
    out["generated_tokens_per_step"] = round(sum(r.get("rollout/trained_tokens", 0.0) for r in steps) / n)
    return out


KINDS = (("agentrl.engine", "engines"), ("TrainerRank", "trainer"), ("RolloutWorker", "rollout_actor"),
         ("smg", "router"))


def process_kind(cmdline: str, driver: bool) -> str:
    return "driver" if driver else next((kind for key, kind in KINDS if key in cmdline), "ray")


class CpuMeter:
    """Cumulative CPU seconds of a process tree by :func:`process_kind`, from :meth:`start` to the last
    :meth:`mark` (each process's latest sample: one that exits between samples loses at most a second)."""

    def __init__(self, root: int) -> None:
        self.root = root
        self.base: dict[int, float] = {}
        self.seen: dict[int, tuple[str, float]] = {}
        self.marked: dict[int, tuple[str, float]] = {}
        self.started: float | None = None
        self.wall = 0.0

    def sample(self) -> None:
        import psutil

        try:
            root = psutil.Process(self.root)
            procs = [root, *root.children(recursive=True)]
        except psutil.NoSuchProcess:
            return
        for proc in procs:
            try:
                times = proc.cpu_times()
                kind = process_kind(" ".join(proc.cmdline()), proc.pid == self.root)
            except psutil.Error:
                continue
            self.seen[proc.pid] = (kind, times.user + times.system)

    def start(self) -> None:
        self.sample()
        self.base = {pid: cpu for pid, (_, cpu) in self.seen.items()}
        self.started = time.monotonic()

    def mark(self) -> None:
        """The span measured ends here (a step row was just written)."""
        self.marked = dict(self.seen)
        self.wall = time.monotonic() - (self.started or time.monotonic())

    def per_kind(self) -> dict[str, float]:
        out: dict[str, float] = {}
        for pid, (kind, cpu) in self.marked.items():
            out[kind] = out.get(kind, 0.0) + cpu - self.base.get(pid, 0.0)
        return out


def run_measured(cmd: list[str], log: Path, metrics: Path) -> tuple[int, dict[str, float], float]:
    """Run ``cmd`` (output to ``log``); CPU seconds by process kind and wall seconds from the step-0 row to
    the last step row."""
    rows = 0
    with log.open("w") as f:
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT)
        meter = CpuMeter(proc.pid)
        while proc.poll() is None:
            text = metrics.read_text() if metrics.exists() else ""
            if meter.started is None and '"step": 0' in text:
                meter.start()
                rows = text.count('"step": ')
            elif meter.started is not None:
                meter.sample()
                if text.count('"step": ') > rows:
                    rows = text.count('"step": ')
                    meter.mark()
            time.sleep(1.0)
    return proc.returncode, meter.per_kind(), meter.wall


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", default="examples/arithmetic/config.yaml")
    p.add_argument("--minutes", type=float, default=1.5, help="GRPO wall budget")
    p.add_argument("--cache-dir", default=".cache/agentrl")
    p.add_argument("--out-dir", help="the run's output directory (default: a temporary one)")
    p.add_argument("--json", help="also write the profile here")
    p.add_argument("overrides", nargs="*", help="extra agentrl train overrides (after --)")
    args = p.parse_args(argv)
    out = Path(args.out_dir or tempfile.mkdtemp(prefix="main-job-profile-"))
    cmd = [sys.executable, "-m", "agentrl.cli", "train", args.config, "--output-dir", str(out), "--overwrite",
           "--cache_dir", args.cache_dir, "--max_minutes", str(args.minutes), "--steps", "100000", *args.overrides]
    print("+", " ".join(cmd), flush=True)
    rc, cpu, wall = run_measured(cmd, out.with_suffix(".log"), out / "metrics.jsonl")
    if rc:
        print(out.with_suffix(".log").read_text()[-3000:])
        return rc
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    result = profile(rows)
    result["cpu_s_per_step"] = {k: round(v / result["steps"], 3) for k, v in sorted(cpu.items())}
    result["busy_cores"] = round(sum(cpu.values()) / wall, 2) if wall else None
    print(f"{'phase':<12}{'s/step':>8}")
    for k in (*PHASES, "other"):
        print(f"{k:<12}{result[k]:>8.3f}")
    print(f"{'total':<12}{result['s_per_step']:>8.3f}  ({result['steps']} steps in {result['wall_s']:.0f} s; "
          f"{result['generated_tokens_per_step']} generated, {result['trained_tokens_per_step']} trained tokens/step)")
    print(f"CPU s/step: {result['cpu_s_per_step']}; busy cores {result['busy_cores']} ")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
