"""Stopping a run on SIGINT (Ctrl-C) or SIGTERM: the first signal raises :class:`StopRequested` (a
``KeyboardInterrupt``) in the driver's main thread, so the ``with Run(...)`` block unwinds and
:meth:`agentrl.run.session.Run.__exit__` stops the rollout actor (its episodes, the environments'
``close_resources()``, the router and the engines), the trainer ranks and Ray.

Why handlers of our own: a process started in the background by a non-interactive shell (``cmd &``)
inherits SIGINT *ignored*, so Python never turns it into ``KeyboardInterrupt``; and ``ray.init`` replaces
the SIGTERM handler with one that kills every Ray process, the rollout actor included, before any
environment could remove its containers. :func:`install` sets both signals (call it again after
``ray.init``).

Two kinds of sections change what a signal does: inside :func:`deferred` (writing a checkpoint or a
metric row) the stop is raised when the block ends, so nothing is left half-written; inside
:func:`shielded` (the shutdown itself) signals are reported and never raised, so the cleanup runs to its
end (each of its waits is bounded).
"""

from __future__ import annotations

import signal
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from types import FrameType

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


class StopRequested(KeyboardInterrupt):
    """A stop signal arrived. (Inside ``ray.get`` Ray re-raises it as a plain ``KeyboardInterrupt``:
    :func:`requested` says which signal it was.)"""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


class _State:
    signum: int | None = None  # the first stop signal received
    deferring = 0
    pending = False  # a signal arrived inside deferred(): raise when it ends
    shielding = 0


_state = _State()


def signal_name(signum: int | None) -> str:
    return signal.Signals(signum).name if signum is not None else "KeyboardInterrupt"


def _say(message: str) -> None:
    print(f"agentrl train: {message}", file=sys.stderr, flush=True)


def _on_signal(signum: int, frame: FrameType | None) -> None:
    first = _state.signum is None
    if first:
        _state.signum = signum
    name = signal_name(signum)
    if _state.shielding:
        _say(f"{name}: already stopping; the shutdown continues (every wait in it is bounded)")
        return
    if _state.deferring:
        _state.pending = True
        _say(f"{name}: stopping once the record being written is complete")
        return
    if first:
        _say(f"{name} received: stopping the run (the step in flight is abandoned)")
    raise StopRequested(signum)


def install() -> None:
    """Make SIGINT and SIGTERM stop the run (see the module doc). Call from the main thread; idempotent."""
    for sig in STOP_SIGNALS:
        signal.signal(sig, _on_signal)


@contextmanager
def handling() -> Iterator[bool]:
    """:func:`install` for the block when in the main thread (signal handlers can only be set there),
    then put back the handlers found; elsewhere a no-op. Yields whether it installed (then re-install
    inside the block after ``ray.init``)."""
    import threading

    if threading.current_thread() is not threading.main_thread():
        yield False
        return
    previous = {sig: signal.getsignal(sig) for sig in STOP_SIGNALS}
    reset()
    install()
    try:
        yield True
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler if handler is not None else signal.SIG_DFL)


def requested() -> int | None:
    """The first stop signal received, or None."""
    return _state.signum


def reset() -> None:
    """Forget a received signal (a process that runs several trainings, e.g. tests)."""
    _state.signum, _state.pending = None, False


@contextmanager
def deferred() -> Iterator[None]:
    """A block a stop signal must not cut (a checkpoint, a metric row): the stop is raised after it."""
    _state.deferring += 1
    try:
        yield
    finally:
        _state.deferring -= 1
    if not _state.deferring and not _state.shielding and _state.pending:
        _state.pending = False
        raise StopRequested(_state.signum or signal.SIGINT)


@contextmanager
def shielded() -> Iterator[None]:
    """A block that stop signals never interrupt (the shutdown): they are reported, not raised."""
    _state.shielding += 1
    try:
        yield
    finally:
        _state.shielding -= 1
