"""Token log-probs and entropy from the output layer's *input*, never holding ``(tokens, vocab)`` at once.

``logits = hidden @ weight.T`` for 8k tokens and a 152k vocabulary is 2.5 GB in bf16, and its gradient
as much again (issue 41: the 1.5B shape runs out of memory on an 80 GB card). Here the output layer and
the log-softmax are one autograd function over chunks of ``chunk_tokens`` positions: the forward keeps
only ``hidden``, ``weight`` and the targets; the backward recomputes each chunk's logits and turns them
straight into that chunk's gradients of ``hidden`` and ``weight`` (the idea of Liger's fused linear
cross-entropy). Peak extra memory: about ``chunk_tokens * vocab`` fp32 values, whatever the token count.

The entropy is a metric here: it carries no gradient (as :mod:`agentrl.trainer.fused_logprobs`).
One tensor-parallel rank (the full vocabulary in ``weight``).
"""

from __future__ import annotations

import torch

CHUNK_TOKENS = 1024  # positions per chunk: 1024 x 152k fp32 logits is 0.6 GB


def _chunk_logits(hidden: torch.Tensor, weight: torch.Tensor, temperature: float) -> torch.Tensor:
    return (hidden @ weight.t()).float() / temperature


class _LinearLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, targets, temperature: float, chunk_tokens: int):
        n = hidden.shape[0]
        lp = torch.empty(n, dtype=torch.float32, device=hidden.device)
        entropy = torch.empty_like(lp)
        for s in range(0, n, chunk_tokens):
            e = min(n, s + chunk_tokens)
            z = _chunk_logits(hidden[s:e], weight, temperature)
            log_norm = torch.logsumexp(z, dim=-1)
            lp[s:e] = z.gather(1, targets[s:e, None]).squeeze(1) - log_norm
            entropy[s:e] = log_norm - (torch.softmax(z, dim=-1) * z).sum(-1)
        ctx.save_for_backward(hidden, weight, targets)
        ctx.temperature, ctx.chunk_tokens = temperature, chunk_tokens
        ctx.mark_non_differentiable(entropy)
        return lp, entropy

    @staticmethod
    def backward(ctx, grad_lp, _grad_entropy):
        hidden, weight, targets = ctx.saved_tensors
        t, n = ctx.temperature, hidden.shape[0]
        grad_hidden = torch.empty_like(hidden) if ctx.needs_input_grad[0] else None
        grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) \
            if ctx.needs_input_grad[1] else None
        for s in range(0, n, ctx.chunk_tokens):
            e = min(n, s + ctx.chunk_tokens)
            g = grad_lp[s:e, None].float()
            # d lp / d logits = (onehot(target) - softmax) / temperature
            grad_z = torch.softmax(_chunk_logits(hidden[s:e], weight, t), dim=-1).mul_(-g)
            grad_z.scatter_add_(1, targets[s:e, None], g)
            grad_z = grad_z.div_(t).to(hidden.dtype)
            if grad_hidden is not None:
                grad_hidden[s:e] = grad_z @ weight
            if grad_weight is not None:
                grad_weight += (grad_z.t() @ hidden[s:e]).float()
        return grad_hidden, None if grad_weight is None else grad_weight.to(weight.dtype), None, None, None


def linear_logprobs_and_entropy(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                                temperature: float = 1.0, chunk_tokens: int = CHUNK_TOKENS
                                ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(log p(target), entropy)`` per position of ``softmax(hidden @ weight.T / temperature)``, fp32,
    ``[n]`` each, for ``hidden [n, h]``, ``weight [V, h]``, ``targets [n]``; differentiable in ``hidden``
    and ``weight`` through the log-probs only."""
    if hidden.dim() != 2 or weight.dim() != 2 or hidden.shape[1] != weight.shape[1]:
        raise ValueError(f"hidden [n, h] and weight [V, h] expected, got {tuple(hidden.shape)} and "
                         f"{tuple(weight.shape)}")
    if targets.shape != hidden.shape[:1]:
        raise ValueError(f"targets must be [n] = {hidden.shape[0]}, got {tuple(targets.shape)}")
    if chunk_tokens < 1:
        raise ValueError(f"chunk_tokens must be >= 1, got {chunk_tokens}")
    return _LinearLogprobs.apply(hidden, weight, targets.long(), float(temperature), int(chunk_tokens))
