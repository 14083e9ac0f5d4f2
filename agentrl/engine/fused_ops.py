"""Fewer kernels per forward on CUDA: transformers' RMSNorm, rotary embedding and SiLU gate, each compiled into
one kernel (``torch.compile``), patched into the engine's model only; and the captured decode step's sampler
(:func:`kernels` ``["sample"]``) compiled the same way.

A decode step of a small model is kernel-bound, not byte-bound: on an H200 a captured Qwen2-0.5B step at one
row ran ~1,000 kernels in ~2.9 ms, while its weights take ~0.25 ms to read. transformers' eager RMSNorm is
~8 kernels (cast, square, mean, add, rsqrt, multiply, cast, scale), its rotary embedding ~5 per tensor
(``rotate_half`` is a slice, a negation and a ``cat``), the MLP's ``act(gate) * up`` two: compiled, each is
one. The math is the same expressions (fp32 normalisation, the cast back before the weight), so the
results equal eager ones up to the fused kernels' rounding (which keeps fp32 where eager rounds to the
model dtype in between).

Scope: :func:`install` patches the instance ``forward`` of the model's RMSNorm and MLP modules, and wraps
the modeling module's ``apply_rotary_pos_emb`` so that it takes the compiled path only inside
:func:`active` (the runner's own forwards): other models in the process (a reference, HF ``generate``)
keep transformers' code. CUDA only; nothing is patched on CPU, and a self-check that fails (no Triton, a
compile error, a mismatch) restores the originals.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import sys
import threading
from typing import Any

logger = logging.getLogger(__name__)
_state = threading.local()


@contextlib.contextmanager
def active():
    """The runner's forwards: inside, the wrapped ``apply_rotary_pos_emb`` takes the compiled path."""
    before = getattr(_state, "on", False)
    _state.on = True
    try:
        yield
    finally:
        _state.on = before


@functools.cache
def kernels() -> dict[str, Any]:
    import torch

    def rms_norm(x, weight, eps: float):
        dtype = x.dtype
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
        return weight * h.to(dtype)

    def rotate_half(x):
        half = x.shape[-1] // 2
        return torch.cat((-x[..., half:], x[..., :half]), dim=-1)

    def rope(q, k, cos, sin):
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
        return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin

    def silu_mul(gate, up):
        return torch.nn.functional.silu(gate) * up

    def sample(logits, temps, greedy, uniforms):
        """Next token per row and its log-prob at the row's temperature (``sampling.sample_next``'s policy):
        ``argmax(log_softmax(x) + Gumbel noise)``, the Gumbel-max draw from ``softmax(x)`` with one
        uniform per vocabulary entry (no cumulative sum); greedy rows take the argmax."""
        x = logits.float() / temps.unsqueeze(1)
        logprobs = x - torch.logsumexp(x, dim=-1, keepdim=True)
        race = logprobs - torch.log(-torch.log(uniforms))
        chosen = torch.where(greedy, x.argmax(dim=-1), race.argmax(dim=-1))
        return chosen, logprobs.gather(1, chosen.unsqueeze(1)).squeeze(1)

    return {"rms_norm": compiled_or_eager(rms_norm), "rope": compiled_or_eager(rope),
            "silu_mul": compiled_or_eager(silu_mul), "sample": compiled_or_eager(sample)}


def compiled_or_eager(fn, backend: str = "inductor"):
    """``fn`` compiled into one graph; called eagerly for inputs that would need a graph past dynamo's
    recompile limit (``torch._dynamo.config.recompile_limit`` per function per process: several models or
    dtypes in one process reach it, and with ``fullgraph`` dynamo then raises instead of running eagerly)."""
    import torch
    from torch._dynamo.exc import FailOnRecompileLimitHit

    fast = torch.compile(fn, dynamic=True, fullgraph=True, backend=backend)
    warned = []

    @functools.wraps(fn)
    def call(*args):
        try:
            return fast(*args)
        except FailOnRecompileLimitHit:
            if not warned:
                warned.append(True)
                logger.warning("fused op %s: dynamo's recompile limit reached; new shapes run eagerly", fn.__name__)
            return fn(*args)

    return call


def _is_rms_norm(module) -> bool:
    return (type(module).__name__.endswith("RMSNorm") and hasattr(module, "variance_epsilon")
            and getattr(module, "weight", None) is not None and module.weight.dim() == 1)


def _is_silu_mlp(module) -> bool:
    import torch

    act = getattr(module, "act_fn", None)
    return (all(hasattr(module, n) for n in ("gate_proj", "up_proj", "down_proj"))
            and (isinstance(act, torch.nn.SiLU) or type(act).__name__ in ("SiLUActivation", "SiLU")))


def _norm_forward(module):
    rms = kernels()["rms_norm"]

    def forward(hidden_states):
        shape = hidden_states.shape
        # 2-D (tokens, hidden): one compiled graph for every batch and length (sizes of 1 specialise)
        return rms(hidden_states.reshape(-1, shape[-1]), module.weight, module.variance_epsilon).view(shape)
    return forward


def _mlp_forward(module):
    silu_mul = kernels()["silu_mul"]

    def forward(x):
        gate, up = module.gate_proj(x), module.up_proj(x)
        return module.down_proj(silu_mul(gate.reshape(-1), up.reshape(-1)).view(gate.shape))
    return forward


def _rope_dispatch(original):
    rope = kernels()["rope"]

    def apply_rotary_pos_emb(q, k, cos, sin, *args, **kwargs):
        if getattr(_state, "on", False) and not args and not kwargs:
            return rope(q, k, cos, sin)
        return original(q, k, cos, sin, *args, **kwargs)

    apply_rotary_pos_emb._agentrl_original = original
    return apply_rotary_pos_emb


def install(model, check) -> bool:
    """Patch ``model`` (see module docstring); ``check()`` runs the model and raises if it is wrong: on any
    error everything patched is restored. Returns whether the fused ops are in place."""
    patched: list[tuple[Any, str, Any]] = []  # (owner, attribute, original or None for an instance attr)
    try:
        for module in model.modules():
            if _is_rms_norm(module):
                patched.append((module, "forward", module.__dict__.get("forward")))
                module.forward = _norm_forward(module)
            elif _is_silu_mlp(module):
                patched.append((module, "forward", module.__dict__.get("forward")))
                module.forward = _mlp_forward(module)
        modeling = sys.modules.get(type(model).__module__)
        rope = getattr(modeling, "apply_rotary_pos_emb", None)
        if rope is not None and not hasattr(rope, "_agentrl_original"):
            patched.append((modeling, "apply_rotary_pos_emb", rope))
            modeling.apply_rotary_pos_emb = _rope_dispatch(rope)
        if not patched:
            return False
        check()
        return True
    except Exception:  # noqa: BLE001 - the eager modules are correct, only slower
        logger.exception("fused ops failed their check; the model keeps transformers' modules")
        for owner, name, original in reversed(patched):
            if original is None:
                owner.__dict__.pop(name, None)
            else:
                setattr(owner, name, original)
        return False
