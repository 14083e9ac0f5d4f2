"""Backend choice without a Docker engine (a real unreachable $DOCKER_HOST, in subprocesses): auto
falls back to bubblewrap with a warning, and docker-marked tests fail under CI but skip elsewhere."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
NO_ENGINE = {"DOCKER_HOST": "unix:///nonexistent/agentrl-docker.sock"}


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "CI"}
    env.update(NO_ENGINE, **extra)
    return env


def test_auto_falls_back_to_bwrap_with_a_warning(require_bwrap):
    code = ("import logging; logging.basicConfig()\n"
            "from agentrl.sandbox import make_sandbox\n"
            "with make_sandbox('auto') as sb:\n"
            "    print(type(sb).__name__, sb.exec('echo hi', timeout=10).stdout.strip())\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=_env(),
                         cwd=ROOT)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["BwrapSandbox", "hi"]
    assert "falling back to the bubblewrap sandbox backend" in out.stderr


def test_explicit_docker_without_engine_is_a_clear_error():
    code = ("from agentrl.sandbox import DockerSandbox, SandboxError\n"
            "try:\n    DockerSandbox().start()\nexcept SandboxError as e:\n    print('ERR', e)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=_env(),
                         cwd=ROOT)
    assert out.stdout.startswith("ERR ") and "agentrl sandbox setup" in out.stdout, (out.stdout, out.stderr)


@pytest.mark.parametrize("ci", ["1", None])
def test_docker_tests_fail_under_ci_and_skip_elsewhere(ci):
    env = _env(**({"CI": ci} if ci else {}))
    out = subprocess.run([sys.executable, "-m", "pytest", "-q", "-rEs", "-p", "no:cacheprovider",
                          "tests/sandbox/test_docker_sandbox.py::test_missing_image_is_a_clear_error"],
                         capture_output=True, text=True, timeout=300, env=env, cwd=ROOT)
    if ci:
        assert out.returncode != 0 and "1 error" in out.stdout, out.stdout[-2000:]
        assert "CI is set but no Docker engine reachable" in out.stdout
    else:
        assert out.returncode == 0 and "1 skipped" in out.stdout, out.stdout[-2000:]
        assert "SKIPPED" in out.stdout and "no Docker engine reachable" in out.stdout
