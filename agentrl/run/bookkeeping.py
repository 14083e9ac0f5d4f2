"""A run's records on disk: the metrics log, the checkpoint directory (names, ``latest``, rotation) and
the reward-curve plot. The loop calls verbs; the file layout lives here."""

from __future__ import annotations

import json
import shutil
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

# Metrics shown on the console per row; the file keeps every key.
CONSOLE_KEYS = ("step", "warmup_step", "warmup_check_accuracy", "eval_accuracy", "rollout/reward_mean",
                "train/groups_dropped", "train/kl", "verify/refused", "rollout/tokens_per_s", "rollout/seconds",
                "train/seconds", "sync/seconds")


class MetricsLog:
    """Append-only JSONL of metric rows, each stamped with the run's wall time (``elapsed_s``).

    ``resume_step``: continue a run from its checkpoint at that step: rows of later steps (written after
    the checkpoint, before the run stopped) are dropped, since the resumed run writes them again, and
    time keeps counting from the last kept row. Without it the log starts empty."""

    def __init__(self, path: Path, *, resume_step: int | None = None, trackers: Sequence[Any] = ()) -> None:
        self.path = path
        self.trackers = list(trackers)  # each row also goes to these (agentrl.run.tracking)
        offset = 0.0
        if resume_step is None:
            path.write_text("")
        else:
            kept = [r for r in self.rows() if r.get("step", 0) <= resume_step] if path.exists() else []
            offset = max((r.get("elapsed_s", 0.0) for r in kept), default=0.0)
            tmp = path.with_suffix(".tmp")
            tmp.write_text("".join(json.dumps(r) + "\n" for r in kept))
            tmp.replace(path)  # a crash here leaves the old log whole, not a cut one
        self.started = time.monotonic() - offset

    def write(self, row: dict[str, Any]) -> None:
        row = {**row, "elapsed_s": round(time.monotonic() - self.started, 2)}
        with self.path.open("a") as f:
            f.write(json.dumps(row) + "\n")
        shown = {k: (round(v, 4) if isinstance(v, float) else v) for k, v in row.items() if k in CONSOLE_KEYS}
        for tracker in self.trackers:
            if "step" in row:
                tracker.log_metrics(row["step"], row)
            elif "warmup_step" in row:  # its own series: warm-up steps are not GRPO steps
                tracker.log_metrics(row["warmup_step"], {f"warmup/{k.removeprefix('warmup_')}": v
                                                         for k, v in row.items() if k != "warmup_step"})
        if row.get("train/skipped"):
            shown["note"] = "this step trained nothing (no group with reward variance, or non-finite values)"
        print(json.dumps(shown), flush=True)

    def rows(self) -> list[dict[str, Any]]:
        return [json.loads(line) for line in self.path.read_text().splitlines() if line.strip()]


class SampleLog:
    """A few whole rollouts per step, ``samples/step-N.jsonl``: Sample dicts whose metadata holds the chat,
    reward components, drift outcomes and stop reason (``agentrl dump FILE`` renders them)."""

    def __init__(self, root: Path, trackers: Sequence[Any] = ()) -> None:
        self.root = root
        self.trackers = list(trackers)

    def write(self, step: int, rows: list[dict[str, Any]]) -> None:
        if not rows:
            return
        self.root.mkdir(exist_ok=True)
        (self.root / f"step-{step}.jsonl").write_text("".join(json.dumps(r, default=str) + "\n" for r in rows))
        table = [{"step": step, "session": r["session_id"], "reward": r["reward"],
                  "reward_components": r["metadata"].get("reward_components"),
                  "stop_reason": r["metadata"].get("stop_reason"),
                  "text": "\n".join(f"{m.get('role')}: {m.get('content')}" for m in r["metadata"].get("messages", [])),
                  "trained_tokens": sum(r["loss_mask"])} for r in rows]
        for tracker in self.trackers:
            tracker.log_samples(step, table)


class CheckpointDir:
    """``checkpoints/step-N`` directories and the ``latest`` pointer; keeps the newest ``keep``."""

    def __init__(self, root: Path, keep: int = 2) -> None:
        self.root = root
        self.keep = keep

    def path(self, step: int) -> Path:
        return self.root / f"step-{step}"

    def latest(self) -> Path | None:
        pointer = self.root / "latest"
        return self.root / pointer.read_text().strip() if pointer.exists() else None

    def latest_step(self) -> int | None:
        latest = self.latest()
        return int(latest.name.removeprefix("step-")) if latest is not None else None

    def mark_latest(self, step: int, *, protect: int | None = None) -> None:
        """Point ``latest`` at ``step`` atomically (a crash mid-save leaves the old pointer), then delete
        all but the newest ``keep`` checkpoints and the ``protect`` one (the best so far)."""
        tmp = self.root / "latest.tmp"
        tmp.write_text(self.path(step).name)
        tmp.replace(self.root / "latest")
        # Complete checkpoints only (a killed save leaves a temp name that is not step-<int>).
        steps = sorted((p for p in self.root.glob("step-*") if p.is_dir() and p.name[5:].isdigit()),
                       key=lambda p: int(p.name[5:]))
        for old in steps[: -self.keep]:
            if protect is None or old.name != self.path(protect).name:
                shutil.rmtree(old, ignore_errors=True)


def train_row(trained: dict[str, Any]) -> dict[str, Any]:
    """A trainer's metrics as step-row keys: under ``train/``, except the MoE router's ``moe/*``, which keep
    their own namespace beside ``rollout/`` and ``sync/`` (what a reader of MoE health looks for)."""
    return {(k if k.startswith("moe/") else f"train/{k}"): v for k, v in trained.items()}


def plot_curves(metrics_path: Path, png_path: Path) -> None:
    """Two panels from the metrics JSONL: reward and held-out accuracy per step, with the warm-up's real
    evaluations left of the warm-up/GRPO boundary; and the wall time of each step, split by phase."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [json.loads(line) for line in metrics_path.read_text().splitlines() if line.strip()]
    steps = [r for r in rows if "step" in r]
    warm = [r for r in rows if "warmup_step" in r and "eval_accuracy" in r and not r.get("cached")]
    last_warm = max((r["warmup_step"] for r in warm), default=0)
    fig, (acc, time_ax) = plt.subplots(2, 1, figsize=(8, 6.5), sharex=True, height_ratios=[3, 2])
    rewards = [(r["step"], r["rollout/reward_mean"]) for r in steps if "rollout/reward_mean" in r]
    evals = [(r["step"], r["eval_accuracy"]) for r in steps if "eval_accuracy" in r]
    if rewards:
        acc.plot(*zip(*rewards, strict=True), label="train reward (mean over episodes)", alpha=0.6)
    if evals:
        acc.plot(*zip(*evals, strict=True), "o-", label="held-out accuracy (greedy)")
    if warm:  # warm-up steps are many per GRPO step: shown on a compressed scale left of 0
        scale = max(last_warm / 10, 1)
        acc.plot([(r["warmup_step"] - last_warm) / scale for r in warm], [r["eval_accuracy"] for r in warm],
                 "s--", color="grey", label=f"warm-up evaluations (1 unit = {scale:g} warm-up steps)")
    acc.axvline(0, color="black", lw=0.8, ls=":")
    acc.text(0, 1.02, " warm-up | GRPO", transform=acc.get_xaxis_transform(), fontsize=8)
    acc.set_ylabel("reward / accuracy (fraction)")
    acc.set_ylim(0, 1)
    acc.grid(alpha=0.3)
    acc.legend(fontsize=8, loc="upper left")
    phases = [("rollout/seconds", "rollout"), ("train/seconds", "train"), ("sync/seconds", "weight sync")]
    timed = [r for r in steps if all(k in r for k, _ in phases)]
    if timed:
        x = [r["step"] for r in timed]
        time_ax.stackplot(x, *[[r[k] for r in timed] for k, _ in phases], labels=[n for _, n in phases], alpha=0.7)
        time_ax.legend(fontsize=8, loc="upper left")
    time_ax.set_xlabel("GRPO step")
    time_ax.set_ylabel("seconds per step")
    time_ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(png_path, dpi=100)
    plt.close(fig)


class RunDirError(ValueError):
    """The output directory holds another run, or nothing to resume."""


def claim_output_dir(out: Path, *, resume: bool, overwrite: bool) -> None:
    """Make ``out`` this run's: refuse one that already holds a run unless it is resumed (``resume``) or
    replaced (``overwrite``, which deletes its checkpoints, metrics, curve and logs)."""
    if resume and overwrite:
        raise RunDirError("--resume and --overwrite contradict each other")
    held = [p for p in (out / "metrics.jsonl", out / "checkpoints") if p.exists() and (p.is_dir() or p.stat().st_size)]
    if resume:
        if not (out / "checkpoints" / "latest").exists():
            raise RunDirError(f"--resume: {out} has no checkpoint to resume (checkpoints/latest is missing)")
        return
    if held and not overwrite:
        raise RunDirError(f"{out} already holds a run ({', '.join(p.name for p in held)}); pass --resume to "
                          "continue it or --overwrite to replace it")
    for name in ("checkpoints", "logs", "samples", "hf", "tensorboard"):
        shutil.rmtree(out / name, ignore_errors=True)
    for name in ("metrics.jsonl", "reward_curve.png"):
        (out / name).unlink(missing_ok=True)
