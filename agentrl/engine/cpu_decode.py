"""Decode steps on the CPU: the model's own weights in one plain function, the running batch in row slots.

On the CPU a decode step of a small model is mostly overhead: transformers' forward builds masks, a cache
object and a module call per projection, and :class:`~agentrl.engine.model_runner.BatchKV` copies the whole
batch's KV whenever one row joins or leaves (left padding must stay aligned). Here instead:

- :class:`SlotBatchKV`: row ``i`` keeps its tokens in columns ``[0, lengths[i])`` of fixed buffers
  ``[rows, kv_heads, columns, head_dim]`` (left-aligned, each row its own width). A decode step writes each
  row's new key and value at that row's own column; a row that leaves is replaced by the last row (one row
  copied); a row that joins is written into the next free slot. Buffers grow by doubling.
- :class:`LeanDecoder`: the decode forward of a Qwen2 / Llama-shaped model written out in torch ops over the
  model's parameters (read at every step, so weight updates apply as they land): RMSNorm, the q/k/v
  projections, RoPE at each row's position, SDPA over the row's own columns (the query heads that share a
  KV head as that head's query positions, as :mod:`agentrl.engine.attention` does), the gated MLP, the final
  norm and the LM head -- the same operations in the same order as transformers' modules, so the logits
  match its forward (checked against it when the decoder is made; a model it does not match keeps
  transformers' decode).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from agentrl.engine.model_runner import RowBuffers, fill_holes

if TYPE_CHECKING:
    import torch

    from agentrl.engine.prefix_cache import KV

SUPPORTED_MODEL_TYPES = frozenset({"qwen2", "llama"})


class SlotBatchKV(RowBuffers):
    """The running batch's KV in row slots (see module docstring). ``lengths[i]``: tokens row ``i`` holds."""

    def __init__(self, layers: int, kv_heads: int, head_dim: int, dtype: Any, device: Any, rows: int = 64,
                 columns: int = 256) -> None:
        self.shape = (layers, kv_heads, head_dim)
        self.dtype, self.device = dtype, device
        self.keys: list[torch.Tensor] = []
        self.values: list[torch.Tensor] = []
        self.lengths: list[int] = []
        self._initial = (rows, columns)  # allocated when the first rows join: an empty batch holds no memory

    @property
    def width(self) -> int:
        return max(self.lengths, default=0)

    def reserve(self, rows: int, columns: int) -> None:
        """Room for ``rows`` rows of ``columns`` tokens (buffers grow to at least double, keeping every row)."""
        import torch

        if rows <= self.rows and columns <= self.columns:
            return
        first_rows, first_columns = self._initial if not self.keys else (0, 0)
        new_rows = max(rows, 2 * self.rows if rows > self.rows else self.rows, first_rows)
        new_columns = max(columns, 2 * self.columns if columns > self.columns else self.columns, first_columns)
        layers, heads, dim = self.shape
        n, w = len(self.lengths), self.width
        with torch.inference_mode():
            keys = [torch.zeros((new_rows, heads, new_columns, dim), dtype=self.dtype, device=self.device)
                    for _ in range(layers)]
            values = [torch.zeros_like(k) for k in keys]
            for old, new in zip([*self.keys, *self.values], [*keys, *values], strict=False):
                new[:n, :, :w] = old[:n, :, :w]
        self.keys, self.values = keys, values

    def row(self, i: int) -> KV:
        """Row ``i``'s KV as independent copies ``[(k, v)]``, each ``[kv_heads, length, head_dim]``."""
        n = self.lengths[i]
        return [(k[i, :, :n].clone(), v[i, :, :n].clone()) for k, v in zip(self.keys, self.values, strict=True)]

    def extend(self, kvs: list[KV]) -> SlotBatchKV:
        """Add sequences' KV (each ``[(k, v)]`` of ``[kv_heads, length, head_dim]``) as the last rows."""
        import torch

        if not kvs:
            return self
        new = [kv[0][0].shape[1] for kv in kvs]
        n = len(self.lengths)
        self.reserve(n + len(kvs), max(new) + 1)
        with torch.inference_mode():
            for j, kv in enumerate(kvs):
                for li, (k, v) in enumerate(kv):
                    self.keys[li][n + j, :, : new[j]] = k
                    self.values[li][n + j, :, : new[j]] = v
        self.lengths = [*self.lengths, *new]
        return self

    def remove(self, rows: list[int]) -> list[int]:
        """Drop ``rows``; each hole is filled by the last remaining row (one row copied per hole, not the
        batch). Returns the old index of every remaining row, in its new order."""
        import torch

        moves, order = fill_holes(len(self.lengths), rows)
        if moves:
            src = torch.tensor([s for s, _ in moves], device=self.device)
            dst = torch.tensor([d for _, d in moves], device=self.device)
            with torch.inference_mode():
                for buf in (*self.keys, *self.values):
                    buf.index_copy_(0, dst, buf.index_select(0, src))
        self.lengths = [self.lengths[i] for i in order]
        return order

    def select(self, rows: list[int]) -> SlotBatchKV:
        """Keep ``rows``, in that order."""
        self._keep_rows(rows)
        return self


class LeanDecoder:
    """One-token decode steps of ``model`` over a :class:`SlotBatchKV` (see module docstring)."""

    def __init__(self, model: Any, rows: int = 64) -> None:
        """``rows``: the slot buffers' first row count (the engine's batch size: no regrowth)."""
        cfg = model.config
        self.model = model
        self.rows = rows
        self.heads = int(cfg.num_attention_heads)
        self.kv_heads = int(getattr(cfg, "num_key_value_heads", None) or self.heads)
        self.head_dim = int(getattr(cfg, "head_dim", None) or cfg.hidden_size // self.heads)
        self.layers = list(model.model.layers)
        self.rotary = model.model.rotary_emb

    @classmethod
    def for_model(cls, model: Any, dtype: Any, device: Any, rows: int = 64) -> LeanDecoder | None:
        """A decoder for ``model`` if it has the supported shape and its logits match the model's own
        forward on a probe batch; else None (transformers' decode is used)."""
        import logging

        cfg = model.config
        rope = getattr(model.model, "rotary_emb", None)
        if (getattr(cfg, "model_type", None) not in SUPPORTED_MODEL_TYPES or getattr(cfg, "hidden_act", None) != "silu"
                or getattr(cfg, "use_sliding_window", False) or rope is None
                or getattr(rope, "rope_type", None) != "default"):
            return None
        decoder = cls(model, rows)
        try:
            err = decoder.check(dtype, device)
        except Exception:  # noqa: BLE001 - transformers' decode is correct, only slower
            logging.getLogger(__name__).exception("lean CPU decode failed its check; decoding with transformers")
            return None
        tol = 1e-5 if dtype.is_floating_point and dtype.itemsize >= 4 else 2e-2  # relative; bf16: rounding order
        if not err < tol:
            logging.getLogger(__name__).warning("lean CPU decode: relative error %.2e against transformers; "
                                                "decoding with transformers", err)
            return None
        return decoder

    def empty_batch(self, rows: int | None = None) -> SlotBatchKV:
        """A batch with no rows (buffers for ``rows``, default :attr:`rows`, allocated when rows join)."""
        return SlotBatchKV(len(self.layers), self.kv_heads, self.head_dim, self.model.dtype, self.model.device,
                           rows or self.rows)

    def check(self, dtype: Any, device: Any) -> float:
        """Largest relative error of the logits against the model's own forward over whole sequences: a
        prefill of rows of different lengths, two decode steps, a row leaving, and a row joining with a
        cached past."""
        import torch

        vocab = int(self.model.get_input_embeddings().weight.shape[0])
        gen = torch.Generator().manual_seed(0)
        seqs = [torch.randint(3, vocab, (n,), generator=gen).tolist() for n in (5, 9, 3)]
        worst = 0.0

        def compare(logits: torch.Tensor, sequence: list[int]) -> None:
            nonlocal worst
            ref = self.model(input_ids=torch.tensor([sequence], device=device)).logits[0, -1].float()
            worst = max(worst, ((logits.float() - ref).norm() / ref.norm()).item())

        batch = self.empty_batch(2)  # grows while rows join
        with torch.inference_mode():
            logits = self.prefill_into(batch, [(seq[:-2], None) for seq in seqs])
            for row, seq in enumerate(seqs):
                compare(logits[row], seq[:-2])
            for step in (2, 1):  # the last two tokens of each sequence, one decode step each
                logits, batch = self.decode(batch, [seq[-step] for seq in seqs])
                for row, seq in enumerate(seqs):
                    compare(logits[row], seq[: len(seq) - step + 1])
            order = batch.remove([0])  # a row leaving moves another into its slot
            seqs = [seqs[i] for i in order]
            logits, batch = self.decode(batch, [seq[-1] for seq in seqs])
            seqs = [[*seq, seq[-1]] for seq in seqs]
            for row, seq in enumerate(seqs):
                compare(logits[row], seq)
            cut = len(seqs[0]) - 2  # a new row whose cached past is a prefix of row 0
            joined = [*seqs[0][:cut], 11, 12, 13]
            past = [(k[:, :cut], v[:, :cut]) for k, v in batch.row(0)]
            logits = self.prefill_into(batch, [(joined, past), (seqs[1][:4], None)])
            compare(logits[0], joined)
            compare(logits[1], seqs[1][:4])
        return worst

    def decode(self, batch: SlotBatchKV, tokens: list[int]) -> tuple[torch.Tensor, SlotBatchKV]:
        """Feed one token per row (row ``i``'s at position ``lengths[i]``); logits ``[rows, vocab]``."""
        import torch

        n = len(tokens)
        batch.reserve(n, batch.width + 1)
        device = batch.device
        G = self.heads // self.kv_heads
        with torch.inference_mode():
            positions = torch.tensor(batch.lengths, device=device)
            width = int(batch.width) + 1
            # row i sees its columns 0..lengths[i] (the new token's included)
            mask = (torch.arange(width, device=device).unsqueeze(0) <= positions.unsqueeze(1))[:, None, None, :]

            def attend(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float) -> torch.Tensor:
                # the query heads that share a KV head are its query positions (no KV head is copied)
                return torch.nn.functional.scaled_dot_product_attention(
                    q.view(n, self.kv_heads, G, self.head_dim), keys[:n, :, :width], values[:n, :, :width],
                    attn_mask=mask, scale=scale).reshape(n, -1)

            logits = self._forward(batch, tokens, torch.arange(n, device=device), positions, attend, None)
        batch.lengths = [length + 1 for length in batch.lengths]
        return logits, batch

    def prefill_into(self, batch: SlotBatchKV, items: list[tuple[list[int], KV | None]]) -> torch.Tensor:
        """Add each ``(tokens, past)`` as a new last row: its cached ``past`` (the KV of ``tokens[:len(past)]``)
        copied into its slot, the rest of ``tokens`` run through the model with their KV written straight into
        the slot. All rows' new tokens go through the projections together (no padding); attention pads the
        queries to the longest. Returns each row's last-position logits ``[len(items), vocab]``."""
        import torch

        device = batch.device
        pasts = [past[0][0].shape[1] if past else 0 for _, past in items]
        news = [len(tokens) - p for (tokens, _), p in zip(items, pasts, strict=True)]
        if min(news) < 1:
            raise ValueError("every prefilled sequence needs a token after its cached past")
        first, count, longest = len(batch.lengths), len(items), max(news)
        width = max(p + n for p, n in zip(pasts, news, strict=True))
        batch.reserve(first + count, width + 1)
        G, D = self.heads // self.kv_heads, self.head_dim
        with torch.inference_mode():
            for b, (_, past) in enumerate(items):
                for li, (k, v) in enumerate(past or []):
                    batch.keys[li][first + b, :, : pasts[b]] = k
                    batch.values[li][first + b, :, : pasts[b]] = v
            tokens = [t for (seq, _), p in zip(items, pasts, strict=True) for t in seq[p:]]
            rows = torch.tensor([first + b for b, n in enumerate(news) for _ in range(n)], device=device)
            steps = torch.tensor([i for n in news for i in range(n)], device=device)  # index within the new tokens
            offsets = torch.tensor(pasts, device=device)
            positions = offsets[rows - first] + steps
            # padded query slot of each token, and what each padded query may see: its row's columns up to its
            # own position (a padding query sees column 0 only: finite, discarded)
            slot = (rows - first) * longest + steps
            cols = torch.arange(width, device=device)
            query_pos = offsets[:, None] + torch.arange(longest, device=device)[None, :]  # [rows, longest]
            real = torch.arange(longest, device=device)[None, :] < torch.tensor(news, device=device)[:, None]
            allowed = torch.where(real[:, :, None], cols[None, None, :] <= query_pos[:, :, None], cols[None, None, :] == 0)
            mask = allowed[:, None, None, :, :].expand(count, 1, G, longest, width).reshape(count, 1, G * longest, width)

            def attend(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float) -> torch.Tensor:
                padded = q.new_zeros((count * longest, self.heads, D))
                padded[slot] = q
                padded = padded.view(count, longest, self.kv_heads, G, D).permute(0, 2, 3, 1, 4)
                out = torch.nn.functional.scaled_dot_product_attention(
                    padded.reshape(count, self.kv_heads, G * longest, D), keys[first : first + count, :, :width],
                    values[first : first + count, :, :width], attn_mask=mask, scale=scale)
                out = out.view(count, self.kv_heads, G, longest, D).permute(0, 3, 1, 2, 4).reshape(count * longest, -1)
                return out[slot]

            last = torch.tensor(news, device=device).cumsum(0) - 1
            batch.lengths = [*batch.lengths, *pasts]
            logits = self._forward(batch, tokens, rows, positions, attend, last)
        batch.lengths[first:] = [p + n for p, n in zip(pasts, news, strict=True)]
        return logits

    def _forward(self, batch: SlotBatchKV, tokens: list[int], rows: torch.Tensor, positions: torch.Tensor,
                 attend: Any, keep: torch.Tensor | None) -> torch.Tensor:
        """Run ``tokens`` (token ``t`` of row ``rows[t]`` at position ``positions[t]``) through the model,
        writing their keys and values into the batch; ``attend(q, keys, values, scale)`` is the attention of
        every token's query ``[tokens, heads, head_dim]`` over a layer's buffers. Logits of the tokens
        ``keep`` (None: all)."""
        import torch.nn.functional as F  # noqa: N812

        n = len(tokens)
        H, KV, D = self.heads, self.kv_heads, self.head_dim
        x = F.embedding(positions.new_tensor(tokens), self.model.model.embed_tokens.weight)
        cos, sin = self._rope(positions, x)
        for li, layer in enumerate(self.layers):
            attn = layer.self_attn
            h = _rms_norm(x, layer.input_layernorm)
            q = _rotate(F.linear(h, attn.q_proj.weight, attn.q_proj.bias).view(n, H, D), cos, sin)
            k = _rotate(F.linear(h, attn.k_proj.weight, attn.k_proj.bias).view(n, KV, D), cos, sin)
            v = F.linear(h, attn.v_proj.weight, attn.v_proj.bias).view(n, KV, D)
            keys, values = batch.keys[li], batch.values[li]
            keys[rows, :, positions] = k
            values[rows, :, positions] = v
            x = x + F.linear(attend(q, keys, values, attn.scaling), attn.o_proj.weight, attn.o_proj.bias)
            h = _rms_norm(x, layer.post_attention_layernorm)
            mlp = layer.mlp
            gate = F.silu(F.linear(h, mlp.gate_proj.weight, mlp.gate_proj.bias))
            x = x + F.linear(gate * F.linear(h, mlp.up_proj.weight, mlp.up_proj.bias), mlp.down_proj.weight,
                             mlp.down_proj.bias)
        if keep is not None:
            x = x[keep]
        x = _rms_norm(x, self.model.model.norm)
        lm_head = self.model.lm_head
        return F.linear(x, lm_head.weight, lm_head.bias)

    def _rope(self, positions: torch.Tensor, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin ``[rows, 1, head_dim]`` at each row's position, as transformers' rotary embedding."""
        import torch

        freqs = positions[:, None].float() * self.rotary.inv_freq.to(device=x.device, dtype=torch.float)
        emb = torch.cat((freqs, freqs), dim=-1)
        scale = self.rotary.attention_scaling
        return (emb.cos() * scale).to(x.dtype).unsqueeze(1), (emb.sin() * scale).to(x.dtype).unsqueeze(1)


def _rms_norm(x: torch.Tensor, norm: Any) -> torch.Tensor:
    """transformers' Qwen2/Llama RMSNorm: in fp32, the weight applied in the input's dtype."""
    import torch

    dtype = x.dtype
    x32 = x.to(torch.float32)
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + norm.variance_epsilon)
    return norm.weight * x32.to(dtype)


def _rotate(t: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE of ``t`` ``[rows, heads, head_dim]`` (rotate_half convention)."""
    import torch

    half = t.shape[-1] // 2
    return t * cos + torch.cat((-t[..., half:], t[..., :half]), dim=-1) * sin
