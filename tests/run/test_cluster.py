"""A real two-node Ray cluster on this machine (``ray start --head`` + ``ray start --address``, each node
declaring 2 GPUs and a custom resource naming it), and what agentrl places on it: which process gets
which GPU ids, engines on one node and trainer ranks on the other, one router serving engines of both
nodes, the broadcast weight sync across nodes (gloo) bit for bit, GPU processes refusing when CUDA is
absent, and ``agentrl train`` through ``$RAY_ADDRESS`` with ``--resume``.

The nodes are started with ``--block`` in their own sessions and torn down by those process groups (never
``ray stop``, which would stop every Ray on the machine); their temp dirs are private, so no other
``ray.init()`` on the machine joins this cluster.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from agentrl.engine.launch import free_ports

pytestmark = [pytest.mark.timeout(900), pytest.mark.slow]
RAY = str(Path(sys.executable).with_name("ray"))


def _ray_start(args: list[str], log: Path, env: dict[str, str] | None = None) -> subprocess.Popen:
    with open(log, "ab") as out:
        return subprocess.Popen([RAY, "start", "--block", "--disable-usage-stats", *args], stdout=out,
                                stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True,
                                env={**os.environ, **(env or {})})


def _stop(proc: subprocess.Popen) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(timeout=30)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """Head (node_a) and worker (node_b), 4 CPUs and 2 declared GPUs each; yields the head's address."""
    import ray

    root = tmp_path_factory.mktemp("cluster")
    temp = Path(f"/tmp/agentrl-rc-{os.getpid()}")  # short: Ray's socket paths must fit in 107 bytes
    gcs, client, dashboard, agent_a, agent_b = free_ports(5)
    host = ray.util.get_node_ip_address()
    address = f"{host}:{gcs}"
    common = ["--num-cpus", "4", "--num-gpus", "2", "--temp-dir"]
    head = _ray_start(["--head", "--port", str(gcs), "--ray-client-server-port", str(client), "--include-dashboard",
                       "false", "--dashboard-port", str(dashboard), "--dashboard-agent-listen-port", str(agent_a), *common, str(temp / "a"),
                       "--resources", json.dumps({"node_a": 100})], root / "head.log")
    procs = [head]
    try:
        deadline = time.monotonic() + 120
        while "Ray runtime started" not in (root / "head.log").read_text():
            assert head.poll() is None and time.monotonic() < deadline, (root / "head.log").read_text()[-3000:]
            time.sleep(0.5)
        procs.append(_ray_start(["--address", address, "--dashboard-agent-listen-port", str(agent_b), *common,
                                 str(temp / "b"), "--resources", json.dumps({"node_b": 100})], root / "worker.log",
                                # the head turned token auth on (Ray 2.60's default); a joining node must present it
                                env={"RAY_AUTH_MODE": "token"}))
        yield {"address": address, "root": root, "logs": [root / "head.log", root / "worker.log"]}
    finally:
        for proc in reversed(procs):
            _stop(proc)
        shutil.rmtree(temp, ignore_errors=True)


@pytest.fixture(scope="module")
def driver(cluster):
    """This test process joined to the cluster through agentrl's own connect(); both nodes alive."""
    import ray

    from agentrl.engine.auth import SECRET_ENV, run_secret
    from agentrl.run.placement import RaySettings, connect

    auth_mode = os.environ.get("RAY_AUTH_MODE")
    info = connect(RaySettings(address=cluster["address"]), env_vars={SECRET_ENV: run_secret()}, default_cpus=1)
    assert info == {"cluster": "connected", "address": cluster["address"]}
    try:
        deadline = time.monotonic() + 120
        while len([n for n in ray.nodes() if n["Alive"]]) < 2:
            assert time.monotonic() < deadline, cluster["logs"][1].read_text()[-3000:]
            time.sleep(0.5)
        nodes = {next(k for k in n["Resources"] if k.startswith("node_")): n["NodeID"] for n in ray.nodes() if n["Alive"]}
        yield {**cluster, "nodes": nodes}
    finally:
        ray.shutdown()
        if auth_mode is None:  # connect() set token mode for this cluster only
            os.environ.pop("RAY_AUTH_MODE", None)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    from agentrl.models.tiny import make_tiny_model

    root = tmp_path_factory.mktemp("models")
    return make_tiny_model(root / "seed0", seed=0), make_tiny_model(root / "seed1", seed=1)


def _reserve(**kwargs):
    from agentrl.run.placement import RaySettings, reserve

    layout = {k: kwargs.pop(k) for k in ("ranks", "engines", "colocate", "place_engines")}
    return reserve(RaySettings(**kwargs), cluster="connected", address=None, **layout)


def _seen(slot) -> dict:
    """What a process scheduled with the slot's options sees: Ray's GPU ids and its node."""
    import ray

    from agentrl.run.placement import here

    seen = ray.get(ray.remote(here).options(**slot.scheduling()).remote())
    return {"node_id": seen["node_id"], "gpu_ids": seen["gpu_ids"]}


def test_each_process_gets_its_own_gpu_ids_from_ray_and_colocated_ones_share(driver) -> None:
    nodes = driver["nodes"]
    plan = _reserve(ranks=2, engines=2, colocate=False, place_engines=True, gpus_per_rank=1, gpus_per_engine=1,
                    trainer_resources={"node_a": 1}, engine_resources={"node_b": 1})
    try:
        assert [s.node_id for s in plan.trainers] == [nodes["node_a"]] * 2
        assert [s.node_id for s in plan.engines] == [nodes["node_b"]] * 2
        taken = [(s.node_id, g) for s in plan.trainers + plan.engines for g in s.gpu_ids]
        assert len(taken) == 4 and len(set(taken)) == 4  # no two non-colocated processes share a GPU
        assert sorted(g for s in plan.trainers for g in s.gpu_ids) == [0, 1]
        for slot in plan.trainers + plan.engines:  # the actor placed there is assigned exactly the probed ids
            assert _seen(slot) == {"node_id": slot.node_id, "gpu_ids": slot.gpu_ids}
        assert plan.master_addr == plan.trainers[0].node_ip and 1024 <= plan.master_port() < 65536
    finally:
        plan.remove()

    # Colocated: one engine with 2 GPUs on the bundles of ranks 0 and 1, which share them by design.
    plan = _reserve(ranks=2, engines=1, colocate=True, place_engines=True, gpus_per_rank=1, gpus_per_engine=2,
                    trainer_strategy="STRICT_PACK")
    try:
        (engine,) = plan.engines
        assert engine.gpu_ids == [i for s in plan.trainers for i in s.gpu_ids] and sorted(engine.gpu_ids) == [0, 1]
        assert engine.node_id == plan.trainers[0].node_id == plan.trainers[1].node_id
        assert engine.bundles == [0, 1] and engine.num_gpus < 1 and plan.trainers[0].num_gpus < 1
        ranks_seen = [_seen(s) for s in plan.trainers]
        assert [r["gpu_ids"] for r in ranks_seen] == [s.gpu_ids for s in plan.trainers]
        assert _seen(engine)["gpu_ids"] == plan.trainers[0].gpu_ids  # Ray's share of bundle 0; bundle 1's id added by us
    finally:
        plan.remove()


def test_a_layout_the_cluster_cannot_hold_is_a_clear_error(driver) -> None:
    from agentrl.run.placement import PlacementError

    with pytest.raises(PlacementError, match=r"did not grant the trainer placement group \(3 x .*'GPU': 1.0.*node_a"):
        _reserve(ranks=3, engines=1, colocate=False, place_engines=False, gpus_per_rank=1,
                 trainer_resources={"node_a": 1}, ready_timeout_s=3)


def test_gpu_processes_refuse_to_run_without_cuda(driver, models) -> None:
    import ray

    from agentrl.run.actors import TrainerRank, remote
    from agentrl.run.engine_host import EngineHost

    plan = _reserve(ranks=1, engines=1, colocate=False, place_engines=True, gpus_per_rank=1, gpus_per_engine=1)
    try:
        host = remote(EngineHost, num_cpus=0).options(**plan.engines[0].scheduling()).remote(
            "embedded", str(models[0]), dtype="float32", engine_args=[], log_dir=None, threads=1,
            gpu_ids=plan.engines[0].gpu_ids, index=0)
        with pytest.raises(ray.exceptions.RayActorError, match=r"engine 0 was placed on GPU\(s\) \[\d\].*CUDA is not available"):
            ray.get(host.url.remote())
        rank = remote(TrainerRank, num_cpus=1).options(**plan.trainers[0].scheduling()).remote(
            str(models[0]), {}, 1.0, 0, 1, 29500, "127.0.0.1", plan.trainers[0].gpu_ids)
        with pytest.raises(ray.exceptions.RayActorError, match=r"trainer rank 0 was placed on GPU\(s\).*refusing to run on the CPU"):
            ray.get(rank.where.remote())
    finally:
        plan.remove()


def test_engines_on_two_nodes_behind_one_router_and_a_broadcast_sync_across_nodes_is_bitwise(driver, models, tmp_path) -> None:
    import httpx
    import ray
    from safetensors.torch import load_file

    from agentrl.engine.weight_loading import weights_checksum
    from agentrl.run.actors import RolloutWorker, remote, start_trainer_group
    from agentrl.run.placement import on_this_node, sync_options_for

    nodes = driver["nodes"]
    plan = _reserve(ranks=1, engines=2, colocate=False, place_engines=True, engine_strategy="STRICT_SPREAD",
                    trainer_resources={"node_a": 1})
    rollout = trainer = None
    try:
        settings = {"num_engines": 2, "samples_per_prompt": 2, "max_new_tokens": 8, "concurrency": 8}
        rollout = remote(RolloutWorker, num_cpus=0).options(**on_this_node()).remote(
            str(models[0]), "agentrl.envs.arithmetic:ArithmeticToolEnv", settings, log_dir=str(tmp_path / "logs"),
            **plan.rollout_kwargs())
        engines = ray.get(rollout.where.remote())
        assert sorted(e["node_id"] for e in engines) == sorted(nodes.values())  # one engine on each node
        assert all(e["gpu_ids"] == [] for e in engines)
        from agentrl.run.config import RunConfig

        cfg = RunConfig()  # the sync schedule over the arithmetic tasks: batch 0 is 8 tasks x 2 samples
        ray.get(rollout.start_pool.remote(cfg.task_source(), 0, cfg))
        _, metrics, _ = ray.get(rollout.take_batch.options(num_returns=3).remote(0, batch=0))
        assert metrics["rollout/episodes"] == 16
        served = {}
        for e in engines:  # the router sent sessions to the engines of both nodes
            text = httpx.get(e["url"] + "/metrics", timeout=30).text
            served[e["node_id"]] = sum(float(line.split()[-1]) for line in text.splitlines()
                                       if line.startswith("agentrl_engine_requests_total"))
        assert all(count > 0 for count in served.values()), served

        # Trainer rank 0 on node_a holds other weights (seed 1); broadcast them to both engines.
        (trainer,) = start_trainer_group(models[1], {}, 1.0, 1, plan=plan)
        rank = ray.get(trainer.where.remote())
        assert rank["node_id"] == nodes["node_a"] and rank["master_addr"] == plan.trainers[0].node_ip
        options = sync_options_for("broadcast", {}, plan)
        # the rendezvous on rank 0's node; the transport travels as its class path (the rank loads that class)
        assert options == {"master_address": plan.trainers[0].node_ip,
                           "transport": "agentrl.weights.transports.broadcast:BroadcastTransport"}
        urls = ray.get(rollout.engine_urls.remote())
        ray.get(trainer.configure_sync.remote("broadcast", urls, options))
        report = ray.get(trainer.sync_weights.remote("7"))
        assert report["details"]["backend"] == "gloo" and report["details"]["world_size"] == 3
        ray.get(trainer.export_hf.remote(str(tmp_path / "hf")))
        ours = load_file(str(tmp_path / "hf" / "model.safetensors"))
        for url in urls:
            remote_sum = httpx.get(url + "/weights_checksum", timeout=60).json()
            mine = weights_checksum((n, ours[n]) for n in remote_sum["parameters"])
            assert mine["total"] == remote_sum["total"], url  # every bit, on both nodes
            assert httpx.get(url + "/server_info", timeout=30).json()["weight_version"] == "7"
        seed0 = load_file(str(models[0] / "model.safetensors"))
        assert weights_checksum(seed0.items())["total"] != weights_checksum(ours.items())["total"]  # it moved
    finally:
        if trainer is not None:
            ray.get(trainer.close.remote())
        if rollout is not None:
            ray.get(rollout.shutdown.remote())
        plan.remove()


def test_agentrl_train_through_ray_address_places_on_both_nodes_then_resumes(driver, tmp_path) -> None:
    out = tmp_path / "run"
    env = {**os.environ, "RAY_ADDRESS": driver["address"]}
    small = ["--cache_dir", str(tmp_path / "cache"), "--warmup.max_steps", "2", "--warmup.check_every", "2",
             "--warmup.num_conversations", "32", "--rollout.num_engines", "1", "--rollout.prompts_per_step", "2",
             "--rollout.samples_per_prompt", "4", "--rollout.max_new_tokens", "16", "--eval.every", "2",
             "--eval.num_tasks", "4", "--sync_options", '{"transport": "broadcast"}',
             "--ray.trainer_resources", '{"node_a": 1}', "--ray.engine_resources", '{"node_b": 1}']
    train = [sys.executable, "-m", "agentrl.cli", "train", "examples/arithmetic/config.yaml", "--output-dir", str(out)]
    done = subprocess.run([*train, "--steps", "2", *small], env=env, capture_output=True, text=True, timeout=800)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "agentrl train: placement: connected cluster (2 node(s))" in done.stdout
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    placed = [r["placement"] for r in rows if "placement" in r]
    assert len(placed) == 1 and placed[0]["address"] == driver["address"]
    (engine,), (rank,) = placed[0]["engines"], placed[0]["trainer_ranks"]
    assert engine["node_id"] == driver["nodes"]["node_b"] and rank["node_id"] == driver["nodes"]["node_a"]
    assert engine["gpu_ids"] == [] and rank["gpu_ids"] == [] and engine["url"].startswith("http://")
    assert [r["step"] for r in rows if "step" in r] == [0, 1, 2]

    done = subprocess.run([*train, "--steps", "3", "--resume", *small], env=env, capture_output=True, text=True,
                          timeout=800)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    new = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()][len(rows):]
    assert [r["step"] for r in new] == [3] and new[0]["placement"]["engines"][0]["node_id"] == driver["nodes"]["node_b"]
