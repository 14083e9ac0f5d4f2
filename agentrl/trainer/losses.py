"""GRPO-family losses as small pure functions on tensors (no Megatron, no distributed state).

Conventions: per-token tensors are ``[B, T]`` (padded response tokens) with a 0/1 float ``mask``; the
log-probs are of the sampled tokens. Every function returns new tensors and never mutates its inputs.
Names follow slime / verl where those exist (``eps_clip``, ``eps_clip_high``, ``eps_clip_c``, ``tis``).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch
from pydantic import ConfigDict, Field, field_validator, model_validator

from agentrl.plugins import resolve
from agentrl.settings import Settings

KLType = Literal["k1", "k2", "k3", "low_var_kl"]
Normalization = Literal["token_mean", "seq_mean", "token_sum"]


# ---------------------------------------------------------------------------------------------- advantages


def grpo_advantages(
    rewards: torch.Tensor, group_ids: Sequence[object], *, scale_by_std: bool = True, eps: float = 1e-6
) -> torch.Tensor:
    """Group-normalised advantages ``(r - mean_g) / (std_g + eps)`` (``scale_by_std=False``: Dr.GRPO).

    ``std`` is the unbiased sample std (as in the GRPO paper / slime); a group of one gets advantage 0.
    """
    rewards = rewards.to(torch.float32)
    if rewards.dim() != 1 or len(group_ids) != rewards.numel():
        raise ValueError(f"rewards must be 1-D with one group id each, got {tuple(rewards.shape)} / {len(group_ids)}")
    out = torch.zeros_like(rewards)
    index: dict[object, list[int]] = {}
    for i, g in enumerate(group_ids):
        index.setdefault(g, []).append(i)
    for members in index.values():
        idx = torch.tensor(members)
        r = rewards[idx]
        centred = r - r.mean()
        if scale_by_std:
            std = r.std() if len(members) > 1 else torch.zeros(())
            centred = centred / (std + eps)
        out[idx] = centred
    return out


def dr_grpo_advantages(rewards: torch.Tensor, group_ids: Sequence[object]) -> torch.Tensor:
    """Dr.GRPO advantages: group mean subtracted, no division by the std (plug-in for ``advantage_fn``)."""
    return grpo_advantages(rewards, group_ids, scale_by_std=False)


# ---------------------------------------------------------------------------------------------- KL


def kl_penalty(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, kind: KLType = "k3") -> torch.Tensor:
    """Per-token estimate of KL(pi || pi_ref) from sampled-token log-probs (Schulman's k1/k2/k3).

    ``low_var_kl`` is k3 clamped to [-10, 10] (verl), which keeps early large ratios from exploding.
    """
    log_ratio = logprobs - ref_logprobs
    if kind == "k1":
        return log_ratio
    if kind == "k2":
        return 0.5 * log_ratio.square()
    if kind in ("k3", "low_var_kl"):
        neg = -log_ratio
        if kind == "low_var_kl":
            neg = neg.clamp(-20.0, 20.0)
        k3 = neg.exp() - 1.0 - neg
        return k3.clamp(-10.0, 10.0) if kind == "low_var_kl" else k3
    raise ValueError(f"unknown KL estimator {kind!r} (k1, k2, k3, low_var_kl)")


def kl_in_reward(
    rewards: torch.Tensor, logprobs: torch.Tensor, ref_logprobs: torch.Tensor, mask: torch.Tensor, coef: float,
    kind: KLType = "k1",
) -> torch.Tensor:
    """Sequence reward minus ``coef`` x summed per-token KL (the "KL in reward" placement)."""
    kl = kl_penalty(logprobs, ref_logprobs, kind) * mask
    return rewards - coef * kl.sum(-1)


# ---------------------------------------------------------------------------------------------- reductions


def reduce_tokens(
    values: torch.Tensor,
    mask: torch.Tensor,
    how: Normalization = "token_mean",
    *,
    n_tokens: float | None = None,
    n_seqs: float | None = None,
) -> torch.Tensor:
    """Reduce ``[B, T]`` per-token values to a scalar.

    ``token_mean``: sum over all tokens / number of tokens (DAPO); ``seq_mean``: mean over sequences of
    each sequence's token mean (GRPO paper); ``token_sum``: plain sum (Dr.GRPO divides by a constant later).
    ``n_tokens`` / ``n_seqs`` replace the local counts, so that micro-batches (and data-parallel ranks)
    each contribute their share of one global mean.
    """
    mask = mask.to(values.dtype)
    if how == "token_mean":
        denom = mask.sum().clamp_min(1.0) if n_tokens is None else n_tokens
        return (values * mask).sum() / denom
    if how == "seq_mean":
        per_seq = (values * mask).sum(-1) / mask.sum(-1).clamp_min(1.0)
        return per_seq.sum() / (per_seq.numel() if n_seqs is None else n_seqs)
    if how == "token_sum":
        return (values * mask).sum()
    raise ValueError(f"unknown normalization {how!r} (token_mean, seq_mean, token_sum)")


# ---------------------------------------------------------------------------------------------- policy loss


def ppo_clip_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    *,
    eps_clip: float = 0.2,
    eps_clip_high: float | None = None,
    eps_clip_c: float | None = None,
    log_ratio: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token PPO clipped surrogate loss and the 0/1 "was clipped" indicator.

    ``ratio`` is clipped to ``[1 - eps_clip, 1 + eps_clip_high]`` (asymmetric: DAPO's clip-higher). With
    ``eps_clip_c`` (> 1) the dual clip bounds the loss of negative-advantage tokens by ``-c * A``.
    ``log_ratio`` overrides ``logprobs - old_logprobs`` (GSPO passes its sequence-level one).
    """
    eps_high = eps_clip if eps_clip_high is None else eps_clip_high
    if log_ratio is None:
        log_ratio = logprobs - old_logprobs
    ratio = log_ratio.exp()
    loss_unclipped = -advantages * ratio
    loss_clipped = -advantages * ratio.clamp(1.0 - eps_clip, 1.0 + eps_high)
    loss = torch.maximum(loss_unclipped, loss_clipped)
    clipped = (loss_clipped > loss_unclipped).to(logprobs.dtype)
    if eps_clip_c is not None:
        if eps_clip_c <= 1.0:
            raise ValueError(f"eps_clip_c must be > 1, got {eps_clip_c}")
        bound = -advantages * eps_clip_c
        dual = torch.minimum(loss, bound)
        clipped = torch.where((advantages < 0) & (loss > bound), torch.ones_like(clipped), clipped)
        loss = torch.where(advantages < 0, dual, loss)
    return loss, clipped


def gspo_log_ratio(logprobs: torch.Tensor, old_logprobs: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """GSPO sequence-level log importance ratio, broadcast to tokens with the per-token gradient.

    ``s_i = mean_t(log pi - log pi_old)`` over the sequence's masked tokens; returned as
    ``sg(s_i) + log pi_t - sg(log pi_t)`` so the value is ``s_i`` at every token (GSPO-token form).
    """
    mask = mask.to(logprobs.dtype)
    seq = ((logprobs - old_logprobs) * mask).sum(-1) / mask.sum(-1).clamp_min(1.0)
    return seq.detach()[:, None] + logprobs - logprobs.detach()


def tis_weights(
    old_logprobs: torch.Tensor, rollout_logprobs: torch.Tensor, *, clip: float = 2.0, clip_low: float = 0.0
) -> torch.Tensor:
    """Truncated importance-sampling weights ``clamp(exp(train_old - rollout), clip_low, clip)`` (no grad).

    Corrects for the rollout engine's sampler differing from the trainer's forward (precision, kernels).
    """
    return (old_logprobs - rollout_logprobs).exp().clamp(clip_low, clip).detach()


# ---------------------------------------------------------------------------------------------- the combined loss


def token_log_ratio(logprobs: torch.Tensor, old_logprobs: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Per-token log importance ratio ``log pi - log pi_old`` (PPO / GRPO)."""
    return logprobs - old_logprobs


def truncated_is_weights(old_logprobs: torch.Tensor, rollout_logprobs: torch.Tensor, cfg: LossConfig) -> torch.Tensor:
    """:func:`tis_weights` with the caps of ``cfg`` (the ``importance_weights="tis"`` plug-in)."""
    return tis_weights(old_logprobs, rollout_logprobs, clip=cfg.tis_clip, clip_low=cfg.tis_clip_low)


def mis_weights(
    old_logprobs: torch.Tensor, rollout_logprobs: torch.Tensor, *, low: float = 0.5, high: float = 2.0
) -> torch.Tensor:
    """Masked importance-sampling weights (IcePop-style, no grad): the ratio ``exp(train_old - rollout)``
    where it lies in ``[low, high]``, 0 elsewhere — a token whose sampler disagrees too much with the
    trainer (a stale weight version, a numerics mismatch) gets no gradient instead of a capped one."""
    ratio = (old_logprobs - rollout_logprobs).exp()
    inside = (ratio >= low) & (ratio <= high)
    return torch.where(inside, ratio, torch.zeros_like(ratio)).detach()


def masked_is_weights(old_logprobs: torch.Tensor, rollout_logprobs: torch.Tensor, cfg: LossConfig) -> torch.Tensor:
    """:func:`mis_weights` with the bounds of ``cfg`` (the ``importance_weights="mis"`` plug-in)."""
    return mis_weights(old_logprobs, rollout_logprobs, low=cfg.mis_low, high=cfg.mis_high)


def importance_ratio_metrics(old_logprobs: torch.Tensor, rollout_logprobs: torch.Tensor, weights: torch.Tensor,
                             mask: torch.Tensor) -> dict[str, torch.Tensor]:
    """Over the masked tokens: the mean and max of the trainer/sampler ratio ``exp(old - rollout)``, and
    the fraction of tokens whose weight is not their ratio (capped by ``tis``, masked out by ``mis``)."""
    mask = mask.to(old_logprobs.dtype)
    ratio = (old_logprobs - rollout_logprobs).exp().detach()
    on = mask > 0
    capped = (~torch.isclose(weights.detach(), ratio, rtol=1e-6, atol=0.0)).to(ratio.dtype)  # a plug-in's float error is no cap
    return {"is_ratio_mean": reduce_tokens(ratio, mask),
            "is_ratio_max": ratio[on].max() if on.any() else ratio.new_zeros(()),
            "is_capped_frac": reduce_tokens(capped, mask)}


# Built-in names of the two loss plug-in points; a "module:attr" path to a user's function of the same
# signature is accepted wherever a name is.
LOG_RATIOS = {"token": token_log_ratio, "gspo": gspo_log_ratio}
IMPORTANCE_WEIGHTS = {"tis": truncated_is_weights, "mis": masked_is_weights}


class LossConfig(Settings):
    """Knobs of :func:`policy_loss` (defaults: GRPO with DAPO-style token-mean, no KL, no entropy).

    Variants are plug-ins rather than flags: ``log_ratio`` ``(logprobs, old_logprobs, mask) -> [B, T]``
    (``token`` or ``gspo``), ``importance_weights`` ``(old_logprobs, rollout_logprobs, cfg) -> [B, T]``
    weights on the policy-gradient term, correcting for the sampler (``tis``, or None)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    eps_clip: float = Field(0.2, description="PPO clip range below 1")
    eps_clip_high: float | None = Field(None, description="clip range above 1 (DAPO clip-higher); None: eps_clip")
    eps_clip_c: float | None = Field(None, description="dual-clip bound (> 1) for negative advantages")
    kl_coef: float = Field(0.0, description="weight of the KL to the reference model (0: no reference model)")
    kl_type: KLType = Field("low_var_kl", description="KL estimator")
    entropy_coef: float = Field(0.0, description="entropy bonus weight")
    log_ratio: str = Field("token", description="importance ratio: token, gspo, or module:attr")
    importance_weights: str | None = Field(None, description="rollout correction: tis (truncated), mis (masked), None, or module:attr")
    tis_clip: float = Field(2.0, description="upper cap of truncated IS weights")
    tis_clip_low: float = Field(0.0, description="lower cap of truncated IS weights")
    mis_low: float = Field(0.5, ge=0, description="masked IS: tokens whose ratio is below this get weight 0")
    mis_high: float = Field(2.0, gt=0, description="masked IS: tokens whose ratio is above this get weight 0")
    normalization: Normalization = Field("token_mean", description="token_mean, seq_mean or token_sum")

    @field_validator("log_ratio", "importance_weights")
    @classmethod
    def _plugin_resolves(cls, value: str | None, info: Any) -> str | None:
        if value is not None:
            resolve(value, LOG_RATIOS if info.field_name == "log_ratio" else IMPORTANCE_WEIGHTS, what=f"loss.{info.field_name}")
        return value

    @model_validator(mode="after")
    def _mis_bounds(self) -> LossConfig:
        if not self.mis_low < 1.0 < self.mis_high:
            raise ValueError(f"masked IS keeps ratios in [mis_low, mis_high]; that range must hold 1 "
                             f"(got [{self.mis_low}, {self.mis_high}])")
        return self


def policy_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    cfg: LossConfig,
    *,
    rollout_logprobs: torch.Tensor | None = None,
    ref_logprobs: torch.Tensor | None = None,
    entropy: torch.Tensor | None = None,
    n_tokens: float | None = None,
    n_seqs: float | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Scalar loss and detached metrics for one batch of ``[B, T]`` response tokens.

    ``advantages`` may be ``[B]`` (one per sequence, broadcast) or ``[B, T]``.
    Metrics: ``pg_loss``, ``clip_frac``, ``kl`` (if ``ref_logprobs``), ``entropy`` (if given),
    ``train_rollout_logprob_abs_diff`` (if ``rollout_logprobs``), ``ratio_mean``; with importance weights
    ``tis_mean`` (the mean weight) and :func:`importance_ratio_metrics`.
    ``n_tokens`` / ``n_seqs``: global denominators (see :func:`reduce_tokens`); metrics stay local means.
    """
    counts = {"n_tokens": n_tokens, "n_seqs": n_seqs}
    mask = mask.to(logprobs.dtype)
    if advantages.dim() == 1:
        advantages = advantages[:, None].expand_as(logprobs)
    log_ratio = resolve(cfg.log_ratio, LOG_RATIOS, what="loss.log_ratio")(logprobs, old_logprobs, mask)
    pg, clipped = ppo_clip_loss(
        logprobs, old_logprobs, advantages, eps_clip=cfg.eps_clip, eps_clip_high=cfg.eps_clip_high,
        eps_clip_c=cfg.eps_clip_c, log_ratio=log_ratio,
    )
    metrics: dict[str, torch.Tensor] = {}
    if cfg.importance_weights is not None:
        if rollout_logprobs is None:
            raise ValueError(f"importance_weights={cfg.importance_weights!r} needs rollout_logprobs")
        w = resolve(cfg.importance_weights, IMPORTANCE_WEIGHTS, what="loss.importance_weights")(
            old_logprobs, rollout_logprobs, cfg)
        pg = pg * w
        metrics["tis_mean"] = reduce_tokens(w, mask).detach()
        metrics.update(importance_ratio_metrics(old_logprobs, rollout_logprobs, w, mask))
    loss = reduce_tokens(pg, mask, cfg.normalization, **counts)
    metrics["pg_loss"] = loss.detach()
    metrics["clip_frac"] = reduce_tokens(clipped, mask).detach()
    ratio = log_ratio.exp()
    metrics["ratio_mean"] = reduce_tokens(ratio.detach(), mask)
    if ref_logprobs is not None:
        kl = kl_penalty(logprobs, ref_logprobs, cfg.kl_type)
        metrics["kl"] = reduce_tokens(kl.detach(), mask)
        if cfg.kl_coef:
            loss = loss + cfg.kl_coef * reduce_tokens(kl, mask, cfg.normalization, **counts)
    elif cfg.kl_coef:
        raise ValueError("kl_coef > 0 needs ref_logprobs")
    if entropy is not None:
        metrics["entropy"] = reduce_tokens(entropy.detach(), mask)
        if cfg.entropy_coef:
            loss = loss - cfg.entropy_coef * reduce_tokens(entropy, mask, cfg.normalization, **counts)
    elif cfg.entropy_coef:
        raise ValueError("entropy_coef > 0 needs entropy")
    if rollout_logprobs is not None:
        metrics["train_rollout_logprob_abs_diff"] = reduce_tokens((old_logprobs - rollout_logprobs).abs().detach(), mask)
    return loss, metrics


AdvantageFn = Callable[[torch.Tensor, Sequence[object]], torch.Tensor]


# ---------------------------------------------------------------------------------------------- distillation

# Sample.metadata key: per response token, the teacher's log-prob of the sampled token, or None where the
# token is no student-sampled token (prompt, tool output, realigned) and so has no teacher target.
TEACHER_LOGPROBS = "teacher_logprobs"
DistillMode = Literal["reverse_kl", "advantage"]


def teacher_targets(samples: Sequence[Any], width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``[b, width]`` teacher log-probs and their 0/1 mask in the padded layout (token ``t`` at column ``t``),
    from each sample's ``metadata[TEACHER_LOGPROBS]`` (absent: no target in that sample)."""
    from agentrl.trainer.batch import sample_field

    values, present = torch.zeros(len(samples), width), torch.zeros(len(samples), width)
    for r, sample in enumerate(samples):
        start = int(sample_field(sample, "response_start"))
        for j, lp in enumerate((sample_field(sample, "metadata") or {}).get(TEACHER_LOGPROBS) or []):
            if lp is not None:
                values[r, start + j], present[r, start + j] = float(lp), 1.0
    return values, present


@dataclass(frozen=True)
class DistillLoss:
    """On-policy distillation's share of the loss: ``coef``, ``mode`` and the task advantage's weight
    ``reward_coef`` (:func:`distill_policy_loss`)."""

    coef: float
    mode: DistillMode
    reward_coef: float = 1.0
    clip: float | None = None

    def bind(self, samples: Sequence[Any], width: int) -> Callable[..., tuple[torch.Tensor, dict[str, torch.Tensor]]]:
        """:func:`policy_loss`'s signature, distilling toward the teacher targets of ``samples`` (a micro-batch's rows)."""
        teacher, present = teacher_targets(samples, width)
        return functools.partial(distill_policy_loss, teacher_logprobs=teacher, teacher_mask=present,
                                 coef=self.coef, mode=self.mode, reward_coef=self.reward_coef, clip=self.clip)


def distill_policy_loss(
    logprobs: torch.Tensor, old_logprobs: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor, cfg: LossConfig,
    *, teacher_logprobs: torch.Tensor, teacher_mask: torch.Tensor, coef: float, mode: DistillMode,
    reward_coef: float = 1.0, clip: float | None = None, **kwargs: Any,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """:func:`policy_loss` with per-token reverse KL to a teacher, on the tokens ``teacher_mask`` marks.

    ``advantage``: the teacher-minus-student log-prob (student: the behaviour log-probs), times ``coef``, joins
    each token's task advantage, through the clip and importance weights. ``reverse_kl``: the task loss plus
    ``coef`` x the sampled reverse KL's score-function surrogate ``sg(lp - lp_teacher) * lp``, whose gradient
    is ``(lp - lp_teacher) grad lp``, that of KL(student || teacher) on the student's own samples (the KL
    itself, differentiated through ``lp`` alone, would have zero expected gradient). The task advantages are
    weighted by ``reward_coef`` first (0: pure distillation, the teacher's signal alone). ``clip`` caps each token's
    teacher-minus-student gap to ``[-clip, clip]`` before ``coef`` (the sampled reverse KL is heavy-tailed: at a
    low temperature one token's gap can be tens of nats, and it then sets the whole step's direction). Metrics add
    ``distill_reverse_kl`` (the mean of ``old - teacher`` over trained tokens, 0 where no target),
    ``distill_target_fraction`` (trained tokens with a teacher target), and the two signals' sizes per trained
    token: ``distill_teacher_adv_abs`` (mean ``|coef x (teacher - old)|``, after the clip), ``distill_task_adv_abs``
    (mean ``|reward_coef x advantage|``); with ``clip``, ``distill_clipped_fraction`` (trained tokens capped)."""
    target = teacher_mask.to(logprobs.dtype) * mask.to(logprobs.dtype)
    gap = (teacher_logprobs - old_logprobs).detach()
    teacher_minus_student = gap * target
    if clip is not None:
        teacher_minus_student = gap.clamp(-clip, clip) * target
    per_token = advantages[:, None].expand_as(logprobs) if advantages.dim() == 1 else advantages
    if reward_coef != 1.0:
        per_token = reward_coef * per_token
    if mode == "advantage":
        loss, metrics = policy_loss(logprobs, old_logprobs, per_token + coef * teacher_minus_student, mask, cfg, **kwargs)
    elif mode == "reverse_kl":
        loss, metrics = policy_loss(logprobs, old_logprobs, per_token, mask, cfg, **kwargs)
        surrogate = -teacher_minus_student * logprobs
        loss = loss + coef * reduce_tokens(surrogate, mask, cfg.normalization, n_tokens=kwargs.get("n_tokens"),
                                           n_seqs=kwargs.get("n_seqs"))
    else:
        raise ValueError(f"unknown distill mode {mode!r} (reverse_kl, advantage)")
    metrics["distill_reverse_kl"] = reduce_tokens(-gap * target, mask)
    if clip is not None:
        metrics["distill_clipped_fraction"] = reduce_tokens((gap.abs() > clip).to(target.dtype) * target, mask)
    metrics["distill_target_fraction"] = reduce_tokens(target, mask)
    metrics["distill_teacher_adv_abs"] = reduce_tokens((coef * teacher_minus_student).abs(), mask)
    metrics["distill_task_adv_abs"] = reduce_tokens(per_token.detach().abs(), mask)
    return loss, metrics
