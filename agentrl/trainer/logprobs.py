"""Log-probs of given tokens and entropy from vocab-parallel logits (each TP rank holds ``V / tp`` columns)."""

from __future__ import annotations

import torch


def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """``[b, L]`` log-probs of ``tokens[:, t]`` under ``logits[:, t - 1]``; column 0 is 0.

    ``logits`` is ``[b, L, V/tp]`` as GPTModel returns it with ``parallel_output=True``.
    """
    lp = _target_logprobs(logits[:, :-1].transpose(0, 1), tokens[:, 1:].transpose(0, 1), temperature)  # [L-1, b]
    lp = lp.transpose(0, 1)
    return torch.cat([torch.zeros_like(lp[:, :1]), lp], dim=1)


def _target_logprobs(logits: torch.Tensor, targets: torch.Tensor, temperature: float) -> torch.Tensor:
    """``[s, b]`` log-probs of ``targets`` ``[s, b]`` under ``logits`` ``[s, b, V/tp]`` (no shift). Uses
    Megatron's ``vocab_parallel_cross_entropy``, which edits its input in place: it gets a (scaled) copy."""
    from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

    x = logits.float()
    if temperature != 1.0:
        x = x / temperature
    # Always a fresh contiguous copy: the op mutates its input and views it as 2-D.
    x = x.clone(memory_format=torch.contiguous_format)
    return -vocab_parallel_cross_entropy(x, targets.contiguous())


def vocab_parallel_entropy(logits: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """``[b, L]`` entropy of the next-token distribution at each position, shifted like :func:`token_logprobs`.

    Differentiable: the cross-rank sums use Megatron's all-reduce with identity backward.
    """
    ent = entropy_at(logits[:, :-1], temperature)
    return torch.cat([torch.zeros_like(ent[..., :1]), ent], dim=-1)


def entropy_at(logits: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """Entropy of the distribution of each row of ``logits`` ``[..., V/tp]`` (no shift); differentiable."""
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.mappings import reduce_from_tensor_model_parallel_region

    x = logits.float() / temperature
    tp = parallel_state.get_tensor_model_parallel_world_size()
    m = x.detach().max(dim=-1, keepdim=True).values
    if tp > 1:
        torch.distributed.all_reduce(m, op=torch.distributed.ReduceOp.MAX,
                                     group=parallel_state.get_tensor_model_parallel_group())
    z = x - m
    e = z.exp()
    sum_e = e.sum(-1)
    sum_ez = (e * z).sum(-1)
    if tp > 1:
        sum_e = reduce_from_tensor_model_parallel_region(sum_e)
        sum_ez = reduce_from_tensor_model_parallel_region(sum_ez)
    # H = log Z - E[z] with Z = sum exp(z)
    return sum_e.log() - sum_ez / sum_e


def logprobs_at(logits: torch.Tensor, targets: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """Log-probs of ``targets`` ``[n]`` under the rows of ``logits`` ``[n, V/tp]`` (no shift), as
    :func:`token_logprobs` computes them."""
    return _target_logprobs(logits.unsqueeze(1), targets.unsqueeze(1), temperature).squeeze(1)
