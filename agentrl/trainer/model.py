"""Build a megatron-core ``GPTModel`` from a Hugging Face config and load HF weights into it.

Attention backends (``attention=``):

* ``"sdpa"`` (default without TransformerEngine): local layer spec (torch RMSNorm, Megatron linears) with
  :class:`~agentrl.trainer.attention.SDPACoreAttention`: no O(S²) score matrix.
* ``"local"``: local layer spec with Megatron's own ``DotProductAttention`` (materialised scores; kept for
  comparison and as a reference; needs an explicit causal mask, see :func:`causal_mask`).
* ``"te"``: ``get_gpt_layer_with_transformer_engine_spec`` (fused norms+linears, flash attention, THD
  packing). Chosen by ``"auto"`` when ``transformer_engine`` imports. It cannot run on these CPU machines;
  its parameter names differ only in the norms, which :mod:`agentrl.weights.convert` maps (``spec="te"``).
"""

from __future__ import annotations

import importlib.util
from collections.abc import Mapping, Sequence
from typing import Any, Literal

import torch
import torch.nn.functional as F

from agentrl.trainer.moe import transformer_kwargs as moe_transformer_kwargs
from agentrl.weights.convert import ModelShape, Spec, hf_to_megatron

Attention = Literal["auto", "sdpa", "local", "te"]
Recompute = Literal["none", "selective", "full"]


def te_available() -> bool:
    return importlib.util.find_spec("transformer_engine") is not None


def resolve_attention(attention: Attention) -> Literal["sdpa", "local", "te"]:
    if attention == "auto":
        return "te" if te_available() else "sdpa"
    if attention == "te" and not te_available():
        raise RuntimeError("attention='te' needs TransformerEngine, which is not installed")
    if attention not in ("sdpa", "local", "te"):
        raise ValueError(f"attention must be auto|sdpa|local|te, got {attention!r}")
    return attention


def resolve_packing(packing: Literal["auto", "packed", "padded"], attention: Attention) -> bool:
    """Whether micro-batches are packed (:class:`~agentrl.trainer.batch.PackedLayout`): ``auto`` packs
    where the backend attends within each packed sequence (sdpa, te); ``local`` needs padding."""
    backend = resolve_attention(attention)
    if packing not in ("auto", "packed", "padded"):
        raise ValueError(f"packing must be auto|packed|padded, got {packing!r}")
    if packing == "packed" and backend == "local":
        raise ValueError("packing='packed' needs attention 'sdpa' or 'te'; 'local' attention runs padded only")
    return packing == "packed" or (packing == "auto" and backend != "local")


def spec_flavour(attention: Attention) -> Spec:
    """Which state-dict naming (:data:`agentrl.weights.convert.Spec`) a backend uses."""
    return "te" if resolve_attention(attention) == "te" else "local"


def _rope(hf_config: Any) -> tuple[float, dict[str, Any]]:
    """(rope theta, GPTModel rope-scaling kwargs). transformers 5.x keeps theta in ``rope_parameters``."""
    params = dict(getattr(hf_config, "rope_parameters", None) or {})
    legacy = getattr(hf_config, "rope_scaling", None) or {}
    params = {**legacy, **params}
    theta = params.get("rope_theta", getattr(hf_config, "rope_theta", 10000.0))
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type in (None, "default"):
        return float(theta), {}
    if rope_type == "llama3":
        return float(theta), {"rope_scaling": True, "rope_scaling_factor": float(params.get("factor", 8.0))}
    raise ValueError(f"rope_type {rope_type!r} is not supported (default and llama3 are)")


def transformer_config_from_hf(
    hf_config: Any,
    *,
    tp_size: int = 1,
    dtype: torch.dtype = torch.float32,
    init_weights: bool = False,
    recompute: Recompute = "none",
    recompute_modules: Sequence[str] = ("core_attn",),
    moe: Any = None,
    **overrides: Any,
):
    """Megatron ``TransformerConfig`` equivalent to a HF Qwen2/Qwen3/Llama config (dropout off).
    ``recompute``: ``full`` checkpoints every layer; ``selective`` checkpoints ``recompute_modules``."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    shape = ModelShape.from_hf_config(hf_config)
    shape.check_tp(tp_size)
    kwargs: dict[str, Any] = dict(
        num_layers=shape.num_layers,
        hidden_size=shape.hidden_size,
        ffn_hidden_size=shape.ffn_hidden_size,
        num_attention_heads=shape.num_attention_heads,
        num_query_groups=shape.num_query_groups,
        kv_channels=shape.head_dim,
        normalization="RMSNorm",
        layernorm_epsilon=float(getattr(hf_config, "rms_norm_eps", 1e-6)),
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=shape.qkv_bias,
        qk_layernorm=shape.qk_layernorm,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        # Fusions are CUDA kernels (or TE); the unfused paths are exact and run everywhere. On CUDA the
        # SwiGLU is Megatron's fused one (torch.compile'd, no TE needed; one rounding to bf16 instead of
        # two): on an H200 at 1.5B it cut the step's elementwise kernels by ~35 ms and its peak memory by
        # ~8 GiB (benchmarks/results/gpu_2026-12-03/NOTES.md).
        bias_activation_fusion=torch.cuda.is_available(),
        bias_dropout_fusion=False,
        masked_softmax_fusion=False,
        apply_rope_fusion=False,
        persist_layer_norm=False,
        gradient_accumulation_fusion=False,
        attention_softmax_in_fp32=True,
        tensor_model_parallel_size=tp_size,
        params_dtype=dtype,
        pipeline_dtype=dtype,
        bf16=dtype == torch.bfloat16,
        fp16=dtype == torch.float16,
        use_cpu_initialization=not torch.cuda.is_available(),
        perform_initialization=init_weights,
        init_method_std=float(getattr(hf_config, "initializer_range", 0.02)),
    )
    if recompute == "full":
        kwargs.update(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
    elif recompute == "selective":
        kwargs.update(recompute_granularity="selective", recompute_modules=list(recompute_modules))
    elif recompute != "none":
        raise ValueError(f"recompute must be none|selective|full, got {recompute!r}")
    kwargs.update(moe_transformer_kwargs(shape, moe))  # {} for dense models; ``moe``: trainer.moe settings
    kwargs.update(overrides)
    return TransformerConfig(**kwargs)


def layer_spec(hf_config: Any, attention: Attention = "auto"):
    """The ``ModuleSpec`` of one decoder layer for the chosen attention backend."""
    from megatron.core.models.gpt.gpt_layer_specs import (
        get_gpt_layer_local_spec,
        get_gpt_layer_with_transformer_engine_spec,
    )

    shape = ModelShape.from_hf_config(hf_config)
    backend = resolve_attention(attention)
    experts = shape.num_experts or None  # MoE: megatron-core's SequentialMLP experts (no grouped GEMM)
    if backend == "te":
        return get_gpt_layer_with_transformer_engine_spec(num_experts=experts, qk_layernorm=shape.qk_layernorm)
    spec = get_gpt_layer_local_spec(num_experts=experts, qk_layernorm=shape.qk_layernorm, normalization="RMSNorm")
    if backend == "sdpa":
        from agentrl.trainer.attention import SDPACoreAttention

        spec.submodules.self_attention.submodules.core_attention = SDPACoreAttention
    return spec


def build_gpt_model(
    hf_config: Any,
    *,
    tp_size: int = 1,
    dtype: torch.dtype = torch.float32,
    attention: Attention = "auto",
    init_weights: bool = False,
    recompute: Recompute = "none",
    recompute_modules: Sequence[str] = ("core_attn",),
    moe: Any = None,
):
    """A ``GPTModel`` shaped like ``hf_config`` (model parallel state must be initialised first).

    Weights are uninitialised unless ``init_weights``; load them with :func:`load_hf_weights`.
    """
    from megatron.core.models.gpt.gpt_model import GPTModel

    config = transformer_config_from_hf(
        hf_config, tp_size=tp_size, dtype=dtype, init_weights=init_weights, recompute=recompute,
        recompute_modules=recompute_modules, moe=moe,
    )
    shape = ModelShape.from_hf_config(hf_config)
    theta, rope_kwargs = _rope(hf_config)
    model = GPTModel(
        config=config,
        transformer_layer_spec=layer_spec(hf_config, attention),
        vocab_size=shape.vocab_size,
        max_sequence_length=int(getattr(hf_config, "max_position_embeddings", 4096)),
        pre_process=True,
        post_process=True,
        parallel_output=True,
        share_embeddings_and_output_weights=shape.tie_word_embeddings,
        position_embedding_type="rope",
        rotary_base=int(theta) if float(theta).is_integer() else theta,
        **rope_kwargs,
    )
    if not init_weights:
        mark_tensor_parallel_params(model)
    if torch.cuda.is_available():
        model.cuda(torch.cuda.current_device())
    return model


def mark_tensor_parallel_params(model: torch.nn.Module) -> None:
    """Set ``tensor_model_parallel`` / ``partition_dim`` on sharded weights.

    Megatron sets these only inside its weight initialisers, which ``perform_initialization=False`` skips
    (we load HF weights instead). Without them, gradient-norm clipping counts each sharded weight on TP
    rank 0 only, as if it were a replicated duplicate (measured: TP=2 grad norm 1.50 vs TP=1 2.05).
    """
    from megatron.core.tensor_parallel.layers import (
        ColumnParallelLinear,
        RowParallelLinear,
        VocabParallelEmbedding,
        set_tensor_model_parallel_attributes,
    )

    for module in model.modules():
        if isinstance(module, ColumnParallelLinear | VocabParallelEmbedding):
            dim = 0
        elif isinstance(module, RowParallelLinear):
            dim = 1
        else:
            continue
        weight = getattr(module, "weight", None)
        if weight is not None and not getattr(weight, "tensor_model_parallel", False):
            set_tensor_model_parallel_attributes(weight, True, dim, 1)


def _is_extra_state(name: str) -> bool:
    return name.endswith("_extra_state")


def load_hf_weights(
    model: torch.nn.Module,
    hf_state: Mapping[str, torch.Tensor],
    hf_config: Any,
    *,
    tp_rank: int,
    tp_size: int,
    attention: Attention = "auto",
    ep_rank: int = 0,
    ep_size: int = 1,
) -> None:
    """Copy a full HF state dict into this rank's (unwrapped) ``GPTModel`` parameters, exactly."""
    shape = ModelShape.from_hf_config(hf_config)
    converted = hf_to_megatron(hf_state, shape, tp_rank=tp_rank, tp_size=tp_size, spec=spec_flavour(attention),
                               ep_rank=ep_rank, ep_size=ep_size)
    params = {n: p for n, p in model.state_dict(keep_vars=True).items() if not _is_extra_state(n)}
    missing = sorted(set(params) - set(converted))
    unexpected = sorted(set(converted) - set(params))
    if missing or unexpected:
        raise KeyError(f"HF->Megatron name mismatch: missing {missing[:5]}, unexpected {unexpected[:5]}")
    with torch.no_grad():
        for name, param in params.items():
            src = converted[name]
            if tuple(src.shape) != tuple(param.shape):
                raise ValueError(f"{name}: converted shape {tuple(src.shape)} != model {tuple(param.shape)}")
            param.copy_(src.to(param.dtype))


def megatron_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """This rank's parameters under their ``GPTModel`` names (wrappers such as DDP/Float16Module removed)."""
    inner = unwrap(model)
    return {n: t for n, t in inner.state_dict().items() if not _is_extra_state(n)}


def unwrap(model: torch.nn.Module) -> torch.nn.Module:
    """Strip Megatron DDP and Float16Module wrappers."""
    while hasattr(model, "module") and not hasattr(model, "decoder"):
        model = model.module
    return model


def causal_mask(seq_len: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """Megatron's bool mask convention (True = masked out), ``[1, 1, s, s]``; needed by ``"local"``."""
    return torch.triu(torch.ones(seq_len, seq_len, dtype=torch.bool, device=device), diagonal=1)[None, None]
