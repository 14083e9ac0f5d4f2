"""The package layering rules of README.md, checked on the source: a lower layer never imports a higher one,
and the light packages never pull torch at import time."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1] / "agentrl"
# Rank of each package; a module may import agentrl packages of equal or lower rank only.
RANK = {
    "trajectory": 0,
    "sandbox": 1,
    "envs": 1,
    "models": 2,
    "engine": 2,
    "rollout": 3,
    "weights": 4,
    "trainer": 5,
    "run": 6,
    "cli": 7,
    "view": 7,  # the trajectory viewer: reads what a run wrote, beside the command line
}
# Same-rank packages that must stay independent of each other.
FORBIDDEN_SIDEWAYS = {("envs", "sandbox"), ("sandbox", "envs"), ("engine", "models"), ("models", "engine")}


def _package_of(path: Path) -> str:
    rel = path.relative_to(ROOT)
    return rel.parts[0].removesuffix(".py") if len(rel.parts) > 1 or rel.stem == "cli" else "root"


def _agentrl_imports(path: Path) -> list[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    names: list[str] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.append(node.module)
    return [n.split(".")[1] for n in names if n.startswith("agentrl.") and len(n.split(".")) > 1]


SOURCES = sorted(p for p in ROOT.rglob("*.py"))


@pytest.mark.parametrize("path", SOURCES, ids=lambda p: str(p.relative_to(ROOT)))
def test_no_upward_imports(path: Path) -> None:
    package = _package_of(path)
    if package not in RANK or package == "cli":
        return
    for imported in _agentrl_imports(path):
        if imported not in RANK:
            continue
        assert RANK[imported] <= RANK[package], f"{path}: {package} (rank {RANK[package]}) imports {imported}"
        assert (package, imported) not in FORBIDDEN_SIDEWAYS, f"{path}: {package} imports sibling {imported}"


def test_the_trainer_is_the_megatron_trainer_only() -> None:
    # The run's orchestration lives in agentrl.run; the trainer sees samples and weights, nothing above.
    allowed = {"trajectory", "weights", "trainer", "plugins", "settings"}  # the last two: stdlib + pydantic
    for path in sorted((ROOT / "trainer").rglob("*.py")):
        assert set(_agentrl_imports(path)) <= allowed, f"{path} imports {set(_agentrl_imports(path)) - allowed}"


@pytest.mark.parametrize("module", ["agentrl", "agentrl.trajectory", "agentrl.envs", "agentrl.sandbox", "agentrl.run",
                                    "agentrl.cli", "agentrl.view.app", "agentrl.view.cli"])
def test_light_imports_do_not_pull_torch(module: str) -> None:
    code = f"import sys, {module}; heavy = [m for m in ('torch', 'transformers', 'ray', 'docker', 'megatron') if m in sys.modules]; print(heavy)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]", f"import {module} pulled {out.strip()}"
