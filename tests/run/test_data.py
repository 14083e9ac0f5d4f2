"""A run's tasks from the user's data: JSONL, Parquet, CSV, a folder, a saved HF dataset; field mapping,
held-out split, seeded epochs, a read position that resumes exactly, and bad data named by file and row
before anything starts."""

from __future__ import annotations

import json
import subprocess
import sys
from collections import Counter

import pytest
from pydantic import BaseModel

from agentrl.run.config import load_config
from agentrl.run.data import DataError, DataSection, load_dataset_tasks

CONFIG = "examples/arithmetic/config.yaml"


def _jsonl(path, rows) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


ROWS = [{"x": i, "y": 100 + i, "note": f"row {i}"} for i in range(20)]


def test_jsonl_rows_become_tasks_through_the_field_mapping_with_a_disjoint_heldout(tmp_path) -> None:
    source = load_dataset_tasks(_jsonl(tmp_path / "t.jsonl", ROWS), DataSection(fields={"a": "x", "b": "y"}), seed=3)
    assert len(source.rows) == 18 and len(source.heldout_rows) == 2  # a seeded 10%
    assert all(set(t) == {"a", "b"} and t["b"] == t["a"] + 100 for t in source.rows + source.heldout_rows)
    assert not {t["a"] for t in source.rows} & {t["a"] for t in source.heldout_rows}
    again = load_dataset_tasks(str(tmp_path / "t.jsonl"), DataSection(fields={"a": "x", "b": "y"}), seed=3)
    assert again.heldout(5) == source.heldout(5)  # seeded


def test_each_epoch_reads_every_row_once_in_a_new_seeded_order(tmp_path) -> None:
    source = load_dataset_tasks(_jsonl(tmp_path / "t.jsonl", ROWS), DataSection(heldout_fraction=0.5), seed=0)
    n = len(source.rows)  # 10
    stream = [t["x"] for step in range(n) for t in source.train(2, step)]  # 2 epochs
    first, second = stream[:n], stream[n:]
    assert Counter(first) == Counter(second) == Counter(t["x"] for t in source.rows)
    assert first != second


@pytest.mark.parametrize("new_n", [3, 2])
def test_resume_continues_at_the_next_unseen_row(tmp_path, new_n) -> None:
    path = _jsonl(tmp_path / "t.jsonl", ROWS)
    uninterrupted = load_dataset_tasks(path, DataSection(), seed=1)
    want = [t["x"] for step in range(6) for t in uninterrupted.train(3, step)]
    first = load_dataset_tasks(path, DataSection(), seed=1)
    read = [t["x"] for step in range(3) for t in first.train(3, step)]
    state = json.loads(json.dumps(first.state_dict(3, 3)))  # as the checkpoint stores it
    resumed = load_dataset_tasks(path, DataSection(), seed=1)
    resumed.load_state_dict(state, 3)
    read += [t["x"] for step in range(3, 6) for t in resumed.train(new_n, step)]
    assert read == want[: len(read)]  # no row repeated, none skipped, even with another batch size


def test_parquet_csv_a_folder_and_a_saved_dataset_dict_load(tmp_path) -> None:
    import datasets

    table = datasets.Dataset.from_list(ROWS)
    table.to_parquet(str(tmp_path / "t.parquet"))
    table.to_csv(str(tmp_path / "t.csv"), index=False)
    folder = tmp_path / "folder"
    folder.mkdir()
    _jsonl(folder / "a.jsonl", ROWS[:10])
    _jsonl(folder / "b.jsonl", ROWS[10:])
    datasets.DatasetDict({"train": table, "test": datasets.Dataset.from_list(ROWS[:4])}).save_to_disk(str(tmp_path / "saved"))
    for path in ("t.parquet", "t.csv", "folder"):
        source = load_dataset_tasks(str(tmp_path / path), DataSection(), seed=0)
        assert sorted(t["x"] for t in source.rows + source.heldout_rows) == list(range(20)), path
    saved = load_dataset_tasks(str(tmp_path / "saved"), DataSection(heldout="test"), seed=0)
    assert len(saved.rows) == 20 and [t["x"] for t in saved.heldout(10)] == [0, 1, 2, 3]


class Sum(BaseModel):
    a: int
    b: int


@pytest.mark.parametrize(("content", "data", "fragment"), [
    ('{"x": 1, "y": 2}\n{"x": 3}\n', {"fields": {"a": "x", "b": "y"}}, "t.jsonl row 2: missing field 'y'"),
    ('{"x": 1, "y": 2}\n{"x": 3, "y": \n', {}, "t.jsonl line 2: not JSON"),
    ('{"x": 1, "y": 2}\n[1, 2]\n', {}, "t.jsonl line 2: a task must be a JSON object"),
    ('{"x": 1, "y": 2}\n{"x": "three", "y": 4}\n', {"fields": {"a": "x", "b": "y"}}, "t.jsonl row 2: field 'a'"),
])
def test_bad_data_names_the_file_and_row(tmp_path, content, data, fragment) -> None:
    (tmp_path / "t.jsonl").write_text(content * 3)
    with pytest.raises(DataError, match=fragment.replace("[", r"\[")):
        load_dataset_tasks(str(tmp_path / "t.jsonl"), DataSection(**data), seed=0, task_model=Sum)


def test_agentrl_train_on_bad_data_exits_before_ray_naming_the_row(tmp_path) -> None:
    bad = _jsonl(tmp_path / "tasks.jsonl", [{"a": 1, "b": 2, "answer": 3}, {"a": 3, "answer": 3}])
    proc = subprocess.run([sys.executable, "-m", "agentrl.cli", "train", "--tasks", bad, "--data.fields",
                           '{"a": "a", "b": "b", "answer": "answer"}', "--output-dir", str(tmp_path / "run")],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "tasks.jsonl row 2: missing field 'b'" in proc.stderr
    assert "ray" not in proc.stdout.lower().replace("array", "")


def test_a_task_path_is_data_and_a_dotted_name_is_a_function(tmp_path) -> None:
    path = _jsonl(tmp_path / "t.jsonl", ROWS)
    assert load_config(CONFIG, ["--tasks", path]).tasks == path
    with pytest.raises(ValueError, match="not found"):
        load_config(CONFIG, ["--tasks", "no_such_pkg:make"])
