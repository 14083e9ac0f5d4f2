"""benchmarks/trainer_bench.py's main-job mode runs on CPU and compares the padded code with the packed one."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "trainer_bench.py"


def test_mainjob_variants_report_padding_and_forwards(tmp_path):
    spec = importlib.util.spec_from_file_location("trainer_bench", BENCH)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    out = tmp_path / "bench.json"
    rc = bench.main(["--batch", "mainjob", "--threads", "1", "--steps", "1", "--attention", "sdpa",
                     "--variants", "padded:fresh", "packed:reuse", "--out", str(out)])
    assert rc == 0
    before, after = json.loads(out.read_text())
    assert (before["layout"], after["layout"]) == ("padded", "packed")
    assert before["real_tokens"] == after["real_tokens"] == after["model_tokens_per_pass"]
    assert before["model_tokens_per_pass"] > before["real_tokens"]  # ragged lengths: padding
    # reference + behaviour + training fwd/bwd (3) before; the behaviour forward is gone after
    assert (before["forward_equivalents"], after["forward_equivalents"]) == (5, 4)
    assert after["cpu_s"] > 0 and after["step_s"] > 0
