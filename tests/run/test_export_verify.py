"""``agentrl export`` refuses a checkpoint whose checksum manifest is gone unless told ``--no-verify``."""

from __future__ import annotations

import json

from agentrl.run.export import main
from agentrl.trainer.checkpoint import MANIFEST


def _checkpoint(tmp_path, *, manifest: bool):
    run = tmp_path / "run"
    step = run / "checkpoints" / "step-3"
    step.mkdir(parents=True)
    (run / "config.json").write_text("{}")
    (step / "common.pt").write_bytes(b"weights")
    if manifest:
        (step / MANIFEST).write_text(json.dumps({"files": {}}))
    return step


def test_a_checkpoint_without_its_manifest_is_refused_before_anything_loads(tmp_path, capsys):
    step = _checkpoint(tmp_path, manifest=False)
    assert main([str(step), str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert f"has no {MANIFEST}" in err and "--no-verify" in err and err.count("\n") == 1
    assert not (tmp_path / "out").exists()


def test_no_verify_goes_past_the_manifest_check(tmp_path, capsys):
    step = _checkpoint(tmp_path, manifest=False)
    assert main([str(step), str(tmp_path / "out"), "--no-verify"]) == 2  # stops later: no metrics.jsonl
    err = capsys.readouterr().err
    assert MANIFEST not in err and "metrics.jsonl" in err


def test_a_missing_checkpoint_is_one_line(tmp_path, capsys):
    assert main([str(tmp_path / "nope"), str(tmp_path / "out")]) == 2
    assert "is not a checkpoint directory" in capsys.readouterr().err
