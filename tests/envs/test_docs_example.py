"""The < 30-line environment shown in docs/envs.md and the package docstring runs as written."""

from __future__ import annotations

import asyncio
import re
from pathlib import Path

import agentrl.envs
from agentrl.envs import run_episode
from agentrl.envs.scripted import ScriptedPolicy
from agentrl.trajectory import verify

DOC = Path(__file__).resolve().parents[2] / "docs" / "envs.md"


def first_python_block(text: str) -> str:
    return re.search(r"```python\n(.*?)```", text, re.DOTALL).group(1)


def run_example(source: str, tokenizer, renderer) -> None:
    assert len(source.strip().splitlines()) < 30
    namespace: dict = {}
    exec(compile(source, "example", "exec"), namespace)  # noqa: S102 - our own documentation
    env_cls = namespace["Arithmetic"]
    policy = ScriptedPolicy(tokenizer, ['<tool_call>{"name": "submit", "arguments": {"answer": 42}}</tool_call>'])
    result = asyncio.run(run_episode(env_cls(), {"a": 20, "b": 22}, policy, renderer, session_id="doc"))
    assert result.metrics.reward == 1.0 and result.metrics.stop_reason == "done"
    verify(result.samples[0], policy.turns["doc"])


def test_docs_example_runs(tokenizer, renderer):
    run_example(first_python_block(DOC.read_text()), tokenizer, renderer)


def test_package_docstring_example_runs(tokenizer, renderer):
    doc = agentrl.envs.__doc__
    block = doc.split("A new tool environment::\n\n", 1)[1].split("\n\nRun it", 1)[0]
    source = "\n".join(line[4:] for line in block.splitlines())
    run_example(source, tokenizer, renderer)
