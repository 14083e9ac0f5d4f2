"""benchmarks/lora_bench.py runs on CPU with the tiny shape and reports what it measured."""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent.parent.parent / "benchmarks"))
import lora_bench  # noqa: E402


def test_lora_bench_tiny_cpu(tmp_path):
    out = tmp_path / "lora.json"
    assert lora_bench.main(["--shape", "tiny", "--rank", "4", "--seq-len", "32", "--steps", "1",
                            "--microbatches", "1", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    train, sync = result["train"], result["sync"]
    assert train["adapter_weights_gib"] < train["base_weights_gib"] and train["tokens_per_s"] > 0
    # rank 4 on every projection of 2 layers: 22528 / 2 adapters' parameters, fp32, plus the file header
    adapter_params = 2 * 4 * (2 * (128 + 128) + 2 * (128 + 64) + 3 * (128 + 512))
    assert adapter_params * 4 < sync["bytes_sent"] < adapter_params * 4 + 16_384
    assert sync["full_bytes"] == 623_744 * 4 and sync["ratio"] == sync["bytes_sent"] / sync["full_bytes"]
    assert sync["merged_weights"] == 2 * 7 and sync["adapter_tensors"] == 2 * 2 * 7
