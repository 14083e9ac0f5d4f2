"""The fused ops' compiled functions (fused_ops.py) past dynamo's recompile limit: they run eagerly instead of
raising (CPU, dynamo's eager backend: the limit is dynamo's, whatever compiles the graphs)."""

from __future__ import annotations

import logging

import pytest
import torch

from agentrl.engine.fused_ops import compiled_or_eager


def _inputs() -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Three dtypes: each needs its own graph."""
    return [(torch.arange(6, dtype=dtype).view(2, 3), torch.full((3,), 3, dtype=dtype))
            for dtype in (torch.float32, torch.float64, torch.int64)]


def test_an_op_past_the_recompile_limit_runs_eagerly_with_the_same_result(monkeypatch, caplog) -> None:
    monkeypatch.setattr(torch._dynamo.config, "recompile_limit", 1)

    def plain(x, w):  # its own code object: dynamo's graphs are cached per code object
        return x * w + 1

    raw = torch.compile(plain, dynamic=True, fullgraph=True, backend="eager")
    raw(*_inputs()[0])
    with pytest.raises(torch._dynamo.exc.FailOnRecompileLimitHit):  # what the fused ops met before
        raw(*_inputs()[1])

    def fused(x, w):
        return x * w + 1

    op = compiled_or_eager(fused, backend="eager")
    with caplog.at_level(logging.WARNING, logger="agentrl.engine.fused_ops"):
        for x, w in _inputs() * 2:
            out = op(x, w)
            assert out.dtype == x.dtype and torch.equal(out, x * w + 1)
    warnings = [r for r in caplog.records if "recompile limit" in r.getMessage()]
    assert len(warnings) == 1 and "fused" in warnings[0].getMessage()
