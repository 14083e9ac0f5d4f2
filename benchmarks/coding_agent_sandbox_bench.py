"""The coding agent's sandbox traffic of one GRPO step, without the model: ``--episodes`` scripted episodes
(write the reference body, run the visible tests, submit, reward = hidden tests in a grading sandbox),
``--concurrency`` at once, through ``FunctionEnv`` and its pools, for each grading-pool size.

    python3 benchmarks/coding_agent_sandbox_bench.py [--graders 4,8] [--pool 16] [--episodes 128] [--steps 3]

Prints a table (seconds per step, grade latency including the wait for a grading sandbox, episodes per
second) and writes benchmarks/results/coding_agent_sandbox_bench.json. It is what bounds a rollout
of the CPU config from below: the tiny model's generation adds to it. Load average is recorded: on 2
shared cores it moves these numbers more than any change.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from examples.coding_agent import function_env  # noqa: E402


def pct(values: list[float], q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, int(q * len(s)))]


async def episode(env_cls: type, task: dict, gate: asyncio.Semaphore, grades: list[float]) -> float:
    async with gate:
        env = env_cls()
        env.reset(task)
        try:
            await env.write(function_env._body(task))
            await env.run_tests()
            env.submit()
            t0 = time.perf_counter()
            reward = await env.reward()
            grades.append(time.perf_counter() - t0)
            return reward
        finally:
            await env.close()


async def bench(graders: int, pool: int, episodes: int, concurrency: int, steps: int) -> dict:
    env_cls = type("Env", (function_env.FunctionEnv,), {"pool_size": pool, "grader_pool_size": graders})
    tasks = function_env.make_tasks(episodes, seed=0, split="train")
    agent_pool, grader = env_cls()._shared()
    await asyncio.to_thread(agent_pool.start)
    await asyncio.to_thread(grader.pool.start)
    walls, grades = [], []
    try:
        for step in range(steps + 1):  # step 0 warms the pools up and is not counted
            gate, step_grades = asyncio.Semaphore(concurrency), []
            t0 = time.perf_counter()
            rewards = await asyncio.gather(*(episode(env_cls, t, gate, step_grades) for t in tasks))
            wall = time.perf_counter() - t0
            if min(rewards) != 1.0:
                raise RuntimeError(f"a reference body failed its hidden tests: {rewards}")
            if step:
                walls.append(wall)
                grades.extend(step_grades)
    finally:
        await asyncio.to_thread(function_env.close_sandboxes)
    return {"graders": graders, "pool": pool, "episodes": episodes, "concurrency": concurrency, "steps": steps,
            "step_s": statistics.median(walls), "step_s_all": walls,
            "episodes_per_s": episodes / statistics.median(walls),
            "grade_p50_ms": 1000 * pct(grades, 0.5), "grade_p99_ms": 1000 * pct(grades, 0.99)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--graders", default="4,8", help="grading-pool sizes, comma separated")
    ap.add_argument("--pool", type=int, default=function_env.FunctionEnv.pool_size)
    ap.add_argument("--episodes", type=int, default=128)
    ap.add_argument("--concurrency", type=int, default=64)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--out", default=str(ROOT / "benchmarks/results/coding_agent_sandbox_bench.json"))
    args = ap.parse_args(argv)

    load_start = os.getloadavg()[0]
    rows = [asyncio.run(bench(int(g), args.pool, args.episodes, args.concurrency, args.steps))
            for g in args.graders.split(",")]
    out = {"cpus": os.cpu_count(), "loadavg_start": load_start, "loadavg_end": os.getloadavg()[0], "rows": rows}
    print(f"cpus={out['cpus']}  load avg {load_start:.1f} -> {out['loadavg_end']:.1f}  "
          f"({args.episodes} episodes per step, {args.concurrency} at once, agent pool {args.pool})")
    print(f"{'graders':>8}{'s/step':>9}{'episodes/s':>12}{'grade p50 ms':>14}{'grade p99 ms':>14}")
    for r in rows:
        print(f"{r['graders']:>8}{r['step_s']:>9.2f}{r['episodes_per_s']:>12.1f}{r['grade_p50_ms']:>14.0f}"
              f"{r['grade_p99_ms']:>14.0f}")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
