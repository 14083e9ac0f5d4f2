"""Flattened per-dtype buckets: bounded size, dtype-pure, exact unflatten."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from agentrl.weights.bucket import BucketEntry, make_buckets, unflatten, unique_named_tensors

DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.int8]


@settings(max_examples=60, deadline=None)
@given(
    specs=st.lists(
        st.tuples(st.sampled_from(DTYPES), st.lists(st.integers(0, 40), min_size=0, max_size=3)),
        min_size=0,
        max_size=20,
    ),
    bucket_bytes=st.integers(1, 4096),
)
def test_buckets_round_trip_and_respect_the_size(specs, bucket_bytes) -> None:
    tensors = [(f"t{i}", torch.randn(shape).to(dtype)) for i, (dtype, shape) in enumerate(specs)]
    buckets = list(make_buckets(tensors, bucket_bytes=bucket_bytes))

    got = {}
    for b in buckets:
        assert len({b.flat.dtype}) == 1
        # Only a single oversized tensor may exceed the bucket size.
        assert b.nbytes <= bucket_bytes or len(b.entries) == 1
        meta_entries = [BucketEntry.from_json(e) for e in b.metadata()["entries"]]
        for name, t in unflatten(b.flat, meta_entries):
            got[name] = t
    assert set(got) == {n for n, _ in tensors}
    for name, t in tensors:
        assert got[name].dtype == t.dtype and got[name].shape == t.shape and torch.equal(got[name], t)
    # Order within one dtype is kept.
    for dtype in DTYPES:
        sent = [n for n, t in tensors if t.dtype == dtype]
        received = [e.name for b in buckets if b.flat.dtype == dtype for e in b.entries]
        assert received == sent


def test_unflatten_rejects_entries_outside_the_bucket() -> None:
    with pytest.raises(ValueError, match="outside a bucket"):
        unflatten(torch.zeros(10), [BucketEntry("x", (4, 3), 0, 12)])


def test_non_positive_bucket_size_is_rejected() -> None:
    with pytest.raises(ValueError, match="positive"):
        list(make_buckets([("a", torch.zeros(2))], bucket_bytes=0))


def test_unique_named_tensors_drops_tied_aliases() -> None:
    embed = torch.randn(4, 4)
    kept = unique_named_tensors([("embed", embed), ("other", torch.randn(4, 4)), ("lm_head", embed)])
    assert [n for n, _ in kept] == ["embed", "other"]
