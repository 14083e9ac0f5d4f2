"""BM25 search over the country corpus (``bm25s``)."""

from __future__ import annotations

from collections.abc import Sequence

from examples.search_r1.corpus import Document, build_corpus


class SearchIndex:
    """``search(query, k)`` -> the ``k`` best documents by BM25 (English stopwords removed).

    ``b`` is low because every document is one short sentence except the lists of neighbours: full length
    normalisation (0.75) ranks "Bhutan borders China, India." above China's long list for the query
    ``borders Afghanistan and Bhutan``, though only China's names both (measured: 237 two-hop questions
    answerable at 0.75, 511 at 0.1).
    """

    def __init__(self, documents: Sequence[Document] | None = None, *, k1: float = 1.2, b: float = 0.1) -> None:
        import bm25s

        self._bm25s = bm25s
        self.documents = list(documents if documents is not None else build_corpus())
        if not self.documents:
            raise ValueError("cannot index an empty corpus")
        self.retriever = bm25s.BM25(k1=k1, b=b)
        tokens = bm25s.tokenize([d.text for d in self.documents], stopwords="en", show_progress=False)
        self.retriever.index(tokens, show_progress=False)

    def search(self, query: str, k: int = 3) -> list[Document]:
        """Best documents first; none when the query has no indexable word."""
        if k < 1:
            raise ValueError(f"k must be >= 1, got {k}")
        tokens = self._bm25s.tokenize([query], stopwords="en", show_progress=False)
        if not tokens.ids or not tokens.ids[0]:
            return []
        ids, scores = self.retriever.retrieve(tokens, k=min(k, len(self.documents)), show_progress=False)
        return [self.documents[int(i)] for i, s in zip(ids[0], scores[0], strict=True) if s > 0]
