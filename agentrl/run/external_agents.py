"""External agents train through the gateway: the ``external_agent`` section of a run's config.

Any program that speaks OpenAI chat completions can be the agent of an RL run. The rollout actor serves
the gateway (:mod:`agentrl.rollout.gateway`, training mode) in front of the run's engines and runs
``copies`` processes of ``command``; each episode goes to a free copy (a task line on its stdin, one line
on its stdout when done), and the turns it asks for are recorded into the step's trajectory manager and
proved and trained like the in-process loop's. What an agent sees, the reward (``reward_from``), the
sampling it gets and how failures are counted: docs/gateway.md, "Training external agents".
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import secrets
import shlex
import shutil
import signal
import socket
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from pydantic import Field, field_validator

from agentrl.settings import Settings

log = logging.getLogger(__name__)

EPISODE_FUNCTION = "agentrl.run.external_agents:ACTIVE.episode"
_LINE_LIMIT = 1 << 20  # bytes of one stdout line an agent may write


class ExternalAgentSettings(Settings):
    """External agent processes that play the run's episodes through the gateway."""

    command: str = Field(description="the agent's command line (shell words, no shell), e.g. "
                                     "'python examples/openai_agent/agent.py'")
    copies: int = Field(4, ge=1, description="agent processes in parallel (one episode each at a time)")
    session_id_from: Literal["base_url", "user", "header"] = Field(
        "base_url", description="how a request names its episode: base_url (a base URL per agent, for agents "
                                "that can set nothing), user (the request's user field) or header (X-Session-Id)")
    reward_from: Literal["env", "finish_call"] = Field(
        "env", description="env (the environment replays the model's tool calls and scores them) or "
                           "finish_call (the reward of the agent's finish call)")
    episode_timeout_s: float = Field(120.0, gt=0, description="seconds an episode may take; the agent is "
                                                              "then killed and restarted")
    max_consecutive_failures: int = Field(8, ge=1, description="agent crashes/timeouts in a row (no episode "
                                                                "finishing between) that fail the step")
    env: dict[str, str] = Field(default_factory=dict, description="extra environment variables of the agents")
    cwd: str | None = Field(None, description="working directory of the agents (default: where the run started)")

    @field_validator("command")
    @classmethod
    def _command_runs(cls, command: str) -> str:
        try:
            argv = shlex.split(command)
        except ValueError as err:
            raise ValueError(f"command {command!r} is not valid shell words: {err}") from None
        if not argv:
            raise ValueError("command is empty")
        if shutil.which(argv[0]) is None and not Path(argv[0]).is_file():
            raise ValueError(f"command {command!r}: {argv[0]!r} is neither on PATH nor a file")
        return command


class AgentCrashed(RuntimeError):
    """The agent process exited with a non-zero status (or was killed) during an episode."""


class AgentTimeout(RuntimeError):
    """The episode ran past ``episode_timeout_s``; the agent was killed."""


class NoFinishCall(RuntimeError):
    """``reward_from: finish_call``, but the agent ended the episode without a finish call."""


class EpisodeDropped(RuntimeError):
    """The agent dropped its session (``DELETE /sessions/<id>``)."""


class AgentsFailing(RuntimeError):
    """The agents keep crashing or timing out: the step fails instead of training on nothing."""


@dataclass
class AgentCopy:
    """One agent process (started again after it exits), its stdout lines and its log."""

    slot: str
    argv: list[str]
    env: dict[str, str]
    cwd: str
    log_path: Path
    proc: asyncio.subprocess.Process | None = None
    lines: asyncio.Queue[str | None] = field(default_factory=asyncio.Queue)
    _reader: asyncio.Task[None] | None = None

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.returncode is None

    async def start(self) -> None:
        from agentrl.engine.process import _die_with

        self.kill()  # what an earlier process of this copy left behind (children of an agent that exited)
        if self._reader is not None:
            self._reader.cancel()
        self.lines = asyncio.Queue()
        with open(self.log_path, "ab") as log_file:  # the child keeps its own descriptor
            self.proc = await asyncio.create_subprocess_exec(
                *self.argv, stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE, stderr=log_file,
                env=self.env, cwd=self.cwd, limit=_LINE_LIMIT, start_new_session=True,
                preexec_fn=_die_with(os.getpid()))  # killed by the kernel if this process dies
        self._reader = asyncio.create_task(self._read(self.proc, self.lines))

    async def _read(self, proc: asyncio.subprocess.Process, lines: asyncio.Queue[str | None]) -> None:
        assert proc.stdout is not None
        try:
            while line := await proc.stdout.readline():
                await lines.put(line.decode(errors="replace").rstrip("\n"))
        except (ValueError, asyncio.LimitOverrunError):  # a line over the limit: the protocol is broken
            self.kill()
        finally:
            await lines.put(None)

    async def next_line(self, timeout_s: float) -> str | int | None:
        """The next stdout line, or the exit status if the process exits first (a child that inherited
        stdout may keep the pipe open after it); None on timeout."""
        assert self.proc is not None
        line = asyncio.ensure_future(self.lines.get())
        exited = asyncio.ensure_future(_exit_status(self.proc))
        try:
            await asyncio.wait({line, exited}, timeout=timeout_s, return_when=asyncio.FIRST_COMPLETED)
            if line.done() and line.result() is not None:
                return line.result()
            if exited.done():
                return exited.result()
            if line.done():  # stdout closed: the process is exiting
                return await asyncio.wait_for(exited, 10)
            return None
        finally:
            for task in (line, exited):
                task.cancel()

    async def send(self, line: str) -> None:
        assert self.proc is not None and self.proc.stdin is not None
        while not self.lines.empty():  # a line left from an earlier episode must not end this one
            if self.lines.get_nowait() is None:
                raise AgentCrashed(f"agent {self.slot} closed its stdout")
        try:
            self.proc.stdin.write(line.encode() + b"\n")
            await self.proc.stdin.drain()
        except (BrokenPipeError, ConnectionResetError) as err:
            raise AgentCrashed(f"agent {self.slot} does not read its stdin: {err}") from None

    def kill(self) -> None:
        """SIGKILL the copy's whole process group (its own session: children it forked too)."""
        if self.proc is not None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.proc.pid, signal.SIGKILL)

    async def reap(self, timeout_s: float = 5.0) -> None:
        if self.proc is not None:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(_exit_status(self.proc), timeout_s)

    async def stop(self, grace_s: float = 2.0) -> None:
        if self.proc is None:
            return
        proc = self.proc
        if proc.returncode is None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, signal.SIGTERM)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(_exit_status(proc), grace_s)
        self.kill()  # whatever is left of its group, also after the leader exited
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(proc.wait(), grace_s)  # pipes closed too: the transport is done
        if self._reader is not None:
            self._reader.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._reader
        self._reader = None

    def log_tail(self, n: int = 8) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""


class ExternalAgents:
    """The gateway (training mode) and the agent copies of one rollout actor; :meth:`episode` is its
    ``episode_function``. Everything runs on the event loop of the first :meth:`episode` call."""

    def __init__(self, settings: ExternalAgentSettings, model_dir: str | Path, *, log_dir: str | Path | None = None,
                 cwd: str | None = None) -> None:
        self.settings = settings
        self.model_dir = str(model_dir)
        self.log_dir = Path(log_dir) if log_dir is not None else None
        self.cwd = settings.cwd or cwd or os.getcwd()
        self.api_key = secrets.token_urlsafe(24)
        self.counts: Counter[str] = Counter()
        self.gateway: Any = None
        self.url: str | None = None
        self.copies: list[AgentCopy] = []
        self._idle: asyncio.Queue[AgentCopy] | None = None
        self._server: Any = None
        self._server_task: asyncio.Task[Any] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._failures_in_row = 0
        self._formats: dict[Any, Any] = {}
        self.failing: str | None = None
        self._reported: Counter[str] = Counter()
        self._starting: asyncio.Future[None] | None = None

    # ---- lifetime ----------------------------------------------------------------------------------
    async def start(self, chat_template_kwargs: dict[str, Any] | None = None) -> None:
        """Serve the gateway on a free 127.0.0.1 port of this loop (rendering with the run's
        ``chat_template_kwargs``); the copies start on first use."""
        loop = asyncio.get_running_loop()
        if self._loop is not None:
            if loop is not self._loop:
                raise RuntimeError("ExternalAgents runs on the event loop it started on")
            return
        import uvicorn
        from transformers import AutoTokenizer

        from agentrl.engine.protocol import context_length_of
        from agentrl.rollout.gateway import Gateway, create_app

        s = self.settings
        self._loop = loop
        tokenizer = AutoTokenizer.from_pretrained(self.model_dir)
        self.gateway = Gateway(tokenizer, _no_generate, context_length=context_length_of(self.model_dir),
                               model_name=Path(self.model_dir).resolve().name,
                               chat_template_kwargs=chat_template_kwargs, episodes_only=True, api_key=self.api_key)
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.bind(("127.0.0.1", 0))  # bound here: no race for the port, and no sys.exit inside uvicorn
        self.url = f"http://127.0.0.1:{sock.getsockname()[1]}"
        self._server = uvicorn.Server(uvicorn.Config(create_app(self.gateway), log_level="warning", log_config=None,
                                                     lifespan="off", timeout_graceful_shutdown=2))
        self._server_task = asyncio.create_task(self._server.serve(sockets=[sock]))
        deadline = time.monotonic() + 30
        while not self._server.started:
            if self._server_task.done() or time.monotonic() > deadline:
                raise RuntimeError(f"the gateway did not start: {self._server_task.exception() if self._server_task.done() else 'timeout'}")
            await asyncio.sleep(0.01)
        argv = shlex.split(s.command)
        self.copies = [AgentCopy(str(i), argv, self._agent_env(str(i)), self.cwd, self._log_path(i))
                       for i in range(s.copies)]
        self._idle = asyncio.Queue()
        for copy in self.copies:
            self._idle.put_nowait(copy)
        log.info("external agents: gateway %s, %d copies of %r", self.url, s.copies, s.command)

    def _log_path(self, index: int) -> Path:
        from agentrl.engine.process import log_file

        return log_file(self.log_dir, f"agent-{index}.log")

    def _agent_env(self, slot: str) -> dict[str, str]:
        from agentrl.engine.auth import SECRET_ENV

        env = {k: v for k, v in os.environ.items() if k != SECRET_ENV}  # agents never control the engines
        env.update(self.settings.env)
        base = f"{self.url}/agents/{slot}/v1" if self.settings.session_id_from == "base_url" else f"{self.url}/v1"
        no_proxy = ",".join(p for p in (env.get("NO_PROXY"), "127.0.0.1", "localhost") if p)
        env.update(OPENAI_BASE_URL=base, OPENAI_API_KEY=self.api_key, AGENTRL_AGENT_SLOT=slot,
                   AGENTRL_FINISH_URL=f"{self.url}/agents/{slot}/finish", NO_PROXY=no_proxy, no_proxy=no_proxy,
                   PYTHONUNBUFFERED="1")
        return env

    async def stop(self) -> None:
        """Stop every agent process (its whole process group) and the gateway."""
        await asyncio.gather(*(copy.stop() for copy in self.copies))
        if self._server is not None:
            self._server.should_exit = True
            if self._server_task is not None:
                with contextlib.suppress(Exception):
                    await asyncio.wait_for(self._server_task, 10)
        self._server = self._server_task = None

    # ---- the episode function --------------------------------------------------------------------
    def raise_if_failing(self) -> None:
        """Fail the step when the agents keep failing (an episode's failure alone is one error episode)."""
        if self.failing:
            raise AgentsFailing(self.failing)

    def metrics(self) -> dict[str, float]:
        """``rollout/agents/<count>``: the agent counts since the last call."""
        before, self._reported = self._reported, Counter(self.counts)
        return {f"rollout/agents/{k}": float(self.counts[k] - before[k]) for k in sorted(self.counts)}

    async def episode(self, env: Any, task: Any, generate: Any, renderer: Any, *, session_id: str,
                      group_id: str | None = None, sampling_params: dict[str, Any] | None = None,
                      trajectory_manager: Any = None, **_: Any) -> Any:
        """One episode of ``env`` on ``task`` played by a free agent copy: the run's per-episode function
        (same signature as :func:`~agentrl.envs.loop.run_episode`); the gateway starts on the first one."""
        from agentrl.envs.environment import maybe_await
        from agentrl.envs.loop import EpisodeMetrics, EpisodeResult
        from agentrl.envs.rewards import combine_reward
        from agentrl.rollout.gateway import Episode
        from agentrl.trajectory import StopReason

        self.raise_if_failing()
        if self._starting is None:
            self._starting = asyncio.ensure_future(self.start(getattr(renderer, "chat_template_kwargs", None)))
        await asyncio.shield(self._starting)
        assert self._idle is not None and trajectory_manager is not None
        started = time.perf_counter()
        metrics = EpisodeMetrics()
        env.task = task
        messages = list(await maybe_await(env.reset(task)))
        env.messages = messages
        prompt = next((m.get("content") for m in reversed(messages) if m.get("role") == "user"), None)
        line = json.dumps({"session_id": session_id, "prompt": prompt, "messages": messages,
                           "tools": env.tool_schemas(), "task": task}, default=str)
        sampling = dict(sampling_params or {})
        episode = Episode(session_id, trajectory_manager, generate, sampling=sampling, max_turns=env.max_turns,
                          tool_format=self._tool_format(env.tool_format))
        copy = await self._idle.get()
        try:
            self.gateway.open_episode(episode, slot=copy.slot)
            await self._play(copy, line)
        finally:
            self.gateway.close_episode(session_id)
            self._idle.put_nowait(copy)
            with contextlib.suppress(Exception):
                await maybe_await(env.close())
        if episode.dropped:
            raise EpisodeDropped(f"the agent dropped episode {session_id!r}")
        metrics.turns, metrics.prompt_tokens = episode.turns, episode.prompt_tokens
        metrics.generated_tokens = episode.generated_tokens
        metrics.finish_reasons, metrics.drift = dict(episode.finish_reasons), dict(episode.outcomes)
        metrics.ill_formed_turns = episode.malformed_turns
        if self.settings.reward_from == "finish_call":
            if episode.finish is None:
                raise NoFinishCall(f"episode {session_id!r} ended without a finish call (reward_from: finish_call)")
            raw = episode.finish.reward
            ended_by_env = False
        else:
            ended_by_env = await _replay(env, episode, metrics)
            raw = await maybe_await(env.reward())
        metrics.reward, metrics.reward_components = combine_reward(raw, env.reward_weights)
        if episode.hit_turn_limit:
            metrics.stop_reason = StopReason.MAX_TURNS
        elif ended_by_env:
            metrics.stop_reason = StopReason.DONE if (episode.replies[-1:] and episode.replies[-1].get("tool_calls")) \
                else StopReason.NO_TOOL_CALL
        elif sum(episode.finish_reasons.values()) and list(episode.finish_reasons)[-1:] == ["length"]:
            metrics.stop_reason = StopReason.LENGTH
        else:
            metrics.stop_reason = StopReason.DONE  # the agent ended it
        samples = []
        if trajectory_manager.has_session(session_id):
            samples = trajectory_manager.get_trajectory(
                session_id, reward=metrics.reward, group_id=group_id or session_id, stop_reason=metrics.stop_reason,
                extra_metadata={"episode_turns": metrics.turns, "tool_calls": metrics.tool_calls,
                                "ill_formed_turns": metrics.ill_formed_turns, "agent_slot": copy.slot,
                                "reward_components": metrics.reward_components})
        metrics.samples = len(samples)
        metrics.seconds = time.perf_counter() - started
        return EpisodeResult(session_id=session_id, group_id=group_id or session_id, task=task, samples=samples,
                             metrics=metrics, messages=episode.transcript or messages)

    def _tool_format(self, setting: Any) -> Any:
        """The environment's tool-call format (``rollout.tool_format`` reaches it through the env)."""
        from agentrl.envs.environment import choose_tool_format

        key = setting if isinstance(setting, str) or setting is None else id(setting)
        if key not in self._formats:
            self._formats[key] = choose_tool_format(setting, self.gateway.tokenizer)
        return self._formats[key]

    async def _play(self, copy: AgentCopy, line: str) -> None:
        """Hand ``line`` to ``copy`` and wait for the episode's end: a stdout line or a clean exit. A crash
        or the timeout raises (the copy is killed; the next episode starts it again)."""
        if not copy.running:
            if copy.proc is not None:
                self.counts["restarts"] += 1
            self.counts["starts"] += 1
            await copy.start()
        try:
            await copy.send(line)
            got = await copy.next_line(self.settings.episode_timeout_s)
            if got is None:
                raise TimeoutError
            if isinstance(got, int):  # it exited: with 0 that ends the episode (one task per process)
                if got != 0:
                    raise AgentCrashed(f"agent {copy.slot} exited with status {got}")
                copy.kill()  # children it left behind
                self.counts["exits"] += 1
        except (TimeoutError, AgentCrashed) as err:
            copy.kill()
            await copy.reap()  # so the next episode sees it dead and starts it again
            if isinstance(err, TimeoutError):
                self.counts["timeouts"] += 1
                err = AgentTimeout(f"agent {copy.slot}: the episode ran past {self.settings.episode_timeout_s} s")
            else:
                self.counts["crashes"] += 1
            self._failures_in_row += 1
            if self._failures_in_row >= self.settings.max_consecutive_failures:
                self.failing = (f"{self._failures_in_row} agent failures in a row (last: {err}); the end of "
                                f"{copy.log_path}:\n{copy.log_tail()}")
            raise err from None
        self._failures_in_row = 0
        self.counts["episodes"] += 1


async def _exit_status(proc: asyncio.subprocess.Process) -> int:
    """``proc``'s exit status as soon as it exits: ``Process.wait()`` also waits for its pipes to close,
    which a child that inherited them can delay for ever."""
    while proc.returncode is None:
        await asyncio.sleep(0.05)
    return proc.returncode


async def _replay(env: Any, episode: Any, metrics: Any) -> bool:
    """Run the tool calls of the replies the model gave (in order, as the gateway returned them) through
    ``env``'s tools, so ``reward()`` judges what the model did; True when the environment ended the episode.
    A reply with a malformed call counts as ill-formed and runs nothing, as a plain-text reply goes to
    ``on_text_response``."""
    from agentrl.envs.environment import ToolCallError, maybe_await
    from agentrl.envs.formats import ToolCall

    for reply, malformed in zip(episode.replies, episode.malformed, strict=True):
        if env.done:
            break
        if malformed:
            continue
        calls = reply.get("tool_calls") or []
        if not calls:
            await maybe_await(env.on_text_response(reply.get("content") or ""))
            continue
        for call in calls:
            if env.done:  # a call after the one that ended the episode is not run
                break
            metrics.tool_calls += 1
            fn = call["function"]
            try:
                arguments = json.loads(fn["arguments"]) if isinstance(fn["arguments"], str) else fn["arguments"]
                await env.call_tool(ToolCall(fn["name"], arguments))
            except (ToolCallError, json.JSONDecodeError, TypeError):
                metrics.tool_errors += 1
    return bool(env.done)


async def _no_generate(*_: Any, **__: Any) -> Any:
    raise RuntimeError("the training gateway generates only for open episodes")


@dataclass
class _ActivePool:
    """The pool of this process (one rollout actor has one), behind the ``episode_function`` path
    :data:`EPISODE_FUNCTION`: a config names functions by path, the pool is state."""

    pool: ExternalAgents | None = None

    async def episode(self, *args: Any, **kwargs: Any) -> Any:
        if self.pool is None:
            raise RuntimeError(f"{EPISODE_FUNCTION} plays episodes with the external agents of the run; set "
                               "external_agent in the run config instead of naming it as episode_function")
        return await self.pool.episode(*args, **kwargs)


ACTIVE = _ActivePool()
