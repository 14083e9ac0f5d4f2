"""Hugging Face <-> Megatron-core state-dict conversion for Qwen2 / Qwen3 / Llama-family decoders.

The layout (measured bit-exact against HF logits in fp32):

* ``linear_qkv`` is grouped per kv group: for each of the ``g`` groups, its ``h/g`` query heads, then its
  key head, then its value head (``cat([q.view(g, h/g*d, H), k.view(g, d, H), v.view(g, d, H)], 1)``);
* ``linear_fc1 = cat([gate, up])`` (per tensor-parallel shard: each rank holds its gate slice then its up
  slice);
* ``post_attention_layernorm`` -> ``pre_mlp_layernorm`` (local spec) or ``mlp.linear_fc1.layer_norm_weight``
  (TransformerEngine spec, which fuses norms into the following linear);
* tied embeddings: no ``output_layer.weight`` on the Megatron side, no ``lm_head.weight`` on export;
* Qwen3-MoE (``num_experts > 0``): ``mlp.gate`` -> ``mlp.router``; expert ``j``'s gate/up/down ->
  ``mlp.experts.local_experts.{j}.linear_fc1`` (``cat([gate, up])``) / ``linear_fc2`` (megatron-core's
  ``SequentialMLP``, in both specs: no grouped GEMM); the norm before an MoE MLP stays ``pre_mlp_layernorm``. Expert parallelism: rank ``r`` of ``s`` holds
  the experts ``r*E/s .. (r+1)*E/s - 1`` as local experts ``0 .. E/s - 1``.

Tensor parallelism: vocab rows, qkv groups, fc1 rows (gate and up separately) split along dim 0;
``linear_proj`` / ``linear_fc2`` split along dim 1; norms are replicated.

This module must not import ``agentrl.trainer`` (the weight-sync code uses it without a trainer).
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch

Spec = Literal["local", "te"]


@dataclass(frozen=True)
class ModelShape:
    """What the conversion needs to know about a decoder (read from a HF config)."""

    num_layers: int
    hidden_size: int
    ffn_hidden_size: int
    num_attention_heads: int
    num_query_groups: int
    head_dim: int
    vocab_size: int
    tie_word_embeddings: bool
    qkv_bias: bool
    qk_layernorm: bool
    num_experts: int = 0  # 0: dense MLP
    moe_topk: int = 0
    moe_ffn_hidden_size: int = 0
    moe_norm_topk_prob: bool = True

    @classmethod
    def from_hf_config(cls, config: Any) -> ModelShape:
        """Build from a ``transformers`` config object (or a plain dict of one)."""
        get = (lambda k, d=None: config.get(k, d)) if isinstance(config, dict) else (
            lambda k, d=None: getattr(config, k, d)
        )
        model_type = get("model_type", "")
        heads = get("num_attention_heads")
        hidden = get("hidden_size")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(
                f"unsupported model_type {model_type!r}; supported: {sorted(SUPPORTED_MODEL_TYPES)}"
            )
        # Llama-family options the Megatron layer spec here does not build (bias-free SwiGLU MLP only).
        if get("mlp_bias", False):
            raise ValueError(f"{model_type} with mlp_bias=True is not supported (MLP linears have no bias)")
        if get("hidden_act", "silu") != "silu":
            raise ValueError(f"hidden_act {get('hidden_act')!r} is not supported (SwiGLU with silu only)")
        experts = int(get("num_experts", None) or get("num_local_experts", None) or 0) if model_type == "qwen3_moe" else 0
        if experts and (get("mlp_only_layers", None) or get("decoder_sparse_step", 1) != 1):
            raise ValueError("qwen3_moe with dense layers (mlp_only_layers / decoder_sparse_step != 1) is not supported")
        return cls(
            num_layers=get("num_hidden_layers"),
            hidden_size=hidden,
            ffn_hidden_size=get("intermediate_size"),
            num_attention_heads=heads,
            num_query_groups=get("num_key_value_heads") or heads,
            head_dim=get("head_dim") or hidden // heads,
            vocab_size=get("vocab_size"),
            tie_word_embeddings=bool(get("tie_word_embeddings", False)),
            # Qwen2 always has q/k/v bias; Llama/Qwen3 only with attention_bias=True.
            qkv_bias=model_type == "qwen2" or bool(get("attention_bias", False)),
            qk_layernorm=model_type in ("qwen3", "qwen3_moe"),
            num_experts=experts,
            moe_topk=int(get("num_experts_per_tok", 0) or 0) if experts else 0,
            moe_ffn_hidden_size=int(get("moe_intermediate_size", 0) or 0) if experts else 0,
            moe_norm_topk_prob=bool(get("norm_topk_prob", True)),
        )

    def check_tp(self, tp_size: int) -> None:
        for what, n in (
            ("num_key_value_heads", self.num_query_groups),
            ("num_attention_heads", self.num_attention_heads),
            ("vocab_size", self.vocab_size),
            ("intermediate_size", self.ffn_hidden_size),
        ):
            if n % tp_size:
                raise ValueError(f"{what}={n} is not divisible by tensor-parallel size {tp_size}")
        if self.num_experts and tp_size > 1:
            raise ValueError("MoE models are converted at tensor-parallel size 1 (use expert parallelism)")

    def check_ep(self, ep_size: int) -> None:
        if ep_size > 1 and (not self.num_experts or self.num_experts % ep_size):
            raise ValueError(f"expert-parallel size {ep_size} must divide num_experts={self.num_experts}")


SUPPORTED_MODEL_TYPES = {"qwen2", "qwen3", "llama", "mistral", "qwen3_moe"}

_ATTN = "decoder.layers.{i}.self_attention"
_MLP = "decoder.layers.{i}.mlp"


def _norm_names(spec: Spec, moe: bool = False) -> tuple[str, str]:
    if spec == "te" and moe:  # an MoE layer keeps its own pre-MLP norm (no fused norm+linear to put it in)
        return f"{_ATTN}.linear_qkv.layer_norm_weight", "decoder.layers.{i}.pre_mlp_layernorm.weight"
    if spec == "te":
        return f"{_ATTN}.linear_qkv.layer_norm_weight", f"{_MLP}.linear_fc1.layer_norm_weight"
    if spec == "local":
        return "decoder.layers.{i}.input_layernorm.weight", "decoder.layers.{i}.pre_mlp_layernorm.weight"
    raise ValueError(f"spec must be 'local' or 'te', got {spec!r}")


# ---------------------------------------------------------------------------------------------- HF -> Megatron


def _group_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, shape: ModelShape) -> torch.Tensor:
    g, d = shape.num_query_groups, shape.head_dim
    per = shape.num_attention_heads // g
    rest = q.shape[1:]
    return torch.cat([q.reshape(g, per * d, *rest), k.reshape(g, d, *rest), v.reshape(g, d, *rest)], 1).reshape(
        -1, *rest
    )


def _ungroup_qkv(qkv: torch.Tensor, shape: ModelShape) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g, d = shape.num_query_groups, shape.head_dim
    per = shape.num_attention_heads // g
    rest = qkv.shape[1:]
    grouped = qkv.reshape(g, (per + 2) * d, *rest)
    q, k, v = torch.split(grouped, [per * d, d, d], dim=1)
    return q.reshape(-1, *rest), k.reshape(-1, *rest), v.reshape(-1, *rest)


def _shard(t: torch.Tensor, dim: int, tp_rank: int, tp_size: int) -> torch.Tensor:
    return torch.chunk(t, tp_size, dim=dim)[tp_rank].clone() if tp_size > 1 else t.clone()


def hf_to_megatron(
    hf: Mapping[str, torch.Tensor],
    shape: ModelShape,
    *,
    tp_rank: int = 0,
    tp_size: int = 1,
    spec: Spec = "local",
    ep_rank: int = 0,
    ep_size: int = 1,
) -> dict[str, torch.Tensor]:
    """Convert a full HF state dict into the Megatron state dict of tensor-parallel rank ``tp_rank`` (and,
    for an MoE model, expert-parallel rank ``ep_rank``)."""
    shape.check_tp(tp_size)
    shape.check_ep(ep_size)
    missing = [n for n in _required_hf_names(shape) if n not in hf]
    if missing:
        raise KeyError(f"HF state dict lacks {len(missing)} tensors, e.g. {missing[:3]}")
    in_norm, mlp_norm = _norm_names(spec, bool(shape.num_experts))
    out: dict[str, torch.Tensor] = {}

    def shard(t: torch.Tensor, dim: int) -> torch.Tensor:
        return _shard(t, dim, tp_rank, tp_size)

    out["embedding.word_embeddings.weight"] = shard(hf["model.embed_tokens.weight"], 0)
    for i in range(shape.num_layers):
        p = f"model.layers.{i}"
        a, m = _ATTN.format(i=i), _MLP.format(i=i)
        out[in_norm.format(i=i)] = hf[f"{p}.input_layernorm.weight"].clone()
        out[mlp_norm.format(i=i)] = hf[f"{p}.post_attention_layernorm.weight"].clone()
        qkv = _group_qkv(*(hf[f"{p}.self_attn.{x}_proj.weight"] for x in "qkv"), shape)
        out[f"{a}.linear_qkv.weight"] = shard(qkv, 0)
        if shape.qkv_bias:
            bias = _group_qkv(*(hf[f"{p}.self_attn.{x}_proj.bias"] for x in "qkv"), shape)
            out[f"{a}.linear_qkv.bias"] = shard(bias, 0)
        if shape.qk_layernorm:
            out[f"{a}.q_layernorm.weight"] = hf[f"{p}.self_attn.q_norm.weight"].clone()
            out[f"{a}.k_layernorm.weight"] = hf[f"{p}.self_attn.k_norm.weight"].clone()
        out[f"{a}.linear_proj.weight"] = shard(hf[f"{p}.self_attn.o_proj.weight"], 1)
        if shape.num_experts:
            out.update(_experts_to_megatron(hf, shape, i, spec, ep_rank, ep_size))
            continue
        gate, up = hf[f"{p}.mlp.gate_proj.weight"], hf[f"{p}.mlp.up_proj.weight"]
        out[f"{m}.linear_fc1.weight"] = torch.cat([shard(gate, 0), shard(up, 0)], 0)
        out[f"{m}.linear_fc2.weight"] = shard(hf[f"{p}.mlp.down_proj.weight"], 1)
    out["decoder.final_layernorm.weight"] = hf["model.norm.weight"].clone()
    if not shape.tie_word_embeddings:
        out["output_layer.weight"] = shard(hf["lm_head.weight"], 0)
    return out


def _expert_names(spec: Spec, i: int, j: int) -> tuple[str, str]:
    """Megatron names of local expert ``j``'s fc1 and fc2 in layer ``i`` (``SequentialMLP`` in both specs)."""
    m = _MLP.format(i=i)
    return f"{m}.experts.local_experts.{j}.linear_fc1.weight", f"{m}.experts.local_experts.{j}.linear_fc2.weight"


def _experts_to_megatron(hf: Mapping[str, torch.Tensor], shape: ModelShape, i: int, spec: Spec, ep_rank: int,
                         ep_size: int) -> dict[str, torch.Tensor]:
    p, per_rank = f"model.layers.{i}.mlp", shape.num_experts // ep_size
    out = {f"{_MLP.format(i=i)}.router.weight": hf[f"{p}.gate.weight"].clone()}
    for j in range(per_rank):
        e = f"{p}.experts.{ep_rank * per_rank + j}"
        fc1, fc2 = _expert_names(spec, i, j)
        out[fc1] = torch.cat([hf[f"{e}.gate_proj.weight"], hf[f"{e}.up_proj.weight"]], 0)
        out[fc2] = hf[f"{e}.down_proj.weight"].clone()
    return out


def _required_hf_names(shape: ModelShape) -> list[str]:
    names = ["model.embed_tokens.weight", "model.norm.weight"]
    if not shape.tie_word_embeddings:
        names.append("lm_head.weight")
    for i in range(shape.num_layers):
        p = f"model.layers.{i}"
        names += [f"{p}.input_layernorm.weight", f"{p}.post_attention_layernorm.weight"]
        names += [f"{p}.self_attn.{x}_proj.weight" for x in "qkvo"]
        if shape.num_experts:
            names.append(f"{p}.mlp.gate.weight")
            names += [f"{p}.mlp.experts.{j}.{x}_proj.weight" for j in range(shape.num_experts) for x in ("gate", "up", "down")]
        else:
            names += [f"{p}.mlp.{x}_proj.weight" for x in ("gate", "up", "down")]
        if shape.qkv_bias:
            names += [f"{p}.self_attn.{x}_proj.bias" for x in "qkv"]
        if shape.qk_layernorm:
            names += [f"{p}.self_attn.q_norm.weight", f"{p}.self_attn.k_norm.weight"]
    return names


# ---------------------------------------------------------------------------------------------- Megatron -> HF

# gather(megatron_name, dim) -> the full tensor (dim=None: replicated, take the local copy).
Gather = Callable[[str, "int | None"], torch.Tensor]


def _gather_from_shards(shards: Sequence[Mapping[str, torch.Tensor]]) -> Gather:
    def gather(name: str, dim: int | None) -> torch.Tensor:
        if dim is None or len(shards) == 1:
            return shards[0][name]
        return torch.cat([s[name] for s in shards], dim=dim)

    return gather


def _gather_from_group(local: Mapping[str, torch.Tensor], group: Any) -> Gather:
    import torch.distributed as dist

    size = dist.get_world_size(group)

    def gather(name: str, dim: int | None) -> torch.Tensor:
        t = local[name]
        if dim is None or size == 1:
            return t
        parts = [torch.empty_like(t) for _ in range(size)]
        dist.all_gather(parts, t.contiguous(), group=group)
        return torch.cat(parts, dim=dim)

    return gather


def _split_fc1(shards_fc1: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    gates, ups = zip(*(torch.chunk(s, 2, dim=0) for s in shards_fc1), strict=True)
    return torch.cat(gates, 0), torch.cat(ups, 0)


def megatron_to_hf_named_tensors(
    state_dict: Mapping[str, torch.Tensor] | Sequence[Mapping[str, torch.Tensor]],
    shape: ModelShape,
    *,
    spec: Spec = "local",
    tp_group: Any = None,
    ep_group: Any = None,
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(hf_name, full_tensor)`` pairs, one layer at a time (weight sync streams them).

    ``state_dict`` is either this rank's Megatron state dict (then ``tp_group``, if it has more than one
    rank, is used to all-gather shards: every rank of the group must iterate in step), or a list of the
    state dicts of all tensor-parallel ranks in rank order (offline conversion). For an MoE model,
    ``ep_group`` (more than one rank) all-gathers the other expert-parallel ranks' experts the same way.
    """
    if isinstance(state_dict, Mapping):
        if tp_group is not None:
            gather = _gather_from_group(state_dict, tp_group)
            fc1_parts = _fc1_parts_from_group(state_dict, tp_group)
        else:
            gather = _gather_from_shards([state_dict])
            fc1_parts = lambda name: [state_dict[name]]  # noqa: E731
    else:
        shards = list(state_dict)
        gather = _gather_from_shards(shards)
        fc1_parts = lambda name: [s[name] for s in shards]  # noqa: E731
    in_norm, mlp_norm = _norm_names(spec, bool(shape.num_experts))
    experts = _experts_gather(state_dict, ep_group)

    yield "model.embed_tokens.weight", gather("embedding.word_embeddings.weight", 0)
    for i in range(shape.num_layers):
        p = f"model.layers.{i}"
        a, m = _ATTN.format(i=i), _MLP.format(i=i)
        yield f"{p}.input_layernorm.weight", gather(in_norm.format(i=i), None)
        q, k, v = _ungroup_qkv(gather(f"{a}.linear_qkv.weight", 0), shape)
        yield f"{p}.self_attn.q_proj.weight", q
        yield f"{p}.self_attn.k_proj.weight", k
        yield f"{p}.self_attn.v_proj.weight", v
        if shape.qkv_bias:
            qb, kb, vb = _ungroup_qkv(gather(f"{a}.linear_qkv.bias", 0), shape)
            yield f"{p}.self_attn.q_proj.bias", qb
            yield f"{p}.self_attn.k_proj.bias", kb
            yield f"{p}.self_attn.v_proj.bias", vb
        if shape.qk_layernorm:
            yield f"{p}.self_attn.q_norm.weight", gather(f"{a}.q_layernorm.weight", None)
            yield f"{p}.self_attn.k_norm.weight", gather(f"{a}.k_layernorm.weight", None)
        yield f"{p}.self_attn.o_proj.weight", gather(f"{a}.linear_proj.weight", 1)
        yield f"{p}.post_attention_layernorm.weight", gather(mlp_norm.format(i=i), None)
        if shape.num_experts:
            yield f"{p}.mlp.gate.weight", gather(f"{m}.router.weight", None)
            yield from _experts_to_hf(experts, shape, i, spec)
            continue
        gate, up = _split_fc1(fc1_parts(f"{m}.linear_fc1.weight"))
        yield f"{p}.mlp.gate_proj.weight", gate
        yield f"{p}.mlp.up_proj.weight", up
        yield f"{p}.mlp.down_proj.weight", gather(f"{m}.linear_fc2.weight", 1)
    yield "model.norm.weight", gather("decoder.final_layernorm.weight", None)
    if not shape.tie_word_embeddings:
        yield "lm_head.weight", gather("output_layer.weight", 0)


def _experts_gather(state_dict: Any, ep_group: Any) -> Callable[[Callable[[int], str]], list[torch.Tensor]]:
    """``gather(name_of)``: every expert's tensor in global order, ``name_of(j)`` naming local expert ``j``
    (all ranks of ``ep_group`` must call it in step)."""
    local = state_dict if isinstance(state_dict, Mapping) else state_dict[0]

    def gather(name_of: Callable[[int], str]) -> list[torch.Tensor]:
        mine: list[torch.Tensor] = []
        while name_of(len(mine)) in local:
            mine.append(local[name_of(len(mine))])
        if ep_group is None:
            return mine
        import torch.distributed as dist

        stacked = torch.stack(mine).contiguous()
        parts = [torch.empty_like(stacked) for _ in range(dist.get_world_size(ep_group))]
        dist.all_gather(parts, stacked, group=ep_group)
        return [t for part in parts for t in part.unbind(0)]

    return gather


def _experts_to_hf(gather: Callable[[Callable[[int], str]], list[torch.Tensor]], shape: ModelShape, i: int,
                   spec: Spec) -> Iterator[tuple[str, torch.Tensor]]:
    p = f"model.layers.{i}.mlp"
    fc1s = gather(lambda j: _expert_names(spec, i, j)[0])
    fc2s = gather(lambda j: _expert_names(spec, i, j)[1])
    if len(fc1s) != shape.num_experts or len(fc2s) != shape.num_experts:
        raise KeyError(f"layer {i}: found {len(fc1s)} experts, the model has {shape.num_experts}")
    for j, (fc1, fc2) in enumerate(zip(fc1s, fc2s, strict=True)):
        gate, up = torch.chunk(fc1, 2, dim=0)
        yield f"{p}.experts.{j}.gate_proj.weight", gate
        yield f"{p}.experts.{j}.up_proj.weight", up
        yield f"{p}.experts.{j}.down_proj.weight", fc2


def _fc1_parts_from_group(local: Mapping[str, torch.Tensor], group: Any) -> Callable[[str], list[torch.Tensor]]:
    import torch.distributed as dist

    def parts(name: str) -> list[torch.Tensor]:
        t = local[name].contiguous()
        out = [torch.empty_like(t) for _ in range(dist.get_world_size(group))]
        dist.all_gather(out, t, group=group)
        return out

    return parts


def megatron_to_hf(
    state_dict: Mapping[str, torch.Tensor] | Sequence[Mapping[str, torch.Tensor]],
    shape: ModelShape,
    *,
    spec: Spec = "local",
) -> dict[str, torch.Tensor]:
    """Full HF state dict from one Megatron state dict or the list of all tensor-parallel shards."""
    return dict(megatron_to_hf_named_tensors(state_dict, shape, spec=spec))


# ---------------------------------------------------------------------------------------------- checkpoint dirs

_WEIGHT_INDEX = "model.safetensors.index.json"


def load_hf_config(model_dir: str | Path) -> Any:
    """The ``transformers`` config of a local checkpoint directory (never a hub id)."""
    from transformers import AutoConfig

    if not (Path(model_dir) / "config.json").is_file():
        raise FileNotFoundError(f"{model_dir} is not a HF model directory (no config.json)")
    return AutoConfig.from_pretrained(str(model_dir))


def load_hf_state_dict(model_dir: str | Path) -> dict[str, torch.Tensor]:
    """Read every tensor of a local HF checkpoint directory (single or sharded safetensors)."""
    from safetensors.torch import load_file

    root = Path(model_dir)
    if not root.is_dir():
        raise FileNotFoundError(f"{root} is not a directory")
    index = root / _WEIGHT_INDEX
    if index.exists():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    else:
        files = sorted(p.name for p in root.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors weights in {root} (pytorch_model.bin is not supported)")
    state: dict[str, torch.Tensor] = {}
    for name in files:
        state.update(load_file(str(root / name)))
    return state


def save_hf_checkpoint(
    named_tensors: Iterator[tuple[str, torch.Tensor]] | Mapping[str, torch.Tensor],
    source_dir: str | Path,
    out_dir: str | Path,
) -> Path:
    """Write ``model.safetensors`` plus the config/tokenizer files of ``source_dir`` into ``out_dir``."""
    from safetensors.torch import save_file

    src, out = Path(source_dir), Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    items = named_tensors.items() if isinstance(named_tensors, Mapping) else named_tensors
    tensors = {name: t.detach().contiguous().cpu() for name, t in items}
    for f in src.iterdir():
        if f.is_file() and not f.name.endswith(".safetensors") and f.name != _WEIGHT_INDEX:
            shutil.copy2(f, out / f.name)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out
