"""Tasks that cannot run are refused before the run: an environment declares the task keys it reads
(``Environment.task_fields``) and every row of a ``--tasks`` file is checked for them when it loads."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from agentrl.envs.arithmetic import ArithmeticEnv, ArithmeticToolEnv
from agentrl.run.data import DataError, DataSection, load_dataset_tasks


def _jsonl(path, rows) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def test_a_row_without_a_declared_field_is_named_with_its_file_and_row(tmp_path):
    rows = [{"a": i, "b": i, "answer": 2 * i} for i in range(5)] + [{"a": 1, "b": 2}]
    with pytest.raises(DataError, match=r"t.jsonl row 6: the environment reads task field 'answer'"):
        load_dataset_tasks(_jsonl(tmp_path / "t.jsonl", rows), DataSection(), seed=0, task_fields=("a", "b", "answer"))
    source = load_dataset_tasks(str(tmp_path / "t.jsonl"), DataSection(), seed=0)  # nothing declared: loads
    assert len(source.rows) + len(source.heldout_rows) == 6


def test_the_field_mapping_is_applied_before_the_check(tmp_path):
    rows = [{"x": i, "y": i, "sum": 2 * i} for i in range(10)]
    source = load_dataset_tasks(_jsonl(tmp_path / "t.jsonl", rows), DataSection(fields={"a": "x", "b": "y", "answer": "sum"}),
                                seed=0, task_fields=ArithmeticEnv.task_fields)
    assert all(set(t) == {"a", "b", "answer"} for t in source.rows)


def test_the_builtin_envs_declare_what_they_read():
    assert set(ArithmeticEnv.task_fields) == set(ArithmeticToolEnv.task_fields) == {"a", "b", "answer"}


def test_agentrl_train_on_rows_lacking_the_answer_exits_before_ray(tmp_path):
    tasks = _jsonl(tmp_path / "tasks.jsonl", [{"a": i, "b": i} for i in range(10)])
    proc = subprocess.run([sys.executable, "-m", "agentrl.cli", "train", "--tasks", tasks, "--output-dir",
                           str(tmp_path / "run")], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "tasks.jsonl row 1: the environment reads task field 'answer'" in proc.stderr
    assert "ray" not in proc.stdout.lower().replace("array", "")
