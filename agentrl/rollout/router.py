"""Process manager for the smg router (PyPI ``smg``): start, register/remove engines, RL fan-out, stop.

The router is the real ``smg launch`` (run as ``python -m smg launch`` with this interpreter, so the
router that runs is the one installed next to agentrl). Session affinity comes only from the
``X-SMG-Routing-Key`` request header (see :mod:`agentrl.rollout.client`); with ``--policy manual
--assignment-mode min_group`` a new key goes to the worker holding the fewest keys and then stays there.

Control calls are rare and synchronous, so they use the standard library (no event loop needed).

Secret: the router's control plane (``/workers``, the RL fan-out) requires the run's secret
(:mod:`agentrl.engine.auth`) as ``Authorization: Bearer``, and every worker is registered with it as its
``api_key``, which smg presents on each call to that worker, so fan-out calls pass the engines' guard;
``/generate`` and ``/health`` stay open. The key reaches smg in its environment, never on its command
line. smg probes each worker's ``/health`` every second and marks it unhealthy after three failures
(its defaults, a minute apart, kept a dead engine ready for minutes); :class:`EngineWatch` removes a dead
engine from the router at once and can restart it.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from agentrl.engine.auth import SECRET_ENV, auth_headers, run_secret
from agentrl.engine.launch import free_port, free_ports
from agentrl.engine.process import log_file, start_tied_process, stop_process_group
from agentrl.engine.weight_loading import RL_FANOUT_SELECTOR as ALL_WORKERS  # smg's every-worker selector

if TYPE_CHECKING:
    from collections.abc import Callable, Sequence

    from agentrl.engine.launch import EngineProcess

_log = logging.getLogger(__name__)

# Runs ``python -m smg <args>`` with the control-plane key taken from the environment, so it never shows
# in the process's command line (``/proc/<pid>/cmdline`` is readable by every local user).
_SMG_WITH_KEY = (
    "import os, runpy, sys; "
    f"key = os.environ.pop({SECRET_ENV!r}); "
    "sys.argv = ['smg', *sys.argv[1:], '--control-plane-api-keys=agentrl:agentrl:admin:' + key]; "
    "runpy.run_module('smg', run_name='__main__', alter_sys=True)"
)
# A new session key goes to the worker holding the fewest keys, then stays there (see module doc).
SESSION_AFFINITY = ("--policy", "manual", "--assignment-mode", "min_group")
# Worker health probing (smg's defaults: every 60 s, 3 failures): a dead engine leaves within ~3 s.
HEALTH_ARGS = ("--health-check-interval-secs", "1", "--health-failure-threshold", "3",
               "--health-check-timeout-secs", "5", "--health-success-threshold", "1")

# Loopback control calls must never go through an http_proxy from the environment.
_OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}))


class RouterError(RuntimeError):
    """The router process failed, or a control call returned an error."""


class FanoutError(RouterError):
    """An RL fan-out call failed on at least one worker; ``.result`` holds smg's full answer."""

    def __init__(self, path: str, result: dict[str, Any]) -> None:
        self.result = result
        failed = ", ".join(f"{f.get('url')}: {f.get('message')}" for f in result.get("failed", []))
        super().__init__(f"fan-out {path!r} failed on {len(result.get('failed', []))} worker(s): {failed}")


@dataclass(frozen=True)
class Worker:
    """One worker as the router's ``/workers`` API reports it."""

    id: str
    url: str
    status: str  # "ready", "pending", "draining", ...
    is_healthy: bool
    labels: dict[str, str] = field(default_factory=dict)

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> Worker:
        return cls(
            id=str(d["id"]),
            url=str(d["url"]),
            status=str(d.get("status", "")),
            is_healthy=bool(d.get("is_healthy", False)),
            labels=dict(d.get("labels") or {}),
        )


def _normalise_url(url: str) -> str:
    return url.rstrip("/")


class SmgRouter:
    """An ``smg launch`` process on ``host:port``, managed through its HTTP control API.

    The router dies with the process that started it, even by SIGKILL. Its output goes to :attr:`log_path`:
    ``log_dir/router-<port>.log`` (kept) when ``log_dir`` is given, else a temp file deleted by :meth:`stop`.
    ``secret`` (default :func:`~agentrl.engine.auth.run_secret`) guards its control plane and is what it
    presents to workers (see module doc).

    >>> with SmgRouter(["http://127.0.0.1:30001"]) as router:   # doctest: +SKIP
    ...     router.add_worker("http://127.0.0.1:30002")
    ...     router.pause(); router.update_weights_from_disk("/ckpt/3", "3"); router.continue_()
    """

    def __init__(
        self,
        worker_urls: tuple[str, ...] | list[str] = (),
        *,
        host: str = "127.0.0.1",
        port: int | None = None,
        enable_rl: bool = True,
        extra_args: tuple[str, ...] | list[str] = (),
        shutdown_grace_s: float = 2.0,
        log_dir: str | Path | None = None,
        secret: str | None = None,
    ) -> None:
        self.host = host
        self.secret = secret or run_secret()
        self._auto_port = port is None  # a port we picked may be taken by a racing process: pick again
        self.port, self._metrics_port = (port, free_port(host)) if port else free_ports(2, host)
        if self._metrics_port == self.port:
            self._metrics_port = free_port(host)
        self.worker_urls = tuple(_normalise_url(u) for u in worker_urls)
        self.enable_rl = enable_rl
        self.extra_args = tuple(extra_args)
        self.shutdown_grace_s = shutdown_grace_s
        self.log_dir = log_dir
        self.log_path: Path | None = None  # set by start()
        self._proc: subprocess.Popen[bytes] | None = None

    # -- process ---------------------------------------------------------------------------------

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def alive(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    @property
    def pid(self) -> int | None:
        return None if self._proc is None else self._proc.pid

    def command(self) -> list[str]:
        """The exact ``smg launch`` command line this router runs (its key comes from the environment; the
        initial workers are registered by :meth:`start`, each with the key)."""
        cmd = [sys.executable, "-c", _SMG_WITH_KEY, "launch", "--host", self.host, "--port", str(self.port),
               *SESSION_AFFINITY]
        # Prometheus gets its own free loopback port: the default 29000 would clash between routers.
        cmd += ["--log-level", "warn", "--prometheus-host", self.host,
                "--prometheus-port", str(self._metrics_port),
                # Without this the default 180 s grace keeps a stopped router alive for minutes.
                "--shutdown-grace-period-secs", str(max(1, int(self.shutdown_grace_s))), *HEALTH_ARGS]
        if self.enable_rl:
            cmd.append("--enable-rl")
        return cmd + list(self.extra_args)

    def start(self, timeout: float = 60.0) -> SmgRouter:
        """Launch the router and wait until it answers ``/health`` and every initial worker is ready."""
        if self._proc is not None:
            raise RouterError("router already started")
        for attempt in range(3):
            try:
                return self._start_once(timeout)
            except RouterError as exc:
                port_clash = "already in use" in str(exc) or "needs its own port" in str(exc)
                if not port_clash or attempt == 2:
                    raise
                ports = free_ports(2, self.host)
                if self._auto_port:
                    self.port = ports[0]
                self._metrics_port = ports[1] if ports[1] != self.port else ports[0]
        raise AssertionError("unreachable")

    def _start_once(self, timeout: float) -> SmgRouter:
        self.log_path = log_file(self.log_dir, f"router-{self.port}.log")
        env = {**os.environ, SECRET_ENV: self.secret}
        self._proc = start_tied_process(self.command(), log_path=self.log_path, env=env)
        try:
            self.wait_healthy(timeout)
            deadline = time.monotonic() + timeout
            for url in self.worker_urls:
                self._register(url)
            for url in self.worker_urls:  # registrations proceed in the background, together
                self._wait_worker_ready(url, deadline)
        except BaseException:
            self.stop()
            raise
        return self

    def wait_healthy(self, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        while True:
            if not self.alive:
                raise RouterError(f"smg exited with code {self._proc.returncode if self._proc else None}:\n"
                                  f"{self.log_tail()}")
            with contextlib.suppress(OSError, RouterError):
                if self._request("GET", "/health", timeout=2.0)[0] == 200:
                    break
            if time.monotonic() > deadline:
                raise RouterError(f"smg not healthy after {timeout:.0f} s:\n{self.log_tail()}")
            time.sleep(0.1)
        if not self.alive:  # the 200 came from whatever else holds the port, and smg died on it
            raise RouterError(f"smg exited while starting:\n{self.log_tail()}")

    def log_tail(self, n_chars: int = 4000) -> str:
        if self.log_path is None:
            return ""
        try:
            return self.log_path.read_bytes()[-n_chars:].decode("utf-8", "replace")
        except OSError:
            return ""

    def stop(self) -> None:
        """Stop the router: SIGTERM, then SIGINT, then SIGKILL to its process group (idempotent)."""
        proc, self._proc = self._proc, None
        # smg drains on SIGTERM (bounded by --shutdown-grace-period-secs); it also honours SIGINT.
        stop_process_group(proc, ((signal.SIGTERM, self.shutdown_grace_s + 3.0), (signal.SIGINT, 3.0),
                                  (signal.SIGKILL, 5.0)))
        self._discard_temp_log()

    def _discard_temp_log(self) -> None:
        if self.log_path is not None and self.log_dir is None:
            with contextlib.suppress(OSError):
                self.log_path.unlink()
            self.log_path = None

    def __enter__(self) -> SmgRouter:
        if self._proc is None:
            self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # -- workers ---------------------------------------------------------------------------------

    def workers(self) -> list[Worker]:
        """Every worker the router knows (ready, pending or draining)."""
        return [Worker.from_json(w) for w in self._json("GET", "/workers").get("workers", [])]

    def worker_id(self, url: str) -> str | None:
        url = _normalise_url(url)
        return next((w.id for w in self.workers() if w.url == url), None)

    def add_worker(self, url: str, timeout: float = 60.0) -> str:
        """Register an engine and wait until the router routes to it; returns the worker id."""
        url = _normalise_url(url)
        worker_id = self._register(url)
        try:
            self._wait_worker_ready(url, time.monotonic() + timeout)
        except RouterError:
            # Do not leave a pending registration retrying in the background for smg's 30 minutes.
            with contextlib.suppress(RouterError, OSError):
                self._json("DELETE", f"/workers/{worker_id}")
            raise
        return worker_id

    def deregister(self, url: str) -> bool:
        """Tell the router to drop the worker at ``url`` (it stops routing to it at once; smg then drains
        it); ``False`` if no such worker is registered. Does not wait for it to be gone."""
        worker_id = self.worker_id(url)
        if worker_id is not None:
            self._json("DELETE", f"/workers/{worker_id}")
        return worker_id is not None

    def _register(self, url: str) -> str:
        answer = self._json("POST", "/workers", {"url": _normalise_url(url), "api_key": self.secret})
        return str(answer.get("worker_id", ""))

    def remove_worker(self, url: str, timeout: float = 30.0) -> None:
        """Deregister an engine (its pinned sessions move to the others) and wait until it is gone."""
        worker_id = self.worker_id(url)
        if worker_id is None:
            raise RouterError(f"no worker with url {url!r}; known: {[w.url for w in self.workers()]}")
        self._json("DELETE", f"/workers/{worker_id}")
        deadline = time.monotonic() + timeout
        while self.worker_id(url) is not None:
            if time.monotonic() > deadline:
                raise RouterError(f"worker {url} still registered {timeout:.0f} s after DELETE")
            time.sleep(0.05)

    def _wait_worker_ready(self, url: str, deadline: float) -> None:
        url = _normalise_url(url)
        while True:
            match = [w for w in self.workers() if w.url == url]
            if match and match[0].status == "ready" and match[0].is_healthy:
                return
            if time.monotonic() > deadline:
                state = f"status {match[0].status!r}" if match else "not registered"
                raise RouterError(f"worker {url} not ready in time ({state}):\n{self.log_tail(1500)}")
            time.sleep(0.05)

    # -- RL control plane (fan-out to every worker) ------------------------------------------------

    def fanout(self, path: str, body: dict[str, Any] | None = None, *, selector: str = ALL_WORKERS,
               allow_partial: bool = False, drop_unreachable: bool = True,
               timeout: float = 600.0) -> dict[str, Any]:
        """POST ``body`` to ``/<path>`` on every worker matching ``selector`` via ``/v1/rl/engine/<path>``.

        Returns smg's answer ``{"results": {worker_id: {url, status, body, ...}}, "failed": [...], ...}``
        plus ``"dropped"``: the urls of unreachable workers that were deregistered. With
        ``drop_unreachable`` an engine that cannot be reached (it died) is removed from the router instead
        of failing the call: it missed this control call (e.g. a weight update), so it must not serve
        again. Any other failure raises :class:`FanoutError`, unless ``allow_partial``.
        """
        if not self.enable_rl:
            raise RouterError("RL fan-out needs the router started with enable_rl=True")
        query = urllib.parse.urlencode({"selector": selector})
        # SGLang rejects a bodyless POST on pause/continue, so always send a JSON object.
        status, payload = self._request("POST", f"/v1/rl/engine/{path.lstrip('/')}?{query}",
                                        body or {}, timeout=timeout)
        if not (status in (200, 207) and isinstance(payload, dict) and "results" in payload):
            raise RouterError(f"fan-out {path!r}: HTTP {status}: {payload}")
        payload["dropped"] = []
        if drop_unreachable:
            dead = [f for f in payload.get("failed", []) if f.get("error") == "upstream_unreachable"]
            for failure in dead:
                with contextlib.suppress(RouterError, OSError):
                    self._json("DELETE", f"/workers/{failure['worker_id']}")
                    payload["dropped"].append(failure["url"])
                    _log.warning("fan-out %s: engine %s unreachable; removed it from the router",
                                 path, failure["url"])
            payload["failed"] = [f for f in payload.get("failed", []) if f.get("url") not in payload["dropped"]]
        if payload["failed"] and not allow_partial:
            raise FanoutError(path, payload)
        return payload

    def pause(self, mode: str | None = None) -> dict[str, Any]:
        """Pause generation on every engine (SGLang ``mode``: abort | retract | in_place)."""
        return self.fanout("pause_generation", {"mode": mode} if mode else {})

    def continue_(self) -> dict[str, Any]:
        """Resume generation on every engine."""
        return self.fanout("continue_generation", {})

    def update_weights_from_disk(self, model_path: str, weight_version: str | None = None, *,
                                 flush_cache: bool = True, allow_missing_manifest: bool = False) -> dict[str, Any]:
        """Every engine loads weights from ``model_path`` (a directory all engines can read), checked against
        its checksum manifest; ``allow_missing_manifest``: a directory without one is loaded unchecked."""
        body: dict[str, Any] = {"model_path": str(model_path), "flush_cache": flush_cache}
        if allow_missing_manifest:
            body["allow_missing_manifest"] = True
        if weight_version is not None:
            body["weight_version"] = str(weight_version)
        return self.fanout("update_weights_from_disk", body)

    def update_weight_version(self, weight_version: str) -> dict[str, Any]:
        return self.fanout("update_weight_version", {"new_version": str(weight_version)})

    def flush_cache(self) -> dict[str, Any]:
        return self.fanout("flush_cache", {})

    # -- transport ---------------------------------------------------------------------------------

    def _json(self, method: str, path: str, body: Any = None) -> dict[str, Any]:
        status, payload = self._request(method, path, body)
        if status >= 400:
            raise RouterError(f"{method} {path}: HTTP {status}: {payload}")
        return payload if isinstance(payload, dict) else {}

    def _request(self, method: str, path: str, body: Any = None, timeout: float = 30.0) -> tuple[int, Any]:
        data = None if body is None else json.dumps(body).encode()
        headers = auth_headers(self.secret)
        if data is not None:
            headers["content-type"] = "application/json"
        req = urllib.request.Request(self.url + path, data=data, method=method, headers=headers)
        try:
            with _OPENER.open(req, timeout=timeout) as resp:
                return resp.status, _decode(resp.read())
        except urllib.error.HTTPError as exc:
            return exc.code, _decode(exc.read())


def _decode(raw: bytes) -> Any:
    if not raw:
        return None
    try:
        return json.loads(raw)
    except ValueError:
        return raw.decode("utf-8", "replace")


class EngineWatch:
    """A thread that takes dead engines out of ``router`` within seconds, and restarts them if asked.

    Every ``interval`` s it checks each engine's process and ``GET /health``; an engine whose process
    exited, or that failed ``failures`` probes in a row, is deregistered (its sessions fail over to the
    others). With ``restart`` it is then started again on its port and re-registered once healthy; it
    serves its start-up weights (and reports their ``weight_version``) until the next weight sync. Start
    it from a thread that lives as long as the engines should: restarted engines are tied to it.
    ``on_event(url, what)`` hears ``"removed"``, ``"restarted"`` and ``"restart failed: ..."`` (logged as
    warnings when it is not given).
    """

    def __init__(self, router: SmgRouter, engines: Sequence[EngineProcess], *, restart: bool = False,
                 interval: float = 1.0, failures: int = 3, probe_timeout: float = 2.0,
                 startup_timeout: float = 300.0, on_event: Callable[[str, str], None] | None = None) -> None:
        self.router = router
        self.engines = list(engines)
        self.restart = restart
        self.interval = interval
        self.failures = failures
        self.probe_timeout = probe_timeout
        self.startup_timeout = startup_timeout
        self.on_event = on_event
        self.removed: set[str] = set()  # urls taken out and (not yet) back
        self._misses: dict[str, int] = {}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> EngineWatch:
        self._thread = threading.Thread(target=self._run, name="engine-watch", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=self.interval + self.probe_timeout + 5)
            self._thread = None

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            for engine in self.engines:
                if self._stop.is_set():
                    return
                try:
                    self.check(engine)
                except Exception:  # the watch must outlive any one failure
                    _log.exception("engine watch: checking %s failed", engine.url)

    def check(self, engine: EngineProcess) -> None:
        """One probe of ``engine``; deregisters (and restarts) it if it is dead."""
        if engine.url in self.removed and not self.restart:
            return
        if engine.alive and self._healthy(engine.url):
            self._misses[engine.url] = 0
            return
        self._misses[engine.url] = misses = self._misses.get(engine.url, 0) + 1
        if engine.alive and misses < self.failures:
            return
        if engine.url not in self.removed:
            self._deregister(engine.url)
        if self.restart:
            self._restart(engine)

    def _healthy(self, url: str) -> bool:
        try:
            with _OPENER.open(url + "/health", timeout=self.probe_timeout) as resp:
                return resp.status == 200
        except OSError:
            return False

    def _deregister(self, url: str) -> None:
        self.removed.add(url)
        self.router.deregister(url)
        self._emit(url, "removed")

    def _restart(self, engine: EngineProcess) -> None:
        engine.stop()
        try:
            engine.start().wait_healthy(self.startup_timeout)
            # smg drains a deleted worker before forgetting it; re-adding its url sooner is refused
            deadline = time.monotonic() + 60
            while self.router.worker_id(engine.url) is not None and time.monotonic() < deadline:
                time.sleep(0.2)
            self.router.add_worker(engine.url)
        except Exception as exc:
            engine.stop()
            self._emit(engine.url, f"restart failed: {type(exc).__name__}: {exc}")
            return
        self.removed.discard(engine.url)
        self._misses[engine.url] = 0
        self._emit(engine.url, "restarted")

    def _emit(self, url: str, what: str) -> None:
        if self.on_event is not None:
            self.on_event(url, what)
        else:
            _log.warning("engine %s: %s", url, what)
