"""Held-out curves and per-step distillation signals of this comparison's runs, from their metrics.jsonl.

    python benchmarks/results/distill_vs_grpo_2026-12-07b/curves.py   # writes curves.json next to this file

Runs (each dir holds the metrics.jsonl `agentrl train` wrote; NOTES.md has the commands):
  stored_grpo, stored_distill: benchmarks/results/distill_vs_grpo_2026-12-07/ (lr 3e-4, warm-up 20 steps)
  run1_pure_lr1e-3, run2_mixed_warmup5, run3_grpo_warmup5: this directory
"""

from __future__ import annotations

import json
from pathlib import Path

HERE = Path(__file__).resolve().parent
RUNS = {
    "stored_grpo": HERE.parent / "distill_vs_grpo_2026-12-07" / "grpo_metrics.jsonl",
    "stored_distill": HERE.parent / "distill_vs_grpo_2026-12-07" / "distill_metrics.jsonl",
    "run1_pure_lr1e-3": HERE / "run1_pure_lr1e-3.metrics.jsonl",
    "run2_mixed_warmup5": HERE / "run2_mixed_warmup5.metrics.jsonl",
    "run3_grpo_warmup5": HERE / "run3_grpo_warmup5.metrics.jsonl",
}
TEACHER = 0.725  # the teacher's held-out greedy accuracy (stored_grpo's best checkpoint, step 55)
PER_STEP = ["train/lr", "train/grad_norm", "rollout/reward_mean", "distill/reverse_kl", "distill/reverse_kl_max",
            "train/distill_teacher_adv_abs", "train/distill_task_adv_abs", "train/n_samples", "train/seconds"]


def rows(path: Path) -> list[dict]:
    return [r for r in map(json.loads, path.read_text().splitlines()) if isinstance(r.get("step"), (int, float))]


def curve(path: Path) -> dict:
    rs = rows(path)
    evals = {int(r["step"]): r["eval_accuracy"] for r in rs if "eval_accuracy" in r}
    reached = [s for s, a in sorted(evals.items()) if a >= TEACHER]
    steps = {int(r["step"]): {k: r[k] for k in PER_STEP if k in r} for r in rs if r["step"] > 0}
    return {"eval_accuracy": evals, "first_step_at_teacher": reached[0] if reached else None, "per_step": steps}


def main() -> None:
    out = {"teacher_heldout_greedy": TEACHER, "runs": {name: curve(p) for name, p in RUNS.items() if p.is_file()}}
    (HERE / "curves.json").write_text(json.dumps(out, indent=1) + "\n")
    for name, c in out["runs"].items():
        print(f"{name:22s} first step >= {TEACHER}: {c['first_step_at_teacher']}  evals: "
              + " ".join(f"{s}:{a:.3f}" for s, a in sorted(c["eval_accuracy"].items())))


if __name__ == "__main__":
    main()
