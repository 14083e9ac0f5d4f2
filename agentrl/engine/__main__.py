"""``python -m agentrl.engine --model DIR --port N``: serve a local HF causal LM with SGLang's native API.

Control routes need the secret in ``$AGENTRL_ENGINE_SECRET`` (or ``--api-key``, which every local user
can read from the command line); without one they are disabled.
"""

from __future__ import annotations

import argparse
import os
import sys

from agentrl.engine.auth import SECRET_ENV
from agentrl.engine.launch import non_loopback_warning
from agentrl.engine.scheduler import MAX_BATCH_SIZE


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m agentrl.engine", description=__doc__)
    p.add_argument("--model", "--model-path", dest="model", required=True, help="local HF model directory")
    p.add_argument("--host", default="127.0.0.1", help="bind address (default loopback; others warn)")
    p.add_argument("--api-key", default=None,
                   help="the control routes' secret (prefer $AGENTRL_ENGINE_SECRET: a flag is visible to ps)")
    p.add_argument("--port", type=int, default=30000)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--device", default=None, help="cpu | cuda | cuda:N (default: cuda when available)")
    p.add_argument("--max-batch-size", "--max-running-requests", dest="max_batch_size", type=int,
                   default=MAX_BATCH_SIZE)
    p.add_argument("--max-prefill-tokens", type=int, default=8192, help="new prompt tokens per prefill batch")
    p.add_argument("--admit-wait-ratio", type=float, default=4.0,
                   help="while rows run, waiting requests join once the oldest waited this many admissions' cost "
                        "(0: before every step)")
    p.add_argument("--prefix-cache-tokens", type=int, default=65536, help="token budget of the prefix KV cache")
    p.add_argument("--weight-version", default="default")
    p.add_argument("--enable-memory-saver", action="store_true", help="CUDA only: use torch_memory_saver")
    p.add_argument("--num-threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    p.add_argument("--null-model", default=None, metavar="SCRIPT.json",
                   help="answer from a script at once instead of running the model (agentrl.engine.null_model): "
                        "the host cost of serving alone, for benchmarks")
    p.add_argument("--log-level", default="warning")
    return p


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    # fail fast, before the slow torch/transformers imports, on a path that cannot be a model
    if not os.path.isfile(os.path.join(args.model, "config.json")):
        parser.error(f"--model {args.model!r} is not a local model directory (no config.json)")
    # Taken out of the environment, so nothing this engine spawns inherits it.
    secret = args.api_key or os.environ.pop(SECRET_ENV, None) or None
    warning = non_loopback_warning(args.host)
    if warning:
        print(f"agentrl engine: {warning}", file=sys.stderr, flush=True)
    import uvicorn

    if args.num_threads:
        import torch

        torch.set_num_threads(args.num_threads)

    from agentrl.engine.engine import Engine, EngineConfig
    from agentrl.engine.server import create_app

    config = EngineConfig(
        model_path=os.path.abspath(args.model),  # smg must see a local path, not a hub id
        dtype=args.dtype,
        device=args.device,
        max_batch_size=args.max_batch_size,
        max_prefill_tokens=args.max_prefill_tokens,
        admit_wait_ratio=args.admit_wait_ratio,
        prefix_cache_tokens=args.prefix_cache_tokens,
        weight_version=args.weight_version,
        host=args.host,
        port=args.port,
        enable_memory_saver=args.enable_memory_saver,
        lean_decode=False if args.null_model else None,
    )
    runner = None
    if args.null_model:
        from agentrl.engine.null_model import NullRunner, NullScript

        try:
            runner = NullRunner(config.model_path, NullScript.load(args.null_model))
        except ValueError as exc:
            parser.error(str(exc))
    engine = Engine(config, runner=runner)
    uvicorn.run(create_app(engine, secret=secret), host=args.host, port=args.port, log_level=args.log_level, access_log=False)
    return 0


if __name__ == "__main__":
    sys.exit(main())
