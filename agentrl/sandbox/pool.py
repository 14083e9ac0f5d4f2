"""A pool of pre-warmed sandboxes, handed out one per episode and recycled after it.

``with SandboxPool(size=4) as pool: with pool.session() as sb: sb.exec(...)`` (or ``async with
pool.asession() as sb``). At most ``size`` sandboxes exist and at most ``size`` are handed out; an
acquire waits for a free one. On release a sandbox is reset (processes killed, /work and /tmp emptied;
~10 ms) or, when ``recycle="replace"``, when it has served ``max_uses`` episodes, or when it is no
longer healthy, closed and replaced by a fresh one. Every sandbox is closed by ``close()``, the
context manager, or at interpreter exit; ``agentrl sandbox gc`` removes what a crash left behind.
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import logging
import queue
import threading
import time
import weakref
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from agentrl.sandbox.backend import make_sandbox, resolve_backend
from agentrl.sandbox.base import Sandbox, SandboxError
from agentrl.sandbox.blocking import run_blocking
from agentrl.sandbox.engine_setup import DEFAULT_IMAGE
from agentrl.sandbox.limits import SandboxLimits

log = logging.getLogger(__name__)

_RECYCLE = ("reset", "replace")


@dataclass
class PoolStats:
    created: int = 0
    replaced: int = 0
    resets: int = 0
    handed_out: int = 0
    unhealthy: int = 0


class SandboxPool:
    """Pre-warmed sandboxes. ``factory`` (a zero-argument callable returning an unstarted
    :class:`Sandbox`) overrides ``backend``/``image``/``limits`` for custom sandboxes."""

    def __init__(self, size: int = 4, *, backend: str = "auto", image: str = DEFAULT_IMAGE,
                 limits: SandboxLimits | None = None, recycle: str = "reset", max_uses: int = 100,
                 health_check: bool = True, factory: Callable[[], Sandbox] | None = None,
                 warm_workers: int = 4):
        if size < 1:
            raise ValueError(f"pool size must be >= 1, got {size}")
        if recycle not in _RECYCLE:
            raise ValueError(f"recycle must be one of {_RECYCLE}, got {recycle!r}")
        if max_uses < 1:
            raise ValueError(f"max_uses must be >= 1, got {max_uses}")
        self.size = size
        self.recycle = recycle
        self.max_uses = max_uses
        self.health_check = health_check
        if factory is None:
            kind = resolve_backend(backend)
            self.backend = kind

            def factory() -> Sandbox:
                return make_sandbox(kind, image=image, limits=limits, role="pool")
        else:
            self.backend = "custom"
        self._factory = factory
        self._warm_workers = max(1, warm_workers)
        self._idle: queue.Queue[Sandbox] = queue.Queue()
        self._all: set[Sandbox] = set()
        self._uses: dict[int, int] = {}
        self._lock = threading.Lock()
        # Sandboxes being made right now (warm-up, replacements, retries) and retries not yet due:
        # close() waits for the first and cancels the second, so no container outlives the pool.
        self._creating = 0
        self._created_or_failed = threading.Condition(self._lock)
        self._retries: set[threading.Timer] = set()
        self._closed = False
        self._started = False
        self._async_sem: asyncio.Semaphore | None = None
        self._async_loop = None
        self.stats = PoolStats()
        _live_pools.add(self)

    # ---- lifecycle ----------------------------------------------------------------------------
    def start(self) -> SandboxPool:
        """Create and start all ``size`` sandboxes (in parallel); idempotent. When any fails (e.g. the
        engine is restarting) the ones made are closed and the pool stays usable: the next call (or
        acquire) tries again."""
        with self._lock:
            if self._closed:
                raise SandboxError("pool is closed")
            if self._started:
                return self
            self._started = True
        workers = min(self.size, self._warm_workers)
        with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="agentrl-pool-warm") as ex:
            futures = [ex.submit(self._new_sandbox) for _ in range(self.size)]
            errors = []
            for fut in futures:
                try:
                    self._idle.put(fut.result())
                except Exception as exc:
                    errors.append(exc)
        if errors:
            self._unwarm()
            raise SandboxError(f"could not warm the pool: {errors[0]}") from errors[0]
        return self

    def _unwarm(self) -> None:
        """Back to not started, with no sandbox (a failed :meth:`start`)."""
        with self._lock:
            sandboxes, self._all = list(self._all), set()
            self._started = False
        while True:
            try:
                self._idle.get_nowait()
            except queue.Empty:
                break
        for sb in sandboxes:
            try:
                sb.close()
            except Exception as exc:
                log.warning("closing %r failed: %s", sb, exc)

    def _new_sandbox(self) -> Sandbox:
        with self._lock:
            if self._closed:
                raise SandboxError("pool is closed")
            self._creating += 1
        try:
            sb = self._factory()
            sb.start()
            with self._lock:
                closed = self._closed
                if not closed:
                    self._all.add(sb)
                    self.stats.created += 1
            if closed:
                sb.close()
                raise SandboxError("pool closed while a sandbox was being made")
            return sb
        finally:
            with self._lock:
                self._creating -= 1
                self._created_or_failed.notify_all()

    def close(self, wait_s: float = 120.0) -> None:
        """Close every sandbox, idle or handed out, once the ones being made (up to ``wait_s`` s) are made
        and closed; safe to call twice."""
        with self._lock:
            self._closed = True
            retries, self._retries = list(self._retries), set()
        for timer in retries:
            timer.cancel()
        with self._lock:
            if not self._created_or_failed.wait_for(lambda: self._creating == 0, wait_s):
                log.warning("%d sandbox(es) still being made %.0f s after close(); they close when made",
                            self._creating, wait_s)
            sandboxes, self._all = list(self._all), set()
        for sb in sandboxes:
            try:
                sb.close()
            except Exception as exc:
                log.warning("closing %r failed: %s", sb, exc)
        while True:
            try:
                self._idle.get_nowait()
            except queue.Empty:
                break

    def __enter__(self) -> SandboxPool:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.close()

    async def __aenter__(self) -> SandboxPool:
        return await run_blocking(self.start)

    async def __aexit__(self, *exc) -> None:
        await run_blocking(self.close)

    # ---- hand-out -----------------------------------------------------------------------------
    @property
    def idle_count(self) -> int:
        return self._idle.qsize()

    def acquire(self, timeout: float | None = None) -> Sandbox:
        """A healthy sandbox for one episode; waits up to ``timeout`` s (None: forever) for a free one.
        A waiter looks again every second, so a pool that failed to warm (engine down) is warmed again
        and a closed pool raises."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            if self._closed:
                raise SandboxError("pool is closed")
            if not self._started:
                self.start()
            left = 1.0 if deadline is None else deadline - time.monotonic()
            try:
                sb = self._idle.get(timeout=max(0.0, min(1.0, left)))
            except queue.Empty:
                if deadline is not None and time.monotonic() >= deadline:
                    raise TimeoutError(f"no sandbox free within {timeout}s (pool size {self.size})") from None
                continue
            if not self.health_check or sb.healthy():
                with self._lock:
                    self.stats.handed_out += 1
                return sb
            self.stats.unhealthy += 1
            log.warning("sandbox %r failed its health check; replacing it", sb)
            self._replace(sb)

    def release(self, sb: Sandbox) -> None:
        """Give a sandbox back after its episode: reset or replace it, then make it available."""
        with self._lock:
            if self._closed:
                return  # close() already closed it
            if sb not in self._all:
                raise ValueError(f"{sb!r} does not belong to this pool")
            uses = self._uses[id(sb)] = self._uses.get(id(sb), 0) + 1
        if self.recycle == "replace" or uses >= self.max_uses or not sb.alive:
            self._replace(sb)
            return
        try:
            sb.reset()
            self.stats.resets += 1
        except Exception as exc:
            log.warning("reset of %r failed (%s); replacing it", sb, exc)
            self._replace(sb)
            return
        self._idle.put(sb)

    def _replace(self, old: Sandbox) -> None:
        with self._lock:
            self._all.discard(old)
            self._uses.pop(id(old), None)
        try:
            old.close()
        except Exception as exc:
            log.warning("closing %r failed: %s", old, exc)
        if self._closed:
            return
        try:
            new = self._new_sandbox()
        except Exception as exc:
            # Keep the slot: the next acquire retries instead of the pool shrinking for good.
            log.error("could not create a replacement sandbox: %s", exc)
            self._retry_later(1.0)
            return
        self.stats.replaced += 1
        self._idle.put(new)

    def _refill_one(self, timer: threading.Timer | None = None) -> None:
        with self._lock:
            self._retries.discard(timer)
        if self._closed:
            return
        try:
            self._idle.put(self._new_sandbox())
            self.stats.replaced += 1
        except Exception as exc:
            log.error("retrying sandbox creation failed: %s", exc)
            self._retry_later(5.0)

    def _retry_later(self, delay_s: float) -> None:
        timer = threading.Timer(delay_s, lambda: self._refill_one(timer))
        timer.daemon = True  # a dead engine must not keep the interpreter from exiting
        with self._lock:
            if self._closed:
                return
            self._retries.add(timer)
        timer.start()

    @contextlib.contextmanager
    def session(self, timeout: float | None = None) -> Iterator[Sandbox]:
        """``with pool.session() as sb:`` one sandbox for one episode."""
        sb = self.acquire(timeout)
        try:
            yield sb
        finally:
            self.release(sb)

    # ---- async --------------------------------------------------------------------------------
    def _semaphore(self) -> asyncio.Semaphore:
        loop = asyncio.get_running_loop()
        if self._async_sem is None or self._async_loop is not loop:
            self._async_sem, self._async_loop = asyncio.Semaphore(self.size), loop
        return self._async_sem

    async def aacquire(self, timeout: float | None = None) -> Sandbox:
        # Waiting happens on an asyncio semaphore, not in a worker thread, so waiting episodes do
        # not occupy the bounded thread pool that running commands need.
        sem = self._semaphore()
        try:
            await asyncio.wait_for(sem.acquire(), timeout)
        except TimeoutError:
            raise TimeoutError(f"no sandbox free within {timeout}s (pool size {self.size})") from None
        try:
            return await run_blocking(self.acquire, None)
        except BaseException:
            sem.release()
            raise

    async def arelease(self, sb: Sandbox) -> None:
        try:
            await run_blocking(self.release, sb)
        finally:
            self._semaphore().release()

    @contextlib.asynccontextmanager
    async def asession(self, timeout: float | None = None):
        """``async with pool.asession() as sb:``"""
        sb = await self.aacquire(timeout)
        try:
            yield sb
        finally:
            await self.arelease(sb)


_live_pools: weakref.WeakSet[SandboxPool] = weakref.WeakSet()


@atexit.register
def _close_pools() -> None:
    for pool in list(_live_pools):
        with contextlib.suppress(Exception):
            pool.close()
