"""An engine started on the node of its placement-group bundle: :class:`EngineHost` is a small Ray actor
in that bundle that starts the engine process there (bound to the node's IP, shown exactly the GPUs Ray
assigned) and reports its URL; :class:`RemoteEngine` is the rollout manager's handle to it, with
:class:`~agentrl.engine.launch.EngineProcess`'s API, so the router and the engine watch work unchanged.

The run's secret reaches the host through the job's runtime env (every node), and from there the engine.
"""

from __future__ import annotations

import os
from typing import Any

from agentrl.run.placement import Slot, here, require_cuda, visible_devices


class EngineHost:
    """Starts and owns one engine process on this node (construct it inside the engine's bundle).

    ``kind``: ``embedded`` or ``sglang``. ``gpu_ids``: the physical GPUs the engine gets (its slot's); with
    none, CUDA is hidden from it. The process is started here, in the actor's thread, so it is tied to
    this actor (it dies with it)."""

    def __init__(self, kind: str, model_dir: str, *, dtype: str, engine_args: list[str], log_dir: str | None,
                 threads: int, gpu_ids: list[int], index: int) -> None:
        self.where_ = {**here(), "engine": index, "gpu_ids": list(gpu_ids)}
        env = visible_devices(gpu_ids)
        if gpu_ids:
            os.environ.update(env)  # before torch initialises CUDA in this process (the check below)
            require_cuda(f"engine {index}", gpu_ids, self.where_["node_id"])
        host = "127.0.0.1" if self.where_["node_ip"] in ("127.0.0.1", "localhost") else self.where_["node_ip"]
        if kind == "embedded":
            from agentrl.engine.launch import EngineProcess

            extra = [*engine_args, *(["--device", "cuda"] if gpu_ids else ["--device", "cpu"])]
            self.engine = EngineProcess(model_dir, host=host, dtype=dtype, extra_args=extra, log_dir=log_dir,
                                        threads=threads, env=env)
        elif kind == "sglang":
            from agentrl.engine.sglang import SGLangProcess

            self.engine = SGLangProcess(model_dir, host=host, dtype=dtype, tp_size=max(1, len(gpu_ids)),
                                        base_gpu_id=0 if gpu_ids else None, sglang_args=engine_args,
                                        log_dir=log_dir, env=env)
        else:
            raise ValueError(f"unknown engine {kind!r}: choose 'embedded' or 'sglang'")
        self.where_["url"] = self.engine.url

    def url(self) -> str:
        return self.engine.url

    def start(self) -> str:
        self.engine.start()
        return self.engine.url

    def wait_healthy(self, timeout: float) -> str:
        self.engine.wait_healthy(timeout)
        return self.engine.url

    def alive(self) -> bool:
        return self.engine.alive

    def stop(self) -> None:
        self.engine.stop()

    def where(self) -> dict[str, Any]:
        return dict(self.where_)


class RemoteEngine:
    """The rollout manager's handle to an :class:`EngineHost` actor (EngineProcess's API, by Ray calls)."""

    def __init__(self, host: Any, timeout: float = 600.0) -> None:
        import ray

        self.host = host
        self.timeout = timeout
        self.url: str = ray.get(host.url.remote(), timeout=timeout)

    def _call(self, method: str, *args: Any, timeout: float | None = None) -> Any:
        import ray

        return ray.get(getattr(self.host, method).remote(*args), timeout=timeout or self.timeout)

    @property
    def alive(self) -> bool:
        try:
            return bool(self._call("alive", timeout=30))
        except Exception:  # the host (or its node) is gone: so is the engine
            return False

    def start(self) -> RemoteEngine:
        self._call("start")
        return self

    def wait_healthy(self, timeout: float = 120) -> RemoteEngine:
        self._call("wait_healthy", timeout, timeout=timeout + 30)
        return self

    def stop(self, timeout: float = 10) -> None:
        import contextlib

        with contextlib.suppress(Exception):
            self._call("stop", timeout=timeout + 30)

    def where(self) -> dict[str, Any]:
        return self._call("where")


def host_factory(slots: list[Slot], *, kind: str, model_dir: str, dtype: str, engine_args: list[str],
                 log_dir: str | None, threads: int) -> Any:
    """``factory(i)`` -> a :class:`RemoteEngine` whose host actor sits in ``slots[i]``."""
    from agentrl.run.actors import remote

    host_cls = remote(EngineHost, num_cpus=0)  # each slot's own resources replace these

    def make(i: int) -> RemoteEngine:
        slot = slots[i]
        actor = host_cls.options(**slot.scheduling()).remote(
            kind, model_dir, dtype=dtype, engine_args=list(engine_args), log_dir=log_dir, threads=threads,
            gpu_ids=slot.gpu_ids, index=i)
        return RemoteEngine(actor)

    return make
