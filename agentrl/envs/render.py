"""Render a chat to token ids so that ONLY template-inserted control tokens are control tokens.

:class:`ChatRenderer` renders the template with a placeholder for every message text and tokenizes
template text normally, message text with ``split_special_tokens=True`` (a template that rewrites message
text is rendered whole with control-token texts escaped instead); why, and what it means for drift:
docs/envs.md, "Rendering". :meth:`ChatRenderer.render_continuation` renders only what follows the reply
just sampled, for the append-only prompt mode.
"""

from __future__ import annotations

import copy
import json
import re
import secrets
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from agentrl.envs.formats import ThinkParser

Message = dict[str, Any]
ENCODED_TEXTS_KEPT = 8192  # per mode; the memo of tokenized texts starts over when it would hold more
RENDERED_CHATS_KEPT = 4096  # likewise for whole rendered chats
# Keyword arguments apply_chat_template takes from the renderer itself; a chat_template_kwargs key may not be one.
RESERVED_TEMPLATE_KWARGS = frozenset({"conversation", "messages", "tools", "tokenize", "add_generation_prompt",
                                      "continue_final_message", "return_dict", "chat_template"})


@dataclass(frozen=True)
class RenderedChat:
    """Token ids of a rendered chat, the rendered text, and a mask of assistant-written tokens."""

    ids: list[int]
    text: str
    # 1 on the tokens of assistant message texts and the end-of-turn token closing each (supervised
    # warm-up trains these); 0 on everything the template, the system, the user or a tool wrote.
    assistant_mask: list[int]


def _memo(store: dict[str, Any], parts: list[Any], make: Callable[[], Any]) -> Any:
    """``make()``, kept in ``store`` by the JSON of ``parts`` (key order kept); not kept when ``parts`` is no
    JSON. The store starts over when it would hold more than :data:`RENDERED_CHATS_KEPT`."""
    try:
        key = json.dumps(parts, ensure_ascii=False)
    except (TypeError, ValueError):
        return make()
    value = store.get(key)
    if value is None:
        value = make()
        if len(store) >= RENDERED_CHATS_KEPT:
            store.clear()
        store[key] = value
    return value


class ChatRenderer:
    """Injection-safe ``messages -> token ids`` with the tokenizer's chat template, and reply decoding."""

    def __init__(self, tokenizer: Any, **chat_template_kwargs: Any) -> None:
        clash = sorted(RESERVED_TEMPLATE_KWARGS & chat_template_kwargs.keys())
        if clash:
            raise ValueError(f"chat_template_kwargs may not set {clash}: the renderer passes them itself")
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
        self._reasoning: tuple[ThinkParser | None] | None = None
        self._encoders = _rust_encoders(tokenizer)
        self._direct_template = _direct_template(tokenizer)
        # texts already tokenized, per split_special mode: a chat's template pieces (system prompt, tool
        # schemas, role headers) repeat in every render. Exact: each piece is always tokenized on its own.
        self._encoded: dict[bool, dict[str, tuple[int, ...]]] = {True: {}, False: {}}
        self._rendered: dict[str, RenderedChat] = {}  # by the chat's JSON (message and key order kept)
        self._slotted_texts: dict[str, str] = {}  # template text of chats with placeholders, by their JSON
        self._checked_tools: tuple[Any, bool] = (None, True)  # the last tool list seen, and whether it is plain

    # ---- prompts ---------------------------------------------------------------------------------
    def render(self, messages: list[Message], tools: list[dict] | None = None, *,
               add_generation_prompt: bool = True) -> RenderedChat:
        """Token ids of ``messages`` (plus the assistant header when ``add_generation_prompt``).

        A message content given as OpenAI text parts (``[{"type": "text", "text": ...}, ...]``) is
        joined into one string first; other part types are refused.
        """
        messages = [_with_text_content(m) for m in messages]
        # the same chat renders the same: a GRPO group's episodes start from one prompt
        known = _memo(self._rendered, [messages, tools, add_generation_prompt],
                      lambda: self._render(messages, tools, add_generation_prompt))
        return RenderedChat(ids=list(known.ids), text=known.text, assistant_mask=list(known.assistant_mask))

    def _render(self, messages: list[Message], tools: list[dict] | None, add_generation_prompt: bool) -> RenderedChat:
        slotted, slots, owner = self._with_placeholders(messages)
        template_text = self._slotted_template_text(slotted, tools, add_generation_prompt)
        real_text = self._apply_template(messages, tools, add_generation_prompt)
        pieces = self._slot.split(template_text)  # [template, slot, template, slot, ..., template]
        filled = "".join(slots[int(p)] if i % 2 else p for i, p in enumerate(pieces))
        if filled != real_text:  # the template rewrites message text: placeholders would lie
            return self._render_escaped(messages, tools, add_generation_prompt)
        return self._tokenize_segments(pieces, slots, owner, messages, real_text)

    def _slotted_template_text(self, slotted: list[Message], tools: list[dict] | None,
                               add_generation_prompt: bool) -> str:
        """The template's text for a chat with placeholders for texts: chats of one shape (roles, other
        fields, which texts are empty) share it, since placeholders are numbered in order -- every episode
        of a task family, whatever its numbers or words. The real render still checks each chat."""
        return _memo(self._slotted_texts, [slotted, tools, add_generation_prompt],
                     lambda: self._apply_template(slotted, tools, add_generation_prompt))

    def render_continuation(self, messages: list[Message], new_from: int, tools: list[dict] | None = None, *,
                            reply_closed: bool = True) -> list[int]:
        """Token ids the template writes after the assistant reply ``messages[new_from - 1]``: the rest of
        that turn's closing, ``messages[new_from:]`` and the generation prompt — never the history again.

        The caller holds the reply's tokens as sampled; ``reply_closed`` says they end with a stop token,
        which the template's own end-of-turn token would repeat (it is left out then). The template sees
        the real history, so context-dependent markup (a tool block opened after an assistant turn, the
        generation prompt's ``chat_template_kwargs``) is what it would write; message text is tokenized
        with control tokens split, as in :meth:`render`.
        """
        messages = [_with_text_content(m) for m in messages]
        if not 0 < new_from <= len(messages) or messages[new_from - 1].get("role") != "assistant":
            raise ValueError(f"messages[{new_from - 1}] must be the assistant reply the continuation follows")
        mark = f"\ue000{self._nonce}:reply\ue001"
        # The reply's text, calls and reasoning are in the held tokens already: a bare marker stands in.
        head = [*messages[: new_from - 1], {"role": "assistant", "content": mark}]
        new = messages[new_from:]
        slotted, slots, _ = self._with_placeholders(new)
        tail = self._after(mark, self._apply_template(head + slotted, tools, True))
        pieces = self._slot.split(tail)
        literal = [slots[int(p)] for p in pieces[1::2]]
        filled = "".join(literal[i // 2] if i % 2 else p for i, p in enumerate(pieces))
        if filled != self._after(mark, self._apply_template(head + new, tools, True)):
            pieces, literal = self._escaped_pieces(head, new, tools, mark)  # the template rewrites new text
        ids = self._interleave(pieces[0::2], literal)
        if reply_closed and ids and ids[0] in self.stop_ids:
            ids = ids[1:]
        return ids

    def _after(self, mark: str, text: str) -> str:
        if text.count(mark) != 1:
            raise ValueError("the chat template does not write the assistant reply verbatim, so the append "
                             "prompt mode cannot tell where the reply ends; use prompt_mode='rerender'")
        return text.split(mark)[1]

    def _escaped_pieces(self, head: list[Message], new: list[Message], tools: list[dict] | None,
                        mark: str) -> tuple[list[str], list[str]]:
        """Template text pieces after ``mark`` and the control-token texts of ``new`` between them."""
        escaped = self._escape_messages(new)
        pieces = self._slot.split(self._after(mark, self._apply_template(head + escaped, tools, True)))
        return pieces, [self.control_texts[int(p)] for p in pieces[1::2]]

    def _interleave(self, template_parts: list[str], texts: list[str]) -> list[int]:
        """Template parts tokenized normally, the texts between them with control tokens split."""
        plain = self._encode_batch(template_parts, split_special=False)
        protected = self._encode_batch(texts, split_special=True)
        ids: list[int] = []
        for k, part in enumerate(plain):
            ids += part
            if k < len(protected):
                ids += protected[k]
        return ids

    def reasoning_parser(self) -> ThinkParser | None:
        """A :class:`ThinkParser` when the chat template thinks in ``<think>`` blocks (``starts_inside`` when
        the generation prompt, with this renderer's ``chat_template_kwargs``, leaves a block open); else None."""
        if self._reasoning is None:
            template = getattr(self.tokenizer, "chat_template", None) or ""
            if isinstance(template, dict):
                template = " ".join(template.values())
            parser = None
            if ThinkParser.open_tag in template:
                header = self._assistant_delimiters()[0] or ""
                opened = header.rfind(ThinkParser.open_tag) > header.rfind(ThinkParser.close_tag)
                parser = ThinkParser(starts_inside=opened)
            self._reasoning = (parser,)
        return self._reasoning[0]

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
        """The template's text for the chat, as ``apply_chat_template(tokenize=False)`` writes it.

        Plain-JSON chats go straight to the template as transformers compiles it (its sandbox, filters and
        globals): apply_chat_template first rebuilds every message and tool schema out of plain types
        (~0.5 ms a call on the main job's chats), which leaves such a chat equal to itself, and the sandbox
        keeps the template from changing it. Anything else takes transformers' own path."""
        tools = tools or None
        direct = self._direct_template
        variables = {**self.tokenizer.special_tokens_map, **self.chat_template_kwargs} if direct else {}
        if direct is None or not messages or not (_is_plain(messages) and self._plain_tools(tools)
                                                  and _is_plain(variables)):
            return self.tokenizer.apply_chat_template(
                messages, tools=tools, tokenize=False, add_generation_prompt=add_generation_prompt,
                **self.chat_template_kwargs,
            )
        compile_template, alias_reasoning = direct
        template = compile_template(self.tokenizer.get_chat_template(None, tools))
        chat = alias_reasoning([{key: value for key, value in m.items() if value is not None} for m in messages])
        return template.render(messages=chat, tools=tools, documents=None, add_generation_prompt=add_generation_prompt,
                               **variables)

    def _plain_tools(self, tools: list[dict] | None) -> bool:
        """:func:`_is_plain` of ``tools``, walked once per list object: an episode renders every turn with the
        same schemas (a list edited in place after its first render is not walked again)."""
        if self._checked_tools[0] is not tools:
            self._checked_tools = (tools, _is_plain(tools))
        return self._checked_tools[1]

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
        pieces = self._slot.split(self._apply_template(self._escape_messages(messages), tools, add_generation_prompt))
        literal = [self.control_texts[int(p)] for p in pieces[1::2]]
        ids = self._interleave(pieces[0::2], literal)
        text = "".join(literal[i // 2] if i % 2 else p for i, p in enumerate(pieces))
        return RenderedChat(ids=ids, text=text, assistant_mask=[0] * len(ids))

    def _escape_messages(self, messages: list[Message]) -> list[Message]:
        """``messages`` with each control-token text in their text swapped for its marker."""
        if not self.control_texts:
            return copy.deepcopy(messages)
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
        return escaped

    def _encode_batch(self, texts: list[str], *, split_special: bool) -> list[list[int]]:
        if not texts:
            return []
        known = self._encoded[split_special]
        missing = [t for t in dict.fromkeys(texts) if t not in known]
        if missing:
            if len(known) + len(missing) > ENCODED_TEXTS_KEPT:
                known.clear()  # this call's texts that were known go too: encode them all again
                missing = list(dict.fromkeys(texts))
            if self._encoders is not None:
                encoded = [e.ids for e in self._encoders[split_special].encode_batch(missing, add_special_tokens=False)]
            else:
                encoded = self.tokenizer(missing, add_special_tokens=False, split_special_tokens=split_special)["input_ids"]
            known.update(zip(missing, map(tuple, encoded), strict=True))
        return [list(known[t]) for t in texts]

    # ---- replies ---------------------------------------------------------------------------------
    def decode_response(self, output_ids: list[int]) -> str:
        """The reply text of sampled ids: the trailing stop token dropped, nothing else (control tokens the
        model emitted mid-reply stay as text, so the parser sees exactly what the model said)."""
        ids = list(output_ids)
        while ids and ids[-1] in self.stop_ids:
            ids.pop()
        return self.tokenizer.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)


def _rust_encoders(tokenizer: Any) -> dict[bool, Any] | None:
    """Two copies of a fast tokenizer's ``tokenizers.Tokenizer``, one keyed ``True`` that encodes control-token
    text as plain text (``split_special_tokens=True``) and one keyed ``False`` that does not; None when
    ``tokenizer`` is not such a tokenizer, or the copies encode a probe differently from ``tokenizer``.

    transformers sets ``encode_special_tokens`` on its one backend tokenizer whenever a call asks for the
    other mode, which rebuilds its added-token matcher: ~0.3 ms per switch, and a render switches twice
    (measured: 1.4 ms of a 2-turn render's 1.5 ms). Each copy stays in its mode."""
    backend = getattr(tokenizer, "_tokenizer", None)
    if backend is None or not hasattr(backend, "to_str") or not hasattr(backend, "encode_special_tokens"):
        return None
    try:
        from tokenizers import Tokenizer

        encoders = {}
        for split in (True, False):
            encoders[split] = Tokenizer.from_str(backend.to_str())
            encoders[split].encode_special_tokens = split
        specials = "".join(t.content for t in tokenizer.added_tokens_decoder.values())
        probe = [f"a{specials} b\n 12+34=46 <tool_call>{{\"x\": 1}}</tool_call>", "", specials]
        for split, encoder in encoders.items():
            want = tokenizer(probe, add_special_tokens=False, split_special_tokens=split)["input_ids"]
            if [e.ids for e in encoder.encode_batch(probe, add_special_tokens=False)] != [list(w) for w in want]:
                return None
    except Exception:  # noqa: BLE001 - the tokenizer's own call is correct, only slower
        return None
    return encoders


def _direct_template(tokenizer: Any) -> tuple[Callable[[str], Any], Callable[[list], list]] | None:
    """transformers' template compiler (cached per template) and reasoning-field aliasing -- the two steps of
    ``apply_chat_template`` a plain chat needs -- when ``tokenizer`` renders with transformers' own
    ``apply_chat_template``; else None (a tokenizer of its own, another transformers: its call stays right)."""
    try:
        from transformers import PreTrainedTokenizerBase
        from transformers.utils.chat_template_utils import _alias_reasoning_fields, _compile_jinja_template
    except ImportError:
        return None
    if getattr(type(tokenizer), "apply_chat_template", None) is not PreTrainedTokenizerBase.apply_chat_template:
        return None
    return _compile_jinja_template, _alias_reasoning_fields


_JSON_SCALARS = frozenset({str, int, float, bool, type(None)})


def _is_plain(value: Any) -> bool:
    """Whether ``value`` is built of exact JSON types only (no subclasses, objects or callables)."""
    kind = type(value)
    if kind in _JSON_SCALARS:
        return True
    if kind is dict:
        return all(type(k) is str for k in value) and all(
            type(v) in _JSON_SCALARS or _is_plain(v) for v in value.values())
    if kind is list or kind is tuple:
        return all(type(v) in _JSON_SCALARS or _is_plain(v) for v in value)
    return False


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
