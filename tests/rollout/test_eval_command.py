"""`agentrl eval DIR --tasks FILE --k K --out F`: real embedded engine, pass@k JSON; bad task files refused
before any engine starts."""

from __future__ import annotations

import json

import pytest

from agentrl.rollout.commands import eval_main


def _tasks_file(path, rows) -> str:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return str(path)


def test_eval_writes_pass_at_k_per_family(tiny_model_dir, tmp_path, capsys) -> None:
    tasks = [{"a": 10, "b": 20, "answer": 30, "multi_turn": False, "family": "small"},
             {"a": 40, "b": 50, "answer": 90, "multi_turn": False, "family": "large"},
             {"a": 11, "b": 12, "answer": 23, "multi_turn": False, "family": "small"}]
    out = tmp_path / "eval.json"
    code = eval_main([str(tiny_model_dir), "--tasks", _tasks_file(tmp_path / "t.jsonl", tasks), "--k", "4",
                      "--out", str(out), "--engines", "1", "--max-new-tokens", "6", "--concurrency", "16"])
    assert code == 0
    report = json.loads(out.read_text())
    assert report == json.loads(capsys.readouterr().out)
    for key in ("pass@1", "pass@2", "pass@4", "mean@4", "greedy_accuracy"):
        assert 0.0 <= report[key] <= 1.0, key
    assert report["pass@1"] <= report["pass@2"] <= report["pass@4"]
    sampled, greedy = report["sampled"], report["greedy"]
    assert sampled["all"]["tasks"] == 3 and sampled["small"]["tasks"] == 2 and sampled["large"]["tasks"] == 1
    assert greedy["all"]["tasks"] == 3 and "pass@1" in greedy["all"] and "pass@2" not in greedy["all"]
    for row in (*sampled.values(), *greedy.values()):
        assert row["pass@1_ci_low"] <= row["pass@1"] <= row["pass@1_ci_high"]


@pytest.mark.parametrize("rows, fragment", [(["{not json"], "line 1: not JSON"), (["[1, 2]"], "line 1: a task must be a JSON object"),
                                            ([" "], "no tasks in the file")])
def test_a_bad_task_file_is_refused_before_engines(tmp_path, rows, fragment) -> None:
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    with pytest.raises(SystemExit, match=fragment):
        eval_main([str(model), "--tasks", _tasks_file(tmp_path / "t.jsonl", rows), "--k", "2"])


def test_k_below_one_is_refused(tmp_path, capsys) -> None:
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    with pytest.raises(SystemExit) as exit_info:
        eval_main([str(model), "--k", "0"])
    assert exit_info.value.code == 2 and "--k must be at least 1" in capsys.readouterr().err
