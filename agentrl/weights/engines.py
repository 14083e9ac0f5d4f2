"""Talking to engines' weight endpoints: one call to every engine, errors that name the engine.

Calls go to each engine concurrently (a thread per engine): a collective such as
``/init_weights_update_group`` only returns once every member has joined, and a slow engine should not
serialise the others.

With ``router_url`` (an smg router started with ``--enable-rl``), a call that sends the same body to
every engine goes as ONE request to the router's RL fan-out ``POST /v1/rl/engine/<path>?selector=...``,
which forwards it to all its workers and answers each worker's status and body (smg 1.13, checked
against the real binary: any POST path is forwarded, 4xx answers come back per worker). Calls with
per-engine bodies (``/init_weights_update_group`` ranks), calls to a subset of engines (fallbacks) and
``GET`` reads (``/server_info``) still go to the engines directly, so ``urls`` must still list them. An
engine the router does not report counts as unreachable (it never saw the update).

Every call presents the run's secret (``Authorization: Bearer``, :mod:`agentrl.engine.auth`), which the
engines' weight routes and the router's control plane require: ``secret=`` or, by default,
``$AGENTRL_ENGINE_SECRET`` (set in every process that started engines, and by the run in its workers).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import httpx

from agentrl.engine.auth import SECRET_ENV, auth_headers
from agentrl.engine.weight_loading import RL_FANOUT_SELECTOR


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
    """Blocking JSON calls to a fixed set of engine base URLs, presenting ``secret`` (default
    ``$AGENTRL_ENGINE_SECRET``)."""

    def __init__(self, urls: Sequence[str], *, timeout: float = 600.0, router_url: str | None = None,
                 secret: str | None = None) -> None:
        if not urls:
            raise ValueError("at least one engine URL is needed")
        self.urls = [u.rstrip("/") for u in urls]
        self.router_url = router_url.rstrip("/") if router_url else None
        secret = secret if secret is not None else os.environ.get(SECRET_ENV)
        self._http = httpx.Client(timeout=timeout, headers=auth_headers(secret))
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
        if self._fans_out(targets, body):
            return self.fanout(path, body)  # type: ignore[arg-type]
        if len(targets) == 1:  # one engine: call from this thread (a pool hop costs more than it overlaps)
            url = targets[0]
            try:
                return [CallResult(url, value=self.call(url, path, body(0, url) if callable(body) else body))]
            except EngineCallError as exc:
                return [CallResult(url, error=exc)]
        futures = [
            self.submit(url, path, body(i, url) if callable(body) else body) for i, url in enumerate(targets)
        ]
        return collect(targets, futures)

    def submit_all(self, path: str, body: dict[str, Any]) -> Callable[[], list[CallResult]]:
        """Start the same call on every engine (through the router when there is one) without waiting;
        the returned function waits and gives each engine's result (for calls that join a collective)."""
        if self._fans_out(self.urls, body):
            future = self._pool.submit(self.fanout, path, body)
            return future.result
        futures = [self.submit(url, path, body) for url in self.urls]
        return lambda: collect(self.urls, futures)

    def _fans_out(self, targets: Sequence[str], body: Any) -> bool:
        return (
            self.router_url is not None
            and body is not None
            and not callable(body)
            and sorted(u.rstrip("/") for u in targets) == sorted(self.urls)
        )

    def fanout(self, path: str, body: dict[str, Any]) -> list[CallResult]:
        """POST ``body`` to ``path`` on every engine through the router's RL fan-out; one result per engine."""
        assert self.router_url is not None
        route = f"{self.router_url}/v1/rl/engine/{path.lstrip('/')}"
        try:
            response = self._http.post(route, json=body, params={"selector": RL_FANOUT_SELECTOR})
            answer = response.json()
        except (httpx.HTTPError, ValueError) as exc:
            error = EngineCallError(self.router_url, path, None, f"router fan-out failed: {type(exc).__name__}: {exc}")
            return [CallResult(url, error=error) for url in self.urls]
        if not isinstance(answer, dict) or "results" not in answer:
            error = EngineCallError(self.router_url, path, None, f"router fan-out: HTTP {response.status_code}: {_message(answer)}")
            return [CallResult(url, error=error) for url in self.urls]
        by_url = {str(r.get("url", "")).rstrip("/"): r for r in answer["results"].values() if isinstance(r, dict)}
        for failure in answer.get("failed", []):  # unreachable workers may appear only here
            by_url.setdefault(str(failure.get("url", "")).rstrip("/"), {"status": failure.get("status"), "body": failure.get("message")})
        results = []
        for url in self.urls:
            reply = by_url.get(url)
            if reply is None:
                message = f"the router at {self.router_url} has no such worker, so it did not get this call"
                results.append(CallResult(url, error=EngineCallError(url, path, None, message)))
                continue
            status, value = reply.get("status"), reply.get("body")
            status = int(status) if isinstance(status, int) else None
            if status is None or status >= 400 or (isinstance(value, dict) and value.get("success") is False):
                results.append(CallResult(url, error=EngineCallError(url, path, status, _message(value))))
            else:
                results.append(CallResult(url, value=value))
        return results

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
