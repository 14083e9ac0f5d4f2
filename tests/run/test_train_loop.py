"""`agentrl train` end to end at toy size: warm-up, engines behind smg, GRPO on Megatron, weight sync every
step, evaluation rows, checkpoints and --resume."""

from __future__ import annotations

import json

import pytest

from agentrl.run.cli import main

pytestmark = pytest.mark.timeout(600)


def rows(out) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def test_train_runs_the_real_loop_then_resumes(tmp_path, arith_first_run) -> None:
    # the first run (2 steps from an empty cache) is conftest.py's arith_first_run; its cache is shared
    out, cache, small = arith_first_run["out"], arith_first_run["cache"], arith_first_run["small"]
    config = "examples/arithmetic/config.yaml"
    first = rows(out)
    warmup = [r for r in first if "warmup_step" in r]
    assert [r["warmup_step"] for r in warmup if "warmup_check_accuracy" in r][:2] == [2, 4]
    assert warmup[-1]["warmup_step"] == 4 and "eval_accuracy" in warmup[-1]  # max_steps ends with a real eval
    steps = [r for r in first if "step" in r]
    assert [r["step"] for r in steps] == [0, 1, 2]
    assert "eval_accuracy" in steps[0] and steps[0]["model_dir"].startswith(str(cache))
    assert "eval_accuracy" in steps[2]
    for r in steps[1:]:
        assert r["rollout/episodes"] == 8 and r["rollout/unproven_trained_tokens"] == 0
        assert r["verify/samples"] >= 8 and r["verify/refused"] == 0 and r["verify/seconds"] >= 0
        assert r["sync/bytes_sent"] > 0 and r["sync/full_bytes"] > 0
    assert (out / "reward_curve.png").stat().st_size > 0
    assert list((out / "logs").glob("engine-*.log")) and list((out / "logs").glob("router-*.log"))
    assert (out / "checkpoints" / "latest").read_text().strip() == "step-2"
    assert sorted(p.name for p in (out / "checkpoints").glob("step-*")) == ["step-0", "step-2"]  # keeps 2

    assert main([config, "--output-dir", str(out), "--steps", "3", "--resume", *small]) == 0
    resumed = rows(out)
    assert resumed[: len(first)] == first  # appended, nothing rewritten
    new = resumed[len(first):]
    assert [r["step"] for r in new] == [3] and "eval_accuracy" in new[0]  # the last step always evaluates
    assert not any("warmup_step" in r for r in new)  # the cached warm model, no second warm-up
    assert (out / "checkpoints" / "latest").read_text().strip() == "step-3"

    # The model comes out: the final and best policies as HF dirs, and `agentrl export` of a checkpoint,
    # which loads in transformers and serves the checkpoint's own held-out accuracy.
    import asyncio

    import torch
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from agentrl.cli import main as agentrl
    from agentrl.envs.arithmetic import ArithmeticToolEnv
    from agentrl.rollout.manager import RolloutManager
    from agentrl.run.config import load_config

    best = json.loads((out / "hf" / "best" / "agentrl_step.json").read_text())
    scored = [r for r in resumed if "step" in r and "eval_accuracy" in r]
    assert best["eval_accuracy"] == max(r["eval_accuracy"] for r in scored)
    assert (out / "checkpoints" / f"step-{best['step']}").is_dir()  # kept besides the latest two
    exported = tmp_path / "exported"
    assert agentrl(["export", str(out / "checkpoints" / "step-3"), str(exported)]) == 0
    got, final = load_file(str(exported / "model.safetensors")), load_file(str(out / "hf" / "final" / "model.safetensors"))
    assert got.keys() == final.keys() and all(torch.equal(got[k], final[k]) for k in got)  # bytes of one policy
    AutoModelForCausalLM.from_pretrained(exported)
    cfg = load_config(config, small)
    heldout = cfg.task_source()

    with RolloutManager(exported, ArithmeticToolEnv, cfg.rollout) as manager:
        accuracy = asyncio.run(manager.evaluate(heldout.heldout(cfg.eval.num_tasks)))["eval_accuracy"]
    assert accuracy == new[0]["eval_accuracy"]

    # A few whole rollouts per step, readable with `agentrl dump`.
    import subprocess
    import sys

    step_file = out / "samples" / "step-1.jsonl"
    shown = [json.loads(line) for line in step_file.read_text().splitlines()]
    assert 1 <= len(shown) <= 4 and all(r["metadata"]["messages"][0]["role"] in ("system", "user") for r in shown)
    assert all("reward_components" in r["metadata"] and r["metadata"]["stop_reason"] for r in shown)
    dumped = subprocess.run([sys.executable, "-m", "agentrl.cli", "dump", str(step_file), "--runs"],
                            capture_output=True, text=True, timeout=60)
    assert dumped.returncode == 0 and "[user]" in dumped.stdout and "[assistant]" in dumped.stdout

    # TensorBoard events in every run: reward, accuracy and timing, each step once across the resume.
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(out / "tensorboard"))
    events.Reload()
    tags = set(events.Tags()["scalars"])
    assert {"rollout/reward_mean", "eval_accuracy", "train/seconds", "rollout/seconds", "sync/seconds"} <= tags
    assert [e.step for e in events.Scalars("rollout/reward_mean")] == [1, 2, 3]
    assert "samples" in events.Tags()["tensors"] or "samples/text_summary" in events.Tags()["tensors"]
