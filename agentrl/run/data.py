"""Where a run's tasks come from: a task function, or the user's own data (JSONL, Parquet or CSV files, a
folder of them, or a dataset saved by HF ``datasets``), read and validated before Ray starts.

Either way a :class:`TaskSource` answers three questions: the tasks of GRPO step ``s`` (:meth:`train`), the
held-out tasks (:meth:`heldout`) and the tasks of the supervised warm-up (:meth:`warmup`). The tasks of a
step are a pure function of the step and of where the run resumed, so any schedule (one that generates
ahead included) and ``--resume`` read every row of an epoch exactly once, in one seeded order.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Protocol

from pydantic import BaseModel, Field, ValidationError

from agentrl.envs.task_files import read_jsonl
from agentrl.settings import Settings

DATA_SUFFIXES = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".csv": "csv"}


class DataError(ValueError):
    """Task data that cannot be used: the message names the file and row."""


class DataSection(Settings):
    """The ``data`` section: how rows of a task file become the environment's tasks."""

    fields: dict[str, str] = Field(default_factory=dict,
                                   description="task key -> column; empty: every column under its own name")
    heldout: str | None = Field(None, description="held-out file/folder/saved dataset, or a split name of a saved DatasetDict")
    heldout_fraction: float = Field(0.1, gt=0, lt=1, description="without heldout: this seeded fraction of the rows")
    train_split: str = Field("train", description="the split of a saved DatasetDict to train on")
    shuffle: bool = Field(True, description="a new seeded order every epoch")
    epochs: float | None = Field(None, gt=0, description="stop after this many passes over the rows (None: steps decide)")


class TaskSource(Protocol):
    def train(self, n: int, step: int) -> list[Any]: ...
    def heldout(self, n: int) -> list[Any]: ...
    def warmup(self, n: int, seed: int) -> list[Any]: ...
    def state_dict(self, step: int, n: int) -> dict[str, Any]: ...
    def load_state_dict(self, state: dict[str, Any], step: int) -> None: ...
    def max_steps(self, n: int) -> int | None: ...


class FunctionTasks:
    """``fn(n, *, seed, split, **task_kwargs)``: fresh tasks per step, seeded by the step."""

    def __init__(self, fn: Callable[..., list[Any]], *, seed: int, task_kwargs: dict[str, Any]) -> None:
        self.fn, self.seed, self.kwargs = fn, seed, task_kwargs

    def train(self, n: int, step: int) -> list[Any]:
        return self.fn(n, seed=self.seed * 1_000_003 + step, split="train", **self.kwargs)

    def heldout(self, n: int) -> list[Any]:
        return self.fn(n, seed=self.seed, split="heldout", **self.kwargs)

    def warmup(self, n: int, seed: int) -> list[Any]:
        # A function may keep the warm-up's tasks apart from GRPO's by naming their split in a
        # ``warmup_split`` attribute (GRPO then trains on tasks the supervised phase never showed).
        return self.fn(n, seed=seed, split=getattr(self.fn, "warmup_split", "train"), **self.kwargs)

    def state_dict(self, step: int, n: int) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any], step: int) -> None:
        pass

    def max_steps(self, n: int) -> int | None:
        return None


class DatasetTasks:
    """Rows of the user's data as tasks. Step ``s`` reads the next ``n`` rows of an endless stream that
    visits every training row once per epoch, in a new seeded order each epoch."""

    def __init__(self, train: list[dict[str, Any]], heldout: list[dict[str, Any]], *, seed: int,
                 shuffle: bool = True, epochs: float | None = None) -> None:
        if not train:
            raise DataError("no training rows")
        self.rows, self.heldout_rows = train, heldout
        self.seed, self.shuffle, self.epochs = seed, shuffle, epochs
        self._orders: dict[int, list[int]] = {}
        self._base_step, self._base_position = 0, 0  # where this run segment started reading

    def _order(self, epoch: int) -> list[int]:
        if epoch not in self._orders:
            order = list(range(len(self.rows)))
            if self.shuffle:
                random.Random(f"{self.seed}-{epoch}").shuffle(order)
            self._orders = {epoch: order}  # one epoch at a time is all a step needs
        return self._orders[epoch]

    def position(self, step: int, n: int) -> int:
        """Rows read before step ``step`` (steps read ``n`` rows each)."""
        return self._base_position + (step - self._base_step) * n

    def train(self, n: int, step: int) -> list[Any]:
        start = self.position(step, n)
        out = []
        for p in range(start, start + n):
            epoch, index = divmod(p, len(self.rows))
            out.append(dict(self.rows[self._order(epoch)[index]]))
        return out

    def heldout(self, n: int) -> list[Any]:
        return [dict(r) for r in self.heldout_rows[:n]]

    def warmup(self, n: int, seed: int) -> list[Any]:
        rng = random.Random(seed)
        return [dict(self.rows[rng.randrange(len(self.rows))]) for _ in range(n)]

    def state_dict(self, step: int, n: int) -> dict[str, Any]:
        """The read position before ``step``: a resumed run starts reading there."""
        return {"position": self.position(step, n), "rows": len(self.rows)}

    def load_state_dict(self, state: dict[str, Any], step: int) -> None:
        if state.get("rows") not in (None, len(self.rows)):
            raise DataError(f"the checkpoint read a data set of {state['rows']} rows; this one has {len(self.rows)}")
        if "position" in state:
            self._base_step, self._base_position = step, int(state["position"])

    def max_steps(self, n: int) -> int | None:
        return None if self.epochs is None else int(self.epochs * len(self.rows)) // n


def is_data_path(value: str) -> bool:
    """A ``tasks`` value naming data rather than a function: an existing path or a data-file suffix."""
    return Path(value).exists() or Path(value).suffix in DATA_SUFFIXES


def _files(path: Path) -> list[Path]:
    if path.is_file():
        return [path]
    files = sorted(p for p in path.iterdir() if p.suffix in DATA_SUFFIXES)
    if not files:
        raise DataError(f"{path}: no {', '.join(DATA_SUFFIXES)} files in this folder")
    return files


def _is_saved_dataset(path: Path) -> bool:
    return path.is_dir() and any((path / n).exists() for n in ("dataset_info.json", "state.json", "dataset_dict.json"))


def _read_file(path: Path) -> list[dict[str, Any]]:
    import datasets

    if path.suffix not in DATA_SUFFIXES:
        raise DataError(f"{path}: not a data file (expected one of {', '.join(DATA_SUFFIXES)})")
    if path.suffix in (".jsonl", ".json"):  # read here, so a bad line is named by its number
        try:
            return read_jsonl(path)
        except ValueError as err:
            raise DataError(str(err)) from None
    try:
        data = datasets.load_dataset(DATA_SUFFIXES[path.suffix], data_files=str(path), split="train")
    except Exception as err:  # the reader's own words, with the file named
        raise DataError(f"{path}: cannot be read as {DATA_SUFFIXES[path.suffix]} ({err})") from err
    return list(data)


def _read(path: Path, split: str) -> tuple[list[dict[str, Any]], list[str]]:
    """Rows and, per row, the name of where it came from (for errors)."""
    if not path.exists():
        raise DataError(f"{path}: no such file or folder")
    if _is_saved_dataset(path):
        import datasets

        data = datasets.load_from_disk(str(path))
        if isinstance(data, datasets.DatasetDict):
            if split not in data:
                raise DataError(f"{path}: no split {split!r} (splits: {sorted(data)})")
            data = data[split]
        rows = list(data)
        return rows, [f"{path} [{split}] row {i + 1}" for i in range(len(rows))]
    rows, where = [], []
    for file in _files(path):
        got = _read_file(file)
        rows += got
        where += [f"{file} row {i + 1}" for i in range(len(got))]
    return rows, where


def _tasks(rows: Sequence[dict[str, Any]], where: Sequence[str], fields: dict[str, str],
           task_model: type[BaseModel] | None, task_fields: Sequence[str] = ()) -> list[dict[str, Any]]:
    out = []
    for row, place in zip(rows, where, strict=True):
        if fields:
            missing = [column for column in fields.values() if row.get(column) is None]
            if missing:
                raise DataError(f"{place}: missing field {missing[0]!r} (row has {sorted(row)})")
            task = {key: row[column] for key, column in fields.items()}
        else:
            task = dict(row)
        if task_model is not None:
            try:
                task = task_model.model_validate(task).model_dump()
            except ValidationError as err:
                first = err.errors()[0]
                field = ".".join(map(str, first["loc"]))
                raise DataError(f"{place}: field {field!r}: {first['msg']}") from None
        lacking = [key for key in task_fields if key not in task]
        if lacking:
            raise DataError(f"{place}: the environment reads task field {lacking[0]!r}, which this row lacks "
                            f"(row has {sorted(task)}; map a column to it with data.fields)")
        out.append(task)
    return out


def load_dataset_tasks(path: str, data: DataSection, *, seed: int, task_model: type[BaseModel] | None = None,
                       task_fields: Sequence[str] = ()) -> DatasetTasks:
    """Read and validate every row now (against ``task_model``, and each must have every key of
    ``task_fields``, the environment's ``Environment.task_fields``); split off held-out rows by name or
    by a seeded fraction."""
    rows, where = _read(Path(path), data.train_split)
    train = _tasks(rows, where, data.fields, task_model, task_fields)
    if data.heldout is not None:
        heldout_path = Path(data.heldout)
        if heldout_path.exists():
            h_rows, h_where = _read(heldout_path, data.train_split)
        else:  # a split name of the same saved dataset
            h_rows, h_where = _read(Path(path), data.heldout)
        heldout = _tasks(h_rows, h_where, data.fields, task_model, task_fields)
    else:
        order = list(range(len(train)))
        random.Random(f"heldout-{seed}").shuffle(order)
        cut = max(1, round(len(train) * data.heldout_fraction))
        if cut >= len(train):
            raise DataError(f"{path}: {len(train)} rows are too few to hold out {data.heldout_fraction:.0%}")
        chosen = set(order[:cut])
        heldout = [train[i] for i in sorted(chosen)]
        train = [t for i, t in enumerate(train) if i not in chosen]
    return DatasetTasks(train, heldout, seed=seed, shuffle=data.shuffle, epochs=data.epochs)
