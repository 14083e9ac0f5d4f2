"""LoRA in the Megatron trainer: the ``trainer.lora`` settings, low-rank adapters on the tensor-parallel
linears, and the two ways out (merged dense weights, the adapters alone).

Adapters sit beside megatron-core's own linears (a forward hook adds ``scale * B(A(x))`` to the layer's
output), so the base weights keep their names, layouts and loading code, and stay frozen in the model
dtype with no gradient and no optimizer state. Tensor parallel follows the base layer's split:

* column-parallel (``linear_qkv``: q/k/v; ``linear_fc1``: gate/up): ``A`` [r, in] is replicated, ``B``
  [out/tp, r] is split on its output like the weight. ``x A^T`` passes through
  ``copy_to_tensor_model_parallel_region`` so ``A``'s gradient is summed over the ranks' ``B`` slices.
* row-parallel (``linear_proj``: o; ``linear_fc2``: down): ``A`` [r, in/tp] is split on its input like
  the weight, ``B`` [out, r] is replicated; the rank-``r`` product ``x_i A_i^T`` is all-reduced
  (``reduce_from_tensor_model_parallel_region``) before ``B``.

Names are per HF projection (``q_proj``, ..., ``down_proj``) with one ``A``/``B`` pair each, as PEFT
has them, so an export is a plain re-naming (q/k/v rows are regrouped per kv group inside ``linear_qkv``).
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, Literal

from pydantic import Field

from agentrl.settings import Settings

if TYPE_CHECKING:
    import torch

    from agentrl.weights.convert import ModelShape

Target = Literal["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
TARGETS: tuple[str, ...] = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# Megatron linear (under decoder.layers.{i}) -> (HF module under model.layers.{i}, its projections, parallel)
_LINEARS: dict[str, tuple[str, tuple[str, ...], str]] = {
    "self_attention.linear_qkv": ("self_attn", ("q_proj", "k_proj", "v_proj"), "column"),
    "self_attention.linear_proj": ("self_attn", ("o_proj",), "row"),
    "mlp.linear_fc1": ("mlp", ("gate_proj", "up_proj"), "column"),
    "mlp.linear_fc2": ("mlp", ("down_proj",), "row"),
}


class LoraConfig(Settings):
    """Low-rank adapters trained in place of the full model (rank 0 or null: off, full fine-tuning)."""

    rank: int | None = Field(None, ge=0, description="adapter rank r; 0 or null: LoRA off (every weight trains)")
    alpha: float = Field(32.0, gt=0, description="the adapters' output is scaled by alpha / rank")
    dropout: float = Field(0.0, ge=0.0, lt=1.0, description="dropout on the adapters' input (training only)")
    target_modules: list[Target] = Field(default_factory=lambda: list(TARGETS), min_length=1,
                                         description="HF projections that get an adapter")

    @property
    def enabled(self) -> bool:
        return bool(self.rank)

    @property
    def scale(self) -> float:
        return self.alpha / self.rank if self.rank else 0.0


def _init_a(rows: int, cols: int, seed: int) -> torch.Tensor:
    """PEFT's ``A`` init (kaiming-uniform, a=sqrt(5), fan-in ``cols``) from ``seed``: the same on every rank."""
    import torch

    a = torch.empty(rows, cols)
    torch.nn.init.kaiming_uniform_(a, a=math.sqrt(5), generator=torch.Generator().manual_seed(seed))
    return a


def _lora_modules():
    """The adapter classes (defined on first use: torch and megatron import only when LoRA is on)."""
    import torch
    from megatron.core.tensor_parallel.mappings import (
        copy_to_tensor_model_parallel_region,
        reduce_from_tensor_model_parallel_region,
    )
    from torch import nn

    def _dropout(p: float) -> nn.Module:
        # Dropout(0) in training still writes a copy of its input (kept for backward): one per adapter.
        return nn.Dropout(p) if p > 0 else nn.Identity()

    class ColumnLora(nn.Module):
        """Adapters on a column-parallel linear whose local output is ``groups`` blocks, each its parts'
        slices side by side (qkv: per local kv group ``[q, k, v]``; fc1: one block ``[gate, up]``)."""

        active = True  # False inside adapters_off: the linear is its frozen base alone

        def __init__(self, sizes: dict[str, int], trained: list[str], groups: int, a_full: dict[str, torch.Tensor],
                     cfg: LoraConfig, dtype: torch.dtype, device: torch.device) -> None:
            super().__init__()
            self.sizes, self.groups, self.scale = sizes, groups, cfg.scale
            self.dropout = _dropout(cfg.dropout)
            self.lora_A = nn.ParameterDict({p: nn.Parameter(a_full[p].to(device, dtype)) for p in trained})
            self.lora_B = nn.ParameterDict({p: nn.Parameter(torch.zeros(groups * sizes[p], cfg.rank, device=device,
                                                                        dtype=dtype)) for p in trained})

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            lead = x.shape[:-1]
            pieces = []
            for p, size in self.sizes.items():
                if p in self.lora_A:
                    low = copy_to_tensor_model_parallel_region(self.dropout(x) @ self.lora_A[p].t())
                    pieces.append((low @ self.lora_B[p].t()).view(*lead, self.groups, size))
                else:
                    pieces.append(x.new_zeros(*lead, self.groups, size))
            return (torch.cat(pieces, -1) * self.scale).flatten(-2)

        def delta_weight(self) -> torch.Tensor:
            """``scale * B A`` laid out like the local weight (fp32)."""
            cols = next(iter(self.lora_A.values())).shape[1]
            device = next(iter(self.lora_A.values())).device
            blocks = [(self.lora_B[p].float() @ self.lora_A[p].float()).view(self.groups, size, cols)
                      if p in self.lora_A else torch.zeros(self.groups, size, cols, device=device)
                      for p, size in self.sizes.items()]
            return torch.cat(blocks, 1).reshape(-1, cols) * self.scale

        def split_axes(self) -> dict[str, int]:
            return {f"lora.lora_B.{p}": 0 for p in self.lora_B}

    class RowLora(nn.Module):
        """The adapter on a row-parallel linear (its input split over the ranks)."""

        active = True

        def __init__(self, part: str, out_features: int, a_local: torch.Tensor, cfg: LoraConfig,
                     dtype: torch.dtype, device: torch.device) -> None:
            super().__init__()
            self.scale = cfg.scale
            self.dropout = _dropout(cfg.dropout)
            self.lora_A = nn.ParameterDict({part: nn.Parameter(a_local.to(device, dtype))})
            self.lora_B = nn.ParameterDict({part: nn.Parameter(torch.zeros(out_features, cfg.rank, device=device,
                                                                           dtype=dtype))})
            self.part = part

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            low = reduce_from_tensor_model_parallel_region(self.dropout(x) @ self.lora_A[self.part].t())
            return (low @ self.lora_B[self.part].t()) * self.scale

        def delta_weight(self) -> torch.Tensor:
            return (self.lora_B[self.part].float() @ self.lora_A[self.part].float()) * self.scale

        def split_axes(self) -> dict[str, int]:
            return {f"lora.lora_A.{self.part}": 1}

    return ColumnLora, RowLora


def _add_adapter(module: Any, args: tuple, kwargs: dict, output: tuple) -> tuple:
    """Forward hook: the linear's ``(output, bias)`` plus its adapter's output on the same input."""
    if not module.lora.active:
        return output
    x = args[0] if args else kwargs["input_"]
    out, bias = output
    return out + module.lora(x).to(out.dtype), bias


def _input_requires_grad(_module: Any, _args: tuple, output: Any) -> Any:
    # The frozen embedding's output needs no grad, but a recomputed layer (an autograd Function) returns
    # grads only to inputs that require them: without this the adapters inside it would get none.
    return output.requires_grad_(True) if output.is_floating_point() else output


def _column_layout(path: str, shape: ModelShape, tp_size: int) -> tuple[dict[str, int], int]:
    """Per-part rows of one output block and the number of blocks, on one rank."""
    if path.endswith("linear_qkv"):
        per = shape.num_attention_heads // shape.num_query_groups
        d = shape.head_dim
        return {"q_proj": per * d, "k_proj": d, "v_proj": d}, shape.num_query_groups // tp_size
    ffn = shape.ffn_hidden_size // tp_size
    return {"gate_proj": ffn, "up_proj": ffn}, 1


def _sharded_with_adapters(linear: Any, axes: dict[str, int]):
    """``linear.sharded_state_dict`` that also shards the adapter tensors split over the TP ranks (Megatron's
    own would save them as replicated, i.e. rank 0's slice only)."""
    from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint

    def sharded_state_dict(prefix: str = "", sharded_offsets: tuple = (), metadata: dict | None = None):
        return make_sharded_tensors_for_checkpoint(
            linear.state_dict(prefix="", keep_vars=True), prefix, axes, sharded_offsets,
            tp_group=linear.tp_group, dp_cp_group=(metadata or {}).get("dp_cp_group"))

    return sharded_state_dict


def _seed(seed: int, layer: int, part: str) -> int:
    return (seed * 1_000_003 + layer) * 16 + TARGETS.index(part)


def apply_lora(model: Any, cfg: LoraConfig, shape: ModelShape, *, tp_rank: int, tp_size: int, seed: int) -> None:
    """Freeze every parameter of the (unwrapped) ``GPTModel`` and add ``cfg``'s adapters (``B = 0``: the
    model's outputs are unchanged until a step trains them). Call before the DDP/optimizer wrapping."""
    from megatron.core.tensor_parallel.layers import (
        ColumnParallelLinear,
        RowParallelLinear,
        set_tensor_model_parallel_attributes,
    )

    column_lora, row_lora = _lora_modules()
    for p in model.parameters():
        p.requires_grad_(False)
    targets = set(cfg.target_modules)
    for layer in model.decoder.layers:
        i = layer.layer_number - 1
        for path, (_, parts, kind) in _LINEARS.items():
            trained = [p for p in parts if p in targets]
            if not trained:
                continue
            linear = layer.get_submodule(path)
            if not isinstance(linear, ColumnParallelLinear if kind == "column" else RowParallelLinear):
                raise ValueError(f"trainer.lora adapts megatron-core's local linears; {path} is "
                                 f"{type(linear).__name__} (TransformerEngine fuses the norm into it): "
                                 "use attention 'sdpa' or 'local'")
            weight = linear.weight
            if kind == "column":
                sizes, groups = _column_layout(path, shape, tp_size)
                a = {p: _init_a(cfg.rank, weight.shape[1], _seed(seed, i, p)) for p in trained}
                linear.lora = column_lora(sizes, trained, groups, a, cfg, weight.dtype, weight.device)
            else:
                a = _init_a(cfg.rank, weight.shape[1] * tp_size, _seed(seed, i, trained[0])).chunk(tp_size, 1)[tp_rank]
                linear.lora = row_lora(trained[0], weight.shape[0], a, cfg, weight.dtype, weight.device)
            axes = linear.lora.split_axes()
            for name, param in linear.named_parameters():
                if name in axes:  # sharded like the base weight: counted once per rank in the grad norm
                    set_tensor_model_parallel_attributes(param, True, axes[name], 1)
            base_axes = {"weight": 0, "bias": 0} if kind == "column" else {"weight": 1}
            linear.sharded_state_dict = _sharded_with_adapters(linear, {**base_axes, **axes})
            linear.register_forward_hook(_add_adapter, with_kwargs=True)
    model.embedding.register_forward_hook(_input_requires_grad)


def _adapted(model: Any) -> Iterator[tuple[str, Any]]:
    """``(name, linear)`` of every linear with an adapter, in module order (the same on every rank)."""
    for name, module in model.named_modules():
        if hasattr(module, "lora") and hasattr(module, "weight"):
            yield name, module


@contextmanager
def adapters_off(model: Any) -> Iterator[None]:
    """Inside, every adapter of ``model`` (wrapped or not) adds nothing: the model is its frozen base, which
    is the initial policy (``B = 0`` at init). LoRA's KL reference is this, not a second copy of the model."""
    from agentrl.trainer.model import unwrap

    loras = [linear.lora for _, linear in _adapted(unwrap(model))]
    for lora in loras:
        lora.active = False
    try:
        yield
    finally:
        for lora in loras:
            lora.active = True


def merged_state_dict(model: Any) -> dict[str, torch.Tensor]:
    """This rank's ``GPTModel`` state dict with each adapter merged into its weight (``W + scale B A``,
    summed in fp32, rounded once to the weight's dtype) and no adapter entries: the dense policy."""
    from agentrl.trainer.model import megatron_state_dict, unwrap

    inner = unwrap(model)
    state = {n: t for n, t in megatron_state_dict(inner).items() if ".lora." not in n}
    for name, linear in _adapted(inner):
        w = linear.weight.detach()
        state[f"{name}.weight"] = (w.float() + linear.lora.delta_weight()).to(w.dtype)
    return state


def adapter_tensors(model: Any, *, tp_group: Any = None) -> Iterator[tuple[str, torch.Tensor, torch.Tensor]]:
    """``(hf_module, A, B)`` per adapter with full (TP-gathered) tensors, HF module names (e.g.
    ``model.layers.0.self_attn.q_proj``) and ``B`` unscaled. All TP ranks must iterate together."""
    import torch
    import torch.distributed as dist

    from agentrl.trainer.model import unwrap

    size = dist.get_world_size(tp_group) if tp_group is not None else 1

    def gather(t: torch.Tensor, dim: int) -> torch.Tensor:
        if size == 1:
            return t
        parts = [torch.empty_like(t) for _ in range(size)]
        dist.all_gather(parts, t.contiguous(), group=tp_group)
        return torch.cat(parts, dim)

    for name, linear in _adapted(unwrap(model)):
        _, _, i, path = name.split(".", 3)  # decoder.layers.{i}.{path}
        hf_parent, _, kind = _LINEARS[path]
        for part, a in linear.lora.lora_A.items():
            a, b = a.detach(), linear.lora.lora_B[part].detach()
            if kind == "column":
                b = gather(b, 0)
            else:
                a = gather(a, 1)
            yield f"model.layers.{i}.{hf_parent}.{part}", a, b


def dense_bytes(hf_config: Any, dtype: torch.dtype) -> int:
    """Bytes of the dense HF model of ``hf_config`` in ``dtype`` (tied weights once): what a full sync sends."""
    import torch
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(hf_config)
    return sum(p.numel() for p in model.parameters()) * torch.empty((), dtype=dtype).element_size()
