"""``agentrl check-logprobs`` end to end: embedded engine samples, Megatron recomputes (fp32 agreement)."""

from __future__ import annotations

import json

from agentrl.run import check_logprobs


def test_engine_and_megatron_agree_on_sampled_multi_turn_tokens(tmp_path, capsys):
    from agentrl.models.tiny import make_tiny_model

    model = make_tiny_model(tmp_path / "tiny", seed=0)
    rc = check_logprobs.main(["--model", str(model), "--samples", "2", "--turns", "2", "--max-new-tokens", "8",
                              "--fail-above", "1e-4"])
    lines = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("{")]
    assert rc == 0
    result = json.loads(lines[-1])
    assert result["n_samples"] == 2 and result["n_tokens"] >= 2
    assert result["max_abs_diff"] < 1e-4 and result["mean_abs_diff"] <= result["max_abs_diff"]


def test_compare_counts_only_trained_tokens():
    samples = [{"loss_mask": [1, 0, 1], "rollout_logprobs": [-1.0, -5.0, -2.0]}]
    out = check_logprobs.compare(samples, [[-1.5, 0.0, -2.0]])
    assert out == {"max_abs_diff": 0.5, "mean_abs_diff": 0.25, "n_tokens": 2, "n_samples": 1}


def test_not_a_model_dir_is_a_clear_error(tmp_path, capsys):
    assert check_logprobs.main(["--model", str(tmp_path)]) == 2
    assert "no config.json" in capsys.readouterr().err
