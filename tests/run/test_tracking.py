"""Each tracker writes a run's metrics and sample table offline under the run dir, and the backend's own
reader gets the same values back; labels, dicts, None and NaN in a metric row crash none of them."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from agentrl.plugins import PluginError
from agentrl.run.tracking import TensorBoardTracker, make_trackers, numeric, table

CONFIG = {"model": "tiny", "train": {"lr": 1e-6, "steps": 3}}
ROWS = [{"step": 2, "session": "s-0", "reward": 1.0, "text": "user: 2+2?\nassistant: 4 | done", "trained_tokens": 5},
        {"step": 2, "session": "s-1", "reward": 0.0, "text": "<tool_call>calc_sum</tool_call>", "tool_calls": [{"name": "calc"}]}]


def _metrics(step: int) -> dict:
    return {"step": step, "rollout/reward_mean": 0.25 * step, "train/kl": float("nan"), "phase": "grpo",
            "eval": {"acc": 1.0}, "eval_accuracy": None, "train/skipped": step == 1}


def _run(report_to: list[str], out: Path) -> list:
    trackers = make_trackers(report_to, out, CONFIG, "run-1")
    for step in range(3):
        for tracker in trackers:
            tracker.log_metrics(step, _metrics(step))
    for tracker in trackers:
        tracker.log_samples(2, ROWS)
        tracker.close()
    return trackers


def test_numeric_keeps_numbers_and_nan_and_drops_labels() -> None:
    got = numeric(_metrics(1))
    assert set(got) == {"rollout/reward_mean", "train/kl", "train/skipped"}
    assert got["train/skipped"] == 1.0 and math.isnan(got["train/kl"])
    columns, data = table(ROWS)
    assert columns == ["step", "session", "reward", "text", "trained_tokens", "tool_calls"]
    assert data[0][-1] is None and json.loads(data[1][-1]) == [{"name": "calc"}]


def test_tensorboard_is_always_on_and_reads_back(tmp_path) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    (tracker,) = _run([], tmp_path)
    assert isinstance(tracker, TensorBoardTracker)
    acc = EventAccumulator(str(tmp_path / "tensorboard"), size_guidance={"tensors": 0})
    acc.Reload()
    assert [(e.step, e.value) for e in acc.Scalars("rollout/reward_mean")] == [(0, 0.0), (1, 0.25), (2, 0.5)]
    assert all(math.isnan(e.value) for e in acc.Scalars("train/kl"))
    assert [e.value for e in acc.Scalars("train/skipped")] == [0.0, 1.0, 0.0]
    assert "phase" not in acc.Tags()["scalars"] and "eval_accuracy" not in acc.Tags()["scalars"]
    (event,) = acc.Tensors("samples/text_summary")
    text = event.tensor_proto.string_val[0].decode()
    assert event.step == 2
    assert text.splitlines()[0] == "| step | session | reward | text | trained_tokens | tool_calls |"
    assert "user: 2+2?<br>assistant: 4 \\| done" in text  # one table row per sample, whatever the text holds
    assert "| &lt;tool\\_call&gt;calc\\_sum&lt;/tool\\_call&gt; |" in text  # markup is shown as written
    assert "&lt;tool\\_call&gt;calc\\_sum" in text  # markup in the text is shown, not rendered
    assert '"lr": 1e-06' in acc.Tensors("config/text_summary")[0].tensor_proto.string_val[0].decode()


def test_wandb_offline_run_reads_back(tmp_path, monkeypatch) -> None:
    pytest.importorskip("wandb")
    monkeypatch.delenv("WANDB_MODE", raising=False)
    _run(["wandb"], tmp_path)
    (run_file,) = tmp_path.glob("wandb/offline-run-*/run-*.wandb")
    # wandb's own reader of the offline transaction log
    out = subprocess.run([sys.executable, "-m", "wandb", "leet", "inspect", "--json", str(run_file)],
                         capture_output=True, text=True, check=True, timeout=120).stdout
    records = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    history = [r["history"]["item"] for r in records if r["type"] == "history"]
    assert [h["rollout/reward_mean"] for h in history] == [0.0, 0.25, 0.5]
    assert all(h["train/kl"] == "NaN" and "phase" not in h for h in history)
    samples = next(h for h in history if "samples.path" in h)
    assert samples["_step"] == 2 and samples["samples.nrows"] == 2
    logged = json.loads((run_file.parent / "files" / samples["samples.path"]).read_text())
    assert logged["columns"] == table(ROWS)[0] and logged["data"][0][3] == ROWS[0]["text"]


def test_mlflow_local_store_reads_back(tmp_path) -> None:
    mlflow = pytest.importorskip("mlflow")
    _run(["mlflow"], tmp_path)
    client = mlflow.MlflowClient(tracking_uri=f"sqlite:///{tmp_path / 'mlflow.db'}")
    (run,) = client.search_runs([client.get_experiment_by_name("agentrl").experiment_id])
    assert run.info.run_name == "run-1" and run.info.status == "FINISHED"
    assert run.data.params["train.lr"] == "1e-06"
    history = client.get_metric_history(run.info.run_id, "rollout/reward_mean")
    assert [(m.step, m.value) for m in history] == [(0, 0.0), (1, 0.25), (2, 0.5)]
    assert all(math.isnan(m.value) for m in client.get_metric_history(run.info.run_id, "train/kl"))
    assert "phase" not in run.data.metrics
    path = client.download_artifacts(run.info.run_id, "samples/step-2.json", str(tmp_path / "dl"))
    logged = json.loads(Path(path).read_text())
    assert logged["columns"] == table(ROWS)[0] and logged["data"][0][3] == ROWS[0]["text"]


def test_trackio_local_db_reads_back(tmp_path, monkeypatch) -> None:
    if "trackio" in sys.modules:
        pytest.skip("trackio was imported before: its directory is fixed")
    monkeypatch.setenv("TRACKIO_DIR", str(tmp_path / "trackio"))  # restored after, unlike the tracker's default
    pytest.importorskip("trackio")
    from trackio.sqlite_storage import SQLiteStorage

    (_, tracker) = _run(["trackio"], tmp_path)
    assert tracker.dir == tmp_path / "trackio" and (tmp_path / "trackio" / "agentrl.db").exists()
    logs = SQLiteStorage.get_logs("agentrl", "run-1")
    metrics = [row for row in logs if "rollout/reward_mean" in row]
    assert [(r["step"], r["rollout/reward_mean"]) for r in metrics] == [(0, 0.0), (1, 0.25), (2, 0.5)]
    assert all(math.isnan(r["train/kl"]) and "phase" not in r for r in metrics)
    (samples,) = [row for row in logs if "samples" in row]
    assert samples["step"] == 2 and samples["samples"]["_value"][0]["text"] == ROWS[0]["text"]


class ListTracker:
    """A user's tracker: keeps what it is given."""

    def __init__(self, *, out_dir: Path, config: dict, run_name: str) -> None:
        self.out_dir, self.config, self.run_name = out_dir, config, run_name
        self.metrics: list[tuple[int, dict]] = []
        self.samples: list[tuple[int, list]] = []
        self.closed = False

    def log_metrics(self, step: int, metrics: dict) -> None:
        self.metrics.append((step, metrics))

    def log_samples(self, step: int, rows: list) -> None:
        self.samples.append((step, rows))

    def close(self) -> None:
        self.closed = True


def test_user_tracker_by_path(tmp_path) -> None:
    tb, user = _run([f"{__name__}:ListTracker", "tensorboard"], tmp_path)  # tensorboard once, first
    assert isinstance(tb, TensorBoardTracker) and isinstance(user, ListTracker)
    assert user.run_name == "run-1" and user.config == CONFIG and user.out_dir == tmp_path
    assert [s for s, _ in user.metrics] == [0, 1, 2] and user.samples == [(2, ROWS)] and user.closed


def test_unknown_missing_or_wrong_tracker_is_a_clear_error(tmp_path, monkeypatch) -> None:
    with pytest.raises(PluginError, match="unknown tracker 'neptune'"):
        make_trackers(["neptune"], tmp_path, CONFIG, "r")
    monkeypatch.setitem(sys.modules, "wandb", None)  # as if not installed
    with pytest.raises(ModuleNotFoundError, match=r"report_to 'wandb' needs the 'wandb>=0.31' package"):
        make_trackers(["wandb"], tmp_path, CONFIG, "r")
    with pytest.raises(TypeError, match="has no log_metrics"):
        make_trackers(["types:SimpleNamespace"], tmp_path, CONFIG, "r")
