"""Where a run's processes go: connect to a Ray cluster (or start a local one), reserve GPUs and CPUs in
placement groups, and record which node and GPU ids every engine and trainer rank got.

:func:`connect` joins ``ray.address`` / ``$RAY_ADDRESS`` (with a local token, if any) or starts a local
cluster; :func:`reserve` makes one bundle per trainer rank and, unless colocated, one per engine (a bundle
never spans nodes), and probes each bundle once for its node and the GPU ids Ray gave it, which become the
process's ``CUDA_VISIBLE_DEVICES``. A process given GPUs where CUDA is absent refuses to start
(:class:`GpuUnavailableError`). Placed engines run on their bundle's node in an
:class:`~agentrl.run.engine_host.EngineHost`; a local CPU run keeps them children of the rollout actor.
The layouts (split, colocated) and the rules: docs/cluster.md.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from pydantic import Field, model_validator

from agentrl.settings import Settings

Strategy = Literal["PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"]
ADDRESS_ENV = "RAY_ADDRESS"
# Fractions of a colocated bundle's GPU: any split works (Ray does not police memory); these only make
# room for both processes in one bundle.
RANK_GPU_SHARE = 0.5
ENGINE_GPU_SHARE = 0.25
PROBE_SHARE = 0.01


class PlacementError(RuntimeError):
    """The cluster cannot hold what the run asks for, or a placement breaks a rule (an engine across nodes)."""


class GpuUnavailableError(RuntimeError):
    """A process was given GPUs but CUDA is not usable in it; it refuses instead of running on the CPU."""


class RaySettings(Settings):
    """The ``ray`` section: which cluster, and what each trainer rank and engine reserves on it."""

    address: str | None = Field(None, description="host:port of a running cluster (else $RAY_ADDRESS; neither: start a local one)")
    num_cpus: int | None = Field(None, ge=1, description="CPUs of a local cluster (default: max(4, trainer_ranks + 1)); not used when connecting")
    gpus_per_rank: int = Field(0, ge=0, description="GPUs of each trainer rank (0: CPU training)")
    gpus_per_engine: int = Field(0, ge=0, description="GPUs of each engine (its tensor-parallel size); 0: CPU engines")
    cpus_per_engine: int = Field(1, ge=1, description="CPUs reserved for each placed engine (also its torch thread count)")
    trainer_strategy: Strategy = Field("PACK", description="placement strategy of the trainer ranks' bundles")
    engine_strategy: Strategy = Field("PACK", description="placement strategy of the engines' bundles (one bundle per engine, never split)")
    trainer_resources: dict[str, float] = Field(default_factory=dict,
                                                description='custom Ray resources each trainer bundle needs, e.g. {"trainer_node": 1}')
    engine_resources: dict[str, float] = Field(default_factory=dict,
                                               description="custom Ray resources each engine bundle needs")
    place_engines: bool | None = Field(None, description="start each engine on its own bundle's node (None: on a cluster, "
                                                         "or with GPUs or engine resources; else as children of the rollout actor)")
    ready_timeout_s: float = Field(120.0, gt=0, description="how long to wait for the cluster to grant the placement groups")

    @model_validator(mode="after")
    def _resources_positive(self) -> RaySettings:
        for name, res in (("trainer_resources", self.trainer_resources), ("engine_resources", self.engine_resources)):
            bad = {k: v for k, v in res.items() if not v > 0 or k in ("CPU", "GPU", "memory")}
            if bad:
                raise ValueError(f"ray.{name}: {bad}: custom resources need a name other than CPU/GPU/memory and an amount > 0 "
                                 "(set GPUs with gpus_per_rank / gpus_per_engine)")
        return self


# -------------------------------------------------------------------------------------------- connect


def cluster_address(settings: RaySettings) -> str | None:
    """The cluster to join: ``ray.address``, else ``$RAY_ADDRESS``, else ``None`` (start a local one, as
    Ray's own ``local`` means)."""
    address = settings.address or os.environ.get(ADDRESS_ENV) or None
    return None if address == "local" else address


def _token_available() -> bool:
    if os.environ.get("RAY_AUTH_TOKEN"):
        return True
    path = os.environ.get("RAY_AUTH_TOKEN_PATH") or str(Path.home() / ".ray" / "auth_token")
    return Path(path).is_file()


def connect(settings: RaySettings, *, env_vars: dict[str, str], default_cpus: int) -> dict[str, Any]:
    """``ray.init`` for the run: join the cluster of :func:`cluster_address` (no resources passed) or start
    a local one with ``default_cpus`` (or ``ray.num_cpus``) CPUs. ``env_vars`` reach every actor on every
    node (the job's runtime env). Returns ``{"cluster": "connected" | "local", "address": ...}``."""
    import ray

    address = cluster_address(settings)
    # The driver's directory on every actor's path: an env or task function in the user's tree
    # (`examples.search_r1.env:...`) loads in the Ray actors as it did in the driver.
    path = os.pathsep.join(p for p in (os.getcwd(), os.environ.get("PYTHONPATH", "")) if p)
    runtime_env = {"env_vars": {"PYTHONPATH": path, **env_vars}}
    if address is None:
        # "local", not None: None would join whatever `ray start` last started on this machine. Ray starts
        # workers 15 nice levels below the raylet; here the workers (trainer ranks, the rollout actor and
        # its engines) are the run itself, so they keep the driver's priority: on a shared machine their
        # threads at nice 15 lost the cores to anyone else's work (a rollout took 2.1 s in a run against
        # 1.0 s for the same engines started at nice 0, with nice-19 jobs beside them).
        context = ray.init(address="local", num_cpus=settings.num_cpus or default_cpus, include_dashboard=False,
                           log_to_driver=True, runtime_env=runtime_env, _system_config={"worker_niceness": 0})
        from agentrl.run.ray_watchdog import watch

        watch(context.address_info["session_dir"])  # a SIGKILLed driver leaves no Ray process of its cluster
        return {"cluster": "local", "address": None}
    if settings.num_cpus is not None:
        raise PlacementError(f"ray.num_cpus sizes a local cluster; the run joins {address}, whose nodes declare their own")
    # Ray 2.60's `ray start` turns token auth on; an explicit address only presents the token in token mode.
    if "RAY_AUTH_MODE" not in os.environ and _token_available():
        try:  # Ray's own switch: sets the mode and refreshes its cached config (the variable alone is not re-read)
            from ray._private.authentication.authentication_token_setup import _enable_token_auth
        except ImportError:  # another Ray version: the variable is all there is
            os.environ["RAY_AUTH_MODE"] = "token"
        else:
            _enable_token_auth()
    try:
        ray.init(address=address, log_to_driver=True, runtime_env=runtime_env)
    except ConnectionError as exc:
        raise PlacementError(f"could not join the Ray cluster at {address} (ray.address / $RAY_ADDRESS): {exc}") from exc
    return {"cluster": "connected", "address": address}


def absolute_paths(cfg: Any) -> Any:
    """``cfg`` (a RunConfig) with ``output_dir``, ``cache_dir`` and ``model.path`` made absolute: actors on
    a cluster run in their node's directory, not the driver's, so a relative path would name another place.
    Unchanged for a local cluster (its actors share the driver's directory; cache keys stay as they were)."""
    if cluster_address(cfg.ray) is None:
        return cfg
    model = cfg.model.model_copy(update={"path": str(Path(cfg.model.path).resolve())}) if cfg.model.path else cfg.model
    return cfg.model_copy(update={"output_dir": str(Path(cfg.output_dir).resolve()),
                                  "cache_dir": str(Path(cfg.cache_dir).resolve()), "model": model})


# -------------------------------------------------------------------------------------------- reserve


@dataclass
class Slot:
    """Where one process runs: a bundle of a placement group, what to ask of it, and what Ray assigned.

    ``gpu_ids``: the physical ids (as Ray numbers them on the node) the process must see; ``bundles``:
    every bundle index whose GPUs it uses (several for an engine colocated over several ranks)."""

    group: Any
    bundle: int
    num_cpus: float
    num_gpus: float
    node_id: str
    node_ip: str
    gpu_ids: list[int] = field(default_factory=list)
    bundles: list[int] = field(default_factory=list)

    def scheduling(self) -> dict[str, Any]:
        """``.options(**slot.scheduling())`` for the actor that runs in this slot."""
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        return {"num_cpus": self.num_cpus, "num_gpus": self.num_gpus,
                "scheduling_strategy": PlacementGroupSchedulingStrategy(self.group, placement_group_bundle_index=self.bundle)}

    def record(self) -> dict[str, Any]:
        return {"node_id": self.node_id, "node_ip": self.node_ip, "gpu_ids": list(self.gpu_ids)}


@dataclass
class Plan:
    """The reserved groups and a slot per trainer rank and per placed engine (``engines`` is empty when
    engines are children of the rollout actor)."""

    cluster: str
    address: str | None
    trainers: list[Slot]
    engines: list[Slot]
    groups: list[Any] = field(default_factory=list)
    cpus_per_engine: int = 1

    def rollout_kwargs(self) -> dict[str, Any]:
        """What the rollout actor needs to start placed engines (nothing when it starts them itself)."""
        return {"engine_slots": self.engines, "cpus_per_engine": self.cpus_per_engine} if self.engines else {}

    @property
    def master_addr(self) -> str:
        """Rank 0's node IP (loopback for a local cluster)."""
        return "127.0.0.1" if self.cluster == "local" else self.trainers[0].node_ip

    def master_port(self) -> int:
        """A port free on rank 0's node for the trainer's rendezvous (asked there on a cluster)."""
        from agentrl.engine.launch import free_port

        if self.cluster == "local":
            return free_port()
        import ray
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        slot = self.trainers[0]
        strategy = PlacementGroupSchedulingStrategy(slot.group, placement_group_bundle_index=slot.bundle)
        return ray.get(ray.remote(free_port).options(num_cpus=PROBE_SHARE, scheduling_strategy=strategy)
                       .remote(slot.node_ip))

    def remove(self) -> None:
        import ray
        from ray.util.placement_group import remove_placement_group

        for group in self.groups:
            if ray.is_initialized():
                remove_placement_group(group)
        self.groups = []


def engines_are_placed(settings: RaySettings, *, cluster: str, colocate: bool, external: bool) -> bool:
    """Whether engines are started on bundles of their own (see module doc) rather than by the rollout actor."""
    if external:
        return False
    if settings.place_engines is not None:
        return settings.place_engines
    return (cluster == "connected" or settings.gpus_per_engine > 0 or bool(settings.engine_resources)
            or (colocate and settings.gpus_per_rank > 0))


def check_shape(settings: RaySettings, *, ranks: int, engines: int, colocate: bool) -> None:
    """Refuse a colocated layout that cannot be built, before anything is reserved."""
    g, r = settings.gpus_per_engine, settings.gpus_per_rank
    if not colocate or (g == 0 and r == 0):
        return
    if r != 1:
        raise PlacementError(f"colocate with GPUs needs ray.gpus_per_rank 1 (one GPU per trainer rank), got {r}")
    if g < 1:
        raise PlacementError("colocate with GPU trainer ranks needs ray.gpus_per_engine >= 1: engines share the ranks' GPUs")
    if engines * g > ranks:
        raise PlacementError(f"colocate: {engines} engine(s) x {g} GPU(s) need {engines * g} trainer GPUs, "
                             f"but trainer_ranks x gpus_per_rank = {ranks}")


def _bundle(cpus: float, gpus: int, resources: dict[str, float]) -> dict[str, float]:
    bundle = {"CPU": float(cpus), **resources}
    if gpus:
        bundle["GPU"] = float(gpus)
    return bundle


def _ready(group: Any, what: str, bundles: list[dict[str, float]], timeout: float) -> None:
    import ray

    try:
        ray.get(group.ready(), timeout=timeout)
    except ray.exceptions.GetTimeoutError:
        from ray.util.placement_group import remove_placement_group

        remove_placement_group(group)
        raise PlacementError(
            f"the cluster did not grant the {what} placement group ({len(bundles)} x {bundles[0]}) within {timeout:g} s; "
            f"it has {ray.cluster_resources()} in all, {ray.available_resources()} free") from None


def here() -> dict[str, Any]:
    """This Ray worker's node and the GPU ids Ray assigned to it."""
    import ray

    return {"node_id": ray.get_runtime_context().get_node_id(), "node_ip": ray.util.get_node_ip_address(),
            "gpu_ids": [int(g) for g in ray.get_gpu_ids()]}


def probe(group: Any, bundle: int, has_gpu: bool) -> Any:
    """A reference to :func:`here` of one bundle (a task holding a sliver of it)."""
    import ray
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    strategy = PlacementGroupSchedulingStrategy(group, placement_group_bundle_index=bundle)
    return ray.remote(here).options(num_cpus=PROBE_SHARE, num_gpus=PROBE_SHARE if has_gpu else 0,
                         scheduling_strategy=strategy).remote()


def reserve(settings: RaySettings, *, cluster: str, address: str | None, ranks: int, engines: int,
            colocate: bool, place_engines: bool) -> Plan:
    """Create and wait for the placement groups (see module doc); probe each bundle for its node and GPUs."""
    import ray
    from ray.util.placement_group import placement_group

    check_shape(settings, ranks=ranks, engines=engines, colocate=colocate)
    r, g = settings.gpus_per_rank, settings.gpus_per_engine
    hosted = place_engines and colocate
    rank_cpus = 1 + (settings.cpus_per_engine if hosted else 0)  # a colocated bundle also holds an engine host
    trainer_bundles = [_bundle(rank_cpus, r, settings.trainer_resources) for _ in range(ranks)]
    trainer_group = placement_group(trainer_bundles, strategy=settings.trainer_strategy)
    groups = [trainer_group]
    plan = Plan(cluster, address, [], [], groups, settings.cpus_per_engine)
    try:
        _ready(trainer_group, "trainer", trainer_bundles, settings.ready_timeout_s)
        engine_group, engine_bundles = None, []
        if place_engines and not colocate:
            engine_bundles = [_bundle(settings.cpus_per_engine, g, settings.engine_resources) for _ in range(engines)]
            engine_group = placement_group(engine_bundles, strategy=settings.engine_strategy)
            groups.append(engine_group)
            _ready(engine_group, "engine", engine_bundles, settings.ready_timeout_s)
        if cluster == "local" and r == 0 and g == 0:  # one node, no GPUs: nothing to learn (and no task to wait for)
            local = {"node_id": ray.get_runtime_context().get_node_id(), "node_ip": "127.0.0.1", "gpu_ids": []}
            trainer_where, engine_where = [local] * ranks, [local] * len(engine_bundles)
        else:
            trainer_where = ray.get([probe(trainer_group, i, r > 0) for i in range(ranks)])
            engine_where = ray.get([probe(engine_group, i, g > 0) for i in range(len(engine_bundles))])
    except BaseException:
        plan.remove()
        raise
    rank_gpus = RANK_GPU_SHARE if (colocate and r > 0 and place_engines) else float(r)
    plan.trainers = [Slot(trainer_group, i, 1, rank_gpus, w["node_id"], w["node_ip"], w["gpu_ids"], [i])
                     for i, w in enumerate(trainer_where)]
    if engine_group is not None:
        plan.engines = [Slot(engine_group, i, settings.cpus_per_engine, float(g), w["node_id"], w["node_ip"], w["gpu_ids"], [i])
                        for i, w in enumerate(engine_where)]
    elif hosted:
        plan.engines = [_colocated_slot(plan, settings, i) for i in range(engines)]
    return plan


def reserve_for(cfg: Any, cluster: dict[str, Any]) -> Plan:
    """:func:`reserve` for a :class:`~agentrl.run.config.RunConfig` on the cluster :func:`connect` joined."""
    placed = engines_are_placed(cfg.ray, cluster=cluster["cluster"], colocate=cfg.colocate,
                                external=bool(cfg.rollout.engine_urls))
    return reserve(cfg.ray, cluster=cluster["cluster"], address=cluster["address"], ranks=cfg.trainer_ranks,
                   engines=cfg.rollout.num_engines, colocate=cfg.colocate, place_engines=placed)


def on_this_node() -> dict[str, Any]:
    """Actor options that keep it on the driver's node (the rollout actor: router, logs, output dir)."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    return {"scheduling_strategy": NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=True)}


def _colocated_slot(plan: Plan, settings: RaySettings, index: int) -> Slot:
    """Engine ``index`` on trainer bundles ``index*g .. index*g+g-1`` (``g`` >= 1 GPUs; one bundle on CPU)."""
    g = max(1, settings.gpus_per_engine)
    ranks = plan.trainers[index * g: index * g + g]
    nodes = {s.node_id for s in ranks}
    if len(nodes) > 1:
        raise PlacementError(f"colocated engine {index} would span trainer ranks on {len(nodes)} nodes "
                             f"({sorted(nodes)}); set ray.trainer_strategy STRICT_PACK or fewer GPUs per engine")
    first = ranks[0]
    gpus = ENGINE_GPU_SHARE if settings.gpus_per_engine > 0 else 0.0
    return Slot(first.group, first.bundle, settings.cpus_per_engine, gpus, first.node_id, first.node_ip,
                [i for s in ranks for i in s.gpu_ids], [s.bundle for s in ranks])


# -------------------------------------------------------------------------------------------- records


def visible_devices(gpu_ids: list[int]) -> dict[str, str]:
    """The environment that shows a process exactly ``gpu_ids`` (and, with none, no GPU at all)."""
    return {"CUDA_VISIBLE_DEVICES": ",".join(str(i) for i in gpu_ids)}


def require_cuda(what: str, gpu_ids: list[int], node: str) -> None:
    """Raise :class:`GpuUnavailableError` when ``gpu_ids`` were assigned but CUDA is not usable here."""
    if not gpu_ids:
        return
    import torch

    if not torch.cuda.is_available():
        build = f"torch {torch.__version__} (CUDA {torch.version.cuda or 'not built in'})"
        raise GpuUnavailableError(f"{what} was placed on GPU(s) {gpu_ids} of node {node}, but CUDA is not available "
                                  f"there ({build}); refusing to run on the CPU. Use a CUDA torch on GPU nodes, or set "
                                  "ray.gpus_per_rank / ray.gpus_per_engine to 0 for a CPU run.")


def placement_record(plan_info: dict[str, Any], engines: list[dict[str, Any]], ranks: list[dict[str, Any]]) -> dict[str, Any]:
    """The ``placement`` object of the run's metrics: the cluster, and each engine's and rank's node and GPUs."""
    nodes = sorted({w["node_id"] for w in [*engines, *ranks] if w.get("node_id")})
    return {**plan_info, "nodes": nodes, "engines": engines, "trainer_ranks": ranks}


def describe(record: dict[str, Any]) -> str:
    """One line for the run's start: where every engine and rank runs."""
    def one(name: str, w: dict[str, Any]) -> str:
        node = (w.get("node_id") or "?")[:8]
        where = f"{w['url']}" if w.get("external") else f"node {node} ({w.get('node_ip')})"
        return f"{name} {where} GPUs {w.get('gpu_ids') if w.get('gpu_ids') is not None else '-'}"

    parts = [one(f"engine {i}", w) for i, w in enumerate(record["engines"])]
    parts += [one(f"rank {w.get('rank', i)}", w) for i, w in enumerate(record["trainer_ranks"])]
    return f"{record['cluster']} cluster ({len(record['nodes'])} node(s)): " + "; ".join(parts)


def sync_options_for(mode: str, options: Any, plan: Plan) -> dict[str, Any]:
    """What the trainer's sender is made with: the options the user set, the transport named by its class
    path (so the rank loads the class the driver resolved), and on a cluster the rendezvous of a transport
    that needs one on rank 0's node (engines on other nodes connect to it) unless set."""
    from agentrl.weights.sync import sync_options
    from agentrl.weights.transport import class_path, transport_class

    typed = sync_options(mode, options)
    transport = transport_class(typed.transport)
    out = {**typed.model_dump(exclude_unset=True), "transport": class_path(transport)}
    if plan.cluster == "connected" and transport.needs_rendezvous and "master_address" not in typed.model_fields_set:
        out["master_address"] = plan.trainers[0].node_ip
    return out


# -------------------------------------------------------------------------------------------- sync checks


class EngineSupportError(ValueError):
    """The weight sync asks for something the engines (or where they run) cannot do."""


def check_sync_support(mode: str, options: Any, kinds: dict[str, str]) -> None:
    """Refuse a payload to engines that do not advertise the engine it needs (``/server_info``'s ``engine``;
    the delta payload needs agentrl's routes, SGLang has none), naming them and what they do support."""
    from agentrl.weights.sync import payload_class

    needs = payload_class(mode).needs_engine
    other = {url: kind for url, kind in kinds.items() if needs is not None and kind != needs}
    if other:
        raise EngineSupportError(
            f"sync_mode {mode} needs engines that advertise {needs}'s routes; {other} do not. Use sync_mode "
            "disk (their /update_weights_from_disk; sync_options.directory must be readable by every engine) or "
            "broadcast (/init_weights_update_group + /update_weights_from_distributed)")


def check_reachable(mode: str, options: Any, engines: list[dict[str, Any]], rank0: dict[str, Any]) -> None:
    """Refuse a host-local transport (the trainer's /dev/shm, shared memory, CUDA IPC) to an engine on
    another host: it could never read the weights."""
    from agentrl.weights.sync import sync_options
    from agentrl.weights.transport import transport_class

    typed = sync_options(mode, options)
    transport = transport_class(typed.transport)
    if transport.reaches_other_hosts(typed):
        return
    away = [e.get("url") for e in engines if e.get("node_ip") and e["node_ip"] != rank0.get("node_ip")]
    if away:
        raise EngineSupportError(
            f"the {transport.label()} weight transport only reaches engines on trainer rank 0's host ({rank0.get('node_ip')}); "
            f"{away} run elsewhere. Set sync_options.directory to a directory every node mounts, or use "
            'sync_options {"transport": "broadcast"}')
