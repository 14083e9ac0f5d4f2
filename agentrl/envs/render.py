"""Render a chat to token ids so that ONLY template-inserted control tokens are control tokens.

A chat template renders the whole conversation into one string; tokenizing that string would turn the
text ``<|im_end|>`` inside a tool result or a user message into the real control token (special-token
injection). :class:`ChatRenderer` renders the template with a placeholder in place of every message
text, then tokenizes segment by segment: template text normally, message text with
``split_special_tokens=True``. Message texts are tokenized on their own, so an assistant reply is
re-tokenized exactly as it would be canonically sampled after ``<|im_start|>assistant\\n`` — which keeps
re-tokenization drift to non-canonical samples only.

A template that rewrites message text (e.g. strips reasoning) cannot work with placeholders; for such
templates the real render is tokenized whole, with each control-token text inside a message escaped
(tokenized with ``split_special_tokens=True``) — equally injection-safe.
"""

from __future__ import annotations

import copy
import json
import re
import secrets
from dataclasses import dataclass
from typing import Any

Message = dict[str, Any]


@dataclass(frozen=True)
class RenderedChat:
    """Token ids of a rendered chat, the rendered text, and a mask of assistant-written tokens."""

    ids: list[int]
    text: str
    # 1 on the tokens of assistant message texts and the end-of-turn token closing each (supervised
    # warm-up trains these); 0 on everything the template, the system, the user or a tool wrote.
    assistant_mask: list[int]


class ChatRenderer:
    """Injection-safe ``messages -> token ids`` with the tokenizer's chat template, and reply decoding."""

    def __init__(self, tokenizer: Any, **chat_template_kwargs: Any) -> None:
        self.tokenizer = tokenizer
        self.chat_template_kwargs = chat_template_kwargs
        self._nonce = secrets.token_hex(4)
        self._slot = re.compile("\ue000" + self._nonce + r":(\d+)\ue001")
        self.control_texts = sorted(
            {t.content for t in tokenizer.added_tokens_decoder.values() if t.special}, key=len, reverse=True
        )
        eos = tokenizer.eos_token_id
        self.stop_ids = {eos} if isinstance(eos, int) else set(eos or [])
        self._delimiters: tuple[str | None, str | None] | None = None

    # ---- prompts ---------------------------------------------------------------------------------
    def render(self, messages: list[Message], tools: list[dict] | None = None, *,
               add_generation_prompt: bool = True) -> RenderedChat:
        """Token ids of ``messages`` (plus the assistant header when ``add_generation_prompt``).

        A message content given as OpenAI text parts (``[{"type": "text", "text": ...}, ...]``) is
        joined into one string first; other part types are refused.
        """
        messages = [_with_text_content(m) for m in messages]
        slotted, slots, owner = self._with_placeholders(messages)
        template_text = self._apply_template(slotted, tools, add_generation_prompt)
        real_text = self._apply_template(messages, tools, add_generation_prompt)
        pieces = self._slot.split(template_text)  # [template, slot, template, slot, ..., template]
        filled = "".join(slots[int(p)] if i % 2 else p for i, p in enumerate(pieces))
        if filled != real_text:  # the template rewrites message text: placeholders would lie
            return self._render_escaped(messages, tools, add_generation_prompt)
        return self._tokenize_segments(pieces, slots, owner, messages, real_text)

    def _with_placeholders(self, messages: list[Message]) -> tuple[list[Message], list[str], list[int]]:
        slotted = copy.deepcopy(messages)
        slots: list[str] = []
        owner: list[int] = []  # message index of each slot

        def slot(text: str, index: int) -> str:
            slots.append(text)
            owner.append(index)
            return f"\ue000{self._nonce}:{len(slots) - 1}\ue001"

        for index, message in enumerate(slotted):
            content = message.get("content")
            if isinstance(content, str) and content:  # empty text stays empty: templates test truthiness
                message["content"] = slot(content, index)
            for call in message.get("tool_calls") or []:
                fn = call.get("function", call)
                fn["name"] = slot(fn["name"], index)
                args = fn.get("arguments", {})
                # transformers' tojson is json.dumps(ensure_ascii=False): same text as the template's.
                fn["arguments"] = slot(args if isinstance(args, str) else json.dumps(args, ensure_ascii=False),
                                       index)
        return slotted, slots, owner

    def _apply_template(self, messages: list[Message], tools: list[dict] | None, add_generation_prompt: bool) -> str:
        return self.tokenizer.apply_chat_template(
            messages, tools=tools or None, tokenize=False, add_generation_prompt=add_generation_prompt,
            **self.chat_template_kwargs,
        )

    def _tokenize_segments(self, pieces: list[str], slots: list[str], owner: list[int],
                           messages: list[Message], text: str) -> RenderedChat:
        """Tokenize template text normally and message text with control tokens split.

        An assistant turn is one segment from after its role header to before its end-of-turn token,
        template-written tool-call markup included: the model wrote all of it as one stream, so an
        OpenAI-style ``tool_calls`` history re-tokenizes exactly like the raw reply text.
        """
        chunks = self._chunks(pieces, slots, owner, messages)
        encoded_template = self._encode_batch([t for t, kind in chunks if kind == "template"], split_special=False)
        encoded_text = self._encode_batch([t for t, kind in chunks if kind != "template"], split_special=True)
        template_iter, text_iter = iter(encoded_template), iter(encoded_text)
        ids: list[int] = []
        mask: list[int] = []
        after_assistant = False
        for _, kind in chunks:
            if kind == "template":
                part = next(template_iter)
                ids.extend(part)
                mask.extend([0] * len(part))
                if after_assistant and part and part[0] in self.stop_ids:
                    mask[len(mask) - len(part)] = 1  # the end-of-turn token closing an assistant reply
            else:
                part = next(text_iter)
                ids.extend(part)
                mask.extend([1 if kind == "assistant" else 0] * len(part))
            after_assistant = kind == "assistant" or (after_assistant and kind == "template" and not part)
        return RenderedChat(ids=ids, text=text, assistant_mask=mask)

    def _chunks(self, pieces: list[str], slots: list[str], owner: list[int],
                messages: list[Message]) -> list[tuple[str, str]]:
        """``[(text, kind)]`` with kind ``template``, ``message`` (user/tool/system text) or ``assistant``."""
        slot_ids = [int(p) for p in pieces[1::2]]
        header, end_text = self._assistant_delimiters()
        chunks: list[tuple[str, str]] = []
        pending = pieces[0]  # template text not yet emitted
        k = 0
        while k < len(slot_ids):
            index = owner[slot_ids[k]]
            if messages[index].get("role") != "assistant":
                chunks += [(pending, "template"), (slots[slot_ids[k]], "message")]
                pending = pieces[2 * k + 2]
                k += 1
                continue
            last = k
            while last + 1 < len(slot_ids) and owner[slot_ids[last + 1]] == index:
                last += 1
            inner = [pieces[2 * i + 2] for i in range(k, last)]
            if any(c in t for t in inner for c in self.control_texts):  # never merge across control tokens
                for i in range(k, last + 1):
                    chunks += [(pending, "template"), (slots[slot_ids[i]], "assistant")]
                    pending = pieces[2 * i + 2]
                k = last + 1
                continue
            cut = pending.rfind(header) if header else -1
            start = cut + len(header) if cut >= 0 and not self._has_control(pending[cut + len(header):]) else len(pending)
            right = pieces[2 * last + 2]
            stop = right.find(end_text) if end_text else -1
            stop = stop if stop >= 0 and not self._has_control(right[:stop]) else 0
            body = pending[start:] + "".join(
                slots[slot_ids[i]] + (inner[i - k] if i < last else "") for i in range(k, last + 1)
            ) + right[:stop]
            chunks += [(pending[:start], "template"), (body, "assistant")]
            pending = right[stop:]
            k = last + 1
        chunks.append((pending, "template"))
        return chunks

    def _has_control(self, text: str) -> bool:
        return any(c in text for c in self.control_texts)

    def _assistant_delimiters(self) -> tuple[str | None, str | None]:
        """The assistant role header (what the generation prompt adds) and the end-of-turn text."""
        if self._delimiters is None:
            probe = [{"role": "user", "content": "x"}]
            try:
                with_header = self._apply_template(probe, None, True)
                without = self._apply_template(probe, None, False)
                header = with_header[len(without):] if with_header.startswith(without) else None
            except Exception:  # a template that cannot render the probe: no merging, still safe
                header = None
            eos = getattr(self.tokenizer, "eos_token", None)
            self._delimiters = (header or None, eos if isinstance(eos, str) and eos else None)
        return self._delimiters

    def _render_escaped(self, messages: list[Message], tools: list[dict] | None,
                        add_generation_prompt: bool) -> RenderedChat:
        """Fallback: every control-token text inside a message is swapped for a marker before rendering;
        the render is tokenized whole and each marker becomes that text, tokenized as plain text."""
        if not self.control_texts:
            text = self._apply_template(messages, tools, add_generation_prompt)
            ids = self._encode_batch([text], split_special=False)[0]
            return RenderedChat(ids=ids, text=text, assistant_mask=[0] * len(ids))
        pattern = re.compile("|".join(re.escape(t) for t in self.control_texts))
        index = {t: i for i, t in enumerate(self.control_texts)}

        def escape(text: str) -> str:
            return pattern.sub(lambda m: f"\ue000{self._nonce}:{index[m.group(0)]}\ue001", text)

        escaped = copy.deepcopy(messages)
        for message in escaped:
            if isinstance(message.get("content"), str):
                message["content"] = escape(message["content"])
            for call in message.get("tool_calls") or []:
                fn = call.get("function", call)
                fn["name"] = escape(fn["name"])
                args = fn.get("arguments", {})
                fn["arguments"] = escape(args if isinstance(args, str) else json.dumps(args, ensure_ascii=False))
        pieces = self._slot.split(self._apply_template(escaped, tools, add_generation_prompt))
        literal = [self.control_texts[int(p)] for p in pieces[1::2]]
        plain = self._encode_batch(pieces[0::2], split_special=False)
        protected = self._encode_batch(literal, split_special=True)
        ids: list[int] = []
        for k, part in enumerate(plain):
            ids += part
            if k < len(protected):
                ids += protected[k]
        text = "".join(literal[i // 2] if i % 2 else p for i, p in enumerate(pieces))
        return RenderedChat(ids=ids, text=text, assistant_mask=[0] * len(ids))

    def _encode_batch(self, texts: list[str], *, split_special: bool) -> list[list[int]]:
        if not texts:
            return []
        out = self.tokenizer(texts, add_special_tokens=False, split_special_tokens=split_special)
        return [list(ids) for ids in out["input_ids"]]

    # ---- replies ---------------------------------------------------------------------------------
    def decode_response(self, output_ids: list[int]) -> str:
        """The reply text of sampled ids: the trailing stop token dropped, nothing else (control tokens the
        model emitted mid-reply stay as text, so the parser sees exactly what the model said)."""
        ids = list(output_ids)
        while ids and ids[-1] in self.stop_ids:
            ids.pop()
        return self.tokenizer.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)


def _with_text_content(message: Message) -> Message:
    content = message.get("content")
    if not isinstance(content, list):
        return message
    texts = []
    for part in content:
        if not (isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)):
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            raise ValueError(f"only text content parts can be rendered, got a {kind!r} part")
        texts.append(part["text"])
    return {**message, "content": "".join(texts)}
