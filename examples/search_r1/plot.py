"""Plot a search-R1 run: held-out exact match and training reward per GRPO step, and search calls per episode.

    python -m examples.search_r1.plot RUN_DIR/metrics.jsonl OUT.png

Prints the curve's numbers too (the warm model is the first ``step`` row with ``eval_accuracy``).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any


def read_steps(path: Path) -> list[dict[str, Any]]:
    """The GRPO ``step`` rows of a metrics.jsonl (warm-up rows skipped)."""
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [r for r in rows if "step" in r]


def summary(steps: list[dict[str, Any]]) -> dict[str, Any]:
    """Warm and final held-out exact match, the held-out curve, and search calls per training episode."""
    evals = [(int(r["step"]), r["eval_accuracy"]) for r in steps if "eval_accuracy" in r]
    if not evals:
        raise ValueError("no step row has eval_accuracy")
    calls = [(int(r["step"]), r["rollout/tool_calls_mean"]) for r in steps if "rollout/tool_calls_mean" in r]
    rewards = [r["rollout/reward_mean"] for r in steps if "rollout/reward_mean" in r]
    tenth = max(1, len(rewards) // 10)
    return {
        "warm_eval": evals[0][1], "final_eval": evals[-1][1], "gain": evals[-1][1] - evals[0][1],
        "best_eval": max(a for _, a in evals), "eval_curve": evals, "grpo_steps": len(rewards),
        "train_reward_first_tenth": sum(rewards[:tenth]) / tenth if rewards else None,
        "train_reward_last_tenth": sum(rewards[-tenth:]) / tenth if rewards else None,
        "search_calls_first_tenth": sum(c for _, c in calls[:tenth]) / tenth if calls else None,
        "search_calls_last_tenth": sum(c for _, c in calls[-tenth:]) / tenth if calls else None,
    }


def plot(steps: list[dict[str, Any]], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (top, bottom) = plt.subplots(2, 1, figsize=(8, 6.5), sharex=True, height_ratios=[3, 2])
    trained = [r for r in steps if "rollout/reward_mean" in r]
    evals = [r for r in steps if "eval_accuracy" in r]
    top.plot([r["step"] for r in trained], [r["rollout/reward_mean"] for r in trained], lw=1, alpha=0.6,
             label="training reward (exact match, mean of the step's episodes)")
    top.plot([r["step"] for r in evals], [r["eval_accuracy"] for r in evals], "o-", color="C1",
             label="held-out exact match (100 questions, greedy)")
    top.set_ylim(0, 1)
    top.set_ylabel("exact match")
    top.legend(loc="upper left", fontsize=8)
    top.grid(alpha=0.3)
    bottom.plot([r["step"] for r in trained], [r.get("rollout/tool_calls_mean", float("nan")) for r in trained],
                color="C2", label="search calls per training episode")
    bottom.set_ylim(bottom=0)
    bottom.set_xlabel("GRPO step (0: the warm model)")
    bottom.set_ylabel("searches / episode")
    bottom.legend(loc="lower right", fontsize=8)
    bottom.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(out, dpi=100)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m examples.search_r1.plot", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("metrics", type=Path)
    parser.add_argument("out", type=Path)
    args = parser.parse_args(argv)
    steps = read_steps(args.metrics)
    plot(steps, args.out)
    print(json.dumps(summary(steps)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
