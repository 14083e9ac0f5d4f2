"""`agentrl train` with an environment whose every episode fails the same way (it reads a task key no
task has, and declares no task_fields) stops after ALL_FAILED_STEPS steps with that error, exit 1."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from agentrl.run.failure_watch import ALL_FAILED_STEPS

pytestmark = pytest.mark.timeout(600)

USER_MODULE = '''
from agentrl.envs import Environment, tool


class Unanswerable(Environment):
    max_turns = 1

    def reset(self, task):
        return [{"role": "user", "content": "Say " + task["word"] + "."}]

    @tool
    def say(self, word: str) -> str:
        """Say a word.

        Args:
            word: the word.
        """
        self.done = True
        return "ok"

    def reward(self):
        return float(self.task["answer"] == 1)  # no task has an answer: every episode raises KeyError


def tasks(n, *, seed, split):
    return [{"word": "red"} for _ in range(n)]
'''


def test_a_run_whose_episodes_all_fail_stops_with_the_error(tmp_path: Path) -> None:
    (tmp_path / "user_unanswerable.py").write_text(USER_MODULE)
    out = tmp_path / "run"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run(
        [sys.executable, "-m", "agentrl.cli", "train", "--env", "user_unanswerable:Unanswerable", "--tasks",
         "user_unanswerable:tasks", "--output-dir", str(out), "--cache_dir", str(tmp_path / "cache"), "--steps", "20",
         "--rollout.num_engines", "1", "--rollout.prompts_per_step", "2", "--rollout.samples_per_prompt", "2",
         "--rollout.max_new_tokens", "8", "--eval.num_tasks", "2", "--eval.every", "100"],
        capture_output=True, text=True, timeout=500, env=env, cwd=Path(__file__).resolve().parents[2])
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert f"every episode of steps 1-{ALL_FAILED_STEPS} failed with KeyError" in proc.stderr
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    trained = [r for r in rows if r.get("step", 0) > 0]
    assert [r["step"] for r in trained] == list(range(1, ALL_FAILED_STEPS + 1))
    assert all(r["rollout/failure_reasons/KeyError"] == r["rollout/episodes"] == 4 for r in trained)
