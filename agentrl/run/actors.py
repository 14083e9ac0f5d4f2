"""Ray actors of a run: one trainer actor per Megatron rank (in a placement group) and one rollout actor
that owns the engines, the smg router, the agent loop and the data buffer.

The classes are plain Python; :func:`remote` wraps them with ``ray.remote`` when a run starts, so this
module imports without Ray and the classes are testable in-process. A batch travels once: the rollout
actor returns its samples as an object in Ray's store, and every trainer rank reads that one object.
"""

from __future__ import annotations

import asyncio
import gc
import os
from pathlib import Path
from typing import Any

from agentrl.plugins import load_function
from agentrl.rollout.buffer import DataBuffer
from agentrl.rollout.episode_pool import example_row, unproven_trained_tokens
from agentrl.rollout.manager import RolloutManager
from agentrl.rollout.settings import RolloutSettings
from agentrl.trajectory import Sample

__all__ = ["RolloutWorker", "TrainerRank", "remote", "start_trainer_group", "training_cpu_threads",
           "unproven_trained_tokens"]


class TrainerRank:
    """One Megatron rank: GRPO steps, weight export + sync to the engines, checkpoints."""

    def __init__(self, model_dir: str, trainer_config: dict[str, Any], temperature: float, rank: int,
                 world_size: int, master_port: int, master_addr: str = "127.0.0.1",
                 gpu_ids: list[int] | None = None, cpu_threads: int | None = None) -> None:
        """``master_addr``: rank 0's node (its IP on a cluster). ``gpu_ids``: the GPUs Ray assigned this
        rank (``[]``: none, so CUDA is hidden); a rank given GPUs where CUDA is absent refuses to start.
        ``cpu_threads``: torch's intra-op threads for this rank (None: what Ray's CPU share sets, 1)."""
        import torch

        from agentrl.run.placement import here, require_cuda, visible_devices

        if cpu_threads is not None:
            torch.set_num_threads(cpu_threads)

        self.where_ = {**here(), "rank": rank, "master_addr": master_addr}
        if gpu_ids is not None:  # before torch initialises CUDA: a 0-GPU Ray actor would otherwise see all
            os.environ.update(visible_devices(gpu_ids))
            self.where_["gpu_ids"] = list(gpu_ids)
            require_cuda(f"trainer rank {rank}", gpu_ids, self.where_["node_id"])
        os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK="0" if gpu_ids else str(rank),
                          MASTER_ADDR=master_addr, MASTER_PORT=str(master_port))
        from agentrl.trainer.actor import MegatronTrainer
        from agentrl.trainer.trainer_config import TrainerConfig

        self.where_["cpu_threads"] = torch.get_num_threads()
        self.rank = rank
        self.model_dir = model_dir
        self.trainer = MegatronTrainer(model_dir, TrainerConfig.model_validate(trainer_config),
                                       temperature=temperature)
        self._sync: Any = None
        self._sync_target: tuple[str, list[str], dict[str, Any]] | None = None

    def where(self) -> dict[str, Any]:
        """This rank's node, node IP and GPU ids (what the run's placement record shows)."""
        return dict(self.where_)

    def configure_sync(self, mode: str, engine_urls: list[str], options: dict[str, Any]) -> None:
        """Where :meth:`sync_weights` sends to; set once per run (and again if the engines change)."""
        self._sync_target = (mode, list(engine_urls), dict(options))
        if self._sync is not None:
            self._sync.close()
            self._sync = None

    def train(self, samples: list[Sample]) -> dict[str, float]:
        return self.trainer.train_step(samples)

    def configure_distill(self, loss: Any) -> None:
        """Train toward the teacher targets samples carry (``loss``: :class:`agentrl.trainer.losses.DistillLoss`)."""
        self.trainer.distill = loss

    def sync_weights(self, weight_version: str) -> dict[str, Any] | None:
        """Every rank exports (TP shards are gathered collectively); rank 0 pushes to the engines."""
        from agentrl.weights.adapter_sync import adapter_named_tensors, sends_adapters

        if self._sync_target is None:
            raise RuntimeError("configure_sync() before sync_weights()")
        mode, urls, options = self._sync_target
        adapters = sends_adapters(mode)
        lora = self.trainer.config.lora
        named = (adapter_named_tensors(self.trainer.export_adapter_tensors(), lora.scale) if adapters
                 else self.trainer.export_hf_named_tensors())
        if self.rank != 0:
            for _ in named:
                pass
            return None
        if self._sync is None:
            from agentrl.trainer.lora import dense_bytes
            from agentrl.weights.sync import make_sync

            extra = {"dense_bytes": dense_bytes(self.trainer.hf_config, self.trainer.dtype)} if adapters else {}
            self._sync = make_sync(mode, urls, **options, **extra)
        return self._sync.sync(named, weight_version).to_json()

    def export_hf(self, out_dir: str) -> str | None:
        """Write the current policy as a HF model dir (weights + the model dir's config and tokenizer)."""
        from agentrl.weights.convert import save_hf_checkpoint

        named = self.trainer.export_hf_named_tensors()
        if self.rank != 0:
            for _ in named:
                pass
            return None
        return str(save_hf_checkpoint(named, self.model_dir, out_dir))

    def save_checkpoint(self, directory: str, extra_state: dict[str, Any]) -> str:
        return str(self.trainer.save_checkpoint(directory, extra_state))

    def load_checkpoint(self, directory: str) -> dict[str, Any]:
        return self.trainer.load_checkpoint(directory)

    def close(self) -> None:
        if self._sync is not None:
            self._sync.close()
            self._sync = None


class RolloutWorker:
    """Engines + router + agent loop + data buffer for one environment; batches out, weights in (through
    the engines)."""

    def __init__(self, model_dir: str, env_path: str, settings: dict[str, Any], *, dtype: str = "float32",
                 group_filter: str = "agentrl.rollout.buffer:has_reward_variance", log_dir: str | None = None,
                 engine_slots: list[Any] | None = None, cpus_per_engine: int = 1,
                 external_agent: dict[str, Any] | None = None, cwd: str | None = None) -> None:
        """``engine_slots`` (:class:`agentrl.run.placement.Slot`): start engine ``i`` on ``engine_slots[i]``'s
        node (:mod:`agentrl.run.engine_host`); without them the engines are this actor's children.
        ``external_agent`` (:class:`agentrl.run.external_agents.ExternalAgentSettings`): agent processes,
        started in ``cwd``, play the episodes through the gateway."""
        self.agents: Any = None
        if external_agent is not None:
            from agentrl.run import external_agents as ext

            self.agents = ext.ACTIVE.pool = ext.ExternalAgents(ext.ExternalAgentSettings.model_validate(external_agent),
                                                               model_dir, log_dir=log_dir, cwd=cwd)
            settings = {**settings, "episode_function": ext.EPISODE_FUNCTION}
        self.settings = RolloutSettings.model_validate(settings)
        factory = None
        if engine_slots:
            from agentrl.run.engine_host import host_factory

            factory = host_factory(engine_slots, kind=self.settings.engine, model_dir=model_dir, dtype=dtype,
                                   engine_args=self.settings.engine_args, log_dir=log_dir, threads=cpus_per_engine)
        self.manager = RolloutManager(model_dir, load_function(env_path), self.settings, dtype=dtype,
                                      log_dir=log_dir, engine_factory=factory)
        self.buffer = DataBuffer(load_function(group_filter))
        self._in_flight: set[asyncio.Task] = set()  # rollouts and evaluations, cancelled by shutdown()
        self._shutting_down = False
        self.manager.start()
        freeze_setup_heap()

    def engine_urls(self) -> list[str]:
        return self.manager.engine_urls

    def engine_kinds(self) -> dict[str, str]:
        return self.manager.engine_kinds()

    def where(self) -> list[dict[str, Any]]:
        """Each engine's url, node, node IP and GPU ids (engines started here are on this actor's node)."""
        from agentrl.run.placement import here

        local = here()
        return [{"engine": i, "url": e.url, **(e.where() if hasattr(e, "where") else {**local, "gpu_ids": []})}
                for i, e in enumerate(self.manager.engines)]

    async def start_pool(self, task_source: Any, first_batch: int, schedule: Any) -> None:
        """Start the episode pool on ``task_source`` under ``schedule`` (the run config: its schedule fields);
        a ``fully_async`` pool starts admitting batches from ``first_batch`` at once."""
        router = self.manager.router

        def engine_control(mode: str) -> None:
            if mode:
                router.pause(mode)
            else:
                router.continue_()

        self.pool = self.manager.pool(task_source, schedule, self.buffer, first_batch=first_batch,
                                      engine_control=engine_control).start()

    async def take_batch(self, trainer_version: int, examples: int = 0, batch: int | None = None,
                         ) -> tuple[list[Sample], dict[str, float], list[dict[str, Any]]]:
        """The pool's next batch for the weights ``trainer_version`` (``batch``: admit that batch of the task
        source and wait for all of it, as :meth:`EpisodePool.take`): the samples of the groups worth training
        (flat, whole groups in order), the metrics and ``examples`` whole episodes to show. Call with
        ``num_returns=3`` so the samples stay in Ray's object store on their way to the trainer ranks."""
        groups, metrics, episodes = await self._abandoned_on_shutdown(self.pool.take(trainer_version, batch))
        if self.agents is not None:
            self.agents.raise_if_failing()
            metrics.update(self.agents.metrics())
        shown: dict[str, Any] = {}  # one episode per group, first groups first
        for e in episodes:
            if e.samples:
                shown.setdefault(str(e.group_id), e)
        return [s for g in groups for s in g], metrics, [example_row(e) for e in list(shown.values())[:examples]]

    async def pause_generation(self) -> None:
        """Before a weight update: no turn runs on the engines until :meth:`continue_generation`."""
        await self.pool.pause()

    async def continue_generation(self) -> None:
        await self.pool.resume()

    async def stop_pool(self) -> dict[str, int]:
        """Cancel the episodes in flight; returns the pool's lifetime counts."""
        pool, self.pool = getattr(self, "pool", None), None
        if pool is None:
            return {}
        await pool.close()
        return dict(pool.counts)

    def buffer_state(self) -> dict[str, Any]:
        return self.buffer.state_dict()

    def load_buffer_state(self, state: dict[str, Any]) -> None:
        self.buffer.load_state_dict(state)

    async def evaluate(self, tasks: list[Any], passk: dict[str, Any] | None = None) -> dict[str, float]:
        """Greedy held-out accuracy; with ``passk`` (:func:`agentrl.rollout.passk.evaluate_passk`'s keyword
        arguments) also its pass@k and mean@k rows."""
        if passk is None:
            result = await self._abandoned_on_shutdown(self.manager.evaluate(tasks))
        else:
            from agentrl.rollout.passk import evaluate_passk, run_metrics

            result = run_metrics(await self._abandoned_on_shutdown(evaluate_passk(self.manager, tasks, **passk)))
        if self.agents is not None:
            self.agents.metrics()  # the agent counts of a training batch leave evaluation episodes out
        return result

    async def _abandoned_on_shutdown(self, work: Any) -> Any:
        """Await ``work`` as a task that :meth:`shutdown` cancels (its episodes' ``close()`` still run)."""
        if self._shutting_down:
            work.close()
            raise RuntimeError("the rollout actor is shutting down")
        task = asyncio.ensure_future(work)
        self._in_flight.add(task)
        try:
            return await task
        finally:
            self._in_flight.discard(task)

    async def load_from_disk(self, model_dir: str, weight_version: str) -> None:
        """Point every engine at a saved HF checkpoint (supervised warm-up evaluations)."""
        self.manager.router.update_weights_from_disk(model_dir, weight_version)

    def release_memory(self) -> None:
        self.manager.router.fanout("release_memory_occupation", {})

    def resume_memory(self) -> None:
        self.manager.router.fanout("resume_memory_occupation", {})

    async def shutdown(self, episode_grace_s: float = 30.0) -> None:
        """Cancel the rollouts and evaluations in flight (and the episode pool), wait up to
        ``episode_grace_s`` for their episodes to close, then stop the agents, the router and the engines
        and close the environment's resources (``close_resources()``). New work is refused from here on."""
        self._shutting_down = True
        in_flight = list(self._in_flight)
        for task in in_flight:
            task.cancel()
        if in_flight:
            await asyncio.wait(in_flight, timeout=episode_grace_s)
        try:
            await asyncio.wait_for(self.stop_pool(), episode_grace_s)
            if self.agents is not None:
                await self.agents.stop()
            await self.manager.aclose_client()
        finally:
            self.manager.shutdown()


def freeze_setup_heap() -> None:
    """Move every object alive now into the collector's permanent generation (``gc.freeze``): what a worker's
    setup loaded (torch, transformers, the tokenizer, Ray) is never garbage, yet each full collection walked
    all of it. Measured on the rollout path (``benchmarks/rollout_host_bench.py``, 2 cores, same minute, load
    ~7): the client process's full collections cost 0.229 ms a turn, 0.016 frozen; 1.94 -> 1.69 ms host CPU
    a turn in all. Objects made later are collected as before."""
    gc.collect()
    gc.freeze()


def remote(cls: type, **options: Any) -> Any:
    """``ray.remote(**options)(cls)``, imported late so this module works without Ray."""
    import ray

    return ray.remote(**options)(cls)


def start_trainer_group(model_dir: str | Path, trainer_config: dict[str, Any], temperature: float, n_ranks: int,
                        use_gpu: bool = False, *, plan: Any = None, cpu_threads: int | None = None) -> list[Any]:
    """One :class:`TrainerRank` actor per rank. With ``plan`` (:class:`agentrl.run.placement.Plan`) rank
    ``r`` goes to ``plan.trainers[r]``, sees exactly its GPUs, and rendezvous at rank 0's node; without it
    the ranks are packed in a new placement group (1 CPU or GPU per bundle) on this machine.
    ``cpu_threads``: each rank's torch threads (see :func:`training_cpu_threads`)."""
    import ray
    from ray.util.placement_group import placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    from agentrl.engine.launch import free_port

    if plan is not None:
        port = plan.master_port()
        actor_cls = remote(TrainerRank, num_cpus=1)  # each slot's own resources replace these
        return [actor_cls.options(**slot.scheduling()).remote(
                    str(model_dir), trainer_config, temperature, r, n_ranks, port, plan.master_addr, slot.gpu_ids,
                    cpu_threads)
                for r, slot in enumerate(plan.trainers)]
    bundle = {"GPU": 1, "CPU": 1} if use_gpu else {"CPU": 1}
    group = placement_group([bundle] * n_ranks, strategy="PACK")
    ray.get(group.ready())
    port = free_port()
    actor_cls = remote(TrainerRank, num_cpus=1, num_gpus=1 if use_gpu else 0)
    return [
        actor_cls.options(scheduling_strategy=PlacementGroupSchedulingStrategy(group, placement_group_bundle_index=r)).remote(
            str(model_dir), trainer_config, temperature, r, n_ranks, port, cpu_threads=cpu_threads)
        for r in range(n_ranks)
    ]


def training_cpu_threads(loop: str, trainer_ranks: int, gpus_per_rank: int, cluster: str,
                         cpus: int | None = None) -> int | None:
    """Torch threads per CPU trainer rank: in the ``sync`` loop on a local cluster the engines wait while the
    ranks train, so the ranks share this machine's cores (``cpus``, default: those this process may use);
    otherwise None (Ray's share, one thread), as the engines generate while the ranks train.

    Measured on the main job's trainer step (2 cores, nothing else running): 1.37 s with one thread,
    1.00 s with two (benchmarks/results/main_job_step_profile.md)."""
    if loop != "sync" or gpus_per_rank > 0 or cluster != "local":
        return None
    total = cpus if cpus is not None else len(os.sched_getaffinity(0))
    return max(1, total // max(1, trainer_ranks))
