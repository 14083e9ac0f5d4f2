"""``agentrl train [CONFIG.yaml] [--output-dir DIR] [--resume] [--print-config] [--section.field VALUE ...]``.

The config is loaded and fully validated before Ray or any engine starts. SIGINT (Ctrl-C) and SIGTERM
stop a run, also one started in the background (which inherits SIGINT ignored): the step in flight is
abandoned, a checkpoint or metric row being written is completed, and every episode, environment resource
(``close_resources()``), engine, router, agent process and Ray actor is stopped on the way out (at most a
few minutes, each wait bounded); the exit status is 128 + the signal's number (130, 143).
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
from typing import Any

from pydantic import ValidationError


def main(argv: list[str] | None = None) -> int:
    import os

    from agentrl.run.config import load_config

    # Plug-in paths name the user's own modules (`examples.search_r1.env:...`, `mypkg.env:MyEnv`) relative
    # to where they run, as `python -m` would find them; the `agentrl` console script alone would not.
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())

    parser = argparse.ArgumentParser(
        prog="agentrl train", description=__doc__,
        epilog="Any config field can be overridden as --section.field VALUE (e.g. --rollout.num_engines 1); "
               "docs/config.md lists them all.")
    parser.add_argument("--output-dir", help="where metrics.jsonl, reward_curve.png, checkpoints/ and logs/ go")
    parser.add_argument("--resume", action="store_true", help="continue from OUTPUT_DIR/checkpoints/latest")
    parser.add_argument("--overwrite", action="store_true", help="replace the run OUTPUT_DIR holds (its checkpoints and metrics)")
    parser.add_argument("--print-config", action="store_true", help="print the resolved config as JSON and exit")
    parser.add_argument("--train-only", metavar="SAMPLES_JSONL",
                        help="debug mode: train on saved Samples (from `agentrl rollout`), no engines")
    argv = list(sys.argv[1:] if argv is None else argv)
    # The optional YAML path comes first; everything after the known flags is a config override.
    config = argv.pop(0) if argv and not argv[0].startswith("-") else None
    parser.usage = "agentrl train [CONFIG.yaml] [--output-dir DIR] [--resume | --overwrite] [--print-config] [--section.field VALUE ...]"
    args, rest = parser.parse_known_args(argv)
    if args.output_dir:
        rest += ["--output_dir", args.output_dir]
    try:
        cfg = load_config(config, rest)
    except (ValidationError, ValueError, OSError) as err:
        print(f"agentrl train: invalid config: {err}", file=sys.stderr)
        return 2
    if args.print_config:
        print(cfg.model_dump_json(indent=2))
        return 0
    from agentrl.run import stopping

    with stopping.handling():  # SIGINT/SIGTERM from here on stop the run (and the handlers are put back after)
        try:
            return _train(cfg, args)
        except KeyboardInterrupt:
            signum = stopping.requested() or signal.SIGINT
            print(f"agentrl train: stopped by {stopping.signal_name(signum)}", file=sys.stderr, flush=True)
            return 128 + signum


def _train(cfg: Any, args: argparse.Namespace) -> int:
    if args.train_only:
        from agentrl.run.train_only import train_from_samples

        out = train_from_samples(cfg, args.train_only)
        print(json.dumps({"output_dir": str(out), "steps": sum(1 for _ in (out / "metrics.jsonl").open())}))
        return 0
    from agentrl.run.bookkeeping import RunDirError
    from agentrl.run.data import DataError
    from agentrl.run.failure_watch import AllEpisodesFailedError
    from agentrl.run.schedules import train

    try:
        out = train(cfg, resume=args.resume, overwrite=args.overwrite)
    except (RunDirError, DataError) as err:  # raised before Ray or any engine starts
        print(f"agentrl train: {err}", file=sys.stderr)
        return 2
    except AllEpisodesFailedError as err:
        print(f"agentrl train: {err}", file=sys.stderr)
        return 1
    evals = [r for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines())
             if "step" in r and "eval_accuracy" in r]  # warm-up rows carry warmup_step instead
    print(json.dumps({"output_dir": str(out), "first_eval": evals[0]["eval_accuracy"],
                      "last_eval": evals[-1]["eval_accuracy"]}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
