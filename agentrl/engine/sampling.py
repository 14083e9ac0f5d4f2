"""Next-token choice for a batch of rows, each with its own sampling parameters.

The returned log-prob is ``log_softmax(logits / temperature)`` of the drawn token: the sampling policy the
trainer recomputes (its ``temperature`` is the rollout's), so train/rollout log-probs and importance ratios
compare like with like. Greedy rows use temperature 1. Top-k/top-p/min-p filters only change which token
is drawn, not the returned log-prob (as SGLang).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

    from agentrl.engine.protocol import SamplingParams


def sample_next(
    logits: torch.Tensor,
    params: list[SamplingParams],
    generators: list[torch.Generator | None],
    rng: torch.Generator | None = None,
) -> tuple[list[int], list[float]]:
    """Pick one token per row of ``logits`` [B, V]; return (token ids, their log-probs at each row's temperature).
    Rows without a generator of their own draw from ``rng`` (None: torch's default generator)."""
    import torch

    logits = logits.float()
    temperatures = torch.tensor([1.0 if p.greedy else p.temperature for p in params], device=logits.device)
    logprobs = torch.log_softmax(logits / temperatures.unsqueeze(1), dim=-1)
    batch = logits.shape[0]
    tokens = torch.empty(batch, dtype=torch.long, device=logits.device)

    greedy_rows = [i for i, p in enumerate(params) if p.greedy]
    if greedy_rows:
        idx = torch.tensor(greedy_rows, device=logits.device)
        tokens[idx] = logits[idx].argmax(dim=-1)

    sampled_rows = [i for i, p in enumerate(params) if not p.greedy]
    if sampled_rows:
        idx = torch.tensor(sampled_rows, device=logits.device)
        probs = _filtered_probs(logits[idx], [params[i] for i in sampled_rows])
        # inverse-CDF draw: one uniform per row (torch.multinomial and per-element noise cost ms per step
        # on CPU at batch 64); seeded rows draw their uniform from their own generator
        cdf = probs.cumsum(dim=-1)
        u = torch.rand((len(sampled_rows), 1), device=logits.device, dtype=cdf.dtype, generator=rng)
        for j, i in enumerate(sampled_rows):
            if generators[i] is not None:
                u[j] = torch.rand(1, generator=generators[i], device=logits.device, dtype=cdf.dtype)
        # right=True: the first index whose cdf exceeds u, so zero-probability tokens are never drawn
        drawn = torch.searchsorted(cdf, u * cdf[:, -1:], right=True).squeeze(-1)
        tokens[idx] = drawn.clamp_(max=probs.shape[-1] - 1)

    chosen = logprobs.gather(1, tokens.unsqueeze(1)).squeeze(1)
    # one device-to-host copy (token ids are exact in float64)
    host = torch.stack((tokens.double(), chosen.double())).tolist()
    return [int(t) for t in host[0]], host[1]


def fusable(params: list[SamplingParams], generators: list[torch.Generator | None], vocab: int) -> bool:
    """Whether every row samples as plain temperature (or greedy) sampling from the default generator: what
    the runner's captured decode step draws itself (``ModelRunner.decode_sample``). Filters (top-k, top-p,
    min-p) and seeded rows go through :func:`sample_next`."""
    if any(g is not None for g in generators):
        return False
    return all(p.greedy or ((p.top_k <= 0 or p.top_k >= vocab) and p.top_p >= 1.0 and p.min_p <= 0.0) for p in params)


def _filtered_probs(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """Softmax of ``logits / temperature`` after top-k, top-p and min-p filtering (per row)."""
    import torch

    device = logits.device
    temps = torch.tensor([p.temperature for p in params], device=device).unsqueeze(1)
    scaled = logits / temps
    vocab = scaled.shape[-1]
    top_ks = [p.top_k if p.top_k > 0 else vocab for p in params]
    if any(k < vocab for k in top_ks):
        ks = torch.tensor(top_ks, device=device).clamp(max=vocab)
        sorted_vals = scaled.sort(dim=-1, descending=True).values
        kth = sorted_vals.gather(1, (ks - 1).unsqueeze(1))
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    probs = torch.softmax(scaled, dim=-1)
    if any(p.top_p < 1.0 for p in params):  # decided on the host: no device sync per decode step
        top_ps = torch.tensor([p.top_p for p in params], device=device)
        sorted_probs, order = probs.sort(dim=-1, descending=True)
        # drop a token when the mass before it already reaches top_p (the first token is always kept)
        before = sorted_probs.cumsum(dim=-1) - sorted_probs
        drop_sorted = before >= top_ps.unsqueeze(1)
        drop = torch.zeros_like(drop_sorted).scatter(1, order, drop_sorted)
        probs = probs.masked_fill(drop, 0.0)
    if any(p.min_p > 0 for p in params):
        min_ps = torch.tensor([p.min_p for p in params], device=device)
        threshold = probs.max(dim=-1, keepdim=True).values * min_ps.unsqueeze(1)
        probs = probs.masked_fill(probs < threshold, 0.0)
    return probs / probs.sum(dim=-1, keepdim=True)
