"""``SearchR1Env``: answer a question by searching the country corpus, then reply ``<answer>...</answer>``."""

from __future__ import annotations

from functools import cache
from typing import Any

from agentrl.envs import Environment, tool
from examples.search_r1.reward import score
from examples.search_r1.search import SearchIndex
from examples.search_r1.synthetic import task_index

# Short: the tiny model has 512 positions for the prompt, two searches and the answer.
SYSTEM_PROMPT = "Search, then reply <answer>the answer</answer>."


@cache
def default_index() -> SearchIndex:
    """The index over the whole corpus, built once per process."""
    return SearchIndex()


class SearchR1Env(Environment):
    """Multi-turn QA: tool ``search(query)``; the episode ends with a reply that calls no tool.

    The reward is exact match of the ``<answer>`` (``format_weight`` > 0 adds a part for a well-formed
    answer tag), so a run's ``eval_accuracy`` is held-out exact match."""

    max_turns = 4  # two hops, the answer, one spare search
    top_k = 2
    snippet_chars = 56  # per hit: a long list of neighbours is clipped (the country it belongs to comes first)
    metric = "em"
    format_weight = 0.0

    def __init__(self, index: SearchIndex | None = None) -> None:
        super().__init__()
        self.index = index or default_index()
        self.final_reply = ""
        self.searches: list[str] = []
        self.task_index: SearchIndex | None = None
        self.found: set[tuple[str, str]] = set()  # (country, field) of every top-1 hit of this episode

    def reset(self, task: dict[str, Any]) -> list[dict[str, str]]:
        # A made-up task (examples.search_r1.synthetic) carries its own documents: search those.
        self.task_index = task_index(tuple(map(tuple, task["docs"]))) if task.get("docs") else None
        return [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": task["question"]}]

    @tool
    def search(self, query: str) -> str:
        """Search the encyclopedia.

        Args:
            query: words to look for.
        """
        self.searches.append(query)
        hits = (self.task_index or self.index).search(query, k=self.top_k)
        if hits:
            self.found.add((hits[0].country, hits[0].field))
        if not hits:
            return "No results."
        return "\n".join(f"[{i + 1}] {clip(doc.text, self.snippet_chars)}" for i, doc in enumerate(hits))

    def on_text_response(self, text: str) -> None:
        self.final_reply = text
        self.done = True
        return None

    def reward(self) -> float:
        """Exact match; a task with ``search_credit`` w (GRPO's, ``make_questions(train_search_credit=w)``;
        never a held-out one, so ``eval_accuracy`` stays exact match) adds w times the share of its expert
        searches' documents that one of the episode's searches ranked first: a query that copies the asked
        name finds its document, one with a remembered name does not, so groups differ before any answer
        is right."""
        em = score(self.final_reply, self.task["answers"], metric=self.metric, format_weight=self.format_weight)
        credit = float(self.task.get("search_credit", 0.0))
        if not credit:
            return em
        needed = {tuple(e) for e in self.task["evidence"]}
        return em + credit * len(needed & self.found) / len(needed)


def clip(text: str, limit: int) -> str:
    """``text`` cut to at most ``limit`` characters at a word boundary, marked with ``...``."""
    if len(text) <= limit:
        return text
    cut = text[: limit - 3].rsplit(" ", 1)[0]
    return cut.rstrip(",") + "..."


def expert_replies(task: dict[str, Any]) -> list[str]:
    """The replies of a policy that runs the question's expert searches, then answers."""
    from agentrl.envs.formats import HermesFormat, ToolCall

    fmt = HermesFormat()
    calls = [fmt.render_calls([ToolCall("search", {"query": q})]) for q in task["queries"]]
    return calls + [f"<answer>{task['answers'][0]}</answer>"]


def expert_messages(task: dict[str, Any]) -> list[dict[str, Any]]:
    """The expert's whole chat of ``task`` for supervised warm-up: the initial messages, then its replies
    with the real search results between them, as the agent loop would record them."""
    env = SearchR1Env()
    messages = env.reset(task)
    *calls, answer = expert_replies(task)
    for reply, query in zip(calls, task["queries"], strict=True):
        messages += [{"role": "assistant", "content": reply},
                     {"role": "tool", "name": "search", "content": env.search(query)}]
    messages.append({"role": "assistant", "content": answer})
    return messages
