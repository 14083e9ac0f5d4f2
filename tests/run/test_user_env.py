"""A user's own environment and task function, with the defaults (no task kwargs, no expert, so no
warm-up), trains through `agentrl train`: the defaults do not come from the arithmetic demo."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(600)

USER_MODULE = '''
import random
from agentrl.envs import Environment, tool


class Shout(Environment):
    max_turns = 2

    def reset(self, task):
        self.said = None
        return [{"role": "user", "content": "Say " + task["word"] + "."}]

    @tool
    def say(self, word: str) -> str:
        """Say a word.

        Args:
            word: the word.
        """
        self.said, self.done = word, True
        return "ok"

    def reward(self):
        return float(self.said == self.task["word"])


def tasks(n, *, seed, split):
    rng = random.Random(f"{split}-{seed}")
    return [{"word": rng.choice(["red", "blue", "green"])} for _ in range(n)]
'''


def test_a_user_env_with_the_defaults_trains(tmp_path: Path) -> None:
    (tmp_path / "user_shout.py").write_text(USER_MODULE)
    out = tmp_path / "run"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run(
        [sys.executable, "-m", "agentrl.cli", "train", "--env", "user_shout:Shout", "--tasks", "user_shout:tasks",
         "--output-dir", str(out), "--cache_dir", str(tmp_path / "cache"), "--steps", "1",
         "--rollout.num_engines", "1", "--rollout.prompts_per_step", "2", "--rollout.samples_per_prompt", "2",
         "--rollout.max_new_tokens", "8", "--eval.num_tasks", "4"],
        capture_output=True, text=True, timeout=500, env=env, cwd=Path(__file__).resolve().parents[2])
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert not any("warmup_step" in r for r in rows)  # no expert configured: no warm-up
    assert [r["step"] for r in rows] == [0, 1] and rows[1]["rollout/episodes"] == 4


def test_tasks_from_a_jsonl_file_train_and_resume(tmp_path: Path) -> None:
    data = tmp_path / "sums.jsonl"
    data.write_text("".join(json.dumps({"x": a, "y": b, "sum": a + b}) + "\n" for a in range(10, 20) for b in (31, 47)))
    out = tmp_path / "run"
    args = [sys.executable, "-m", "agentrl.cli", "train", "--tasks", str(data), "--data.fields",
            '{"a": "x", "b": "y", "answer": "sum"}', "--output-dir", str(out), "--cache_dir", str(tmp_path / "cache"),
            "--rollout.num_engines", "1", "--rollout.prompts_per_step", "2", "--rollout.samples_per_prompt", "2",
            "--rollout.max_new_tokens", "8", "--eval.num_tasks", "2", "--eval.every", "1"]
    repo = Path(__file__).resolve().parents[2]
    first = subprocess.run([*args, "--steps", "1"], capture_output=True, text=True, timeout=500, cwd=repo)
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
    again = subprocess.run([*args, "--steps", "2", "--resume"], capture_output=True, text=True, timeout=500, cwd=repo)
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1, 2] and rows[2]["rollout/episodes"] == 4
