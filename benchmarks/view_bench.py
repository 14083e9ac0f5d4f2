"""``agentrl view`` on a large step: how long the first page, later pages, a search and one sample take.

A synthetic run with one ``samples/step-1.jsonl`` of ``--samples`` samples (``--tokens`` tokens each:
prompt, then three turns of model output and tool context; a chat of three messages), served through the
viewer's FastAPI app in process (Starlette's TestClient: no socket, so the numbers are the server's work).

Measured: the first page (reads and indexes the whole file), a later page, a filtered page, a text search,
one sample rendered token by token, and the bytes of a page of summaries.

    python benchmarks/view_bench.py                       # 10k samples x 300 tokens
    python benchmarks/view_bench.py --samples 50000 --out benchmarks/results/view_bench_50k.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def synthetic_sample(i: int, tokens: int) -> dict:
    prompt = tokens // 4
    turn = (tokens - prompt) // 3
    runs, start = [[0, prompt, "prompt", 0, None]], prompt
    for k in range(3):
        half = turn // 2
        if k:
            runs.append([start, start + half, "context", k, None])
            start += half
        end = tokens if k == 2 else start + (turn - half if k else turn)
        runs.append([start, end, "model", k, str(i % 7)])
        start = end
    n_resp = tokens - prompt
    mask = [0 if prompt + j < tokens and any(r[2] == "context" and r[0] <= prompt + j < r[1] for r in runs)
            else 1 for j in range(n_resp)]
    return {"tokens": [(i * 31 + j) % 1000 for j in range(tokens)], "response_start": prompt, "loss_mask": mask,
            "rollout_logprobs": [-0.01 * (j % 50) for j in range(n_resp)], "provenance": runs,
            "reward": float(i % 3 == 0), "status": "completed", "session_id": f"s{i}", "group_id": f"g{i // 8}",
            "metadata": {"turns": [0, 1, 2], "outcomes": ["new", "clean", "realigned" if i % 5 == 0 else "clean"],
                         "stop_reason": "done", "messages": [{"role": "user", "content": f"What is {i}+{i}?"},
                                                             {"role": "assistant", "content": "call add"},
                                                             {"role": "tool", "content": str(2 * i)}]}}


def timed(fn, repeat: int = 1) -> tuple[float, object]:
    times, result = [], None
    for _ in range(repeat):
        started = time.perf_counter()
        result = fn()
        times.append(time.perf_counter() - started)
    return statistics.median(times), result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=10_000)
    parser.add_argument("--tokens", type=int, default=300)
    parser.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "view_bench.json"))
    args = parser.parse_args()
    from fastapi.testclient import TestClient

    from agentrl.view.app import create_app
    from agentrl.view.filters import MAX_PAGE
    from agentrl.view.run_dir import RunDir
    from agentrl.view.tokens import cached_decoder

    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        (root / "samples").mkdir()
        step_file = root / "samples" / "step-1.jsonl"
        with step_file.open("w") as f:
            for i in range(args.samples):
                f.write(json.dumps(synthetic_sample(i, args.tokens)) + "\n")
        client = TestClient(create_app(RunDir(root), cached_decoder(None)), base_url="http://127.0.0.1")

        def get(url: str, **params) -> dict:
            response = client.get(url, params=params)
            response.raise_for_status()
            return response.json()

        url = "/api/steps/1/samples"
        rows = [("step file MB", round(step_file.stat().st_size / 1e6, 1))]
        seconds, first = timed(lambda: get(url, limit=100))
        rows.append(("first page (reads + indexes the file) s", round(seconds, 3)))
        seconds, later = timed(lambda: get(url, offset=args.samples - MAX_PAGE, limit=MAX_PAGE), 5)
        rows.append((f"a later page of {MAX_PAGE} s (median of 5)", round(seconds, 4)))
        rows.append((f"bytes of a page of {MAX_PAGE}", len(json.dumps(later))))
        seconds, _ = timed(lambda: get(url, outcome="realigned", reward_min=1, limit=100), 5)
        rows.append(("filtered page (outcome + reward) s", round(seconds, 4)))
        seconds, _ = timed(lambda: get(url, q=f"what is {args.samples - 1}+", limit=100), 5)
        rows.append(("text search s", round(seconds, 4)))
        seconds, one = timed(lambda: get(f"{url}/{args.samples // 2}"), 5)
        rows.append((f"one sample of {args.tokens} tokens rendered s", round(seconds, 4)))
        assert first["total"] == args.samples and len(later["items"]) == MAX_PAGE
        assert one["html"].count("data-provenance") == args.tokens
    width = max(len(name) for name, _ in rows)
    print(f"agentrl view, one step of {args.samples} samples x {args.tokens} tokens")
    for name, value in rows:
        print(f"  {name:<{width}}  {value}")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"samples": args.samples, "tokens": args.tokens, **dict(rows)}, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
