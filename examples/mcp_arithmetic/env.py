"""The multi-turn arithmetic task with ``add`` served by an MCP server (``server.py``, over stdio).

The model calls ``add`` (on the server), then the environment's own ``submit``; reward 1 for the right
sum after an ``add`` call, as :class:`agentrl.envs.arithmetic.ArithmeticToolEnv`."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from agentrl.envs.arithmetic import ArithmeticEnv
from agentrl.envs.mcp import MCPEnvironment

SERVER = Path(__file__).with_name("server.py")


class MCPArithmeticEnv(MCPEnvironment, ArithmeticEnv):
    """The arithmetic env's prompt, ``submit`` and task fields; ``add`` from the MCP server."""

    max_turns = 4
    mcp_command = [sys.executable, str(SERVER)]

    def prompt(self, task: dict[str, Any]) -> list[dict[str, Any]]:
        return ArithmeticEnv.reset(self, task)

    def reward(self) -> float:
        return float("add" in self.mcp_calls and self.submitted == self.task["answer"])
