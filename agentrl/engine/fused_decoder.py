"""The engine's own forward for Llama-family decoders (Qwen2, Llama) on CUDA: the captured decode step and the
prefill of new sequences, in ~10 kernels per layer instead of transformers' ~20.

Per layer: residual add + RMSNorm (one Triton kernel), one GEMM for q/k/v, rotary embedding + KV write +
attention (decode: one ``decode_attention`` kernel over each row's own span, split when rows are few; prefill:
``rope_scatter`` then flash attention over the packed sequences, causal), the output GEMM, add + norm, one GEMM
for gate/up, SiLU gate, the down GEMM (``decoder_kernels.py``). A decode step at 128 rows of a 0.5B model is kernel-bound (each kernel
1-5 us, ~20 per layer before); see ``benchmarks/results/gpu_engine_2026-12-03/NOTES.md``.

One GEMM for q/k/v and one for gate/up need each layer's weights side by side: :func:`join_projections` moves
them into one buffer per layer and makes the model's own ``q_proj.weight`` (etc.) views into it, so every
weight update that writes the model's tensors in place (disk, tensor, CUDA IPC, broadcast, delta: all go
through ``named_tensors()``) writes the joined weights too, and transformers' modules (the prefill of rows with
a cached prefix) keep working on the same memory. Releasing memory by swapping ``.data`` breaks the views;
``ModelRunner.weights_moved`` joins them again on resume.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

logger = logging.getLogger(__name__)
MODEL_TYPES = ("qwen2", "llama")
_GROUPS = (("self_attn", ("q_proj", "k_proj", "v_proj")), ("mlp", ("gate_proj", "up_proj")))


def _joined(tensors: list[torch.Tensor]) -> torch.Tensor | None:
    """The one tensor that ``tensors`` (same trailing shape, contiguous) are consecutive slices of, as a view
    over their common memory; None unless they lie exactly so."""
    first = tensors[0]
    end = first.data_ptr()
    for t in tensors:
        if (not t.is_contiguous() or t.dtype != first.dtype or t.shape[1:] != first.shape[1:]
                or t.data_ptr() != end or t.untyped_storage().data_ptr() != first.untyped_storage().data_ptr()):
            return None
        end += t.numel() * t.element_size()
    rows = sum(t.shape[0] for t in tensors)
    return first.as_strided((rows, *first.shape[1:]), first.stride())


def join_projections(model) -> int:
    """Put each decoder layer's q/k/v weights (and biases), and its gate/up weights, side by side in one buffer
    (see module docstring); layers already joined are left alone. Returns how many groups were (re)joined."""
    import torch

    count = 0
    with torch.no_grad():
        for layer in model.model.layers:
            for owner_name, names in _GROUPS:
                owner = getattr(layer, owner_name)
                linears = [getattr(owner, n) for n in names]
                for attr in ("weight", "bias"):
                    params = [getattr(lin, attr) for lin in linears]
                    if all(p is None for p in params):
                        continue
                    if _joined([p.data for p in params]) is not None:
                        continue
                    buffer = torch.cat([p.data for p in params], dim=0)
                    offset = 0
                    for p in params:
                        n = p.shape[0]
                        p.data = buffer[offset : offset + n]
                        offset += n
                    count += 1
    return count


@dataclass
class LayerWeights:
    """One decoder layer's tensors as the fused forward uses them (views; built per forward, never kept)."""

    input_norm: torch.Tensor
    post_norm: torch.Tensor
    qkv: torch.Tensor
    qkv_bias: torch.Tensor | None
    o: torch.Tensor
    o_bias: torch.Tensor | None
    gate_up: torch.Tensor
    gate_up_bias: torch.Tensor | None
    down: torch.Tensor
    down_bias: torch.Tensor | None


def unsupported_reason(model) -> str | None:
    """Why :class:`FusedDecoder` cannot run ``model`` (None: it can)."""
    from agentrl.engine.fused_ops import _is_rms_norm, _is_silu_mlp

    config = model.config
    if getattr(config, "model_type", None) not in MODEL_TYPES:
        return f"model type {getattr(config, 'model_type', None)!r} (supported: {', '.join(MODEL_TYPES)})"
    inner = getattr(model, "model", None)
    if inner is None or not all(hasattr(inner, n) for n in ("embed_tokens", "layers", "norm", "rotary_emb")):
        return "not a decoder with embed_tokens / layers / norm / rotary_emb"
    if not hasattr(model, "lm_head") or not _is_rms_norm(inner.norm):
        return "no lm_head or no RMSNorm at the end"
    rope_type = getattr(inner.rotary_emb, "rope_type", "default")
    if "dynamic" in rope_type or "longrope" in rope_type:
        return f"rope type {rope_type!r} changes with the length"
    if getattr(config, "use_sliding_window", False) or any(t != "full_attention" for t in getattr(config, "layer_types", None) or []):
        return "sliding-window attention"
    for layer in inner.layers:
        attn = layer.self_attn
        if not all(hasattr(attn, n) for n in ("q_proj", "k_proj", "v_proj", "o_proj", "scaling")):
            return "attention without q/k/v/o projections"
        if getattr(attn, "q_norm", None) is not None or getattr(attn, "k_norm", None) is not None:
            return "q/k norms"
        if (attn.q_proj.bias is None) != (attn.k_proj.bias is None) or (attn.q_proj.bias is None) != (attn.v_proj.bias is None):
            return "q/k/v projections with and without bias"
        if not (_is_rms_norm(layer.input_layernorm) and _is_rms_norm(layer.post_attention_layernorm)
                and _is_silu_mlp(layer.mlp)):
            return "a layer that is not RMSNorm / attention / RMSNorm / SiLU-gated MLP"
        if (layer.mlp.gate_proj.bias is None) != (layer.mlp.up_proj.bias is None):
            return "gate/up projections with and without bias"
    return None


class FusedDecoder:
    """Decode step and prefill of ``model`` (see module docstring). ``context`` positions get rotary tables."""

    def __init__(self, model, context: int) -> None:
        import torch

        self.model = model
        config = model.config
        self.heads = int(config.num_attention_heads)
        self.kv_heads = int(getattr(config, "num_key_value_heads", None) or self.heads)
        first = model.model.layers[0].self_attn
        self.dim = int(getattr(first, "head_dim", None) or config.hidden_size // self.heads)
        self.scale = float(first.scaling)
        self.eps = float(model.model.norm.variance_epsilon)
        weight = model.model.embed_tokens.weight
        self.device, self.dtype = weight.device, weight.dtype
        with torch.inference_mode():  # transformers' own rotary module, once for every position
            positions = torch.arange(context, device=self.device).unsqueeze(0)
            cos, sin = model.model.rotary_emb(weight[:1].unsqueeze(0), positions)
            self.cos, self.sin = cos[0].contiguous(), sin[0].contiguous()
        join_projections(model)

    # -- weights ------------------------------------------------------------------------------------
    def rejoin(self) -> None:
        """After the parameters' memory moved (released and resumed): join the projections again."""
        join_projections(self.model)

    def layers(self) -> list[LayerWeights]:
        def joined(linears, attr):
            params = [getattr(lin, attr) for lin in linears]
            if params[0] is None:
                return None
            t = _joined([p.data for p in params])
            if t is None:
                raise RuntimeError("fused decoder: projections are no longer side by side (weights moved?)")
            return t

        out = []
        for layer in self.model.model.layers:
            attn, mlp = layer.self_attn, layer.mlp
            qkv = (attn.q_proj, attn.k_proj, attn.v_proj)
            gate_up = (mlp.gate_proj, mlp.up_proj)
            out.append(LayerWeights(
                layer.input_layernorm.weight, layer.post_attention_layernorm.weight,
                joined(qkv, "weight"), joined(qkv, "bias"), attn.o_proj.weight, attn.o_proj.bias,
                joined(gate_up, "weight"), joined(gate_up, "bias"), mlp.down_proj.weight, mlp.down_proj.bias))
        return out

    def _final(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        import torch

        from agentrl.engine.decoder_kernels import add_rms_norm

        h, _ = add_rms_norm(x, residual, self.model.model.norm.weight, self.eps)
        head = self.model.lm_head
        return torch.nn.functional.linear(h, head.weight, head.bias)

    # -- decode -------------------------------------------------------------------------------------
    def decode_logits(self, ids: torch.Tensor, positions: torch.Tensor, column: torch.Tensor,
                      keys: list[torch.Tensor], values: list[torch.Tensor]) -> torch.Tensor:
        """One token per row: ``ids``/``positions`` ``[B, 1]`` (position = the row's tokens so far), K/V
        written at ``column`` (one-element device tensor) of ``keys[l]``/``values[l]`` ``[>= B, kv_heads, T,
        dim]``, row ``b`` attending to columns ``column - positions[b] .. column``. Returns logits ``[B, V]``."""
        import torch

        from agentrl.engine.decode_attention import decode_attention
        from agentrl.engine.decoder_kernels import add_rms_norm, silu_mul

        linear = torch.nn.functional.linear
        b = ids.shape[0]
        pos = positions.view(-1)
        x = torch.nn.functional.embedding(ids.view(-1), self.model.model.embed_tokens.weight)
        residual = None
        groups = self.heads // self.kv_heads
        qd, kd = self.heads * self.dim, self.kv_heads * self.dim
        rope = (self.cos, self.sin, qd, qd + kd)  # rotary embedding and this step's K/V write, in the attention
        for li, w in enumerate(self.layers()):
            h, residual = add_rms_norm(x, residual, w.input_norm, self.eps)
            qkv = linear(h, w.qkv, w.qkv_bias)
            attn = decode_attention(qkv[:, :qd].view(b, self.kv_heads, groups, self.dim), keys[li], values[li], None,
                                    self.scale, limit=column, positions=pos, rope=rope)
            x = linear(attn.view(b, self.heads * self.dim), w.o, w.o_bias)
            h, residual = add_rms_norm(x, residual, w.post_norm, self.eps)
            x = linear(silu_mul(linear(h, w.gate_up, w.gate_up_bias)), w.down, w.down_bias)
        return self._final(x, residual)

    # -- prefill ------------------------------------------------------------------------------------
    def prefill(self, sequences: list[list[int]]) -> tuple[torch.Tensor, list[tuple[torch.Tensor, torch.Tensor]]]:
        """New sequences (no cached past), packed without padding: returns last-position logits ``[B, V]`` and
        per layer ``(k, v)`` ``[B, kv_heads, N, dim]`` (``N`` the longest), row ``b``'s tokens in its last
        columns and zeros left of them (the layout of ``model_runner.PrefillKV.block``)."""
        import torch

        from agentrl.engine.decoder_kernels import add_rms_norm, rope_scatter, silu_mul

        linear = torch.nn.functional.linear
        lengths = [len(s) for s in sequences]
        widest, total = max(lengths), sum(lengths)
        ids = torch.tensor([t for seq in sequences for t in seq], dtype=torch.long).to(self.device, non_blocking=True)
        n = torch.tensor(lengths, dtype=torch.long).to(self.device, non_blocking=True)
        cu_t = torch.nn.functional.pad(n.cumsum(0), (1, 0)).to(torch.int32)
        rows = torch.repeat_interleave(torch.arange(len(sequences), device=self.device), n, output_size=total)
        positions = torch.arange(total, device=self.device) - cu_t[:-1].long()[rows]
        cols = positions + (widest - n)[rows]  # right-aligned in the block
        layers = self.layers()
        kv = torch.zeros((len(layers), 2, len(sequences), self.kv_heads, widest, self.dim), dtype=self.dtype,
                         device=self.device)
        x = torch.nn.functional.embedding(ids, self.model.model.embed_tokens.weight)
        residual = None
        kd = self.kv_heads * self.dim
        for li, w in enumerate(layers):
            h, residual = add_rms_norm(x, residual, w.input_norm, self.eps)
            qkv = linear(h, w.qkv, w.qkv_bias)
            k = torch.empty((total, kd), dtype=self.dtype, device=self.device)
            q = rope_scatter(qkv, positions, self.cos, self.sin, self.heads, self.kv_heads, self.dim, kv[li, 0],
                             kv[li, 1], rows=rows, columns=cols, k_out=k)
            v = qkv[:, self.heads * self.dim + kd :]
            attn = causal_varlen_attention(q.view(total, self.heads, self.dim), k.view(total, self.kv_heads, self.dim),
                                           v.view(total, self.kv_heads, self.dim), cu_t, widest, self.scale)
            x = linear(attn.view(total, self.heads * self.dim), w.o, w.o_bias)
            h, residual = add_rms_norm(x, residual, w.post_norm, self.eps)
            x = linear(silu_mul(linear(h, w.gate_up, w.gate_up_bias)), w.down, w.down_bias)
        last = cu_t[1:].long() - 1
        logits = self._final(x.index_select(0, last), residual.index_select(0, last))
        return logits, [(kv[li, 0], kv[li, 1]) for li in range(len(layers))]

    # -- start-up check -------------------------------------------------------------------------------
    def check(self, cache_arg: str, *, prefill: bool) -> None:
        """Raise unless the fused decode step (and, with ``prefill``, the fused prefill) give this model's own
        eager logits: three rows of different lengths prefilled, then one decode step on static buffers with
        a left-padded layout. Relative tolerance: fp32 1e-4 (summation order), else 3e-2 (rounding)."""
        import torch
        from transformers import DynamicCache

        tol = 1e-4 if self.dtype == torch.float32 else 3e-2
        vocab = int(self.model.model.embed_tokens.weight.shape[0])
        gen = torch.Generator(device="cpu").manual_seed(0)
        lengths = [5, 9, 3]
        seqs = [torch.randint(3, vocab, (n + 1,), generator=gen).tolist() for n in lengths]
        columns, width = 16, max(lengths)
        keys = [torch.zeros((3, self.kv_heads, columns, self.dim), dtype=self.dtype, device=self.device)
                for _ in self.model.model.layers]
        values = [torch.zeros_like(k) for k in keys]

        def compare(out, ref, what):
            err = ((out.float() - ref.float()).norm() / ref.float().norm()).item()
            if not err < tol:
                raise RuntimeError(f"fused decoder: {what} relative error {err:.2e} (tolerance {tol:.0e})")

        with torch.inference_mode():
            last_refs, next_refs = [], []
            for b, seq in enumerate(seqs):
                n = lengths[b]
                cache = DynamicCache()
                out = self.model(input_ids=torch.tensor([seq[:n]], device=self.device), use_cache=True,
                                 **{cache_arg: cache})
                last_refs.append(out.logits[0, -1])
                next_refs.append(self.model(input_ids=torch.tensor([seq], device=self.device)).logits[0, -1])
                for li, layer in enumerate(cache.layers):
                    keys[li][b, :, width - n : width] = layer.keys[0]
                    values[li][b, :, width - n : width] = layer.values[0]
            if prefill:
                logits, blocks = self.prefill([seq[:n] for seq, n in zip(seqs, lengths, strict=True)])
                compare(logits, torch.stack(last_refs), "prefill logits")
                for li, (k, v) in enumerate(blocks):
                    compare(k, keys[li][:, :, :width], f"prefill keys of layer {li}")
                    compare(v, values[li][:, :, :width], f"prefill values of layer {li}")
            ids = torch.tensor([[seq[-1]] for seq in seqs], device=self.device)
            positions = torch.tensor([[n] for n in lengths], device=self.device)
            column = torch.tensor([width], device=self.device)
            logits = self.decode_logits(ids, positions, column, keys, values)
            compare(logits, torch.stack(next_refs), "decode logits")


def causal_varlen_attention(q, k, v, cu_seqlens, max_len: int, scale: float):
    """Causal attention within each of the packed sequences (``cu_seqlens`` int32 ``[B + 1]``): ``q``
    ``[N, H, D]``, ``k``/``v`` ``[N, H_kv, D]`` (grouped heads as they are). Flash attention (bf16/fp16)."""
    import torch

    return torch.ops.aten._flash_attention_forward(q, k, v, cu_seqlens, cu_seqlens, max_len, max_len, 0.0, True, False,
                                                   scale=scale)[0]


def build(model, context: int, cache_arg: str) -> tuple[FusedDecoder | None, bool]:
    """The fused decoder for ``model`` if it supports it and passes its check (else None, logged), and whether
    its prefill passed too (flash attention: not for fp32)."""
    import torch

    reason = unsupported_reason(model)
    if reason is not None:
        logger.info("fused decoder off: %s", reason)
        return None, False
    try:
        decoder = FusedDecoder(model, context)
    except Exception:  # noqa: BLE001 - transformers' forward is correct, only slower
        logger.exception("fused decoder could not be set up; decoding with transformers' modules")
        return None, False
    prefill = decoder.dtype in (torch.bfloat16, torch.float16)
    for with_prefill in ((True, False) if prefill else (False,)):
        try:
            decoder.check(cache_arg, prefill=with_prefill)
            return decoder, with_prefill
        except Exception:  # noqa: BLE001
            logger.exception("fused decoder failed its check (prefill %s)", "on" if with_prefill else "off")
    return None, False

