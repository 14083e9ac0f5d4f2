"""Megatron trainer throughput: tokens/s, MFU and peak memory of ``MegatronTrainer.train_step``.

CPU (runs anywhere, tiny shape)::

    python3 benchmarks/trainer_bench.py --shape tiny --steps 5 --threads 1

The main job's trainer step on CPU, before (padded, a separate behaviour forward) and after (packed, the
behaviour log-probs from the training forward), interleaved in one process so both see the same load::

    python3 benchmarks/trainer_bench.py --batch mainjob --threads 1 --steps 9 --attention sdpa \
        --variants padded:fresh packed:reuse --out benchmarks/results/trainer_bench_mainjob_cpu.json

GPU (one H200; random-init Qwen2 shapes in bf16, 8k tokens per micro-batch, local vs SDPA attention)::

    python3 benchmarks/trainer_bench.py --device cuda --shape qwen2-1.5b --dtype bfloat16 \\
        --seq-len 2048 --seqs-per-microbatch 4 --attention sdpa local

Memory (issue 41: 1.5B at 8k tokens per micro-batch without full recompute; a 4B shape with Adam on the
CPU)::

    python3 benchmarks/trainer_bench.py --device cuda --shape qwen2-1.5b --seq-len 2048 --seqs-per-microbatch 4 \
        --attention sdpa --recompute selective --recompute-modules mlp
    python3 benchmarks/trainer_bench.py --device cuda --shape 4b --seq-len 2048 --seqs-per-microbatch 4 \
        --attention sdpa --optimizer-offload --microbatches 1

Each row has the GiB of the parameters, gradient buffers and optimizer (device; ``optimizer_host_gib``
when offloaded) and, on CUDA with one variant, ``activations_and_temporaries_gib``: the step's peak above
what persists between steps. ``--logprob-chunk-elements 0`` puts a micro-batch's logits in one chunk
(the ``(tokens, vocab)`` memory of the code before chunking).

A train step = one no-grad forward (behaviour log-probs; ``:reuse`` takes them from the training forward
instead) + forward/backward + Adam, as in GRPO. MFU counts the model FLOPs of the passes run (4 x forward,
3 x with ``:reuse``) against ``--peak-tflops`` (H200 dense bf16 datasheet: 989; a bf16 matmul measures
about 790 there, see ``--matmul-peak``). Variants are timed interleaved (step of A, step of B, ...): wall
time and, on CPU, this process's CPU time, which a busy shared machine inflates less. Prints a table and
writes ``benchmarks/results/trainer_bench.json``.
"""

from __future__ import annotations

import argparse
import json
import random
import resource
import sys
import time
import warnings
from pathlib import Path

SHAPES = {
    # the tiny test model (agentrl.models.tiny)
    "tiny": dict(hidden_size=128, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=1024, tie_word_embeddings=True),
    "qwen2-0.5b": dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                       num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True),
    "qwen2-1.5b": dict(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12,
                       num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True),
    # Qwen3-4B's widths and depth in Qwen2 layers (no q/k norms): 3.7B parameters
    "4b": dict(hidden_size=2560, intermediate_size=9728, num_hidden_layers=36, num_attention_heads=32,
               num_key_value_heads=8, vocab_size=151936, tie_word_embeddings=True),
}


def hf_config(shape: str, seq_len: int):
    from transformers import Qwen2Config

    return Qwen2Config(max_position_embeddings=max(seq_len, 512), rope_theta=1e6, **SHAPES[shape])


def forward_flops_per_token(cfg, seq_len: int) -> float:
    """Matmul FLOPs of one forward per token: linears, causal attention (s/2 average keys), LM head."""
    h, L, v = cfg.hidden_size, cfg.num_hidden_layers, cfg.vocab_size
    heads, kv = cfg.num_attention_heads, cfg.num_key_value_heads
    d = h // heads
    qkv = h * (heads + 2 * kv) * d
    proj = heads * d * h
    mlp = 3 * h * cfg.intermediate_size
    attn = 2 * 2 * heads * d * (seq_len / 2)  # QK^T and AV
    return L * (2 * (qkv + proj + mlp) + attn) + 2 * h * v


def mainjob_batch(vocab: int, n_seqs: int = 80, seed: int = 0) -> list[dict]:
    """Shaped like a step of the arithmetic main job (examples/arithmetic): about 80 samples after the
    group filter, ~30 prompt tokens, 55-95 response tokens of which a ~12-token tool reply is not
    trained (the expert conversation tokenises to 103-105 tokens; ~47 trained tokens per sample)."""
    rng = random.Random(seed)
    out = []
    for i in range(n_seqs):
        prompt, resp = rng.randrange(28, 35), rng.randrange(55, 96)
        tool = rng.randrange(10, 15)
        cut = rng.randrange(15, resp - tool - 5)
        mask = [1] * cut + [0] * tool + [1] * (resp - cut - tool)
        out.append(dict(tokens=[rng.randrange(3, vocab) for _ in range(prompt + resp)], response_start=prompt,
                        loss_mask=mask, rollout_logprobs=[-1.0] * resp, reward=float(rng.random() < 0.3),
                        group_id=i // 8))
    return out


def synthetic_batch(n_seqs: int, seq_len: int, vocab: int, seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    prompt = seq_len // 4
    return [
        dict(tokens=[rng.randrange(3, vocab) for _ in range(seq_len)], response_start=prompt,
             loss_mask=[1] * (seq_len - prompt), rollout_logprobs=[-1.0] * (seq_len - prompt),
             reward=float(i % 2), group_id=i // 4)
        for i in range(n_seqs)
    ]


def peak_memory_gib(device: str) -> float:
    import torch

    if device == "cuda":
        return torch.cuda.max_memory_allocated() / 2**30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB -> GiB (process RSS)


def build_trainer(args, cfg, attention: str, layout: str, behaviour: str):
    from agentrl.trainer.actor import MegatronTrainer
    from agentrl.trainer.losses import LossConfig
    from agentrl.trainer.trainer_config import TrainerConfig

    trainer = MegatronTrainer(None, TrainerConfig(
        dtype=args.dtype, attention=attention, lr=args.lr, max_tokens_per_microbatch=args.tokens_per_microbatch,
        recompute=args.recompute, recompute_modules=args.recompute_modules, tp_size=args.tp_size, packing=layout,
        use_distributed_optimizer=args.optimizer_offload, optimizer_cpu_offload=args.optimizer_offload,
        optimizer_offload_fraction=args.offload_fraction, overlap_cpu_optimizer_d2h_h2d=args.overlap_offload,
        loss=LossConfig(kl_coef=args.kl_coef), lr_warmup_steps=0,
    ), hf_config=cfg)
    if behaviour == "fresh":  # the code before: a separate no-grad forward for the behaviour log-probs
        trainer._old_from_train_forward = lambda n_chunks: False
    return trainer


def _storages(tensors) -> dict:
    return {t.untyped_storage().data_ptr(): t for t in tensors}


def _gib(tensors, device: str) -> float:
    """GiB of the distinct storages among ``tensors`` that live on ``device`` (cpu or cuda)."""
    return sum(t.untyped_storage().nbytes() for t in _storages(tensors).values() if t.device.type == device) / 2**30


def memory_components(trainer, device: str) -> dict:
    """GiB held by the parameters, the gradient buffers and the optimizer (fp32 main copies and Adam state
    that are neither), on ``device`` and, for an offloaded optimizer, on the host."""
    import torch

    from agentrl.trainer.fast_optimizer import torch_optimizers

    params = list(trainer.model.parameters())
    grads = [b.grad_data for b in trainer.model.buffers + trainer.model.expert_parallel_buffers]
    taken = set(_storages(params)) | set(_storages(grads))
    opt_tensors = []
    for opt in torch_optimizers(trainer.optimizer):
        for inner in getattr(opt, "sub_optimizers", None) or [opt]:  # the hybrid CPU/GPU optimizer's halves
            opt_tensors += [p for g in inner.param_groups for p in g["params"]]
            opt_tensors += [v for st in inner.state.values() for v in st.values() if isinstance(v, torch.Tensor)]
    opt_tensors = [t for t in opt_tensors if t.untyped_storage().data_ptr() not in taken]
    out = {"params_gib": _gib(params, device), "grads_gib": _gib(grads, device),
           "optimizer_gib": _gib(opt_tensors, device)}
    if device == "cuda":
        out["optimizer_host_gib"] = _gib(opt_tensors, "cpu")
    return out


def count_forwards(trainer, batch) -> tuple[int, int]:
    """(model tokens per forward pass over the batch, forward-equivalents per step: fwd+bwd counts 3)."""
    mbs = trainer._micro_batches(batch)
    tokens = sum(mb.model_tokens.numel() for mb in mbs)
    has_ref = trainer.ref_model is not None or trainer.ref_is_base  # LoRA: the base forward, adapters off
    passes = 3 + (0 if trainer._old_from_train_forward(1) else 1) + (1 if has_ref else 0)
    return tokens, passes


def run_variants(args, variants: list[tuple[str, str, str]]) -> list[dict]:
    import torch

    cfg = hf_config(args.shape, args.seq_len)
    if args.batch == "mainjob":
        batch = mainjob_batch(cfg.vocab_size)
    else:
        batch = synthetic_batch(args.seqs_per_microbatch * args.microbatches, args.seq_len, cfg.vocab_size)
    real_tokens = sum(len(s["tokens"]) for s in batch)
    trainers = [build_trainer(args, cfg, *v) for v in variants]
    sync = torch.cuda.synchronize if args.device == "cuda" else (lambda: None)
    for t in trainers:
        t.train_step(batch)  # warm-up (allocator, kernels; the optimizer state is created here)
    walls: list[list[float]] = [[] for _ in trainers]
    cpus: list[list[float]] = [[] for _ in trainers]
    static_gib = None
    if args.device == "cuda":
        torch.cuda.synchronize()
        static_gib = torch.cuda.memory_allocated() / 2**30  # everything held between steps
        torch.cuda.reset_peak_memory_stats()
    for _ in range(args.steps):
        for k, t in enumerate(trainers):
            sync()
            w0, c0 = time.perf_counter(), time.process_time()
            t.train_step(batch)
            sync()
            walls[k].append(time.perf_counter() - w0)
            cpus[k].append(time.process_time() - c0)
    phases = [phase_times(t, batch) for t in trainers] if args.phases and args.device == "cuda" else None
    world = torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1
    rows = []
    for (attention, layout, behaviour), t, wall, cpu in zip(variants, trainers, walls, cpus, strict=True):
        step_s = sorted(wall)[len(wall) // 2]
        cpu_s = sorted(cpu)[len(cpu) // 2]
        model_tokens, passes = count_forwards(t, batch)
        # Model FLOPs: real tokens only (padding is waste, not work); attention at the batch's mean length.
        mean_len = real_tokens / len(batch)
        flops = passes * forward_flops_per_token(cfg, mean_len) * real_tokens / world
        rows.append(dict(
            shape=args.shape, device=args.device, dtype=args.dtype, attention=attention, layout=layout,
            behaviour_logprobs=behaviour, batch=args.batch, seq_len=args.seq_len, samples=len(batch),
            seqs_per_microbatch=args.seqs_per_microbatch, microbatches=args.microbatches,
            real_tokens=real_tokens, model_tokens_per_pass=model_tokens, forward_equivalents=passes,
            world_size=world, tp_size=args.tp_size, kl_coef=args.kl_coef,
            tokens_per_microbatch=args.tokens_per_microbatch, recompute=args.recompute,
            params_m=sum(p.numel() for p in t.gpt.parameters()) / 1e6,
            step_s=step_s, step_s_all=wall, cpu_s=cpu_s if args.device == "cpu" else None,
            tokens_per_s=real_tokens / step_s, achieved_tflops=flops / step_s / 1e12,
            mfu=(flops / step_s / 1e12 / args.peak_tflops) if args.peak_tflops else None,
            mfu_of_matmul_peak=(flops / step_s / 1e12 / args.matmul_peak) if args.matmul_peak else None,
            peak_mem_gib=peak_memory_gib(args.device),
            fast_optimizer=fast_optimizer_on(), fused_logprobs=t._fused_logprobs(),
            recompute_modules=args.recompute_modules if args.recompute == "selective" else None,
            optimizer_offload=args.optimizer_offload, logprob_chunk_tokens=chunk_tokens(cfg, args),
            **memory_components(t, args.device),
        ))
        if static_gib is not None and len(trainers) == 1:
            # the step's peak above what persists between steps: activations, their gradients and the
            # log-prob chunks (plus transient buffers of the optimizer step)
            rows[-1]["static_gib"] = static_gib
            rows[-1]["activations_and_temporaries_gib"] = rows[-1]["peak_mem_gib"] - static_gib
        if phases is not None:
            rows[-1]["phases_s"] = phases[len(rows) - 1]
    del trainers
    import gc

    gc.collect()
    if args.device == "cuda":
        torch.cuda.empty_cache()
    return rows


def chunk_tokens(cfg, args) -> int:
    from agentrl.trainer.chunked_logprobs import chunk_tokens_for

    return chunk_tokens_for(cfg.vocab_size // args.tp_size)


def fast_optimizer_on() -> bool:
    import torch

    from agentrl.trainer import fast_optimizer

    return fast_optimizer.ENABLED and torch.cuda.is_available()


def phase_times(trainer, batch) -> dict:
    """CUDA: one train step with a device sync around each phase: seconds in the forwards (model + fp32
    logits), the backwards, the gradient sync and the optimizer step; ``other`` is the rest (log-probs,
    loss, metrics, zeroing). The syncs serialise host and device, so the phases add up to a bit more than
    an unsynced step; the split says which phase a change moved. ``<phase>_host``: the seconds until each
    call returned, before its sync (near the phase's own: the device waited on the host there)."""
    import torch

    spent: dict[str, float] = {}
    hosts: dict[str, float] = {}

    def timed(name, fn):
        def wrapper(*a, **kw):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            out = fn(*a, **kw)
            host = time.perf_counter() - t0  # until the call returned: its host side (plus any syncs in it)
            torch.cuda.synchronize()
            spent[name] = spent.get(name, 0.0) + time.perf_counter() - t0
            hosts[name] = hosts.get(name, 0.0) + host
            return out
        return wrapper

    backward = torch.Tensor.backward
    trainer._forward = timed("forward", trainer._forward)
    trainer.optimizer.step = timed("optimizer", trainer.optimizer.step)
    trainer.model.finish_grad_sync = timed("grad_sync", trainer.model.finish_grad_sync)
    torch.Tensor.backward = timed("backward", backward)
    try:
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        trainer.train_step(batch)
        torch.cuda.synchronize()
        total = time.perf_counter() - t0
    finally:
        torch.Tensor.backward = backward
        del trainer._forward, trainer.optimizer.step, trainer.model.finish_grad_sync
    out = {k: round(v, 4) for k, v in spent.items()}
    out["other"] = round(total - sum(spent.values()), 4)
    out["total"] = round(total, 4)
    # host seconds of each phase: close to the phase's seconds means the GPU waited on Python there
    out.update({f"{k}_host": round(v, 4) for k, v in hosts.items()})
    return out


def profile_step(args, variant: tuple[str, str, str]) -> dict:
    """CUDA: one train step of ``variant`` under ``torch.profiler``; kernels by self device time, grouped
    into matmuls, attention, the optimizer and the rest (where a step's time goes)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    cfg = hf_config(args.shape, args.seq_len)
    batch = synthetic_batch(args.seqs_per_microbatch * args.microbatches, args.seq_len, cfg.vocab_size)
    trainer = build_trainer(args, cfg, *variant)
    trainer.train_step(batch)  # warm-up
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        trainer.train_step(batch)
        torch.cuda.synchronize()
    events = [e for e in prof.key_averages() if getattr(e, "self_device_time_total", 0) > 0]
    total = sum(e.self_device_time_total for e in events) or 1.0

    def group(name: str) -> str:
        low = name.lower()
        if any(k in low for k in ("gemm", "nvjet", "cutlass", "sm90_xmma", "cublas", "matmul")):
            return "matmul"
        if any(k in low for k in ("flash", "fmha", "attention", "sdpa")):
            return "attention"
        if any(k in low for k in ("adam", "multi_tensor", "foreach")):
            return "optimizer/foreach"
        return "other"

    groups: dict[str, float] = {}
    for e in events:
        groups[group(e.key)] = groups.get(group(e.key), 0.0) + e.self_device_time_total
    top = sorted(events, key=lambda e: -e.self_device_time_total)[:30]
    result = {"variant": ":".join(variant), "device_ms": total / 1e3,
              "groups_ms": {k: round(v / 1e3, 2) for k, v in sorted(groups.items(), key=lambda kv: -kv[1])},
              "top": [{"kernel": e.key[:160], "ms": round(e.self_device_time_total / 1e3, 3), "calls": e.count,
                       "share": round(e.self_device_time_total / total, 4)} for e in top]}
    print(f"profile {result['variant']}: {result['device_ms']:.1f} ms of kernels in one step; by group (ms): "
          f"{result['groups_ms']}")
    for row in result["top"]:
        print(f"  {row['ms']:>8.2f} ms {100 * row['share']:>5.1f}% x{row['calls']:<5} {row['kernel'][:110]}")
    del trainer
    return result


def measure_matmul_peak() -> float:
    """bf16 TFLOP/s of a large random 8192^3 matmul on this GPU (median of 20, after warm-up)."""
    import torch

    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    for _ in range(5):
        a @ b
    times = []
    for _ in range(20):
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        a @ b
        e1.record()
        e1.synchronize()
        times.append(e0.elapsed_time(e1) / 1e3)
    return 2 * 8192**3 / sorted(times)[len(times) // 2] / 1e12


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--shape", choices=sorted(SHAPES), default="tiny")
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default=None,
                        help="default: float32 on cpu, bfloat16 on cuda")
    parser.add_argument("--seq-len", type=int, default=None, help="default: 128 on cpu, 2048 on cuda")
    parser.add_argument("--seqs-per-microbatch", type=int, default=None, help="default: 4")
    parser.add_argument("--microbatches", type=int, default=2)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--attention", nargs="+", default=["sdpa", "local"], choices=["sdpa", "local", "te"])
    parser.add_argument("--variants", nargs="+", default=["auto:reuse"],
                        help="layout:behaviour pairs; layout auto|packed|padded, behaviour reuse (log-probs of "
                             "the training forward) or fresh (a separate forward, the code before)")
    parser.add_argument("--batch", choices=["synthetic", "mainjob"], default="synthetic",
                        help="synthetic: equal lengths (--seq-len); mainjob: the arithmetic main job's shape")
    parser.add_argument("--kl-coef", type=float, default=None, help="default 0.001 for mainjob (a reference "
                        "forward, as the main job), else 0")
    parser.add_argument("--lr", type=float, default=1e-6)
    parser.add_argument("--matmul-peak", type=float, default=None,
                        help="bf16 matmul TFLOP/s for MFU; default on cuda: measured here (8192^3)")
    parser.add_argument("--recompute", nargs="?", const="full", default="none", choices=["none", "selective", "full"],
                        help="activation recomputation (bare --recompute: full)")
    parser.add_argument("--recompute-modules", nargs="+", default=["core_attn"],
                        help="with --recompute selective: megatron-core modules (core_attn, mlp, ...)")
    parser.add_argument("--optimizer-offload", action="store_true",
                        help="Adam on the CPU (megatron-core's hybrid optimizer, inside the distributed optimizer)")
    parser.add_argument("--offload-fraction", type=float, default=1.0, help="with --optimizer-offload")
    parser.add_argument("--overlap-offload", action="store_true",
                        help="with --optimizer-offload: overlap the copies (overlap_cpu_optimizer_d2h_h2d)")
    parser.add_argument("--logprob-chunk-elements", type=int, default=None,
                        help="logits per log-prob chunk (agentrl.trainer.chunked_logprobs.CHUNK_ELEMENTS); 0: one "
                             "chunk per micro-batch, i.e. (tokens, vocab) logits at once (the before of an A/B)")
    parser.add_argument("--peak-tflops", type=float, default=None, help="for MFU; default 989 on cuda (H200)")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch CPU threads (on a shared 2-core box, 1 avoids oversubscription: 16x faster)")
    parser.add_argument("--tp-size", type=int, default=1,
                        help="tensor parallel size; run under torchrun (data parallel gets the other ranks)")
    parser.add_argument("--profile", action="store_true",
                        help="cuda: then profile one step of the first variant (kernels by device time) into the JSON")
    parser.add_argument("--megatron-override", action="append", default=[], metavar="KEY=VALUE",
                        help="cuda experiments: a TransformerConfig field for every trainer built (e.g. "
                             "bias_activation_fusion=true); the value is read as JSON")
    parser.add_argument("--phases", action="store_true",
                        help="cuda: one more step per variant with a sync around each phase (forward, backward, "
                             "grad sync, optimizer); seconds per phase in the JSON and printed")
    parser.add_argument("--megatron-fallbacks", action="store_true",
                        help="cuda: Megatron's own per-tensor multi-tensor fallbacks and torch's foreach AdamW "
                             "(agentrl.trainer.fast_optimizer off: the before of an A/B)")
    parser.add_argument("--fp32-logprobs", action="store_true",
                        help="cuda: each log-prob chunk in fp32 torch ops (agentrl.trainer.fused_logprobs off: "
                             "the before of an A/B)")
    parser.add_argument("--setups", nargs="+", default=None, metavar="LENxSEQSxMB",
                        help="run each shape in turn in this one process (imports and compiled kernels shared): "
                             "sequence length x sequences per micro-batch x micro-batches per step, e.g. 2048x4x2 "
                             "8192x1x8; overrides --seq-len/--seqs-per-microbatch/--microbatches")
    parser.add_argument("--out", default="benchmarks/results/trainer_bench.json")
    args = parser.parse_args(argv)
    if args.setups:
        try:
            setups = [tuple(int(x) for x in s.split("x")) for s in args.setups]
            assert all(len(s) == 3 and min(s) > 0 for s in setups)
        except (ValueError, AssertionError):
            parser.error(f"--setups: {args.setups} are not LENxSEQSxMB triples of positive integers")
        args.seq_len = max(s[0] for s in setups)  # the model's positions cover the longest
    args.dtype = args.dtype or ("bfloat16" if args.device == "cuda" else "float32")
    args.seq_len = args.seq_len or (2048 if args.device == "cuda" else 128)
    args.seqs_per_microbatch = args.seqs_per_microbatch or 4
    args.tokens_per_microbatch = 8192 if args.batch == "mainjob" else args.seq_len * args.seqs_per_microbatch
    if args.kl_coef is None:
        args.kl_coef = 0.001 if args.batch == "mainjob" else 0.0
    if args.peak_tflops is None and args.device == "cuda":
        args.peak_tflops = 989.0
    if args.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            print("trainer_bench: --device cuda but CUDA is not available", file=sys.stderr)
            return 2
    warnings.filterwarnings("ignore")
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)

    if args.device == "cuda" and args.matmul_peak is None:
        args.matmul_peak = measure_matmul_peak()
    if args.megatron_fallbacks:
        from agentrl.trainer import fast_optimizer

        fast_optimizer.ENABLED = False
    if args.fp32_logprobs:
        from agentrl.trainer import fused_logprobs

        fused_logprobs.ENABLED = False
    if args.logprob_chunk_elements is not None:
        from agentrl.trainer import chunked_logprobs

        chunked_logprobs.CHUNK_ELEMENTS = args.logprob_chunk_elements or 2**62
    if args.megatron_override:
        import agentrl.trainer.model as model_module

        overrides = {k: json.loads(v) for k, v in (o.split("=", 1) for o in args.megatron_override)}
        plain = model_module.transformer_config_from_hf
        model_module.transformer_config_from_hf = lambda *a, **kw: plain(*a, **{**kw, **overrides})
    import os

    rows = []
    out = Path(args.out)
    for setup in setups if args.setups else [None]:
        if setup is not None:
            args.seq_len, args.seqs_per_microbatch, args.microbatches = setup
            args.tokens_per_microbatch = args.seq_len * args.seqs_per_microbatch
        rows.extend(run_attentions(args, parser))
        if setup is not None and int(os.environ.get("RANK", "0")) == 0:  # each shape's rows as they come (a
            print_rows(rows[-len(args.attention):])                     # time limit keeps those done)
            out.parent.mkdir(parents=True, exist_ok=True)
            out.write_text(json.dumps(rows, indent=2))

    if int(os.environ.get("RANK", "0")) != 0:
        return 0 if all("error" not in r for r in rows) else 1
    if not args.setups:
        print_rows(rows)
    if args.megatron_override:
        for r in rows:
            r["megatron_overrides"] = args.megatron_override
    result: list | dict = rows
    if args.profile and args.device == "cuda":
        first = (args.attention[0], *args.variants[0].split(":"))
        result = {"rows": rows, "profile": profile_step(args, first)}
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    return 0 if all("error" not in r for r in rows) else 1


def run_attentions(args, parser) -> list[dict]:
    rows = []
    for attention in args.attention:
        variants = [(attention, *v.split(":")) for v in args.variants]
        for _, layout, behaviour in variants:
            if layout not in ("auto", "packed", "padded") or behaviour not in ("reuse", "fresh"):
                parser.error(f"--variants: {layout}:{behaviour} is not layout:behaviour")
        if attention == "local":  # local attention runs padded only
            variants = [(a, "padded", b) for a, _, b in variants]
            variants = list(dict.fromkeys(variants))
        try:
            rows.extend(run_variants(args, variants))
        except Exception as exc:  # e.g. OOM for the local spec at long sequences: report, keep going
            rows.append(dict(shape=args.shape, attention=attention, seq_len=args.seq_len,
                             microbatches=args.microbatches, error=f"{type(exc).__name__}: {exc}"[:300]))
            import gc

            gc.collect()
            if args.device == "cuda":
                import torch

                torch.cuda.empty_cache()
    return rows


def print_rows(rows: list[dict]) -> None:
    header = (f"{'shape':<11} {'setup':<9} {'attn':<5} {'variant':<13} {'dtype':<9} {'tokens':>6} {'model tok':>9} {'step s':>7} "
              f"{'cpu s':>6} {'tok/s':>9} {'TFLOP/s':>8} {'MFU':>6} {'of mm':>6} {'peak GiB':>8}")
    print(header)
    for r in rows:
        if "error" in r:
            print(f"{r['shape']:<11} {r.get('seq_len')}x?x{r.get('microbatches')} {r['attention']:<5} ERROR {r['error']}")
            continue
        mfu = f"{100 * r['mfu']:.1f}%" if r["mfu"] is not None else "n/a"
        of_mm = f"{100 * r['mfu_of_matmul_peak']:.1f}%" if r["mfu_of_matmul_peak"] is not None else "n/a"
        cpu = f"{r['cpu_s']:.3f}" if r["cpu_s"] is not None else "n/a"
        variant = f"{r['layout']}:{r['behaviour_logprobs']}"
        setup = f"{r['seq_len']}x{r['seqs_per_microbatch']}x{r['microbatches']}"
        print(f"{r['shape']:<11} {setup:<9} {r['attention']:<5} {variant:<13} {r['dtype']:<9} {r['real_tokens']:>6} "
              f"{r['model_tokens_per_pass']:>9} {r['step_s']:>7.3f} {cpu:>6} {r['tokens_per_s']:>9.0f} "
              f"{r['achieved_tflops']:>8.3f} {mfu:>6} {of_mm:>6} {r['peak_mem_gib']:>8.2f}")
        memory = {k.removesuffix("_gib"): round(v, 2) for k, v in r.items() if k.endswith("_gib") and k != "peak_mem_gib"}
        print(f"  memory GiB: {memory}")
        if "phases_s" in r:
            print(f"  phases (s, synced): {r['phases_s']}")


if __name__ == "__main__":
    sys.exit(main())
