"""`agentrl eval` / `agentrl rollout` on a path that is no model dir: one clear line, exit 2, no engine."""

from __future__ import annotations

import pytest

from agentrl.rollout.commands import eval_main, rollout_main


@pytest.mark.parametrize("main", [eval_main, lambda argv: rollout_main([*argv, "--output", "x.jsonl"])])
def test_a_missing_model_dir_is_one_line(tmp_path, capsys, main):
    with pytest.raises(SystemExit) as exit_info:
        main([str(tmp_path / "no_such_model")])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert f"{tmp_path / 'no_such_model'} is not a directory" in err
    assert "Traceback" not in err and "Repo id" not in err


def test_a_dir_without_config_json_is_named(tmp_path, capsys):
    with pytest.raises(SystemExit):
        eval_main([str(tmp_path)])
    assert "has no config.json" in capsys.readouterr().err
