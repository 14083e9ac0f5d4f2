"""The transformers model and its two forward passes: prefill of one sequence and a batched decode step.

KV layout: a running batch keeps, per layer, keys/values ``[B, kv_heads, T, head_dim]`` with each row's
real tokens in its last ``length`` columns (left padding). Every row gets exactly one token per decode
step, so padding stays on the left; positions are passed explicitly, so padding never shifts RoPE.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

    from agentrl.engine.prefix_cache import KV


@dataclass
class BatchKV:
    """Left-padded KV of the running batch (see module docstring)."""

    keys: list[torch.Tensor]
    values: list[torch.Tensor]
    lengths: list[int]

    @property
    def width(self) -> int:
        return self.keys[0].shape[2] if self.keys else 0

    def row(self, i: int) -> KV:
        """Row ``i``'s real KV, as an independent copy ``[(k, v)]`` with ``[kv_heads, L, head_dim]``."""
        n, t = self.lengths[i], self.width
        return [(k[i, :, t - n :].clone(), v[i, :, t - n :].clone()) for k, v in zip(self.keys, self.values, strict=False)]

    def select(self, rows: list[int]) -> BatchKV:
        """Keep ``rows`` (in that order) and trim columns that are now padding in every row."""
        import torch

        if not rows:
            return BatchKV([], [], [])
        lengths = [self.lengths[i] for i in rows]
        start = self.width - max(lengths)
        idx = torch.tensor(rows, device=self.keys[0].device)
        keys = [k.index_select(0, idx)[:, :, start:] for k in self.keys]
        values = [v.index_select(0, idx)[:, :, start:] for v in self.values]
        return BatchKV(keys, values, lengths)

    def append_row(self, kv: KV) -> BatchKV:
        """Add one sequence's KV as a new last row, left-padding whichever side is shorter."""
        import torch

        n = kv[0][0].shape[1]
        if not self.lengths:
            return BatchKV([k.unsqueeze(0) for k, _ in kv], [v.unsqueeze(0) for _, v in kv], [n])
        width = max(self.width, n)
        keys, values = [], []
        for (old_k, old_v), (k, v) in zip(zip(self.keys, self.values, strict=False), kv, strict=False):
            keys.append(torch.cat([_pad_left(old_k, width), _pad_left(k.unsqueeze(0), width)], dim=0))
            values.append(torch.cat([_pad_left(old_v, width), _pad_left(v.unsqueeze(0), width)], dim=0))
        return BatchKV(keys, values, [*self.lengths, n])


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

    def __init__(self, model_path: str, *, dtype: str = "float32", device: str | None = None) -> None:
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        self.dtype = resolve_dtype(dtype)
        self.tokenizer = AutoTokenizer.from_pretrained(model_path)
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
    def prefill(self, tokens: list[int], past: KV | None) -> tuple[torch.Tensor, KV]:
        """Run ``tokens[len(past):]`` on top of ``past``; return last-position logits [V] and the full KV."""
        import torch
        from transformers import DynamicCache

        start = past[0][0].shape[1] if past else 0
        cache = DynamicCache(ddp_cache_data=[(k.unsqueeze(0), v.unsqueeze(0)) for k, v in past]) if past else DynamicCache()
        ids = torch.tensor([tokens[start:]], device=self.device)
        positions = torch.arange(start, len(tokens), device=self.device).unsqueeze(0)
        with torch.inference_mode():
            out = self.model(input_ids=ids, position_ids=positions, use_cache=True, **{self._cache_arg: cache})
        kv = [(layer.keys[0], layer.values[0]) for layer in cache.layers]
        return out.logits[0, -1], kv

    def decode(self, batch: BatchKV, tokens: list[int]) -> tuple[torch.Tensor, BatchKV]:
        """Feed one token per row; return logits [B, V] and the grown batch KV."""
        import torch
        from transformers import DynamicCache

        width = batch.width
        lengths = torch.tensor(batch.lengths, device=self.device)
        cols = torch.arange(width + 1, device=self.device)
        # row i's real tokens (and the new one) are its last lengths[i] + 1 columns
        mask = (cols.unsqueeze(0) >= (width - lengths).unsqueeze(1)).long()
        cache = DynamicCache(ddp_cache_data=list(zip(batch.keys, batch.values, strict=False)))
        ids = torch.tensor(tokens, device=self.device).unsqueeze(1)
        with torch.inference_mode():
            out = self.model(
                input_ids=ids,
                attention_mask=mask,
                position_ids=lengths.unsqueeze(1),
                use_cache=True,
                **{self._cache_arg: cache},
            )
        layers = cache.layers
        grown = BatchKV([la.keys for la in layers], [la.values for la in layers], [n + 1 for n in batch.lengths])
        return out.logits[:, -1], grown

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
