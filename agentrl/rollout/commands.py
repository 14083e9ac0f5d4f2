"""``agentrl rollout`` (rollout only: episodes to a Samples JSONL) and ``agentrl eval`` (held-out pass@k).

Both start embedded engines behind smg for a local model directory, run the environment's episodes
through them (:meth:`~agentrl.rollout.manager.RolloutManager.rollout`, the training path's episode pool)
and stop everything on exit.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from agentrl.envs import load_function
from agentrl.envs.task_files import read_jsonl
from agentrl.rollout.buffer import save_samples_jsonl
from agentrl.rollout.manager import RolloutManager, RolloutSettings
from agentrl.rollout.model_path import local_model_dir


def _parser(prog: str, description: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog, description=description)
    p.add_argument("model", type=local_model_dir, help="local HF model directory (weights, tokenizer, chat template)")
    p.add_argument("--env", default="agentrl.envs.arithmetic:ArithmeticToolEnv", help="module:Environment")
    p.add_argument("--tasks", default="agentrl.envs.arithmetic:make_tasks",
                   help="module:fn(n, *, seed, split, **task_kwargs) -> tasks, or a JSONL file of task objects")
    p.add_argument("--task-kwargs", default='{"multi_turn": true}', type=json.loads, help="JSON object")
    p.add_argument("--num-tasks", type=int, default=200, help="tasks to play (of a JSONL file: its first ones)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--engines", type=int, default=1)
    p.add_argument("--max-new-tokens", type=int, default=48)
    p.add_argument("--concurrency", type=int, default=64)
    p.add_argument("--policy", default="realign", choices=["realign", "fork", "truncate"])
    return p


def _with_engines(args: argparse.Namespace, split: str, temperature: float,
                  play: Callable[[RolloutManager, list[Any]], Awaitable[Any]]) -> Any:
    """Read the tasks (a bad file fails here, before any engine starts), start engines + router for
    ``args.model``, await ``play(manager, tasks)``, stop everything."""
    if args.tasks.endswith(".jsonl"):
        tasks = read_jsonl_tasks(args.tasks)[: args.num_tasks]
    else:
        tasks = load_function(args.tasks)(args.num_tasks, seed=args.seed, split=split, **args.task_kwargs)
    settings = RolloutSettings(num_engines=args.engines, temperature=temperature, max_new_tokens=args.max_new_tokens,
                               concurrency=args.concurrency, policy=args.policy)
    manager = RolloutManager(args.model, load_function(args.env), settings).start()

    async def go() -> Any:
        try:
            return await play(manager, tasks)
        finally:
            await manager.aclose_client()

    try:
        return asyncio.run(go())
    finally:
        manager.shutdown()


def rollout_main(argv: list[str] | None = None) -> int:
    p = _parser("agentrl rollout", "Run episodes through embedded engines and save their Samples as JSONL.")
    p.add_argument("--output", required=True, help="Samples JSONL to write (read by train-only debugging)")
    p.add_argument("--split", default="train", choices=["train", "heldout"])
    p.add_argument("--samples-per-task", type=int, default=8)
    p.add_argument("--temperature", type=float, default=1.0)
    args = p.parse_args(argv)
    batch = _with_engines(args, args.split, args.temperature,
                          lambda manager, tasks: manager.rollout(tasks, args.samples_per_task))
    n = save_samples_jsonl((s for g in batch.groups for s in g), args.output)
    print(json.dumps({"samples": n, "output": args.output, **batch.metrics}))
    return 0


def read_jsonl_tasks(path: str) -> list[dict[str, Any]]:
    """The tasks of a JSONL file; a bad or empty file is a ``SystemExit`` naming it (before any engine starts)."""
    try:
        tasks = read_jsonl(path)
    except ValueError as err:
        raise SystemExit(f"--tasks {err}") from None
    if not tasks:
        raise SystemExit(f"--tasks {path}: no tasks in the file")
    return tasks


def eval_main(argv: list[str] | None = None) -> int:
    p = _parser("agentrl eval", "Held-out pass@k and mean@k of a model on an environment: one greedy episode "
                "per task and, with --k above 1, k sampled ones; per task family, with 95% intervals.")
    p.add_argument("--k", type=int, default=1, help="sampled episodes per task (pass@1, 2, 4, ..., k); 1: greedy only")
    p.add_argument("--temperature", type=float, default=1.0, help="temperature of the sampled episodes")
    p.add_argument("--family-key", default="family", help="task field naming its family (absent: family 'all')")
    p.add_argument("--threshold", type=float, default=1.0, help="an episode passes when its reward reaches this")
    p.add_argument("--out", help="write the result JSON here too")
    args = p.parse_args(argv)
    if args.k < 1:
        p.error(f"--k must be at least 1, got {args.k}")
    from agentrl.rollout.passk import evaluate_passk, headline

    result = _with_engines(args, "heldout", 0.0, lambda manager, tasks: evaluate_passk(
        manager, tasks, k=args.k, temperature=args.temperature, family_key=args.family_key, threshold=args.threshold))
    report = {"model": args.model, "env": args.env, "tasks": args.tasks, "k": args.k, **headline(result), **result}
    text = json.dumps(report, indent=2)
    if args.out:
        Path(args.out).write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(eval_main())
