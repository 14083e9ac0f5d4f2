"""The batched diff finds exactly the positions the per-tensor diff finds (GPU speed: delta_gpu_bench.py)."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from agentrl.weights.delta import changed_indices, changed_indices_many  # noqa: E402


def pairs():
    g = torch.Generator().manual_seed(0)
    out = []
    for shape, dtype in [((7, 5), torch.bfloat16), ((0,), torch.float32), ((300,), torch.float32), ((4, 4), torch.bool),
                         ((9,), torch.int64), ((50, 3), torch.bfloat16)]:
        old = (torch.rand(shape, generator=g) < 0.5) if dtype == torch.bool else (torch.randn(shape, generator=g) * 100).to(dtype)
        new = old.clone()
        flat = new.view(-1)
        if flat.numel():
            picks = torch.randperm(flat.numel(), generator=g)[: max(1, flat.numel() // 10)]
            flat[picks] = ~flat[picks] if dtype == torch.bool else flat[picks] + 1
        out.append((old, new))
    out.append((torch.ones(6), torch.ones(6)))  # nothing changed
    return out


@pytest.mark.parametrize("group_elements", [1 << 30, 64, 1])  # one group, several, a group per tensor
def test_batched_diff_equals_the_per_tensor_diff(group_elements):
    ps = pairs()
    got = changed_indices_many(ps, group_elements=group_elements)
    assert len(got) == len(ps)
    for (old, new), index in zip(ps, got, strict=True):
        assert torch.equal(index, changed_indices(old, new)) and index.dtype == torch.int64


def test_batched_diff_refuses_pairs_that_do_not_match():
    with pytest.raises(ValueError, match="cannot diff"):
        changed_indices_many([(torch.zeros(3), torch.zeros(4))])
    assert changed_indices_many([]) == []
