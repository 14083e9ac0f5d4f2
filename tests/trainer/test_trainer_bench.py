"""benchmarks/trainer_bench.py runs on CPU with a small shape and writes its JSON."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "trainer_bench.py"


def _load():
    spec = importlib.util.spec_from_file_location("trainer_bench", BENCH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_cpu_tiny_run_writes_results(tmp_path):
    bench = _load()
    out = tmp_path / "bench.json"
    rc = bench.main(["--shape", "tiny", "--seq-len", "32", "--seqs-per-microbatch", "2", "--microbatches", "1",
                     "--steps", "1", "--attention", "sdpa", "--out", str(out)])
    assert rc == 0
    (row,) = json.loads(out.read_text())
    assert row["attention"] == "sdpa" and row["tokens_per_s"] > 0 and row["mfu"] is None
    assert 0.5 < row["params_m"] < 0.8  # the 0.62M tiny shape


def test_flops_formula_counts_linears_and_head():
    bench = _load()
    cfg = bench.hf_config("tiny", 32)
    # 2 layers x 2 x (qkv 128*256 + proj 128*128 + mlp 3*128*512) + attention + head 2*128*1024
    linear = 2 * 2 * (128 * 256 + 128 * 128 + 3 * 128 * 512)
    attn = 2 * 4 * 4 * 32 * 16
    assert bench.forward_flops_per_token(cfg, 32) == linear + attn + 2 * 128 * 1024


def test_memory_flags_reach_the_trainer_and_the_row_reports_components(tmp_path):
    bench = _load()
    out = tmp_path / "bench.json"
    rc = bench.main(["--shape", "tiny", "--seq-len", "32", "--seqs-per-microbatch", "2", "--microbatches", "1",
                     "--steps", "1", "--attention", "sdpa", "--dtype", "bfloat16", "--recompute", "selective",
                     "--recompute-modules", "mlp", "--logprob-chunk-elements", str(16 * 1024), "--out", str(out)])
    assert rc == 0
    (row,) = json.loads(out.read_text())
    assert row["recompute"] == "selective" and row["recompute_modules"] == ["mlp"]
    assert row["logprob_chunk_tokens"] == 16  # 16 x 1024-token vocabulary per chunk
    # 0.62M parameters: bf16 weights, fp32 gradient buffer, fp32 main copies + two Adam moments
    n = row["params_m"] * 1e6
    assert row["params_gib"] * 2**30 == pytest.approx(2 * n, rel=0.01)
    assert row["grads_gib"] * 2**30 == pytest.approx(4 * n, rel=0.01)
    assert row["optimizer_gib"] * 2**30 == pytest.approx(12 * n, rel=0.01)


# --setups: several batch shapes in one process, each row saying which shape it timed
def test_setups_run_in_turn_and_rows_carry_their_shape(tmp_path):
    out = tmp_path / "bench.json"
    assert _load().main(["--shape", "tiny", "--steps", "1", "--threads", "1", "--attention", "sdpa", "--setups", "32x2x1", "64x1x2",
                         "--out", str(out)]) == 0
    rows = json.loads(out.read_text())
    got = [(r["seq_len"], r["seqs_per_microbatch"], r["microbatches"], r["real_tokens"], r["tokens_per_microbatch"])
           for r in rows]
    assert got == [(32, 2, 1, 64, 64), (64, 1, 2, 128, 64)]


@pytest.mark.parametrize("bad", ["32x2", "32x0x1", "axbxc"])
def test_bad_setups_are_refused(bad):
    with pytest.raises(SystemExit):
        _load().main(["--shape", "tiny", "--setups", bad])
