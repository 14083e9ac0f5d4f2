"""No function in agentrl/engine over 80 lines (issue 39), Triton kernel bodies (decode_attention.py) aside."""

from __future__ import annotations

import ast
from pathlib import Path

ENGINE = Path(__file__).resolve().parents[2] / "agentrl" / "engine"
TRITON_KERNELS = {("decode_attention.py", "_kernels"), ("decode_attention.py", "partial_kernel")}


def test_no_engine_function_is_over_80_lines() -> None:
    long = []
    for path in sorted(ENGINE.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and (path.name, node.name) not in TRITON_KERNELS:
                lines = node.end_lineno - node.lineno + 1
                if lines > 80:
                    long.append(f"{path.name}:{node.name} ({lines} lines)")
    assert not long, long
