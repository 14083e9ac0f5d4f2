"""trainer_bench --setups: several batch shapes in one process, each row saying which shape it timed."""

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
