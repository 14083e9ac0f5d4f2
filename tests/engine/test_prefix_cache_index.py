"""The prefix cache's first-token index (issue 40: the server's admissions and finished rows scanned every entry):
a lookup compares only entries that start like the sequence, and evictions, supersessions and clears keep the
index and the LRU in step."""

from __future__ import annotations

import random

from agentrl.engine import prefix_cache
from agentrl.engine.prefix_cache import PrefixCache


def test_a_lookup_compares_only_entries_with_its_first_token_and_the_index_follows_evictions(monkeypatch):
    compared = []
    real = prefix_cache.common_prefix_len
    monkeypatch.setattr(prefix_cache, "common_prefix_len", lambda a, b: compared.append(a[0]) or real(a, b))
    rng = random.Random(0)
    cache = PrefixCache(max_tokens=40 * 20)
    for first in range(60):  # 60 entries of 20 tokens in a budget of 40: the 20 oldest are evicted
        cache.insert([first] + [rng.randrange(100, 200) for _ in range(19)], [])
    assert len(cache) == 40 and cache.num_tokens == 800
    assert sum(len(v) for v in cache._by_first.values()) == 40 and min(cache._by_first) == 20
    n, _ = cache.lookup([45, 7, 7], max_len=2)
    assert compared == [45] and n == 1  # one entry compared; it shares the first token only
    assert cache.lookup([5, 7, 7], max_len=2)[0] == 0 and compared == [45]  # evicted: nothing to compare
    longer = [50, *range(300, 340)]
    cache.insert(longer[:10], [])
    cache.insert(longer, [])  # supersedes its own prefix, under the same first token
    assert sorted(len(e.tokens) for e in cache._by_first[50].values()) == [20, 41]
    assert cache.lookup(longer + [1], max_len=41)[0] == 41
    cache.clear()
    assert not cache._by_first and len(cache) == 0
