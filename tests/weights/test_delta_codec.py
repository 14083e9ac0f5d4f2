"""The byte-wise delta codec: exact round trips, rejection of bad payloads, bounded snapshots."""

from __future__ import annotations

import json
import struct

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from agentrl.engine.delta import (
    DeltaChecksumError,
    DeltaCorruptError,
    DeltaError,
    DeltaMismatchError,
    DeltaVersionError,
    apply_delta,
    flat_bits,
    frame,
    read_delta_header,
)
from agentrl.weights.delta import Snapshot, encode_delta, encode_tensor

DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.int8]
PATTERNS = ["none", "one", "all", "clustered", "random"]
ENCODINGS = ["auto", "int32", "gap16", "gap32", "xor", "raw"]


def random_tensor(shape: tuple[int, ...], dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    if dtype == torch.int8:
        return torch.randint(-128, 128, shape, dtype=torch.int8, generator=gen)
    return (torch.randn(shape, generator=gen) * 0.05).to(dtype)


def change_mask(numel: int, pattern: str, gen: torch.Generator, fraction: float) -> torch.Tensor:
    mask = torch.zeros(numel, dtype=torch.bool)
    if pattern == "one":
        mask[int(torch.randint(numel, (1,), generator=gen))] = True
    elif pattern == "all":
        mask[:] = True
    elif pattern == "clustered":
        start = int(torch.randint(numel, (1,), generator=gen))
        mask[start : start + max(1, numel // 20)] = True
    elif pattern == "random":
        mask = torch.rand(numel, generator=gen) < fraction
    return mask


def perturb(old: torch.Tensor, mask: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    """New tensor whose bits differ from ``old`` exactly where ``mask`` is set (any bit pattern, NaNs too)."""
    new = old.clone()
    bits = flat_bits(new)
    k = int(mask.sum())
    flip = torch.randint(1, 2 ** (8 * bits.element_size() - 1) - 1, (k,), generator=gen).to(bits.dtype)
    bits[mask] = bits[mask] ^ flip
    return new


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(flat_bits(a), flat_bits(b))


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    dtype=st.sampled_from(DTYPES),
    pattern=st.sampled_from(PATTERNS),
    encoding=st.sampled_from(ENCODINGS),
    shape=st.sampled_from([(1,), (7,), (33, 65), (4, 5, 300), (70000,)]),
    fraction=st.floats(0.01, 0.10),
    seed=st.integers(0, 2**31 - 1),
)
def test_round_trip_is_bit_exact(dtype, pattern, encoding, shape, fraction, seed) -> None:
    gen = torch.Generator().manual_seed(seed)
    old = random_tensor(shape, dtype, gen)
    mask = change_mask(old.numel(), pattern, gen, fraction)
    new = perturb(old, mask, gen)
    other = random_tensor((3, 4), dtype, gen)  # an unchanged neighbour must stay untouched
    engine = {"w": old.clone(), "other": other.clone()}

    payload, stats = encode_delta(
        [("w", old, new), ("other", other, other)], base_version="v1", new_version="v2", encoding=encoding
    )
    header = apply_delta(engine, payload, base_version="v1")

    assert same_bits(engine["w"], new)
    assert same_bits(engine["other"], other)
    assert header.new_version == "v2"
    if encoding != "raw":
        assert stats.changed == int(mask.sum())
        assert {e.name for e in header.tensors} == ({"w"} if mask.any() else set())


def test_gap16_escapes_long_gaps() -> None:
    old = torch.zeros(300_000, dtype=torch.float32)
    new = old.clone()
    positions = [0, 1, 65_534, 65_535 + 65_534, 299_999]  # gaps of 65533, 65534 (escape), 65535, ...
    new[positions] = 1.0
    encoded = encode_tensor("w", old, new, "gap16")
    assert encoded.sections[1], "long gaps must go to the escape stream"
    engine = {"w": old.clone()}
    payload, _ = encode_delta([("w", old, new)], base_version="a", new_version="b", encoding="gap16")
    apply_delta(engine, payload, base_version="a")
    assert same_bits(engine["w"], new)


def test_auto_picks_xor_for_dense_and_gaps_for_sparse() -> None:
    old = torch.randn(10_000)
    assert encode_tensor("w", old, old + 1.0).entry.encoding == "xor"
    sparse = old.clone()
    sparse[::1000] += 1.0
    assert encode_tensor("w", old, sparse).entry.encoding == "gap16"


# ---------------------------------------------------------------- rejection: the engine keeps its weights


@pytest.fixture(scope="module")
def pair():
    gen = torch.Generator().manual_seed(1)
    old = {"a": random_tensor((64, 32), torch.float32, gen), "b": random_tensor((100,), torch.bfloat16, gen)}
    new = {k: perturb(v, change_mask(v.numel(), "random", gen, 0.05), gen) for k, v in old.items()}
    payload, _ = encode_delta(
        [(k, old[k], new[k]) for k in old], base_version="7", new_version="8", encoding="gap16"
    )
    return old, new, payload


def engine_copy(old: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in old.items()}


def assert_untouched(engine: dict[str, torch.Tensor], old: dict[str, torch.Tensor]) -> None:
    for k in old:
        assert same_bits(engine[k], old[k]), f"{k} was modified by a rejected delta"


@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_flipped_byte_is_rejected(pair, data) -> None:
    old, _, payload = pair
    pos = data.draw(st.integers(0, len(payload) - 1))
    bit = data.draw(st.integers(0, 7))
    bad = bytearray(payload)
    bad[pos] ^= 1 << bit
    engine = engine_copy(old)
    with pytest.raises(DeltaCorruptError):
        apply_delta(engine, bytes(bad), base_version="7")
    assert_untouched(engine, old)


@settings(max_examples=40, deadline=None)
@given(data=st.data())
def test_truncated_payload_is_rejected(pair, data) -> None:
    old, _, payload = pair
    cut = data.draw(st.integers(0, len(payload) - 1))
    engine = engine_copy(old)
    with pytest.raises(DeltaCorruptError):
        apply_delta(engine, payload[:cut], base_version="7")
    assert_untouched(engine, old)


def test_wrong_version_is_rejected(pair) -> None:
    old, _, payload = pair
    engine = engine_copy(old)
    with pytest.raises(DeltaVersionError, match="out-of-order"):
        apply_delta(engine, payload, base_version="6")
    assert_untouched(engine, old)


def test_out_of_order_second_delta_is_rejected(pair) -> None:
    old, new, payload = pair
    newer = {k: v.clone() for k, v in new.items()}
    newer["a"][0, 0] += 1
    second, _ = encode_delta([(k, new[k], newer[k]) for k in new], base_version="8", new_version="9")
    engine = engine_copy(old)
    with pytest.raises(DeltaVersionError):
        apply_delta(engine, second, base_version="7")  # 8 -> 9 arrives before 7 -> 8
    assert_untouched(engine, old)
    apply_delta(engine, payload, base_version="7")
    apply_delta(engine, second, base_version="8")
    assert all(same_bits(engine[k], newer[k]) for k in newer)


def test_wrong_base_bits_are_rejected_even_without_version(pair) -> None:
    old, _, payload = pair
    engine = engine_copy(old)
    engine["b"][3] = 123.0
    before = engine_copy(engine)
    with pytest.raises(DeltaChecksumError, match="base"):
        apply_delta(engine, payload, base_version=None)
    assert_untouched(engine, before)


@pytest.mark.parametrize(
    ("change", "error", "match"),
    [
        (lambda e: e.update(b=torch.zeros(101, dtype=torch.bfloat16)), DeltaMismatchError, "shape"),
        (lambda e: e.update(b=torch.zeros(100, dtype=torch.float16)), DeltaMismatchError, "dtype"),
        (lambda e: e.pop("b"), DeltaMismatchError, "no such tensor"),
    ],
    ids=["wrong-shape", "wrong-dtype", "unknown-name"],
)
def test_mismatched_tensors_are_rejected(pair, change, error, match) -> None:
    old, _, payload = pair
    engine = engine_copy(old)
    change(engine)
    before = engine_copy(engine)
    with pytest.raises(error, match=match):
        apply_delta(engine, payload, base_version="7")
    assert_untouched(engine, before)


def reframe(payload: bytes, edit) -> bytes:
    """Re-frame a payload after editing its header (valid framing, lying content)."""
    (hlen,) = struct.unpack("<Q", payload[8:16])
    header = json.loads(payload[16 : 16 + hlen])
    body = payload[16 + hlen + 8 : -8]
    edit(header)
    return frame(header, body)


def test_wrong_result_checksum_rolls_back_every_tensor(pair) -> None:
    old, _, payload = pair

    def lie(header):
        header["tensors"][-1]["new_xxh"] ^= 1  # the last tensor fails after the first was written

    engine = engine_copy(old)
    with pytest.raises(DeltaChecksumError, match="after applying"):
        apply_delta(engine, reframe(payload, lie), base_version="7")
    assert_untouched(engine, old)


@pytest.mark.parametrize(
    "edit",
    [
        lambda h: h["tensors"][0].update(count=h["tensors"][0]["count"] + 1),
        lambda h: h["tensors"][0].update(encoding="lz4"),
        lambda h: h.update(raw_body_len=h["raw_body_len"] + 1),
        lambda h: h.update(format=99),
        lambda h: h.pop("tensors"),
        lambda h: h["tensors"].append(dict(h["tensors"][0])),
    ],
    ids=["count", "encoding", "body-length", "format", "no-tensors", "duplicate"],
)
def test_lying_headers_are_rejected(pair, edit) -> None:
    old, _, payload = pair
    engine = engine_copy(old)
    with pytest.raises(DeltaError):
        apply_delta(engine, reframe(payload, edit), base_version="7")
    assert_untouched(engine, old)


def test_not_a_delta_is_rejected() -> None:
    with pytest.raises(DeltaCorruptError, match="magic"):
        read_delta_header(b"PK\x03\x04" + bytes(64))


# ---------------------------------------------------------------- snapshot budget


def test_snapshot_stays_within_budget_and_falls_back_to_raw() -> None:
    gen = torch.Generator().manual_seed(2)
    tensors = [(f"t{i}", random_tensor((256,), torch.float32, gen)) for i in range(4)]  # 1 KiB each
    snap = Snapshot(budget_bytes=2500)
    snap.record(tensors, "1")
    assert snap.bytes_used <= 2500
    assert [snap.get(n) is not None for n, _ in tensors] == [True, True, False, False]

    new = [(n, t + 1) for n, t in tensors]
    payload, stats = encode_delta(snap.triples(new), base_version="1", new_version="2")
    assert stats.encodings == {"xor": 2, "raw": 2}
    engine = dict(tensors)
    engine = {k: v.clone() for k, v in engine.items()}
    apply_delta(engine, payload, base_version="1")
    assert all(same_bits(engine[n], t) for n, t in new)


def test_zero_budget_snapshot_sends_everything_raw() -> None:
    snap = Snapshot(budget_bytes=0)
    t = torch.ones(10)
    snap.record([("t", t)], "1")
    assert snap.bytes_used == 0
    payload, stats = encode_delta(snap.triples([("t", t)]), base_version="1", new_version="2")
    assert stats.encodings == {"raw": 1}


def test_invalidated_snapshot_has_no_base() -> None:
    snap = Snapshot(budget_bytes=1 << 20)
    snap.record([("t", torch.ones(4))], "1")
    snap.invalidate()
    assert snap.get("t") is None and not snap.valid


def test_tied_weights_listed_twice_are_written_once() -> None:
    """XOR applied twice to shared storage would cancel out: aliases must be written once."""
    embed = torch.randn(16, 8)
    engine = {"embed.weight": embed, "lm_head.weight": embed}  # tied, like HF state_dict
    new = embed + 1.0
    payload, _ = encode_delta(
        [("embed.weight", embed.clone(), new), ("lm_head.weight", embed.clone(), new)],
        base_version="1",
        new_version="2",
        encoding="xor",
    )
    apply_delta(engine, payload, base_version="1")
    assert same_bits(engine["embed.weight"], new) and same_bits(engine["lm_head.weight"], new)


def test_tied_weights_with_different_bits_are_rejected() -> None:
    embed = torch.randn(16, 8)
    before = embed.clone()
    engine = {"embed.weight": embed, "lm_head.weight": embed}
    payload, _ = encode_delta(
        [("embed.weight", before, before + 1.0), ("lm_head.weight", before, before + 2.0)],
        base_version="1",
        new_version="2",
    )
    with pytest.raises(DeltaMismatchError, match="shares storage"):
        apply_delta(engine, payload, base_version="1")
    assert same_bits(embed, before)
