"""Megatron's ``torch_dist`` checkpoint save, with the shard files written by threads of this process.

Megatron's writer (``FileSystemWriterAsync.write_preloaded_data_multiproc``) ``fork``s one process per
shard file. A trainer process has threads of its own (Ray's, a tracker's, OpenTelemetry's); a child forked
while one of them holds a lock it later needs waits forever, and the save waits with it (seen once in CI: a
save that never returned). Writing the same buckets with the same function from threads forks nothing and
produces the same files, results and metadata.

Megatron also hands the write results back through a ``multiprocessing`` Manager queue that it starts with
``spawn`` on the first save: a server process that imports the trainer's main module (~2 s of the first
checkpoint on 2 cores, inside a run's clock) and outlives the save. The threads share memory, so their
results go through a plain ``queue.Queue`` and no process is started at all.
"""

from __future__ import annotations

import queue
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from typing import Any


def threaded_save_strategy(thread_count: int = 2):
    """A ``TorchDistSaveShardedStrategy`` whose writes run in ``thread_count`` threads, for ``dist_checkpointing.save``."""
    from megatron.core.dist_checkpointing.strategies.async_utils import AsyncRequest
    from megatron.core.dist_checkpointing.strategies.torch import TorchDistSaveShardedStrategy

    class ThreadedTorchDistSave(TorchDistSaveShardedStrategy):
        def async_save(self, sharded_state_dict, checkpoint_dir) -> AsyncRequest:
            with _in_process_results_queue():
                return super().async_save(sharded_state_dict, checkpoint_dir)

        def _get_save_and_finalize_callbacks(self, writer, save_state_dict_ret) -> AsyncRequest:
            request = super()._get_save_and_finalize_callbacks(writer, save_state_dict_ret)
            if request.async_fn is None:  # nothing to write on this rank
                return request
            transforms = [writer.transforms] if hasattr(writer, "transforms") else []
            return request._replace(async_fn=lambda rank, buckets, results: _write_buckets(transforms, buckets, results))

    return ThreadedTorchDistSave("torch_dist", 1, thread_count=thread_count)


@contextmanager
def _in_process_results_queue() -> Iterator[None]:
    """While Megatron plans a save, its writer takes a ``queue.Queue`` for the write results instead of
    its spawned Manager's queue. Swapped for the call only: Megatron's forking writer still needs its own."""
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    manager_queue = filesystem_async._get_write_results_queue
    filesystem_async._get_write_results_queue = queue.Queue
    try:
        yield
    finally:
        filesystem_async._get_write_results_queue = manager_queue


def _write_buckets(transforms: list, buckets: list, results: Any) -> None:
    """Megatron's per-bucket writer on a thread each; puts ``{bucket: write results}`` (or the first error) on ``results``."""
    from megatron.core.dist_checkpointing.strategies.filesystem_async import FileSystemWriterAsync

    def write(index: int, bucket) -> tuple[int, Any]:
        out: queue.Queue = queue.Queue()
        done: queue.Queue = queue.Queue()
        done.put(index)  # the writer takes one item and marks it done when it finishes
        FileSystemWriterAsync.write_preloaded_data(transforms, index, bucket, out, done, use_fsync=True)
        return out.get_nowait()

    with ThreadPoolExecutor(max_workers=max(1, len(buckets)), thread_name_prefix="ckpt-write") as pool:
        written = list(pool.map(write, range(len(buckets)), buckets))
    errors = [r for _, r in written if isinstance(r, Exception)]
    results.put(errors[0] if errors else dict(written))
