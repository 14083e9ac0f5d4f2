"""A scripted policy: a ``generate`` callable that "samples" known replies, for testing environments.

It tokenizes each reply text with the real tokenizer (canonically, control-token texts kept literal),
appends the end-of-turn token and returns a :class:`~agentrl.trajectory.TurnRecord` with made-up
log-probs — a policy that always says what the script says. It also keeps every record per session,
so tests can ``verify(sample, policy.turns[session_id])``.
"""

from __future__ import annotations

import asyncio
from collections import defaultdict
from collections.abc import Callable, Sequence
from typing import Any

from agentrl.trajectory import TurnRecord

# reply(prompt_text, turn_index) -> the assistant text of that turn
ReplyFn = Callable[[str, int], str]


class ScriptedPolicy:
    """``await policy(input_ids, session_id=..., sampling_params=...)`` -> TurnRecord of the scripted reply.

    ``script`` is a list of replies (turn k gets ``script[k]``; past the end, the last one repeats) or a
    function ``(prompt_text, turn_index) -> reply``. ``max_new_tokens`` in ``sampling_params`` is obeyed
    (the reply is cut and ``finish_reason`` is ``"length"``). ``delay`` seconds are awaited per call.
    """

    def __init__(self, tokenizer: Any, script: Sequence[str] | ReplyFn, *, weight_version: str | None = "0",
                 delay: float = 0.0) -> None:
        self.tokenizer = tokenizer
        self.script = script
        self.weight_version = weight_version
        self.delay = delay
        self.turns: dict[str, list[TurnRecord]] = defaultdict(list)
        self.sampling_params: list[dict[str, Any]] = []
        self.in_flight = 0
        self.max_in_flight = 0

    def reply(self, prompt_text: str, index: int) -> str:
        if callable(self.script):
            return self.script(prompt_text, index)
        return self.script[min(index, len(self.script) - 1)]

    async def __call__(self, input_ids: list[int], *, session_id: str,
                       sampling_params: dict[str, Any] | None = None) -> TurnRecord:
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        try:
            await asyncio.sleep(self.delay)
            params = dict(sampling_params or {})
            self.sampling_params.append(params)
            index = len(self.turns[session_id])
            prompt_text = self.tokenizer.decode(input_ids, skip_special_tokens=False)
            text = self.reply(prompt_text, index)
            ids = list(self.tokenizer(text, add_special_tokens=False, split_special_tokens=True)["input_ids"])
            ids.append(self.tokenizer.eos_token_id)
            finish = "stop"
            limit = params.get("max_new_tokens")
            if limit is not None and len(ids) > limit:
                ids, finish = ids[:limit], "length"
            record = TurnRecord(
                prompt_ids=list(input_ids), output_ids=ids,
                output_logprobs=[-0.01 * (1 + (i % 7)) for i in range(len(ids))],
                finish_reason=finish, weight_version=self.weight_version,
            )
            self.turns[session_id].append(record)
            return record
        finally:
            self.in_flight -= 1
