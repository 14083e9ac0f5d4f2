"""A stdio MCP server with the arithmetic task's ``add`` tool: ``python examples/mcp_arithmetic/server.py``.

With ``--with-crash`` it also serves ``crash``, which exits the process mid-call, so tests can show a dead
server failing its episode."""

from __future__ import annotations

import os
import sys

from mcp.server.mcpserver import MCPServer

server = MCPServer("arithmetic")


@server.tool()
def add(a: int, b: int) -> int:
    """Add two numbers."""
    return a + b


def crash() -> str:
    """Exit the server process (for failure tests)."""
    os._exit(3)


if __name__ == "__main__":
    if "--with-crash" in sys.argv[1:]:
        server.tool()(crash)
    server.run("stdio")
