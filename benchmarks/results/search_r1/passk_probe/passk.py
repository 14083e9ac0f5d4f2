"""Probe: what can a warm model sample? For each checkpoint, one engine (python -m agentrl.engine, one
thread) and the run's agent loop (generate_rollout, SearchR1Env) on three pools of questions: the run's
held-out evaluation (100 real, 50 one-hop + 50 two-hop), 100 of GRPO's real questions, 100 made-up ones.
Per pool: greedy exact match, and at each temperature k samples per question: mean exact match (sampled
pass@1), pass@k (some sample right), groups with reward variance; and where greedy episodes fail.

nice -n 19 python benchmarks/results/search_r1/passk_probe/passk.py OUT.jsonl CKPT_DIR... [--k 16] [--temps 0.7,1.0]
"""
import argparse
import asyncio
import json
import os
import socket
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import yaml


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def pools(kw: dict) -> dict[str, list]:
    from examples.search_r1.questions import make_questions

    real = {**kw, "train_synthetic": 0.0, "train_search_credit": 0.0}
    return {
        "heldout": make_questions(100, seed=0, split="heldout", **kw),
        "train": make_questions(100, seed=12345, split="train", **real),
        "synthetic": make_questions(100, seed=777, split="train", **{**real, "train_synthetic": 1.0}),
    }


def first_hits(task: dict, queries: list[str]) -> list[tuple[str, str] | None]:
    from examples.search_r1.env import default_index
    from examples.search_r1.synthetic import task_index

    index = task_index(tuple(map(tuple, task["docs"]))) if task.get("docs") else default_index()
    out = []
    for q in queries:
        hits = index.search(q, k=1)
        out.append((hits[0].country, hits[0].field) if hits else None)
    return out


def diagnose(episode) -> str:
    """Where a greedy episode went wrong: ok, no_search, q1 (first search did not find the expert's first
    document), q2 (second), answer (searches right, answer wrong), format (no answer tag)."""
    from agentrl.envs.formats import HermesFormat

    task = episode.task
    if episode.metrics.reward >= 1:
        return "ok"
    fmt = HermesFormat()
    queries, final = [], ""
    for m in episode.messages:
        if m["role"] == "assistant":
            parsed = fmt.parse(m["content"] or "")
            calls = [c for c in parsed.calls if c.name == "search"] if parsed.calls else []
            queries += [str(c.arguments.get("query", "")) for c in calls]
            if not calls:
                final = m["content"] or ""
    need = [tuple(e) for e in task["evidence"]]
    found = first_hits(task, queries)
    for i, doc in enumerate(need):
        if doc not in found:
            return "no_search" if not queries else f"q{i + 1}"
    return "answer" if "<answer>" in final else "format"


async def run_pool(url: str, renderer, tasks: list, k: int, temperature: float):
    from agentrl.envs import generate_rollout
    from agentrl.rollout.client import RolloutClient
    from examples.search_r1.env import SearchR1Env

    client = RolloutClient(url)
    try:
        return await generate_rollout(SearchR1Env, tasks, client.generate_turn, renderer, n_samples_per_task=k,
                                      concurrency=64, max_context_tokens=512,
                                      sampling_params={"temperature": temperature, "max_new_tokens": 64})
    finally:
        await client.aclose()


def measure(ckpt: Path, qs: dict, k: int, temps: list[float], which: list[str]) -> dict:
    import httpx
    from transformers import AutoTokenizer

    from agentrl.envs import ChatRenderer

    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "agentrl.engine", "--model", str(ckpt), "--port", str(port),
                             "--num-threads", "1", "--max-batch-size", "64"], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        for _ in range(600):
            try:
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        renderer = ChatRenderer(AutoTokenizer.from_pretrained(ckpt))
        row: dict = {"ckpt": str(ckpt)}
        for name in which:
            tasks = qs[name]
            greedy = asyncio.run(run_pool(url, renderer, tasks, 1, 0.0))
            eps = greedy.episodes
            row[f"{name}/greedy"] = sum(e.metrics.reward >= 1 for e in eps) / len(eps)
            for hops in (1, 2):
                sub = [e for e in eps if len(e.task["evidence"]) == hops]
                row[f"{name}/greedy_{hops}hop"] = sum(e.metrics.reward >= 1 for e in sub) / max(len(sub), 1)
            row[f"{name}/greedy_fail"] = dict(Counter(diagnose(e) for e in eps))
            row[f"{name}/greedy_searches"] = sum(e.metrics.tool_calls for e in eps) / len(eps)
            for t in temps:
                res = asyncio.run(run_pool(url, renderer, tasks, k, t))
                means = [sum(e.metrics.reward >= 1 for e in g) / len(g) for g in res.groups]
                row[f"{name}/T{t}/pass1"] = sum(means) / len(means)
                row[f"{name}/T{t}/pass{k}"] = sum(m > 0 for m in means) / len(means)
                row[f"{name}/T{t}/mixed"] = sum(0 < m < 1 for m in means) / len(means)
                row[f"{name}/T{t}/fail"] = dict(Counter(diagnose(e) for e in res.episodes))
        return row
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("out")
    p.add_argument("ckpts", nargs="+")
    p.add_argument("--k", type=int, default=16)
    p.add_argument("--temps", default="0.7,1.0")
    p.add_argument("--pools", default="heldout,train,synthetic")
    p.add_argument("--set", nargs="*", default=[], help="task_kwargs overrides key=json")
    a = p.parse_args()
    kw = yaml.safe_load(Path("examples/search_r1/config.yaml").read_text())["task_kwargs"]
    for s in a.set:
        key, v = s.split("=", 1)
        kw[key] = json.loads(v)
    qs = pools(kw)
    temps = [float(t) for t in a.temps.split(",") if t]
    with open(a.out, "a") as f:
        for c in a.ckpts:
            t0 = time.monotonic()
            row = measure(Path(c), qs, a.k, temps, a.pools.split(","))
            row["seconds"] = round(time.monotonic() - t0, 1)
            print(json.dumps(row), flush=True)
            f.write(json.dumps(row) + "\n")
            f.flush()


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
