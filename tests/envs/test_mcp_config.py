"""``rollout.mcp`` in a run config: the example config loads and points every environment the run makes
at its server; bad MCP settings are refused when the config loads, before Ray starts."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
from pydantic import ValidationError

from agentrl.envs.mcp import MCPServerSettings
from agentrl.run.config import RunConfig, load_config, read_yaml_config

REPO = Path(__file__).resolve().parents[2]
CONFIG = REPO / "examples" / "mcp_arithmetic" / "config.yaml"


def test_the_example_config_loads_and_sets_the_server_on_each_env(monkeypatch):
    monkeypatch.chdir(REPO)
    cfg = load_config(CONFIG)
    assert cfg.rollout.mcp == MCPServerSettings(command=["python3", "examples/mcp_arithmetic/server.py"], timeout_s=20,
                                                lifetime="process")
    from examples.mcp_arithmetic.env import MCPArithmeticEnv

    env = MCPArithmeticEnv()
    cfg.rollout.mcp.apply(env)
    assert (env.mcp_command, env.mcp_url, env.mcp_timeout_s, env.mcp_lifetime) == (
        ["python3", "examples/mcp_arithmetic/server.py"], None, 20, "process")
    assert MCPArithmeticEnv.mcp_command[1].endswith("server.py")  # the class keeps its own


@pytest.mark.parametrize(("mcp", "why"), [
    ({}, "exactly one of command"),
    ({"command": ["python3"], "url": "http://127.0.0.1:1/mcp"}, "exactly one of command"),
    ({"command": []}, "must name a program"),
    ({"command": ["no-such-mcp-server-program"]}, "not an executable"),
    ({"command": ["python3", "examples/mcp_arithmetic/nowhere.py"]}, "no such server script"),
    ({"url": "ftp://127.0.0.1/mcp"}, "http(s)"),
    ({"url": "http:///mcp"}, "http(s)"),
    ({"command": ["python3"], "timeout_s": 0}, "greater than 0"),
    ({"command": ["python3"], "tiemout_s": 3}, "did you mean 'timeout_s'"),
    ({"command": ["python3"], "lifetime": "forever"}, "'episode' or 'process'"),
])
def test_bad_mcp_settings_are_refused_at_load(monkeypatch, mcp, why):
    monkeypatch.chdir(REPO)
    raw = read_yaml_config(CONFIG)
    raw["rollout"]["mcp"] = mcp
    with pytest.raises(ValidationError, match=re.escape(why)):
        RunConfig.model_validate(raw)


def test_an_mcp_server_for_an_env_without_mcp_tools_is_refused(monkeypatch):
    monkeypatch.chdir(REPO)
    with pytest.raises(ValidationError, match="is no MCPEnvironment"):
        load_config(None, ["--rollout.mcp", '{"command": ["python3"]}'])


def test_agentrl_train_refuses_a_bad_server_before_ray(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "agentrl.cli", "train", str(CONFIG), "--output-dir", str(tmp_path / "run"),
                           "--rollout.mcp.command", '["python3", "examples/mcp_arithmetic/missing.py"]'],
                          capture_output=True, text=True, timeout=120, cwd=REPO)
    assert proc.returncode != 0
    assert "no such server script" in proc.stderr and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert "ray" not in proc.stderr.lower().replace("array", ""), proc.stderr[-2000:]  # Ray never started
