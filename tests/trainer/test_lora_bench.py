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


def test_lora_bench_colocate_flow_on_cpu(tmp_path):
    """The colocated cycle (engine generates, releases, trainer steps, engine resumes, adapters merged,
    generates) runs end to end; on CPU it reports the flow (memory figures are the device's, on CUDA)."""
    out = tmp_path / "colocate.json"
    assert lora_bench.main(["--shape", "tiny", "--rank", "4", "--seq-len", "32", "--steps", "2", "--colocate",
                            "--gen-requests", "2", "--prompt-len", "8", "--new-tokens", "2", "--out", str(out)]) == 0
    row = json.loads(out.read_text())["colocate"]
    assert row["served_version_after"] == "lora-2"  # the second step's adapters are what the engine serves
    assert [len(row["timings_s"][k]) for k in ("release_s", "train_step_s", "resume_s", "sync_s", "generate_s")] == \
        [2, 2, 2, 3, 3]
    assert row["sync_bytes_sent"] < 0.2 * row["sync_full_bytes"]
