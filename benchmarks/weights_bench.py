"""Weight-sync benchmark: bytes on the wire and seconds per mode, delta compression per encoding.

CPU (default): a random-init Qwen2 of Qwen2.5-0.5B's shape (``--shape 0.5b``; ``--shape small`` for a CI
smoke run) trained in fp32 by one real AdamW step (a forward/backward on random tokens) at each learning
rate in ``--lrs`` (default 1e-6 and 1e-5). Reported per LR: the fraction of elements whose bits changed,
in fp32 master weights and in the bf16 weights an engine serves, and the payload size and encode time of
the ``auto`` delta encoding -- of every encoding at the last LR (compression ratio = full bytes /
payload bytes). Then one embedded engine
(``--sync-dtype``, default bfloat16) is synced in every mode -- disk, tensor (shm), broadcast (gloo),
delta -- first with the initial weights, then with the weights after the step at the last LR; the
second sync is what the table shows. Bitwise equality with the engine is checked after each.

GPU (``--device cuda``; one GPU): delta diff throughput (``changed_indices`` on bf16 tensors, GB of
weights compared per second) and a colocated hand-off of ``--ipc-gb`` GB of bf16 buckets into a second
process, naive (a fresh 512 MiB CUDA IPC tensor per bucket through a queue, opened on every sync) and
persistent (staging buffers whose IPC handles are opened once; each sync is a device copy into staging
and a device copy out of it). ``--device cpu --suite transfer`` runs the same over shared memory.

Usage: python3 benchmarks/weights_bench.py [--shape small]              # CPU: modes + encodings
       python3 benchmarks/weights_bench.py --device cuda                # GPU: diff GB/s + IPC hand-off
Writes (merges its section into) benchmarks/results/weights_bench.json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

RESULTS = ROOT / "benchmarks" / "results" / "weights_bench.json"
SHAPES = {
    # Qwen2.5-0.5B
    "0.5b": dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                 num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True),
    "small": dict(hidden_size=256, intermediate_size=1024, num_hidden_layers=4, num_attention_heads=4,
                  num_key_value_heads=2, vocab_size=8192, tie_word_embeddings=True),
}
ENCODINGS = ["gap16", "gap32", "int32", "xor", "raw", "auto"]
GB = 1e9


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


# ---------------------------------------------------------------- CPU: model, step, encodings, modes


def build_model(shape: str, seed: int):
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    config = Qwen2Config(max_position_embeddings=1024, **SHAPES[shape])
    return Qwen2ForCausalLM(config).to(torch.float32)


def adamw_step(model, lr: float, seed: int, tokens: int) -> float:
    """One real optimizer step (forward/backward on random tokens); frees grads and optimizer state."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, model.config.vocab_size, (1, tokens), generator=gen)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    start = time.perf_counter()
    model(input_ids=ids, labels=ids).loss.backward()
    optimizer.step()
    seconds = time.perf_counter() - start
    optimizer.zero_grad(set_to_none=True)
    del optimizer
    return seconds


def named(model, dtype) -> list:
    return [(n, p.detach().to(dtype).contiguous()) for n, p in model.named_parameters()]


def changed_fraction(old: list, new: list) -> float:
    from agentrl.weights.delta import changed_indices

    changed = sum(int(changed_indices(o, n).numel()) for (_, o), (_, n) in zip(old, new, strict=True))
    return changed / sum(t.numel() for _, t in new)


def encoding_table(old: list, new: list, version: str, encodings: list[str]) -> list[dict]:
    from agentrl.weights.delta import encode_delta

    rows = []
    for enc in encodings:
        start = time.perf_counter()
        payload, stats = encode_delta(
            ((n, o, t) for (n, o), (_, t) in zip(old, new, strict=True)),
            base_version="0", new_version=version, encoding=enc,
        )
        seconds = time.perf_counter() - start
        rows.append({
            "encoding": enc,
            "payload_bytes": len(payload),
            "encoded_bytes": stats.raw_bytes,
            "full_bytes": stats.full_bytes,
            "ratio": stats.full_bytes / len(payload),
            "encode_s": seconds,
            "tensors_by_encoding": stats.encodings,
        })
        log(f"  {enc:6s} {len(payload) / 1e6:10.1f} MB  ratio {rows[-1]['ratio']:7.2f}  {seconds:6.2f} s")
    return rows


def engine_bits_equal(url: str, tensors: list) -> bool:
    import httpx

    from agentrl.engine.weight_loading import weights_checksum

    remote = httpx.get(url + "/weights_checksum", timeout=600).json()
    local = dict(tensors)
    # The engine lists named_parameters (tied weights once); compare those names.
    ours = weights_checksum((n, local[n]) for n in remote["parameters"])
    return ours["total"] == remote["total"]


def run_modes(model_dir: Path, initial: list, stepped: list, sync_dtype: str, lr_tag: str) -> list[dict]:
    from agentrl.engine.launch import EngineProcess
    from agentrl.weights.sync import make_sync

    rows = []
    engine = EngineProcess(model_dir, dtype=sync_dtype).start()
    try:
        engine.wait_healthy(timeout=900)
        for mode, options in [("disk", {}), ("tensor", {}), ("broadcast", {}), ("delta", {})]:
            with make_sync(mode, [engine.url], **options) as sync:
                first = sync.sync(initial, f"{mode}-0")
                second = sync.sync(stepped, f"{mode}-1")
                equal = engine_bits_equal(engine.url, stepped)
            rows.append({
                "mode": mode,
                "lr": lr_tag,
                "bytes_sent": second.bytes_sent,
                "full_bytes": second.full_bytes,
                "seconds": second.seconds,
                "first_sync_seconds": first.seconds,
                "bitwise_equal": equal,
                "details": second.details,
            })
            log(f"  {mode:9s} {second.bytes_sent / 1e6:10.1f} MB  {second.seconds:6.2f} s  equal={equal}")
    finally:
        engine.stop()
    return rows


def cpu_bench(args) -> dict:
    import torch

    from agentrl.models.tiny import copy_tokenizer

    sync_dtype = {"bfloat16": torch.bfloat16, "float32": torch.float32, "float16": torch.float16}[args.sync_dtype]
    work = Path(tempfile.mkdtemp(prefix="weights-bench-"))
    try:
        log(f"building {args.shape} model")
        model = build_model(args.shape, args.seed)
        n_params = sum(p.numel() for p in model.parameters())
        model_dir = work / "model"
        model.to(sync_dtype).save_pretrained(model_dir, safe_serialization=True)  # what the engine serves
        model.to(torch.float32)
        copy_tokenizer(model_dir)
        # The fp32 start point goes to disk, not RAM: the step itself needs grads and Adam state.
        from safetensors.torch import load_file, save_file

        save_file({n: p.detach().contiguous() for n, p in model.named_parameters()}, str(work / "initial.safetensors"))
        initial = named(model, sync_dtype)

        per_lr, stepped = [], None
        for lr in args.lrs:
            initial_fp32 = load_file(str(work / "initial.safetensors"))
            with torch.no_grad():
                for n, p in model.named_parameters():
                    p.copy_(initial_fp32[n])
            del initial_fp32
            step_s = adamw_step(model, lr, args.seed, args.tokens)
            fp32_now = [(n, p.detach()) for n, p in model.named_parameters()]
            stepped = named(model, sync_dtype)
            initial_fp32 = load_file(str(work / "initial.safetensors"))
            fp32_frac = changed_fraction([(n, initial_fp32[n]) for n, _ in fp32_now], fp32_now)
            del initial_fp32
            served_frac = changed_fraction(initial, stepped)
            log(f"lr {lr:g}: step {step_s:.1f} s, changed fp32 {fp32_frac:.4f}, {args.sync_dtype} {served_frac:.4f}")
            per_lr.append({
                "lr": lr,
                "step_seconds": step_s,
                "changed_fraction_fp32": fp32_frac,
                f"changed_fraction_{args.sync_dtype}": served_frac,
                "encodings": encoding_table(initial, stepped, f"lr{lr:g}", args.encodings if lr == args.lrs[-1] else ["auto"]),
            })
        log(f"modes (sync of {args.sync_dtype} weights after the step at lr {args.lrs[-1]:g})")
        modes = run_modes(model_dir, initial, stepped, args.sync_dtype, f"{args.lrs[-1]:g}")
        return {
            "shape": args.shape,
            "params": n_params,
            "sync_dtype": args.sync_dtype,
            "tokens_per_step": args.tokens,
            "per_lr": per_lr,
            "modes": modes,
        }
    finally:
        shutil.rmtree(work, ignore_errors=True)


# ---------------------------------------------------------------- GPU (or CPU shm): diff and hand-off


def diff_bench(device: str, gb: float, fraction: float, repeats: int) -> dict:
    import torch

    from agentrl.weights.delta import changed_indices

    numel = int(gb * GB / 2)
    old = torch.randn(numel, device=device).to(torch.bfloat16)
    new = old.clone()
    step = max(1, int(1 / fraction))
    new[::step] = new[::step] + 1.0
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
    changed_indices(old, new)  # warm-up
    sync()
    start = time.perf_counter()
    for _ in range(repeats):
        idx = changed_indices(old, new)
    sync()
    seconds = (time.perf_counter() - start) / repeats
    count_start = time.perf_counter()
    for _ in range(repeats):
        int((old.view(torch.int16) != new.view(torch.int16)).sum())
    sync()
    count_seconds = (time.perf_counter() - count_start) / repeats
    result = {
        "bytes": numel * 2,
        "changed": int(idx.numel()),
        "diff_s": seconds,
        "diff_GBps": numel * 2 / GB / seconds,
        "count_only_GBps": numel * 2 / GB / count_seconds,
    }
    log(f"diff {numel * 2 / GB:.1f} GB bf16 on {device}: {result['diff_GBps']:.0f} GB/s (count only {result['count_only_GBps']:.0f})")
    return result


def _receiver(conn, device: str) -> None:
    """Second process: receives buckets (naive: a fresh IPC tensor per bucket; persistent: handles once)."""
    import torch

    params: list = conn.recv()  # sizes of its own parameter buckets
    own = [torch.empty(n, dtype=torch.bfloat16, device=device) for n in params]
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
    staging = None
    while True:
        msg = conn.recv()
        if msg[0] == "stop":
            break
        if msg[0] == "staging":  # persistent buffers: handles opened once, here
            staging = msg[1]
            conn.send("ok")
        elif msg[0] == "bucket":  # naive: each bucket arrives as its own IPC tensor
            own[msg[1]].copy_(msg[2])
            sync()
            conn.send("ok")
        elif msg[0] == "go":  # persistent: staging already filled by the sender
            for dst, src in zip(own, staging, strict=True):
                dst.copy_(src, non_blocking=True)
            sync()
            conn.send("ok")


def handoff_bench(device: str, gb: float, bucket_mb: int, repeats: int) -> dict:
    import torch
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    if device == "cpu":
        mp.set_sharing_strategy("file_system")
    bucket = bucket_mb << 20
    n_buckets = max(1, int(gb * GB) // bucket)
    sizes = [bucket // 2] * n_buckets
    total = sum(sizes) * 2
    source = [torch.randn(n, device=device).to(torch.bfloat16) for n in sizes]  # the trainer's weights
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_receiver, args=(child, device), daemon=True)
    proc.start()
    try:
        parent.send(sizes)
        # naive: a fresh tensor per bucket, shared anew (and opened anew) every sync
        naive_times = []
        for _ in range(repeats):
            start = time.perf_counter()
            for i, src in enumerate(source):
                fresh = src.clone()
                if device == "cpu":
                    fresh.share_memory_()
                sync()
                parent.send(("bucket", i, fresh))
                parent.recv()
                del fresh
            naive_times.append(time.perf_counter() - start)
        # persistent: staging buffers shared once; per sync copy in, signal, receiver copies out
        staging = [torch.empty_like(s) for s in source]
        if device == "cpu":
            for s in staging:
                s.share_memory_()
        open_start = time.perf_counter()
        parent.send(("staging", staging))
        parent.recv()
        open_s = time.perf_counter() - open_start
        persistent_times = []
        for _ in range(repeats):
            start = time.perf_counter()
            for dst, src in zip(staging, source, strict=True):
                dst.copy_(src, non_blocking=True)
            sync()
            parent.send(("go",))
            parent.recv()
            persistent_times.append(time.perf_counter() - start)
        parent.send(("stop",))
        proc.join(timeout=60)
    finally:
        if proc.is_alive():
            proc.kill()
    naive, persistent = min(naive_times), min(persistent_times)
    result = {
        "device": device,
        "bytes": total,
        "bucket_bytes": bucket,
        "buckets": n_buckets,
        "naive_s": naive,
        "naive_GBps": total / GB / naive,
        "persistent_s": persistent,
        "persistent_GBps": total / GB / persistent,
        "persistent_open_s": open_s,
    }
    log(f"hand-off {total / GB:.1f} GB on {device}: naive {result['naive_GBps']:.1f} GB/s, "
        f"persistent {result['persistent_GBps']:.1f} GB/s (handles opened once in {open_s:.2f} s)")
    return result


# ---------------------------------------------------------------- report


def print_cpu_table(r: dict) -> None:
    print(f"\n{r['shape']} Qwen2 ({r['params'] / 1e6:.0f}M params), engine weights in {r['sync_dtype']}")
    print("\nchanged fraction after one AdamW step")
    print(f"{'lr':>8} {'fp32':>8} {r['sync_dtype']:>9}")
    served_key = f"changed_fraction_{r['sync_dtype']}"
    for p in r["per_lr"]:
        print(f"{p['lr']:>8g} {p['changed_fraction_fp32']:>8.4f} {p[served_key]:>9.4f}")
    print("\ndelta payload per encoding (ratio = full / payload)")
    print(f"{'lr':>8} {'encoding':>8} {'payload MB':>11} {'ratio':>7} {'encode s':>9}")
    for p in r["per_lr"]:
        for e in p["encodings"]:
            print(f"{p['lr']:>8g} {e['encoding']:>8} {e['payload_bytes'] / 1e6:>11.2f} {e['ratio']:>7.2f} {e['encode_s']:>9.2f}")
    print(f"\nsync after one step at lr {r['modes'][0]['lr']} (second sync; the first sends initial weights)")
    print(f"{'mode':>10} {'MB sent':>9} {'full MB':>9} {'seconds':>8} {'bitwise':>8}")
    for m in r["modes"]:
        print(f"{m['mode']:>10} {m['bytes_sent'] / 1e6:>9.1f} {m['full_bytes'] / 1e6:>9.1f} {m['seconds']:>8.2f} {m['bitwise_equal']!s:>8}")


def print_transfer_table(r: dict) -> None:
    d, h = r["diff"], r["handoff"]
    print(f"\ndelta diff ({d['bytes'] / GB:.1f} GB bf16, {d['changed']} changed): {d['diff_GBps']:.1f} GB/s "
          f"(count only {d['count_only_GBps']:.1f} GB/s)")
    print(f"hand-off of {h['bytes'] / GB:.1f} GB in {h['buckets']} buckets of {h['bucket_bytes'] >> 20} MiB into a second process")
    print(f"{'variant':>12} {'seconds':>9} {'GB/s':>8}")
    print(f"{'naive':>12} {h['naive_s']:>9.3f} {h['naive_GBps']:>8.1f}")
    print(f"{'persistent':>12} {h['persistent_s']:>9.3f} {h['persistent_GBps']:>8.1f}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cpu", help="cpu: modes + encodings; cuda: diff GB/s + IPC hand-off")
    p.add_argument("--shape", default="0.5b", choices=sorted(SHAPES))
    p.add_argument("--lrs", type=float, nargs="+", default=[1e-6, 1e-5])
    p.add_argument("--tokens", type=int, default=64, help="tokens in the training batch of the step")
    p.add_argument("--sync-dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--encodings", nargs="+", default=ENCODINGS, help="encodings compared at the last LR (others: auto)")
    p.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    p.add_argument("--diff-gb", type=float, default=8.0)
    p.add_argument("--diff-fraction", type=float, default=0.01)
    p.add_argument("--ipc-gb", type=float, default=30.0)
    p.add_argument("--bucket-mb", type=int, default=512)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--suite", choices=["modes", "transfer"], default=None,
                   help="modes: sync modes + encodings (default on cpu); transfer: diff GB/s + hand-off "
                        "(default on cuda; on cpu it runs over shared memory as a smoke test)")
    p.add_argument("--out", type=Path, default=RESULTS)
    args = p.parse_args(argv)

    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    section: dict
    suite = args.suite or ("modes" if args.device == "cpu" else "transfer")
    if suite == "modes":
        section = cpu_bench(args)
        print_cpu_table(section)
        key = "cpu" if args.shape == "0.5b" else f"cpu_{args.shape}"
    else:
        section = {
            "diff": diff_bench(args.device, args.diff_gb, args.diff_fraction, args.repeats),
            "handoff": handoff_bench(args.device, args.ipc_gb, args.bucket_mb, args.repeats),
        }
        print_transfer_table(section)
        key = f"{args.device.split(':')[0]}_transfer"
    section["machine"] = {"platform": platform.platform(), "torch": torch.__version__,
                          "cpus": os.cpu_count(), "loadavg_at_end": os.getloadavg(),
                          "threads": torch.get_num_threads(),
                          "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    results = json.loads(args.out.read_text()) if args.out.exists() else {}
    results[key] = section
    args.out.write_text(json.dumps(results, indent=2) + "\n")
    log(f"wrote {args.out} [{key}]")
    return 0


if __name__ == "__main__":
    sys.exit(main())
