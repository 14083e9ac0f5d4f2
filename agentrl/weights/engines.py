"""Talking to engines' weight endpoints: one call to every engine, errors that name the engine.

Calls go to each engine concurrently (a thread per engine): a collective such as
``/init_weights_update_group`` only returns once every member has joined, and a slow engine should not
serialise the others.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import httpx


class EngineCallError(RuntimeError):
    """An engine answered a weight call with an error (or not at all)."""

    def __init__(self, url: str, path: str, status: int | None, message: str) -> None:
        super().__init__(f"{url}{path}: {status if status is not None else 'no answer'}: {message}")
        self.url = url
        self.path = path
        self.status = status
        self.message = message

    @property
    def rejected(self) -> bool:
        """The engine understood and refused the request (4xx), rather than failing or being unreachable."""
        return self.status is not None and 400 <= self.status < 500


@dataclass
class CallResult:
    url: str
    value: Any = None
    error: EngineCallError | None = None


class EngineClient:
    """Blocking JSON calls to a fixed set of engine base URLs."""

    def __init__(self, urls: Sequence[str], *, timeout: float = 600.0) -> None:
        if not urls:
            raise ValueError("at least one engine URL is needed")
        self.urls = [u.rstrip("/") for u in urls]
        self._http = httpx.Client(timeout=timeout)
        self._pool = ThreadPoolExecutor(max_workers=max(1, len(self.urls)), thread_name_prefix="weight-sync")

    def close(self) -> None:
        self._http.close()
        self._pool.shutdown(wait=False)

    def call(self, url: str, path: str, body: dict[str, Any] | None = None) -> Any:
        """POST ``body`` (GET when ``None``) to one engine; the decoded JSON answer or :class:`EngineCallError`."""
        try:
            response = self._http.get(url + path) if body is None else self._http.post(url + path, json=body)
        except httpx.HTTPError as exc:
            raise EngineCallError(url, path, None, f"{type(exc).__name__}: {exc}") from None
        try:
            answer = response.json()
        except ValueError:
            answer = response.text
        if response.status_code >= 400:
            raise EngineCallError(url, path, response.status_code, _message(answer))
        if isinstance(answer, dict) and answer.get("success") is False:
            raise EngineCallError(url, path, response.status_code, _message(answer))
        return answer

    def submit(self, url: str, path: str, body: dict[str, Any] | None = None) -> Future:
        return self._pool.submit(self.call, url, path, body)

    def call_all(
        self,
        path: str,
        body: dict[str, Any] | Callable[[int, str], dict[str, Any]] | None = None,
        *,
        urls: Sequence[str] | None = None,
    ) -> list[CallResult]:
        """Call ``path`` on every engine at once; ``body`` may depend on ``(index, url)``. Never raises."""
        targets = list(urls if urls is not None else self.urls)
        futures = [
            self.submit(url, path, body(i, url) if callable(body) else body) for i, url in enumerate(targets)
        ]
        return collect(targets, futures)

    def weight_versions(self, urls: Sequence[str] | None = None) -> dict[str, str]:
        """Each engine's current ``weight_version`` from ``/server_info``."""
        return {r.url: str(r.value.get("weight_version")) for r in raise_errors(self.call_all("/server_info", urls=urls))}


def collect(urls: Sequence[str], futures: Sequence[Future]) -> list[CallResult]:
    results = []
    for url, fut in zip(urls, futures, strict=True):
        try:
            results.append(CallResult(url, value=fut.result()))
        except EngineCallError as exc:
            results.append(CallResult(url, error=exc))
    return results


def raise_errors(results: list[CallResult]) -> list[CallResult]:
    """Raise the first error (listing all failing engines), else return ``results``."""
    failed = [r for r in results if r.error is not None]
    if failed:
        first = failed[0].error
        assert first is not None
        if len(failed) > 1:
            raise EngineCallError(first.url, first.path, first.status, f"{first.message} (and {len(failed) - 1} more engine(s))")
        raise first
    return results


def _message(answer: Any) -> str:
    if isinstance(answer, dict):
        for key in ("message", "detail", "error"):
            if key in answer:
                value = answer[key]
                return value if isinstance(value, str) else str(value)
    return str(answer)[:2000]
