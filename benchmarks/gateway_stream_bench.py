"""What streaming adds per turn through the gateway: p50 / p90 wall time of one turn, non-streamed vs
streamed, on each protocol (chat completions, Responses, Anthropic Messages), with a scripted policy
behind the gateway (no engine: the difference is the gateway's own work) and the tiny test tokenizer.

    python3 benchmarks/gateway_stream_bench.py [--turns 200] [--out benchmarks/results/gateway_stream_bench.json]

Target (issue 43): streaming adds <= 1 ms p50 per turn over non-streaming. Prints a table, writes JSON.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "tests" / "rollout")]

REPLY = "The answer is 5, and here is a longer sentence so the reply streams in many pieces. " * 3
BODIES = {
    "chat": ("/v1/chat/completions", {"model": "tiny", "messages": [{"role": "user", "content": "What is 2+3?"}]}),
    "responses": ("/v1/responses", {"model": "tiny", "input": "What is 2+3?"}),
    "messages": ("/v1/messages", {"model": "tiny", "max_tokens": 256,
                                  "messages": [{"role": "user", "content": "What is 2+3?"}]}),
}


def time_turns(client, url: str, path: str, body: dict, turns: int, stream: bool) -> list[float]:
    out = []
    for i in range(turns):
        headers = {"X-Session-Id": f"{path}-{stream}-{i}"}
        started = time.perf_counter()
        if stream:
            with client.stream("POST", url + path, json={**body, "stream": True}, headers=headers) as resp:
                for _ in resp.iter_bytes():
                    pass
        else:
            client.post(url + path, json=body, headers=headers).raise_for_status()
        out.append(time.perf_counter() - started)
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--turns", type=int, default=200)
    p.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "gateway_stream_bench.json"))
    args = p.parse_args()
    import httpx
    from test_gateway import TOKENIZER_DIR, ServerThread
    from transformers import AutoTokenizer

    from agentrl.envs.scripted import ScriptedPolicy
    from agentrl.rollout.gateway import Gateway, create_app

    gateway = Gateway(AutoTokenizer.from_pretrained(TOKENIZER_DIR),
                      ScriptedPolicy(AutoTokenizer.from_pretrained(TOKENIZER_DIR), [REPLY]), model_name="tiny")
    rows = {}
    with ServerThread(create_app(gateway)) as server, httpx.Client(trust_env=False, timeout=30) as client:
        for name, (path, body) in BODIES.items():
            time_turns(client, server.url, path, body, 20, False)  # warm-up
            time_turns(client, server.url, path, body, 20, True)
            plain = time_turns(client, server.url, path, body, args.turns, False)
            streamed = time_turns(client, server.url, path, body, args.turns, True)
            rows[name] = {"plain_p50_ms": 1e3 * statistics.median(plain),
                          "stream_p50_ms": 1e3 * statistics.median(streamed),
                          "plain_p90_ms": 1e3 * statistics.quantiles(plain, n=10)[-1],
                          "stream_p90_ms": 1e3 * statistics.quantiles(streamed, n=10)[-1]}
            rows[name]["added_p50_ms"] = rows[name]["stream_p50_ms"] - rows[name]["plain_p50_ms"]
    print(f"{'protocol':<10} {'plain p50':>10} {'stream p50':>11} {'added p50':>10} {'plain p90':>10} {'stream p90':>11}")
    for name, r in rows.items():
        print(f"{name:<10} {r['plain_p50_ms']:>9.2f}ms {r['stream_p50_ms']:>10.2f}ms {r['added_p50_ms']:>9.2f}ms "
              f"{r['plain_p90_ms']:>9.2f}ms {r['stream_p90_ms']:>10.2f}ms")
    ok = all(r["added_p50_ms"] <= 1.0 for r in rows.values())
    print(f"target (streaming adds <= 1 ms p50 per turn): {'met' if ok else 'NOT met'}")
    Path(args.out).write_text(json.dumps({"turns": args.turns, "reply_chars": len(REPLY), "protocols": rows,
                                          "target_met": ok}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
