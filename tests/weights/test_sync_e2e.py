"""Every sync mode against real engine processes: bitwise-equal weights, versions, log-probs, fallbacks."""

from __future__ import annotations

import pytest
import torch
from weights_sync_helpers import (
    CorruptingDeltaSync,
    Trainer,
    assert_engines_equal,
    control_post,
    engine_checksum,
    generate,
)

from agentrl.weights.delta_sync import DeltaSync
from agentrl.weights.sync import WeightSyncError, make_sync

MODES = {
    "disk": {},
    "tensor": {"bucket_bytes": 1 << 20},  # three buckets for a 2.5 MB model
    "tensor-safetensors": {"transport": "safetensors", "bucket_bytes": 1 << 20},
    "broadcast": {"bucket_bytes": 1 << 20},
    "delta": {},
    "delta-broadcast": {"transport": "broadcast"},  # the delta payload over the process group
}
CHECK_AFTER = {1, 2, 10}
SYNCS = {"tensor-safetensors": 2}  # a transport variant: the 10-sync run is for the four modes
PROMPT = [1, 17, 250, 33, 9, 400, 2, 1, 61]


@pytest.mark.parametrize("case", list(MODES))
def test_engines_hold_the_trainers_bits_after_1_2_and_10_syncs(case, engine_urls, trainer: Trainer) -> None:
    mode = case.split("-")[0]
    with make_sync(mode, engine_urls, **MODES[case]) as sync:
        for k in range(1, SYNCS.get(case, 10) + 1):
            trainer.step()
            version = f"{case}-{k}"
            report = sync.sync(trainer.named_tensors(), version)
            assert report.weight_version == version and report.mode == mode
            assert report.full_bytes == sum(t.numel() * t.element_size() for _, t in trainer.named_tensors())
            assert report.bytes_sent > 0 and report.seconds > 0
            if k in CHECK_AFTER:
                assert_engines_equal(engine_urls, trainer, version)
        if mode == "delta":
            assert report.fallback is None and report.details["encodings"]
            assert report.details["transport"] == MODES[case].get("transport", "disk")

    # Tokens sampled now carry the new version, and their log-probs are the trainer's.
    for url in engine_urls:
        out = generate(url, PROMPT)
        meta = out["meta_info"]
        assert meta["weight_version"] == version
        engine_lps = [lp for lp, _, _ in meta["output_token_logprobs"]]
        local_lps = trainer.logprobs(PROMPT, out["output_ids"])
        assert torch.allclose(torch.tensor(engine_lps), torch.tensor(local_lps), atol=1e-4, rtol=0)


def test_corrupt_delta_is_rejected_and_replaced_by_a_full_sync(engine_urls, trainer: Trainer) -> None:
    with CorruptingDeltaSync(engine_urls) as sync:
        trainer.step()
        first = sync.sync(trainer.named_tensors(), "corrupt-1")
        assert "first sync" in first.fallback
        trainer.step()
        report = sync.sync(trainer.named_tensors(), "corrupt-2")
        assert "checksum" in report.fallback
        assert sorted(report.details["full_sync_engines"]) == sorted(engine_urls)
        assert_engines_equal(engine_urls, trainer, "corrupt-2")


def test_out_of_order_delta_falls_back_for_that_engine_only(engine_urls, trainer: Trainer) -> None:
    with DeltaSync(engine_urls) as sync:
        trainer.step()
        sync.sync(trainer.named_tensors(), "ooo-1")
        # Someone else moved engine 0 to another version: the next delta's base no longer matches it.
        control_post(engine_urls[0] + "/update_weight_version", {"new_version": "elsewhere"})
        trainer.step()
        report = sync.sync(trainer.named_tensors(), "ooo-2")
        assert report.details["full_sync_engines"] == [engine_urls[0]]
        assert "out-of-order" in report.fallback
        assert_engines_equal(engine_urls, trainer, "ooo-2")


def test_delta_with_a_snapshot_budget_sends_the_rest_raw(engine_urls, trainer: Trainer) -> None:
    total = sum(t.numel() * t.element_size() for _, t in trainer.named_tensors())
    with DeltaSync(engine_urls, snapshot_budget_bytes=total // 2) as sync:
        for k in (1, 2, 3):
            trainer.step()
            report = sync.sync(trainer.named_tensors(), f"budget-{k}")
            assert sync.snapshot.bytes_used <= total // 2
        assert report.fallback is None and "raw" in report.details["encodings"]
        assert_engines_equal(engine_urls, trainer, "budget-3")


def test_sparse_update_sends_a_small_delta(engine_urls, trainer: Trainer) -> None:
    """Few changed elements -> a payload far smaller than the model (bf16-like sparsity)."""
    with DeltaSync(engine_urls) as sync:
        sync.sync(trainer.named_tensors(), "sparse-1")
        with torch.no_grad():
            for _, p in trainer.model.named_parameters():
                p.view(-1)[:: max(1, p.numel() // 3)] += 0.5
        report = sync.sync(trainer.named_tensors(), "sparse-2")
        assert report.fallback is None
        assert report.bytes_sent < report.full_bytes / 50
        assert_engines_equal(engine_urls, trainer, "sparse-2")


def test_a_refused_update_raises_and_the_engine_keeps_its_weights(engine_urls, trainer: Trainer) -> None:
    with make_sync("disk", engine_urls) as sync:
        sync.sync(trainer.named_tensors(), "keep-1")
        before = [engine_checksum(u) for u in engine_urls]
        bad = [(n, t[:-1] if n.endswith("norm.weight") else t) for n, t in trainer.named_tensors()]
        with pytest.raises(WeightSyncError, match="shape"):
            sync.sync(bad, "keep-2")
        assert [engine_checksum(u) for u in engine_urls] == before


def test_unknown_mode_is_rejected(engine_urls) -> None:
    with pytest.raises(ValueError, match="unknown weight-sync mode"):
        make_sync("carrier-pigeon", engine_urls)
