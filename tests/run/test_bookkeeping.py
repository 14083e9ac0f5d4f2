"""A run's records survive being run twice and resumed: no truncated metrics, no duplicated rows, time that
keeps counting, pruning by step number, and an output dir that is never silently reused."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from agentrl.run.bookkeeping import CheckpointDir, MetricsLog, RunDirError, claim_output_dir


def _rows(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_resume_drops_rows_past_the_checkpoint_and_keeps_time_counting(tmp_path, capsys) -> None:
    path = tmp_path / "metrics.jsonl"
    rows = [{"warmup_step": 10, "elapsed_s": 3.0}] + [{"step": s, "elapsed_s": 10.0 + s} for s in range(9)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    log = MetricsLog(path, resume_step=5)  # the run saved step-5, then logged 6..8 and died
    assert [r.get("step") for r in _rows(path)] == [None, 0, 1, 2, 3, 4, 5]
    log.write({"step": 6})
    after = _rows(path)
    assert [r.get("step") for r in after] == [None, 0, 1, 2, 3, 4, 5, 6]  # 6 once, not twice
    assert after[-1]["elapsed_s"] >= 15.0  # continues from step 5's 15 s, not from 0


def test_a_fresh_log_starts_empty(tmp_path) -> None:
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 3}\n')
    MetricsLog(path)
    assert path.read_text() == ""


def test_pruning_keeps_the_newest_by_step_number_and_ignores_temp_dirs(tmp_path) -> None:
    ckpts = CheckpointDir(tmp_path, keep=2)
    for name in ("step-2", "step-10", "step-9", "step-10.tmp-123"):
        (tmp_path / name).mkdir()
    ckpts.mark_latest(10)
    assert sorted(p.name for p in tmp_path.glob("step-*")) == ["step-10", "step-10.tmp-123", "step-9"]
    assert ckpts.latest() == tmp_path / "step-10" and ckpts.latest_step() == 10


def _finished_run(out) -> None:
    (out / "checkpoints" / "step-10").mkdir(parents=True)
    (out / "checkpoints" / "latest").write_text("step-10")
    (out / "metrics.jsonl").write_text("".join(json.dumps({"step": s}) + "\n" for s in range(11)))


def test_a_dir_holding_a_run_is_refused_without_resume_or_overwrite_and_loses_nothing(tmp_path) -> None:
    _finished_run(tmp_path)
    before = (tmp_path / "metrics.jsonl").read_text()
    with pytest.raises(RunDirError, match="--resume to continue it or --overwrite"):
        claim_output_dir(tmp_path, resume=False, overwrite=False)
    assert (tmp_path / "metrics.jsonl").read_text() == before and (tmp_path / "checkpoints" / "step-10").is_dir()
    claim_output_dir(tmp_path, resume=True, overwrite=False)  # resuming it is fine
    claim_output_dir(tmp_path, resume=False, overwrite=True)  # replacing it clears the old run
    assert not (tmp_path / "checkpoints").exists() and not (tmp_path / "metrics.jsonl").exists()


def test_resume_of_a_dir_without_a_checkpoint_is_an_error(tmp_path) -> None:
    with pytest.raises(RunDirError, match="no checkpoint to resume"):
        claim_output_dir(tmp_path, resume=True, overwrite=False)
    with pytest.raises(RunDirError, match="contradict"):
        claim_output_dir(tmp_path, resume=True, overwrite=True)


def test_agentrl_train_refuses_a_finished_run_dir_before_starting_anything(tmp_path) -> None:
    _finished_run(tmp_path)
    proc = subprocess.run([sys.executable, "-m", "agentrl.cli", "train", "examples/arithmetic/config.yaml",
                           "--output-dir", str(tmp_path)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "already holds a run" in proc.stderr
    assert len(_rows(tmp_path / "metrics.jsonl")) == 11


def test_the_best_checkpoint_is_kept_besides_the_newest(tmp_path) -> None:
    ckpts = CheckpointDir(tmp_path, keep=2)
    for step in (0, 5, 10, 15):
        (tmp_path / f"step-{step}").mkdir()
        ckpts.mark_latest(step, protect=5)
    assert sorted(p.name for p in tmp_path.glob("step-*")) == ["step-10", "step-15", "step-5"]
