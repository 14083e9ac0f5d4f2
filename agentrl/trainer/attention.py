"""Core attention over ``torch.nn.functional.scaled_dot_product_attention`` for the local layer spec.

Megatron's local ``DotProductAttention`` materialises the ``[b, heads, s, s]`` score matrix (O(S²)
memory: a 0.63B model at 4k x 4 tokens ran out of 139 GiB on one H200). SDPA dispatches to a
flash / memory-efficient kernel instead.

Two layouts. Padded ``[s, b, heads, d]``: causal masking suffices, since batches are right-padded and
padded positions sit after every real token. Packed (Megatron's ``thd``, ``[t, heads, d]`` with
:class:`PackedSegments`): the sequences are scattered into a ``[b, heads, longest, d]`` block for one
causal SDPA call and gathered back, so attention stays within each sequence while every linear layer,
norm and the LM head run on real tokens only.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.transformer.dot_product_attention import DotProductAttention


@dataclass
class PackedSegments(PackedSeqParams):
    """Megatron's ``PackedSeqParams`` (``thd``; read by RoPE and TransformerEngine) plus where each packed
    position sits in a ``[rows, width]`` block, for :class:`SDPACoreAttention`."""

    flat_index: torch.Tensor | None = None  # [t] long: row * width + column of each packed position
    rows: int = 0
    width: int = 0


def packed_seq_params(layout: Any, host_cu_seqlens: bool = False) -> PackedSegments:
    """:class:`PackedSegments` for a :class:`~agentrl.trainer.batch.PackedLayout`. ``host_cu_seqlens``: pass
    the host copy of the sequence boundaries, where only RoPE reads them (SDPA attends through
    ``flat_index``): Megatron's thd RoPE takes the lengths with ``.tolist()`` for q and k in every layer,
    which on device tensors was a device sync each time (56 per micro-batch at 28 layers: the forward
    ran in lock-step with the host). TransformerEngine's attention needs them on the device."""
    cu = layout.cu_seqlens_host if host_cu_seqlens and layout.cu_seqlens_host is not None else layout.cu_seqlens
    return PackedSegments(
        qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu,
        max_seqlen_q=layout.max_seqlen, max_seqlen_kv=layout.max_seqlen,
        flat_index=layout.flat_index, rows=layout.rows, width=layout.width,
    )


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
        if attention_bias is not None:
            raise NotImplementedError("SDPACoreAttention does not support attention bias")
        if packed_seq_params is not None:
            if not isinstance(packed_seq_params, PackedSegments) or packed_seq_params.flat_index is None:
                raise NotImplementedError("SDPACoreAttention packs only through agentrl's PackedSegments")
            return self._packed(query, key, value, packed_seq_params)
        # Megatron layout [s, b, heads, d] -> SDPA layout [b, heads, s, d].
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))
        out = self._sdpa(q, k, v)
        # [b, heads, s, d] -> [s, b, heads * d]
        return out.permute(2, 0, 1, 3).reshape(out.shape[2], out.shape[0], self.hidden_size_per_partition)

    def _sdpa(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        groups = self.num_attention_heads_per_partition // self.num_query_groups_per_partition
        if groups > 1:
            k = k.repeat_interleave(groups, dim=1)
            v = v.repeat_interleave(groups, dim=1)
        dropout = self.attention_dropout.p if self.training else 0.0
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=dropout, scale=self.softmax_scale)

    def _packed(self, query, key, value, p: PackedSegments) -> torch.Tensor:
        """``[t, heads, d]`` in, ``[t, heads * d]`` out; attention causal within each sequence."""
        t = query.shape[0]
        if p.rows == 1:  # one sequence: the packed row is already its own block
            out = self._sdpa(*(x.transpose(0, 1)[None] for x in (query, key, value)))
            return out[0].transpose(0, 1).reshape(t, self.hidden_size_per_partition)

        def block(x: torch.Tensor) -> torch.Tensor:  # [t, h, d] -> [rows, h, width, d], zeros after each end
            out = x.new_zeros(p.rows * p.width, *x.shape[1:]).index_copy(0, p.flat_index, x)
            return out.view(p.rows, p.width, *x.shape[1:]).transpose(1, 2)

        out = self._sdpa(block(query), block(key), block(value))  # [rows, h, width, d]
        out = out.transpose(1, 2).reshape(p.rows * p.width, self.hidden_size_per_partition)
        return out.index_select(0, p.flat_index)
