"""@tool: JSON schema from type hints and docstrings; argument validation against that schema."""

from __future__ import annotations

import asyncio
from typing import Literal

import pytest

from agentrl.envs import Environment, ToolCall, ToolCallError, tool
from agentrl.envs.docstrings import parse_docstring
from agentrl.envs.tools import ToolArgumentError, build_tool_spec


class Shop(Environment):
    def reset(self, task):
        return [{"role": "user", "content": "buy"}]

    @tool
    def buy(self, item: str, count: int = 1, size: Literal["s", "m"] = "m", tags: list[str] | None = None) -> str:
        """Buy an item.

        Longer explanation that is part of the summary.

        Args:
            item: what to buy.
            count (int): how many,
                at least one.
            size: the size.

        Returns:
            a receipt.
        """
        return f"{count}x{item}/{size}/{tags}"

    @tool(name="lookup")
    async def search(self, query: str) -> dict:
        """Look something up.

        Parameters
        ----------
        query : str
            the query text
        """
        await asyncio.sleep(0)
        return {"hits": [query]}

    @tool
    def explode(self) -> str:
        """Always fails."""
        raise RuntimeError("boom")

    def reward(self):
        return 0.0


def test_schema_from_hints_and_google_docstring():
    fn = Shop.tools["buy"].schema()["function"]
    assert fn["name"] == "buy"
    assert fn["description"] == "Buy an item. Longer explanation that is part of the summary."
    props = fn["parameters"]["properties"]
    assert props["item"] == {"type": "string", "description": "what to buy."}
    assert props["count"]["type"] == "integer" and props["count"]["default"] == 1
    assert props["count"]["description"] == "how many, at least one."
    assert props["size"]["enum"] == ["s", "m"]
    assert "title" not in str(fn["parameters"])  # pydantic noise removed
    assert fn["parameters"]["required"] == ["item"]
    assert fn["parameters"]["type"] == "object"


def test_numpy_docstring_async_tool_and_renamed_tool():
    spec = Shop.tools["lookup"]
    assert spec.is_async
    assert spec.parameters["properties"]["query"]["description"] == "the query text"
    assert [s["function"]["name"] for s in Shop.tool_schemas()] == ["buy", "lookup", "explode"]


def test_docstring_parser_ignores_other_sections():
    doc = parse_docstring("Do it.\n\nArgs:\n    x: the x.\n\nRaises:\n    y: not an argument.\n")
    assert doc.summary == "Do it." and doc.params == {"x": "the x."}
    assert parse_docstring(None).params == {}


@pytest.mark.parametrize(
    "arguments, fragment",
    [
        ({"count": 2}, "missing required argument 'item'"),
        ({"item": 5}, "argument 'item'"),
        ({"item": "x", "count": "2"}, "argument 'count'"),  # strict: a string is not an integer
        ({"item": "x", "count": 1.5}, "argument 'count'"),
        ({"item": "x", "size": "xl"}, "argument 'size'"),
        ({"item": "x", "colour": "red"}, "unexpected argument 'colour'"),
        (["x"], "must be a JSON object"),
    ],
)
def test_wrong_arguments_are_rejected_with_a_readable_message(arguments, fragment):
    with pytest.raises(ToolArgumentError, match=fragment):
        Shop.tools["buy"].validate(arguments)


def test_valid_arguments_keep_function_defaults():
    assert Shop.tools["buy"].validate({"item": "x", "tags": ["a"]}) == {"item": "x", "tags": ["a"]}


def test_call_tool_runs_sync_and_async_tools_and_reports_failures():
    env = Shop()

    async def go():
        assert await env.call_tool(ToolCall("buy", {"item": "pen", "count": 3})) == "3xpen/m/None"
        assert await env.call_tool(ToolCall("lookup", {"query": "q"})) == '{"hits": ["q"]}'
        with pytest.raises(ToolCallError, match="unknown tool 'sell'; available tools: buy, explode, lookup"):
            await env.call_tool(ToolCall("sell", {}))
        with pytest.raises(ToolCallError, match="failed: RuntimeError: boom"):
            await env.call_tool(ToolCall("explode", {}))
        with pytest.raises(ToolCallError, match="argument 'count'"):
            await env.call_tool(ToolCall("buy", {"item": "pen", "count": "many"}))

    asyncio.run(go())


def test_long_tool_output_is_truncated():
    class Long(Shop):
        max_tool_output_chars = 10

        @tool
        def big(self) -> str:
            """Big output."""
            return "x" * 25

    text = asyncio.run(Long().call_tool(ToolCall("big", {})))
    assert text.startswith("x" * 10) and "truncated 15 characters" in text


def test_untyped_or_variadic_parameters_are_refused_at_declaration():
    def untyped(self, x):
        """No hint."""

    def variadic(self, *args: int):
        """Variadic."""

    with pytest.raises(TypeError, match="needs a type hint"):
        build_tool_spec(untyped)
    with pytest.raises(TypeError, match=r"\*args"):
        build_tool_spec(variadic)


def test_subclass_inherits_and_overrides_tools():
    class Base(Environment):
        @tool
        def ping(self) -> str:
            """Base ping."""
            return "base"

    class Child(Base):
        @tool
        def ping(self) -> str:
            """Child ping."""
            return "child"

        @tool
        def extra(self) -> str:
            """Extra."""
            return "e"

    assert set(Child.tools) == {"ping", "extra"} and set(Base.tools) == {"ping"}
    assert asyncio.run(Child().call_tool(ToolCall("ping", {}))) == "child"


def test_slow_async_tool_times_out_with_a_message():
    class Slow(Shop):
        tool_timeout_s = 0.05

        @tool
        async def wait(self) -> str:
            """Waits too long."""
            await asyncio.sleep(5)
            return "late"

    with pytest.raises(ToolCallError, match="timed out after 0.05 s"):
        asyncio.run(Slow().call_tool(ToolCall("wait", {})))


def test_an_undecorated_override_of_a_tool_method_is_what_runs():
    class Cheaper(Shop):
        def buy(self, item: str, count: int = 1, size: str = "m", tags: list[str] | None = None) -> str:
            return "discount " + item

    assert "buy" in Cheaper.tools
    assert asyncio.run(Cheaper().call_tool(ToolCall("buy", {"item": "pen"}))) == "discount pen"
