"""On-policy distillation's run side: only the student's sampled, trained tokens are sent for teacher targets;
a real teacher engine scores them (the student as its own teacher: a reverse KL of ~0); the config refuses a bad
teacher before Ray starts and, distilling, trains every group unless told otherwise."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from pathlib import Path

import pytest

from agentrl.run.distill import TeacherWorker, student_positions, with_teacher_logprobs
from agentrl.trainer.losses import TEACHER_LOGPROBS
from agentrl.trajectory import MODEL, TrajectoryManager, TurnRecord

CONFIG = str(Path(__file__).resolve().parents[2] / "examples" / "arithmetic" / "config.yaml")


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory) -> Path:
    from agentrl.models.tiny import make_tiny_model

    return Path(make_tiny_model(tmp_path_factory.mktemp("tiny") / "model", seed=0))


def _drifted_session():
    """Two turns; the second prompt re-renders the first reply's 68 as 69 (realigned) and adds a user turn."""
    manager = TrajectoryManager(policy="realign")
    user = {"role": "user", "content": "hi"}
    manager.record_turn("s", turn=TurnRecord([1, 87, 2], [67, 68, 2], [-0.1, -0.2, -0.3], "stop", "7"),
                        prompt_messages=[user], response_message={"role": "assistant", "content": "a"})
    manager.record_turn("s", turn=TurnRecord([1, 87, 2, 67, 69, 2, 1], [70, 2], [-0.4, -0.5], "stop", "7"),
                        prompt_messages=[user, {"role": "assistant", "content": "a"}, user],
                        response_message={"role": "assistant", "content": "b"})
    return manager.get_trajectory("s", reward=1.0)


def test_only_the_students_trained_tokens_are_asked_for() -> None:
    samples = _drifted_session()
    assert samples
    for sample in samples:
        positions = student_positions(sample)
        expected = [t for t in range(sample.response_start, len(sample.tokens))
                    if sample.provenance[t].source == MODEL and sample.loss_mask[t - sample.response_start]]
        assert positions == expected
        sources = {sample.provenance[t].source for t in range(sample.response_start, len(sample.tokens))}
        assert len(sources) > 1  # the session holds other tokens too (context, realigned), none of them asked for
        scored = with_teacher_logprobs(sample, positions, [-1.0] * len(positions))
        targets = scored.metadata[TEACHER_LOGPROBS]
        assert [t + sample.response_start for t, v in enumerate(targets) if v is not None] == positions
        assert sample.metadata.get(TEACHER_LOGPROBS) is None  # the input sample is left as it was


def _sampled_session(url: str):
    """Two turns sampled by the engine at ``url`` (T=0.7), the second prompt adding context tokens."""
    import json
    import urllib.request

    def generate(ids: list[int]) -> TurnRecord:
        body = {"input_ids": ids, "return_logprob": True,
                "sampling_params": {"temperature": 0.7, "max_new_tokens": 6, "sampling_seed": len(ids)}}
        request = urllib.request.Request(f"{url}/generate", data=json.dumps(body).encode(),
                                         headers={"content-type": "application/json"})
        with urllib.request.build_opener(urllib.request.ProxyHandler({})).open(request, timeout=60) as r:
            out = json.loads(r.read())
        lps = [lp for lp, _, _ in out["meta_info"]["output_token_logprobs"]]
        return TurnRecord(ids, out["output_ids"], lps, out["meta_info"]["finish_reason"]["type"], "0")

    manager = TrajectoryManager(policy="realign")
    first = generate([1, 40, 41, 42])
    manager.record_turn("s", turn=first, prompt_messages=[{"role": "user", "content": "q"}],
                        response_message={"role": "assistant", "content": "a"})
    second = generate([*first.prompt_ids, *first.output_ids, 1, 50, 51, 2])
    manager.record_turn("s", turn=second, prompt_messages=[{"role": "user", "content": "q"}] * 2,
                        response_message={"role": "assistant", "content": "b"})
    return manager.get_trajectory("s", reward=1.0)


def test_the_student_as_its_own_teacher_scores_its_sampled_logprobs(tiny_model_dir) -> None:
    teacher = TeacherWorker({"teacher": str(tiny_model_dir), "batch_size": 1}, 0.7)
    try:
        samples = _sampled_session(teacher.engines.urls[0]) * 2

        async def score():
            try:
                return await teacher.score(samples, {"rollout/x": 1.0})
            finally:
                await teacher.shutdown()

        scored, metrics = asyncio.run(score())
    finally:
        teacher.engines.stop()
    assert metrics["rollout/x"] == 1.0 and metrics["distill/requests"] == len(samples)
    assert metrics["distill/student_tokens"] == sum(len(student_positions(s)) for s in samples) > 0
    assert abs(metrics["distill/reverse_kl"]) < 1e-4  # same weights, same temperature: the sampler's log-probs
    for before, after in zip(samples, scored, strict=True):
        targets = after.metadata[TEACHER_LOGPROBS]
        asked = set(student_positions(before))
        assert len(asked) < len(targets)  # context tokens are in the response too, and get no target
        for j, value in enumerate(targets):
            assert (value is not None) == (j + before.response_start in asked)
            if value is not None:
                assert value == pytest.approx(before.rollout_logprobs[j], abs=1e-4)  # float32 in other orders


def test_a_bad_teacher_exits_2_before_ray(tmp_path) -> None:
    proc = subprocess.run([sys.executable, "-m", "agentrl.cli", "train", CONFIG, "--distill.teacher", str(tmp_path / "nope"),
                           "--output-dir", str(tmp_path / "run")], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert "distill.teacher" in proc.stderr and "is not a directory" in proc.stderr and "Traceback" not in proc.stderr
    assert "ray" not in proc.stderr.lower().replace("array", "")
    assert not (tmp_path / "run").exists()


def test_distilling_trains_every_group_unless_a_filter_is_set(tiny_model_dir) -> None:
    from agentrl.run.config import load_config

    teacher = ["--distill.teacher", str(tiny_model_dir)]
    assert load_config(CONFIG, teacher).group_filter == "agentrl.rollout.buffer:keep_all"
    kept = load_config(CONFIG, [*teacher, "--group_filter", "agentrl.rollout.buffer:has_reward_variance"])
    assert kept.group_filter == "agentrl.rollout.buffer:has_reward_variance"
    assert load_config(CONFIG).group_filter == "agentrl.rollout.buffer:has_reward_variance"
    with pytest.raises(ValueError, match="distill.mode"):
        load_config(CONFIG, [*teacher, "--distill.mode", "forward_kl"])
