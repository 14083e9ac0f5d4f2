"""Disk mode: write HF safetensors to a directory (tmpfs when available), then ``/update_weights_from_disk``.

Each version goes to its own sub-directory ``<root>/<weight_version>/``; once every engine acknowledged
it, older version directories written by this sender are deleted, so tmpfs holds one copy of the model.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import weakref
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from agentrl.weights.bucket import unique_named_tensors
from agentrl.weights.engines import raise_errors
from agentrl.weights.sync import SyncReport, WeightSync, WeightSyncError, full_bytes

if TYPE_CHECKING:
    import torch

SHARD_BYTES = 4 << 30


def default_weights_root(owner: object) -> Path:
    """A fresh directory on tmpfs (``/dev/shm``) when it is writable, else in the system temp dir.

    It is removed when ``owner`` is garbage-collected or the interpreter exits, so a sender that is
    never closed does not leave a model copy in RAM-backed tmpfs.
    """
    shm = Path("/dev/shm")
    base = shm if shm.is_dir() and os.access(shm, os.W_OK) else None
    root = Path(tempfile.mkdtemp(prefix="agentrl-weights-", dir=base))
    weakref.finalize(owner, shutil.rmtree, root, ignore_errors=True)
    return root


def save_safetensors(tensors: list[tuple[str, torch.Tensor]], directory: Path, *, shard_bytes: int = SHARD_BYTES) -> int:
    """Write ``tensors`` as ``model-XXXXX.safetensors`` shards of at most ``shard_bytes``; returns bytes written.

    Written to a temporary name and renamed, so a reader never sees a half-written shard.
    """
    from safetensors.torch import save_file

    directory.mkdir(parents=True, exist_ok=True)
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, t in unique_named_tensors(tensors):
        nbytes = t.numel() * t.element_size()
        if shards[-1] and size + nbytes > shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = t.detach().contiguous().cpu()
        size += nbytes
    written = 0
    for i, shard in enumerate(shards):
        final = directory / f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        tmp = final.with_suffix(".tmp")
        save_file(shard, str(tmp), metadata={"format": "pt"})
        tmp.rename(final)
        written += final.stat().st_size
    return written


class DiskSync(WeightSync):
    """``disk`` mode. ``directory``: where versions are written (default: a fresh dir on ``/dev/shm``)."""

    mode = "disk"

    def __init__(
        self,
        engine_urls: Sequence[str],
        *,
        directory: str | Path | None = None,
        flush_cache: bool = True,
        abort_all_requests: bool = False,
        keep_old_versions: bool = False,
        timeout: float = 600.0,
        router_url: str | None = None,
    ) -> None:
        super().__init__(engine_urls, timeout=timeout, router_url=router_url)
        self._owns_root = directory is None
        self.root = Path(directory) if directory is not None else default_weights_root(self)
        self.root.mkdir(parents=True, exist_ok=True)
        self.flush_cache = flush_cache
        self.abort_all_requests = abort_all_requests
        self.keep_old_versions = keep_old_versions
        self._written: list[Path] = []

    def _push(self, tensors: list[tuple[str, torch.Tensor]], weight_version: str) -> SyncReport:
        return self.push_to(tensors, weight_version, self.engine_urls)

    def push_to(self, tensors: list[tuple[str, torch.Tensor]], weight_version: str, urls: Sequence[str]) -> SyncReport:
        """Write the version once and load it into the engines at ``urls`` (used for delta fallbacks too)."""
        directory = self.root / _safe_name(weight_version)
        if directory.exists():
            shutil.rmtree(directory)
        written = save_safetensors(tensors, directory)
        body = {
            "model_path": str(directory),
            "weight_version": weight_version,
            "flush_cache": self.flush_cache,
            "abort_all_requests": self.abort_all_requests,
        }
        try:
            raise_errors(self.engines.call_all("/update_weights_from_disk", body, urls=urls))
        except Exception as exc:
            raise WeightSyncError(f"disk sync of {weight_version!r} failed: {exc}") from exc
        self._written.append(directory)
        if not self.keep_old_versions:
            for old in self._written[:-1]:
                shutil.rmtree(old, ignore_errors=True)
            self._written = self._written[-1:]
        return SyncReport(self.mode, weight_version, written, full_bytes(tensors), 0.0, details={"path": str(directory)})

    def close(self) -> None:
        super().close()
        if self._owns_root:
            shutil.rmtree(self.root, ignore_errors=True)


def _safe_name(version: str) -> str:
    cleaned = "".join(c if c.isalnum() or c in "-_." else "_" for c in version)
    return f"v-{cleaned}"
