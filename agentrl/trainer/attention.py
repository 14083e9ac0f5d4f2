"""Core attention over ``torch.nn.functional.scaled_dot_product_attention`` for the local layer spec.

Megatron's local ``DotProductAttention`` materialises the ``[b, heads, s, s]`` score matrix (O(S²)
memory: a 0.63B model at 4k x 4 tokens ran out of 139 GiB on one H200). SDPA dispatches to a
flash / memory-efficient kernel instead. Masking is causal only: batches are right-padded, so padded
positions sit after every real token and never influence a real token's output.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from megatron.core.transformer.dot_product_attention import DotProductAttention


class SDPACoreAttention(DotProductAttention):
    """Drop-in ``core_attention`` for ``get_gpt_layer_local_spec`` (same constructor, same I/O layout)."""

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: torch.Tensor | None,
        attn_mask_type=None,
        attention_bias=None,
        packed_seq_params=None,
    ) -> torch.Tensor:
        if packed_seq_params is not None or attention_bias is not None:
            raise NotImplementedError("SDPACoreAttention supports neither packed sequences nor attention bias")
        # Megatron layout [s, b, heads, d] -> SDPA layout [b, heads, s, d].
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))
        groups = self.num_attention_heads_per_partition // self.num_query_groups_per_partition
        if groups > 1:
            k = k.repeat_interleave(groups, dim=1)
            v = v.repeat_interleave(groups, dim=1)
        dropout = self.attention_dropout.p if self.training else 0.0
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=dropout, scale=self.softmax_scale)
        # [b, heads, s, d] -> [s, b, heads * d]
        return out.permute(2, 0, 1, 3).reshape(out.shape[2], out.shape[0], self.hidden_size_per_partition)
