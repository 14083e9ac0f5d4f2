"""The coding agent's tokenizer (``model.tokenizer``): the bundled tiny BPE plus one token per argument name,
per word of the docstrings and per fixed piece of a one-line body and of a tool call.

With the plain tiny tokenizer ``numbers`` is ``number s`` in one place and ``Ġnumber s`` in another, and
``above`` is ``Ġa bo ve``: the 0.6M model copied names and constants badly, and its held-out errors were
exactly that (a wrong name, a wrong constant). Here a name is one token that is the same wherever it stands
(added without its leading space, matched only as a whole word: ``def f(xs):``, ``of xs above``, ``return
[v for v in xs ...`` all hold the same ``xs`` token), and a body is a few tokens: ``return `` ``[v for v in
`` ``xs`` `` if v > `` ``3`` ``]``. What the model must get right is then what the task is about: which
operation the sentence names, which name to copy, which digit to copy. Any other text (HumanEval included)
still encodes through the byte-level BPE.
"""

from __future__ import annotations

import re
from pathlib import Path

from examples.coding_agent import oneliners

# Fixed pieces of the chats: the tool calls the expert makes, the tool results, and the pieces of the
# operations' expressions between their names and constants (oneliners.OPS), longest first so that
# leftmost-longest matching takes the whole piece.
CALLS = ('{"name": "write", "arguments": {"code": "', '"}}', '{"name": "run_tests", "arguments": {}}',
         '{"name": "submit", "arguments": {}}')
RESULTS = ("saved solution.py", "submitted", " examples passed", "ok   ", "FAIL ")
CODE = ("return ",)
# The chat's own words: role names and the system prompt's words.
CHAT = ("system", "user", "assistant", "Write", " the", " function's", " body", " with", " write", " test", " it",
        " run_tests", " then", " submit", "Tools", "(code)", "()")


def expression_pieces() -> list[str]:
    """The text of every operation's expression between its names, constants and the chained ``{e}``."""
    pieces: set[str] = set()
    for op in oneliners.OPS:
        for template in filter(None, (op.expr, op.post)):
            pieces.update(p for p in re.split(r"\{[abke]\}", template) if p)
    return sorted(pieces, key=lambda p: (-len(p), p))


def docstring_words() -> list[str]:
    """Every word of the operations' sentences (oneliners.OPS ``text`` and ``then``)."""
    words: set[str] = set()
    for op in oneliners.OPS:
        for template in filter(None, (op.text, op.then)):
            words.update(re.findall(r"[A-Za-z]+", re.sub(r"\{[abk]\}", " ", template)))
    return sorted(words)


def names() -> list[str]:
    return sorted(oneliners.NAMES)


def write_tokenizer(out_dir: str | Path) -> None:
    """``model.tokenizer`` plug-in: the tiny tokenizer with the tokens above, written into ``out_dir``."""
    from tokenizers import AddedToken
    from transformers import AutoTokenizer

    from agentrl.models.tiny import TOKENIZER_DIR

    tokenizer = AutoTokenizer.from_pretrained(TOKENIZER_DIR)

    def token(text: str, *, whole_word: bool) -> AddedToken:
        return AddedToken(text, single_word=whole_word, lstrip=False, rstrip=False, normalized=False)

    # Words keep their leading space (" above"), as the BPE's do, while a name's space stays a token of its
    # own, so that the name token is the same after "(", " " and "[v for v in ". A name matches only as a
    # whole word ("a" is not the "a" of "data"); a spaced word cannot (the word before it ends right at its
    # space), so " in" may begin " input" in other text: a different split of the same bytes.
    words = [*docstring_words(), *oneliners.NUMBER_WORDS]
    fixed = [*CALLS, *RESULTS, *CODE, *CHAT, *expression_pieces(), "Return", *(" " + w for w in words)]
    tokenizer.add_tokens([token(n, whole_word=True) for n in names()] + [token(p, whole_word=False) for p in fixed])
    tokenizer.save_pretrained(out_dir)
