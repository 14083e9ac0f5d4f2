"""``FunctionEnv``: write a function's body in a pooled Docker sandbox, run its examples, submit; reward =
hidden tests in a grading sandbox. The environment of ``examples/coding_agent/config.yaml``.

Tools (compact, so episodes fit the tiny model's 512 positions): ``write(code)`` saves ``solution.py`` =
the task's prompt (signature + docstring) + ``code`` as the body; ``run_tests()`` runs the docstring's
examples against it; ``submit()`` ends the episode. One sandbox per episode from a process-wide pool
(taken on the first ``write``/``run_tests``, reset and given back by ``close()``). The reward is 1.0 when
``solution.py``, copied out of the agent's sandbox, passes every hidden test in a grading sandbox
(:class:`agentrl.sandbox.PooledGrader`), else 0.0; an episode that wrote nothing is graded too (the
tests fail to import a solution), so every reward comes from a sandbox execution.

Two task families, one environment: ``family="oneliner"`` (:mod:`examples.coding_agent.oneliners`, the
training family) and ``family="humaneval"`` (the 164 HumanEval problems, the held-out "real" benchmark).

A sandbox that dies during the episode (container killed, engine restarted), or a grading sandbox that
dies while grading, fails the episode with :class:`SandboxFailure`: it is counted (``rollout/failed``,
``rollout/failure_reasons/SandboxFailure``, ``env/sandbox/failed_episodes``) and has no sample, so no
reward of 0 ever stands for "the infrastructure broke".
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import os
import random
import re
import sys
import textwrap
import threading
import types
from typing import Any

from agentrl.envs import Environment, tool
from agentrl.envs.formats import HermesFormat, ToolCall, ToolCallFormat
from examples.coding_agent import oneliners
from examples.coding_agent.feedback import NO_EXAMPLES, RUNNER, SOLUTION_FILE, all_passed_report, runner_input
from examples.coding_agent.meter import SandboxMeter

__all__ = ["FunctionEnv", "SandboxFailure", "expert_messages", "expert_messages_with_repairs", "expert_replies",
           "make_tasks", "near_miss_body", "visible_report"]

SYSTEM_PROMPT = "Write the function's body with write, test it with run_tests, then submit."
FAMILIES = ("oneliner", "humaneval")
# Extra label on every container of this example: tests find exactly ours (and any left behind) by it.
EXAMPLE_LABEL = "agentrl.example"
LABELS = {EXAMPLE_LABEL: "coding_agent"}
SAVED = f"saved {SOLUTION_FILE}"
SUBMITTED = "submitted"
NO_SOLUTION = f"no {SOLUTION_FILE} yet: write it first"
METER = SandboxMeter()


class SandboxFailure(RuntimeError):
    """The episode's sandbox or its grading sandbox died: the episode has no reward."""


_lock = threading.Lock()
_pools: dict[tuple[int, int, str], tuple[Any, Any]] = {}  # (pool size, grader size, backend)


def sandboxes(pool_size: int, grader_size: int, backend: str = "docker") -> tuple[Any, Any]:
    """The process-wide (agent pool, pooled grader) pair for these sizes and sandbox ``backend`` ("docker"
    or "bwrap"), created on first use."""
    from agentrl.sandbox import PooledGrader, SandboxPool
    from agentrl.sandbox.backend import make_sandbox

    with _lock:
        pair = _pools.get((pool_size, grader_size, backend))
        if pair is None:
            if backend == "docker" and not any(key[2] == "docker" for key in _pools):
                remove_orphans()
            pool = SandboxPool(size=pool_size, factory=lambda: make_sandbox(backend, labels=LABELS, role="pool"))
            grader = PooledGrader(size=grader_size, backend=backend, labels=LABELS, timeout=FunctionEnv.grade_timeout_s)
            pair = _pools[(pool_size, grader_size, backend)] = (pool, grader)
        return pair


def close_sandboxes() -> None:
    """Remove every sandbox this process's environments created."""
    with _lock:
        pairs = list(_pools.values())
        _pools.clear()
    for pool, grader in pairs:
        pool.close()
        grader.close()


def remove_orphans() -> int:
    """Remove this example's containers and volumes whose owner process is gone (what a run killed
    before it could close its pools left behind); returns how many containers went."""
    from agentrl.sandbox.docker_client import docker_client
    from agentrl.sandbox.labels import owner_alive

    api = docker_client().api
    mine = {"label": [f"{EXAMPLE_LABEL}={LABELS[EXAMPLE_LABEL]}"]}
    removed = 0
    for container in api.containers(all=True, filters=mine):
        if not owner_alive(container.get("Labels") or {}):
            with contextlib.suppress(Exception):  # removed concurrently
                api.remove_container(container["Id"], force=True)
                removed += 1
    for volume in api.volumes(filters=mine).get("Volumes") or []:
        if not owner_alive(volume.get("Labels") or {}):
            with contextlib.suppress(Exception):
                api.remove_volume(volume["Name"], force=True)
    return removed


def live_containers() -> int:
    """Containers of this example owned by this process, as the Docker engine lists them."""
    from agentrl.sandbox.docker_client import docker_client

    labels = [f"{EXAMPLE_LABEL}={LABELS[EXAMPLE_LABEL]}", f"agentrl.owner_pid={os.getpid()}"]
    return len(docker_client().api.containers(all=True, filters={"label": labels}))


def hidden_tests(task: dict[str, Any]) -> dict[str, str]:
    if task["family"] == "oneliner":
        return oneliners.hidden_tests(task)
    from examples.coding_agent.env import hidden_tests as humaneval_tests

    return humaneval_tests(task["task_id"])


def solution_module(task: dict[str, Any], code: str) -> str:
    """``solution.py``: the prompt, then ``code`` as the body (dedented, then indented one level)."""
    body = textwrap.indent(textwrap.dedent(code).strip("\n"), "    ")
    return task["prompt"] + body + "\n"


class FunctionEnv(Environment):
    """One function to implement. ``pool`` / ``grader`` override the process-wide pool and grader."""

    max_turns = 5
    tool_timeout_s = 120.0  # includes waiting for a free sandbox while the pool serves other episodes
    exec_timeout_s = 5.0
    grade_timeout_s = 10.0
    pool_size = 16
    grader_pool_size = 4
    sandbox_backend = "docker"  # or "bwrap" (bubblewrap, for machines without Docker: a subclass sets it)

    def __init__(self, pool: Any = None, grader: Any = None) -> None:
        super().__init__()
        self._pool, self._grader = pool, grader
        self._acquiring: Any = None
        self._failure: str | None = None
        self._written = False
        self.grade: Any = None

    def reset(self, task: dict[str, Any]) -> list[dict[str, str]]:
        # Sync and sandbox-free: the warm-up renders prompts with reset() alone.
        self.task = task
        return [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": task["prompt"]}]

    def _shared(self) -> tuple[Any, Any]:
        if self._pool is None or self._grader is None:
            pool, grader = sandboxes(self.pool_size, self.grader_pool_size, self.sandbox_backend)
            self._pool, self._grader = self._pool or pool, self._grader or grader
        return self._pool, self._grader

    async def sandbox(self):
        """This episode's sandbox, from the pool on first use (the hand-out is shielded, so a tool that
        times out waiting still leaves the sandbox to close())."""
        import asyncio

        if self._acquiring is None:
            pool, _ = self._shared()
            self._acquiring = asyncio.ensure_future(pool.aacquire())
        return await asyncio.shield(self._acquiring)

    async def _check(self, sandbox, what: str) -> None:
        """Record a failure when ``sandbox`` is gone (asked only after something looked wrong)."""
        from agentrl.sandbox.blocking import run_blocking

        if self._failure is None and not await run_blocking(lambda: sandbox.alive):
            self._failure = f"the episode's sandbox died during {what}"

    @tool
    async def write(self, code: str) -> str:
        """Save solution.py: the function's signature and docstring, then code as its body.

        Args:
            code: the body, e.g. return x + 1
        """
        sandbox = await self.sandbox()
        try:
            async with METER.timed("write"):
                await sandbox.awrite_files({SOLUTION_FILE: solution_module(self.task, code)})
        except Exception:
            await self._check(sandbox, "write")
            raise
        self._written = True
        return SAVED

    @tool
    async def run_tests(self) -> str:
        """Run the docstring's examples against solution.py."""
        examples = self.task["examples"]
        if not examples:
            return NO_EXAMPLES
        if not self._written:
            return NO_SOLUTION
        sandbox = await self.sandbox()
        async with METER.timed("run_tests"):
            res = await sandbox.arun_python(RUNNER, timeout=self.exec_timeout_s, stdin=runner_input(examples))
        if res.exit_code in (-1, 137) and res.stderr.startswith("sandbox:"):
            await self._check(sandbox, "run_tests")
        if res.ok and res.stdout.strip():
            return res.stdout.strip()
        return f"error: exit code {res.exit_code}{' (timed out)' if res.timed_out else ''}"

    @tool
    def submit(self) -> str:
        """Submit solution.py and end the episode."""
        self.done = True
        return SUBMITTED

    async def reward(self) -> float:
        from agentrl.sandbox import SandboxError

        try:
            if self._failure is None:
                _, grader = self._shared()
                async with METER.timed("grade"):
                    self.grade = await self._grade(grader, hidden_tests(self.task))
            if self.grade is not None and self.grade.exec_result is not None:
                METER.add("grade_run", self.grade.exec_result.duration_s)
        except SandboxError as exc:
            self._failure = f"grading failed: {exc}"
        if self._failure is not None:
            METER.failed()
            raise SandboxFailure(self._failure)
        return self.grade.reward

    async def _grade(self, grader: Any, tests: dict[str, str]) -> Any:
        from agentrl.sandbox.blocking import run_blocking
        from agentrl.sandbox.grader import GradeResult, export_solution

        if self._acquiring is None:  # nothing written: the tests still run, against no solution
            return await grader.agrade({}, tests)
        sandbox = await self.sandbox()
        files = await run_blocking(export_solution, sandbox, [SOLUTION_FILE])
        if isinstance(files, GradeResult):  # a missing file may mean the sandbox died
            await self._check(sandbox, "grading")
            return files
        # The agent's sandbox goes back to the pool before the grade waits for a grading sandbox: the
        # next episode can write and run tests meanwhile.
        await self.close()
        return await grader.agrade(files, tests)

    async def close(self) -> None:
        if self._acquiring is None:
            return
        acquiring, self._acquiring = self._acquiring, None
        try:
            sandbox = await acquiring
        except Exception:
            return
        await self._pool.arelease(sandbox)

    @classmethod
    def close_resources(cls) -> None:
        """Remove the process's sandboxes (the rollout manager calls this on shutdown)."""
        close_sandboxes()

    @classmethod
    def rollout_metrics(cls) -> dict[str, float]:
        """Sandbox metrics since the last call (the rollout manager reports them as ``env/sandbox/*``)."""
        out = METER.report()
        pairs = list(_pools.values())
        if pairs:
            out["sandbox/pool_size"] = float(sum(pool.size for pool, _ in pairs))
            out["sandbox/grader_pool_size"] = float(sum(grader.pool.size for _, grader in pairs))
            if any(key[2] == "docker" for key in _pools):
                with contextlib.suppress(Exception):  # an unreachable engine: the failures already say so
                    out["sandbox/containers"] = float(live_containers())
        return out


def _body(task: dict[str, Any]) -> str:
    if task["family"] == "oneliner":
        return oneliners.solution_body(task)
    from examples.coding_agent.tasks import problems

    return textwrap.dedent(problems()[task["task_id"]]["canonical_solution"]).strip("\n")


def expert_replies(task: dict[str, Any], *, tool_format: ToolCallFormat | None = None,
                   code: str | None = None) -> list[str]:
    """The expert's assistant texts: write the reference body (or ``code``), run the examples, submit."""
    fmt = tool_format or HermesFormat()
    return [fmt.render_calls([ToolCall("write", {"code": _body(task) if code is None else code})]),
            fmt.render_calls([ToolCall("run_tests", {})]),
            fmt.render_calls([ToolCall("submit", {})])]


def expert_messages(task: dict[str, Any], *, tool_format: ToolCallFormat | None = None) -> list[dict[str, Any]]:
    """The scripted correct chat of ``task`` for the supervised warm-up, with the tool results the
    environment gives (the same constants; a test replays it through the environment)."""
    write, run, submit = expert_replies(task, tool_format=tool_format)
    report = all_passed_report(task["examples"]) if task["examples"] else NO_EXAMPLES
    return [*FunctionEnv().reset(task),
            {"role": "assistant", "content": write}, {"role": "tool", "name": "write", "content": SAVED},
            {"role": "assistant", "content": run}, {"role": "tool", "name": "run_tests", "content": report},
            {"role": "assistant", "content": submit}, {"role": "tool", "name": "submit", "content": SUBMITTED}]


def make_tasks(n: int, *, seed: int = 0, split: str = "train", family: str = "oneliner",
               level: int = 1) -> list[dict[str, Any]]:
    """``n`` tasks of ``family`` from ``split``: seeded one-liners (``level`` 1 or 2; the splits ``warmup``,
    ``train`` and ``heldout`` hold disjoint specs) or HumanEval problems (the 32 held out, or the other 132,
    which ``warmup`` and ``train`` share)."""
    if family == "oneliner":
        return oneliners.make_tasks(n, seed=seed, split=split, level=level)
    if family == "humaneval":
        from examples.coding_agent.tasks import make_tasks as humaneval_tasks

        return [{**t, "family": "humaneval"} for t in humaneval_tasks(n, seed=seed, split=split.replace("warmup", "train"))]
    raise ValueError(f"family must be one of {FAMILIES}, got {family!r}")


# The supervised warm-up draws its chats from the "warmup" split (agentrl.run.data.FunctionTasks), GRPO from
# "train": the warm model recalls the specs it was shown (probe: greedy 0.45 on them, 0.16 held out), so
# GRPO on those sharpened recall, not the copying held-out needs.
make_tasks.warmup_split = "warmup"


# ---- the expert that repairs a near miss -------------------------------------------------------------
# A share of the warm-up chats first writes a near miss (a wrong argument name or constant: the errors the
# tiny model makes), reads the run_tests FAIL, writes the reference and submits, so the policy has seen
# feedback used; with max_turns 5 an episode has room for exactly one repair.
REPAIR_PERCENT = 30


def visible_report(task: dict[str, Any], code: str) -> str:
    """What ``run_tests`` answers for ``code``: :data:`RUNNER` itself, run on the host in this process.

    Only for the expert's own bodies (the reference and :func:`near_miss_body`, our templates): model code
    only ever runs in a sandbox. A test checks the texts equal what the sandbox answers."""
    if not task["examples"]:
        return NO_EXAMPLES
    module = types.ModuleType("solution")
    saved_module, saved_stdin, out = sys.modules.get("solution"), sys.stdin, io.StringIO()
    sys.modules["solution"] = module
    try:
        try:
            exec(compile(solution_module(task, code), SOLUTION_FILE, "exec"), module.__dict__)  # noqa: S102
        except BaseException as exc:  # the runner's import failure, reproduced
            return f"solution.py failed to import: {type(exc).__name__}: {exc}"
        sys.stdin = io.StringIO(runner_input(task["examples"]))
        with contextlib.redirect_stdout(out):
            exec(compile(RUNNER, "<runner>", "exec"), {"__name__": "__main__"})  # noqa: S102
    finally:
        sys.stdin = saved_stdin
        if saved_module is None:
            sys.modules.pop("solution", None)
        else:
            sys.modules["solution"] = saved_module
    return out.getvalue().strip()


def near_miss_body(task: dict[str, Any]) -> str | None:
    """A one-liner's reference body with one argument name or one constant wrong (seeded by the task),
    chosen so that the visible example fails; None when there is none (or for HumanEval)."""
    if task["family"] != "oneliner":
        return None
    spec, rng = task["spec"], random.Random(f"near-miss-{task['seed']}")
    body = oneliners.solution_body(task)
    options = []
    for i, k in enumerate(spec["ks"]):
        bounds = oneliners.OPS_BY_NAME[spec["ops"][i]].k
        if k is not None and bounds:
            ks = [v for v in range(bounds[0], bounds[1] + 1) if v != k]
            options.append(("k", i, rng.choice(ks)))
    pool = {"list": oneliners.LIST_NAMES, "str": oneliners.STR_NAMES}.get(
        oneliners.OPS_BY_NAME[spec["ops"][0]].kind, oneliners.INT_NAMES)
    arg = rng.choice(spec["args"])
    options.append(("name", arg, rng.choice([n for n in pool if n not in spec["args"]])))
    kind, where, value = rng.choice(options)
    if kind == "k":
        wrong = oneliners.solution_body({**task, "spec": {**spec, "ks": [value if j == where else k
                                                                         for j, k in enumerate(spec["ks"])]}})
    else:
        wrong = re.sub(rf"\b{re.escape(where)}\b", value, body)
    if wrong == body or visible_report(task, wrong).endswith(f"{len(task['examples'])}/{len(task['examples'])} examples passed"):
        return None
    return wrong


def _repairs(task: dict[str, Any]) -> bool:
    # Held-out chats stay plain: the warm-up's teacher-forced check scores them whole, and the repair's
    # deliberate near miss is never what a greedy policy should write.
    if task["family"] == "oneliner" and oneliners.split_of(task["spec"]) == "heldout":
        return False
    digest = hashlib.sha256(f"repair-{task['task_id']}".encode()).digest()
    return int.from_bytes(digest[:4], "big") % 100 < REPAIR_PERCENT


def expert_messages_with_repairs(task: dict[str, Any], *, tool_format: ToolCallFormat | None = None,
                                 ) -> list[dict[str, Any]]:
    """:func:`expert_messages`, except that for :data:`REPAIR_PERCENT` % of the training tasks (by task id) the
    chat first writes :func:`near_miss_body`, runs the examples (the FAIL text the sandbox gives), then
    writes the reference body, runs them again and submits."""
    wrong = near_miss_body(task) if _repairs(task) else None
    if wrong is None:
        return expert_messages(task, tool_format=tool_format)
    fmt = tool_format or HermesFormat()
    write_wrong = fmt.render_calls([ToolCall("write", {"code": wrong})])
    write, run, submit = expert_replies(task, tool_format=tool_format)
    return [*FunctionEnv().reset(task),
            {"role": "assistant", "content": write_wrong}, {"role": "tool", "name": "write", "content": SAVED},
            {"role": "assistant", "content": run},
            {"role": "tool", "name": "run_tests", "content": visible_report(task, wrong)},
            {"role": "assistant", "content": write}, {"role": "tool", "name": "write", "content": SAVED},
            {"role": "assistant", "content": run},
            {"role": "tool", "name": "run_tests", "content": all_passed_report(task["examples"])},
            {"role": "assistant", "content": submit}, {"role": "tool", "name": "submit", "content": SUBMITTED}]
