"""LRU cache of per-sequence KV tensors keyed by their token ids, bounded by the total token count.

The KV of position ``i`` depends only on tokens ``0..i``, so any common prefix of a cached sequence and a
new prompt can be reused by slicing. Multi-turn sessions hit it: turn ``t+1``'s prompt extends turn
``t``'s prompt + output. An entry superseded by a longer one with the same prefix is dropped.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

# per layer: (keys, values), each [kv_heads, seq_len, head_dim]
KV = list[tuple["torch.Tensor", "torch.Tensor"]]


@dataclass
class _Entry:
    tokens: tuple[int, ...]
    kv: KV


def common_prefix_len(a: tuple[int, ...] | list[int], b: tuple[int, ...] | list[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    # compare in chunks first: long shared prefixes are the common case
    step = 64
    while i + step <= n and a[i : i + step] == b[i : i + step]:
        i += step
    while i < n and a[i] == b[i]:
        i += 1
    return i


class PrefixCache:
    """Thread-safe LRU of KV tensors; ``max_tokens`` bounds the sum of cached sequence lengths."""

    def __init__(self, max_tokens: int) -> None:
        self.max_tokens = max_tokens
        self._entries: OrderedDict[tuple[int, ...], _Entry] = OrderedDict()
        # the entries by first token: only those can share a prefix with a sequence (a lookup or insert then
        # scans them alone; unrelated prompts cost nothing)
        self._by_first: dict[int, dict[tuple[int, ...], _Entry]] = {}
        self._tokens = 0
        self._lock = threading.Lock()

    @property
    def num_tokens(self) -> int:
        return self._tokens

    def __len__(self) -> int:
        return len(self._entries)

    def lookup(self, tokens: list[int], max_len: int) -> tuple[int, KV | None]:
        """Longest reusable prefix (at most ``max_len`` tokens) of ``tokens``: (length, sliced KV)."""
        if max_len <= 0:
            return 0, None
        key = tuple(tokens)
        best_len, best = 0, None
        with self._lock:
            for entry in self._by_first.get(key[0], {}).values():
                n = min(common_prefix_len(entry.tokens, key), max_len)
                if n > best_len:
                    best_len, best = n, entry
            if best is None:
                return 0, None
            self._entries.move_to_end(best.tokens)
            kv = [(k[:, :best_len], v[:, :best_len]) for k, v in best.kv]
        return best_len, kv

    def insert(self, tokens: list[int], kv: KV) -> None:
        """Cache ``kv`` (its first ``len(tokens)`` columns are ``tokens``'; lookups never read further);
        evict least recently used entries to fit."""
        n = len(tokens)
        if n == 0 or n > self.max_tokens:
            return
        key = tuple(tokens)
        with self._lock:
            # drop entries that this one extends (their KV is a slice of ours)
            same_first = self._by_first.get(key[0], {})
            # (the last-token test first: entries that share a system prompt rarely end where this one has the same)
            for old in [e for e in same_first.values() if len(e.tokens) <= n and key[len(e.tokens) - 1] == e.tokens[-1]
                        and key[: len(e.tokens)] == e.tokens]:
                self._remove(old.tokens)
            self._entries[key] = self._by_first.setdefault(key[0], {})[key] = _Entry(key, kv)
            self._tokens += n
            while self._tokens > self.max_tokens:
                self._remove(next(iter(self._entries)))

    def _remove(self, key: tuple[int, ...]) -> None:
        entry = self._entries.pop(key)
        same_first = self._by_first[key[0]]
        del same_first[key]
        if not same_first:
            del self._by_first[key[0]]
        self._tokens -= len(entry.tokens)

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()
            self._by_first.clear()
            self._tokens = 0
