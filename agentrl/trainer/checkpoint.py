"""Save / resume a trainer with ``megatron.core.dist_checkpointing`` (resharding-capable, one dir per step).

Contents: model and optimizer (sharded), per-rank RNG states (a ``ShardedObject`` per rank), and common
state written once by rank 0: the LR scheduler, the step counter, the caller's ``extra_state``
(data-buffer cursor, weight version, ...), ``optimizer_state`` (whether the optimizer section is in) and
``world_size``. Model and optimizer load at another data-parallel size (tested: 2 -> 1; Megatron's
"dp_reshardable" format of the distributed optimizer reshards along data-parallel only); RNG states
are restored only at the world size that saved them.

An optimizer that has not stepped yet (Adam before its first update) has no per-parameter state, while
Megatron's loading template always allocates one, so the two sharded state dicts would disagree. Such an
optimizer holds nothing that the model, the config and the LR schedule do not determine, so it is not
saved at all (``optimizer_state: "not_stepped"``); loading resets the optimizer to that fresh state and
re-copies its main (fp32) parameters from the loaded model.

On disk: ``save_checkpoint(".../step-N")`` writes into the sibling ``step-N.tmp-<pid>`` (rank 0's pid),
then :data:`MANIFEST` (every other file's size and xxh3-64 checksum) as its last file, and only then
renames it to ``step-N``; a complete ``step-N`` already there is swapped out atomically and deleted. A
save killed at any point leaves ``step-N`` as it was (absent, or the earlier attempt's) plus a temp
sibling, which the next save of ``step-N`` removes. ``load_checkpoint`` checks every file against the
manifest before it reads any of them; checkpoints written before the manifest existed load with a warning.
"""

from __future__ import annotations

import ctypes
import json
import os
import random
import shutil
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException

from agentrl.trainer.cpu_shims import cuda_to_cpu
from agentrl.trainer.threaded_save import threaded_save_strategy

OPTIMIZER_SAVED = "saved"
OPTIMIZER_NOT_STEPPED = "not_stepped"
# Megatron's DistributedOptimizer default ("fully_sharded_model_space") writes flattened tensor ranges,
# which its torch_dist save strategy rejects; "fully_reshardable" stores model-shaped tensors (any TP/DP).
_DISTOPT_METADATA = {"distrib_optim_sharding_type": "dp_reshardable"}
_COMMON_KEYS = ("scheduler", "step", "extra_state")
MANIFEST = "agentrl-manifest.json"
_MANIFEST_FORMAT = 1
_TMP, _OLD = ".tmp-", ".old-"
_CHUNK = 8 << 20


class CheckpointError(ValueError):
    """A checkpoint directory that exists but cannot be restored (incomplete, corrupt or mismatched)."""


def _rng_state() -> dict[str, Any]:
    from megatron.core import tensor_parallel

    state: dict[str, Any] = {
        "python": random.getstate(),
        "torch": torch.get_rng_state(),
        "tracker": tensor_parallel.get_cuda_rng_tracker().get_states(),
    }
    try:
        import numpy as np

        state["numpy"] = np.random.get_state()
    except ImportError:  # pragma: no cover - numpy ships with torch here
        pass
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _set_rng_state(state: dict[str, Any]) -> None:
    from megatron.core import tensor_parallel

    random.setstate(state["python"])
    torch.set_rng_state(state["torch"])
    tensor_parallel.get_cuda_rng_tracker().set_states(state["tracker"])
    if "numpy" in state:
        import numpy as np

        np.random.set_state(state["numpy"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def _rng_sharded(state: dict[str, Any] | None):
    from megatron.core.dist_checkpointing.mapping import ShardedObject

    world, rank = dist.get_world_size(), dist.get_rank()
    return ShardedObject("rng_state", state, (world,), (rank,), replica_id=0)


# ---------------------------------------------------------------------------------------------- optimizer


def _parts(optimizer) -> list:
    """The Megatron optimizers inside a ``ChainedOptimizer`` (or the optimizer itself)."""
    return list(getattr(optimizer, "chained_optimizers", [optimizer]))


def _is_distributed(part) -> bool:
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    return isinstance(part, DistributedOptimizer)


def _optimizer_has_stepped(optimizer) -> bool:
    """False while a stateful optimizer (Adam) has no per-parameter state yet, on every rank.

    Optimizers without per-parameter state (SGD without momentum, ``init_state_fn is None``) always count
    as stepped: their (empty) state is saved and loaded as is.
    """
    local = any(p.init_state_fn is None or len(p.optimizer.state) > 0 for p in _parts(optimizer))
    # A data-parallel shard can differ from its peers; the saved section must be all or nothing.
    flags: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(flags, local)
    return any(flags)


def _optimizer_sharded_state(optimizer, model_sd: dict[str, Any], *, is_loading: bool) -> dict[str, Any]:
    parts = _parts(optimizer)
    if is_loading:
        for part in parts:
            if _is_distributed(part) and len(part.optimizer.state) == 0:
                # Its sharded_state_dict reads the inner state (and its step) first. Megatron's dummy state
                # comes from a zero-gradient step, which changes only what the load overwrites: moments and
                # main params (for fp32, views of the model's parameters).
                part._init_optimizer_states_with_dummy_values()
    # ``is_loading`` only makes Megatron allocate state through init_state_fn: nothing to allocate for SGD.
    is_loading = is_loading and all(p.init_state_fn is not None for p in parts)
    kwargs = {"metadata": dict(_DISTOPT_METADATA)} if any(_is_distributed(p) for p in parts) else {}
    return optimizer.sharded_state_dict(model_sd, is_loading=is_loading, **kwargs)


def _unshare_steps(optimizer) -> None:
    """Give every parameter its own Adam ``step`` tensor.

    megatron-core 0.16.1's ``DistributedOptimizer.load_state_dict`` (torch Adam, no Apex/TE) puts one
    ``step`` tensor into every parameter's state; torch's multi-tensor Adam then increments that shared
    tensor once per parameter, so the resumed run's bias correction used step 1 + #params.
    """
    for part in _parts(optimizer):
        for state in part.optimizer.state.values():
            if isinstance(state.get("step"), torch.Tensor):
                state["step"] = state["step"].clone()


def _reset_optimizer(optimizer) -> None:
    """Make ``optimizer`` what a fresh one over the (just loaded) model is: no state, main params = model."""
    for part in _parts(optimizer):
        part.optimizer.state.clear()
    optimizer.reload_model_params()


# ---------------------------------------------------------------------------------------------- manifest


def _xxh3():
    import xxhash

    return xxhash.xxh3_64()


def _digest(file: Path) -> dict[str, Any]:
    """Size and checksum of ``file``, flushed to disk on the way (it is about to be renamed into place)."""
    digest, size = _xxh3(), 0
    buf = bytearray(_CHUNK)
    with open(file, "rb") as f:
        while n := f.readinto(buf):
            digest.update(memoryview(buf)[:n])
            size += n
        os.fsync(f.fileno())
    return {"size": size, "xxh3_64": digest.hexdigest()}


def _files_checksum(files: dict[str, Any]) -> str:
    digest = _xxh3()
    digest.update(json.dumps(files, sort_keys=True).encode())
    return digest.hexdigest()


def _checkpoint_files(directory: Path) -> list[str]:
    return sorted(str(f.relative_to(directory)) for f in directory.rglob("*") if f.is_file() and f.name != MANIFEST)


def _fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_manifest(directory: str | Path, digests: dict[str, dict[str, Any]] | None = None) -> None:
    """Write :data:`MANIFEST` for the files in ``directory`` (``digests``: already computed ones)."""
    path = Path(directory)
    files = dict(digests) if digests is not None else {name: _digest(path / name) for name in _checkpoint_files(path)}
    body = {"format": _MANIFEST_FORMAT, "files": files, "files_checksum": _files_checksum(files)}
    with open(path / MANIFEST, "w") as f:
        json.dump(body, f, indent=1, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())
    _fsync_dir(path)


def _share(items: list[str]) -> list[str]:
    """This rank's part of ``items`` when every rank reads a slice of the checkpoint's files."""
    return items[dist.get_rank()::dist.get_world_size()]


def _seal(path: Path) -> None:
    """Collective: every rank checksums a share of the files, rank 0 writes the manifest."""
    names: list[Any] = [_checkpoint_files(path) if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(names, src=0)
    mine = {name: _digest(path / name) for name in _share(names[0])}
    parts: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(parts, mine)
    if dist.get_rank() == 0:
        write_manifest(path, {k: v for part in parts for k, v in part.items()})


def _kind(name: str) -> str:
    return "shard file" if name.endswith(".distcp") else "file"


def _check_against(path: Path, files: dict[str, Any], names: list[str]) -> str | None:
    """The first of ``names`` whose bytes differ from the manifest entry, as an error message."""
    for name in names:
        want, file = files[name], path / name
        have = file.stat().st_size if file.is_file() else None
        if have is None:
            return f"checkpoint {path} is incomplete: {_kind(name)} {name} is missing"
        if have < want["size"]:
            return f"checkpoint {path} is incomplete: {_kind(name)} {name} has {have} of {want['size']} bytes"
        if have != want["size"] or _digest(file)["xxh3_64"] != want["xxh3_64"]:
            return (f"checkpoint {path} is corrupt: {_kind(name)} {name} does not match the checksum in "
                    f"{MANIFEST} (its bytes changed after the save)")
    return None


def _verify(path: Path) -> None:
    """Collective: check every file against the manifest (each rank a share) before anything is loaded."""
    manifest = path / MANIFEST
    if not manifest.is_file():
        warnings.warn(f"checkpoint {path} has no {MANIFEST} (written before agentrl checksummed its "
                      "checkpoints): its bytes cannot be verified", stacklevel=3)
        return
    try:
        body = json.loads(manifest.read_text())
        files = body["files"]
        intact = body.get("format") == _MANIFEST_FORMAT and _files_checksum(files) == body["files_checksum"]
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise CheckpointError(f"checkpoint {path}: its {MANIFEST} is unreadable ({e})") from e
    if not intact:
        raise CheckpointError(f"checkpoint {path}: its {MANIFEST} is corrupt (its own checksum does not match)")
    problems: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(problems, _check_against(path, files, _share(sorted(files))))
    first = next((p for p in problems if p is not None), None)
    if first is not None:
        raise CheckpointError(first)


# ---------------------------------------------------------------------------------------------- directories

_RENAME_EXCHANGE = 2
_AT_FDCWD = -100


def _exchange(a: Path, b: Path) -> bool:
    """Swap two existing paths in one step (Linux ``renameat2``); False where the system cannot."""
    renameat2 = getattr(ctypes.CDLL(None, use_errno=True), "renameat2", None)
    if renameat2 is None:
        return False
    return renameat2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0


def _is_replaceable(path: Path) -> bool:
    """An empty directory or a checkpoint (complete, or an older agentrl's): never a user's other directory."""
    return path.is_dir() and (not any(path.iterdir()) or (path / MANIFEST).is_file()
                              or (path / "metadata.json").is_file())


def _prepare_temp(path: Path) -> Path:
    """Rank 0: remove what killed saves of ``path`` left, and create this save's temp sibling."""
    if path.exists() and not _is_replaceable(path):
        raise FileExistsError(f"{path} exists and is not a checkpoint: not replacing it")
    path.parent.mkdir(parents=True, exist_ok=True)
    for stale in path.parent.iterdir():
        if stale.name.startswith((path.name + _TMP, path.name + _OLD)):
            shutil.rmtree(stale, ignore_errors=True)
    tmp = path.with_name(f"{path.name}{_TMP}{os.getpid()}")
    tmp.mkdir()
    return tmp


def _move_into_place(tmp: Path, path: Path) -> None:
    """Rank 0: make the sealed ``tmp`` the checkpoint at ``path``, replacing an earlier one atomically."""
    if not path.exists():
        tmp.rename(path)
    elif _exchange(tmp, path):
        shutil.rmtree(tmp)  # now the earlier checkpoint
    else:
        # No atomic swap here: a kill between the two renames leaves no `path`, but both complete
        # checkpoints under their temp names.
        old = path.with_name(f"{path.name}{_OLD}{os.getpid()}")
        path.rename(old)
        tmp.rename(path)
        shutil.rmtree(old)
    _fsync_dir(path.parent)


def _on_rank0(fn, *args) -> Any:
    """``fn(*args)`` on rank 0, its result (or its exception, re-raised) on every rank."""
    out: list[Any] = [None]
    if dist.get_rank() == 0:
        try:
            out[0] = ("ok", fn(*args))
        except Exception as e:  # every rank must learn of it, or the others wait at the next collective
            out[0] = ("error", e)
    dist.broadcast_object_list(out, src=0)
    status, value = out[0]
    if status == "error":
        raise value
    return value


# ---------------------------------------------------------------------------------------------- save / load


def save_checkpoint(directory: str | Path, model, optimizer, scheduler, *, step: int,
                    extra_state: dict[str, Any] | None = None) -> Path:
    """Write a checkpoint of ``model`` (an unwrapped GPTModel) and its optimizer as ``directory``.

    ``directory`` appears only once complete (see the module docstring); an earlier checkpoint there is
    replaced, anything else there is a ``FileExistsError``. Collective: every rank calls it; all ranks
    must see one filesystem. Shard files are written by threads (:mod:`agentrl.trainer.threaded_save`), but
    Megatron's writer still starts a ``spawn`` multiprocessing manager once per process, which re-imports
    ``__main__``: a script that saves needs the ``if __name__ == "__main__":`` guard (otherwise Python's
    bootstrapping RuntimeError).
    """
    from megatron.core import dist_checkpointing

    path = Path(directory)
    tmp = _on_rank0(_prepare_temp, path)
    stepped = _optimizer_has_stepped(optimizer)
    with cuda_to_cpu():
        model_sd = model.sharded_state_dict()
        state: dict[str, Any] = {"model": model_sd, "rng": _rng_sharded(_rng_state())}
        if stepped:
            state["optimizer"] = _optimizer_sharded_state(optimizer, model_sd, is_loading=False)
        state["optimizer_state"] = OPTIMIZER_SAVED if stepped else OPTIMIZER_NOT_STEPPED
        state["scheduler"] = scheduler.state_dict()
        state["step"] = step
        state["extra_state"] = dict(extra_state or {})
        state["world_size"] = dist.get_world_size()  # RNG states are per rank
        try:
            dist_checkpointing.save(state, str(tmp), sharded_strategy=threaded_save_strategy())
        except CheckpointException as e:  # a BaseException: it would pass every `except Exception`
            raise OSError(f"writing checkpoint {path} failed: {e}") from e
    dist.barrier()
    _seal(tmp)
    _on_rank0(_move_into_place, tmp, path)
    return path


def _load_common(path: Path) -> dict[str, Any]:
    from megatron.core import dist_checkpointing

    if not path.is_dir():
        raise FileNotFoundError(f"checkpoint directory {path} does not exist")
    if not ((path / "metadata.json").is_file() or (path / MANIFEST).is_file()):
        raise FileNotFoundError(f"{path} is not a dist_checkpointing checkpoint (no metadata.json)")
    _verify(path)  # before metadata.json is parsed: a flipped byte there is corruption too
    try:
        is_checkpoint = dist_checkpointing.check_is_distributed_checkpoint(str(path))
    except ValueError as e:
        raise CheckpointError(f"checkpoint {path}: cannot read its metadata.json ({e})") from e
    if not is_checkpoint:
        raise FileNotFoundError(f"{path} is not a dist_checkpointing checkpoint (no metadata.json)")
    try:
        common = dist_checkpointing.load_common_state_dict(str(path))
    except Exception as e:
        raise CheckpointError(f"checkpoint {path}: cannot read its common state ({e})") from e
    missing = [k for k in _COMMON_KEYS if k not in common]
    if missing:
        raise CheckpointError(f"checkpoint {path} lacks {missing}: not written by agentrl's save_checkpoint")
    # Checkpoints written before the marker existed always held the optimizer section.
    kind = common.get("optimizer_state", OPTIMIZER_SAVED)
    if kind not in (OPTIMIZER_SAVED, OPTIMIZER_NOT_STEPPED):
        raise CheckpointError(f"checkpoint {path}: unknown optimizer_state {kind!r}")
    if kind == OPTIMIZER_SAVED and "optimizer" not in common:
        raise CheckpointError(f"checkpoint {path} says its optimizer state was saved, but it has none")
    return common


def _check_shard_files(path: Path) -> None:
    """Every byte range the checkpoint's index points at must exist (a save that died leaves them short).

    Checked before loading because the load writes into the live parameters as it reads; the one check
    of a checkpoint without a manifest.
    """
    from torch.distributed.checkpoint import FileSystemReader

    try:
        index = FileSystemReader(str(path)).read_metadata().storage_data or {}
    except Exception as e:
        raise CheckpointError(f"checkpoint {path}: cannot read its shard index (.metadata): {e}") from e
    need: dict[str, int] = {}
    for info in index.values():
        need[info.relative_path] = max(need.get(info.relative_path, 0), info.offset + info.length)
    for name, size in sorted(need.items()):
        file = path / name
        have = file.stat().st_size if file.is_file() else None
        if have is None or have < size:
            state = "is missing" if have is None else f"has {have} of {size} bytes"
            raise CheckpointError(f"checkpoint {path} is incomplete: shard file {name} {state}")


def _check_optimizer_tensors(path: Path, optimizer) -> None:
    """A clear error instead of a deep KeyError when a stateful optimizer's tensors are not in ``path``."""
    from megatron.core import dist_checkpointing

    stateful = any(p.init_state_fn is not None for p in _parts(optimizer))
    if stateful and not any(k.startswith("optimizer.") for k in dist_checkpointing.load_tensors_metadata(str(path))):
        raise CheckpointError(
            f"checkpoint {path} has no optimizer tensors, but this optimizer needs them (a checkpoint saved "
            "before the first optimizer step by an older agentrl, or a truncated one): it cannot be resumed")


def load_checkpoint(directory: str | Path, model, optimizer, scheduler) -> tuple[int, dict[str, Any]]:
    """Restore everything :func:`save_checkpoint` wrote; returns ``(step, extra_state)``.

    Raises ``FileNotFoundError`` for a missing directory or one that is no checkpoint, and
    :class:`CheckpointError` for a checkpoint that is incomplete, corrupt (a file that differs from the
    manifest, named in the message) or does not fit this trainer; all before the trainer is touched.
    """
    from megatron.core import dist_checkpointing
    from torch.distributed.checkpoint.api import CheckpointException

    path = Path(directory)
    common = _load_common(path)
    stepped = common.get("optimizer_state", OPTIMIZER_SAVED) == OPTIMIZER_SAVED
    # Per-rank RNG streams have no meaning at another world size (model and optimizer do reshard).
    same_world = common.get("world_size", dist.get_world_size()) == dist.get_world_size()
    if not same_world:
        warnings.warn(f"checkpoint {path} was saved by {common['world_size']} ranks, this run has "
                      f"{dist.get_world_size()}: keeping this run's RNG states", stacklevel=2)
    # Everything that can be checked is checked before the trainer is touched.
    _check_shard_files(path)
    if stepped:
        _check_optimizer_tensors(path, optimizer)
    with cuda_to_cpu():
        model_sd = model.sharded_state_dict()
        template: dict[str, Any] = {"model": model_sd}
        if same_world:
            template["rng"] = _rng_sharded(None)
        if stepped:
            template["optimizer"] = _optimizer_sharded_state(optimizer, model_sd, is_loading=True)
        try:
            loaded = dist_checkpointing.load(template, str(path))
        except (Exception, CheckpointException) as e:  # torch's CheckpointException is a BaseException
            raise CheckpointError(f"checkpoint {path} is corrupt or not for this model; the trainer may be "
                                  f"partly overwritten, build a new one: {e}") from e
        # no_grad: fp32 DistributedOptimizer main params are views of the model's leaf parameters.
        with torch.no_grad():
            model.load_state_dict(loaded["model"])
            if stepped:
                optimizer.load_state_dict(loaded["optimizer"])
                _unshare_steps(optimizer)
            else:
                _reset_optimizer(optimizer)
    # OptimizerParamScheduler.load_state_dict adds the saved step count to its own: start from zero, so a
    # trainer that already stepped gets the saved count (and LR), not the sum.
    scheduler.num_steps = 0
    scheduler.load_state_dict(common["scheduler"])
    if same_world:
        _set_rng_state(loaded["rng"])
    return int(common["step"]), dict(common["extra_state"])
