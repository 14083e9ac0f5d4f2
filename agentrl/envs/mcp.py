"""``MCPEnvironment``: an environment whose tools come from an MCP server (the ``mcp`` SDK).

Each episode starts its own server connection in ``reset`` and ends it in ``close`` (``mcp_lifetime =
"episode"``, the default: no state leaks between episodes): a stdio server (``mcp_command``, a subprocess)
or a streamable-HTTP server (``mcp_url``). With ``mcp_lifetime = "process"`` the episodes of one process
(and event loop) share one connection to the server instead, opened by the first episode and kept until
the loop ends: for stateless tools, where a server process per episode costs more than the episode (the
``mcp`` SDK alone takes ~1 s of CPU to import in each stdio server process). A shared server that dies fails
the episodes using it and is started afresh by the next episode. The tools the model sees are the server's ``tools/list`` (name,
description, JSON schema) after the subclass's own ``@tool`` methods; a call to a server tool goes
through ``tools/call``. A tool's error result (``isError``) is a message for the model, like any tool
failure; a server that dies or stops answering is :class:`MCPServerError`, which fails that episode.

Subclass it: set ``mcp_command`` (or ``mcp_url``), write ``prompt(task)`` (the initial messages) and
``reward()``; ``self.mcp_calls`` lists the server tools called this episode. A run's config may name the
server instead (``rollout.mcp``, :class:`MCPServerSettings`): checked at load, before Ray starts, and set
on every environment the run makes.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import shutil
from pathlib import Path
from typing import Any, ClassVar, Literal
from urllib.parse import urlsplit

from pydantic import Field, field_validator, model_validator

from agentrl.envs.environment import Environment, ToolCallError
from agentrl.envs.formats import ToolCall
from agentrl.settings import Settings


class MCPServerError(RuntimeError):
    """The episode's MCP server could not be started, died, or did not answer."""


class MCPServerSettings(Settings):
    """``rollout.mcp``: the MCP server of an :class:`MCPEnvironment`, overriding its class's own."""

    command: list[str] | None = Field(None, description="a stdio server: argv of the process each episode starts")
    url: str | None = Field(None, description="a streamable-HTTP server's endpoint, e.g. http://127.0.0.1:8000/mcp")
    timeout_s: float = Field(30.0, gt=0, allow_inf_nan=False, description="per MCP request (initialize, tools/list, tools/call)")
    lifetime: Literal["episode", "process"] = Field(
        "episode", description="episode: a server connection (a stdio process) per episode; process: one shared by "
                               "the episodes of a rollout process, for stateless tools")

    @field_validator("command")
    @classmethod
    def _command_runs(cls, argv: list[str] | None) -> list[str] | None:
        if argv is None:
            return None
        if not argv or not argv[0].strip():
            raise ValueError("mcp.command must name a program")
        if shutil.which(argv[0]) is None:
            raise ValueError(f"mcp.command: {argv[0]!r} is not an executable on PATH or a path to one")
        scripts = [a for a in argv[1:] if a.endswith(".py") and not Path(a).is_file()]
        if scripts:  # `python server.py` with a wrong path would fail only in the first episode
            raise ValueError(f"mcp.command: no such server script {scripts[0]!r}")
        return argv

    @field_validator("url")
    @classmethod
    def _url_is_http(cls, url: str | None) -> str | None:
        if url is not None:
            parts = urlsplit(url)
            if parts.scheme not in ("http", "https") or not parts.hostname:
                raise ValueError(f"mcp.url must be an http(s)://host[:port]/path URL, got {url!r}")
        return url

    @model_validator(mode="after")
    def _one_server(self) -> MCPServerSettings:
        if (self.command is None) == (self.url is None):
            raise ValueError("mcp: set exactly one of command (a stdio server) and url (streamable HTTP)")
        return self

    def apply(self, env: Environment) -> None:
        """Point ``env`` (an :class:`MCPEnvironment`) at this server."""
        if not isinstance(env, MCPEnvironment):
            raise TypeError(f"rollout.mcp needs an MCPEnvironment; {type(env).__name__} is not one")
        env.mcp_command, env.mcp_url, env.mcp_timeout_s = self.command, self.url, self.timeout_s
        env.mcp_lifetime = self.lifetime


class MCPEnvironment(Environment):
    """An :class:`Environment` whose tools are an MCP server's (see the module docstring)."""

    mcp_command: ClassVar[list[str] | None] = None  # a stdio server: argv of the process to start
    mcp_url: ClassVar[str | None] = None  # a streamable-HTTP server's endpoint, e.g. http://host:8000/mcp
    mcp_timeout_s: ClassVar[float] = 30.0  # per request (initialize, tools/list, tools/call)
    mcp_lifetime: ClassVar[str] = "episode"  # or "process": one connection shared by the process's episodes

    def prompt(self, task: Any) -> list[dict[str, Any]]:
        """The episode's initial messages (system and/or user)."""
        raise NotImplementedError(f"{type(self).__name__}.prompt(task) must return the initial messages")

    async def reset(self, task: Any) -> list[dict[str, Any]]:
        await self.connect()
        return self.prompt(task)

    async def connect(self) -> None:
        """Start (stdio) or reach (HTTP) the server, initialize the session and read its tools (or join the
        process's shared connection, with ``mcp_lifetime = "process"``)."""
        if (self.mcp_command is None) == (self.mcp_url is None):
            raise ValueError(f"{type(self).__name__} must set exactly one of mcp_command and mcp_url")
        if self.mcp_lifetime not in ("episode", "process"):
            raise ValueError(f"mcp_lifetime must be 'episode' or 'process', got {self.mcp_lifetime!r}")
        self.mcp_calls: list[str] = []
        self._shared: SharedServer | None = None
        try:
            if self.mcp_lifetime == "process":
                self._shared = await SharedServer.of(self._server_key(), self._transport, self.mcp_timeout_s)
                self._session, tools = self._shared.session, self._shared.tools
            else:
                self._stack = contextlib.AsyncExitStack()
                self._session, tools = await open_session(self._stack, self._transport(), self.mcp_timeout_s)
        except Exception as err:
            raise MCPServerError(f"MCP server {self._server_name()} did not start: {type(err).__name__}: "
                                 f"{err}") from err
        self._server_tools = {t.name: t for t in tools if t.name not in self.tools}

    def _server_key(self) -> tuple[Any, ...]:
        return (tuple(self.mcp_command or ()), self.mcp_url, self.mcp_timeout_s)

    def _transport(self) -> contextlib.AbstractAsyncContextManager[Any]:
        if self.mcp_command is not None:
            from mcp import StdioServerParameters
            from mcp.client.stdio import stdio_client

            command, *args = self.mcp_command
            return stdio_client(StdioServerParameters(command=command, args=args))
        from mcp.client.streamable_http import streamable_http_client

        return streamable_http_client(self.mcp_url)

    def _server_name(self) -> str:
        return " ".join(self.mcp_command) if self.mcp_command is not None else str(self.mcp_url)

    def tool_schemas(self) -> list[dict[str, Any]]:  # type: ignore[override]  # per episode, not per class
        """The subclass's ``@tool`` methods, then the server's tools (from ``tools/list``)."""
        served = [{"type": "function", "function": {"name": t.name, "description": t.description or "",
                                                    "parameters": t.input_schema}}
                  for t in getattr(self, "_server_tools", {}).values()]
        return [*super().tool_schemas(), *served]

    async def call_tool(self, call: ToolCall) -> str:
        """A local ``@tool`` as usual; a server tool through ``tools/call`` (its error result is a
        :class:`ToolCallError`; a dead or silent server is :class:`MCPServerError`)."""
        if call.name in self.tools or call.name not in getattr(self, "_server_tools", {}):
            return await super().call_tool(call)
        self.mcp_calls.append(call.name)
        try:
            result = await self._session.call_tool(call.name, dict(call.arguments),
                                                   read_timeout_seconds=self.mcp_timeout_s)
        except Exception as err:  # the transport broke or timed out: the episode cannot go on
            if self._shared is not None:
                self._shared.broken = True  # the next episode starts the server afresh
            raise MCPServerError(f"MCP server {self._server_name()} failed on tools/call {call.name!r}: "
                                 f"{type(err).__name__}: {err}") from err
        text = "".join(getattr(block, "text", "") for block in getattr(result, "content", None) or [])
        if not text and getattr(result, "structured_content", None) is not None:
            text = json.dumps(result.structured_content, ensure_ascii=False)
        if getattr(result, "is_error", False):
            raise ToolCallError(f"tool {call.name!r} failed: {text}")
        return self._as_text(text)

    async def close(self) -> None:
        """End the server connection (a stdio server's process exits with it)."""
        stack = getattr(self, "_stack", None)
        self._stack = None
        if stack is not None:
            with contextlib.suppress(Exception):  # a server that already died has nothing left to close
                await stack.aclose()


async def open_session(stack: contextlib.AsyncExitStack, transport: Any, timeout_s: float) -> tuple[Any, list[Any]]:
    """An initialized ``ClientSession`` over ``transport`` (entered on ``stack``) and the server's tools."""
    from mcp import ClientSession

    read, write = await stack.enter_async_context(transport)
    session = await stack.enter_async_context(ClientSession(read, write, read_timeout_seconds=timeout_s))
    await session.initialize()
    listed = await session.list_tools()
    return session, list(listed.tools)


class SharedServer:
    """One MCP connection shared by the episodes of an event loop (``mcp_lifetime = "process"``).

    A task of its own holds the connection open (the SDK's sessions must be entered and left in one task),
    until the loop ends (``asyncio.run`` cancels it, which ends a stdio server's process) or the server
    breaks; requests from the episodes' tasks go through the session concurrently (JSON-RPC ids)."""

    _open: ClassVar[dict[tuple[Any, ...], SharedServer]] = {}

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.ready: asyncio.Future[None] = loop.create_future()
        self.broken = False
        self.session: Any = None
        self.tools: list[Any] = []
        self.task: asyncio.Task[None] | None = None

    @classmethod
    async def of(cls, key: tuple[Any, ...], transport: Any, timeout_s: float) -> SharedServer:
        """The loop's live connection for ``key``, started on first use (or after it broke)."""
        loop = asyncio.get_running_loop()
        full_key = (id(loop), *key)
        shared = cls._open.get(full_key)
        if shared is None or shared.broken or shared.loop is not loop or (shared.task and shared.task.done()):
            if shared is not None and shared.loop is loop and shared.task is not None:
                shared.task.cancel()  # a broken connection's holder lets go of it (and its process)
            for stale in [k for k, v in cls._open.items() if v.loop.is_closed()]:
                del cls._open[stale]
            shared = cls._open[full_key] = cls(loop)
            shared.task = loop.create_task(shared._hold(transport(), timeout_s))
        await asyncio.shield(shared.ready)
        return shared

    async def _hold(self, transport: Any, timeout_s: float) -> None:
        try:
            async with contextlib.AsyncExitStack() as stack:
                self.session, self.tools = await open_session(stack, transport, timeout_s)
                self.ready.set_result(None)
                await asyncio.Event().wait()  # until cancelled, or the session's own tasks fail
        except BaseException as err:
            self.broken = True
            if not self.ready.done():
                self.ready.set_exception(err if isinstance(err, Exception) else RuntimeError(repr(err)))
            if not isinstance(err, Exception):
                raise
