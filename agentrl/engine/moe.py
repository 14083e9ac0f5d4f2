"""The engine's mixture-of-experts MLP (Qwen3-MoE): routing that the engine can report, experts named as
in the checkpoint, and a grouped expert matmul on CUDA.

:func:`install` replaces every transformers ``Qwen3MoeSparseMoeBlock`` of a loaded model by
:class:`SparseMoeBlock`. Its parameters carry the checkpoint's names (``mlp.gate.weight``,
``mlp.experts.{j}.{gate,up,down}_proj.weight``; transformers fuses the experts into 3-D tensors in memory)
so weight syncs from the trainer land by name; they are views into two stacked buffers
``[experts, 2 * width, hidden]`` / ``[experts, hidden, width]`` that the forward reads.

Routing is Qwen3-MoE's: softmax over all experts (fp32), top-k, renormalised over the k when
``norm_topk_prob``. Each forward keeps its chosen experts (``routed``, ``[tokens, k]``; on CUDA in a
persistent buffer, so a captured decode step refreshes it on every replay); :func:`routed_experts` reads
them for the positions whose logits were sampled, as one flat ``layers x k`` list per token.

Experts: on the CPU the loop over the experts that got tokens (as transformers does); on CUDA the tokens
sorted by expert and run as one grouped matmul per projection (``torch._grouped_mm``, bf16 on Hopper, checked
against the loop once), else the same sorted tokens one slice per expert. No token is ever dropped.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

MODEL_TYPES = frozenset({"qwen3_moe"})
_ROUTED_ROWS = 1024  # persistent routing buffer rows (grown for larger eager forwards)
_log = logging.getLogger(__name__)


class _Expert(nn.Module):
    def __init__(self, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor) -> None:
        super().__init__()
        self.gate_proj, self.up_proj, self.down_proj = (_Weight(t) for t in (gate, up, down))


class _Weight(nn.Module):
    def __init__(self, view: torch.Tensor) -> None:
        super().__init__()
        self.weight = nn.Parameter(view, requires_grad=False)


class SparseMoeBlock(nn.Module):
    """Router plus experts of one layer (see the module docstring)."""

    grouped_mm_ok: bool | None = None  # torch._grouped_mm checked against the loop (None: not yet)

    def __init__(self, block: nn.Module, config: Any) -> None:
        super().__init__()
        experts = block.experts
        self.num_experts, self.top_k = int(config.num_experts), int(config.num_experts_per_tok)
        self.norm_topk_prob = bool(config.norm_topk_prob)
        self.gate = block.gate
        self.gate_up = experts.gate_up_proj.detach()  # [E, 2I, H]: plain tensors, not in the state dict
        self.down = experts.down_proj.detach()  # [E, H, I]
        width = self.gate_up.shape[1] // 2
        self.act = experts.act_fn
        self.experts = nn.ModuleList(
            _Expert(self.gate_up[j, :width], self.gate_up[j, width:], self.down[j]) for j in range(self.num_experts)
        )
        self._routed_buffer: torch.Tensor | None = None
        self.routed: torch.Tensor | None = None

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        shape = hidden_states.shape
        x = hidden_states.reshape(-1, shape[-1])
        logits = F.linear(x, self.gate.weight)
        probs = torch.softmax(logits, dtype=torch.float, dim=-1)
        weights, chosen = torch.topk(probs, self.top_k, dim=-1)
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        self._keep(chosen)
        if x.device.type == "cuda":
            out = self._sorted_experts(x, chosen, weights.to(x.dtype))
        else:
            out = self._looped_experts(x, chosen, weights.to(x.dtype))
        return out.reshape(shape)

    def _keep(self, chosen: torch.Tensor) -> None:
        n = chosen.shape[0]
        if not _capturing(chosen) and (
                self._routed_buffer is None or self._routed_buffer.shape[0] < n
                or self._routed_buffer.device != chosen.device):
            self._routed_buffer = torch.empty((max(n, _ROUTED_ROWS), self.top_k), dtype=torch.long, device=chosen.device)
        if self._routed_buffer is not None and self._routed_buffer.shape[0] >= n:
            self._routed_buffer[:n].copy_(chosen)
            self.routed = self._routed_buffer[:n]
        else:
            self.routed = chosen

    def _expert_mlp(self, x: torch.Tensor, j: int) -> torch.Tensor:
        gate, up = F.linear(x, self.gate_up[j]).chunk(2, dim=-1)
        return F.linear(self.act(gate) * up, self.down[j])

    def _looped_experts(self, x: torch.Tensor, chosen: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        out = torch.zeros_like(x)
        for j in torch.unique(chosen).tolist():
            token, slot = torch.where(chosen == j)
            out.index_add_(0, token, self._expert_mlp(x[token], j) * weights[token, slot, None])
        return out

    def _sorted_experts(self, x: torch.Tensor, chosen: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        flat = chosen.reshape(-1)
        order = torch.argsort(flat, stable=True)
        token = order // self.top_k
        counts = torch.zeros(self.num_experts, dtype=torch.int32, device=x.device).scatter_add_(
            0, flat, torch.ones_like(flat, dtype=torch.int32))
        xs = x[token]
        ys = self._grouped(xs, counts) if self._use_grouped(x) else None
        if ys is None:
            ys = torch.empty_like(xs)
            start = 0
            for j, n in enumerate(counts.tolist()):
                if n:
                    ys[start:start + n] = self._expert_mlp(xs[start:start + n], j)
                start += n
        ys = ys * weights.reshape(-1)[order, None]
        return torch.zeros_like(x).index_add_(0, token, ys)

    def _grouped(self, xs: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        offsets = torch.cumsum(counts, 0, dtype=torch.int32)
        gate, up = torch._grouped_mm(xs, self.gate_up.transpose(1, 2), offs=offsets).chunk(2, dim=-1)
        return torch._grouped_mm(self.act(gate) * up, self.down.transpose(1, 2), offs=offsets)

    def _use_grouped(self, x: torch.Tensor) -> bool:
        if SparseMoeBlock.grouped_mm_ok is None:
            SparseMoeBlock.grouped_mm_ok = self._check_grouped(x)
        return SparseMoeBlock.grouped_mm_ok

    def _check_grouped(self, x: torch.Tensor) -> bool:
        """Whether ``torch._grouped_mm`` runs here and agrees with the per-expert loop (bf16 tolerance)."""
        if not hasattr(torch, "_grouped_mm") or x.dtype != torch.bfloat16 or _capturing(x):
            return False
        try:
            gen = torch.Generator(device=x.device).manual_seed(0)
            probe = torch.randn((64, x.shape[1]), device=x.device, dtype=x.dtype, generator=gen)
            chosen = torch.randint(0, self.num_experts, (64,), device=x.device, generator=gen).sort().values
            counts = torch.bincount(chosen, minlength=self.num_experts).to(torch.int32)
            got = self._grouped(probe, counts).float()
            want = torch.cat([self._expert_mlp(probe[chosen == j], j) for j in range(self.num_experts)]).float()
            err = ((got - want).norm() / want.norm().clamp_min(1e-12)).item()
            if not err < 2e-2:
                raise RuntimeError(f"relative error {err:.2e}")
        except Exception:  # noqa: BLE001 - the sorted per-expert path is correct, only slower
            _log.exception("grouped expert matmul failed its check; experts run one slice each")
            return False
        return True


def _capturing(t: torch.Tensor) -> bool:
    """Whether a CUDA graph is being captured (never on the CPU, where torch's query may not exist)."""
    return t.is_cuda and torch.cuda.is_current_stream_capturing()


def install(model: nn.Module) -> int:
    """Replace the model's transformers MoE blocks by :class:`SparseMoeBlock`; returns how many."""
    if getattr(model.config, "model_type", None) not in MODEL_TYPES:
        return 0
    layers = model.model.layers
    n = 0
    for layer in layers:
        if type(layer.mlp).__name__ == "Qwen3MoeSparseMoeBlock":
            layer.mlp = SparseMoeBlock(layer.mlp, model.config)
            n += 1
    return n


def blocks(model: nn.Module) -> list[SparseMoeBlock]:
    return [m for m in model.modules() if isinstance(m, SparseMoeBlock)]


def routed_experts(model: nn.Module, rows: torch.Tensor | list[int]) -> torch.Tensor | None:
    """The experts of the last forward at flat token positions ``rows``: ``[len(rows), layers * k]`` (device
    tensor; None for a dense model)."""
    found = blocks(model)
    if not found:
        return None
    index = torch.as_tensor(rows, device=found[0].routed.device)
    return torch.cat([b.routed.index_select(0, index) for b in found], dim=1)
