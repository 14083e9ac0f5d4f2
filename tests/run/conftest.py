"""Shared by the arithmetic example's end-to-end runs: one warm-up for the session.

``arith_first_run`` is test_train_loop.py's first ``agentrl train`` (warm-up, then two GRPO steps); its
cache (the tiny base and the warm model) is also test_async_loops.py's, whose warm-up settings match, so
the suite warms up once instead of twice. test_train_loop.py asserts what that run wrote.
"""

from __future__ import annotations

import pytest

ARITH_CONFIG = "examples/arithmetic/config.yaml"


def arith_small(cache) -> list[str]:
    """test_train_loop.py's toy-size settings (the warm-up ones are also test_async_loops.py's)."""
    return ["--cache_dir", str(cache), "--warmup.max_steps", "4", "--warmup.check_every", "2",
            "--warmup.num_conversations", "64", "--rollout.num_engines", "1", "--rollout.prompts_per_step", "2",
            "--rollout.samples_per_prompt", "4", "--rollout.max_new_tokens", "16", "--eval.every", "2",
            "--eval.num_tasks", "8", "--sync_options", '{"transport": "broadcast"}']


@pytest.fixture(scope="session")
def arith_first_run(tmp_path_factory) -> dict:
    """``{"out", "cache", "small"}`` after ``agentrl train`` of the arithmetic example for 2 steps from an
    empty cache (so it warms up)."""
    from agentrl.run.cli import main

    root = tmp_path_factory.mktemp("arith")
    out, cache = root / "run", root / "cache"
    small = arith_small(cache)
    assert main([ARITH_CONFIG, "--output-dir", str(out), "--steps", "2", *small]) == 0
    return {"out": out, "cache": cache, "small": small}
