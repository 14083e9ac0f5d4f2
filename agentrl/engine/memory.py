"""``/release_memory_occupation`` and ``/resume_memory_occupation`` for a colocated trainer.

Tags as SGLang's: ``weights``, ``kv_cache`` (``cuda_graph`` is accepted and means nothing here); no tags
means all. While anything is released the engine refuses ``/generate`` with 503.

* ``kv_cache``: the prefix cache is dropped (running sequences are refused: release needs an idle engine).
* ``weights`` on CUDA with ``torch_memory_saver`` importable and ``--enable-memory-saver``: the model was
  loaded inside ``torch_memory_saver.region("weights", enable_cpu_backup=True)`` and is paused/resumed
  by tag, as SGLang does (needs its LD_PRELOAD hook; untested on these CPU-only machines).
* ``weights`` otherwise: each parameter's storage is swapped for an empty tensor after keeping a CPU copy
  (moved off the GPU on CUDA) and restored on resume, bit for bit. On CPU the copy *is* the weights, so
  nothing is freed; the call still keeps the protocol (the trainer can run the same code everywhere).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from agentrl.engine.engine import Engine

ALL_TAGS = {"weights", "kv_cache", "cuda_graph"}


class MemoryStateError(ValueError):
    """The release/resume request does not fit the engine's state."""


def _normalise(tags: set[str]) -> set[str]:
    unknown = tags - ALL_TAGS
    if unknown:
        raise MemoryStateError(f"unknown memory tag(s): {', '.join(sorted(unknown))}; known: {sorted(ALL_TAGS)}")
    return tags


def _memory_saver(engine: Engine):
    if not engine.config.enable_memory_saver or engine.runner.device.type != "cuda":
        return None
    try:
        import torch_memory_saver  # type: ignore[import-not-found]
    except ImportError:
        return None
    return torch_memory_saver.torch_memory_saver


def release(engine: Engine, tags: set[str]) -> None:
    import torch

    tags = _normalise(tags)
    sched = engine.scheduler
    if sched.running or sched.waiting:
        raise MemoryStateError("cannot release memory while requests are in flight; pause_generation first")
    if "kv_cache" in tags:
        engine.prefix_cache.clear()
    if "weights" in tags and "weights" not in engine.memory_released:
        saver = _memory_saver(engine)
        if saver is not None:
            saver.pause("weights")
        else:
            backup = {}
            for name, p in engine.runner.model.named_parameters():
                backup[name] = p.data if p.device.type == "cpu" else p.data.to("cpu")
                p.data = torch.empty(0, dtype=p.dtype, device=p.device)
            engine._offloaded = backup
            if engine.runner.device.type == "cuda":
                torch.cuda.empty_cache()
    engine.memory_released |= tags


def resume(engine: Engine, tags: set[str]) -> None:
    tags = _normalise(tags)
    if "weights" in tags and "weights" in engine.memory_released:
        saver = _memory_saver(engine)
        if saver is not None:
            saver.resume("weights")
        elif engine._offloaded is not None:
            device = engine.runner.device
            for name, p in engine.runner.model.named_parameters():
                p.data = engine._offloaded[name].to(device)
            engine._offloaded = None
        moved = getattr(engine.runner, "weights_moved", None)
        if moved is not None:  # captured decode steps read the old parameter memory
            moved()
    engine.memory_released -= tags
