"""The transformers model and its two forward passes: prefill of one sequence and a batched decode step.

KV layout: a running batch keeps, per layer, keys/values ``[B, kv_heads, T, head_dim]`` with each row's
real tokens in its last ``length`` columns (left padding). Every row gets exactly one token per decode
step, so padding stays on the left; positions are passed explicitly, so padding never shifts RoPE.
"""

from __future__ import annotations

import functools
import inspect
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

    from agentrl.engine.prefix_cache import KV


@dataclass
class BatchKV:
    """Left-padded KV of the running batch (see module docstring), held in a transformers cache object
    that decode steps grow in place; it is rebuilt only when rows join or leave."""

    cache: Any  # transformers DynamicCache, or None when the batch is empty
    lengths: list[int]

    @classmethod
    def empty(cls) -> BatchKV:
        return cls(None, [])

    @property
    def layers(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        return [] if self.cache is None else [(la.keys, la.values) for la in self.cache.layers]

    @property
    def width(self) -> int:
        return self.cache.layers[0].keys.shape[2] if self.cache is not None else 0

    def row(self, i: int) -> KV:
        """Row ``i``'s real KV, as an independent copy ``[(k, v)]`` with ``[kv_heads, L, head_dim]``."""
        n, t = self.lengths[i], self.width
        return [(k[i, :, t - n :].clone(), v[i, :, t - n :].clone()) for k, v in self.layers]

    def select(self, rows: list[int]) -> BatchKV:
        """Keep ``rows`` (in that order) and trim columns that are now padding in every row."""
        import torch

        if not rows:
            return BatchKV.empty()
        lengths = [self.lengths[i] for i in rows]
        start = self.width - max(lengths)
        idx = torch.tensor(rows, device=self.layers[0][0].device)
        layers = [(k.index_select(0, idx)[:, :, start:], v.index_select(0, idx)[:, :, start:]) for k, v in self.layers]
        return BatchKV(_make_cache(layers), lengths)

    def extend(self, kvs: list[KV]) -> BatchKV:
        """Add sequences' KV as new last rows, left-padding everything to the widest."""
        import torch

        if not kvs:
            return self
        lengths = [*self.lengths, *(kv[0][0].shape[1] for kv in kvs)]
        width = max(lengths)
        old = self.layers
        layers = []
        for li in range(len(kvs[0])):
            parts_k = [_pad_left(old[li][0], width)] if old else []
            parts_v = [_pad_left(old[li][1], width)] if old else []
            parts_k += [_pad_left(kv[li][0].unsqueeze(0), width) for kv in kvs]
            parts_v += [_pad_left(kv[li][1].unsqueeze(0), width) for kv in kvs]
            layers.append((torch.cat(parts_k, dim=0), torch.cat(parts_v, dim=0)))
        return BatchKV(_make_cache(layers), lengths)


def _make_cache(layers: list[tuple[torch.Tensor, torch.Tensor]]):
    """A transformers DynamicCache over ``layers`` whose layers append into spare capacity."""
    from transformers import DynamicCache

    cache = DynamicCache()
    if layers:
        cache.layers = [_growing_layer(k, v) for k, v in layers]
    return cache


def _growing_layer(keys: torch.Tensor, values: torch.Tensor, spare: int = 64):
    return _growing_layer_class()(keys, values, spare)


@functools.cache
def _growing_layer_class():
    """A ``DynamicLayer`` that writes new tokens into spare capacity (doubling when full) instead of
    re-allocating the whole KV with ``torch.cat`` on every decode step (built lazily: transformers is
    imported only when a model runs)."""
    from transformers.cache_utils import DynamicLayer

    class GrowingLayer(DynamicLayer):
        def __init__(self, keys, values, spare: int) -> None:
            super().__init__()
            b, h, t, d = keys.shape
            self._k = keys.new_empty((b, h, t + spare, d))
            self._v = values.new_empty((b, h, t + spare, d))
            self._k[:, :, :t] = keys
            self._v[:, :, :t] = values
            self._len = t
            self.keys, self.values = self._k[:, :, :t], self._v[:, :, :t]
            self.dtype, self.device = keys.dtype, keys.device
            self.is_initialized = True

        def update(self, key_states, value_states, *args, **kwargs):
            end = self._len + key_states.shape[-2]
            if end > self._k.shape[2]:
                cap = max(end, 2 * self._k.shape[2])
                k, v = self._k, self._v
                self._k = k.new_empty((*k.shape[:2], cap, k.shape[3]))
                self._v = v.new_empty((*v.shape[:2], cap, v.shape[3]))
                self._k[:, :, : self._len] = k[:, :, : self._len]
                self._v[:, :, : self._len] = v[:, :, : self._len]
            self._k[:, :, self._len : end] = key_states
            self._v[:, :, self._len : end] = value_states
            self._len = end
            self.keys, self.values = self._k[:, :, :end], self._v[:, :, :end]
            return self.keys, self.values

    return GrowingLayer


def _pad_left(t: torch.Tensor, width: int) -> torch.Tensor:
    import torch

    missing = width - t.shape[2]
    if missing == 0:
        return t
    pad = torch.zeros((t.shape[0], t.shape[1], missing, t.shape[3]), dtype=t.dtype, device=t.device)
    return torch.cat([pad, t], dim=2)


def resolve_dtype(name: str):
    import torch

    table = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
    if name not in table:
        raise ValueError(f"unsupported dtype {name!r}; choose one of {sorted(table)}")
    return table[name]


class ModelRunner:
    """Loads a causal LM + tokenizer from a local directory and runs its forward passes."""

    def __init__(
        self, model_path: str, *, dtype: str = "float32", device: str | None = None, memory_saver: bool = False
    ) -> None:
        import contextlib

        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        self.dtype = resolve_dtype(dtype)
        self.tokenizer = AutoTokenizer.from_pretrained(model_path)
        region = contextlib.nullcontext()
        if memory_saver and self.device.type == "cuda":
            # weights allocated inside the region can be paused/resumed by tag (see memory.py)
            with contextlib.suppress(ImportError):
                from torch_memory_saver import torch_memory_saver  # type: ignore[import-not-found]

                region = torch_memory_saver.region(tag="weights", enable_cpu_backup=True)
        with region:
            self.model = AutoModelForCausalLM.from_pretrained(
                model_path, dtype=self.dtype, attn_implementation="sdpa"
            ).to(self.device)
        self.model.eval()
        config = self.model.config
        self.context_length: int = int(getattr(config, "max_position_embeddings", 2048))
        self.vocab_size: int = int(self.model.get_input_embeddings().weight.shape[0])
        self.eos_token_ids: set[int] = _eos_ids(self.model, self.tokenizer)
        # transformers >= 5.2x renamed ``past_key_values`` to ``cache``; accept both
        self._cache_arg = "cache" if "cache" in inspect.signature(self.model.forward).parameters else "past_key_values"

    # ---- forward passes -------------------------------------------------------------------------
    def prefill(self, items: list[tuple[list[int], KV | None]]) -> tuple[torch.Tensor, list[KV]]:
        """Run several sequences at once, each ``(tokens, past)`` computing ``tokens[len(past):]`` on top
        of its cached prefix; return last-position logits [B, V] and each sequence's full KV.

        Rows are left-padded twice (before the past and before the new tokens) and a 4D mask lets each
        real token see exactly its own earlier tokens; a padding query sees only itself, which keeps its
        (discarded) activations finite.
        """
        import torch

        pasts = [past[0][0].shape[1] if past else 0 for _, past in items]
        news = [len(tokens) - p for (tokens, _), p in zip(items, pasts, strict=True)]
        B, P, N = len(items), max(pasts), max(news)
        dev = self.device
        ids = torch.zeros((B, N), dtype=torch.long, device=dev)
        positions = torch.zeros((B, N), dtype=torch.long, device=dev)
        for b, ((tokens, _), p, n) in enumerate(zip(items, pasts, news, strict=True)):
            ids[b, N - n :] = torch.tensor(tokens[p:], device=dev)
            positions[b, N - n :] = torch.arange(p, p + n, device=dev)
        past_t = torch.tensor(pasts, device=dev).unsqueeze(1)
        new_t = torch.tensor(news, device=dev).unsqueeze(1)
        cols = torch.arange(P + N, device=dev).unsqueeze(0)
        real_key = ((cols < P) & (cols >= P - past_t)) | ((cols >= P) & (cols >= P + N - new_t))  # [B, P+N]
        q_cols = P + torch.arange(N, device=dev)  # column index of each query
        causal = cols.unsqueeze(1) <= q_cols.view(1, N, 1)  # [1, N, P+N]
        allowed = (real_key.unsqueeze(1) & causal) | (cols.unsqueeze(1) == q_cols.view(1, N, 1))
        mask = torch.zeros(allowed.shape, dtype=self.dtype, device=dev).masked_fill(~allowed, torch.finfo(self.dtype).min)
        layers = []
        if P:
            n_layers = len(next(past for _, past in items if past))
            for li in range(n_layers):
                ks = [_pad_left(past[li][0].unsqueeze(0), P) if past else None for _, past in items]
                vs = [_pad_left(past[li][1].unsqueeze(0), P) if past else None for _, past in items]
                ref_k = next(k for k in ks if k is not None)
                ks = [k if k is not None else ref_k.new_zeros(ref_k.shape) for k in ks]
                vs = [v if v is not None else ref_k.new_zeros(ref_k.shape) for v in vs]
                layers.append((torch.cat(ks, dim=0), torch.cat(vs, dim=0)))
        cache = _make_cache(layers)
        with torch.inference_mode():
            out = self.model(
                input_ids=ids,
                attention_mask=mask.unsqueeze(1),
                position_ids=positions,
                use_cache=True,
                logits_to_keep=1,
                **{self._cache_arg: cache},
            )
        kvs: list[KV] = []
        full = [(la.keys, la.values) for la in cache.layers]
        for b, (p, n) in enumerate(zip(pasts, news, strict=True)):
            kvs.append([
                (torch.cat([k[b, :, P - p : P], k[b, :, P + N - n :]], dim=1),
                 torch.cat([v[b, :, P - p : P], v[b, :, P + N - n :]], dim=1))
                for k, v in full
            ])
        return out.logits[:, -1], kvs

    def decode(self, batch: BatchKV, tokens: list[int]) -> tuple[torch.Tensor, BatchKV]:
        """Feed one token per row; return logits [B, V] and the batch KV (grown in place)."""
        import torch

        width = batch.width
        lengths = torch.tensor(batch.lengths, device=self.device)
        cols = torch.arange(width + 1, device=self.device)
        # row i's real tokens (and the new one) are its last lengths[i] + 1 columns
        mask = (cols.unsqueeze(0) >= (width - lengths).unsqueeze(1)).long()
        ids = torch.tensor(tokens, device=self.device).unsqueeze(1)
        with torch.inference_mode():
            out = self.model(
                input_ids=ids,
                attention_mask=mask,
                position_ids=lengths.unsqueeze(1),
                use_cache=True,
                **{self._cache_arg: batch.cache},
            )
        return out.logits[:, -1], BatchKV(batch.cache, [n + 1 for n in batch.lengths])

    # ---- weights ------------------------------------------------------------------------------
    def named_tensors(self) -> dict[str, torch.Tensor]:
        """Every loadable tensor by HF name (``state_dict`` keys: tied weights appear under both names)."""
        return dict(self.model.state_dict())

    def named_parameters(self) -> list[tuple[str, torch.Tensor]]:
        """Parameters in HF ``named_parameters`` order (tied weights once)."""
        return [(n, p.detach()) for n, p in self.model.named_parameters()]


def _eos_ids(model, tokenizer) -> set[int]:
    ids: set[int] = set()
    gen = getattr(model, "generation_config", None)
    for source in (getattr(gen, "eos_token_id", None), getattr(model.config, "eos_token_id", None), tokenizer.eos_token_id):
        if isinstance(source, int):
            ids.add(source)
        elif isinstance(source, list | tuple):
            ids.update(int(i) for i in source)
    return ids
