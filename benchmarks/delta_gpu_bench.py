"""Delta weight sync at a given changed fraction on a whole bf16 model: diff GB/s, payload size, bitwise apply.

The model is a random-init Qwen2 shape in bf16 on ``--device``. ``--changed`` of the elements change, in
one of two patterns: ``ulp`` (each changed element moves one bf16 ulp up or down: what a small optimizer
step does to bf16 weights, whose fp32 master moved across a rounding boundary) or ``random`` (the changed
elements get unrelated values: the worst case for compression). Reported per pattern: the diff
(``changed_indices`` over every tensor, GB of weights compared per second, median of ``--repeats``;
``changed_indices_many``, the same positions with two syncs per group instead of one per tensor;
``diff_many``, a changed mask and count per tensor with one sync per group; ``staged``, a snapshot
inside its budget with the new bits staged into its flat layout by one fused copy, then one comparison
per buffer, timed together; and ``fused``, what ``DeltaSync`` does with such a snapshot: on CUDA one
Triton launch per buffer that reads the new tensors in place, no staging copy), the
``auto`` payload (``encode_delta``) as a fraction of the full bf16 bytes and its encode seconds, and the
engine-side ``apply_delta`` onto a copy of the old weights, checked bitwise against the new ones::

    python3 benchmarks/delta_gpu_bench.py --device cuda --shape qwen2-1.5b --changed 0.03
    python3 benchmarks/delta_gpu_bench.py --device cpu --shape tiny --changed 0.03   # smoke run

Prints a table and writes JSON (``--out``).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).parent))
from trainer_bench import SHAPES  # noqa: E402


def bf16_state(shape: str, device: str, seed: int = 0) -> dict:
    import torch
    from transformers import AutoModelForCausalLM, Qwen2Config

    torch.manual_seed(seed)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(Qwen2Config(**SHAPES[shape]), dtype=torch.bfloat16)
    # named_parameters: tied weights once (the engine writes a shared storage once)
    return {n: p.detach() for n, p in model.named_parameters()}


def perturb(state: dict, fraction: float, pattern: str, seed: int = 1) -> dict:
    import torch

    out = {}
    for i, (name, t) in enumerate(state.items()):
        g = torch.Generator(device=t.device).manual_seed(seed + i)
        mask = torch.rand(t.shape, device=t.device, generator=g) < fraction
        if pattern == "ulp":
            bits = t.view(torch.int16)
            step = torch.where(torch.rand(t.shape, device=t.device, generator=g) < 0.5, 1, -1).to(torch.int16)
            new = torch.where(mask, bits + step, bits).view(torch.bfloat16)
        else:
            noise = torch.randn(t.shape, device=t.device, generator=g, dtype=torch.float32).to(torch.bfloat16)
            new = torch.where(mask, noise, t)
        out[name] = new.clone()
    return out


def run_pattern(args, old: dict, pattern: str) -> dict:
    import torch

    from agentrl.engine.delta import apply_delta
    from agentrl.weights.delta import Snapshot, changed_indices, changed_indices_many, diff_many, encode_delta

    sync = torch.cuda.synchronize if args.device == "cuda" else (lambda: None)
    new = perturb(old, args.changed, pattern)
    full_bytes = sum(t.numel() * t.element_size() for t in new.values())
    for name in old:  # warm-up
        changed_indices(old[name], new[name])
    times = []
    for _ in range(args.repeats):
        sync()
        t0 = time.perf_counter()
        changed = sum(int(changed_indices(old[n], new[n]).numel()) for n in old)  # .numel() forces the result
        sync()
        times.append(time.perf_counter() - t0)
    diff_s = sorted(times)[len(times) // 2]
    pairs = [(old[n], new[n]) for n in old]
    changed_indices_many(pairs)  # warm-up
    batched = []
    for _ in range(args.repeats):
        sync()
        t0 = time.perf_counter()
        batched_changed = sum(int(i.numel()) for i in changed_indices_many(pairs))
        sync()
        batched.append(time.perf_counter() - t0)
    batched_s = sorted(batched)[len(batched) // 2]
    if batched_changed != changed:
        raise RuntimeError(f"batched diff found {batched_changed} changes, the per-tensor diff {changed}")
    def timed(fn) -> tuple[float, int]:
        fn()  # warm-up (allocations)
        times, counted = [], 0
        for _ in range(args.repeats):
            sync()
            t0 = time.perf_counter()
            counted = fn()  # the counts are on the host: synced
            sync()
            times.append(time.perf_counter() - t0)
        if counted != changed:
            raise RuntimeError(f"{fn.__name__} counted {counted} changes, the per-tensor diff {changed}")
        return sorted(times)[len(times) // 2], counted

    def many() -> int:
        return sum(d.count for d in diff_many(pairs))

    # what DeltaSync does when the snapshot fits its budget: the snapshot is one flat layout, the new
    # bits are staged into a second one (one fused copy), one comparison per buffer
    snapshot = Snapshot(budget_bytes=1 << 62, device=None)
    snapshot.record(list(old.items()), "v0")
    new_items = list(new.items())

    def fused() -> int:
        return sum(d.count for d in snapshot.diffs(new_items).values())

    def staged() -> int:
        return sum(d.count for d in snapshot.diffs(new_items, in_place=False).values())

    many_s, _ = timed(many)
    staged_s, _ = timed(staged)
    fused_s, _ = timed(fused)
    fused_path = snapshot.last_diff
    numel = sum(t.numel() for t in new.values())
    t0 = time.perf_counter()
    payload, stats = encode_delta(snapshot.triples(new_items), base_version="v0", new_version="v1",
                                  diffs=snapshot.diffs(new_items))
    encode_s = time.perf_counter() - t0
    target = {n: t.clone() for n, t in old.items()}
    sync()
    t0 = time.perf_counter()
    header = apply_delta(target, payload, base_version="v0")
    sync()
    apply_s = time.perf_counter() - t0
    bitwise = all(torch.equal(target[n].view(torch.int16), new[n].view(torch.int16)) for n in new)
    return {"pattern": pattern, "changed_fraction": changed / numel, "full_bytes": full_bytes,
            "diff_s": diff_s, "diff_GBps": full_bytes / diff_s / 1e9,
            "diff_batched_s": batched_s, "diff_batched_GBps": full_bytes / batched_s / 1e9,
            "diff_many_s": many_s, "diff_many_GBps": full_bytes / many_s / 1e9,
            "diff_staged_s": staged_s, "diff_staged_GBps": full_bytes / staged_s / 1e9,
            "diff_fused_s": fused_s, "diff_fused_GBps": full_bytes / fused_s / 1e9, "fused_path": fused_path,
            "payload_bytes": len(payload),
            "payload_fraction": len(payload) / full_bytes, "encodings": stats.encodings, "encode_s": encode_s,
            "apply_s": apply_s, "new_version": header.new_version, "bitwise_equal": bitwise}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--shape", choices=sorted(SHAPES), default="tiny")
    p.add_argument("--changed", type=float, default=0.03)
    p.add_argument("--patterns", nargs="+", default=["ulp", "random"], choices=["ulp", "random"])
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "delta_gpu_bench.json"))
    args = p.parse_args(argv)
    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        print("delta_gpu_bench: --device cuda but CUDA is not available", file=sys.stderr)
        return 2
    old = bf16_state(args.shape, args.device)
    rows = [run_pattern(args, old, pattern) for pattern in args.patterns]
    print(f"\ndelta sync, {args.shape} bf16 on {args.device}, {args.changed:.1%} of elements changed")
    print(f"{'pattern':<7} {'changed':>8} {'GB':>6} {'diff GB/s':>10} {'batched':>8} {'many':>6} {'staged':>7} "
          f"{'fused':>7} {'payload':>8} {'encode s':>9} {'apply s':>8} bitwise   (GB/s of weights compared; diff: "
          "changed_indices per tensor; batched: changed_indices_many; many: diff_many, masks + counts; staged: a flat "
          "snapshot's diffs with the staging copy; fused: what DeltaSync uses, a flat snapshot's diffs, in place "
          f"on CUDA: {rows[0]['fused_path'] if rows else '-'})")
    for r in rows:
        print(f"{r['pattern']:<7} {r['changed_fraction']:>8.4f} {r['full_bytes'] / 1e9:>6.2f} {r['diff_GBps']:>10.0f} "
              f"{r['diff_batched_GBps']:>8.0f} {r['diff_many_GBps']:>6.0f} {r['diff_staged_GBps']:>7.0f} "
              f"{r['diff_fused_GBps']:>7.0f} "
              f"{r['payload_fraction']:>8.2%} {r['encode_s']:>9.2f} {r['apply_s']:>8.2f} {r['bitwise_equal']}")
    result = {"device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu", "shape": args.shape,
              "changed": args.changed, "rows": rows}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    print(f"wrote {out}")
    return 0 if all(r["bitwise_equal"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
