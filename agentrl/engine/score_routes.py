"""``POST /token_logprobs``: the model's log-probs of given tokens of given sequences (scoring, no generation).

Body ``{"input_ids": [[id, ...], ...], "positions": [[p, ...], ...], "temperature": 1.0}``: for each sequence,
the log-prob of ``input_ids[p]`` given ``input_ids[:p]`` at each listed ``p`` (``1 <= p < len``, strictly increasing), the logits
divided by ``temperature`` as when sampling. Answer ``{"logprobs": [[lp, ...], ...], "weight_version": v}``.
A distillation teacher scores exactly the tokens a student sampled through it. The forward passes run in the
engine's worker thread between two generation steps, so they never see weights change halfway.
"""

from __future__ import annotations

import asyncio
import math
from typing import TYPE_CHECKING, Any

from fastapi import APIRouter, Request
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from agentrl.engine.http_common import read_json
from agentrl.engine.protocol import BadRequest

if TYPE_CHECKING:
    from agentrl.engine.engine import Engine

MAX_SEQUENCES = 256  # per request: one request's forwards hold the worker thread


class TokenLogprobsRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    input_ids: list[list[int]] = Field(min_length=1, max_length=MAX_SEQUENCES)
    positions: list[list[int]]
    temperature: float = Field(1.0, gt=0)


def checked(body: dict[str, Any], vocab_size: int, context_length: int) -> TokenLogprobsRequest:
    """The request, or :class:`BadRequest` naming what is wrong with it."""
    try:
        req = TokenLogprobsRequest.model_validate(body)
    except ValidationError as err:
        first = err.errors()[0]
        where = ".".join(str(p) for p in first["loc"])
        raise BadRequest(f"/token_logprobs: {where}: {first['msg']}") from None
    if not math.isfinite(req.temperature) or req.temperature < 1e-6:
        raise BadRequest(f"/token_logprobs: temperature must be a finite number >= 1e-6, got {req.temperature}")
    if len(req.positions) != len(req.input_ids):
        raise BadRequest(f"/token_logprobs: {len(req.positions)} position lists for {len(req.input_ids)} sequences")
    for i, (ids, positions) in enumerate(zip(req.input_ids, req.positions, strict=True)):
        if not 2 <= len(ids) <= context_length:
            raise BadRequest(f"/token_logprobs: sequence {i} has {len(ids)} tokens; 2 to {context_length} are scored")
        bad = [t for t in ids if not 0 <= t < vocab_size]
        if bad:
            raise BadRequest(f"/token_logprobs: sequence {i}: token id(s) out of vocabulary [0, {vocab_size}): {bad[:8]}")
        outside = [p for p in positions if not 1 <= p < len(ids)]
        if outside:
            raise BadRequest(f"/token_logprobs: sequence {i}: positions {outside[:8]} outside [1, {len(ids)})")
        # increasing, so a list is never longer than its sequence
        if any(a >= b for a, b in zip(positions, positions[1:], strict=False)):
            raise BadRequest(f"/token_logprobs: sequence {i}: positions must be strictly increasing")
    return req


class ScoreRoutes:
    """The scoring route of one engine (open, as /generate is)."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine

    def router(self) -> APIRouter:
        router = APIRouter()
        router.add_api_route("/token_logprobs", self.token_logprobs, methods=["POST"])
        return router

    async def token_logprobs(self, request: Request) -> dict[str, Any]:
        engine = self.engine
        model = getattr(engine.runner, "model", None)
        if model is None:
            raise BadRequest("this engine has no model to score with (null model)", status=501)
        if engine.memory_released:
            raise BadRequest("memory is released (release_memory_occupation); resume it first", status=503)
        req = checked(await read_json(request), engine.runner.vocab_size, engine.runner.context_length)

        def score() -> tuple[list[list[float]], str]:
            return [_logprobs(model, engine.runner.device, ids, positions, req.temperature)
                    for ids, positions in zip(req.input_ids, req.positions, strict=True)], engine.weight_version

        values, version = await asyncio.wrap_future(engine.scheduler.call(score))
        return {"logprobs": values, "weight_version": version}


def _logprobs(model: Any, device: Any, ids: list[int], positions: list[int], temperature: float) -> list[float]:
    import torch

    if not positions:
        return []
    with torch.inference_mode():
        logits = model(input_ids=torch.tensor([ids], device=device), use_cache=False).logits[0].float()
        at = torch.tensor(positions, device=device)
        picked = torch.log_softmax(logits[at - 1] / temperature, dim=-1)  # the logits at p - 1 predict token p
        return picked.gather(1, torch.tensor(ids, device=device)[at].unsqueeze(1)).squeeze(1).tolist()
