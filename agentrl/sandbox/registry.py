"""Every live sandbox of this process, so an interpreter exit removes them (atexit) even when the
caller forgot ``close()``. Crashes that skip atexit are what ``agentrl sandbox gc`` is for."""

from __future__ import annotations

import atexit
import logging
import threading
import weakref

log = logging.getLogger(__name__)

_live: weakref.WeakSet = weakref.WeakSet()
_lock = threading.Lock()


def track(sandbox) -> None:
    with _lock:
        _live.add(sandbox)


def untrack(sandbox) -> None:
    with _lock:
        _live.discard(sandbox)


def close_all() -> int:
    """Close every tracked sandbox; returns how many."""
    with _lock:
        live = list(_live)
    for sandbox in live:
        try:
            sandbox.close()
        except Exception as exc:
            log.warning("closing %r at exit failed: %s", sandbox, exc)
    return len(live)


atexit.register(close_all)
