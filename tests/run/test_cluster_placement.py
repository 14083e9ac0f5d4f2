"""Placement rules without a cluster: layouts refused before anything is reserved, the weight-sync checks
against what engines advertise and where they run, the CUDA-absent refusal, the GPU example config, and
servers already running (``rollout.engine_urls``): used as they are, checked first, never stopped."""

from __future__ import annotations

import asyncio
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import SimpleNamespace

import pytest

from agentrl.run import ray_watchdog
from agentrl.run.placement import (
    EngineSupportError,
    GpuUnavailableError,
    PlacementError,
    Plan,
    RaySettings,
    Slot,
    check_reachable,
    check_shape,
    check_sync_support,
    connect,
    engines_are_placed,
    require_cuda,
    sync_options_for,
)


def test_colocated_layouts_that_cannot_be_built_are_refused() -> None:
    gpu = RaySettings(gpus_per_rank=1, gpus_per_engine=2)
    check_shape(gpu, ranks=4, engines=2, colocate=True)  # 2 engines x 2 GPUs on 4 ranks' GPUs
    with pytest.raises(PlacementError, match="need 6 trainer GPUs, but trainer_ranks x gpus_per_rank = 4"):
        check_shape(gpu, ranks=4, engines=3, colocate=True)
    with pytest.raises(PlacementError, match="gpus_per_rank 1"):
        check_shape(RaySettings(gpus_per_rank=2, gpus_per_engine=2), ranks=2, engines=1, colocate=True)
    with pytest.raises(PlacementError, match="gpus_per_engine >= 1"):
        check_shape(RaySettings(gpus_per_rank=1), ranks=1, engines=1, colocate=True)
    check_shape(RaySettings(), ranks=1, engines=2, colocate=True)  # CPU colocate: memory release only


def test_engines_are_placed_on_a_cluster_or_with_gpus_and_stay_children_locally() -> None:
    local = RaySettings()
    assert not engines_are_placed(local, cluster="local", colocate=False, external=False)  # the embedded default
    assert engines_are_placed(local, cluster="connected", colocate=False, external=False)
    assert engines_are_placed(RaySettings(gpus_per_engine=1), cluster="local", colocate=False, external=False)
    assert engines_are_placed(RaySettings(engine_resources={"x": 1}), cluster="local", colocate=False, external=False)
    assert not engines_are_placed(local, cluster="connected", colocate=False, external=True)  # running servers
    assert engines_are_placed(RaySettings(place_engines=True), cluster="local", colocate=False, external=False)


def test_ray_section_refuses_what_ray_would_misread() -> None:
    with pytest.raises(ValueError, match="custom resources need a name other than CPU/GPU"):
        RaySettings(trainer_resources={"GPU": 1})
    with pytest.raises(ValueError, match="amount > 0"):
        RaySettings(engine_resources={"node_b": 0})
    with pytest.raises(PlacementError, match="ray.num_cpus sizes a local cluster"):  # before ray.init is tried
        connect(RaySettings(address="192.0.2.1:1", num_cpus=2), env_vars={}, default_cpus=1)


def test_engine_urls_must_be_http_urls_once_each() -> None:
    from agentrl.rollout.settings import RolloutSettings

    assert RolloutSettings(engine_urls=["http://10.0.0.2:30000/"]).engine_urls == ["http://10.0.0.2:30000"]
    with pytest.raises(ValueError, match="not an http://host:port url"):
        RolloutSettings(engine_urls=["10.0.0.2:30000"])
    with pytest.raises(ValueError, match="lists a server twice"):
        RolloutSettings(engine_urls=["http://a:1", "http://a:1/"])


def test_delta_only_where_the_engines_advertise_it() -> None:
    agentrl = {"http://a:1": "agentrl-embedded"}
    check_sync_support("delta", {}, agentrl)
    check_sync_support("delta", {"transport": "broadcast"}, agentrl)
    for mode, options in (("disk", {}), ("broadcast", {}), ("full", {"transport": "disk"})):
        check_sync_support(mode, options, {"http://b:2": "sglang"})  # SGLang's own update routes
    with pytest.raises(EngineSupportError, match=r"delta .*'http://b:2': 'sglang'.*sync_mode disk"):
        check_sync_support("delta", {}, {**agentrl, "http://b:2": "sglang"})


def test_host_local_transports_refuse_engines_on_other_hosts() -> None:
    rank0 = {"node_ip": "10.0.0.1"}
    here, away = {"url": "http://10.0.0.1:1", "node_ip": "10.0.0.1"}, {"url": "http://10.0.0.2:1", "node_ip": "10.0.0.2"}
    check_reachable("delta", {}, [here], rank0)
    with pytest.raises(EngineSupportError, match=r"disk weight transport only reaches .*10.0.0.1.*10.0.0.2:1"):
        check_reachable("delta", {}, [here, away], rank0)
    with pytest.raises(EngineSupportError, match="tensor weight transport"):
        check_reachable("tensor", {}, [away], rank0)
    check_reachable("delta", {"directory": "/nfs/weights"}, [away], rank0)  # a shared directory
    check_reachable("broadcast", {}, [away], rank0)
    check_reachable("delta", {}, [{"url": "http://x:1", "node_ip": None}], rank0)  # running servers: unknown


def test_broadcast_rendezvous_is_rank_0s_node_on_a_cluster() -> None:
    slot = Slot(None, 0, 1, 0, "n0", "10.0.0.7", [], [0])
    cluster, local = Plan("connected", "h:1", [slot], []), Plan("local", None, [slot], [])
    broadcast, disk = "agentrl.weights.transports.broadcast:BroadcastTransport", "agentrl.weights.transports.disk:DiskTransport"
    assert sync_options_for("broadcast", {}, cluster) == {"transport": broadcast, "master_address": "10.0.0.7"}
    assert sync_options_for("delta", {"transport": "broadcast"}, cluster)["master_address"] == "10.0.0.7"
    assert sync_options_for("delta", {"transport": "broadcast", "master_address": "10.9.9.9"}, cluster)["master_address"] == "10.9.9.9"
    assert sync_options_for("broadcast", {}, local) == {"transport": broadcast}  # one host: loopback, as before
    assert sync_options_for("delta", {"level": 3}, cluster) == {"transport": disk, "level": 3}  # disk: no rendezvous
    assert local.master_addr == "127.0.0.1" and cluster.master_addr == "10.0.0.7"


def test_placement_asks_the_transport_class_so_a_new_one_needs_no_placement_edit(monkeypatch) -> None:
    """A registered transport declaring host_local and needs_rendezvous gets both checks by its attributes."""
    from pydantic import Field

    from agentrl.weights import transport as registry
    from agentrl.weights.transport import Transport, TransportOptions

    class PigeonOptions(TransportOptions):
        master_address: str = Field("127.0.0.1", description="where the pigeons fly back to")

    class Pigeon(Transport):
        name, carries, Options, host_local, needs_rendezvous = "pigeon", frozenset({"full"}), PigeonOptions, True, True

        def send_full(self, tensors, weight_version, urls):  # pragma: no cover - never sent here
            raise NotImplementedError

    monkeypatch.setattr(registry, "TRANSPORTS", {**registry.TRANSPORTS, "pigeon": Pigeon})
    rank0, away = {"node_ip": "10.0.0.1"}, {"url": "http://10.0.0.2:1", "node_ip": "10.0.0.2"}
    with pytest.raises(EngineSupportError, match="pigeon weight transport only reaches"):
        check_reachable("full", {"transport": "pigeon"}, [away], rank0)
    cluster = Plan("connected", "h:1", [Slot(None, 0, 1, 0, "n0", "10.0.0.7", [], [0])], [])
    assert sync_options_for("full", {"transport": "pigeon"}, cluster)["master_address"] == "10.0.0.7"
    with pytest.raises(TypeError, match="master_address"):
        type("NoAddress", (Transport,), {"needs_rendezvous": True, "send_full": Pigeon.send_full})


def test_a_process_given_gpus_refuses_when_cuda_is_absent() -> None:
    import torch

    require_cuda("trainer rank 0", [], "node")  # no GPUs asked: nothing to refuse
    if torch.cuda.is_available():
        pytest.skip("CUDA is present here")
    with pytest.raises(GpuUnavailableError, match=r"trainer rank 0 was placed on GPU\(s\) \[1\] of node n1.*refusing to run on the CPU"):
        require_cuda("trainer rank 0", [1], "n1")


def test_the_gpu_example_places_one_engine_and_one_rank_on_one_shared_gpu() -> None:
    from agentrl.run.config import load_config

    cfg = load_config("examples/arithmetic/config_gpu.yaml", ["--model.path", "/models/smollm2"])
    assert cfg.colocate and cfg.schedule == "sync" and cfg.trainer_ranks == 1 and cfg.rollout.num_engines == 1
    assert (cfg.ray.gpus_per_rank, cfg.ray.gpus_per_engine) == (1, 1)
    check_shape(cfg.ray, ranks=cfg.trainer_ranks, engines=cfg.rollout.num_engines, colocate=cfg.colocate)
    assert engines_are_placed(cfg.ray, cluster="local", colocate=True, external=False)
    check_sync_support(cfg.sync_mode, cfg.sync_options, {"http://e:1": "agentrl-embedded"})


class _Answer(BaseHTTPRequestHandler):
    """/health 200; /server_info 401 unless the bearer is ``secret`` (as a server with another key)."""

    secret = "the-servers-own-key"

    def do_GET(self) -> None:  # noqa: N802
        if self.path == "/health":
            self.send_response(200)
            self.end_headers()
            return
        ok = self.headers.get("Authorization") == f"Bearer {self.secret}"
        self.send_response(200 if ok else 401)
        self.end_headers()
        self.wfile.write(json.dumps({"weight_version": "0"}).encode() if ok else b"")

    def log_message(self, *args) -> None:
        pass


def test_a_running_server_that_does_not_answer_or_refuses_the_secret_is_named() -> None:
    from agentrl.engine.launch import EngineStartError, ExternalEngine, free_port

    dead = f"http://127.0.0.1:{free_port()}"
    with pytest.raises(EngineStartError, match=rf"engine {dead} \(rollout.engine_urls\) does not answer GET /health"):
        ExternalEngine(dead, secret="s").wait_healthy(1.0)
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Answer)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{server.server_port}"
        with pytest.raises(EngineStartError, match=rf"engine {url} refused the run's secret \(HTTP 401"):
            ExternalEngine(url, secret="another").wait_healthy(5)
        engine = ExternalEngine(url, secret=_Answer.secret).wait_healthy(5)
        assert engine.info == {"weight_version": "0"} and engine.alive
        assert engine.where()["external"] and engine.where()["engine"] == "sglang"  # no agentrl advert
    finally:
        server.shutdown()


def test_rollouts_run_on_servers_already_running_and_leave_them_running(tmp_path) -> None:
    import httpx

    from agentrl.engine.launch import EngineProcess
    from agentrl.envs.arithmetic import ArithmeticToolEnv, make_tasks
    from agentrl.models.tiny import make_tiny_model
    from agentrl.rollout.manager import RolloutManager
    from agentrl.rollout.settings import RolloutSettings

    model = make_tiny_model(tmp_path / "m", seed=0)
    with EngineProcess(model, threads=1) as served:  # stands in for `agentrl serve` started by someone else
        settings = RolloutSettings(engine_urls=[served.url], num_engines=5, samples_per_prompt=2, max_new_tokens=8)
        with RolloutManager(model, ArithmeticToolEnv, settings) as manager:
            assert manager.engine_urls == [served.url]  # num_engines is not used: nothing was started
            assert manager.engine_kinds() == {served.url: "agentrl-embedded"}
            batch = asyncio.run(manager.rollout(make_tasks(2, seed=0), 2))
            assert batch.metrics["rollout/episodes"] == 4
        assert served.alive and httpx.get(served.url + "/health", timeout=10).status_code == 200


def test_every_config_in_the_cluster_docs_is_valid() -> None:
    import re
    from pathlib import Path

    import yaml

    from agentrl.run.config import RunConfig

    blocks = re.findall(r"```yaml\n(.*?)```", Path("docs/cluster.md").read_text(), flags=re.S)
    assert len(blocks) == 3
    for block in blocks:
        cfg = RunConfig.model_validate(yaml.safe_load(block))
        check_shape(cfg.ray, ranks=cfg.trainer_ranks, engines=cfg.rollout.num_engines, colocate=cfg.colocate)


def test_paths_become_absolute_on_a_cluster_only(monkeypatch, tmp_path) -> None:
    from agentrl.run.config import load_config
    from agentrl.run.placement import absolute_paths

    monkeypatch.chdir(tmp_path)
    cfg = load_config(None, ["--output_dir", "runs/x", "--cache_dir", "c", "--model.path", "m"])
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    assert absolute_paths(cfg) is cfg  # local: as given (the local cache keys stay what they were)
    monkeypatch.setenv("RAY_ADDRESS", "10.0.0.1:6379")  # actors there do not run in this directory
    moved = absolute_paths(cfg)
    assert (moved.output_dir, moved.cache_dir, moved.model.path) == (
        str(tmp_path / "runs/x"), str(tmp_path / "c"), str(tmp_path / "m"))


def test_ray_address_local_starts_a_local_cluster_as_in_ray(monkeypatch) -> None:
    from agentrl.run.placement import RaySettings, cluster_address

    monkeypatch.setenv("RAY_ADDRESS", "local")
    assert cluster_address(RaySettings()) is None
    monkeypatch.setenv("RAY_ADDRESS", "10.0.0.5:6379")
    assert cluster_address(RaySettings()) == "10.0.0.5:6379"
    assert cluster_address(RaySettings(address="local")) is None


def test_actors_get_the_drivers_directory_on_their_path(monkeypatch, tmp_path) -> None:
    import ray

    seen: dict = {}
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("PYTHONPATH", "/opt/site")
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.setattr(ray, "init", lambda **kwargs: seen.update(kwargs) or SimpleNamespace(address_info={"session_dir": "/s"}))
    monkeypatch.setattr(ray_watchdog, "watch", lambda session_dir: seen.update(watched=session_dir))
    connect(RaySettings(), env_vars={"X": "1"}, default_cpus=1)
    assert seen["watched"] == "/s"  # a local cluster gets its watchdog
    assert seen["runtime_env"]["env_vars"] == {"PYTHONPATH": f"{tmp_path}{__import__('os').pathsep}/opt/site", "X": "1"}
