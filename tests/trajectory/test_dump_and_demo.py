"""The dump CLI and the demo that scripts/main runs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from agentrl.trajectory import TrajectoryManager, TurnRecord
from agentrl.trajectory.dump import load_samples
from agentrl.trajectory.dump import main as dump_main

TOKENIZER = Path(__file__).resolve().parents[1] / "assets" / "tiny_tokenizer"


def _samples():
    manager = TrajectoryManager()
    user = {"role": "user", "content": "hi"}
    manager.record_turn(
        "s",
        turn=TurnRecord([1, 87, 2], [67, 68, 2], [-0.1, -0.2, -0.3], "stop", "7"),
        prompt_messages=[user],
        response_message={"role": "assistant", "content": "a"},
    )
    # The next prompt re-renders the response as [67, 69]: drift at position 4, realigned.
    manager.record_turn(
        "s",
        turn=TurnRecord([1, 87, 2, 67, 69, 2, 1], [70, 2], [-0.4, -0.5], "stop", "7"),
        prompt_messages=[user, {"role": "assistant", "content": "a"}, user],
        response_message={"role": "assistant", "content": "b"},
    )
    return manager.get_trajectory("s", reward=0.5)


@pytest.mark.parametrize("layout", ["object", "list", "jsonl"])
def test_dump_reads_every_layout_and_marks_drift(tmp_path, capsys, layout):
    samples = _samples()
    dicts = [s.to_dict() for s in samples]
    path = tmp_path / "samples.json"
    if layout == "object":
        path.write_text(json.dumps(dicts[0]))
    elif layout == "list":
        path.write_text(json.dumps(dicts))
    else:
        path.write_text("\n".join(json.dumps(d) for d in dicts * 2) + "\n")
    assert load_samples(path) == (samples * 2 if layout == "jsonl" else samples)
    assert dump_main([str(path), "--tokenizer", str(TOKENIZER)]) == 0
    out = capsys.readouterr().out
    assert "<<< drift: turn 1 re-rendered from here (realigned)" in out
    assert "'<|im_end|>'" in out  # decoded
    row = next(line for line in out.splitlines() if line.split()[:2] == ["3", "67"])
    assert row.split()[2:6] == ["0", "0.0000", "model", "0"]  # turn 0's token, untrained after the drift


def test_dump_runs_view_and_limits(tmp_path, capsys):
    path = tmp_path / "s.json"
    path.write_text(json.dumps(_samples()[0].to_dict()))
    assert dump_main([str(path), "--runs"]) == 0
    out = capsys.readouterr().out
    assert "[    4,     6)  realigned_prompt     1" in out and " pos " not in out
    assert dump_main([str(path), "--max-tokens", "2"]) == 0
    assert "7 more tokens" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ("", "empty file"),
        ("{not json", "not JSON"),
        ('{"tokens": [1]}', "lacks"),
        (
            '[{"tokens": [1], "response_start": 5, "loss_mask": [], "rollout_logprobs": [], "provenance": []}]',
            "response_start",
        ),
    ],
)
def test_dump_reports_bad_files(tmp_path, capsys, content, message):
    path = tmp_path / "bad.json"
    path.write_text(content)
    assert dump_main([str(path)]) == 2
    assert message in capsys.readouterr().err
    assert dump_main([str(tmp_path / "missing.json")]) == 2


class _FastChat:
    """The demo's tokenizer interface over the test tokenizer (tokenizers + jinja2: no transformers import)."""

    def __init__(self) -> None:
        from real_tokenizers import tiny_tokenizer

        self.tok = tiny_tokenizer()
        self.eos_id = self.tok.eos_id

    def encode(self, text):
        return self.tok.encode(text)

    def prompt_ids(self, messages):
        return self.tok.prompt_ids(messages)

    def decode_one(self, token):
        return self.tok.decode([token])


def test_demo_shows_the_contract():
    from agentrl.trajectory.demo import run_demo

    report, samples = run_demo(_FastChat())
    lines = report.splitlines()
    assert any("clean episode" in line and "new, clean, clean" in line and "51/51" in line for line in lines)
    rows = {tuple(line.split()[2:4]): line for line in lines if line.startswith("drifting episode")}
    assert "new, clean, realigned" in rows[("realign", "1024")] and "32/52" in rows[("realign", "1024")]
    assert "new, clean, forked" in rows[("fork", "1024")] and "52/52" in rows[("fork", "1024")]
    assert "new, clean, cut" in rows[("truncate", "1024")]
    assert "new, clean, forked" in rows[("realign", "4")]
    assert "<<< drift: turn 2 re-rendered from here (realigned)" in report
    (sample,) = samples
    assert sample.metadata["outcomes"] == ["new", "clean", "realigned"]


def test_demo_main_through_transformers(tmp_path, capsys):
    """The command scripts/main runs, end to end (imports transformers: the slowest test here)."""
    pytest.importorskip("transformers")
    from agentrl.trajectory.demo import main as demo_main

    out_file = tmp_path / "demo.jsonl"
    assert demo_main(["--out", str(out_file)]) == 0
    assert "new, clean, realigned" in capsys.readouterr().out
    (sample,) = load_samples(out_file)
    assert sample.metadata["outcomes"] == ["new", "clean", "realigned"]
