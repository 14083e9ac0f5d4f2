"""The example's tokenizer: the bundled tiny BPE tokenizer plus one token per name (``model.tokenizer``).

With the tiny tokenizer a name is several pieces ("Nepal" -> ``ĠN e p al``), and the tiny random-init
model learned to copy the first pieces and then drift to a memorised name ("Nepal" -> "Netherland").
Here every real country and capital and every made-up name of ``synthetic.name_pool()`` is one added
token, so putting the asked name into the query, or the found capital into the answer, copies one token
(an induction-style copy). Added tokens match before the BPE, leftmost-longest ("Equatorial Guinea" is one
token, not "Equatorial" + "Guinea"), and without their leading space: "capital of Nepal" is
``capital of Ġ Nepal`` wherever the name stands, so the token to copy is the same in the question, the
query, the search result and the answer.
"""

from __future__ import annotations

from pathlib import Path


def names() -> list[str]:
    """Every name made one token: real countries and capitals, then the made-up pool. ASCII names only:
    the byte-level decoder would turn an added token's "í" into a stray byte ("Brasília" decodes to
    "Bras\ufffdlia"), so the few names with accents (Bogotá, São Tomé, ...) stay BPE pieces."""
    from examples.search_r1.corpus import countries
    from examples.search_r1.synthetic import name_pool

    real = sorted(n for n in {c.name for c in countries()} | {c.capital for c in countries() if c.capital}
                  if n.isascii())
    return real + [n for n in name_pool() if n not in set(real)]


# The words of the prompts, questions, queries and documents, and the fixed pieces of a search call: each
# one token (with and without its leading space), so a chat is shorter (a one-hop expert chat 153 -> ~90
# tokens) and a reply is a few tokens: `TOOL_CALL_OPEN name TOOL_CALL_CLOSE` (the template's <tool_call>
# and </tool_call> around it are already single tokens).
WORDS = ("system", "user", "assistant", "Search", "then", "reply", "answer", "Tools", "search", "query",
         "What", "Which", "is", "the", "capital", "of", "country", "that", "borders", "and", "has",
         "population", "whose", "The", "in", "area", "square", "kilometres", "Languages", "ISO", "codes",
         "Currencies", "No", "results")
PIECES = ('{"name": "search", "arguments": {"query": "', '"}}', "<answer>", "</answer>")


def write_tokenizer(out_dir: str | Path, *, words: bool = True) -> None:
    """``model.tokenizer`` plug-in: write the tiny tokenizer with one token per name (and, with ``words``,
    per word of :data:`WORDS` and piece of :data:`PIECES`) into ``out_dir``."""
    from tokenizers import AddedToken
    from transformers import AutoTokenizer

    from agentrl.models.tiny import TOKENIZER_DIR

    tokenizer = AutoTokenizer.from_pretrained(TOKENIZER_DIR)
    every = names()
    # Added tokens match leftmost first: " No" would take the space and "No" of " Nosbo" before the name
    # could, so a spaced word that begins a name is left out.
    spaced = [" " + w for w in WORDS if not any(n.startswith(w) for n in every)]
    extra = [*PIECES, *WORDS, *spaced] if words else []
    tokenizer.add_tokens([AddedToken(n, single_word=False, lstrip=False, rstrip=False, normalized=False)
                          for n in [*every, *extra]])
    tokenizer.save_pretrained(out_dir)


def write_name_tokenizer(out_dir: str | Path) -> None:
    """:func:`write_tokenizer` with the names only (the probe's comparison)."""
    write_tokenizer(out_dir, words=False)
