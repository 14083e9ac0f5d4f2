"""Embedded engine generation against HF ``generate`` (static cache): output tokens/s, time to first token
and per-token latency at several concurrencies, on the same random-init Qwen2-shaped model and batch.

The engine runs in this process (``Engine`` + its scheduler thread, no HTTP): ``concurrency`` requests of
``--prompt-len`` random tokens are submitted at once, each generating exactly ``--new-tokens`` (T=1,
ignore_eos), after an untimed 4-token run at that concurrency (``--no-warm``: without; the first run at a
concurrency captures its decode graphs). Token times are taken in the worker thread as each token is
appended. Engine modes:
``static`` (fixed KV buffers, decode steps replayed as CUDA graphs: the default on CUDA) and ``dynamic``
(the left-padded KV rebuilt as rows join or leave, every kernel launched from Python: the CPU default).

The anchors are HF ``model.generate`` on the same prompts as one ``[concurrency, prompt_len]`` batch,
sampling at T=1 for exactly as many tokens: ``static`` (``cache_implementation="static"``, which
transformers compiles itself on each new shape: timed warm, after one untimed call at that shape, whose
time is reported as ``cold_seconds``) and ``eager`` (the default dynamic cache: what TRL's GRPOTrainer
calls without vLLM). Time to first token is a ``max_new_tokens=1`` call; per-token latency the rest over
the remaining tokens.

    python3 benchmarks/engine_gpu_bench.py --device cuda --shapes qwen2-0.5b qwen2-1.5b \\
        --concurrency 1 32 128 256 --out benchmarks/results/engine_gpu_bench.json
    python3 benchmarks/engine_gpu_bench.py --device cpu --shapes tiny --concurrency 1 4 \\
        --prompt-len 32 --new-tokens 16          # smoke run

Prints a table and writes JSON.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).parent))
from trainer_bench import SHAPES  # noqa: E402


class _InlineLoop:
    """Stands in for the event loop a server hands the scheduler: runs ``notify`` at once, in the worker."""

    def call_soon_threadsafe(self, fn) -> None:
        fn()


def build_model_dir(shape: str, dtype: str, root: Path, context: int, device: str, seed: int = 0) -> Path:
    import torch
    from transformers import AutoModelForCausalLM, Qwen2Config

    from agentrl.models.tiny import copy_tokenizer

    torch.manual_seed(seed)
    config = Qwen2Config(max_position_embeddings=context, rope_theta=1e6, **SHAPES[shape])
    with torch.device(device):  # random init on the GPU: seconds instead of a minute for 1.5B on the CPU
        model = AutoModelForCausalLM.from_config(config, dtype=getattr(torch, dtype))
    out = copy_tokenizer(root / shape)
    model.save_pretrained(out, safe_serialization=True)
    return out


def prompts_for(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(length)] for _ in range(n)]


def engine_run(engine, prompts: list[list[int]], new_tokens: int, sync) -> dict:
    """Submit every prompt at once; wait until all finish; per-request first-token and finish times."""
    from agentrl.engine.protocol import SamplingParams
    from agentrl.engine.scheduler import Sequence

    loop = _InlineLoop()
    done = threading.Event()
    first: dict[str, float] = {}
    finished: dict[str, float] = {}
    seqs = []

    def notify_for(seq):
        def notify() -> None:
            now = time.perf_counter()
            if seq.output_ids and seq.rid not in first:
                first[seq.rid] = now
            if seq.finish_reason is not None:
                finished[seq.rid] = now
                if len(finished) == len(prompts):
                    done.set()
        return notify

    for p in prompts:
        seq = Sequence(prompt_ids=list(p), stream=True, loop=loop,
                       params=SamplingParams(max_new_tokens=new_tokens, temperature=1.0, ignore_eos=True))
        seq.notify = notify_for(seq)
        seqs.append(seq)
    sync()
    t0 = time.perf_counter()
    for seq in seqs:
        engine.scheduler.submit(seq)
    if not done.wait(timeout=1800):
        raise TimeoutError("engine run did not finish")
    wall = time.perf_counter() - t0
    bad = [s.finish_reason for s in seqs if (s.finish_reason or {}).get("type") != "length"]
    if bad:
        raise RuntimeError(f"requests ended early: {bad[:3]}")
    tokens = sum(len(s.output_ids) for s in seqs)
    ttft = sorted(first[s.rid] - t0 for s in seqs)
    tpot = sorted((finished[s.rid] - first[s.rid]) / max(len(s.output_ids) - 1, 1) for s in seqs)
    return {"seconds": wall, "output_tokens": tokens, "output_tokens_per_s": tokens / wall,
            "ttft_p50_s": ttft[len(ttft) // 2], "ttft_max_s": ttft[-1],
            "per_token_p50_s": tpot[len(tpot) // 2]}


def step_split(before: dict, after: dict, seconds: float) -> dict:
    """The worker's time over a run from two ``Scheduler.stats()`` snapshots: per decode step its wall time,
    the worker's busy time, the time it waited for the device in ``collect`` and the host time left once
    device waits, admissions (prefill included) and graph captures are taken out; and the run's events."""
    d = {k: after[k] - before.get(k, 0) for k in after}
    steps = max(d["decode_steps"], 1)
    host = d["busy_s"] - d.get("runner_wait_s", 0.0) - d["admit_s"] - d.get("runner_capture_s", 0.0)
    return {"decode_steps": d["decode_steps"], "wall_ms_per_step": 1e3 * seconds / steps,
            "busy_ms_per_step": 1e3 * d["busy_s"] / steps, "wait_ms_per_step": 1e3 * d.get("runner_wait_s", 0.0) / steps,
            "host_ms_per_step": 1e3 * host / steps, "idle_s": seconds - d["busy_s"],
            "admissions": d["admissions"], "rows_per_admission": d["admitted_rows"] / max(d["admissions"], 1),
            "admit_s": d["admit_s"], "drop_s": d["drop_s"], "drains": d["drains"],
            "pipelined_fraction": d["pipelined_steps"] / steps, "dropped_tokens": d["dropped_tokens"],
            **{k[len("runner_"):]: v for k, v in d.items() if k.startswith("runner_") and k != "runner_wait_s"}}


SPLIT_HEADER = (f"{'run':<26} {'steps':>5} {'wall':>6} {'busy':>6} {'wait':>6} {'host':>6} {'idle s':>6} {'adm':>4} "
                f"{'rows/adm':>8} {'adm s':>6} {'drop s':>6} {'drains':>6} {'pipe%':>5} {'capt':>4} {'capt s':>6} "
                f"{'eager':>5} {'writes':>6} {'prefill':>7}  (ms per decode step)")


def split_line(name: str, s: dict) -> str:
    return (f"{name:<26} {s['decode_steps']:>5} {s['wall_ms_per_step']:>6.2f} {s['busy_ms_per_step']:>6.2f} "
            f"{s['wait_ms_per_step']:>6.2f} {s['host_ms_per_step']:>6.2f} {s['idle_s']:>6.2f} {s['admissions']:>4} "
            f"{s['rows_per_admission']:>8.1f} {s['admit_s']:>6.3f} {s['drop_s']:>6.3f} {s['drains']:>6} "
            f"{100 * s['pipelined_fraction']:>5.0f} {s.get('captures', 0):>4} {s.get('capture_s', 0):>6.2f} "
            f"{s.get('eager_steps', 0):>5} {s.get('input_writes', 0):>6} {s.get('prefills', 0):>3}/{s.get('fused_prefills', 0):<3}")


def hf_generate_run(model, prompts: list[list[int]], new_tokens: int, device: str, sync, mode: str = "static") -> dict:
    import torch

    ids = torch.tensor(prompts, device=device)
    kw = dict(do_sample=True, temperature=1.0, top_k=0, top_p=1.0, pad_token_id=0)
    if mode == "static":
        kw["cache_implementation"] = "static"

    def timed(n: int) -> tuple[float, int]:
        sync()
        t0 = time.perf_counter()
        with torch.inference_mode():
            out = model.generate(ids, max_new_tokens=n, min_new_tokens=n, **kw)
        sync()
        return time.perf_counter() - t0, out.shape[1] - ids.shape[1]

    cold = None
    if mode == "static":  # the first call at a shape compiles: untimed for the figures, reported
        cold = timed(new_tokens)[0]
        timed(1)
    ttft, _ = timed(1)
    wall, generated = timed(new_tokens)
    tokens = generated * len(prompts)
    return {"seconds": wall, "output_tokens": tokens, "output_tokens_per_s": tokens / wall, "ttft_p50_s": ttft,
            "ttft_max_s": ttft, "per_token_p50_s": (wall - ttft) / max(new_tokens - 1, 1), "cold_seconds": cold}


def write_trace(path: Path, trace: list[tuple]) -> None:
    """The scheduler's per-step trace, times from the first record: [what, start s, seconds, rows, queued]."""
    path.parent.mkdir(parents=True, exist_ok=True)
    t0 = trace[0][1] if trace else 0.0
    path.write_text(json.dumps([[r[0], round(r[1] - t0, 6), round(r[2], 6), *r[3:]] for r in trace]))


def _timed(fn, acc: dict, key: str, sync):
    def wrapped(*a, **k):
        t0 = time.perf_counter()
        out = fn(*a, **k)
        sync()
        acc[key] = acc.get(key, 0.0) + time.perf_counter() - t0
        acc[key + "_calls"] = acc.get(key + "_calls", 0) + 1
        return out
    return wrapped


def profile_engine(args, engine, shape: str, concurrency: int, vocab: int, sync, out_dir: Path | None) -> dict:
    """Where one decode iteration's time goes at ``concurrency``: the worker's phases (each synchronized
    with the device, so device time lands in the phase that launched it), the captured steps' replay time
    alone (CUDA events, no host work between replays), and a torch.profiler table of a short run."""
    import torch

    sched, runner = engine.scheduler, engine.runner
    result: dict = {"shape": shape, "concurrency": concurrency, "fused_sampling": runner.fused_sampling}
    pipelined = sched.pipelined_steps
    engine_run(engine, prompts_for(concurrency, args.prompt_len, vocab, seed=20_000 + concurrency), 4, sync)
    acc: dict = {}
    originals = {name: getattr(sched, name) for name in ("_admit", "_decode_step", "_sample", "_append_token",
                                                         "_finish_done")}
    r_originals = {name: getattr(runner, name) for name in ("decode", "launch_sample", "collect")}
    for name, fn in originals.items():
        setattr(sched, name, _timed(fn, acc, name, sync if name != "_append_token" else (lambda: None)))
    for name, fn in r_originals.items():
        setattr(runner, name, _timed(fn, acc, "runner." + name, sync))
    try:
        r = engine_run(engine, prompts_for(concurrency, args.prompt_len, vocab, seed=concurrency), args.new_tokens, sync)
    finally:
        for name in originals:
            delattr(sched, name)
        for name in r_originals:
            delattr(runner, name)
    steps = acc.get("_decode_step_calls", 1)
    result["run"] = r
    result["pipelined_steps"] = sched.pipelined_steps - pipelined
    result["per_step_ms"] = {k: 1e3 * v / steps for k, v in acc.items() if not k.endswith("_calls")}
    result["calls"] = {k: v for k, v in acc.items() if k.endswith("_calls")}
    # the captured steps alone
    replays = {}
    for key, step in list(runner._graphs.items()):
        if step.get("graph") is None:
            continue
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        with torch.inference_mode():
            snapshot = [t.clone() for t in (step["ids"], step["positions"], step["column"])]
        for _ in range(3):
            step["graph"].replay()
        times = []
        for _ in range(20):
            start.record()
            step["graph"].replay()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        with torch.inference_mode():
            for t, v in zip((step["ids"], step["positions"], step["column"]), snapshot, strict=True):
                t.copy_(v)
        step.pop("state", None)  # inputs rewritten at the next use
        replays[f"bucket{key[0]}_{'fused' if key[2] else 'logits'}"] = sorted(times)[len(times) // 2]
    result["replay_ms"] = replays
    if out_dir is not None:
        from torch.profiler import ProfilerActivity, profile

        # one decode step's kernels alone: replays of the captured step of this concurrency's bucket
        key = max((k for k, st in runner._graphs.items() if st.get("graph") is not None and k[0] <= concurrency
                   and k[2]), default=None)
        if key is not None:
            step = runner._graphs[key]
            with torch.inference_mode():
                snapshot = [t.clone() for t in (step["ids"], step["positions"], step["column"])]
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                for _ in range(10):
                    step["graph"].replay()
                torch.cuda.synchronize()
            with torch.inference_mode():
                for t, v in zip((step["ids"], step["positions"], step["column"]), snapshot, strict=True):
                    t.copy_(v)
            step.pop("state", None)
            kernels = [e for e in prof.events() if e.device_type.name == "CUDA"]
            result["replay_kernels_per_step"] = len(kernels) / 10
            with (out_dir / "profile_tables.txt").open("a") as f:
                f.write(f"==== {shape} c={concurrency}: 10 replays of the captured step of bucket {key[0]} "
                        f"({len(kernels) / 10:.0f} kernels per step)\n"
                        f"{prof.key_averages().table(sort_by='cuda_time_total', row_limit=30)}\n")

        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            engine_run(engine, prompts_for(concurrency, args.prompt_len, vocab, seed=30_000 + concurrency), 16, sync)
        tag = f"{shape} c={concurrency} {'fused' if runner.fused_sampling else 'logits'} (16-token run)"
        table = prof.key_averages().table(sort_by="cuda_time_total", row_limit=40)
        with (out_dir / "profile_tables.txt").open("a") as f:
            f.write(f"==== {tag}\n{table}\n")
        kernels = [e for e in prof.events() if e.device_type.name == "CUDA"]
        result["profile_kernel_ms_total"] = sum(e.device_time for e in kernels) / 1e3 if kernels else None
    print(json.dumps({"profile": result}), flush=True)
    return result


def bench_shape(args, shape: str, root: Path) -> list[dict]:
    import torch
    from transformers import AutoModelForCausalLM

    from agentrl.engine.engine import Engine, EngineConfig

    sync = torch.cuda.synchronize if args.device == "cuda" else (lambda: None)
    context = args.prompt_len + args.new_tokens + 8
    model_dir = build_model_dir(shape, args.dtype, root, context, args.device)
    vocab = SHAPES[shape]["vocab_size"]
    rows = []
    for mode in args.engine_modes:
        built = time.perf_counter()
        engine = Engine(EngineConfig(str(model_dir), dtype=args.dtype, device=args.device,
                                     max_batch_size=max(args.concurrency), max_prefill_tokens=args.max_prefill_tokens,
                                     prefix_cache_tokens=0, static_kv=mode == "static",
                                     fused_ops=False if args.no_fused_ops else None))
        engine.runner.fused_sampling = not args.no_fused_sampling
        if args.no_fused_decoder:  # transformers' modules (with the compiled ops) instead of fused_decoder.py
            engine.runner.fused_decoder, engine.runner.fused_prefill = None, False
        elif args.no_fused_prefill:
            engine.runner.fused_prefill = False
        engine.scheduler.pipeline_depth = args.pipeline_depth
        if args.no_triton_attention:
            from agentrl.engine import attention

            attention.TRITON_DECODE = False
        print(json.dumps({"engine_ready_s": time.perf_counter() - built, "fused_ops": engine.runner.fused_ops,
                          "fused_decoder": engine.runner.fused_decoder is not None,
                          "fused_prefill": engine.runner.fused_prefill}), flush=True)
        engine.start()
        print(SPLIT_HEADER, flush=True)
        try:
            engine_run(engine, prompts_for(2, args.prompt_len, vocab, seed=999), 4, sync)  # warm-up
            for c in args.concurrency:
                warm = None
                if args.warm:  # capture this concurrency's decode graphs (row buckets as rows join) untimed
                    warm = engine_run(engine, prompts_for(c, args.prompt_len, vocab, seed=10_000 + c), 4, sync)["seconds"]
                pipelined = engine.scheduler.pipelined_steps
                stats0 = engine.scheduler.stats()
                if args.trace_dir:
                    engine.scheduler.trace = []
                r = engine_run(engine, prompts_for(c, args.prompt_len, vocab, seed=c), args.new_tokens, sync)
                r["pipelined_steps"] = engine.scheduler.pipelined_steps - pipelined
                r["split"] = step_split(stats0, engine.scheduler.stats(), r["seconds"])
                print(split_line(f"engine_{mode} c={c}", r["split"]), flush=True)
                if args.trace_dir:
                    write_trace(Path(args.trace_dir) / f"trace_gpu_bench_{shape}_c{c}.json", engine.scheduler.trace)
                    engine.scheduler.trace = None
                rows.append({"shape": shape, "runner": f"engine_{mode}", "concurrency": c, **r, "warmup_seconds": warm,
                             "fused_ops": engine.runner.fused_ops, "decode_sdpa": args.decode_sdpa,
                             "fused_decoder": engine.runner.fused_decoder is not None,
                             "fused_prefill": engine.runner.fused_prefill,
                             "pdl": not args.no_pdl,
                             "triton_attention": __import__("agentrl.engine.attention").engine.attention.TRITON_DECODE,
                             "cuda_graphs": engine.runner.cuda_graphs and not engine.runner._graph_failed,
                             "fused_sampling": engine.runner.fused_sampling})
                print(json.dumps(rows[-1]), flush=True)
            for c in args.profile:
                for fused in (True, False) if args.profile_host_sampling else (True,):
                    engine.runner.fused_sampling = fused
                    args.profiles.append(profile_engine(args, engine, shape, c, vocab, sync,
                                                        Path(args.out).parent if args.device == "cuda" else None))
                engine.runner.fused_sampling = True
        finally:
            engine.shutdown()
        del engine
        if args.device == "cuda":
            torch.cuda.empty_cache()
    if args.hf_modes and shape in args.hf_shapes:
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, args.dtype),
                                                     attn_implementation="sdpa").to(args.device).eval()
        for mode in args.hf_modes:
            for c in args.hf_concurrency or args.concurrency:
                r = hf_generate_run(model, prompts_for(c, args.prompt_len, vocab, seed=c), args.new_tokens, args.device,
                                    sync, mode)
                rows.append({"shape": shape, "runner": f"hf_generate_{mode}", "concurrency": c, **r})
                print(json.dumps(rows[-1]), flush=True)
        del model
    if args.device == "cuda":
        torch.cuda.empty_cache()
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--shapes", nargs="+", default=["tiny"], choices=sorted(SHAPES))
    p.add_argument("--dtype", default=None, help="default: bfloat16 on cuda, float32 on cpu")
    p.add_argument("--concurrency", nargs="+", type=int, default=[1, 32, 128, 256])
    p.add_argument("--prompt-len", type=int, default=512)
    p.add_argument("--new-tokens", type=int, default=256)
    p.add_argument("--max-prefill-tokens", type=int, default=None, help="engine; default 65536 on cuda (128 prompts of 512 in one prefill), 8192 on cpu")
    p.add_argument("--engine-modes", nargs="+", default=["static"], choices=["static", "dynamic"])
    p.add_argument("--hf-modes", nargs="*", default=["static"], choices=["static", "eager"],
                   help="HF generate anchors (none: engine only)")
    p.add_argument("--hf-shapes", nargs="+", default=None, help="shapes with HF anchors (default: all)")
    p.add_argument("--hf-concurrency", nargs="+", type=int, default=None, help="default: --concurrency")
    p.add_argument("--warm", action=argparse.BooleanOptionalAction, default=True,
                   help="before each timed engine run, an untimed 4-token run at that concurrency (captures its "
                        "CUDA graphs, as the HF static anchor is timed after an untimed call); --no-warm: cold")
    p.add_argument("--profile", nargs="*", type=int, default=[],
                   help="after the timed rows, per-phase timings of a decode iteration at these concurrencies, "
                        "with and without sampling in the captured step (and torch.profiler tables on cuda)")
    p.add_argument("--no-fused-sampling", action="store_true", help="engine: sample on the host side (the old path)")
    p.add_argument("--no-fused-ops", action="store_true", help="engine: transformers' eager RMSNorm/RoPE/SiLU")
    p.add_argument("--no-triton-attention", action="store_true",
                   help="engine: SDPA for the decode attention of transformers' modules (with --no-fused-decoder)")
    p.add_argument("--no-fused-decoder", action="store_true",
                   help="engine: transformers' modules for decode and prefill (fused_decoder.py off)")
    p.add_argument("--no-fused-prefill", action="store_true", help="engine: transformers' modules for the prefill")
    p.add_argument("--pipeline-depth", type=int, default=2,
                   help="engine: decode steps in flight behind the one being collected (0: none)")
    p.add_argument("--decode-sdpa", default=None, choices=["efficient", "cudnn", "math", "flash"],
                   help="engine: force this SDPA backend for the one-token decode attention")
    p.add_argument("--profile-host-sampling", action="store_true",
                   help="profile also with sampling on the host (the old path)")
    p.add_argument("--attention-launch", default=None, metavar="JSON",
                   help='engine: the decode attention\'s default launch, e.g. {"block_n": 64, "num_warps": 4, '
                        '"num_stages": 3, "programs": 132} (decode_attention.LAUNCH)')
    p.add_argument("--sampler-launch", default=None, metavar="JSON",
                   help='engine: the sampler\'s launch, e.g. {"programs": 1056, "num_warps": 4} '
                        '(decoder_kernels.SAMPLE_LAUNCH)')
    p.add_argument("--no-pdl", action="store_true",
                   help="engine: launch the Triton kernels plainly (decoder_kernels.PDL off)")
    p.add_argument("--trace-dir", default=None, help="write the scheduler's per-step trace of each timed run here")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "engine_gpu_bench.json"))
    args = p.parse_args(argv)
    args.dtype = args.dtype or ("bfloat16" if args.device == "cuda" else "float32")
    args.max_prefill_tokens = args.max_prefill_tokens or (65536 if args.device == "cuda" else 8192)
    args.hf_shapes = args.hf_shapes or args.shapes
    args.profiles = []
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    if args.attention_launch:
        from agentrl.engine import decode_attention

        decode_attention.LAUNCH.update(json.loads(args.attention_launch))
    if args.no_pdl or args.sampler_launch:
        from agentrl.engine import decoder_kernels

        decoder_kernels.PDL = not args.no_pdl
        decoder_kernels.SAMPLE_LAUNCH.update(json.loads(args.sampler_launch or "{}"))
    if args.decode_sdpa:
        from torch.nn.attention import SDPBackend

        from agentrl.engine import attention

        attention.DECODE_BACKENDS = [{"efficient": SDPBackend.EFFICIENT_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION,
                                      "math": SDPBackend.MATH, "flash": SDPBackend.FLASH_ATTENTION}[args.decode_sdpa]]
    if args.device == "cuda" and not torch.cuda.is_available():
        print("engine_gpu_bench: --device cuda but CUDA is not available", file=sys.stderr)
        return 2
    rows = []
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        for shape in args.shapes:
            rows.extend(bench_shape(args, shape, Path(tmp)))
            out.write_text(json.dumps({"partial": True, "rows": rows}, indent=2))  # survives a later timeout
    anchor = {(r["shape"], r["concurrency"]): r for r in rows if r["runner"] == "hf_generate_static"}
    print(f"\n{args.device}, {args.dtype}, prompt {args.prompt_len}, output {args.new_tokens} tokens, T=1")
    print(f"{'shape':<11} {'runner':<19} {'conc':>5} {'out tok/s':>10} {'vs HF':>6} {'TTFT p50 ms':>11} "
          f"{'TTFT max ms':>11} {'ms/token':>9}  (vs HF: against hf_generate_static, warm)")
    for r in rows:
        a = anchor.get((r["shape"], r["concurrency"]))
        ratio = f"{r['output_tokens_per_s'] / a['output_tokens_per_s']:.2f}x" if a else "n/a"
        print(f"{r['shape']:<11} {r['runner']:<19} {r['concurrency']:>5} {r['output_tokens_per_s']:>10.0f} {ratio:>6} "
              f"{1e3 * r['ttft_p50_s']:>11.1f} {1e3 * r['ttft_max_s']:>11.1f} {1e3 * r['per_token_p50_s']:>9.2f}")
    result = {"device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu", "dtype": args.dtype,
              "prompt_len": args.prompt_len, "new_tokens": args.new_tokens,
              "max_prefill_tokens": args.max_prefill_tokens, "torch": torch.__version__, "rows": rows,
              "profiles": args.profiles}
    import transformers

    result["transformers"] = transformers.__version__
    out.write_text(json.dumps(result, indent=2))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
