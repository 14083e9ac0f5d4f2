#!/usr/bin/env python3
"""The arithmetic task played by a LangGraph graph over ``langchain-openai``'s ``ChatOpenAI`` (chat
completions): a model node and LangGraph's ``ToolNode``, looping until the model submits or stops calling
tools. The agent never imports agentrl; its base URL and key are the run's ``OPENAI_BASE_URL`` /
``OPENAI_API_KEY``.

Needs ``pip install langgraph langchain-openai``.

    printf '{"prompt": "What is 12+30?"}\\n' | OPENAI_BASE_URL=http://127.0.0.1:8000/v1 python langgraph_agent.py
"""

from __future__ import annotations

import os
from typing import Any

from _episodes import MAX_TURNS, SYSTEM_PROMPT, serve
from _episodes import add as add_numbers
from langchain_core.messages import AIMessage, HumanMessage, SystemMessage, ToolMessage
from langchain_core.tools import tool
from langchain_openai import ChatOpenAI
from langgraph.graph import END, START, MessagesState, StateGraph
from langgraph.prebuilt import ToolNode


@tool
def submit(answer: int) -> str:
    """Submit the final answer."""
    return "ok"


@tool
def add(a: int, b: int) -> int:
    """Add two numbers."""
    return add_numbers(a, b)


def build_graph(model: Any) -> Any:
    """START -> model -> (tool calls? tools : END); tools -> (submitted? END : model)."""
    llm = model.bind_tools([submit, add])

    def call_model(state: MessagesState) -> dict[str, Any]:
        return {"messages": [llm.invoke(state["messages"])]}

    def after_model(state: MessagesState) -> str:
        last = state["messages"][-1]
        return "tools" if isinstance(last, AIMessage) and last.tool_calls else END

    def after_tools(state: MessagesState) -> str:
        replies = sum(isinstance(m, AIMessage) for m in state["messages"])
        submitted = any(isinstance(m, ToolMessage) and m.name == "submit" for m in state["messages"])
        return END if submitted or replies >= MAX_TURNS else "model"

    graph = StateGraph(MessagesState)
    graph.add_node("model", call_model)
    graph.add_node("tools", ToolNode([submit, add], handle_tool_errors=True))
    graph.add_edge(START, "model")
    graph.add_conditional_edges("model", after_model, ["tools", END])
    graph.add_conditional_edges("tools", after_tools, ["model", END])
    return graph.compile()


def outcome(messages: list[Any]) -> dict[str, Any]:
    """The submitted answer, and whether an ``add`` call ran without error before it."""
    answer, used_add = None, False
    for message in messages:
        if isinstance(message, ToolMessage) and message.name == "add" and message.status != "error":
            used_add = True
        for call in getattr(message, "tool_calls", None) or []:
            if call["name"] == "submit" and answer is None:
                answer = call["args"].get("answer")
    return {"answer": answer, "used_add": used_add}


def play(graph: Any, task: dict[str, Any]) -> dict[str, Any]:
    state = graph.invoke({"messages": [SystemMessage(SYSTEM_PROMPT), HumanMessage(task["prompt"])]},
                         {"recursion_limit": 2 * MAX_TURNS + 2})
    return outcome(state["messages"])


if __name__ == "__main__":
    model = ChatOpenAI(model=os.environ.get("OPENAI_MODEL", "agentrl"), base_url=os.environ["OPENAI_BASE_URL"],
                       api_key=os.environ.get("OPENAI_API_KEY", "unused"), timeout=120, max_retries=0)
    graph = build_graph(model)
    raise SystemExit(serve(lambda task: play(graph, task)))
