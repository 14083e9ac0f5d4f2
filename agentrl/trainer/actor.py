"""``MegatronTrainer``: one rank of the GRPO policy trainer (model, optimizer, log-probs, step, checkpoints).

Works as a plain single process (it creates a 1-rank gloo group itself) and under torchrun / one Ray
actor per rank. Every rank receives the *global* batch of Samples in ``train_step``: advantages need
whole groups, and each data-parallel rank then trains on its slice (sample ``i`` -> rank ``i % dp``).
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from agentrl.plugins import load_function as load_callable
from agentrl.trainer.batch import (
    MicroBatch,
    make_micro_batches,
    response_values,
    sample_field,
    sample_reward,
    validate_sample,
)
from agentrl.trainer.cpu_shims import cuda_to_cpu
from agentrl.trainer.lora import adapter_tensors, adapters_off, apply_lora, merged_state_dict
from agentrl.trainer.losses import DistillLoss, kl_in_reward, policy_loss
from agentrl.trainer.model import (
    build_gpt_model,
    causal_mask,
    load_hf_weights,
    megatron_state_dict,
    resolve_attention,
    resolve_packing,
    spec_flavour,
    unwrap,
)
from agentrl.trainer.moe import MoERouting
from agentrl.trainer.parallel import expert_parallel_rank_size, init_model_parallel, tp_rank_size
from agentrl.trainer.trainer_config import TrainerConfig
from agentrl.weights.convert import (
    ModelShape,
    load_hf_config,
    load_hf_state_dict,
    megatron_to_hf_named_tensors,
)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def make_lr_scheduler(optimizer: Any, cfg: TrainerConfig) -> Any:
    """Megatron's ``OptimizerParamScheduler`` for ``cfg``'s LR warm-up and decay, stepped once per optimizer
    step *before* it (so optimizer step n runs at ``get_lr()`` with ``num_steps == n``)."""
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    decay = cfg.lr_decay_steps if cfg.lr_decay_steps is not None else 10**9
    return OptimizerParamScheduler(
        optimizer, init_lr=0.0 if cfg.lr_warmup_steps else cfg.lr, max_lr=cfg.lr, min_lr=cfg.min_lr,
        lr_warmup_steps=cfg.lr_warmup_steps, lr_decay_steps=max(decay, cfg.lr_warmup_steps + 1),
        lr_decay_style=cfg.lr_decay_style, start_wd=cfg.weight_decay, end_wd=cfg.weight_decay,
        wd_incr_steps=1, wd_incr_style="constant",
    )


def _narrowed(before: Sequence[Any], after: Sequence[Any]) -> list[Any]:
    """``after`` if each of its loss masks keeps a subset of ``before``'s trained tokens; else ValueError."""
    after = list(after)
    if len(after) != len(before):
        raise ValueError(f"credit_fn returned {len(after)} samples for {len(before)}")
    for i, (old, new) in enumerate(zip(before, after, strict=True)):
        old_mask, new_mask = sample_field(old, "loss_mask"), sample_field(new, "loss_mask")
        if len(new_mask) != len(old_mask) or any(n and not o for o, n in zip(old_mask, new_mask, strict=True)):
            raise ValueError(f"credit_fn may only withhold training from tokens; sample {i}'s loss mask "
                             "grew or changed length")
    return after


def _who(samples: Sequence[Any], i: int) -> str:
    s = samples[i]
    return f"sample {i} (session {sample_field(s, 'session_id')!r}, group {sample_field(s, 'group_id')!r})"


def _refuse_non_finite(samples: Sequence[Any], what: str, values: Sequence[Sequence[float]]) -> None:
    """``ValueError`` naming the first sample with a NaN or infinite entry in its ``values``: one such
    number reaches every weight through the optimizer's shared state."""
    for i, row in enumerate(values):
        if not math.isfinite(sum(row)):  # one C-speed pass (NaN and inf survive a sum); the entry only if needed
            bad = next((j for j, x in enumerate(row) if not math.isfinite(x)), None)
            where = f"[{bad}] is {row[bad]}" if bad is not None else " overflows"
            raise ValueError(f"{_who(samples, i)}: {what}{where}; the batch is refused, nothing was trained")


def _checked_rewards(samples: Sequence[Any], reward_key: str | None) -> list[float]:
    """Each sample's reward, after validating the samples and refusing a non-finite reward or rollout
    log-prob (naming the sample)."""
    for i, s in enumerate(samples):
        validate_sample(s, i)
    rewards = [sample_reward(s, reward_key) for s in samples]
    _refuse_non_finite(samples, "reward", [[r] for r in rewards])
    _refuse_non_finite(samples, "rollout_logprobs", [sample_field(s, "rollout_logprobs") or [] for s in samples])
    return rewards


@dataclass(frozen=True)
class _StepPlan:
    """What every mini-batch of one train step reads: the (credited) global batch, its advantages, the
    behaviour and reference log-probs per global sample index, and the loss settings."""

    samples: list[Any]
    advantages: list[float]
    old_from_train: bool  # behaviour log-probs are the training forward's own (detached)
    old_by_sample: dict[int, torch.Tensor] | None
    ref_by_sample: dict[int, torch.Tensor] | None
    loss_cfg: Any


def _pad_rows(rows: list[torch.Tensor], width: int) -> torch.Tensor:
    out = rows[0].new_zeros(len(rows), width)
    for r, t in enumerate(rows):
        out[r, : t.numel()] = t
    return out


def metric_kind(name: str) -> str:
    """How micro-batch values of step metric ``name`` combine: ``max`` (``*_max``), ``min`` (``*_min``),
    ``sum`` (``loss``: each micro-batch's is already its share of the global mean) or ``mean`` (weighted
    by the micro-batch's trained tokens)."""
    if name.endswith("_max"):
        return "max"
    if name.endswith("_min"):
        return "min"
    return "sum" if name == "loss" else "mean"


def accumulate_metric(totals: dict[str, float], name: str, value: float, weight: float) -> None:
    """Fold one micro-batch's ``value`` of ``name`` (over ``weight`` trained tokens) into ``totals``.

    A micro-batch without trained tokens has no max or min to give (its 0 is a placeholder): it enters
    only the neutral -inf (+inf), so that every rank still holds the name for :func:`reduce_metrics`."""
    kind = metric_kind(name)
    if kind == "mean":
        totals[name] = totals.get(name, 0.0) + value * weight
    elif kind == "sum":
        totals[name] = totals.get(name, 0.0) + value
    else:
        pick, neutral = (max, -math.inf) if kind == "max" else (min, math.inf)
        totals[name] = pick(totals.get(name, neutral), value if weight > 0 else neutral)


def reduce_metrics(totals: dict[str, float], token_weight: float, *, group: Any = None,
                   device: Any = "cpu") -> dict[str, float]:
    """Finish :func:`accumulate_metric`'s ``totals`` of this rank's ``token_weight`` trained tokens: sums
    and token weights are summed over the ranks of ``group`` (None: this process only), maxima max-reduced,
    minima min-reduced. Every rank must hold the same metric names. A max or min no rank saw a trained
    token for is 0, as :func:`agentrl.trainer.losses.importance_ratio_metrics` reports an empty batch."""
    keys = sorted(totals)
    additive = [k for k in keys if metric_kind(k) in ("sum", "mean")]
    extreme = {"max": [k for k in keys if metric_kind(k) == "max"], "min": [k for k in keys if metric_kind(k) == "min"]}
    sums = torch.tensor([totals[k] for k in additive] + [token_weight], dtype=torch.float64, device=device)
    # A rank that saw no trained token for a max (min) holds -inf (+inf): it never wins.
    fill = {"max": -math.inf, "min": math.inf}
    extremes = {kind: torch.tensor([totals[k] for k in names], dtype=torch.float64, device=device)
                for kind, names in extreme.items()}
    if group is not None:
        dist.all_reduce(sums, group=group)
        for kind, op in (("max", dist.ReduceOp.MAX), ("min", dist.ReduceOp.MIN)):
            if extreme[kind]:
                dist.all_reduce(extremes[kind], op=op, group=group)
    total_weight = sums[-1].item()
    weight = max(total_weight, 1.0)
    out = {k: sums[i].item() if metric_kind(k) == "sum" else sums[i].item() / weight for i, k in enumerate(additive)}
    for kind, names in extreme.items():
        for i, k in enumerate(names):
            value = extremes[kind][i].item()
            out[k] = value if value != fill[kind] else 0.0
    return out


class MegatronTrainer:
    """GRPO-family trainer over a megatron-core ``GPTModel`` loaded from a HF checkpoint directory."""

    def __init__(self, model_dir: str | Path | None, config: TrainerConfig | None = None, *,
                 temperature: float = 1.0, hf_config: Any = None) -> None:
        """Load ``model_dir`` (a local HF checkpoint), or with ``model_dir=None`` build a random-init model
        shaped by ``hf_config`` (benchmarks; the reference model is then a copy of the same init).

        ``temperature``: the one the samples were drawn at; log-probs are of ``logits / temperature``, so
        any other value makes the importance ratio wrong from the first token."""
        from megatron.core import parallel_state

        if not (math.isfinite(temperature) and temperature > 0):
            raise ValueError(f"temperature must be a finite number > 0, got {temperature}")
        self.temperature = temperature
        self.config = cfg = config or TrainerConfig()
        if model_dir is None and hf_config is None:
            raise ValueError("give a model directory or, for a random-init model, hf_config")
        self.model_dir = Path(model_dir) if model_dir is not None else None
        init_model_parallel(cfg.tp_size, seed=cfg.seed, ep_size=cfg.moe.expert_parallel_size)
        self.tp_rank, self.tp_size = tp_rank_size()
        self.dp_rank = parallel_state.get_data_parallel_rank()
        self.dp_size = parallel_state.get_data_parallel_world_size()
        self.dtype = _DTYPES[cfg.dtype]
        self.attention = resolve_attention(cfg.attention)
        self.packed = resolve_packing(cfg.packing, cfg.attention)
        self.hf_config = hf_config if hf_config is not None else load_hf_config(self.model_dir)
        self.shape = ModelShape.from_hf_config(self.hf_config)
        self.device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")

        self.gpt = self._build(self.model_dir)
        self.moe = MoERouting(self.gpt, replay=cfg.moe.routing_replay)  # falsy for a dense model
        if cfg.lora.enabled:  # before DDP and the optimizer: they see only the adapters as trainable
            apply_lora(self.gpt, cfg.lora, self.shape, tp_rank=self.tp_rank, tp_size=self.tp_size, seed=cfg.seed)
        self.model = self._wrap_ddp(self._mixed_precision(self.gpt))
        self.optimizer = self._build_optimizer()
        self.scheduler = self._build_scheduler()
        self.ref_model = None
        # LoRA's reference is its frozen base (the initial policy): the policy with its adapters off, no copy
        self.ref_is_base = cfg.needs_ref and cfg.lora.enabled and cfg.ref_model_dir is None
        if cfg.needs_ref and not self.ref_is_base:
            ref_dir = cfg.ref_model_dir or self.model_dir
            self.ref_model = self._mixed_precision(self._build(Path(ref_dir) if ref_dir else None))
            if ref_dir is None:
                unwrap(self.ref_model).load_state_dict(self.gpt.state_dict())
            for p in self.ref_model.parameters():
                p.requires_grad_(False)
        self.advantage_fn = load_callable(cfg.advantage_fn)
        self.credit_fn = load_callable(cfg.credit_fn) if cfg.credit_fn else None
        self.distill: DistillLoss | None = None  # set by a run that distills (agentrl.run.distill)
        self.step = 0

    # ------------------------------------------------------------------------------------------ construction

    def _build(self, model_dir: Path | None):
        model = build_gpt_model(
            self.hf_config, tp_size=self.tp_size, dtype=self.dtype, attention=self.attention,
            recompute=self.config.recompute, recompute_modules=self.config.recompute_modules,
            init_weights=model_dir is None, moe=self.config.moe,
        )
        if model_dir is None:
            return model
        hf_state = load_hf_state_dict(model_dir)
        load_hf_weights(model, hf_state, self.hf_config, tp_rank=self.tp_rank, tp_size=self.tp_size,
                        attention=self.attention, **expert_parallel_rank_size())
        return model

    def _mixed_precision(self, model):
        if self.dtype == torch.float32:
            return model
        from megatron.core.transformer.module import Float16Module

        # bf16 compute with fp32 logits at the output; the optimizer keeps fp32 main params.
        return Float16Module(model.config, model)

    def _wrap_ddp(self, model):
        from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

        ddp_config = DistributedDataParallelConfig(
            grad_reduce_in_fp32=True,
            overlap_grad_reduce=False,
            use_distributed_optimizer=self.config.use_distributed_optimizer,
        )
        with cuda_to_cpu():
            return DistributedDataParallel(config=self.gpt.config, ddp_config=ddp_config, module=model)

    def _build_optimizer(self):
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

        cfg = self.config
        opt_config = OptimizerConfig(
            optimizer=cfg.optimizer, sgd_momentum=0.0, lr=cfg.lr, min_lr=cfg.min_lr, weight_decay=cfg.weight_decay,
            adam_beta1=cfg.adam_beta1, adam_beta2=cfg.adam_beta2, adam_eps=cfg.adam_eps,
            clip_grad=cfg.clip_grad, bf16=self.dtype == torch.bfloat16, params_dtype=self.dtype,
            use_distributed_optimizer=cfg.use_distributed_optimizer,
            # Adam's state and update move to the CPU; the fp32 main params stay on the device (Megatron-LM pairs
            # offload with the precision-aware optimizer, which in megatron-core 0.16.1 cannot start without TE).
            optimizer_cpu_offload=cfg.optimizer_cpu_offload, optimizer_offload_fraction=cfg.optimizer_offload_fraction,
            overlap_cpu_optimizer_d2h_h2d=cfg.overlap_cpu_optimizer_d2h_h2d,
        )
        with cuda_to_cpu():
            optimizer = get_megatron_optimizer(opt_config, [self.model])
        if torch.cuda.is_available():  # foreach/fused in place of Megatron's per-tensor fallbacks (no TE/Apex)
            from agentrl.trainer import fast_optimizer

            fast_optimizer.install()
            fast_optimizer.fuse_adam(optimizer)
        return optimizer

    def _build_scheduler(self):
        return make_lr_scheduler(self.optimizer, self.config)

    # ------------------------------------------------------------------------------------------ forward

    def _forward(self, model, mb: MicroBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """``(hidden, weight)``: the output layer's input ``[b, L, h]`` (packed: ``[1, T, h]``) in the model's
        dtype and its weight ``[V/tp, h]`` (tied: the embedding's). The output layer itself is skipped:
        :mod:`agentrl.trainer.chunked_logprobs` applies it chunk by chunk, so no ``(tokens, vocab)``
        logits exist at once."""
        layer = unwrap(model).output_layer
        seen: dict[str, torch.Tensor] = {}

        def skip(input_, weight=None, runtime_gather_output=None):  # ColumnParallelLinear's signature
            seen["weight"] = layer.weight if weight is None else weight
            return input_, None

        layer.forward = skip
        try:
            hidden = self._model_forward(model, mb)
        finally:
            del layer.forward
        return hidden, seen["weight"]

    def _model_forward(self, model, mb: MicroBatch) -> torch.Tensor:
        mb = mb.to(self.device)
        self.moe.route(mb)  # the routers replay (or compare with) this micro-batch's recorded experts
        # Float16Module upcasts its output unless told not to (no such wrapper, no such argument, in fp32)
        kwargs = {} if self.dtype == torch.float32 else {"fp32_output": False}
        if mb.packed is not None:
            from agentrl.trainer.attention import packed_seq_params

            out = model(mb.packed.tokens, mb.packed.position_ids, None,
                        packed_seq_params=packed_seq_params(mb.packed, host_cu_seqlens=self.attention != "te"),
                        **kwargs)
        else:
            # Megatron's own DotProductAttention needs the explicit causal mask; SDPA / TE are causal by spec.
            mask = causal_mask(mb.tokens.shape[1], self.device) if self.attention == "local" else None
            out = model(mb.tokens, mb.position_ids, mask, **kwargs)
        return out

    def _fused_logprobs(self, entropy_grad: bool = False) -> bool:
        """Whether the log-prob chunks run in the one-pass Triton kernels (:mod:`agentrl.trainer.fused_logprobs`:
        CUDA, one TP rank, no gradient through the entropy) rather than fp32 torch ops."""
        from agentrl.trainer import fused_logprobs

        return not entropy_grad and fused_logprobs.available(self.device, self.tp_size)

    def _trained_positions(self, mb: MicroBatch) -> torch.Tensor | None:
        """Packed positions whose logits predict a trained token (loss mask 1): on the CPU with one TP rank
        only these go through the output layer, the log-probs and the entropy in a train step (on the main
        job fewer than half the positions: the prompts and tool replies are not trained). None: all."""
        p = mb.packed
        if p is None or self.tp_size != 1 or self.device.type != "cpu":
            return None
        trained = torch.zeros(p.tokens.shape[1], dtype=torch.bool)
        interior = p.interior.cpu()
        trained[interior] = mb.loss_mask.reshape(-1).cpu()[p.flat_index.cpu()[interior]] > 0
        if not trained.any():  # nothing trained here: an empty output layer call gains nothing
            return None
        return (trained.nonzero().squeeze(1) - 1).to(self.device)

    def _logprobs_entropy(self, model, mb: MicroBatch, entropy_grad: bool,
                          trained_only: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """``([b, L] log-probs, [b, L] entropy)`` of one micro-batch, unpacked; the entropy carries a
        gradient only with ``entropy_grad``. ``trained_only``: values only where the loss mask is 1 (0
        elsewhere), which on the CPU skips the output layer at every other position."""
        from megatron.core import parallel_state

        from agentrl.trainer.chunked_logprobs import linear_logprobs_and_entropy, shifted_logprobs_and_entropy

        positions = self._trained_positions(mb) if trained_only else None
        hidden, weight = self._forward(model, mb)
        tokens = mb.model_tokens
        kwargs = dict(entropy_grad=entropy_grad and torch.is_grad_enabled(),
                      tp_group=parallel_state.get_tensor_model_parallel_group() if self.tp_size > 1 else None)
        if positions is None:
            lp, entropy = shifted_logprobs_and_entropy(hidden, weight, tokens, self.temperature, **kwargs)
            return mb.unpack(lp), mb.unpack(entropy)
        # The other positions hold 0: no loss, metric or ratio reads them (they are masked).
        lp, entropy = linear_logprobs_and_entropy(hidden[0, positions], weight, tokens[0, positions + 1],
                                                  self.temperature, **kwargs)
        at = (torch.zeros_like(positions), positions + 1)
        return (mb.unpack(lp.new_zeros(tokens.shape).index_put(at, lp)),
                mb.unpack(entropy.new_zeros(tokens.shape).index_put(at, entropy)))

    def _micro_batches(self, samples: Sequence[Any], advantages=None) -> list[MicroBatch]:
        mbs = make_micro_batches(samples, self.config.max_tokens_per_microbatch, advantages, self.config.pad_id,
                                 packed=self.packed)
        if self.moe:
            self.moe.attach(mbs, samples)  # the engine's expert choices, in each micro-batch's token order
        return mbs

    @torch.no_grad()
    def _logprobs_per_mb(self, model, mbs: list[MicroBatch], trained_only: bool = False) -> list[torch.Tensor]:
        model.eval()
        return [self._logprobs_entropy(model, mb, False, trained_only)[0] for mb in mbs]

    @torch.no_grad()
    def compute_logprobs(self, samples: Sequence[Any]) -> list[list[float]]:
        """Log-probs of each sample's ``tokens[response_start:]`` under the current policy (input order)."""
        for i, s in enumerate(samples):
            validate_sample(s, i)
        out: list[list[float]] = [[] for _ in samples]
        mbs = self._micro_batches(samples)
        for mb, lp in zip(mbs, self._logprobs_per_mb(self.model, mbs), strict=True):
            for i, values in zip(mb.index, response_values(lp, mb), strict=True):
                out[i] = values
        return out

    # ------------------------------------------------------------------------------------------ training

    def _local_indices(self, n: int, rank: int) -> list[int]:
        return [i for i in range(n) if i % self.dp_size == rank]

    def _minibatch_chunks(self, indices: list[int], n_total: int) -> list[list[int]]:
        # Every data-parallel rank must take the same number of optimizer steps: cap by the smallest slice.
        k = max(1, min(self.config.steps_per_batch, n_total // self.dp_size))
        return [indices[j::k] for j in range(k)]

    def _skip(self, metrics: dict[str, float]) -> dict[str, float]:
        """Count a step that changes no weight (the LR schedule still advances, as for a taken step)."""
        self.step += 1
        self.scheduler.step(increment=1)
        return {**metrics, "skipped": 1.0, "step": float(self.step)}

    def train_step(self, samples: Sequence[Any]) -> dict[str, float]:
        """One GRPO update on the global batch ``samples``; returns averaged metrics.

        A batch whose every advantage is zero trains nothing and is skipped (``skipped: 1``), weights
        unchanged; choosing which groups are worth training is the data buffer's group filter.

        A NaN or infinite reward, rollout log-prob or advantage is a ``ValueError`` naming the sample,
        raised before any optimizer step (weights, step and LR schedule unchanged). An optimizer step
        whose loss or gradients come out non-finite is not taken (its weights unchanged) and counted in
        ``nonfinite_steps``; ``skipped: 1`` when no step of the batch was taken."""
        cfg = self.config
        samples = list(samples)
        rewards = _checked_rewards(samples, cfg.reward_key)
        reward_t = torch.tensor(rewards, dtype=torch.float32)
        groups = [sample_field(s, "group_id") for s in samples]
        metrics: dict[str, float] = {"reward_mean": sum(rewards) / max(len(rewards), 1),
                                     "n_samples": float(len(samples))}
        # With KL in the reward the advantages need the forward below; otherwise they are known now.
        advantages = None if cfg.kl_in_reward else self._advantages(samples, reward_t, groups, "advantage")
        # Distillation trains every token toward the teacher, task advantages or not.
        if len(samples) < self.dp_size or (advantages is not None and not any(advantages) and self.distill is None):
            return self._skip(metrics)

        local = self._local_indices(len(samples), self.dp_rank)
        mbs = self._micro_batches([samples[i] for i in local])
        chunks = self._minibatch_chunks(local, len(samples))
        old_from_train = self._old_from_train_forward(len(chunks))
        old, ref = self._behaviour_and_reference(mbs, old_from_train)
        if cfg.kl_in_reward:
            if ref is None:
                raise ValueError("kl_in_reward needs loss.kl_coef > 0 (it sets the coefficient)")
            adjusted = self._rewards_with_kl(reward_t, mbs, old, ref, local)
            metrics["kl_reward_penalty"] = float((reward_t - adjusted).mean())
            advantages = self._advantages(samples, adjusted, groups, "advantage (KL in the reward)")
        if self.credit_fn is not None:
            samples, metrics["credit_withheld_tokens"] = self._credited(samples, advantages)

        plan = _StepPlan(
            samples=samples, advantages=advantages, old_from_train=old_from_train,
            old_by_sample=self._per_sample(mbs, old, local) if old is not None else None,
            ref_by_sample=self._per_sample(mbs, ref, local) if ref is not None else None,
            # With KL in the reward, the loss must not add it a second time.
            loss_cfg=cfg.loss.model_copy(update={"kl_coef": 0.0}) if cfg.kl_in_reward else cfg.loss,
        )
        totals: dict[str, float] = {}
        token_weight, nonfinite = 0.0, 0
        for chunk_no, chunk in enumerate(chunks):
            weight, finite, grad_norm, lr = self._train_minibatch(plan, chunk_no, chunk, totals)
            token_weight += weight
            nonfinite += not finite
        self.step += 1
        if nonfinite:
            metrics["nonfinite_steps"] = float(nonfinite)
            if nonfinite == len(chunks):
                metrics["skipped"] = 1.0
        metrics.update(self._reduce_metrics(totals, token_weight))
        metrics["grad_norm"] = float(grad_norm) if grad_norm is not None else float("nan")
        metrics["lr"] = lr
        metrics["n_tokens"] = float(sum(sum(sample_field(s, "loss_mask")) for s in samples))
        metrics["step"] = float(self.step)
        metrics.update(self.moe.metrics())  # moe/*: router losses, expert load, routing mismatch
        return metrics

    def _advantages(self, samples: list[Any], rewards: torch.Tensor, groups: list[Any], what: str) -> list[float]:
        """``advantage_fn`` of ``rewards`` per group, refused (naming the sample) if any is not finite."""
        advantages = self.advantage_fn(rewards, groups).tolist()
        _refuse_non_finite(samples, what, [[a] for a in advantages])
        return advantages

    def _behaviour_and_reference(self, mbs: list[MicroBatch], old_from_train: bool):
        """Behaviour (``old``) and reference log-probs per micro-batch of the local slice, before any update.

        With one mini-batch and no KL in the reward (``old_from_train``), the training forward itself runs
        at these weights on these micro-batches: its detached log-probs are the behaviour log-probs (the
        same values), one forward fewer, and ``old`` is None. Only trained tokens' values are computed
        (the losses, ratios and metrics are masked)."""
        if old_from_train:
            old = None
        elif self.config.old_logprobs == "train":
            old = self._logprobs_per_mb(self.model, mbs, True)
        else:
            old = [mb.rollout_logprobs.to(self.device) for mb in mbs]
        ref = self._logprobs_per_mb(self.ref_model, mbs, True) if self.ref_model is not None else None
        if self.ref_is_base:
            with adapters_off(self.gpt):
                ref = self._logprobs_per_mb(self.model, mbs, True)
        return old, ref

    def _credited(self, samples: list[Any], advantages: list[float]) -> tuple[list[Any], float]:
        """``credit_fn``'s samples (loss masks only narrowed) and how many trained tokens it withheld."""
        before = sum(sum(sample_field(s, "loss_mask")) for s in samples)
        after = _narrowed(samples, self.credit_fn(samples, advantages))
        return after, float(before - sum(sum(sample_field(s, "loss_mask")) for s in after))

    def _global_denominators(self, samples: list[Any], chunk_no: int) -> tuple[float, float]:
        """``(sequences, trained tokens)`` of mini-batch ``chunk_no`` across all data-parallel ranks."""
        n = len(samples)
        peers = [self._minibatch_chunks(self._local_indices(n, r), n)[chunk_no] for r in range(self.dp_size)]
        n_seqs = float(sum(len(p) for p in peers))
        n_tokens = float(sum(sum(sample_field(samples[i], "loss_mask")) for p in peers for i in p))
        return max(n_seqs, 1.0), max(n_tokens, 1.0)

    def _train_minibatch(self, plan: _StepPlan, chunk_no: int, chunk: list[int],
                         totals: dict[str, float]) -> tuple[float, bool, Any, float]:
        """Accumulate gradients over mini-batch ``chunk``'s micro-batches and take one optimizer step
        (not taken if its loss or a gradient is non-finite); metrics go into ``totals``. Returns
        ``(trained tokens, step taken, grad norm, lr)``."""
        n_seqs, n_tokens = self._global_denominators(plan.samples, chunk_no)
        self.model.train()
        self.model.zero_grad_buffer()
        self.optimizer.zero_grad()
        chunk_loss, token_weight = 0.0, 0.0
        chunk_samples = [plan.samples[i] for i in chunk]
        for mb in self._micro_batches(chunk_samples, [plan.advantages[i] for i in chunk]):
            loss, m = self._micro_batch_loss(plan, mb, chunk, n_tokens, n_seqs)
            # DDP averages gradients over data-parallel ranks; the denominators are already global.
            (loss * self.dp_size).backward()
            w = float(mb.n_tokens)
            token_weight += w
            chunk_loss += float(loss.detach())
            totals["loss"] = totals.get("loss", 0.0) + float(loss.detach())
            for k, v in m.items():
                if k != "pg_loss":
                    accumulate_metric(totals, k, float(v), w)
        # Scheduler first: optimizer step n runs at lr(n), so a warm-up's first step is not at lr(0) = 0.
        self.scheduler.step(increment=1)
        lr = float(self.optimizer.param_groups[0]["lr"])
        with cuda_to_cpu():
            self.model.finish_grad_sync()
            if not self._all_finite(chunk_loss):
                return token_weight, False, float("nan"), lr
            _, grad_norm, _ = self.optimizer.step()
        return token_weight, True, grad_norm, lr

    def _micro_batch_loss(self, plan: _StepPlan, mb: MicroBatch, chunk: list[int], n_tokens: float,
                          n_seqs: float) -> tuple[torch.Tensor, dict[str, Any]]:
        """The policy loss (its share of the global mean) and metrics of one micro-batch of ``chunk``."""
        ids = [chunk[j] for j in mb.index]
        width = mb.tokens.shape[1]
        ref_lp = _pad_rows([plan.ref_by_sample[i] for i in ids], width) if plan.ref_by_sample else None
        lp, entropy = self._logprobs_entropy(self.model, mb, entropy_grad=plan.loss_cfg.entropy_coef != 0,
                                             trained_only=True)
        old_lp = lp.detach() if plan.old_from_train else _pad_rows([plan.old_by_sample[i] for i in ids], width)
        has_rollout = all(sample_field(plan.samples[i], "rollout_logprobs") for i in ids)
        loss_fn = policy_loss if self.distill is None else self.distill.bind([plan.samples[i] for i in ids], width)
        return loss_fn(
            lp, old_lp, mb.advantages, mb.loss_mask, plan.loss_cfg,
            rollout_logprobs=mb.rollout_logprobs if has_rollout else None,
            ref_logprobs=ref_lp if not self.config.kl_in_reward else None,
            entropy=entropy, n_tokens=n_tokens, n_seqs=n_seqs,
        )

    def _old_from_train_forward(self, n_chunks: int) -> bool:
        """Whether the behaviour log-probs can be the training forward's own: a fresh forward is asked for
        (``old_logprobs="train"``), the batch is one mini-batch (so no step precedes its forward), and no
        KL in the reward needs them before the advantages."""
        cfg = self.config
        return cfg.old_logprobs == "train" and n_chunks == 1 and not cfg.kl_in_reward

    def _all_finite(self, loss: float) -> bool:
        """Whether ``loss`` and every gradient are finite on every rank (all must agree to step or not)."""
        bad = torch.zeros((), device=self.device)
        for buffer in self.model.buffers + self.model.expert_parallel_buffers:
            bad += (~torch.isfinite(buffer.grad_data)).any()
        bad += not math.isfinite(loss)
        if dist.get_world_size() > 1:
            dist.all_reduce(bad)
        return not bad.item()

    @staticmethod
    def _per_sample(mbs: list[MicroBatch], values: list[torch.Tensor], local: list[int]) -> dict[int, torch.Tensor]:
        """Unpad ``[b, L]`` per-micro-batch tensors into ``{global sample index: [len]}``."""
        out = {}
        for mb, v in zip(mbs, values, strict=True):
            for row, (i, n) in enumerate(zip(mb.index, mb.lengths, strict=True)):
                out[local[i]] = v[row, :n]
        return out

    def _rewards_with_kl(self, reward_t, mbs, old, ref, local) -> torch.Tensor:
        """Rewards minus ``kl_coef`` x summed KL, gathered across data-parallel ranks."""
        from megatron.core import parallel_state

        adjusted = {}
        for mb, o, r in zip(mbs, old, ref, strict=True):
            new = kl_in_reward(reward_t[[local[i] for i in mb.index]].to(o.device), o, r, mb.loss_mask.to(o.device),
                               self.config.loss.kl_coef, self.config.loss.kl_type)
            adjusted.update({local[i]: float(v) for i, v in zip(mb.index, new, strict=True)})
        if self.dp_size > 1:
            parts: list[dict] = [{} for _ in range(self.dp_size)]
            dist.all_gather_object(parts, adjusted, group=parallel_state.get_data_parallel_group())
            for p in parts:
                adjusted.update(p)
        return torch.tensor([adjusted[i] for i in range(len(reward_t))], dtype=torch.float32)

    def _reduce_metrics(self, totals: dict[str, float], token_weight: float) -> dict[str, float]:
        """Step metrics from :func:`accumulate_metric`'s ``totals``, reduced over data-parallel ranks."""
        from megatron.core import parallel_state

        group = parallel_state.get_data_parallel_group() if self.dp_size > 1 else None
        return reduce_metrics(totals, token_weight, group=group, device=self.device)

    # ------------------------------------------------------------------------------------------ weights

    def export_hf_named_tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Stream ``(hf_name, full tensor)`` of the current policy (all TP ranks must iterate together)."""
        from megatron.core import parallel_state

        group = parallel_state.get_tensor_model_parallel_group() if self.tp_size > 1 else None
        ep_group = parallel_state.get_expert_model_parallel_group() if self.config.moe.expert_parallel_size > 1 else None
        state = merged_state_dict(self.gpt) if self.config.lora.enabled else megatron_state_dict(self.gpt)
        return megatron_to_hf_named_tensors(state, self.shape, spec=spec_flavour(self.attention), tp_group=group,
                                            ep_group=ep_group)

    def export_adapter_tensors(self) -> Iterator[tuple[str, torch.Tensor, torch.Tensor]]:
        """``(hf_module, A, B)`` of every LoRA adapter, full tensors, ``B`` unscaled (all TP ranks iterate)."""
        from megatron.core import parallel_state

        return adapter_tensors(self.gpt, tp_group=parallel_state.get_tensor_model_parallel_group()
                               if self.tp_size > 1 else None)

    # ------------------------------------------------------------------------------------------ checkpoints

    def save_checkpoint(self, directory: str | Path, extra_state: dict[str, Any] | None = None) -> Path:
        """Save model, optimizer, scheduler, RNG, step and ``extra_state`` (e.g. buffer cursor, weight version)."""
        from agentrl.trainer.checkpoint import save_checkpoint

        return save_checkpoint(directory, self.gpt, self.optimizer, self.scheduler, step=self.step,
                               extra_state=extra_state)

    def load_checkpoint(self, directory: str | Path) -> dict[str, Any]:
        """Restore a checkpoint written by :meth:`save_checkpoint`; returns its ``extra_state``.

        ``FileNotFoundError`` for a missing directory or one that is no checkpoint;
        :class:`agentrl.trainer.checkpoint.CheckpointError` for an incomplete or mismatched one.
        """
        from agentrl.trainer.checkpoint import load_checkpoint

        self.step, extra = load_checkpoint(directory, self.gpt, self.optimizer, self.scheduler)
        return extra
