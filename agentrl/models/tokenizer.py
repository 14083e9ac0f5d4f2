"""Train a small byte-level BPE tokenizer with a ChatML template, entirely offline.

The split pattern is Qwen2's with digits split singly, and all 256 bytes are in the alphabet, so any
text round-trips. ``<|im_start|>``/``<|im_end|>`` are control tokens; ``<tool_call>`` and friends are
single *non-special* tokens, as in Qwen2.5, so a model can emit them and a decode keeps them.
"""

from __future__ import annotations

import random
import sys
from collections.abc import Iterator
from pathlib import Path

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
TOOL_TOKENS = ["<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"]
# Qwen2 pre-tokenizer pattern, with \p{N} instead of \p{N}{1,3} so numbers split into single digits.
SPLIT_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
CHAT_TEMPLATE = (Path(__file__).parent / "chat_template.jinja").read_text()


def synthetic_corpus(seed: int = 0, max_bytes: int = 3_000_000) -> Iterator[str]:
    """Arithmetic-with-tools chats, tool-call JSON and Python source from the standard library."""
    rng = random.Random(seed)
    for _ in range(20_000):
        a, b = rng.randint(0, 999), rng.randint(0, 999)
        op = rng.choice(["+", "-", "*"])
        yield f"What is {a}{op}{b}? Use the calculator tool, then submit the answer."
        yield f'<tool_call>{{"name": "calculator", "arguments": {{"expression": "{a}{op}{b}"}}}}</tool_call>'
        yield f'<tool_call>{{"name": "submit", "arguments": {{"answer": {a + b}}}}}</tool_call>'
        yield f"<tool_response>\n{a + b}\n</tool_response>"
    stdlib = Path(random.__file__).parent
    total = 0
    for path in sorted(stdlib.glob("*.py")):
        text = path.read_text(encoding="utf-8", errors="ignore")
        total += len(text)
        yield text
        if total > max_bytes:
            break


def train_tokenizer(out_dir: str | Path, vocab_size: int = 1024, seed: int = 0) -> Path:
    """Train the tokenizer and save it (``tokenizer.json`` + config + chat template) to ``out_dir``."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(SPLIT_PATTERN), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size - len(TOOL_TOKENS),
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(synthetic_corpus(seed), trainer)
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in TOOL_TOKENS])
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        clean_up_tokenization_spaces=False,
    )
    fast.chat_template = CHAT_TEMPLATE
    out = Path(out_dir)
    fast.save_pretrained(out)
    return out


def main(argv: list[str] | None = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("out_dir")
    parser.add_argument("--vocab-size", type=int, default=1024)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    print(train_tokenizer(args.out_dir, args.vocab_size, args.seed))
    return 0


if __name__ == "__main__":
    sys.exit(main())
