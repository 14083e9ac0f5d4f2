"""Where a main-job GRPO step's wall time goes: ``agentrl train`` for a few minutes, then seconds per phase.

    python3 benchmarks/main_job_profile.py [--config examples/arithmetic/config.yaml] [--minutes 1.5]
                                           [--cache-dir C] [--out-dir D] [--json R.json] [-- extra overrides]

Phases per step, from the run's own metric rows: rollout (``rollout/seconds``), train (``train/seconds``:
the Ray call of every rank), weight sync (``sync/seconds``), the evaluation and the checkpoint (incl. the
best-policy export) every ``eval.every`` steps (``eval/seconds``, ``checkpoint/seconds``: shown per step,
i.e. divided by the steps between them), and ``other``: the rest of the step's ``elapsed_s`` (the driver's
Ray calls, the metric row, sample logs). The warm-up and the step-0 evaluation are not counted.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
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
    with out.with_suffix(".log").open("w") as log:
        rc = subprocess.run(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT).returncode
    if rc:
        print(out.with_suffix(".log").read_text()[-3000:])
        return rc
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    result = profile(rows)
    print(f"{'phase':<12}{'s/step':>8}")
    for k in (*PHASES, "other"):
        print(f"{k:<12}{result[k]:>8.3f}")
    print(f"{'total':<12}{result['s_per_step']:>8.3f}  ({result['steps']} steps in {result['wall_s']:.0f} s; "
          f"{result['generated_tokens_per_step']} generated, {result['trained_tokens_per_step']} trained tokens/step)")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
