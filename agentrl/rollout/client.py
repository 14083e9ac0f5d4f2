"""Async rollout client: one ``/generate`` call per agent turn, session-pinned, retried, abortable.

The agent loop receives :meth:`RolloutClient.generate_turn` as its ``generate`` callable. Each request
carries ``X-SMG-Routing-Key: <session_id>`` (smg's only affinity signal) so every turn of an episode
lands on the engine that holds its prefix cache, and ``return_logprob: true`` so the trainer gets the
sampler's log-probs.

Failure policy (an episode must survive a dead engine, the router fails pinned sessions over):
connection errors, cut responses, 5xx, 408 and 429 are retried with exponential backoff and jitter,
bounded by ``max_retries`` and ``retry_budget_s``; other 4xx raise :class:`GenerateRequestError` with
the server's message at once (the request itself is wrong); the per-request ``timeout`` aborts the
request on the engine and raises :class:`GenerateTimeoutError`. Cancelling the awaiting task
(``asyncio.CancelledError``) aborts the request on the engine too.

The hot path is not httpx, nor aiohttp for ``http://`` URLs: against an instant engine stub on 2 cores, a
tuned ``httpx.AsyncClient`` spent 3-8 ms of CPU per request and reached 45-140 req/s, raw aiohttp 0.45-0.8 ms
and 300-800 req/s on the same (heavily shared) machine (``benchmarks/client_bench.py``). ``/generate`` now goes
through :mod:`agentrl.rollout.http1`, a keep-alive HTTP/1.1 pool that does only what this call needs: in
``benchmarks/rollout_host_bench.py`` (real smg and engine server, same minutes) the client process's own
share fell from 0.65-0.78 to 0.40-0.44 ms a turn. aiohttp still serves ``https`` URLs and the abort routes.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import random
import time
import urllib.parse
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from agentrl.engine.auth import SECRET_ENV, auth_headers
from agentrl.rollout.http1 import Http1Pool, HttpConnectionError
from agentrl.rollout.router import ALL_WORKERS
from agentrl.trajectory import TurnRecord

ROUTING_KEY_HEADER = "X-SMG-Routing-Key"
# smg does not proxy /abort_request; its RL control plane fans it out to every engine instead.
_FANOUT_ABORT_PATH = "/v1/rl/engine/abort_request?" + urllib.parse.urlencode({"selector": ALL_WORKERS})
_RETRYABLE_4XX = frozenset({408, 429})  # "try again later" by definition
_INT = {int}


class RolloutClientError(RuntimeError):
    """Base class of the errors :class:`RolloutClient` raises."""


class GenerateRequestError(RolloutClientError):
    """The server rejected the request (4xx): retrying the same request cannot succeed."""

    def __init__(self, status: int, message: str) -> None:
        self.status = status
        self.message = message
        super().__init__(f"/generate rejected with HTTP {status}: {message}")


class GenerateTimeoutError(RolloutClientError):
    """The request took longer than the client's per-request timeout (it was aborted on the engine)."""


class MalformedResponseError(RolloutClientError):
    """A 200 answer that is not a complete SGLang ``/generate`` response."""


class GenerateRetriesExhausted(RolloutClientError):
    """Every attempt failed with a transient error; ``__cause__`` is the last one."""


class _Transient(Exception):
    """A failure worth retrying (5xx, 408/429, a 200 whose body does not parse)."""


@dataclass(frozen=True)
class GenerateResult:
    """One ``/generate`` answer: the sampled ``turn`` and what only the client reports about it.

    ``meta`` is SGLang's untouched ``meta_info``; ``rid`` the request id of the attempt that answered.
    """

    turn: TurnRecord
    cached_tokens: int
    text: str
    meta: dict[str, Any] = field(repr=False, compare=False)
    rid: str = ""


def _server_message(raw: bytes) -> str:
    """The human part of an error body: SGLang/FastAPI/smg put it in different places."""
    try:
        body = json.loads(raw)
    except ValueError:
        return raw.decode("utf-8", "replace").strip()[:2000]
    if isinstance(body, dict):
        err = body.get("error", body.get("detail", body.get("message")))
        if isinstance(err, dict):
            err = err.get("message", err)
        if err is not None:
            return str(err)[:2000]
    return str(body)[:2000]


def parse_generate_response(prompt_ids: Sequence[int], body: Any, rid: str = "") -> GenerateResult:
    """Turn SGLang's ``/generate`` JSON into a :class:`GenerateResult` (raises ``ValueError`` if malformed).

    The turn itself is read by :meth:`TurnRecord.from_generate_response`, the one parser of that answer.
    """
    turn = TurnRecord.from_generate_response(prompt_ids, body)
    meta = body["meta_info"]
    return GenerateResult(
        turn=turn,
        cached_tokens=int(meta.get("cached_tokens") or 0),
        text=str(body.get("text") or ""),
        meta=meta,
        rid=rid,
    )


class RolloutClient:
    """Pooled async client for an SGLang-compatible ``/generate`` behind smg (or one engine directly).

    The connection pool is created on first use in the running event loop (and again if the client is
    later used from another loop). ``timeout`` bounds each attempt; retries are bounded by
    ``max_retries`` and ``retry_budget_s``.

    >>> async with RolloutClient("http://127.0.0.1:30000") as client:      # doctest: +SKIP
    ...     turn = await client.generate_turn([1, 2, 3], session_id="ep-7",
    ...                                       sampling_params={"max_new_tokens": 64})
    """

    def __init__(
        self,
        base_url: str,
        *,
        timeout: float = 300.0,
        max_retries: int = 6,
        backoff: float = 0.1,
        max_backoff: float = 2.0,
        retry_budget_s: float = 60.0,
        max_connections: int = 1024,
        abort_timeout: float = 5.0,
        return_routed_experts: bool = False,
    ) -> None:
        """``return_routed_experts``: ask an MoE engine for each sampled token's experts (routing replay)."""
        if timeout <= 0 or backoff < 0 or max_retries < 0 or retry_budget_s < 0:
            raise ValueError("timeout must be > 0; backoff, max_retries and retry_budget_s must be >= 0")
        self.base_url = base_url.rstrip("/")
        self.timeout = timeout
        self.max_retries = max_retries
        self.backoff = backoff
        self.max_backoff = max_backoff
        self.retry_budget_s = retry_budget_s
        self.max_connections = max_connections
        self.abort_timeout = abort_timeout
        self._session: aiohttp.ClientSession | None = None
        self._session_loop: asyncio.AbstractEventLoop | None = None
        self._generate_url = self.base_url + "/generate"
        # /generate on http:// goes through agentrl.rollout.http1 (a fraction of aiohttp's CPU per request)
        origin = urllib.parse.urlsplit(self.base_url)
        self._http1_origin = (origin.hostname, origin.port or 80) if origin.scheme == "http" and origin.hostname else None
        self._generate_target = (origin.path or "") + "/generate"
        self._http1: Http1Pool | None = None
        self._http1_loop: asyncio.AbstractEventLoop | None = None
        self._abort_via_fanout: bool | None = None  # learned on the first abort: engine or smg?
        self.retries = 0  # transient failures retried so far (observability, tests)
        self.return_routed_experts = return_routed_experts

    # -- lifecycle ---------------------------------------------------------------------------------

    def _pool(self) -> aiohttp.ClientSession:
        loop = asyncio.get_running_loop()
        # A session belongs to the loop that made it: a client reused across asyncio.run() calls gets a
        # fresh pool (the old loop, and so its connections, are gone).
        if self._session is None or self._session.closed or self._session_loop is not loop:
            self._session_loop = loop
            connector = aiohttp.TCPConnector(limit=self.max_connections, limit_per_host=self.max_connections,
                                             ttl_dns_cache=300)
            self._session = aiohttp.ClientSession(
                connector=connector, json_serialize=json.dumps, trust_env=False,
                timeout=aiohttp.ClientTimeout(total=None, sock_connect=10.0),
            )
        return self._session

    def _fast_pool(self) -> Http1Pool:
        loop = asyncio.get_running_loop()
        if self._http1 is None or self._http1_loop is not loop:  # as _pool: one per event loop
            self._http1_loop = loop
            host, port = self._http1_origin
            self._http1 = Http1Pool(host, port, max_connections=self.max_connections)
        return self._http1

    async def aclose(self) -> None:
        if self._session is not None and self._session_loop is asyncio.get_running_loop():
            await self._session.close()
        self._session = None
        if self._http1 is not None and self._http1_loop is asyncio.get_running_loop():
            self._http1.close()
        self._http1 = None

    async def __aenter__(self) -> RolloutClient:
        self._pool()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    # -- generate ----------------------------------------------------------------------------------

    async def generate(
        self,
        input_ids: Sequence[int],
        sampling_params: dict[str, Any] | None = None,
        *,
        session_id: str,
        rid: str | None = None,
    ) -> GenerateResult:
        """Sample one continuation of ``input_ids`` on the engine pinned to ``session_id``."""
        if not session_id:
            raise ValueError("session_id must be a non-empty string (it pins the episode to one engine)")
        prompt = list(input_ids)  # a copy: the record must hold what was sent, whatever the caller does meanwhile
        if not set(map(type, prompt)) <= _INT:  # one C-level pass in the common case (a long prompt: ~2.5x cheaper)
            prompt = [int(t) for t in prompt]
        if not prompt:
            raise ValueError("input_ids must not be empty")
        if sampling_params and sampling_params.get("n", 1) != 1:
            raise ValueError("generate() samples one continuation per call: sampling_params['n'] must be 1")
        base_rid = rid or os.urandom(16).hex()  # uuid4's 128 random bits without its per-call object work
        body: dict[str, Any] = {"input_ids": prompt, "sampling_params": dict(sampling_params or {}),
                                "return_logprob": True, "rid": base_rid}
        if self.return_routed_experts:
            body["return_routed_experts"] = True
        headers = {ROUTING_KEY_HEADER: session_id, "Content-Type": "application/json"}
        started = time.monotonic()
        attempt = 0
        while True:
            # A retry gets a fresh rid: the engine may still be running (or remember) the previous one.
            rid = base_rid if attempt == 0 else f"{base_rid}-retry{attempt}"
            body["rid"] = rid
            try:
                async with asyncio.timeout(self.timeout):
                    answer = await self._post_generate(json.dumps(body).encode(), headers)
                break
            except asyncio.CancelledError:
                await self._abort_quietly(rid, session_id)
                raise
            except TimeoutError as exc:
                await self._abort_quietly(rid, session_id)
                raise GenerateTimeoutError(f"/generate rid={rid} exceeded {self.timeout:g} s") from exc
            except (aiohttp.ClientError, HttpConnectionError, _Transient) as exc:
                # refused/reset connections and bodies cut short by a dying engine
                if attempt >= self.max_retries:
                    raise GenerateRetriesExhausted(
                        f"/generate rid={rid} failed {attempt + 1} times: {exc!r}") from exc
                delay = min(self.max_backoff, self.backoff * (2 ** attempt)) * (0.5 + random.random() / 2)
                if time.monotonic() - started + delay > self.retry_budget_s:
                    raise GenerateRetriesExhausted(
                        f"/generate rid={rid} out of retry budget ({self.retry_budget_s:g} s): {exc!r}"
                    ) from exc
                attempt += 1
                self.retries += 1
                await asyncio.sleep(delay)
        try:
            return parse_generate_response(prompt, answer, rid)
        except (ValueError, KeyError, TypeError, IndexError) as exc:
            raise MalformedResponseError(f"/generate rid={rid}: unexpected answer ({exc}): "
                                         f"{str(answer)[:500]}") from exc

    async def _post_generate(self, payload: bytes, headers: dict[str, str]) -> Any:
        if self._http1_origin is not None:
            status, raw = await self._fast_pool().post(self._generate_target, payload, headers)
        else:
            async with self._pool().post(self._generate_url, data=payload, headers=headers) as resp:
                raw = await resp.read()
                status = resp.status
        if status == 200:
            try:
                return json.loads(raw)
            except ValueError as exc:  # a body cut short by a proxy: the next attempt can succeed
                raise _Transient(f"HTTP 200 with unparsable body ({exc})") from exc
        if status >= 500 or status in _RETRYABLE_4XX:
            raise _Transient(f"HTTP {status}: {_server_message(raw)}")
        raise GenerateRequestError(status, _server_message(raw))

    async def generate_turn(
        self,
        input_ids: Sequence[int],
        *,
        session_id: str,
        sampling_params: dict[str, Any] | None = None,
    ) -> TurnRecord:
        """The agent loop's ``generate`` callable: one sampled turn as a :class:`TurnRecord`."""
        return (await self.generate(input_ids, sampling_params, session_id=session_id)).turn

    # -- abort -------------------------------------------------------------------------------------

    async def abort(self, rid: str, session_id: str | None = None) -> bool:
        """Ask the engine(s) to drop request ``rid``; returns whether some server accepted the call.

        Sent to ``/abort_request`` (an engine); if that route is missing (smg), fanned out through
        smg's RL control plane to every engine (aborting an unknown rid is a no-op there).
        """
        body = json.dumps({"rid": rid}).encode()
        # abort is a control route: it needs the run's engine secret (agentrl.engine.auth)
        headers = {"Content-Type": "application/json", **auth_headers(os.environ.get(SECRET_ENV))}
        if session_id:
            headers[ROUTING_KEY_HEADER] = session_id
        paths = ["/abort_request", _FANOUT_ABORT_PATH]
        if self._abort_via_fanout:
            paths.reverse()
        for path in paths:
            async with self._pool().post(self.base_url + path, data=body, headers=headers) as resp:
                await resp.read()
                if resp.status < 400:
                    self._abort_via_fanout = path != "/abort_request"
                    return True
        return False

    async def _abort_quietly(self, rid: str, session_id: str) -> None:
        # Runs while the caller is being cancelled or timed out: never raise, never hang.
        with contextlib.suppress(Exception):
            async with asyncio.timeout(self.abort_timeout):
                await self.abort(rid, session_id)
