"""LoRA benchmark: memory per component and speed of a LoRA train step, and what one adapter sync costs.

GPU (one 80 GB card; random-init shapes, bf16)::

    python3 benchmarks/lora_bench.py --device cuda --shape qwen2-7b --dtype bfloat16 --rank 16 \\
        --seq-len 8192 --seqs-per-microbatch 1 --steps 3 --out $OUT/lora_train_7b.json
    python3 benchmarks/lora_bench.py --device cuda --shape qwen2-0.5b --dtype bfloat16 --rank 16 \\
        --sync-only --out $OUT/lora_sync_05b.json

CPU smoke (tiny shape)::

    python3 benchmarks/lora_bench.py --shape tiny --rank 8 --seq-len 64 --steps 2

``train``: peak memory after building (frozen base weights and adapters), after the first step (plus the
optimizer's fp32 main copies and Adam moments of the adapters alone), and during a step (the rest:
activations, log-prob chunks, gradients), with step time and tokens/s. ``sync``: the bytes the ``adapter``
payload writes per sync (safetensors, as the disk transport sends them) against the dense model's bytes,
and the engine side's merge (``base + B @ A`` for every adapted weight, :mod:`agentrl.engine.lora`): its
time per sync and the base copy it keeps. Prints a table and writes JSON.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import time
import warnings
from pathlib import Path

SHAPES = {
    "tiny": dict(hidden_size=128, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=1024, tie_word_embeddings=True),
    "qwen2-0.5b": dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                       num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True),
    "qwen2-7b": dict(hidden_size=3584, intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28,
                     num_key_value_heads=4, vocab_size=152064, tie_word_embeddings=False),
}
GIB = 2**30


def hf_config(shape: str, seq_len: int):
    from transformers import Qwen2Config

    return Qwen2Config(max_position_embeddings=max(seq_len, 512), rope_theta=1e6, **SHAPES[shape])


def synthetic_batch(n_seqs: int, seq_len: int, vocab: int, seed: int = 0) -> list[dict]:
    """Full-length sequences, a quarter prompt, rewards alternating 0/1 in groups of 2 (every advantage != 0)."""
    rng = random.Random(seed)
    prompt = seq_len // 4
    return [dict(tokens=[rng.randrange(3, vocab) for _ in range(seq_len)], response_start=prompt,
                 loss_mask=[1] * (seq_len - prompt), rollout_logprobs=[-1.0] * (seq_len - prompt),
                 reward=float(i % 2), group_id=i // 2) for i in range(n_seqs)]


def allocated_gib(device: str) -> float:
    import torch

    return torch.cuda.memory_allocated() / GIB if device == "cuda" else float("nan")


def peak_gib(device: str) -> float:
    import torch

    return torch.cuda.max_memory_allocated() / GIB if device == "cuda" else float("nan")


def build_trainer(args, cfg):
    from agentrl.trainer.actor import MegatronTrainer
    from agentrl.trainer.trainer_config import TrainerConfig

    extra = {"recompute": args.recompute} if args.recompute else {}
    return MegatronTrainer(None, TrainerConfig(
        dtype=args.dtype, attention="sdpa", lr=1e-4, max_tokens_per_microbatch=args.seq_len * args.seqs_per_microbatch,
        lora={"rank": args.rank, "alpha": 2.0 * args.rank}, loss={"kl_coef": 0.0}, **extra,
    ), hf_config=cfg)


def param_gib(trainer, trainable: bool) -> float:
    return sum(p.numel() * p.element_size() for p in trainer.gpt.parameters() if p.requires_grad == trainable) / GIB


def bench_train(args) -> dict:
    import torch

    cfg = hf_config(args.shape, args.seq_len)
    if args.device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    trainer = build_trainer(args, cfg)
    row = {"shape": args.shape, "dtype": args.dtype, "rank": args.rank, "seq_len": args.seq_len,
           "tokens_per_microbatch": args.seq_len * args.seqs_per_microbatch, "recompute": args.recompute or "none",
           "base_weights_gib": param_gib(trainer, False), "adapter_weights_gib": param_gib(trainer, True),
           "allocated_after_build_gib": allocated_gib(args.device)}
    n_seqs = args.seqs_per_microbatch * args.microbatches
    times = []
    for step in range(args.steps):
        batch = synthetic_batch(n_seqs, args.seq_len, cfg.vocab_size, seed=step)
        if args.device == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        metrics = trainer.train_step(batch)
        if args.device == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
        if step == 0:  # the optimizer's state exists from the first step on
            row["allocated_after_step_gib"] = allocated_gib(args.device)
    row["optimizer_state_gib"] = row["allocated_after_step_gib"] - row["allocated_after_build_gib"]
    row["peak_gib"] = peak_gib(args.device)
    row["step_peak_over_steady_gib"] = row["peak_gib"] - row["allocated_after_step_gib"]
    best = min(times[1:] or times)
    row.update(step_s=best, tokens_per_s=n_seqs * args.seq_len / best, loss=metrics.get("loss"),
               fits_80gb=row["peak_gib"] < 80 * 1e9 / GIB if args.device == "cuda" else None)
    return row


def bench_sync(args) -> dict:
    import torch

    from agentrl.engine.lora import AdapterMerger
    from agentrl.trainer.lora import dense_bytes
    from agentrl.weights.adapter_sync import adapter_named_tensors
    from agentrl.weights.transports.disk import save_safetensors

    cfg = hf_config(args.shape, args.seq_len)
    trainer = build_trainer(args, cfg)
    with torch.no_grad():  # nonzero B, as after training (B starts at 0)
        for p in trainer.gpt.parameters():
            if p.requires_grad:
                p.normal_(0, 0.01)
    named = list(adapter_named_tensors(trainer.export_adapter_tensors(), trainer.config.lora.scale))
    with tempfile.TemporaryDirectory() as tmp:
        sent = save_safetensors(named, Path(tmp) / "v1")
    dense = dense_bytes(cfg, trainer.dtype)
    weights = dict(trainer.export_hf_named_tensors())  # the engine's dense weights (HF names)
    merger = AdapterMerger()
    adapters = dict(named)
    times = []
    for _ in range(3):
        if args.device == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        merged = merger.merge(weights, adapters, 0)
        merger.merged_at = 0  # as the engine after its merge landed: the next merge reuses the base copy
        if args.device == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    base_copy = sum(t.numel() * t.element_size() for t in merger.base.values())
    return {"shape": args.shape, "dtype": args.dtype, "rank": args.rank, "bytes_sent": sent, "full_bytes": dense,
            "ratio": sent / dense, "adapter_tensors": len(named), "merged_weights": len(merged),
            "merge_s": min(times[1:]), "first_merge_s": times[0], "engine_base_copy_gib": base_copy / GIB}


class _EngineServer:
    """The embedded engine's app served by uvicorn in a thread of this process (as the tests run it)."""

    def __init__(self, model_dir: Path, **config) -> None:
        import threading

        import uvicorn

        from agentrl.engine.auth import run_secret
        from agentrl.engine.engine import Engine, EngineConfig
        from agentrl.engine.launch import free_port
        from agentrl.engine.server import create_app

        port = free_port()
        self.engine = Engine(EngineConfig(model_path=str(model_dir), port=port, **config))
        self.secret = run_secret()
        self.server = uvicorn.Server(uvicorn.Config(create_app(self.engine, secret=self.secret), host="127.0.0.1",
                                                    port=port, log_level="warning", access_log=False))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.url = f"http://127.0.0.1:{port}"

    def __enter__(self) -> _EngineServer:
        self.thread.start()
        deadline = time.monotonic() + 120
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("engine server did not start")
            time.sleep(0.05)
        return self

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)

    def post(self, path: str, body: dict) -> dict:
        import urllib.request

        from agentrl.engine.auth import auth_headers

        req = urllib.request.Request(self.url + path, data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json", **auth_headers(self.secret)})
        with urllib.request.urlopen(req, timeout=600) as r:
            return json.loads(r.read() or b"{}")

    def merger(self):
        """The app's ``AdapterMerger`` (its weight routes hold it; included routers nest their routes)."""
        from agentrl.engine.weight_routes import WeightRoutes

        routes = list(self.server.config.app.routes)
        while routes:
            r = routes.pop()
            routes += getattr(getattr(r, "original_router", None), "routes", [])
            if isinstance(getattr(getattr(r, "endpoint", None), "__self__", None), WeightRoutes):
                return r.endpoint.__self__.adapters
        raise RuntimeError("no weight routes in the engine app")


def _model_dir(trainer, cfg, root: Path) -> Path:
    """An HF directory of the trainer's dense weights (its frozen base: B = 0) and the tiny tokenizer (the
    engine only decodes ids with it; prompts are ids)."""
    from safetensors.torch import save_file

    from agentrl.models.tiny import copy_tokenizer

    out = root / "engine_model"
    out.mkdir(parents=True, exist_ok=True)
    cfg.architectures = ["Qwen2ForCausalLM"]
    cfg.save_pretrained(out)
    copy_tokenizer(out)
    seen, tensors = set(), {}
    for name, t in trainer.export_hf_named_tensors():
        if name not in seen:
            seen.add(name)
            tensors[name] = t.detach().contiguous().cpu()
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


def dense_bytes_of(trainer) -> int:
    return sum(p.numel() * p.element_size() for p in trainer.gpt.parameters())


def _scratch(nbytes: int) -> str:
    """/dev/shm (host memory: the fastest write and read) when it has room for ``nbytes`` and a margin (a
    container's is often 64 MB), else the temp directory."""
    import shutil

    shm = Path("/dev/shm")
    if shm.is_dir() and shutil.disk_usage(shm).free > 1.2 * nbytes + 2**30:
        return str(shm)
    return tempfile.gettempdir()


class _Memory:
    """Device memory at named points (allocated by both the trainer and the engine of this process)."""

    def __init__(self) -> None:
        self.points: dict[str, dict[str, float]] = {}

    def mark(self, label: str) -> float:
        import torch

        if not torch.cuda.is_available():  # a CPU smoke run: the flow, no memory figures
            self.points[label] = {"allocated_gib": 0.0, "peak_since_last_mark_gib": 0.0, "device_used_gib": 0.0}
            return 0.0
        torch.cuda.synchronize()
        free, total = torch.cuda.mem_get_info()
        self.points[label] = {"allocated_gib": torch.cuda.memory_allocated() / GIB,
                              "peak_since_last_mark_gib": torch.cuda.max_memory_allocated() / GIB,
                              "device_used_gib": (total - free) / GIB}
        torch.cuda.reset_peak_memory_stats()
        point = self.points[label]
        print(f"  memory {label}: allocated {point['allocated_gib']:.2f} GiB, peak since last "
              f"{point['peak_since_last_mark_gib']:.2f}, device used {point['device_used_gib']:.2f}", flush=True)
        return point["allocated_gib"]

    def peak(self, label: str) -> float:
        return self.points[label]["peak_since_last_mark_gib"]


def _generate(server: _EngineServer, n: int, prompt_len: int, new_tokens: int, seed: int) -> dict:
    from concurrent.futures import ThreadPoolExecutor

    rng = random.Random(seed)
    prompts = [[rng.randrange(3, 1000) for _ in range(prompt_len)] for _ in range(n)]
    body = {"sampling_params": {"max_new_tokens": new_tokens, "temperature": 1.0, "ignore_eos": True}}
    start = time.perf_counter()
    with ThreadPoolExecutor(n) as pool:
        outs = list(pool.map(lambda p: server.post("/generate", {**body, "input_ids": p}), prompts))
    seconds = time.perf_counter() - start
    tokens = sum(len(o["output_ids"]) for o in outs)
    return {"seconds": seconds, "tokens": tokens, "tokens_per_s": tokens / seconds,
            "weight_version": outs[0]["meta_info"].get("weight_version")}


def bench_colocate(args, save=lambda row: None) -> dict:
    """A LoRA trainer and an engine on one device, as a colocated run cycles them: the engine (loaded with
    the trainer's base weights) generates, releases its memory (``/release_memory_occupation``) while the
    trainer steps, resumes, receives the adapters (``adapter`` sync: merged from its base copy) and generates
    again. Device memory per component from the deltas at each point, and each phase's peak. ``save(row)``
    after each cycle: what a time limit would otherwise lose."""
    import gc

    import torch

    from agentrl.trainer.lora import dense_bytes
    from agentrl.weights.adapter_sync import adapter_named_tensors
    from agentrl.weights.sync import make_sync

    cfg = hf_config(args.shape, args.seq_len)
    mem = _Memory()
    mem.mark("start")
    trainer = build_trainer(args, cfg)
    row = {"shape": args.shape, "dtype": args.dtype, "rank": args.rank, "seq_len": args.seq_len,
           "tokens_per_microbatch": args.seq_len * args.seqs_per_microbatch, "microbatches": args.microbatches,
           "recompute": args.recompute or "none", "trainer_base_weights_gib": param_gib(trainer, False),
           "trainer_adapter_weights_gib": param_gib(trainer, True)}
    trainer_built = mem.mark("trainer_built")
    timings: dict[str, list[float]] = {}

    def timed(name: str, fn, *a, **kw):
        start = time.perf_counter()
        out = fn(*a, **kw)
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        timings.setdefault(name, []).append(round(time.perf_counter() - start, 3))
        print(f"  [{time.strftime('%H:%M:%S')}] {name.removesuffix('_s')} {timings[name][-1]} s", flush=True)
        return out

    root = Path(_scratch(dense_bytes_of(trainer))) / f"lora_bench_{time.time_ns()}"
    try:
        model_dir = timed("write_model_dir_s", _model_dir, trainer, cfg, root)
        gc.collect()
        server = timed("engine_start_s", lambda: _EngineServer(
            model_dir, dtype=args.dtype, device=args.device, max_batch_size=max(args.gen_requests, 1),
            fused_ops=args.engine_fused_ops).__enter__())
    except BaseException:
        import shutil

        shutil.rmtree(root, ignore_errors=True)
        raise
    import shutil

    shutil.rmtree(root, ignore_errors=True)  # the engine holds its weights now (tmpfs is host memory)
    try:
        row["engine_weights_gib"] = mem.mark("engine_started") - trainer_built
        gens = [timed("generate_s", _generate, server, args.gen_requests, args.prompt_len, args.new_tokens, 0)]
        row["engine_kv_and_graphs_gib"] = mem.mark("generated") - trainer_built - row["engine_weights_gib"]
        row["generate_peak_gib"] = mem.peak("generated")
        dense = dense_bytes(cfg, trainer.dtype)
        with make_sync("adapter", [server.url], dense_bytes=dense) as sync:
            def send(version: str):
                named = list(adapter_named_tensors(trainer.export_adapter_tensors(), trainer.config.lora.scale))
                return sync.sync(named, version)

            report = timed("sync_s", send, "lora-0")
            row["engine_lora_base_copy_gib"] = sum(t.numel() * t.element_size() for t in server.merger().base.values()) / GIB
            row["sync_bytes_sent"], row["sync_full_bytes"] = report.bytes_sent, report.full_bytes
            after_sync = mem.mark("synced")
            row["first_sync_peak_gib"] = mem.peak("synced")
            row["engine_total_before_release_gib"] = after_sync - trainer_built
            for step in range(args.steps):
                timed("release_s", server.post, "/release_memory_occupation", {})
                released = mem.mark(f"released_{step}")
                batch = synthetic_batch(args.seqs_per_microbatch * args.microbatches, args.seq_len, cfg.vocab_size,
                                        seed=step)
                timed("train_step_s", trainer.train_step, batch)
                trained = mem.mark(f"trained_{step}")
                if step == 0:
                    row["engine_left_after_release_gib"] = released - trainer_built
                    row["trainer_optimizer_state_gib"] = trained - released
                row["train_peak_gib"] = mem.peak(f"trained_{step}")  # the device's peak in the step (engine released)
                row["train_peak_over_steady_gib"] = row["train_peak_gib"] - trained
                timed("resume_s", server.post, "/resume_memory_occupation", {})
                mem.mark(f"resumed_{step}")
                report = timed("sync_s", send, f"lora-{step + 1}")
                mem.mark(f"synced_{step}")
                row["sync_peak_gib"] = mem.peak(f"synced_{step}")
                gens.append(timed("generate_s", _generate, server, args.gen_requests, args.prompt_len,
                                  args.new_tokens, step + 1))
                mem.mark(f"generated_{step}")
                row["generate_peak_gib"] = max(row["generate_peak_gib"], mem.peak(f"generated_{step}"))
                save({**row, "timings_s": timings, "partial": f"cycle {step + 1} of {args.steps}"})
    finally:
        server.__exit__(None, None, None)
    row["served_version_after"] = gens[-1]["weight_version"]
    row["generate_tokens_per_s"] = [round(g["tokens_per_s"], 1) for g in gens]
    row["device_peak_gib"] = max(p["peak_since_last_mark_gib"] for p in mem.points.values())
    row["fits_80gb"] = row["device_peak_gib"] < 80 * 1e9 / GIB
    row["timings_s"] = timings
    row["memory_points"] = {k: {m: round(v, 3) for m, v in p.items()} for k, p in mem.points.items()}
    return row


def print_colocate(row: dict) -> None:
    """The colocated run's memory per component and phase, one line each (the JSON has every point)."""
    keys = ["trainer_base_weights_gib", "trainer_adapter_weights_gib", "trainer_optimizer_state_gib",
            "engine_weights_gib", "engine_kv_and_graphs_gib", "engine_lora_base_copy_gib",
            "engine_total_before_release_gib", "engine_left_after_release_gib", "train_peak_gib",
            "train_peak_over_steady_gib", "first_sync_peak_gib", "sync_peak_gib", "generate_peak_gib",
            "device_peak_gib"]
    print(f"colocate {row['shape']} r{row['rank']} {row['tokens_per_microbatch']} tok/ubatch x{row['microbatches']}: "
          f"fits_80gb={row['fits_80gb']} served={row['served_version_after']}")
    for k in keys:
        if k in row:
            print(f"  {k.removesuffix('_gib'):<32} {row[k]:8.2f} GiB")
    print("  seconds: " + "  ".join(f"{k.removesuffix('_s')}={v}" for k, v in row["timings_s"].items()))
    print(f"  sync bytes {row.get('sync_bytes_sent')} of {row.get('sync_full_bytes')}; "
          f"generate tok/s {row['generate_tokens_per_s']}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="tiny")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--seqs-per-microbatch", type=int, default=1)
    parser.add_argument("--microbatches", type=int, default=2, help="micro-batches per step (gradient accumulation)")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--recompute", default=None, help="trainer.recompute (default: the trainer's)")
    parser.add_argument("--sync-only", action="store_true", help="only the sync measurement")
    parser.add_argument("--train-only", action="store_true", help="only the train measurement")
    parser.add_argument("--colocate", action="store_true",
                        help="trainer and an embedded engine on one device, released/resumed around each step "
                             "(cuda: memory per component and phase; cpu: the flow only); instead of train and sync")
    parser.add_argument("--gen-requests", type=int, default=8, help="with --colocate: concurrent /generate calls")
    parser.add_argument("--prompt-len", type=int, default=512, help="with --colocate")
    parser.add_argument("--new-tokens", type=int, default=32, help="with --colocate")
    parser.add_argument("--engine-fused-ops", action="store_true",
                        help="with --colocate: the engine's compiled fused ops and decoder (its CUDA default; off "
                             "here by default: their compile time, not their memory, is what they change)")
    parser.add_argument("--out", default=None, help="JSON path (default: print only)")
    args = parser.parse_args(argv)
    warnings.filterwarnings("ignore")
    if args.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            parser.error("--device cuda: no CUDA device")
    else:
        import os

        os.environ["CUDA_VISIBLE_DEVICES"] = ""
    result: dict = {"argv": sys.argv[1:] if argv is None else argv}
    if args.colocate:
        saved: dict = {}

        def save(row: dict) -> None:
            saved.update(row)
            if args.out:
                Path(args.out).parent.mkdir(parents=True, exist_ok=True)
                Path(args.out).write_text(json.dumps({**result, "colocate": row}, indent=2) + "\n")

        try:
            result["colocate"] = bench_colocate(args, save)
        except Exception as err:  # OOM, a refused request: report it (the rows saved so far stay on disk)
            import traceback

            traceback.print_exc(limit=4)
            result["colocate"] = {**saved, "shape": args.shape, "error": f"{type(err).__name__}: {err}".splitlines()[0][:300],
                                  "peak_gib": peak_gib(args.device)}
            print(f"colocate: ERROR {result['colocate']['error']}")
        else:
            print_colocate(result["colocate"])
        if args.out:
            Path(args.out).parent.mkdir(parents=True, exist_ok=True)
            Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
        return 0 if "error" not in result["colocate"] else 1
    if not args.sync_only:
        try:
            result["train"] = bench_train(args)
        except RuntimeError as err:  # torch.cuda.OutOfMemoryError is one: the answer is then "does not fit"
            result["train"] = {"shape": args.shape, "error": str(err).splitlines()[0][:300],
                               "peak_gib": peak_gib(args.device), "fits_80gb": False}
    if not args.train_only:
        result["sync"] = bench_sync(args)
    for part, row in result.items():
        if isinstance(row, dict):
            print(f"{part:>6}: " + "  ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items()))
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
