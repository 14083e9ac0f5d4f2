"""The multi-turn arithmetic task with ``add`` served by an MCP server (``server.py``, over stdio).

The model calls ``add`` (on the server), then the environment's own ``submit``; reward 1 for the right
sum after an ``add`` call, as :class:`agentrl.envs.arithmetic.ArithmeticToolEnv`."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from agentrl.envs.arithmetic import SYSTEM_PROMPT, question
from agentrl.envs.mcp import MCPEnvironment
from agentrl.envs.tools import tool

SERVER = Path(__file__).with_name("server.py")


class MCPArithmeticEnv(MCPEnvironment):
    max_turns = 4
    task_fields = ("a", "b", "answer")
    mcp_command = [sys.executable, str(SERVER)]

    def prompt(self, task: dict[str, Any]) -> list[dict[str, Any]]:
        self.submitted: int | None = None
        return [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": question(task)}]

    @tool
    def submit(self, answer: int) -> str:
        """Submit the final answer.

        Args:
            answer: the sum.
        """
        self.submitted = answer
        self.done = True
        return "ok"

    def reward(self) -> float:
        return float("add" in self.mcp_calls and self.submitted == self.task["answer"])
