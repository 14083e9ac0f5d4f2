"""One bounded thread pool that runs the blocking sandbox calls for asyncio code.

The docker SDK and subprocess are blocking; the agent loop is async. Every ``a*`` method of a sandbox
or pool goes through :func:`run_blocking`, so at most ``max_workers`` sandbox calls are in flight at
once no matter how many episodes await them (the rest queue in the executor).
"""

from __future__ import annotations

import asyncio
import functools
import os
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

T = TypeVar("T")

_lock = threading.Lock()
_executor: ThreadPoolExecutor | None = None
_max_workers = int(os.environ.get("AGENTRL_SANDBOX_THREADS", "32"))


def configure(max_workers: int) -> None:
    """Set the pool size; takes effect for the next executor (call before the first async call)."""
    global _max_workers, _executor
    if max_workers < 1:
        raise ValueError(f"max_workers must be >= 1, got {max_workers}")
    with _lock:
        _max_workers = max_workers
        old, _executor = _executor, None
    if old is not None:
        old.shutdown(wait=False)


def executor() -> ThreadPoolExecutor:
    global _executor
    with _lock:
        if _executor is None:
            _executor = ThreadPoolExecutor(max_workers=_max_workers, thread_name_prefix="agentrl-sandbox")
        return _executor


async def run_blocking(fn: Callable[..., T], /, *args, **kwargs) -> T:
    """Run ``fn(*args, **kwargs)`` in the sandbox thread pool and await its result."""
    loop = asyncio.get_running_loop()
    return await loop.run_in_executor(executor(), functools.partial(fn, *args, **kwargs))
