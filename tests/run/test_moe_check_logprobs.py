"""``agentrl check-logprobs DIR`` on a tiny Qwen3-MoE: engine and Megatron agree in fp32, routing free and
replayed; the model directory is given once."""

from __future__ import annotations

import json

import pytest

from agentrl.run import check_logprobs


def test_moe_engine_and_megatron_agree(tmp_path, capsys):
    from agentrl.models.tiny import make_tiny_model

    model = make_tiny_model(tmp_path / "moe", seed=0, arch="qwen3_moe")
    rc = check_logprobs.main([str(model), "--samples", "2", "--turns", "2", "--max-new-tokens", "8",
                              "--fail-above", "1e-4"])
    result = json.loads([ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("{")][-1])
    assert rc == 0 and result["n_tokens"] >= 2
    assert result["max_abs_diff"] < 1e-4
    assert result["replay"]["max_abs_diff"] < 1e-4  # the engine's own experts replayed


@pytest.mark.parametrize("argv", [[], ["a", "--model", "b"]])
def test_model_directory_is_given_exactly_once(argv, capsys):
    with pytest.raises(SystemExit):
        check_logprobs.main(argv)
    assert "give the model directory once" in capsys.readouterr().err
