"""Mixture-of-experts in the trainer: the ``trainer.moe`` settings, megatron-core's MoE layer arguments, the
router's metrics and routing replay.

Routing replay: the engine reports, for each sampled token, the experts every MoE layer chose at the position
whose logits the token was drawn from (the previous position: ``Sample.routed_experts[i]`` belongs to
``tokens[response_start + i]`` and was routed at position ``response_start + i - 1``). With
``routing_replay`` the trainer's router takes exactly those experts at those positions (the weights are its
own softmax over the chosen experts' logits, so the router still learns); every other position routes
freely. Without replay the same records measure how often the trainer would have routed differently
(``moe/routing_mismatch``).

Metrics (``moe/*``, averaged over the step's training forwards and the MoE layers): ``aux_loss`` (the
Switch load-balancing loss ``E / (k T^2) * sum_e tokens_e * sum_t p_te``, 1.0 when balanced),
``z_loss`` (mean squared log-sum-exp of the router logits), ``load_max`` / ``load_min`` (tokens of the
busiest / idlest expert over the mean), and with routing records ``routing_mismatch`` (the share of
recorded (token, layer) choices the trainer's free top-k differs from) and ``replayed_tokens``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from pydantic import Field

from agentrl.settings import Settings


class MoEConfig(Settings):
    """Mixture-of-experts options of the trainer (ignored for dense models)."""

    routing_replay: bool = Field(False, description="force the experts the engine chose for each sampled token")
    aux_loss_coeff: float = Field(0.0, ge=0, description="load-balancing (Switch aux) loss coefficient")
    z_loss_coeff: float = Field(0.0, ge=0, description="router z-loss coefficient")
    expert_parallel_size: int = Field(1, ge=1, description="expert-parallel size (over the data-parallel ranks)")


def transformer_kwargs(shape: Any, moe: MoEConfig | None) -> dict[str, Any]:
    """``TransformerConfig`` arguments for the MoE layers of ``shape`` (a ``ModelShape``); {} when dense.

    Qwen3-MoE routing: softmax over all experts then top-k, renormalised over the k when ``norm_topk_prob``
    (= Megatron's top-k of the logits then softmax over the k), else not (= ``moe_router_pre_softmax``).
    No capacity factor: no token is ever dropped."""
    if not shape.num_experts:
        return {}
    _define_missing_te_gemm()
    moe = moe or MoEConfig()
    return dict(
        num_moe_experts=shape.num_experts,
        moe_router_topk=shape.moe_topk,
        moe_ffn_hidden_size=shape.moe_ffn_hidden_size,
        moe_router_pre_softmax=not shape.moe_norm_topk_prob,
        moe_router_load_balancing_type="aux_loss" if moe.aux_loss_coeff > 0 else "none",
        moe_aux_loss_coeff=moe.aux_loss_coeff,
        moe_z_loss_coeff=moe.z_loss_coeff or None,
        moe_token_dispatcher_type="alltoall",  # uneven token counts per rank (allgather needs them equal)
        moe_grouped_gemm=False,
        moe_expert_capacity_factor=None,
        expert_model_parallel_size=moe.expert_parallel_size,
    )


def _define_missing_te_gemm() -> None:
    """megatron-core 0.16.1's router gating reads ``te_general_gemm``, which it defines only when
    TransformerEngine imports; without TE it must be None (its torch fallback then runs). On the CPU its
    alltoall dispatcher's device-to-host copies, made on a CUDA side stream, are plain (the tensors already
    live on the host)."""
    from megatron.core.transformer.moe import moe_utils
    from megatron.core.transformer.moe.token_dispatcher import MoEAlltoAllTokenDispatcher

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None
    if not torch.cuda.is_available() and MoEAlltoAllTokenDispatcher.cuda_dtoh_stream is None:
        MoEAlltoAllTokenDispatcher.cuda_dtoh_stream = "host"  # not None: no CUDA stream is made
        MoEAlltoAllTokenDispatcher._maybe_dtoh_and_synchronize = _host_dtoh


def _host_dtoh(self: Any, point: str, tokens_per_expert: torch.Tensor | None = None) -> torch.Tensor | None:
    """``MoEAlltoAllTokenDispatcher._maybe_dtoh_and_synchronize`` without streams: the split sizes as numpy."""
    if not self.drop_and_pad and point == self.cuda_dtoh_point:
        for name in ("input_splits", "output_splits", "output_splits_tp"):
            value = getattr(self, name)
            if isinstance(value, torch.Tensor):
                setattr(self, name, value.numpy())
    return tokens_per_expert


def routers(model: torch.nn.Module) -> list[Any]:
    """The model's MoE routers, in layer order."""
    from megatron.core.transformer.moe.router import TopKRouter

    return [m for m in model.modules() if isinstance(m, TopKRouter)]


class _LayerRouting:
    """Stands in for megatron-core's ``RouterReplay`` on one router: computes the free top-k, compares it with
    the recorded choices, and (replaying) substitutes them where recorded."""

    def __init__(self, state: MoERouting) -> None:
        self.state = state
        self.target: torch.Tensor | None = None  # [tokens, k] long
        self.recorded: torch.Tensor | None = None  # [tokens] bool
        self.chosen: torch.Tensor | None = None  # the experts of the last forward, [tokens, k]

    def get_replay_topk(self, scores, topk, num_groups=None, group_topk=None, default_compute_topk=None):
        probs, idx = default_compute_topk(scores, topk, num_groups=num_groups, group_topk=group_topk)
        if self.target is not None:
            self.target, self.recorded = self.target.to(idx.device), self.recorded.to(idx.device)
            if torch.is_grad_enabled():
                self.state.compare(idx, self.target, self.recorded)
        if self.target is not None and self.state.replay:
            idx = torch.where(self.recorded.unsqueeze(1), self.target, idx)
            probs = scores.gather(1, idx)
        self.chosen = idx.detach()
        return probs, idx


class MoERouting:
    """Replay and metrics for every router of a model (:meth:`attach` records to micro-batches,
    :meth:`route` before each forward, :meth:`metrics` once per step)."""

    def __init__(self, model: torch.nn.Module, *, replay: bool) -> None:
        self.replay = replay
        self.layers: list[_LayerRouting] = []
        found = routers(model)
        self.topk = found[0].topk if found else 0
        self.num_experts = found[0].config.num_moe_experts if found else 0
        for router in found:
            layer = _LayerRouting(self)
            router.router_replay = layer
            router.register_forward_hook(self._observe)
            self.layers.append(layer)
        self._totals: dict[str, float] = {}

    def __bool__(self) -> bool:
        return bool(self.layers)

    # ---- replay targets -----------------------------------------------------------------------------------
    def targets(self, mb: Any, samples: Sequence[Any]) -> tuple[torch.Tensor, torch.Tensor] | None:
        """``(experts [T, layers, k], recorded [T])`` in the model's token order of micro-batch ``mb`` (packed:
        its packed positions; padded: Megatron's ``[s, b]`` order), or None when no sample carries records."""
        from agentrl.trainer.batch import sample_field

        records = [sample_field(samples[i], "routed_experts") for i in mb.index]
        if not any(records):
            return None
        rows, width = mb.tokens.shape
        per_token = len(self.layers) * self.topk
        padded = torch.zeros((rows, width, per_token), dtype=torch.long)
        recorded = torch.zeros((rows, width), dtype=torch.bool)
        for row, (record, start) in enumerate(zip(records, mb.response_starts, strict=True)):
            for i, experts in enumerate(record or ()):
                if experts is None:
                    continue
                if len(experts) != per_token or not all(0 <= e < self.num_experts for e in experts):
                    raise ValueError(f"sample {mb.index[row]}: routed_experts[{i}] must be {len(self.layers)} "
                                     f"layers x {self.topk} expert ids in [0, {self.num_experts})")
                if start + i - 1 < width:
                    padded[row, start + i - 1] = torch.tensor(experts)
                    recorded[row, start + i - 1] = True
        if mb.packed is not None:
            flat = mb.packed.flat_index.cpu()
            experts, mask = padded.reshape(rows * width, -1)[flat], recorded.reshape(-1)[flat]
        else:  # Megatron routes [s, b] flattened: position-major
            experts, mask = padded.transpose(0, 1).reshape(rows * width, -1), recorded.transpose(0, 1).reshape(-1)
        return experts.view(len(mask), len(self.layers), -1), mask

    def route(self, mb: Any) -> None:
        """Route the next forward with the records :meth:`attach` gave ``mb`` (none: every token freely)."""
        found = getattr(mb, "routed_targets", None)
        for li, layer in enumerate(self.layers):
            layer.target, layer.recorded = (None, None) if found is None else (found[0][:, li], found[1])

    def attach(self, mbs: Sequence[Any], samples: Sequence[Any]) -> None:
        for mb in mbs:
            mb.routed_targets = self.targets(mb, samples)

    # ---- metrics -----------------------------------------------------------------------------------------
    def compare(self, free: torch.Tensor, target: torch.Tensor, recorded: torch.Tensor) -> None:
        rows = recorded.nonzero().squeeze(1)
        if not len(rows):
            return
        same = (free[rows].sort(1).values == target[rows].sort(1).values).all(1)
        self._add("routing_mismatch", float((~same).sum()), float(len(rows)))
        self._add("replayed_tokens", float(len(rows)) if self.replay else 0.0, float(len(self.layers)))

    def _observe(self, router: Any, inputs: tuple, outputs: tuple) -> None:
        if not (router.training and torch.is_grad_enabled()):
            return
        with torch.no_grad():
            logits = router.gating(inputs[0]).float().reshape(-1, router.config.num_moe_experts)
            _, routing_map = outputs
            tokens = routing_map.reshape(-1, logits.shape[1]).float().sum(0)
            n, experts, k = logits.shape[0], logits.shape[1], router.topk
            probs = torch.softmax(logits, dim=-1)
            self._add("aux_loss", float(experts / (k * n * n) * (tokens * probs.sum(0)).sum()), 1.0)
            self._add("z_loss", float(torch.logsumexp(logits, -1).square().mean()), 1.0)
            mean = tokens.mean().clamp_min(1e-9)
            self._add("load_max", float(tokens.max() / mean), 1.0)
            self._add("load_min", float(tokens.min() / mean), 1.0)

    def _add(self, name: str, value: float, weight: float) -> None:
        self._totals[name] = self._totals.get(name, 0.0) + value
        self._totals[name + "#w"] = self._totals.get(name + "#w", 0.0) + weight

    def metrics(self) -> dict[str, float]:
        """``moe/*`` averages since the last call (and reset)."""
        out = {f"moe/{name}": value / max(self._totals[name + "#w"], 1e-12)
               for name, value in self._totals.items() if not name.endswith("#w")}
        if "moe/replayed_tokens" in out:  # a count per step, not a rate
            out["moe/replayed_tokens"] = self._totals["replayed_tokens"]
        self._totals = {}
        return out

    def last_choices(self) -> list[torch.Tensor]:
        """The experts each layer used in the last forward, ``[tokens, k]`` per layer."""
        return [layer.chosen for layer in self.layers]

