"""agentrl.envs — give a model tools, get trainable trajectories.

A new tool environment::

    from agentrl.envs import Environment, tool

    class Arithmetic(Environment):
        max_turns = 3

        def reset(self, task):
            self.submitted = None
            return [{"role": "user", "content": f"What is {task['a']}+{task['b']}?"}]

        @tool
        def submit(self, answer: int) -> str:
            \"\"\"Submit the final answer.

            Args:
                answer: the sum.
            \"\"\"
            self.submitted, self.done = answer, True
            return "ok"

        def reward(self):
            return float(self.submitted == self.task["a"] + self.task["b"])

Run it with :func:`generate_rollout` (many episodes, GRPO groups) or :func:`run_episode` (one),
given a tokenizer's :class:`ChatRenderer` and any async ``generate(input_ids, *, session_id,
sampling_params) -> TurnRecord``. See ``docs/envs.md``.
"""

from __future__ import annotations

from typing import Any

from agentrl.envs.environment import Environment, ToolCallError
from agentrl.envs.formats import (
    HermesFormat,
    ParsedResponse,
    ToolCall,
    ToolCallFormat,
    format_for,
    get_tool_call_format,
    register_tool_call_format,
)
from agentrl.envs.tools import ToolArgumentError, ToolSpec, tool
from agentrl.plugins import load_function

# The loop imports the trajectory package; loaded on first use so ``import agentrl.envs`` stays minimal.
_LOOP_NAMES = {"run_episode", "generate_rollout", "EpisodeResult", "EpisodeMetrics", "RolloutResult", "Generate",
               "TurnAbortedError"}


def __getattr__(name: str) -> Any:
    if name in _LOOP_NAMES:
        from agentrl.envs import loop

        return getattr(loop, name)
    if name in ("ChatRenderer", "RenderedChat"):
        from agentrl.envs import render

        return getattr(render, name)
    raise AttributeError(f"module 'agentrl.envs' has no attribute {name!r}")


__all__ = [
    "ChatRenderer", "Environment", "EpisodeMetrics", "EpisodeResult", "Generate", "HermesFormat",
    "ParsedResponse", "RenderedChat", "RolloutResult", "ToolArgumentError", "ToolCall", "ToolCallError",
    "ToolCallFormat", "ToolSpec", "TurnAbortedError", "format_for", "generate_rollout", "get_tool_call_format", "load_function",
    "register_tool_call_format", "run_episode", "tool",
]
