"""Ray actors of a run: one trainer actor per Megatron rank (in a placement group) and one rollout actor
that owns the engines, the smg router and the agent loop.

The classes are plain Python; :func:`remote` wraps them with ``ray.remote`` when a run starts, so this
module imports without Ray and the classes are testable in-process.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from agentrl.engine.launch import free_port
from agentrl.rollout.buffer import save_samples_jsonl
from agentrl.rollout.manager import RolloutBatch, RolloutManager, RolloutSettings
from agentrl.trajectory import MODEL, Sample


def unproven_trained_tokens(sample: Sample) -> int:
    """Trained tokens (loss mask 1) whose provenance is not a model output: must always be 0."""
    count = 0
    for run in sample.provenance.runs:
        if run.source == MODEL:
            continue
        lo, hi = max(run.start, sample.response_start), run.end
        count += sum(sample.loss_mask[lo - sample.response_start : hi - sample.response_start]) if hi > lo else 0
    return count


class TrainerRank:
    """One Megatron rank: GRPO steps, weight export + sync to the engines, checkpoints."""

    def __init__(self, model_dir: str, trainer_config: dict[str, Any], rank: int, world_size: int,
                 master_port: int) -> None:
        os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                          MASTER_ADDR="127.0.0.1", MASTER_PORT=str(master_port))
        from agentrl.trainer.actor import MegatronTrainer
        from agentrl.trainer.trainer_config import TrainerConfig

        self.rank = rank
        self.trainer = MegatronTrainer(model_dir, TrainerConfig(**trainer_config))
        self._sync: Any = None

    def train(self, samples: list[Sample]) -> dict[str, float]:
        return self.trainer.train_step(samples)

    def sync_weights(self, mode: str, engine_urls: list[str], weight_version: str,
                     options: dict[str, Any] | None = None) -> dict[str, Any] | None:
        """Every rank exports (TP shards are gathered collectively); rank 0 pushes to the engines."""
        named = self.trainer.export_hf_named_tensors()
        if self.rank != 0:
            for _ in named:
                pass
            return None
        from agentrl.weights.sync import make_sync

        if self._sync is None or self._sync.engine_urls != list(engine_urls):
            self._sync = make_sync(mode, engine_urls, **(options or {}))
        return self._sync.sync(named, weight_version).to_json()

    def save_checkpoint(self, directory: str, extra_state: dict[str, Any]) -> str:
        return str(self.trainer.save_checkpoint(directory, extra_state))

    def load_checkpoint(self, directory: str) -> dict[str, Any]:
        return self.trainer.load_checkpoint(directory)


class RolloutWorker:
    """Engines + router + agent loop for one environment; Samples out, weights in (through the engines)."""

    def __init__(self, model_dir: str, env_path: str, settings: dict[str, Any]) -> None:
        from agentrl.envs import load_function

        self.manager = RolloutManager(model_dir, load_function(env_path), RolloutSettings(**settings))
        self.manager.start()

    def engine_urls(self) -> list[str]:
        return self.manager.engine_urls

    async def rollout(self, tasks: list[Any], samples_per_task: int, dump_path: str | None = None) -> RolloutBatch:
        batch = await self.manager.rollout(tasks, samples_per_task)
        samples = [s for g in batch.groups for s in g]
        batch.metrics["rollout/unproven_trained_tokens"] = float(sum(map(unproven_trained_tokens, samples)))
        batch.metrics["rollout/trained_tokens"] = float(sum(s.trained_tokens for s in samples))
        if dump_path:
            save_samples_jsonl(samples, dump_path)
        return batch

    async def evaluate(self, tasks: list[Any]) -> dict[str, float]:
        return await self.manager.evaluate(tasks)

    async def load_from_disk(self, model_dir: str, weight_version: str) -> None:
        """Point every engine at a saved HF checkpoint (supervised warm-up evaluations)."""
        self.manager.router.update_weights_from_disk(model_dir, weight_version)

    def release_memory(self) -> None:
        self.manager.router.fanout("release_memory_occupation", {})

    def resume_memory(self) -> None:
        self.manager.router.fanout("resume_memory_occupation", {})

    async def shutdown(self) -> None:
        await self.manager.aclose_client()
        self.manager.shutdown()


def remote(cls: type, **options: Any) -> Any:
    """``ray.remote(**options)(cls)``, imported late so this module works without Ray."""
    import ray

    return ray.remote(**options)(cls)


def start_trainer_group(model_dir: str | Path, trainer_config: dict[str, Any], n_ranks: int,
                        use_gpu: bool = False) -> list[Any]:
    """One :class:`TrainerRank` actor per rank, packed in a placement group (1 CPU or GPU per bundle)."""
    import ray
    from ray.util.placement_group import placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    bundle = {"GPU": 1, "CPU": 1} if use_gpu else {"CPU": 1}
    group = placement_group([bundle] * n_ranks, strategy="PACK")
    ray.get(group.ready())
    port = free_port()
    actor_cls = remote(TrainerRank, num_cpus=1, num_gpus=1 if use_gpu else 0)
    return [
        actor_cls.options(scheduling_strategy=PlacementGroupSchedulingStrategy(group, placement_group_bundle_index=r)).remote(
            str(model_dir), trainer_config, r, n_ranks, port)
        for r in range(n_ranks)
    ]
