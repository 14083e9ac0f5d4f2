"""``agentrl serve``: N embedded engines behind one smg router, in one command; Ctrl-C stops everything.

    agentrl serve --model DIR --engines 2 --port 30000 [--dtype float32] [--host 127.0.0.1]

Prints the router URL on stdout once the router and every engine are healthy, then serves until
SIGINT or SIGTERM. An engine that dies while serving is taken out of the router within seconds and
reported on stderr (and started again with ``--restart-dead-engines``); the command exits with status 1
if the router itself dies. Every child dies with this process, even when it is SIGKILLed.

``/generate`` is open; weight-update and control routes of the engines and the router need
``Authorization: Bearer $AGENTRL_ENGINE_SECRET`` (set it to choose the secret; unset, a random one is
used and control calls from outside are impossible). Each engine gets ``--cpus`` (default: the cores
this process may use) divided by ``--engines`` torch threads.
"""

from __future__ import annotations

import argparse
import shlex
import signal
import sys
import threading
import time
from pathlib import Path
from types import FrameType
from typing import Any


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="agentrl serve", description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True, help="local HF model directory (config.json + weights)")
    p.add_argument("--engines", type=int, default=1, help="number of embedded engine processes (default 1)")
    p.add_argument("--port", type=int, default=30000, help="router port (default 30000)")
    p.add_argument("--host", default="127.0.0.1",
                   help="bind address of the router and the engines (default loopback; others warn)")
    p.add_argument("--cpus", type=int, default=None,
                   help="CPU cores the engines share (default: those this process may run on)")
    p.add_argument("--restart-dead-engines", action="store_true", help="start a dead engine again")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--engine-args", default="", help="extra engine flags, one shell-quoted string")
    p.add_argument("--router-args", default="", help="extra `smg launch` flags, one shell-quoted string")
    p.add_argument("--startup-timeout", type=float, default=300.0, help="seconds to wait for health")
    return p


def model_and_port_problem(model_dir: str, port: int) -> str | None:
    """Why ``--model`` / ``--port`` cannot serve, or None (shared by ``serve`` and ``gateway``)."""
    if not 0 < port < 65536:
        return f"--port must be in 1..65535, got {port}"
    model = Path(model_dir)
    if not model.is_dir():
        return f"--model {model_dir!r} is not a directory"
    if not (model / "config.json").is_file():
        return f"--model {model_dir!r} has no config.json (is it a HF model directory?)"
    return None


def _check_args(args: argparse.Namespace) -> str | None:
    if args.engines < 1:
        return f"--engines must be >= 1, got {args.engines}"
    if args.cpus is not None and args.cpus < 1:
        return f"--cpus must be >= 1, got {args.cpus}"
    return model_and_port_problem(args.model, args.port)


def _wait_healthy(engines: list, stop: threading.Event, deadline: float) -> bool:
    """Wait until every engine is healthy (True) or ``stop`` is set (False); ``EngineStartError`` for one
    that died or missed ``deadline`` (a monotonic time)."""
    from agentrl.engine.launch import EngineStartError

    for engine in engines:
        while not stop.is_set():
            try:
                engine.wait_healthy(timeout=min(1.0, max(0.0, deadline - time.monotonic())))
                break
            except EngineStartError:
                if not engine.alive:  # it may have died just after a 1 s poll timed out: say so
                    code = engine.proc.returncode if engine.proc else None
                    raise EngineStartError(f"engine exited with code {code} before becoming healthy:\n"
                                           f"{engine.log_tail()}") from None
                if time.monotonic() > deadline:
                    raise
        if stop.is_set():
            return False
    return True


def _report(url: str, what: str) -> None:
    print(f"agentrl serve: engine {url}: {what}", file=sys.stderr, flush=True)


def _serve(args: argparse.Namespace, engines: list, secret: str, threads: int, stop: threading.Event,
           running: dict[str, Any]) -> int:
    """Start the engines and the router, print its URL and serve until ``stop``; the exit status.
    What was started is put in ``running`` (``router``, ``watch``) for the caller to stop."""
    from agentrl.rollout.router import EngineWatch, SmgRouter

    for engine in engines:  # all start at once; loading overlaps
        engine.start()
    deadline = time.monotonic() + args.startup_timeout
    if not _wait_healthy(engines, stop, deadline):
        return 130
    router = running["router"] = SmgRouter([e.url for e in engines], host=args.host, port=args.port,
                                           extra_args=shlex.split(args.router_args), secret=secret)
    router.start(timeout=max(10.0, deadline - time.monotonic()))
    print(router.url, flush=True)
    print(f"agentrl serve: router {router.url} -> engines {', '.join(e.url for e in engines)} "
          f"({threads} thread(s) each); Ctrl-C stops all", file=sys.stderr, flush=True)
    # Runs in this (main) thread's lifetime: engines it restarts are tied to its thread, which lives
    # until the caller's finally clause.
    running["watch"] = EngineWatch(router, engines, restart=args.restart_dead_engines, on_event=_report).start()
    while not stop.wait(0.5):
        if not router.alive:
            print(f"agentrl serve: router exited:\n{router.log_tail(2000)}", file=sys.stderr)
            return 1
    return 0


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    problem = _check_args(args)
    if problem:
        print(f"agentrl serve: {problem}", file=sys.stderr)
        return 2

    from agentrl.engine.auth import run_secret
    from agentrl.engine.launch import EngineProcess, non_loopback_warning, threads_per_engine

    warning = non_loopback_warning(args.host)
    if warning:
        print(f"agentrl serve: warning: {warning}", file=sys.stderr, flush=True)
    stop = threading.Event()

    def on_signal(signum: int, frame: FrameType | None) -> None:
        stop.set()

    previous = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGINT, signal.SIGTERM)}
    model_dir = str(Path(args.model).resolve())
    secret = run_secret()
    threads = threads_per_engine(args.engines, args.cpus)
    engines = [EngineProcess(model_dir, host=args.host, dtype=args.dtype, extra_args=shlex.split(args.engine_args),
                             secret=secret, threads=threads) for _ in range(args.engines)]
    running: dict[str, Any] = {}
    try:
        return _serve(args, engines, secret, threads, stop, running)
    except Exception as exc:  # startup failed: say why, then clean up below
        print(f"agentrl serve: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    finally:
        # Ignore further Ctrl-C while children are being stopped, so none is left behind.
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        for name in ("watch", "router"):
            if name in running:
                running[name].stop()
        for engine in engines:
            engine.stop()
        for sig, handler in previous.items():
            signal.signal(sig, handler)


if __name__ == "__main__":
    raise SystemExit(main())
