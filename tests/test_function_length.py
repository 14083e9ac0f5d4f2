"""No function in ``agentrl/`` is over 80 lines, Triton kernel bodies aside (issue 39, part 4).

A function's length is its source lines from ``def`` (decorators excluded) to its last line. Exempt:
functions decorated with ``triton.jit`` (or a bare ``jit`` imported from triton), whose body is one GPU
kernel and is not split without cost; their lines are also not counted in the function that encloses
them, so a kernel factory such as ``agentrl/engine/decode_attention.py:_kernels`` is measured by its
own code only.
"""

from __future__ import annotations

import ast
from pathlib import Path

LIMIT = 80
ROOT = Path(__file__).resolve().parents[1] / "agentrl"
Function = ast.FunctionDef | ast.AsyncFunctionDef


def _is_triton_kernel(fn: Function) -> bool:
    for dec in fn.decorator_list:
        target = dec.func if isinstance(dec, ast.Call) else dec
        if isinstance(target, ast.Attribute) and target.attr == "jit" and isinstance(target.value, ast.Name) \
                and target.value.id in ("triton", "tl"):
            return True
        if isinstance(target, ast.Name) and target.id == "jit":
            return True
    return False


def _own_lines(fn: Function) -> int:
    """Lines of ``fn`` less those of the Triton kernels nested in it."""
    lines = fn.end_lineno - fn.lineno + 1
    for node in ast.walk(fn):
        if node is not fn and isinstance(node, Function) and _is_triton_kernel(node):
            lines -= node.end_lineno - min([node.lineno, *(d.lineno for d in node.decorator_list)]) + 1
    return lines


def long_functions(root: Path = ROOT, limit: int = LIMIT) -> list[str]:
    """``path:line name (n lines)`` of each non-kernel function over ``limit`` lines under ``root``."""
    out = []
    for path in sorted(root.rglob("*.py")):
        tree = ast.parse(path.read_text(), filename=str(path))
        for node in ast.walk(tree):
            if isinstance(node, Function) and not _is_triton_kernel(node) and (n := _own_lines(node)) > limit:
                out.append(f"{path.relative_to(root.parent)}:{node.lineno} {node.name} ({n} lines)")
    return out


def test_no_function_over_80_lines():
    too_long = long_functions()
    assert not too_long, "functions over 80 lines (split them into named pieces):\n" + "\n".join(too_long)


def test_the_rule_finds_a_long_function_and_exempts_only_kernels(tmp_path):
    body = "\n".join(f"    x{i} = {i}" for i in range(LIMIT))
    kernel = "\n".join(f"        y{i} = {i}" for i in range(LIMIT + 5))
    (tmp_path / "m.py").write_text(
        f"import triton\n\ndef long():\n{body}\n\n"
        f"@triton.jit\ndef kernel():\n{kernel.replace('        ', '    ')}\n\n"
        f"def factory():\n    @triton.jit\n    def k():\n{kernel}\n    return k\n")
    found = long_functions(tmp_path)
    assert [f.split()[1] for f in found] == ["long"], found
