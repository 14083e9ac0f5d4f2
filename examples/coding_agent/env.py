"""``CodingEnv``: solve a HumanEval problem with tools in a pooled Docker sandbox; reward = hidden tests.

Tools: ``write_file(path, content)``, ``run_python(code)`` and ``run_tests()`` (the docstring's examples
only) — all inside one sandbox per episode, taken from a process-wide :class:`SandboxPool` on the first
tool that needs it and given back by ``close()``. The episode ends when the model replies without a
tool call. The reward is 1.0 when ``solution.py`` passes the problem's hidden tests in a *fresh* grading
sandbox (:class:`agentrl.sandbox.Grader`), else 0.0.

For ``agentrl train``: ``env: examples.coding_agent.env:CodingEnv``, ``tasks:
examples.coding_agent.env:make_tasks``, ``expert: examples.coding_agent.env:expert_messages``
(see ``examples/coding_agent/train.yaml``).
"""

from __future__ import annotations

import asyncio
import threading
from typing import Any

from agentrl.envs import Environment, tool
from agentrl.envs.formats import HermesFormat, ToolCall, ToolCallFormat
from examples.coding_agent.feedback import (
    NO_EXAMPLES,
    NO_SOLUTION,
    RUNNER,
    SOLUTION_FILE,
    all_passed_report,
    describe,
    examples_report,
    exec_report,
    runner_input,
    wrote_message,
)
from examples.coding_agent.tasks import make_tasks, problems

__all__ = ["CodingEnv", "expert_messages", "expert_replies", "make_tasks", "sandbox_pool"]

SYSTEM_PROMPT = (
    "You are a careful Python programmer working in a sandbox. Write the solution with write_file, check it "
    "with run_tests (the examples from the docstring) or run_python, and fix it until it works. When you "
    "are done, reply with a short message and no tool call."
)

_pools: dict[tuple[str, int], Any] = {}
_pools_lock = threading.Lock()


def sandbox_pool(backend: str = "docker", size: int = 4):
    """The process-wide sandbox pool for ``(backend, size)``, created on first use (warmed lazily)."""
    from agentrl.sandbox import SandboxPool

    with _pools_lock:
        pool = _pools.get((backend, size))
        if pool is None:
            pool = _pools[(backend, size)] = SandboxPool(size=size, backend=backend)
        return pool


def hidden_tests(task_id: str) -> dict[str, str]:
    """The grader's test file for a problem (never shown to the agent)."""
    from agentrl.sandbox.humaneval import humaneval_files

    return humaneval_files(problems()[task_id], "")[1]


class CodingEnv(Environment):
    """One HumanEval problem. ``pool`` / ``grader`` override the process-wide Docker pool and grader."""

    max_turns = 8
    max_tool_output_chars = 4000
    tool_timeout_s = 120.0  # a pool that is busy with other episodes makes a tool wait for a sandbox
    exec_timeout_s = 10.0  # per run_python / run_tests command
    grade_timeout_s = 30.0
    sandbox_backend = "docker"
    pool_size = 4

    def __init__(self, pool: Any = None, grader: Any = None) -> None:
        super().__init__()
        self._pool = pool
        self._grader = grader
        self._acquiring: asyncio.Future | None = None  # the pool hand-out of this episode's sandbox
        self.grade: Any = None  # the GradeResult of the reward, for inspection

    def reset(self, task: dict[str, Any]) -> list[dict[str, str]]:
        # Sync and sandbox-free: the warm-up builds prompts with reset() alone; sandboxes come on first use.
        self.task = task
        return [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": describe(task)}]

    async def sandbox(self):
        """This episode's sandbox, acquired from the pool on first use.

        The hand-out runs as its own task, shielded: a tool that times out while waiting for a free
        sandbox does not cancel it, so the sandbox it eventually gets is still given back by close().
        """
        if self._acquiring is None:  # no await between the check and the assignment: one hand-out
            self._pool = self._pool or sandbox_pool(self.sandbox_backend, self.pool_size)
            self._acquiring = asyncio.ensure_future(self._pool.aacquire())
        return await asyncio.shield(self._acquiring)

    @tool
    async def write_file(self, path: str, content: str) -> str:
        """Write a text file in the working directory (overwrites it).

        Args:
            path: file path relative to the working directory, e.g. solution.py.
            content: the complete file content.
        """
        from agentrl.sandbox.base import work_path

        work_path("/work", path)  # a path outside the work dir is refused before any sandbox is used
        sandbox = await self.sandbox()
        await sandbox.awrite_files({path: content})
        return wrote_message(path, content)

    @tool
    async def run_python(self, code: str) -> str:
        """Run a Python program in the working directory and return its exit code, stdout and stderr.

        Args:
            code: the program's source.
        """
        sandbox = await self.sandbox()
        res = await sandbox.arun_python(code, timeout=self.exec_timeout_s)
        return exec_report(res, self.exec_timeout_s)

    @tool
    async def run_tests(self) -> str:
        """Run the examples from the task's docstring against solution.py."""
        examples = self.task["examples"]
        if not examples:
            return NO_EXAMPLES
        sandbox = await self.sandbox()
        probe = await sandbox.aexec(["test", "-f", SOLUTION_FILE], timeout=self.exec_timeout_s)
        if probe.exit_code != 0:
            return NO_SOLUTION
        res = await sandbox.arun_python(RUNNER, timeout=self.exec_timeout_s, stdin=runner_input(examples))
        return examples_report(res, self.exec_timeout_s)

    async def reward(self) -> float:
        if self._acquiring is None:  # no tool ever needed a sandbox: nothing was written
            return 0.0
        from agentrl.sandbox import Grader

        sandbox = await self.sandbox()
        grader = self._grader or Grader(backend=self.sandbox_backend, timeout=self.grade_timeout_s)
        self.grade = await asyncio.to_thread(grader.grade_from, sandbox, [SOLUTION_FILE],
                                             hidden_tests(self.task["task_id"]))
        return self.grade.reward

    async def close(self) -> None:
        if self._acquiring is None:
            return
        acquiring, self._acquiring = self._acquiring, None
        try:
            sandbox = await acquiring
        except Exception:  # the hand-out itself failed: there is nothing to give back
            return
        await self._pool.arelease(sandbox)


def expert_replies(task: dict[str, Any], *, tool_format: ToolCallFormat | None = None,
                   solution: str | None = None) -> list[str]:
    """The assistant texts of the expert: write the canonical solution, run the examples, say done.
    ``solution`` replaces the canonical module (e.g. a broken one, for tests)."""
    fmt = tool_format or HermesFormat()
    code = solution if solution is not None else task["prompt"] + problems()[task["task_id"]]["canonical_solution"]
    return [fmt.render_calls([ToolCall("write_file", {"path": SOLUTION_FILE, "content": code})]),
            fmt.render_calls([ToolCall("run_tests", {})]),
            "Done: solution.py passes the examples."]


def expert_messages(task: dict[str, Any], *, tool_format: ToolCallFormat | None = None) -> list[dict[str, Any]]:
    """The scripted correct chat of ``task`` for supervised warm-up: the initial messages, then the
    expert's replies and the tool results the environment gives them (texts from the same functions)."""
    env = CodingEnv()
    messages = env.reset(task)
    write, run, done = expert_replies(task, tool_format=tool_format)
    code = task["prompt"] + problems()[task["task_id"]]["canonical_solution"]
    messages += [
        {"role": "assistant", "content": write},
        {"role": "tool", "name": "write_file", "content": wrote_message(SOLUTION_FILE, code)},
        {"role": "assistant", "content": run},
        {"role": "tool", "name": "run_tests", "content": all_passed_report(task["examples"])},
        {"role": "assistant", "content": done},
    ]
    return messages
