"""On-policy distillation: the student (the policy) samples, a teacher scores the student's own tokens.

``distill.teacher`` is a local HF model dir sharing the student's tokenizer; the run starts an engine pool of
its own for it (:class:`TeacherWorker`, a Ray actor). Between a batch's rollout and its training,
:meth:`Teacher.score` asks the teacher, through the engines' ``/token_logprobs`` route, for the log-prob of
exactly the tokens the trajectory's provenance marks as the student's sampled, trained tokens
(:func:`student_positions`), at the rollout temperature; every other token (prompt, tool output, realigned
text) gets no target. The targets ride in ``Sample.metadata["teacher_logprobs"]`` to the trainer, whose loss
(:func:`agentrl.trainer.losses.distill_policy_loss`) mixes the per-token reverse KL with the task reward.

The step row gets ``distill/seconds``, ``distill/student_tokens`` (tokens scored), ``distill/requests`` and
``distill/reverse_kl`` (the sampled reverse KL at sampling time: mean of rollout minus teacher log-prob) and
``distill/reverse_kl_max`` (its largest single token: the heavy tail that dominates a step's gradient).
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any, Literal

from pydantic import Field, field_validator

from agentrl.rollout.model_engines import check_model_dir
from agentrl.settings import Settings
from agentrl.trainer.losses import TEACHER_LOGPROBS, DistillLoss
from agentrl.trajectory import MODEL, Sample


class DistillSettings(Settings):
    teacher: str = Field(description="local HF model dir of the teacher (the student's tokenizer)")
    coef: float = Field(1.0, ge=0, allow_inf_nan=False, description="weight of the per-token reverse KL beside the task reward")
    reward_coef: float = Field(1.0, ge=0, allow_inf_nan=False,
                               description="weight of the task reward's advantage (0: pure distillation, the teacher alone)")
    clip: float | None = Field(None, gt=0, allow_inf_nan=False,
                               description="cap of each token's |teacher - student| log-prob gap (null: none)")
    mode: Literal["reverse_kl", "advantage"] = Field(
        "advantage", description="advantage: teacher minus student log-prob joins each token's advantage (clipped "
                                 "like it); reverse_kl: the reverse KL's gradient as a loss term of its own")
    num_engines: int = Field(1, ge=1, description="engines serving the teacher")
    batch_size: int = Field(16, ge=1, description="samples per scoring request")
    timeout_s: float = Field(300.0, gt=0, description="per scoring request")

    @field_validator("teacher")
    @classmethod
    def _teacher_is_a_model_dir(cls, path: str) -> str:
        return str(Path(check_model_dir(path, "distill.teacher")).resolve())

    def loss(self) -> DistillLoss:
        return DistillLoss(coef=self.coef, mode=self.mode, reward_coef=self.reward_coef, clip=self.clip)


def student_positions(sample: Sample) -> list[int]:
    """Positions (in ``sample.tokens``) of the tokens the student sampled and trains: model provenance and
    loss mask 1. Nothing else is sent for a teacher target."""
    start = sample.response_start
    return [t for run in sample.provenance.runs if run.source == MODEL
            for t in range(max(run.start, start), run.end) if sample.loss_mask[t - start]]


def with_teacher_logprobs(sample: Sample, positions: list[int], logprobs: list[float]) -> Sample:
    """``sample`` with ``metadata[TEACHER_LOGPROBS]``: per response token the teacher's log-prob, None elsewhere."""
    import dataclasses

    targets: list[float | None] = [None] * (len(sample.tokens) - sample.response_start)
    for t, lp in zip(positions, logprobs, strict=True):
        targets[t - sample.response_start] = lp
    return dataclasses.replace(sample, metadata={**sample.metadata, TEACHER_LOGPROBS: targets})


class TeacherWorker:
    """The teacher's engines (a Ray actor): scores batches of samples."""

    def __init__(self, settings: dict[str, Any], temperature: float, *, dtype: str = "float32",
                 log_dir: str | None = None) -> None:
        from agentrl.rollout.model_engines import ModelEngines

        self.settings = DistillSettings.model_validate(settings)
        self.temperature = temperature if temperature > 0 else 1.0  # greedy rollouts: the plain distribution
        self.engines = ModelEngines(self.settings.teacher, count=self.settings.num_engines, dtype=dtype,
                                    log_dir=log_dir).start()
        self._session: Any = None

    async def score(self, samples: list[Sample], metrics: dict[str, float]) -> tuple[list[Sample], dict[str, float]]:
        """``samples`` with teacher targets on their student tokens, and ``metrics`` with ``distill/*`` added."""
        import aiohttp

        started = time.perf_counter()
        if self._session is None:
            self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=self.settings.timeout_s))
        positions = [student_positions(s) for s in samples]
        n = self.settings.batch_size
        chunks = [list(range(i, min(i + n, len(samples)))) for i in range(0, len(samples), n)]
        urls = self.engines.urls
        answers = await asyncio.gather(*(self._request(urls[c % len(urls)], [samples[i] for i in chunk],
                                                       [positions[i] for i in chunk]) for c, chunk in enumerate(chunks)))
        teacher = [lp for answer in answers for lp in answer]
        scored = [with_teacher_logprobs(s, p, lp) for s, p, lp in zip(samples, positions, teacher, strict=True)]
        gaps = [s.rollout_logprobs[t - s.response_start] - lp for s, p, lps in zip(samples, positions, teacher, strict=True)
                if s.rollout_logprobs for t, lp in zip(p, lps, strict=True)]
        return scored, {**metrics, "distill/seconds": time.perf_counter() - started,
                        "distill/student_tokens": float(sum(map(len, positions))), "distill/requests": float(len(chunks)),
                        "distill/reverse_kl": sum(gaps) / len(gaps) if gaps else 0.0,
                        "distill/reverse_kl_max": max(gaps, default=0.0)}

    async def _request(self, url: str, samples: list[Sample], positions: list[list[int]]) -> list[list[float]]:
        body = {"input_ids": [list(s.tokens) for s in samples], "positions": positions, "temperature": self.temperature}
        async with self._session.post(f"{url}/token_logprobs", json=body) as response:
            if response.status != 200:
                raise RuntimeError(f"the teacher at {url} refused a scoring request: HTTP {response.status}: "
                                   f"{(await response.text())[:300]}")
            return (await response.json())["logprobs"]

    async def shutdown(self) -> None:
        if self._session is not None:
            await self._session.close()
        self.engines.stop()


def check_same_tokenizer(teacher: str, student: str | Path) -> None:
    """A ``ValueError`` unless the teacher's and the student's ``tokenizer.json`` map the same tokens to the same
    ids (a saved copy may differ in bytes: the ids must mean the same)."""
    from tokenizers import Tokenizer

    a, b = Path(teacher) / "tokenizer.json", Path(student) / "tokenizer.json"
    if not (a.is_file() and b.is_file()):
        return
    if Tokenizer.from_file(str(a)).get_vocab(True) != Tokenizer.from_file(str(b)).get_vocab(True):
        raise ValueError(f"distill.teacher {teacher} has another vocabulary than the student {student}: "
                         "teacher log-probs of the student's token ids would mean nothing")


class Teacher:
    """The driver's side: the teacher actor, and the trainer ranks told how to distill."""

    def __init__(self, actor: Any) -> None:
        self.actor = actor

    @classmethod
    def start(cls, cfg: Any, student_dir: str | Path, trainers: list[Any], log_dir: str | Path) -> Teacher | None:
        """None without ``cfg.distill``; else start the teacher's engines (on this node) and configure the ranks."""
        import ray

        from agentrl.run import placement
        from agentrl.run.actors import remote

        if cfg.distill is None:
            return None
        check_same_tokenizer(cfg.distill.teacher, student_dir)
        actor = remote(TeacherWorker, num_cpus=0).options(**placement.on_this_node()).remote(
            cfg.distill.model_dump(), cfg.rollout.temperature, dtype=cfg.trainer.dtype, log_dir=str(log_dir))
        ray.get([t.configure_distill.remote(cfg.distill.loss()) for t in trainers])
        return cls(actor)

    def score(self, batch: Any) -> Any:
        """``batch`` (a :class:`~agentrl.run.session.PendingBatch`) with its samples scored by the teacher."""
        samples, metrics = self.actor.score.options(num_returns=2).remote(batch.samples, batch.metrics)
        return type(batch)(batch.step, samples, metrics, batch.examples)

    def shutdown(self) -> Any:
        return self.actor.shutdown.remote()
