"""agentrl.rollout: the smg router process, the async rollout client, the rollout manager and its settings,
the proof of every batch, the data buffer, the OpenAI-compatible gateway, and ``agentrl serve`` /
``rollout`` / ``eval``.

Exports are lazy so that ``import agentrl.rollout`` does not import aiohttp (or anything heavier).
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "SmgRouter": "agentrl.rollout.router",
    "RouterError": "agentrl.rollout.router",
    "FanoutError": "agentrl.rollout.router",
    "RolloutClient": "agentrl.rollout.client",
    "GenerateResult": "agentrl.rollout.client",
    "RolloutClientError": "agentrl.rollout.client",
    "GenerateRequestError": "agentrl.rollout.client",
    "GenerateTimeoutError": "agentrl.rollout.client",
    "GenerateRetriesExhausted": "agentrl.rollout.client",
    "MalformedResponseError": "agentrl.rollout.client",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'agentrl.rollout' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
