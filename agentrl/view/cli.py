"""``agentrl view RUN_DIR [--export FILE.html]``: serve the run's viewer on loopback, or write it to a file."""

from __future__ import annotations

import argparse
import socket
import sys

from agentrl.engine.launch import is_loopback
from agentrl.view.run_dir import RunDir, RunDirError


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="agentrl view", description=__doc__.splitlines()[0])
    parser.add_argument("run_dir", help="a run's output directory (holds samples/, metrics.jsonl, checkpoints/)")
    parser.add_argument("--export", metavar="FILE.html", help="write one self-contained HTML file and exit")
    parser.add_argument("--max-samples", type=int, default=200, help="--export: samples per step (0: all)")
    parser.add_argument("--tokenizer", help="tokenizer directory for token text (default: the run's hf/final)")
    parser.add_argument("--host", default="127.0.0.1", help="bind address (loopback unless --allow-remote)")
    parser.add_argument("--port", type=int, default=8765, help="port (0: any free one)")
    parser.add_argument("--allow-remote", action="store_true",
                        help="allow a non-loopback --host: anyone who reaches it reads the run's samples")
    return parser


def _fail(message: str) -> int:
    print(f"agentrl view: {message}", file=sys.stderr)
    return 2


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if not is_loopback(args.host.strip("[]")) and not args.allow_remote:
        return _fail(f"--host {args.host} is not a loopback address; pass --allow-remote to serve beyond "
                     "this machine")
    try:
        run = RunDir(args.run_dir)
        from agentrl.trajectory.dump import load_decoder
        from agentrl.view.tokens import cached_decoder

        tokenizer = args.tokenizer or run.tokenizer_dir()
        decode = cached_decoder(load_decoder(str(tokenizer)) if tokenizer else None)
        for error in run.metrics()[1]:
            print(f"agentrl view: skipped {error}", file=sys.stderr)
        if args.export:
            from agentrl.view.export import export_html

            for step in run.steps():  # served, a step's bad lines show on the page when it is opened
                for error in run.index(step).errors:
                    print(f"agentrl view: skipped {error}", file=sys.stderr)
            counts = export_html(run, decode, args.export, max_samples=args.max_samples)
            print(f"wrote {args.export}: {counts['samples']} samples of {counts['steps']} steps, "
                  f"{counts['bytes']} bytes")
            return 0
    except (RunDirError, OSError, ValueError) as exc:
        return _fail(str(exc))
    return serve(run, decode, args.host, args.port, allow_remote=args.allow_remote)


def serve(run: RunDir, decode, host: str, port: int, *, allow_remote: bool) -> int:
    import uvicorn

    from agentrl.view.app import create_app

    app = create_app(run, decode, allowed_hosts=["*"] if allow_remote else None)
    try:
        sock = socket.create_server((host.strip("[]"), port), family=socket.AF_INET6 if ":" in host
                                    else socket.AF_INET)
    except OSError as exc:
        return _fail(f"cannot listen on {host}:{port} ({exc.strerror or exc})")
    bound = sock.getsockname()[1]
    shown = f"[{host.strip('[]')}]" if ":" in host else host
    print(f"agentrl view: serving {run.root} at http://{shown}:{bound}/ (Ctrl-C stops)", flush=True)
    config = uvicorn.Config(app, log_level="warning")
    uvicorn.Server(config).run(sockets=[sock])
    return 0
