"""GPU weight-sync check: trainer-side tensors on one GPU, an embedded engine on the same or another GPU.

Modes: ``ipc`` (``TensorSync`` over CUDA IPC; engine on the trainer's GPU), ``broadcast`` (NCCL group,
``/init_weights_update_group`` + ``/update_weights_from_distributed``), ``delta-broadcast`` (byte-wise
delta payloads over that NCCL group). Each round perturbs ``--changed`` of the elements (standing in for
an optimizer step), syncs, and compares the engine's ``/weights_checksum`` with the local one bitwise.
Prints one JSON line per round (seconds, GB/s of full-model bytes, and ``timings``: for ``ipc`` the split
into staging copy, handle export, request, the engine's IPC open / check / wait / copy / version bump,
and the version check) and the result, which it writes to ``--out``; then a table of the split. A hang
dumps every thread's stack after ``--hang-seconds`` and exits, so a stuck collective shows where it is::

    python3 benchmarks/gpu_sync_check.py --mode broadcast --shape qwen2-0.5b --trainer-gpu 0 --engine-gpu 1
"""

from __future__ import annotations

import argparse
import faulthandler
import json
import os
import sys
import tempfile
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from trainer_bench import SHAPES  # noqa: E402


def build_model(shape: str, dtype, device: str, seed: int = 0):
    import torch
    from transformers import AutoModelForCausalLM, Qwen2Config

    from agentrl.models.tiny import copy_tokenizer

    torch.manual_seed(seed)
    config = Qwen2Config(max_position_embeddings=1024, rope_theta=1e6, **SHAPES[shape])
    model = AutoModelForCausalLM.from_config(config, dtype=dtype).to(device)
    out = copy_tokenizer(Path(tempfile.mkdtemp()) / shape)
    model.save_pretrained(out, safe_serialization=True)
    return model, out


def make_sender(mode: str, url: str):
    from agentrl.weights.delta_sync import DeltaSync
    from agentrl.weights.sync import BroadcastSync
    from agentrl.weights.transports.tensor import TensorSync

    if mode == "ipc":
        return TensorSync([url], transport="cuda_ipc")
    if mode == "broadcast":
        return BroadcastSync([url], backend="nccl", group_timeout_s=120)
    return DeltaSync([url], transport="broadcast", backend="nccl", group_timeout_s=120, snapshot_device=None)


def post(url: str, body: dict, secret: str | None = None) -> dict:
    from agentrl.engine.auth import auth_headers

    request = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST",
                                     headers={"Content-Type": "application/json", **auth_headers(secret)})
    with urllib.request.urlopen(request, timeout=600) as r:
        return json.loads(r.read() or b"{}")


def release_check(url: str, named: list, engine_gpu: int, secret: str | None = None) -> dict:
    """Colocate round trip: free GPU bytes before/after ``/release_memory_occupation`` and after resume, plus
    the weights' bits after resume."""
    import torch

    from agentrl.engine.weight_loading import weights_checksum

    def free() -> int:
        torch.cuda.synchronize()
        return torch.cuda.mem_get_info(engine_gpu)[0]

    before = free()
    post(url + "/release_memory_occupation", {}, secret)
    released = free()
    post(url + "/resume_memory_occupation", {}, secret)
    resumed = free()
    with urllib.request.urlopen(url + "/weights_checksum", timeout=600) as r:
        remote = json.loads(r.read())
    local = weights_checksum((n, t.cpu()) for n, t in named)
    same = all(local["parameters"].get(n) == d for n, d in remote["parameters"].items())
    result = {"freed_GiB": round((released - before) / 2**30, 2), "retaken_GiB": round((released - resumed) / 2**30, 2),
              "bitwise_equal_after_resume": same}
    print(json.dumps(result), flush=True)
    return result


def print_split(rounds: list[dict]) -> None:
    """One row per round: GB/s and milliseconds per part of the hand-off."""
    keys = sorted({k for r in rounds for k, v in (r.get("timings") or {}).items() if v is not None})
    if not keys:
        return
    print("round  GB/s  total_ms  " + "  ".join(k.removesuffix("_s") + "_ms" for k in keys))
    for r in rounds:
        t = r.get("timings") or {}
        cells = [f"{1e3 * t[k]:.2f}" if t.get(k) is not None else "-" for k in keys]
        print(f"{r['round']:>5}  {r['full_GB_per_s']:>5}  {1e3 * r['seconds']:>8.2f}  " + "  ".join(cells))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mode", choices=["ipc", "broadcast", "delta-broadcast"], required=True)
    p.add_argument("--shape", choices=sorted(SHAPES), default="tiny")
    p.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    p.add_argument("--trainer-gpu", type=int, default=0)
    p.add_argument("--engine-gpu", type=int, default=None, help="default: the trainer's GPU")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--changed", type=float, default=0.02, help="fraction of elements changed per round")
    p.add_argument("--hang-seconds", type=float, default=240)
    p.add_argument("--log-dir", default=None, help="where the engine log goes (default: a temp dir)")
    p.add_argument("--release-check", action="store_true",
                   help="then release the engine's memory (colocate), measure the GPU memory freed, resume, "
                        "re-check bits, and sync once more")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    faulthandler.dump_traceback_later(args.hang_seconds, exit=True)

    import torch

    from agentrl.engine.launch import EngineProcess
    from agentrl.engine.weight_loading import weights_checksum

    engine_gpu = args.trainer_gpu if args.engine_gpu is None else args.engine_gpu
    if args.mode == "ipc" and engine_gpu != args.trainer_gpu:
        p.error("ipc needs the engine on the trainer's GPU")
    torch.cuda.set_device(args.trainer_gpu)
    device = f"cuda:{args.trainer_gpu}"
    model, model_dir = build_model(args.shape, getattr(torch, args.dtype), device)
    log_dir = Path(args.log_dir or tempfile.mkdtemp())
    log_dir.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": str(engine_gpu)}
    rounds = []
    with EngineProcess(model_dir, dtype=args.dtype, extra_args=["--device", "cuda"], env=env,
                       log_path=log_dir / f"engine-{args.mode}-gpu{engine_gpu}.log") as engine:
        engine.wait_healthy(600)
        with make_sender(args.mode, engine.url) as sender:
            generator = torch.Generator(device=device).manual_seed(1)

            def one_round(k: int, label: str | None = None) -> list:
                with torch.no_grad():
                    for param in model.parameters():
                        mask = torch.rand(param.shape, device=device, generator=generator) < args.changed
                        param.add_(mask * torch.randn(param.shape, device=device, generator=generator,
                                                      dtype=param.dtype) * 1e-2)
                named = list(model.state_dict().items())
                torch.cuda.synchronize()
                report = sender.sync(named, f"gpu-{k}")
                with urllib.request.urlopen(engine.url + "/weights_checksum", timeout=600) as r:
                    remote = json.loads(r.read())
                local = weights_checksum((n, t.cpu()) for n, t in named)
                same = all(local["parameters"].get(n) == d for n, d in remote["parameters"].items())
                rounds.append({"round": k, "bitwise_equal": same and remote["weight_version"] == f"gpu-{k}",
                               "seconds": round(report.seconds, 4), "bytes_sent": report.bytes_sent,
                               "full_bytes": report.full_bytes,
                               "full_GB_per_s": round(report.full_bytes / report.seconds / 1e9, 2),
                               "fallback": report.fallback, "label": label,
                               # where the seconds went (tensor transport: stage/export/request and the
                               # engine's ipc_open/check/wait/copy/version; every mode: the version check)
                               "timings": {**report.details.get("timings", {}),
                                           "check_versions_s": report.details.get("check_versions_s")},
                               "layout": report.details.get("layout"), "requests": report.details.get("requests")})
                print(json.dumps(rounds[-1]), flush=True)
                return named

            for k in range(1, args.rounds + 1):
                named = one_round(k)
            release = None
            if args.release_check:
                # release and resume with the sender still open (its buffers stay mapped), then sync again:
                # the engine's kept copy plan must write the resumed parameters
                release = release_check(engine.url, named, engine_gpu, engine.secret)
                one_round(args.rounds + 1, "after release + resume")
    result = {"release": release, "mode": args.mode, "shape": args.shape, "dtype": args.dtype, "trainer_gpu": args.trainer_gpu,
              "engine_gpu": engine_gpu, "device": torch.cuda.get_device_name(), "rounds": rounds,
              "all_bitwise_equal": all(r["bitwise_equal"] for r in rounds)
              and (release is None or release["bitwise_equal_after_resume"])}
    print(json.dumps(result))
    print_split(rounds)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=2))
    faulthandler.cancel_dump_traceback_later()
    return 0 if result["all_bitwise_equal"] else 1


if __name__ == "__main__":
    sys.exit(main())
