"""Engines of a second model beside the policy's (a judge, a distillation teacher): embedded engine processes
this process starts and stops, reached directly (no router: their callers spread requests themselves)."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def check_model_dir(path: str, what: str) -> str:
    """``path`` when it is a local HF model directory (``config.json`` inside); a ``ValueError`` naming
    ``what`` otherwise, so a config refuses it before anything starts."""
    p = Path(path)
    if not p.is_dir():
        raise ValueError(f"{what}: {path} is not a directory (a local HF model dir is expected)")
    if not (p / "config.json").is_file():
        raise ValueError(f"{what}: {path} has no config.json, so it is not a HF model dir")
    return path


class ModelEngines:
    """``count`` embedded engines serving ``model_dir`` (their torch threads split ``cpus``, default the cores
    this process may use); :attr:`urls` once :meth:`start` returned."""

    def __init__(self, model_dir: str, *, count: int = 1, dtype: str = "float32", engine_args: list[str] = (),
                 log_dir: str | Path | None = None, secret: str | None = None, cpus: int | None = None) -> None:
        from agentrl.engine.launch import EngineProcess, threads_per_engine

        threads = threads_per_engine(count, cpus)
        self.engines: list[Any] = [EngineProcess(model_dir, dtype=dtype, extra_args=list(engine_args), log_dir=log_dir,
                                                 secret=secret, threads=threads) for _ in range(count)]

    @property
    def urls(self) -> list[str]:
        return [e.url for e in self.engines]

    def start(self, timeout: float = 120.0) -> ModelEngines:
        """Start every engine and wait until all are healthy; on failure stop them all and raise."""
        try:
            for engine in self.engines:
                engine.start()
            for engine in self.engines:
                engine.wait_healthy(timeout)
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self) -> None:
        for engine in self.engines:
            engine.stop()
