"""Reasoning blocks: split a reply into (reasoning, content) before its tool calls are parsed.

Qwen3, DeepSeek-R1 and GLM-4.5 think inside ``<think>...</think>``. DeepSeek-R1's template (and Qwen3's
with thinking forced on) already writes ``<think>\\n`` at the end of the prompt, so the reply starts *inside*
the block and carries only the closing tag. A reply cut off while thinking has no closing tag: all of it
is reasoning. Calls written inside the reasoning are drafts and are not run.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace
from typing import Any

from agentrl.envs.formats.base import ParsedResponse, ToolCallFormat


@dataclass(frozen=True)
class ThinkParser:
    """Splits ``<think>...</think>`` off a reply.

    ``starts_inside``: the prompt already opened the block, so text up to the first close tag is
    reasoning even when it has no open tag (a close tag with no open tag before it is read that way too)."""

    open_tag: str = "<think>"
    close_tag: str = "</think>"
    starts_inside: bool = False

    def split(self, text: str) -> tuple[str, str]:
        """``(reasoning, content)``: the text of the block(s), stripped, and everything else, stripped."""
        reasoning: list[str] = []
        content: list[str] = []
        pos = 0
        first_open = text.find(self.open_tag)
        first_close = text.find(self.close_tag)
        inside = self.starts_inside or (first_close != -1 and (first_open == -1 or first_close < first_open))
        while pos <= len(text):
            if inside:
                end = text.find(self.close_tag, pos)
                if end == -1:  # unterminated: the rest is reasoning
                    reasoning.append(text[pos:])
                    break
                reasoning.append(text[pos:end])
                pos = end + len(self.close_tag)
                inside = False
            else:
                start = text.find(self.open_tag, pos)
                if start == -1:
                    content.append(text[pos:])
                    break
                content.append(text[pos:start])
                pos = start + len(self.open_tag)
                inside = True
        return "\n".join(p.strip() for p in reasoning if p.strip()), "".join(content).strip()

    def is_unterminated(self, text: str) -> bool:
        """Whether the reply ends inside a reasoning block (it was cut off while thinking)."""
        last_open = text.rfind(self.open_tag)
        last_close = text.rfind(self.close_tag)
        if last_open != -1:
            return last_close < last_open
        return self.starts_inside and last_close == -1

    def parse(self, text: str, fmt: ToolCallFormat) -> ParsedResponse:
        """``fmt.parse`` of the content, with the reasoning set (a format's own reasoning, e.g. gpt-oss's
        analysis channel, comes first)."""
        reasoning, content = self.split(text)
        parsed = fmt.parse(content)
        joined = "\n".join(r for r in (parsed.reasoning, reasoning) if r)
        return replace(parsed, reasoning=joined)


# A template whose generation prompt ends by opening the block: DeepSeek-R1 writes '<｜Assistant｜><think>\n'.
_OPENS_IN_PROMPT = re.compile(r"<｜Assistant｜><think>")


def think_parser_for(tokenizer_or_template: Any) -> ThinkParser | None:
    """The :class:`ThinkParser` a chat template calls for (a tokenizer or the template text): None when the
    template never mentions ``<think>``; ``starts_inside`` when its generation prompt opens the block."""
    template = tokenizer_or_template if isinstance(tokenizer_or_template, str) else (
        getattr(tokenizer_or_template, "chat_template", None) or "")
    if isinstance(template, dict):
        template = " ".join(template.values())
    if "think>" not in template:  # "<think>" or only "</think>" (R1-Distill strips it from history)
        return None
    return ThinkParser(starts_inside=bool(_OPENS_IN_PROMPT.search(template)))
