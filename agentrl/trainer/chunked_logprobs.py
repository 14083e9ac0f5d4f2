"""Token log-probs and entropy from the output layer's *input*, never holding ``(tokens, vocab)`` at once.

``logits = hidden @ weight.T`` for 8k tokens and a 152k vocabulary is 2.5 GB in bf16, and its gradient
as much again (issue 41: the 1.5B shape ran out of memory on an 80 GB card). Here the output layer and
the log-softmax are one autograd function over chunks of positions: the forward keeps only ``hidden``,
``weight``, the targets and two fp32 numbers per position (the log-normaliser and the mean logit); the
backward recomputes each chunk's logits and turns them straight into that chunk's gradients of
``hidden`` and ``weight`` (the idea of Liger's fused linear cross-entropy). Peak extra memory: a few
``chunk x vocab`` buffers, whatever the token count (:data:`CHUNK_ELEMENTS`).

Vocab-parallel: with ``tp_group``, ``weight`` is this rank's ``[V / tp, h]`` slice (rank ``r`` holds ids
``r * V / tp ...``); per chunk the max is all-reduced, then the sums of ``exp``, ``exp * z`` and the
target's logit in one all-reduce, and the backward all-reduces the gradient of ``hidden`` (the output
layer's input is replicated over the tensor-parallel ranks).

Per chunk the softmax runs in fp32 torch ops, or, on CUDA with one rank and no entropy gradient, in the
one-pass Triton kernels of :mod:`agentrl.trainer.fused_logprobs` over the chunk's logits in the model's
dtype (one read per pass instead of about eight).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

# Logit values per chunk (positions x this rank's vocabulary columns): 2**27 is 0.5 GiB in fp32, 883
# positions at a 152k vocabulary; a whole micro-batch of the 0.62M test model (vocab 1024) is one chunk.
CHUNK_ELEMENTS = 2**27


def chunk_tokens_for(vocab_local: int) -> int:
    """Positions per chunk for ``vocab_local`` columns on this rank (:data:`CHUNK_ELEMENTS`; at least 1)."""
    return max(1, CHUNK_ELEMENTS // vocab_local)


def _logits(hidden: torch.Tensor, weight: torch.Tensor, temperature: float) -> torch.Tensor:
    z = (hidden @ weight.t()).float()
    return z.div_(temperature) if temperature != 1.0 else z


def _all_reduce(x: torch.Tensor, group, op=dist.ReduceOp.SUM) -> torch.Tensor:
    if group is not None:
        dist.all_reduce(x, op=op, group=group)
    return x


class _Chunking:
    """Where each chunk starts and ends, and which targets fall in this rank's vocabulary slice."""

    def __init__(self, n: int, chunk: int, targets: torch.Tensor, vocab_start: int, vocab_local: int):
        self.bounds = [(s, min(n, s + chunk)) for s in range(0, n, chunk)]
        local = targets - vocab_start
        self.here = (local >= 0) & (local < vocab_local)  # [n] bool
        self.local = local.clamp(0, vocab_local - 1)[:, None]  # [n, 1], any column where not here


def _torch_stats(z: torch.Tensor, local: torch.Tensor, here: torch.Tensor, group) -> tuple[torch.Tensor, ...]:
    """``(lp, entropy, lse, mean z)`` of the fp32 logits ``z`` ``[c, V/tp]`` (consumed in place)."""
    m = _all_reduce(z.max(-1).values, group, dist.ReduceOp.MAX)
    z = z.sub_(m[:, None])  # z - m, <= 0
    target = z.gather(1, local).squeeze(1) * here
    e = z.exp()
    sum_e = e.sum(-1)
    sums = _all_reduce(torch.stack([sum_e, e.mul_(z).sum(-1), target]), group)
    log_s, mean_shift = sums[0].log(), sums[1] / sums[0]
    # lp = z_t - m - log S; H = log S - E[z - m]; lse = m + log S; E[z] = m + E[z - m]
    return sums[2] - log_s, log_s - mean_shift, m + log_s, m + mean_shift


class _LinearLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, targets, temperature: float, chunk: int, entropy_grad: bool, group,
                vocab_start: int):
        from agentrl.trainer import fused_logprobs

        n, vocab_local = hidden.shape[0], weight.shape[0]
        cut = _Chunking(n, chunk, targets, vocab_start, vocab_local)
        kernel = group is None and not entropy_grad and fused_logprobs.available(hidden.device, 1)
        out = torch.empty(4, n, dtype=torch.float32, device=hidden.device)  # lp, entropy, lse, mean z
        for s, e in cut.bounds:
            if kernel:
                out[:3, s:e] = torch.stack(fused_logprobs.row_stats(hidden[s:e] @ weight.t(), targets[s:e],
                                                                    temperature))
            else:
                out[:, s:e] = torch.stack(_torch_stats(_logits(hidden[s:e], weight, temperature),
                                                       cut.local[s:e], cut.here[s:e], group))
        ctx.save_for_backward(hidden, weight, targets, out[2], out[3])
        ctx.cut, ctx.kernel, ctx.group = cut, kernel, group
        ctx.temperature, ctx.entropy_grad = temperature, entropy_grad
        lp, entropy = out[0].clone(), out[1].clone()
        if not entropy_grad:
            ctx.mark_non_differentiable(entropy)
        return lp, entropy

    @staticmethod
    def backward(ctx, grad_lp, grad_entropy):
        hidden, weight, targets, lse, mean_z = ctx.saved_tensors
        cut = ctx.cut
        grad_lp = grad_lp.float() if grad_lp is not None else torch.zeros_like(lse)
        grad_hidden = torch.empty_like(hidden) if ctx.needs_input_grad[0] else None
        grad_weight = None
        for s, e in cut.bounds:
            grad_z = _chunk_grad(ctx, hidden[s:e], weight, targets[s:e], lse[s:e], mean_z[s:e], grad_lp[s:e],
                                 None if grad_entropy is None else grad_entropy[s:e].float(), cut.local[s:e],
                                 cut.here[s:e])
            if grad_hidden is not None:
                grad_hidden[s:e] = grad_z @ weight
            if ctx.needs_input_grad[1]:
                part = grad_z.t() @ hidden[s:e]
                if len(cut.bounds) == 1:
                    grad_weight = part
                else:  # sum the chunks in fp32, round once (as one GEMM over all positions would)
                    grad_weight = part.float() if grad_weight is None else grad_weight.add_(part)
        if grad_hidden is not None:
            _all_reduce(grad_hidden, ctx.group)  # each rank holds its vocabulary slice's share
        if grad_weight is not None:
            grad_weight = grad_weight.to(weight.dtype)
        return grad_hidden, grad_weight, None, None, None, None, None, None


def _chunk_grad(ctx, hidden, weight, targets, lse, mean_z, grad_lp, grad_entropy, local, here) -> torch.Tensor:
    """d loss / d logits of one chunk, in ``hidden``'s dtype."""
    from agentrl.trainer import fused_logprobs

    t = ctx.temperature
    if ctx.kernel:
        return fused_logprobs.row_grad(hidden @ weight.t(), targets, lse, grad_lp, t)
    z = _logits(hidden, weight, t)
    p = (z - lse[:, None]).exp_()
    if ctx.entropy_grad and grad_entropy is not None:
        # dH/dz_j = p_j (E[z] - z_j); d lp/dz_j = onehot_j - p_j
        grad_z = z.sub_(mean_z[:, None]).mul_(p).mul_(-grad_entropy[:, None]).sub_(p.mul_(grad_lp[:, None]))
    else:
        grad_z = p.mul_(-grad_lp[:, None])
    grad_z.scatter_add_(1, local, (grad_lp * here)[:, None])
    return (grad_z.div_(t) if t != 1.0 else grad_z).to(hidden.dtype)


def linear_logprobs_and_entropy(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                                temperature: float = 1.0, chunk_tokens: int | None = None, *,
                                entropy_grad: bool = False, tp_group=None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(log p(target), entropy)`` per position of ``softmax(hidden @ weight.T / temperature)``, fp32,
    ``[n]`` each, for ``hidden [n, h]``, ``weight [V/tp, h]`` (this rank's rows of the vocabulary with
    ``tp_group``, else all of it) and ``targets [n]`` (vocabulary ids). Differentiable in ``hidden`` and
    ``weight`` through the log-probs, and through the entropy too with ``entropy_grad``.
    ``chunk_tokens``: positions per chunk (default :func:`chunk_tokens_for` this rank's vocabulary)."""
    if hidden.dim() != 2 or weight.dim() != 2 or hidden.shape[1] != weight.shape[1]:
        raise ValueError(f"hidden [n, h] and weight [V, h] expected, got {tuple(hidden.shape)} and "
                         f"{tuple(weight.shape)}")
    if targets.shape != hidden.shape[:1]:
        raise ValueError(f"targets must be [n] = {hidden.shape[0]}, got {tuple(targets.shape)}")
    if chunk_tokens is None:
        chunk_tokens = chunk_tokens_for(weight.shape[0])
    if chunk_tokens < 1:
        raise ValueError(f"chunk_tokens must be >= 1, got {chunk_tokens}")
    tp = dist.get_world_size(tp_group) if tp_group is not None else 1
    group = tp_group if tp > 1 else None
    vocab_start = dist.get_rank(tp_group) * weight.shape[0] if group is not None else 0
    return _LinearLogprobs.apply(hidden, weight, targets.long(), float(temperature), int(chunk_tokens),
                                 bool(entropy_grad), group, vocab_start)


def shifted_logprobs_and_entropy(hidden: torch.Tensor, weight: torch.Tensor, tokens: torch.Tensor,
                                 temperature: float = 1.0, **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
    """``([b, L] log-probs, [b, L] entropy)`` of ``tokens[:, t]`` under position ``t - 1`` of ``hidden``
    ``[b, L, h]`` (column 0 is 0), by :func:`linear_logprobs_and_entropy` (``kwargs`` go there)."""
    b, length, h = hidden.shape
    lp, entropy = linear_logprobs_and_entropy(hidden[:, :-1].reshape(-1, h), weight, tokens[:, 1:].reshape(-1),
                                              temperature, **kwargs)
    zero = lp.new_zeros(b, 1)
    return (torch.cat([zero, lp.view(b, length - 1)], 1), torch.cat([zero, entropy.view(b, length - 1)], 1))
