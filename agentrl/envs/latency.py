"""Tool calls with heavy-tailed latency, the workload that asynchronous training exists for.

``LongTailArithmeticEnv`` is :class:`~agentrl.envs.arithmetic.ArithmeticToolEnv` whose ``add`` tool
takes a lognormal time (median ``latency_median_s``, log-std ``latency_sigma``, capped at
``latency_cap_s``), as sandbox executions, searches and other remote tools do: most calls are quick, a
few take many times the median, and a synchronous step waits for the slowest one of its batch.
"""

from __future__ import annotations

import asyncio
import math
import random
from typing import ClassVar

from agentrl.envs.arithmetic import ArithmeticToolEnv
from agentrl.envs.tools import tool


def lognormal_seconds(rng: random.Random, median_s: float, sigma: float, cap_s: float) -> float:
    """One latency: ``median_s * exp(sigma * N(0, 1))``, at most ``cap_s``."""
    return min(cap_s, median_s * math.exp(sigma * rng.gauss(0.0, 1.0)))


class LongTailArithmeticEnv(ArithmeticToolEnv):
    """Call ``add`` (which takes a heavy-tailed time), then ``submit`` the sum."""

    # mean ~2 s, p90 ~4.7 s, p99 ~16 s: a batch of 64 calls waits ~14 s for its slowest
    latency_median_s: ClassVar[float] = 1.0
    latency_sigma: ClassVar[float] = 1.2
    latency_cap_s: ClassVar[float] = 30.0
    tool_timeout_s: ClassVar[float | None] = None  # the latency is the point: never cut it short
    _rng: ClassVar[random.Random] = random.Random(0)

    @tool
    async def add(self, a: int, b: int) -> int:
        """Add two numbers.

        Args:
            a: first number.
            b: second number.
        """
        await asyncio.sleep(lognormal_seconds(self._rng, self.latency_median_s, self.latency_sigma, self.latency_cap_s))
        self.used_add = True
        return a + b
