"""``MCPEnvironment``: an environment whose tools come from an MCP server (the ``mcp`` SDK).

Each episode starts its own server connection in ``reset`` and ends it in ``close`` (lifetime = the
episode; not pooled, so no state leaks between episodes): a stdio server (``mcp_command``, a subprocess)
or a streamable-HTTP server (``mcp_url``). The tools the model sees are the server's ``tools/list`` (name,
description, JSON schema) after the subclass's own ``@tool`` methods; a call to a server tool goes
through ``tools/call``. A tool's error result (``isError``) is a message for the model, like any tool
failure; a server that dies or stops answering is :class:`MCPServerError`, which fails that episode.

Subclass it: set ``mcp_command`` (or ``mcp_url``), write ``prompt(task)`` (the initial messages) and
``reward()``; ``self.mcp_calls`` lists the server tools called this episode. A run's config may name the
server instead (``rollout.mcp``, :class:`MCPServerSettings`): checked at load, before Ray starts, and set
on every environment the run makes.
"""

from __future__ import annotations

import contextlib
import json
import shutil
from pathlib import Path
from typing import Any, ClassVar
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


class MCPEnvironment(Environment):
    """An :class:`Environment` whose tools are an MCP server's (see the module docstring)."""

    mcp_command: ClassVar[list[str] | None] = None  # a stdio server: argv of the process to start
    mcp_url: ClassVar[str | None] = None  # a streamable-HTTP server's endpoint, e.g. http://host:8000/mcp
    mcp_timeout_s: ClassVar[float] = 30.0  # per request (initialize, tools/list, tools/call)

    def prompt(self, task: Any) -> list[dict[str, Any]]:
        """The episode's initial messages (system and/or user)."""
        raise NotImplementedError(f"{type(self).__name__}.prompt(task) must return the initial messages")

    async def reset(self, task: Any) -> list[dict[str, Any]]:
        await self.connect()
        return self.prompt(task)

    async def connect(self) -> None:
        """Start (stdio) or reach (HTTP) the server, initialize the session and read its tools."""
        from mcp import ClientSession

        if (self.mcp_command is None) == (self.mcp_url is None):
            raise ValueError(f"{type(self).__name__} must set exactly one of mcp_command and mcp_url")
        self.mcp_calls: list[str] = []
        self._stack = contextlib.AsyncExitStack()
        try:
            read, write = await self._stack.enter_async_context(self._transport())
            self._session = await self._stack.enter_async_context(
                ClientSession(read, write, read_timeout_seconds=self.mcp_timeout_s))
            await self._session.initialize()
            listed = await self._session.list_tools()
        except Exception as err:
            raise MCPServerError(f"MCP server {self._server_name()} did not start: {type(err).__name__}: "
                                 f"{err}") from err
        self._server_tools = {t.name: t for t in listed.tools if t.name not in self.tools}

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
