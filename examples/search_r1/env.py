"""``SearchR1Env``: answer a question by searching the country corpus, then reply ``<answer>...</answer>``."""

from __future__ import annotations

from functools import cache
from typing import Any

from agentrl.envs import Environment, tool
from examples.search_r1.reward import score
from examples.search_r1.search import SearchIndex

SYSTEM_PROMPT = (
    "Answer the question. Use the search tool to look facts up, as often as you need. "
    "When you know the answer, reply with <answer>the answer</answer> and nothing else."
)


@cache
def default_index() -> SearchIndex:
    """The index over the whole corpus, built once per process."""
    return SearchIndex()


class SearchR1Env(Environment):
    """Multi-turn QA: tool ``search(query)``; the episode ends with a reply that calls no tool."""

    max_turns = 8
    top_k = 3
    metric = "em"
    format_weight = 0.2

    def __init__(self, index: SearchIndex | None = None) -> None:
        super().__init__()
        self.index = index or default_index()
        self.final_reply = ""
        self.searches: list[str] = []

    def reset(self, task: dict[str, Any]) -> list[dict[str, str]]:
        return [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": task["question"]}]

    @tool
    def search(self, query: str) -> str:
        """Search the encyclopedia.

        Args:
            query: words to look for.
        """
        self.searches.append(query)
        hits = self.index.search(query, k=self.top_k)
        if not hits:
            return "No results."
        return "\n".join(f"[{i + 1}] {doc.text}" for i, doc in enumerate(hits))

    def on_text_response(self, text: str) -> None:
        self.final_reply = text
        self.done = True
        return None

    def reward(self) -> float:
        return score(self.final_reply, self.task["answers"], metric=self.metric, format_weight=self.format_weight)


def expert_replies(task: dict[str, Any]) -> list[str]:
    """The replies of a policy that runs the question's expert searches, then answers."""
    from agentrl.envs.formats import HermesFormat, ToolCall

    fmt = HermesFormat()
    calls = [fmt.render_calls([ToolCall("search", {"query": q})]) for q in task["queries"]]
    return calls + [f"<answer>{task['answers'][0]}</answer>"]
