"""The ``disk`` transport: files in a directory (tmpfs when available) the engines read.

Full weights: HF safetensors shards in ``<root>/<weight_version>/`` with a checksum manifest the engine
verifies before loading (:data:`~agentrl.engine.weight_loading.CHECKSUM_MANIFEST`), loaded with
``/update_weights_from_disk``; once every engine acknowledged a version, older version directories
written by this transport are deleted, so tmpfs holds one copy of the model. Delta payloads: one file,
applied with ``/update_weights_from_delta`` and deleted right after.

Without ``directory`` the transport makes its own under ``/dev/shm`` and deletes it on ``close()``, on
garbage collection and at interpreter exit; a directory left by a process that died without any of those
(SIGKILL) is deleted by the next transport made on that host.
"""

from __future__ import annotations

import os
import re
import shutil
import tempfile
import weakref
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pydantic import Field

from agentrl.engine.weight_loading import write_checksum_manifest
from agentrl.weights.bucket import unique_named_tensors
from agentrl.weights.engines import CallResult, raise_errors
from agentrl.weights.transport import Sent, Transport, TransportOptions, WeightSyncError

if TYPE_CHECKING:
    import torch

SHARD_BYTES = 4 << 30
TEMP_PREFIX = "agentrl-weights-"
_OWNED = re.compile(re.escape(TEMP_PREFIX) + r"(\d+)-")  # the pid of the process that made the directory


class TempWeightsDir:
    """A fresh directory on tmpfs (``/dev/shm``) when it is writable, else in the system temp dir.

    :meth:`remove` deletes it (once); it also runs when ``owner`` is garbage-collected or the
    interpreter exits, so a transport that is never closed leaves no model copy in RAM-backed tmpfs.
    """

    def __init__(self, owner: object) -> None:
        shm = Path("/dev/shm")
        base = shm if shm.is_dir() and os.access(shm, os.W_OK) else Path(tempfile.gettempdir())
        remove_orphans(base)
        self.path = Path(tempfile.mkdtemp(prefix=f"{TEMP_PREFIX}{os.getpid()}-", dir=base))
        self.remove = weakref.finalize(owner, shutil.rmtree, self.path, ignore_errors=True)


def remove_orphans(base: Path) -> None:
    """Delete this library's weight directories in ``base`` whose creating process is gone."""
    for entry in base.glob(TEMP_PREFIX + "*"):
        owner = _OWNED.match(entry.name)
        if owner and entry.is_dir() and not _alive(int(owner.group(1))):
            shutil.rmtree(entry, ignore_errors=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # another user's process
    return True


def save_safetensors(tensors: list[tuple[str, torch.Tensor]], directory: Path, *, shard_bytes: int = SHARD_BYTES) -> int:
    """Write ``tensors`` as ``model-XXXXX.safetensors`` shards of at most ``shard_bytes`` plus their checksum
    manifest; returns the shards' bytes.

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
    files = []
    for i, shard in enumerate(shards):
        final = directory / f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        tmp = final.with_suffix(".tmp")
        save_file(shard, str(tmp), metadata={"format": "pt"})
        tmp.rename(final)
        files.append(final)
    write_checksum_manifest(directory, files)
    return sum(f.stat().st_size for f in files)


class DiskOptions(TransportOptions):
    """Options of the ``disk`` transport."""

    directory: Path | None = Field(None, description="where the files go, readable by every engine (a directory every node "
                                  "mounts reaches other hosts); null: a fresh one on /dev/shm, this host only")
    abort_all_requests: bool = Field(False, description="engines abort requests in flight before loading")
    keep_old_versions: bool = Field(False, description="keep every version's directory (default: the latest only)")


class DiskTransport(Transport):
    """``disk`` (see module doc)."""

    name = "disk"
    carries = frozenset({"full", "delta"})
    Options = DiskOptions
    host_local = True  # unless options.directory is shared: see reaches_other_hosts

    def __init__(self, engines: Any, options: DiskOptions | None = None, **values: Any) -> None:
        super().__init__(engines, options, **values)
        self._temp = TempWeightsDir(self) if self.options.directory is None else None
        self.root = self._temp.path if self._temp is not None else self.options.directory
        self.root.mkdir(parents=True, exist_ok=True)
        self._written: list[Path] = []

    @classmethod
    def reaches_other_hosts(cls, options: TransportOptions) -> bool:
        return getattr(options, "directory", None) is not None  # a directory the user says every engine reads

    def send_full(self, tensors: list[tuple[str, torch.Tensor]], weight_version: str, urls: Sequence[str]) -> Sent:
        directory = self.root / _safe_name(weight_version)
        if directory.exists():
            shutil.rmtree(directory)
        written = save_safetensors(tensors, directory)
        body = {
            "model_path": str(directory),
            "weight_version": weight_version,
            "flush_cache": self.options.flush_cache,
            "abort_all_requests": self.options.abort_all_requests,
        }
        try:
            raise_errors(self.engines.call_all("/update_weights_from_disk", body, urls=urls))
        except Exception as exc:
            raise WeightSyncError(f"disk sync of {weight_version!r} failed: {exc}") from exc
        self._written.append(directory)
        if not self.options.keep_old_versions:
            for old in self._written[:-1]:
                shutil.rmtree(old, ignore_errors=True)
            self._written = self._written[-1:]
        return Sent(written, list(urls), {"path": str(directory)})

    def send_delta(self, payload: bytes, body: dict[str, Any]) -> list[CallResult]:
        path = self.root / f"delta-{os.getpid()}-{id(self):x}.bin"
        tmp = path.with_suffix(".tmp")
        tmp.write_bytes(payload)
        tmp.rename(path)  # never seen half-written
        try:
            return self.engines.call_all("/update_weights_from_delta", {**body, "path": str(path)})
        finally:
            path.unlink(missing_ok=True)

    def close(self) -> None:
        if self._temp is not None:
            self._temp.remove()


def _safe_name(version: str) -> str:
    cleaned = "".join(c if c.isalnum() or c in "-_." else "_" for c in version)
    return f"v-{cleaned}"
