"""``agentrl check-weight-sync``: one JSON line, bitwise equality after K steps, clear errors on bad input."""

from __future__ import annotations

import json

import pytest

from agentrl.run.check_weight_sync import main

FIELDS = {"bitwise_equal", "bytes_sent", "full_bytes", "seconds", "weight_version"}


@pytest.mark.parametrize("mode", ["disk", "tensor", "broadcast", "delta"])
def test_check_passes_on_a_running_engine(mode, tiny_model_dir, engine_urls, capsys) -> None:
    code = main([
        "--model", str(tiny_model_dir), "--mode", mode, "--steps", "2", "--engine-url", engine_urls[0],
        "--trainer", "hf-adamw-standin",
    ])
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == 1
    result = json.loads(lines[0])
    assert set(result) >= FIELDS
    assert result["bitwise_equal"] is True and code == 0
    assert result["weight_version"] == "step-2"
    assert result["full_bytes"] == 2 * 2_494_976  # two syncs of the 0.62M-param fp32 tiny model
    assert result["bytes_sent"] > 0 and result["seconds"] > 0
    assert result["trainer"] == "hf-adamw-standin"


def test_check_delta_over_the_broadcast_group(tiny_model_dir, engine_urls, capsys) -> None:
    code = main([
        "--model", str(tiny_model_dir), "--mode", "delta", "--transport", "broadcast", "--steps", "3",
        "--engine-url", engine_urls[0], "--trainer", "hf-adamw-standin",
    ])
    result = json.loads(capsys.readouterr().out)
    assert code == 0 and result["bitwise_equal"] is True and result["weight_version"] == "step-3"
    assert result["transport"] == "broadcast"
    # the first sync is a full broadcast, the other two are deltas over the group
    assert result["syncs"][0]["fallback"] and not any(s["fallback"] for s in result["syncs"][1:])


@pytest.mark.parametrize(("mode", "transport"), [("delta", "shm"), ("disk", "broadcast"), ("tensor", "pigeon")])
def test_check_rejects_a_transport_that_does_not_fit_the_mode(mode, transport, tiny_model_dir, capsys) -> None:
    assert main(["--model", str(tiny_model_dir), "--mode", mode, "--transport", transport]) == 2
    assert "--transport" in capsys.readouterr().err


def test_check_with_the_megatron_trainer_and_its_own_engine(tiny_model_dir, capsys) -> None:
    pytest.importorskip("megatron.core")
    code = main(["--model", str(tiny_model_dir), "--mode", "delta", "--steps", "3"])
    result = json.loads(capsys.readouterr().out)
    assert result["trainer"] == "megatron"
    assert code == 0 and result["bitwise_equal"] is True and result["weight_version"] == "step-3"
    # First sync is full, the next two are deltas.
    assert result["syncs"][0]["fallback"] and not result["syncs"][1]["fallback"]


def test_check_rejects_a_directory_without_a_model(tmp_path, capsys) -> None:
    assert main(["--model", str(tmp_path), "--mode", "disk"]) == 2
    assert "config.json" in capsys.readouterr().err


def test_check_rejects_zero_steps(tiny_model_dir, capsys) -> None:
    assert main(["--model", str(tiny_model_dir), "--mode", "disk", "--steps", "0"]) == 2
    assert "--steps" in capsys.readouterr().err


def test_check_rejects_an_unknown_mode(tiny_model_dir) -> None:
    with pytest.raises(SystemExit):
        main(["--model", str(tiny_model_dir), "--mode", "pigeon"])
