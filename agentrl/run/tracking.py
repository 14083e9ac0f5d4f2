"""Experiment trackers a run reports to: per-step metrics and a table of a few whole rollouts.

TensorBoard is always on (event files under ``OUT_DIR/tensorboard/``); ``report_to`` adds ``wandb``,
``mlflow``, ``trackio`` or a user's class by ``"module:Class"`` path. Every built-in one writes under the
run's output dir and needs no server. Each backend's package is imported inside its class, so a run only
needs the packages of the trackers it asks for.
"""

from __future__ import annotations

import html
import importlib
import json
import numbers
import os
import re
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from agentrl.plugins import resolve

PROJECT = "agentrl"  # wandb project, MLflow experiment and trackio project of every run


@runtime_checkable
class Tracker(Protocol):
    """Where a run's metrics and samples go. Built with keywords ``out_dir``, ``config``, ``run_name``."""

    def log_metrics(self, step: int, metrics: Mapping[str, Any]) -> None:
        """Numbers of one step; other values are skipped (:func:`numeric`)."""

    def log_samples(self, step: int, rows: list[dict[str, Any]]) -> None:
        """A table of a few whole rollouts of one step, one dict per row (step, session, reward, text...)."""

    def close(self) -> None:
        """Flush and finish; the tracker is not used after."""


def numeric(metrics: Mapping[str, Any]) -> dict[str, float]:
    """The real-number values of ``metrics`` as floats (bools as 0/1, NaN kept); strings, dicts, None and
    other values dropped, since a run's metric rows also carry labels that no backend can plot. ``step`` is
    dropped too: it is every backend's x axis (and a reserved key in trackio)."""
    return {k: float(v) for k, v in metrics.items() if isinstance(v, numbers.Real) and k != "step"}


def table(rows: Sequence[Mapping[str, Any]]) -> tuple[list[str], list[list[Any]]]:
    """(columns, data) of ``rows``: columns in first-seen order, a missing cell None, and a cell that is not
    a plain scalar (tool calls, reward components) as JSON text, since table backends want one type a cell."""
    columns = list(dict.fromkeys(k for row in rows for k in row))

    def cell(v: Any) -> Any:
        return v if v is None or isinstance(v, (str, int, float, bool)) else json.dumps(v, default=str)

    return columns, [[cell(row.get(c)) for c in columns] for row in rows]


def _require(module: str, name: str, pip: str) -> Any:
    """``module``, imported for tracker ``name``, whose package ``name`` is installed by ``pip``."""
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as err:
        if err.name != name:
            raise  # the package is there but one of its own imports is missing: show that
        raise ModuleNotFoundError(f"report_to {name!r} needs the {pip!r} package, which is not installed: "
                                  f"pip install '{pip}'", name=err.name) from err


class TensorBoardTracker:
    """Event files under ``out_dir/tensorboard/``: a scalar per metric, the samples as a markdown table.

    ``purge_step``: a resumed run's first step; events at or after it from the stopped run are hidden, so
    the steps it repeats are not shown twice."""

    def __init__(self, *, out_dir: Path, config: Mapping[str, Any], run_name: str,
                 purge_step: int | None = None) -> None:
        tb = _require("torch.utils.tensorboard", "tensorboard", "tensorboard>=2.16")
        self.writer = tb.SummaryWriter(log_dir=str(Path(out_dir) / "tensorboard"), purge_step=purge_step)
        self.writer.add_text("config", f"run `{run_name}`\n\n```\n{json.dumps(config, indent=2, default=str)}\n```", 0)

    def log_metrics(self, step: int, metrics: Mapping[str, Any]) -> None:
        for key, value in numeric(metrics).items():
            self.writer.add_scalar(key, value, step)
        self.writer.flush()  # a step takes seconds or more; a live TensorBoard should see it now

    def log_samples(self, step: int, rows: list[dict[str, Any]]) -> None:
        if not rows:
            return
        columns, data = table(rows)

        def md(v: Any) -> str:
            # rollout text is full of <tool_call>, <|im_start|>, * and _: shown as written, one cell a value
            text = re.sub(r"([\\`*_\[\]#|~])", r"\\\1", html.escape("" if v is None else str(v), quote=False))
            return text.replace("\n", "<br>")

        lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
        lines += ["| " + " | ".join(md(v) for v in row) + " |" for row in data]
        self.writer.add_text("samples", "\n".join(lines), step)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


class _RunTracker:
    """wandb and trackio share one API: ``run.log(dict, step=)``, a ``Table(columns=, data=)``, ``finish()``."""

    run: Any
    new_table: Any

    def log_metrics(self, step: int, metrics: Mapping[str, Any]) -> None:
        self.run.log(numeric(metrics), step=step)

    def log_samples(self, step: int, rows: list[dict[str, Any]]) -> None:
        if rows:
            columns, data = table(rows)
            self.run.log({"samples": self.new_table(columns=columns, data=data)}, step=step)

    def close(self) -> None:
        self.run.finish()


class WandbTracker(_RunTracker):
    """A wandb run under ``out_dir/wandb/``, offline unless ``WANDB_MODE`` says otherwise (``wandb sync``
    uploads it later)."""

    def __init__(self, *, out_dir: Path, config: Mapping[str, Any], run_name: str) -> None:
        wandb = _require("wandb", "wandb", "wandb>=0.31")
        self.new_table = wandb.Table
        # console="off": the run keeps its own logs; wandb would copy every console line into its run file too
        self.run = wandb.init(project=os.environ.get("WANDB_PROJECT", PROJECT), name=run_name, config=dict(config),
                              dir=str(out_dir), mode=os.environ.get("WANDB_MODE", "offline"), reinit="create_new",
                              settings=wandb.Settings(console="off"))


def _flatten(config: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    flat: dict[str, Any] = {}
    for key, value in config.items():
        if isinstance(value, Mapping):
            flat.update(_flatten(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


class MlflowTracker:
    """An MLflow run in the sqlite store ``out_dir/mlflow.db``, artifacts under ``out_dir/mlflow-artifacts/``
    (MLflow 3.17 refuses a file store by default); ``mlflow ui --backend-store-uri sqlite:///OUT_DIR/mlflow.db`` shows it."""

    def __init__(self, *, out_dir: Path, config: Mapping[str, Any], run_name: str) -> None:
        mlflow = _require("mlflow", "mlflow", "mlflow>=3.17")
        out_dir = Path(out_dir).resolve()
        self.entities = mlflow.entities
        # the client, not mlflow.set_tracking_uri: a run must not change the process-wide tracking URI
        self.client = mlflow.MlflowClient(tracking_uri=f"sqlite:///{out_dir / 'mlflow.db'}")
        experiment = self.client.get_experiment_by_name(PROJECT)
        experiment_id = experiment.experiment_id if experiment else self.client.create_experiment(
            PROJECT, artifact_location=(out_dir / "mlflow-artifacts").as_uri())
        self.run_id = self.client.create_run(experiment_id, run_name=run_name).info.run_id
        params = [self.entities.Param(k, str(v)[:6000]) for k, v in _flatten(config).items()]
        for i in range(0, len(params), 100):  # MLflow's per-batch limit
            self.client.log_batch(self.run_id, params=params[i:i + 100])

    def log_metrics(self, step: int, metrics: Mapping[str, Any]) -> None:
        now = int(time.time() * 1000)
        found = [self.entities.Metric(re.sub(r"[^\w./\- :]", "_", k), v, now, step) for k, v in numeric(metrics).items()]
        for i in range(0, len(found), 1000):  # MLflow's per-batch limit
            self.client.log_batch(self.run_id, metrics=found[i:i + 1000])

    def log_samples(self, step: int, rows: list[dict[str, Any]]) -> None:
        if rows:
            columns, data = table(rows)
            self.client.log_table(self.run_id, data={c: [r[i] for r in data] for i, c in enumerate(columns)},
                                  artifact_file=f"samples/step-{step}.json")

    def close(self) -> None:
        self.client.set_terminated(self.run_id)


class TrackioTracker(_RunTracker):
    """A trackio run in the local sqlite db under ``out_dir/trackio/`` (``trackio show`` serves it).

    trackio reads its directory once, when first imported: ``TRACKIO_DIR`` set by the user wins, and a
    process that imported trackio before keeps the directory it had then (``self.dir`` says which)."""

    def __init__(self, *, out_dir: Path, config: Mapping[str, Any], run_name: str) -> None:
        os.environ.setdefault("TRACKIO_DIR", str(Path(out_dir).resolve() / "trackio"))
        trackio = _require("trackio", "trackio", "trackio>=0.43")
        self.dir = Path(trackio.utils.TRACKIO_DIR)
        self.new_table = trackio.Table
        self.run = trackio.init(project=PROJECT, name=run_name, config=dict(config))


BUILTIN: dict[str, type] = {"tensorboard": TensorBoardTracker, "wandb": WandbTracker, "mlflow": MlflowTracker,
                            "trackio": TrackioTracker}


def make_trackers(report_to: Sequence[str] | None, out_dir: Path, config: Mapping[str, Any],
                  run_name: str, resume_step: int | None = None) -> list[Tracker]:
    """TensorBoard, then each of ``report_to`` (a built-in name or a ``"module:Class"`` path, its class
    built with keywords ``out_dir``, ``config``, ``run_name``), each once, in order.

    A missing backend package is a ``ModuleNotFoundError`` naming its pip requirement; a class without the
    :class:`Tracker` methods a ``TypeError``. Trackers already made are closed before either is raised."""
    names = list(dict.fromkeys(["tensorboard", *(report_to or [])]))
    made: list[Tracker] = []
    try:
        for name in names:
            cls = resolve(name, BUILTIN, what="tracker")
            resumed = {"purge_step": resume_step + 1} if cls is TensorBoardTracker and resume_step is not None else {}
            tracker = cls(out_dir=Path(out_dir), config=config, run_name=run_name, **resumed)
            if not isinstance(tracker, Tracker):
                raise TypeError(f"tracker {name!r} has no log_metrics / log_samples / close")
            made.append(tracker)
    except BaseException:
        for tracker in made:
            tracker.close()
        raise
    return made
