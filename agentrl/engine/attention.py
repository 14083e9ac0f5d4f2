"""The engine's attention: transformers' SDPA, except one-token decode steps of grouped-query models.

transformers' SDPA path (5.17 on the H200 image) copies every KV head to all the query heads it serves
(``repeat_kv``) in every layer of every decode step when a mask is given, which the engine's decode always
gives: for Qwen2-0.5B (14 query heads over 2 KV heads) over 1024 static KV columns that is ~11 GB of
copies per step at 128 rows. A decode step has one query per row, so the ``n_rep`` query heads that
share a KV head can instead be that KV head's ``n_rep`` query *positions*: ``[B, H, 1, D]`` becomes
``[B, H_kv, n_rep, D]`` over the unexpanded ``[B, H_kv, T, D]`` keys and values, with the row's mask
(``[B, 1, 1, T]``, shared by every head) broadcast over them. Same scores, same softmax, no copy, and an
ordinary masked SDPA call that the fused kernels (and CUDA graphs) take. Prefill and models without
grouped heads go to transformers' own SDPA unchanged.
"""

from __future__ import annotations

import contextlib
import functools
import threading
from typing import Any

NAME = "agentrl_sdpa"
# SDPA backends for the one-token decode call (``torch.nn.attention.SDPBackend`` members), None: torch's choice
DECODE_BACKENDS: list | None = None
# CUDA decode steps through decode_attention.py's Triton kernel (set by a runner whose check of it passed)
TRITON_DECODE = False
_local = threading.local()


@contextlib.contextmanager
def decode_limit(column):
    """Inside: one-token decode attention (Triton) reads no column after ``column`` (a one-element device
    tensor: the static batch's write column, which every row's mask ends at)."""
    before = getattr(_local, "column", None)
    _local.column = column
    try:
        yield
    finally:
        _local.column = before


def decode_sdpa_attention_forward(module, query, key, value, attention_mask, dropout: float = 0.0,
                                  scaling: float | None = None, **kwargs: Any):
    """transformers' attention-function signature (``query`` ``[B, H, Q, D]``, ``key``/``value``
    ``[B, H_kv, T, D]``); returns ``([B, Q, H, D], None)``."""
    import torch
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    groups = int(getattr(module, "num_key_value_groups", 1) or 1)
    batch, heads, q_len, dim = query.shape
    mask_shared = attention_mask is None or (attention_mask.dim() == 4 and attention_mask.shape[1] == 1)
    if (q_len != 1 or groups == 1 or not mask_shared or key.shape[1] * groups != heads
            or kwargs.get("position_bias") is not None or kwargs.get("softcap") is not None or kwargs.get("s_aux") is not None):
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)
    # query head h serves KV head h // groups (repeat_kv's order), so a plain reshape groups them
    packed = query.reshape(batch, heads // groups, groups, dim)
    if TRITON_DECODE and query.is_cuda and not (dropout and module.training):
        from agentrl.engine import decode_attention as da

        mask2d = None
        if attention_mask is not None and attention_mask.shape[0] == batch:
            mask2d = attention_mask[:, 0, 0, :]
        if (attention_mask is None or mask2d is not None) and da.supported(packed, key, value, mask2d):
            out = da.decode_attention(packed, key, value, mask2d, scaling, getattr(_local, "column", None))
            return out.reshape(batch, heads, 1, dim).transpose(1, 2), None
    if DECODE_BACKENDS is None:
        backends = contextlib.nullcontext()
    else:
        from torch.nn.attention import sdpa_kernel

        backends = sdpa_kernel(DECODE_BACKENDS)
    with backends:
        out = torch.nn.functional.scaled_dot_product_attention(
            packed, key, value, attn_mask=attention_mask, dropout_p=dropout if module.training else 0.0,
            scale=scaling, is_causal=False)
    return out.reshape(batch, heads, 1, dim).transpose(1, 2), None


@functools.cache
def register() -> str:
    """Register :data:`NAME` with transformers (attention and SDPA's mask builder); returns the name."""
    from transformers import AttentionInterface, AttentionMaskInterface
    from transformers.masking_utils import sdpa_mask

    AttentionInterface.register(NAME, decode_sdpa_attention_forward)
    AttentionMaskInterface.register(NAME, sdpa_mask)
    return NAME
