"""CUDA IPC pickling by GPU UUID: CPU tensors unchanged, an unseen GPU a clear error (GPU path: benchmarks/gpu_sync_check.py)."""

from __future__ import annotations

from multiprocessing.reduction import ForkingPickler

import pytest

torch = pytest.importorskip("torch")

from agentrl.engine.cuda_ipc import dumps, rebuild_cuda_tensor_by_uuid  # noqa: E402


def test_cpu_tensors_round_trip_through_shared_memory():
    import torch.multiprocessing as mp

    mp.set_sharing_strategy("file_system")
    items = [("w", torch.arange(12, dtype=torch.float32).reshape(3, 4)), ("b", torch.ones(3, dtype=torch.bfloat16))]
    back = ForkingPickler.loads(dumps(items))
    assert [n for n, _ in back] == ["w", "b"]
    assert all(torch.equal(a, b) and a.dtype == b.dtype for (_, a), (_, b) in zip(items, back, strict=True))


def test_a_gpu_this_process_cannot_see_is_a_clear_error():
    args = [None] * 15
    args[6] = "GPU-00000000-0000-0000-0000-000000000000"
    with pytest.raises(RuntimeError, match="does not see.*CUDA_VISIBLE_DEVICES"):
        rebuild_cuda_tensor_by_uuid(*args)
