"""Greedy eval of a model dir on held-out and train splits; dumps per-episode rows (task, reward, messages)."""

import asyncio
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[4]))  # the repo root
from agentrl.rollout.episode_pool import example_row
from agentrl.rollout.manager import RolloutManager, RolloutSettings
from examples.coding_agent.function_env import FunctionEnv, make_tasks

model, out, n = sys.argv[1], sys.argv[2], int(sys.argv[3])
mnt = int(sys.argv[4]) if len(sys.argv) > 4 else 64
splits = [("heldout", 0), ("train", 12345)]
settings = RolloutSettings(num_engines=1, temperature=0.0, max_new_tokens=mnt, concurrency=32)
manager = RolloutManager(model, FunctionEnv, settings).start()
rows = []


async def go():
    try:
        for split, seed in splits:
            tasks = make_tasks(n, seed=seed, split=split)
            by_prompt = {t["prompt"]: t for t in tasks}
            t0 = time.time()
            batch = await manager.rollout(tasks, 1, temperature=0.0)
            seen = {}
            for i, s in enumerate(example_row(e) for e in batch.episodes if e.samples):
                md = s["metadata"]
                msgs = md["messages"]
                seen[i] = dict(
                    split=split,
                    reward=s["reward"],
                    messages=msgs,
                    stop=md.get("stop_reason"),
                    ill=md.get("ill_formed_turns"),
                    task=by_prompt[msgs[1]["content"]],
                )
            rows.extend(seen.values())
            acc = sum(r["reward"] for r in seen.values()) / len(tasks)
            print(
                json.dumps(
                    {
                        "model": model,
                        "split": split,
                        "n": len(tasks),
                        "episodes": len(seen),
                        "acc": acc,
                        "s": time.time() - t0,
                    }
                ),
                flush=True,
            )
    finally:
        await manager.aclose_client()


try:
    asyncio.run(go())
finally:
    manager.shutdown()
Path(out).write_text(json.dumps(rows, default=str))
