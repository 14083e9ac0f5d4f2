"""The batched diff finds exactly the positions the per-tensor diff finds (GPU speed: delta_gpu_bench.py)."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from agentrl.weights.delta import DIFF_BLOCK, changed_indices, changed_indices_many, diff_many  # noqa: E402


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
    out.append((torch.zeros(1000), torch.ones(1000)))  # everything changed: full blocks count to their size
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


DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="no GPU"))]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("group_elements", [1 << 30, 2 * DIFF_BLOCK, 1])  # one group, several, one per tensor
def test_fused_diff_counts_and_masks_equal_the_per_tensor_diff(group_elements, device):
    ps = [(old.to(device), new.to(device)) for old, new in pairs()]
    base = torch.randn(DIFF_BLOCK * 3, device=device)  # a group whose tensors all fill whole blocks
    changed = base.clone()
    changed[[0, 5, DIFF_BLOCK * 3 - 1]] += 1
    aligned = [(base, changed)]
    for batch in (ps, aligned, aligned + ps):
        got = diff_many(batch, group_elements=group_elements)
        assert len(got) == len(batch)
        for (old, new), diff in zip(batch, got, strict=True):
            index = changed_indices(old, new)
            assert diff.count == index.numel() and diff.mask.dtype == torch.bool and diff.mask.numel() == new.numel()
            assert torch.equal(diff.mask.nonzero().reshape(-1), index)


def test_fused_diff_refuses_pairs_that_do_not_match():
    with pytest.raises(ValueError, match="cannot diff"):
        diff_many([(torch.zeros(3), torch.zeros(4))])
    assert diff_many([]) == []


@pytest.mark.parametrize("device", DEVICES)
def test_encoding_with_the_fused_diff_round_trips_bitwise(device):
    """encode_delta (fused diff, shuffled on the tensors' device) -> apply_delta gives the new bits."""
    from agentrl.engine.delta import apply_delta
    from agentrl.weights.delta import encode_delta

    g = torch.Generator().manual_seed(3)
    olds = {f"t{i}": (torch.randn(n, generator=g) * 10).to(dt).to(device)
            for i, (n, dt) in enumerate([(1000, torch.bfloat16), (300, torch.float32), (5000, torch.bfloat16)])}
    news = {}
    for k, (name, t) in enumerate(olds.items()):
        new = t.clone()
        new[:: (3 if k == 0 else 97)] += 1  # dense (xor) for t0, sparse (gap16) for the rest
        news[name] = new
    payload, stats = encode_delta(((n, olds[n], news[n]) for n in olds), base_version="a", new_version="b")
    assert set(stats.encodings) == {"xor", "gap16"}
    target = {n: t.clone() for n, t in olds.items()}
    apply_delta(target, payload, base_version="a")
    assert all(torch.equal(target[n].view(-1).view(torch.uint8), news[n].view(-1).view(torch.uint8)) for n in news)


@pytest.mark.parametrize("device", DEVICES)
def test_a_flat_snapshot_diffs_in_one_pass_and_its_payload_applies_bitwise(device):
    from agentrl.engine.delta import apply_delta
    from agentrl.weights.delta import Snapshot, encode_delta

    ps = [(old.to(device), new.to(device)) for old, new in pairs()]
    olds = [(f"t{i}", old) for i, (old, _) in enumerate(ps)]
    news = [(f"t{i}", new) for i, (_, new) in enumerate(ps)]
    snap = Snapshot(budget_bytes=1 << 20, device=None)
    assert snap.diffs(news) == {}  # nothing acknowledged yet
    snap.record(olds, "1")
    diffs = snap.diffs(news)
    assert set(diffs) == {n for n, _ in news}
    for (name, new), (_, old) in zip(news, olds, strict=True):
        assert diffs[name].count == changed_indices(old, new).numel()
    payload, _ = encode_delta(snap.triples(news), base_version="1", new_version="2", diffs=diffs)
    target = {n: t.clone() for n, t in olds}
    apply_delta(target, payload, base_version="1")
    assert all(torch.equal(target[n].reshape(-1).view(torch.uint8), t.reshape(-1).view(torch.uint8)) for n, t in news)
    assert snap.diffs([*news, ("extra", torch.ones(2, device=device))]) == {}  # another layout: diffed per group
    small = Snapshot(budget_bytes=100, device=None)
    small.record(olds, "1")
    assert small.diffs(news) == {}  # not everything fits the budget: no flat layout


def test_a_snapshot_on_another_device_than_its_tensors_stays_per_tensor():
    """device='meta' stands in for 'another device than the tensors' (CPU tests have one device)."""
    from agentrl.weights.delta import Snapshot

    snap = Snapshot(budget_bytes=1 << 20, device="cpu")
    named = [("a", torch.ones(4)), ("b", torch.zeros(3))]
    snap.record(named, "1")
    assert snap.diffs(named) != {}  # beside its tensors: flat
    assert not Snapshot(1 << 20, device="meta")._beside(torch.device("cpu"))
    assert Snapshot(1 << 20, device="cuda")._beside(torch.device("cuda", 0))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no GPU")
def test_the_in_place_diff_on_cuda_equals_the_staged_one():
    """On CUDA a flat snapshot diffs the live tensors in place (one Triton launch per buffer, no staging
    copy): same masks and counts as the staged comparison and the per-tensor diff, for tensors that end
    mid-chunk, span several chunks, start on an unaligned address (a view at an odd offset: the kernel's
    unvectorised variant), are empty, or are not contiguous (that diff stages instead)."""
    from agentrl.weights.delta import Snapshot
    from agentrl.weights.delta_kernel import CHUNK

    g = torch.Generator(device="cuda").manual_seed(5)
    specs = [(7, torch.bfloat16), (CHUNK, torch.bfloat16), (3 * CHUNK + 5, torch.bfloat16), (0, torch.bfloat16),
             (1000, torch.float32), (CHUNK + 1, torch.float32), (64, torch.bool)]
    olds, news = [], []
    for i, (n, dtype) in enumerate(specs):
        old = (torch.rand(n, device="cuda", generator=g) < 0.5) if dtype == torch.bool else \
            (torch.randn(n, device="cuda", generator=g) * 10).to(dtype)
        new = old.clone()
        if n:
            picks = torch.randperm(n, device="cuda", generator=g)[: max(1, n // 9)]
            new[picks] = ~new[picks] if dtype == torch.bool else new[picks] + 1
        olds.append((f"t{i}", old))
        news.append((f"t{i}", new))
    odd = torch.zeros(specs[2][0] + 1, dtype=torch.bfloat16, device="cuda")
    odd[1:] = news[2][1]
    news[2] = ("t2", odd[1:])  # contiguous, 2 bytes past an aligned address
    snap = Snapshot(budget_bytes=1 << 30, device=None)
    snap.record(olds, "1")
    expected = [changed_indices(old, new) for (_, old), (_, new) in zip(olds, news, strict=True)]
    for in_place, path in ((True, "live"), (False, "staged")):
        diffs = snap.diffs(news, in_place=in_place)
        assert snap.last_diff == path
        for (name, _), index in zip(news, expected, strict=True):
            assert diffs[name].count == index.numel()
            assert torch.equal(diffs[name].mask.nonzero().reshape(-1), index)
    strided = list(news)
    strided[4] = ("t4", torch.stack([news[4][1], news[4][1]], 1)[:, 0])
    diffs = snap.diffs(strided)
    assert snap.last_diff == "staged" and diffs["t4"].count == expected[4].numel()
