"""Search-R1-style multi-turn QA, fully offline: BM25 search over a countryinfo corpus.

``SearchR1Env`` (tool ``search``; final ``<answer>``), ``make_questions(split=...)`` (single- and
multi-hop, held-out split by country), ``score`` (EM/F1 + format).
"""
