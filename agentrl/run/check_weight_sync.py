"""``agentrl check-weight-sync``: take K optimizer steps, sync each into a real engine, compare bits.

Loads ``--model`` into a trainer and into an embedded engine process, then K times: one optimizer step,
one sync in ``--mode`` (a payload, ``full`` or ``delta``, or a preset ``disk``, ``tensor``, ``broadcast``;
``--transport`` picks how the bytes move, e.g. ``--mode delta --transport broadcast``, and the ``tensor``
preset reads it as its handles, e.g. ``--mode tensor --transport cuda_ipc``) as version ``step-k``. Finally
it compares the engine's ``/weights_checksum`` with the same checksum of the trainer's exported HF
tensors and prints one JSON line: ``bitwise_equal``, ``bytes_sent`` / ``full_bytes`` / ``seconds``
(summed over the K syncs), ``weight_version`` (the engine's), plus per-sync details. Exit code 0 only
when the bits and the version match.

Trainers (``--trainer``): ``megatron`` (default) -- :class:`agentrl.trainer.actor.MegatronTrainer`
taking real GRPO steps, its weights exported with ``export_hf_named_tensors()``; ``hf-adamw-standin`` --
NOT the real trainer: the HF model with a plain torch AdamW step on random tokens (no megatron-core
needed; same HF names and dtypes, same sync path).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


class HFAdamWStandIn:
    """NOT the Megatron trainer: the HF model with a torch AdamW step on random tokens (see module doc)."""

    name = "hf-adamw-standin"

    def __init__(self, model_dir: Path, *, lr: float, seed: int = 0) -> None:
        import torch
        from transformers import AutoModelForCausalLM

        torch.manual_seed(seed)
        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=lr)
        self.generator = torch.Generator().manual_seed(seed)

    def step(self) -> None:
        import torch

        vocab = self.model.config.vocab_size
        ids = torch.randint(0, vocab, (2, 32), generator=self.generator)
        self.model(input_ids=ids, labels=ids).loss.backward()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)

    def export_hf_named_tensors(self) -> Iterable[tuple[str, torch.Tensor]]:
        return [(n, p.detach()) for n, p in self.model.named_parameters()]


class MegatronGRPO:
    """The real trainer: :class:`agentrl.trainer.actor.MegatronTrainer` taking GRPO steps on random samples.

    Each step is one ``train_step`` over ``groups`` groups of ``group_size`` random-token samples with
    rewards that differ inside every group (so advantages, and therefore gradients, are non-zero).
    """

    name = "megatron"

    def __init__(self, model_dir: Path, *, lr: float, seed: int = 0, groups: int = 2, group_size: int = 4) -> None:
        import random

        from agentrl.trainer.actor import MegatronTrainer
        from agentrl.trainer.trainer_config import TrainerConfig

        self.trainer = MegatronTrainer(model_dir, TrainerConfig(lr=lr, seed=seed))
        self.vocab = int(self.trainer.hf_config.vocab_size)
        self.rng = random.Random(seed)
        self.groups, self.group_size = groups, group_size

    def step(self) -> None:
        samples = []
        for g in range(self.groups):
            for i in range(self.group_size):
                tokens = [self.rng.randrange(3, self.vocab) for _ in range(24)]
                samples.append({
                    "tokens": tokens, "response_start": 8, "loss_mask": [1] * 16, "rollout_logprobs": [],
                    "reward": float(i % 2), "group_id": g,
                })
        self.trainer.train_step(samples)

    def export_hf_named_tensors(self) -> Iterable[tuple[str, torch.Tensor]]:
        return list(self.trainer.export_hf_named_tensors())


TRAINERS = {"megatron": MegatronGRPO, "hf-adamw-standin": HFAdamWStandIn}


def engine_checksum(url: str) -> dict:
    import httpx

    response = httpx.get(url + "/weights_checksum", timeout=600)
    response.raise_for_status()
    return response.json()


def bits_match(remote: dict, tensors: Iterable[tuple[str, torch.Tensor]]) -> tuple[bool, list[str]]:
    """Compare the engine's checksum with ours over the engine's parameter names (tied weights once)."""
    from agentrl.engine.weight_loading import weights_checksum

    local = dict(tensors)
    missing = [n for n in remote["parameters"] if n not in local]
    if missing:
        return False, missing
    ours = weights_checksum((n, local[n]) for n in remote["parameters"])
    differing = [n for n, d in ours["parameters"].items() if remote["parameters"][n] != d]
    return ours["total"] == remote["total"], differing


def run(args: argparse.Namespace) -> dict:
    from agentrl.engine.launch import EngineProcess
    from agentrl.weights.sync import make_sync

    trainer = TRAINERS[args.trainer](Path(args.model), lr=args.lr, seed=args.seed)
    engine = None
    url = args.engine_url
    if url is None:
        engine = EngineProcess(args.model, dtype="float32").start()
    try:
        if engine is not None:
            engine.wait_healthy(timeout=args.engine_timeout)
            url = engine.url
        reports = []
        options = {"transport": args.transport} if args.transport else {}
        with make_sync(args.mode, [url], **options) as sync:
            for k in range(1, args.steps + 1):
                trainer.step()
                reports.append(sync.sync(trainer.export_hf_named_tensors(), f"step-{k}"))
        remote = engine_checksum(url)
        equal, differing = bits_match(remote, trainer.export_hf_named_tensors())
        expected_version = f"step-{args.steps}"
        return {
            "bitwise_equal": equal and remote["weight_version"] == expected_version,
            "bytes_sent": sum(r.bytes_sent for r in reports),
            "full_bytes": sum(r.full_bytes for r in reports),
            "seconds": round(sum(r.seconds for r in reports), 6),
            "weight_version": remote["weight_version"],
            "mode": args.mode,
            "transport": args.transport,
            "steps": args.steps,
            "trainer": trainer.name,
            "differing_tensors": differing[:8],
            "syncs": [
                {"weight_version": r.weight_version, "bytes_sent": r.bytes_sent, "seconds": round(r.seconds, 6),
                 "fallback": r.fallback}
                for r in reports
            ],
        }
    finally:
        if engine is not None:
            engine.stop()


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="agentrl check-weight-sync", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, help="local HF model directory (e.g. from agentrl make-tiny-model)")
    from agentrl.weights.sync import MODES

    p.add_argument("--mode", required=True, choices=sorted(MODES))
    p.add_argument("--transport", default=None,
                   help="how the mode moves bytes: a transport that carries its payload (delta: disk|broadcast), "
                        "or for the tensor preset its handles (shm|cuda_ipc|safetensors); default: the mode's")
    p.add_argument("--steps", type=int, default=1, help="optimizer steps, each followed by one sync (>= 1)")
    p.add_argument("--trainer", default="megatron", choices=sorted(TRAINERS))
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--engine-url", default=None, help="use a running engine instead of starting one")
    p.add_argument("--engine-timeout", type=float, default=300.0)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.steps < 1:
        print("agentrl check-weight-sync: --steps must be >= 1", file=sys.stderr)
        return 2
    if args.transport is not None:
        from pydantic import ValidationError

        from agentrl.weights.sync import sync_options

        try:  # the payload and transport classes say what fits, before any model or engine loads
            sync_options(args.mode, {"transport": args.transport})
        except (ValueError, ImportError) as err:
            why = "; ".join(e["msg"] for e in err.errors()) if isinstance(err, ValidationError) else str(err)
            print(f"agentrl check-weight-sync: --transport {args.transport!r} does not fit --mode {args.mode}: {why}",
                  file=sys.stderr)
            return 2
    if not (Path(args.model) / "config.json").is_file():
        print(f"agentrl check-weight-sync: {args.model!r} is not an HF model directory (no config.json)", file=sys.stderr)
        return 2
    start = time.perf_counter()
    result = run(args)
    result["wall_seconds"] = round(time.perf_counter() - start, 3)
    print(json.dumps(result), flush=True)
    return 0 if result["bitwise_equal"] else 1


if __name__ == "__main__":
    sys.exit(main())
