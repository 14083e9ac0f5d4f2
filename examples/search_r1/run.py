"""Run Search-R1 episodes and write their Samples as JSONL.

    python -m examples.search_r1.run --url http://127.0.0.1:30000 --model MODEL_DIR --split heldout --n 50
    python -m examples.search_r1.run --scripted --model MODEL_DIR --n 10     # the expert policy, no engine

``--url`` is an smg router or one engine (SGLang ``/generate`` API); the session id is the routing key.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from pathlib import Path


async def run(args: argparse.Namespace) -> dict:
    from transformers import AutoTokenizer

    from agentrl.envs import ChatRenderer, generate_rollout
    from examples.search_r1.env import SearchR1Env, expert_replies
    from examples.search_r1.questions import make_questions

    tasks = make_questions(args.n, split=args.split, seed=args.seed)
    renderer = ChatRenderer(AutoTokenizer.from_pretrained(args.model))
    client = None
    if args.scripted:
        from agentrl.envs.scripted import ScriptedPolicy

        scripts = {t["question"]: expert_replies(t) for t in tasks}

        def reply(prompt_text: str, turn: int) -> str:
            question = next(q for q in scripts if q in prompt_text)
            return scripts[question][min(turn, len(scripts[question]) - 1)]

        generate = ScriptedPolicy(renderer.tokenizer, reply)
    else:
        from agentrl.rollout.client import RolloutClient

        client = RolloutClient(args.url)
        generate = client.generate_turn
    try:
        result = await generate_rollout(
            SearchR1Env, tasks, generate, renderer, n_samples_per_task=args.samples,
            concurrency=args.concurrency, max_context_tokens=args.context,
            sampling_params={"temperature": args.temperature, "max_new_tokens": args.max_new_tokens},
        )
    finally:
        if client is not None:
            await client.aclose()
    if args.out:
        with Path(args.out).open("w") as f:
            for sample in result.samples:
                f.write(sample.to_json() + "\n")
    return result.summary()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m examples.search_r1.run", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True, help="model directory (its tokenizer renders the chats)")
    parser.add_argument("--url", help="router or engine base URL")
    parser.add_argument("--scripted", action="store_true", help="use the expert policy instead of a model")
    parser.add_argument("--split", default="heldout", choices=["train", "heldout"])
    parser.add_argument("--n", type=int, default=20, help="questions")
    parser.add_argument("--samples", type=int, default=1, help="episodes per question (a GRPO group)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--max-new-tokens", type=int, default=256)
    parser.add_argument("--context", type=int, default=None, help="the model's context length")
    parser.add_argument("--out", help="write Samples as JSONL here")
    args = parser.parse_args(argv)
    if not args.scripted and not args.url:
        parser.error("give --url (a router or engine) or --scripted")
    print(json.dumps(asyncio.run(run(args)), indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
