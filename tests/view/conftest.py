"""A small run directory written the way a run writes one (SampleLog, MetricsLog, checkpoints, hf/final),
with samples of real multi-turn tool episodes (the trajectory demo's tiny tokenizer and ChatML template),
clean and drifting, under the realign and truncate policies."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "trajectory"))  # real_tokenizers

from real_tokenizers import ASSETS, tiny_tokenizer  # noqa: E402

from agentrl.run.bookkeeping import MetricsLog, SampleLog  # noqa: E402
from agentrl.trajectory import TrajectoryManager  # noqa: E402
from agentrl.trajectory.demo import CLEAN_EPISODE, DRIFT_EPISODE, QUESTION, SYSTEM, play  # noqa: E402


class DemoTokenizer:
    """What ``agentrl.trajectory.demo.play`` needs, on the fast test tokenizer."""

    def __init__(self) -> None:
        self.tok = tiny_tokenizer()
        self.eos_id = self.tok.eos_id
        self.encode = self.tok.encode
        self.prompt_ids = self.tok.prompt_ids

    def decode_one(self, token: int) -> str:
        return self.tok.decode([token])


def episode_rows(tok: DemoTokenizer, step: int) -> list[dict]:
    """Sample dicts as SampleLog writes them: the chat, stop reason and reward components in metadata."""
    rows = []
    for name, policy, episode, reward in (("clean", "realign", CLEAN_EPISODE, 1.0),
                                          ("drift", "realign", DRIFT_EPISODE, float(step % 2)),
                                          ("cut", "truncate", DRIFT_EPISODE, 0.5)):
        manager = TrajectoryManager(policy=policy)
        session = f"{name}-{step}"
        play(manager, tok, session, episode)
        sample = manager.get_trajectory(session, reward=reward, group_id=name)[0]
        row = sample.to_dict()
        messages = [SYSTEM, QUESTION] + [m for _, message, then in episode for m in (message, *then)]
        row["metadata"] = {**row["metadata"], "messages": messages, "stop_reason": "no_tool_call",
                           "reward_components": {"correct": reward}}
        rows.append(row)
    return rows


@pytest.fixture(scope="session")
def demo_tokenizer() -> DemoTokenizer:
    return DemoTokenizer()


@pytest.fixture(scope="session")
def run_dir(tmp_path_factory, demo_tokenizer) -> Path:
    out = tmp_path_factory.mktemp("view") / "run"
    out.mkdir()
    log = MetricsLog(out / "metrics.jsonl")
    samples = SampleLog(out / "samples")
    log.write({"step": 0, "eval_accuracy": 0.25})
    for step in (1, 2):
        samples.write(step, episode_rows(demo_tokenizer, step))
        log.write({"step": step, "rollout/reward_mean": 0.3 * step, "eval_accuracy": 0.25 + 0.2 * step})
    for step in (0, 2):
        (out / "checkpoints" / f"step-{step}").mkdir(parents=True)
    (out / "checkpoints" / "latest").write_text("step-2")
    (out / "hf" / "final").mkdir(parents=True)
    shutil.copy(ASSETS / "tokenizer.json", out / "hf" / "final" / "tokenizer.json")
    return out


def read_rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
