"""``rollout.judge``: a generative reward model on engines of the run scores each finished episode.

The judge is the policy's own engines (``model`` unset: their current weights) or engines of another local
model dir that the rollout manager starts and stops. Each finished episode's judge prompt (``prompt_template``
filled with the task, the conversation and the final answer, in the judge's chat template) waits up to
``batch_wait_ms`` for others; up to ``batch_size`` prompts go to one engine in one batched greedy
``/generate``. The reply's verdict (``pass_fail``: PASS -> 1, FAIL -> 0; ``score``: a number in
``[score_min, score_max]``) joins the environment's reward components under ``name``. No verdict in the
reply, an engine error or ``timeout_s`` passing raises :class:`JudgeError`: the episode fails, is counted
(``rollout/failure_reasons/JudgeError``) and dropped, never given a made-up reward. The judge's prompt and
reply go through their own HTTP session, never through the trajectory recorder, so no judge token is trained.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import re
import string
from collections.abc import Callable, Mapping
from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from agentrl.envs.environment import Environment, maybe_await
from agentrl.settings import Settings
from agentrl.trajectory.sample import REWARD_LIMIT

TEMPLATE_FIELDS = ("task", "conversation", "answer")
DEFAULT_TEMPLATE = ("Grade the assistant's final answer to the task.\nTask: {task}\nConversation:\n{conversation}\n"
                    "Final answer: {answer}\nReply with PASS if the final answer is correct, otherwise FAIL.")
DEFAULT_PATTERNS = {"pass_fail": r"\b(PASS|FAIL)\b", "score": r"(?i)score\s*[:=]?\s*(-?\d+(?:\.\d+)?)"}


class JudgeError(RuntimeError):
    """The judge gave no usable verdict for an episode."""


class JudgeSettings(Settings):
    model: str | None = Field(None, description="local HF model dir of the judge's own engines; null: the policy's engines")
    num_engines: int = Field(1, ge=1, description="engines started for model (unused without it)")
    engine_args: list[str] = Field(default_factory=list, description="extra flags of the judge's engines")
    prompt_template: str = Field(DEFAULT_TEMPLATE, description="the judge's user message: a Python format string "
                                 "of {task} (JSON), {conversation} (role: content lines) and {answer} (the last assistant message)")
    verdict: Literal["pass_fail", "score"] = Field("pass_fail", description="PASS/FAIL (1/0), or a number")
    pattern: str | None = Field(None, description="regex whose one group is the verdict; null: "
                                f"{DEFAULT_PATTERNS['pass_fail']!r} or {DEFAULT_PATTERNS['score']!r}")
    score_min: float = Field(0.0, allow_inf_nan=False, description="score: a verdict below this is no verdict")
    score_max: float = Field(1.0, allow_inf_nan=False, description="score: a verdict above this is no verdict")
    name: str = Field("judge", description="the reward component the verdict is logged and weighted under")
    max_new_tokens: int = Field(32, ge=1, description="tokens of the judge's reply")
    batch_size: int = Field(16, ge=1, description="judge prompts per /generate request")
    batch_wait_ms: float = Field(20.0, ge=0, description="how long a prompt waits for others to share its request")
    timeout_s: float = Field(60.0, gt=0, description="per episode, from its prompt being queued to its verdict")

    @field_validator("model")
    @classmethod
    def _model_is_a_dir(cls, path: str | None) -> str | None:
        from agentrl.rollout.model_engines import check_model_dir

        return None if path is None else check_model_dir(path, "rollout.judge.model")

    @field_validator("prompt_template")
    @classmethod
    def _template_fields_known(cls, template: str) -> str:
        try:
            roots = {re.split(r"[.\[]", name)[0] for _, name, _, _ in string.Formatter().parse(template) if name is not None}
        except ValueError as err:
            raise ValueError(f"not a format string: {err}") from None
        unknown = sorted(roots - set(TEMPLATE_FIELDS))
        if unknown or "" in roots:
            raise ValueError(f"fields {unknown or ['{}']} are not among {list(TEMPLATE_FIELDS)}")
        return template

    @field_validator("pattern")
    @classmethod
    def _pattern_has_one_group(cls, pattern: str | None) -> str | None:
        if pattern is not None:
            try:
                groups = re.compile(pattern).groups
            except re.error as err:
                raise ValueError(f"not a regular expression: {err}") from None
            if groups != 1:
                raise ValueError(f"the verdict pattern needs exactly one group, {pattern!r} has {groups}")
        return pattern

    @model_validator(mode="after")
    def _range(self) -> JudgeSettings:
        if self.score_min >= self.score_max:
            raise ValueError(f"score_min {self.score_min} must be below score_max {self.score_max}")
        if max(abs(self.score_min), abs(self.score_max)) > REWARD_LIMIT:  # a verdict must be a reward the trainer holds
            raise ValueError(f"score_min and score_max must be within ±{REWARD_LIMIT:g} (the reward limit)")
        return self


def parse_verdict(reply: str, settings: JudgeSettings) -> float:
    """The verdict in ``reply`` (its first match of the pattern), or :class:`JudgeError`."""
    found = re.search(settings.pattern or DEFAULT_PATTERNS[settings.verdict], reply)
    if found is None:
        raise JudgeError(f"no {settings.verdict} verdict in the judge's reply {reply[:200]!r}")
    value = found.group(1)
    if settings.verdict == "pass_fail":
        if value.upper() not in ("PASS", "FAIL"):
            raise JudgeError(f"the verdict {value!r} is neither PASS nor FAIL")
        return 1.0 if value.upper() == "PASS" else 0.0
    try:
        score = float(value)
    except ValueError:
        raise JudgeError(f"the verdict {value!r} is not a number") from None
    if not settings.score_min <= score <= settings.score_max:  # NaN fails this too
        raise JudgeError(f"the score {score} is outside [{settings.score_min}, {settings.score_max}]")
    return score


def judge_prompt(template: str, task: Any, messages: list[dict[str, Any]]) -> str:
    """``template`` filled from an episode: the task as JSON, the conversation, the last assistant message."""
    def text(m: dict[str, Any]) -> str:
        calls = m.get("tool_calls")
        return str(m.get("content") or "") + (f" {json.dumps(calls, default=str)}" if calls else "")

    conversation = "\n".join(f"{m.get('role')}: {text(m)}" for m in messages)
    answer = next((text(m) for m in reversed(messages) if m.get("role") == "assistant"), "")
    try:
        return template.format(task=_Task(task) if isinstance(task, dict) else task, conversation=conversation,
                               answer=answer)
    except (KeyError, IndexError, AttributeError, TypeError, ValueError) as err:
        raise JudgeError(f"prompt_template does not fit the episode: {type(err).__name__}: {err}") from None


class _Task(dict):
    """A dict task: ``{task}`` formats as JSON, ``{task[key]}`` reads a field."""

    def __format__(self, spec: str) -> str:
        return format(json.dumps(self, default=str), spec)


class Judge:
    """Scores episodes on engines at :meth:`start`'s urls; call :meth:`aclose` in the loop that scored."""

    def __init__(self, settings: JudgeSettings) -> None:
        self.settings = settings
        self.tokenizer: Any = None
        self.context_length: int | None = None
        self.engines: Any = None  # ModelEngines of settings.model
        self.urls: list[str] = []
        self._next_url = itertools.count()
        self._pending: list[tuple[list[int], asyncio.Future]] = []
        self._timer: asyncio.TimerHandle | None = None
        self._session: Any = None
        self.counts = {"requests": 0, "prompts": 0}

    def start(self, policy_urls: list[str], policy_tokenizer: Any, policy_context: int | None, *,
              dtype: str = "float32", log_dir: Any = None, secret: str | None = None) -> Judge:
        """Judge on the policy's engines (their urls, tokenizer and context length), or start ``model``'s."""
        s = self.settings
        if s.model is None:
            self.urls, self.tokenizer, self.context_length = list(policy_urls), policy_tokenizer, policy_context
            return self
        from transformers import AutoTokenizer

        from agentrl.engine.protocol import context_length_of
        from agentrl.rollout.model_engines import ModelEngines

        self.tokenizer, self.context_length = AutoTokenizer.from_pretrained(s.model), context_length_of(s.model)
        self.engines = ModelEngines(s.model, count=s.num_engines, dtype=dtype, engine_args=s.engine_args,
                                    log_dir=log_dir, secret=secret).start()
        self.urls = self.engines.urls
        return self

    def stop(self) -> None:
        """Stop the judge's own engines (the policy's are not the judge's to stop)."""
        if self.engines is not None:
            self.engines.stop()
            self.engines = None

    def prompt_ids(self, task: Any, messages: list[dict[str, Any]]) -> list[int]:
        text = judge_prompt(self.settings.prompt_template, task, messages)
        rendered = self.tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=False,
                                                      add_generation_prompt=True)
        ids = self.tokenizer(rendered, add_special_tokens=False).input_ids
        if self.context_length is not None and len(ids) + self.settings.max_new_tokens > self.context_length:
            raise JudgeError(f"the judge prompt ({len(ids)} tokens) and its reply do not fit the judge's "
                             f"context ({self.context_length} tokens)")
        return ids

    async def score(self, task: Any, messages: list[dict[str, Any]]) -> float:
        """The episode's verdict (:func:`parse_verdict`), or :class:`JudgeError`."""
        future = asyncio.get_running_loop().create_future()
        self._pending.append((self.prompt_ids(task, messages), future))
        if len(self._pending) >= self.settings.batch_size:
            self._flush()
        elif self._timer is None:
            self._timer = asyncio.get_running_loop().call_later(self.settings.batch_wait_ms / 1000, self._flush)
        try:
            reply = await asyncio.wait_for(future, self.settings.timeout_s)
        except TimeoutError:
            raise JudgeError(f"no verdict within {self.settings.timeout_s} s") from None
        return parse_verdict(reply, self.settings)

    def _flush(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        while self._pending:
            batch, self._pending = self._pending[: self.settings.batch_size], self._pending[self.settings.batch_size:]
            asyncio.ensure_future(self._send(batch))

    async def _send(self, batch: list[tuple[list[int], asyncio.Future]]) -> None:
        url = self.urls[next(self._next_url) % len(self.urls)]
        self.counts["requests"] += 1
        self.counts["prompts"] += len(batch)
        try:
            replies = await self._generate(url, [ids for ids, _ in batch])
        except JudgeError as error:
            for _, future in batch:
                if not future.done():
                    future.set_exception(error)
            return
        for (_, future), reply in zip(batch, replies, strict=True):
            if not future.done():
                future.set_result(reply)

    async def _generate(self, url: str, prompts: list[list[int]]) -> list[str]:
        """One batched greedy ``/generate``: the reply text of each prompt, or :class:`JudgeError`."""
        import aiohttp

        body = {"input_ids": prompts, "sampling_params": {"temperature": 0.0, "max_new_tokens": self.settings.max_new_tokens}}
        if self._session is None or self._session.closed:
            self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=self.settings.timeout_s))
        try:
            async with self._session.post(f"{url}/generate", json=body) as response:
                text = await response.text()
        except TimeoutError:
            raise JudgeError(f"{url}: no verdict within {self.settings.timeout_s} s") from None
        except aiohttp.ClientError as err:
            raise JudgeError(f"{url}: {type(err).__name__}: {err}") from None
        if response.status != 200:
            raise JudgeError(f"{url}/generate answered HTTP {response.status}: {text[:200]}")
        try:
            outputs = json.loads(text)
            replies = [str(o["text"]) for o in outputs]
        except (json.JSONDecodeError, KeyError, TypeError):
            replies = []
        if len(replies) != len(prompts):
            raise JudgeError(f"{url}/generate answered {len(prompts)} prompts with {text[:200]}")
        return replies

    async def aclose(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None


def with_judge(env_factory: Callable[[], Environment], judge: Judge) -> Callable[[], Environment]:
    """``env_factory`` whose environments add the judge's verdict to their reward components."""

    def make() -> Environment:
        env = env_factory()
        local = env.reward

        async def reward() -> dict[str, float]:
            own = await maybe_await(local())
            components = dict(own) if isinstance(own, Mapping) else {"env": float(own)}
            return {**components, judge.settings.name: await judge.score(env.task, list(env.messages))}

        env.reward = reward
        return env

    return make
