"""PrefixCache unit behaviour and cached_tokens growth over a multi-turn session."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from agentrl.engine.prefix_cache import PrefixCache, common_prefix_len


def kv_for(tokens: list[int]):
    """Fake per-layer KV whose values encode the token ids, so slices can be checked."""
    t = torch.tensor(tokens, dtype=torch.float32).view(1, -1, 1)
    return [(t.clone(), -t.clone())]


def test_lookup_returns_longest_common_prefix_slice():
    cache = PrefixCache(max_tokens=100)
    cache.insert([1, 2, 3, 4, 5], kv_for([1, 2, 3, 4, 5]))
    cache.insert([1, 2, 9], kv_for([1, 2, 9]))
    n, kv = cache.lookup([1, 2, 3, 4, 7, 8], max_len=5)
    assert n == 4 and kv[0][0].flatten().tolist() == [1, 2, 3, 4]
    assert cache.lookup([1, 2, 3, 4, 5, 6], max_len=3)[0] == 3  # capped (the last prompt token is recomputed)
    assert cache.lookup([7, 1, 2], max_len=2) == (0, None)


def test_an_extending_entry_replaces_its_prefix():
    cache = PrefixCache(max_tokens=100)
    cache.insert([1, 2, 3], kv_for([1, 2, 3]))
    cache.insert([1, 2, 3, 4, 5], kv_for([1, 2, 3, 4, 5]))
    assert len(cache) == 1 and cache.num_tokens == 5


def test_lru_eviction_bounds_tokens():
    cache = PrefixCache(max_tokens=10)
    cache.insert([1, 1, 1, 1], kv_for([1, 1, 1, 1]))
    cache.insert([2, 2, 2, 2], kv_for([2, 2, 2, 2]))
    cache.lookup([1, 1, 1, 1, 9], max_len=4)  # touch entry 1: entry 2 is now least recent
    cache.insert([3, 3, 3, 3], kv_for([3, 3, 3, 3]))
    assert cache.num_tokens <= 10
    assert cache.lookup([2, 2, 2, 2, 9], max_len=4)[0] == 0
    assert cache.lookup([1, 1, 1, 1, 9], max_len=4)[0] == 4
    cache.insert(list(range(11)), kv_for(list(range(11))))  # larger than the whole budget: not cached
    assert cache.num_tokens <= 10
    cache.clear()
    assert len(cache) == 0 and cache.num_tokens == 0


@settings(max_examples=100, deadline=None)
@given(st.lists(st.integers(0, 3), max_size=30), st.lists(st.integers(0, 3), max_size=30))
def test_common_prefix_len_property(a, b):
    n = common_prefix_len(a, b)
    assert a[:n] == b[:n]
    assert n == min(len(a), len(b)) or a[n] != b[n]


def test_cached_tokens_grow_over_a_multi_turn_session(client):
    client.post("/flush_cache")
    prompt = [1, 40, 41, 42, 43, 44, 45]
    cached = []
    for turn in range(4):
        out = client.post("/generate", json={"input_ids": prompt, "sampling_params": {"max_new_tokens": 6}}).json()
        cached.append(out["meta_info"]["cached_tokens"])
        prompt = prompt + out["output_ids"] + [2, 1, 60 + turn, 61, 62]
    assert cached[0] == 0
    assert all(b > a for a, b in zip(cached, cached[1:], strict=False)), cached
    # flush_cache drops the KV: the same prompt is computed from scratch
    assert client.post("/flush_cache").status_code == 200
    out = client.post("/generate", json={"input_ids": prompt, "sampling_params": {"max_new_tokens": 1}}).json()
    assert out["meta_info"]["cached_tokens"] == 0
