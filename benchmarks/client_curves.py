"""Reward curves of real agent clients trained through the gateway, and of the MCP-tool env (issue 43).

One short ``agentrl train`` per client, each from the same warm model, one after the other:

* ``agents_sdk``: the OpenAI Agents SDK with its default (Responses) model, ``examples/client_agents/agents_sdk_agent.py``
* ``anthropic``: the ``anthropic`` SDK's Messages API, ``examples/client_agents/anthropic_agent.py``
* ``langgraph``: a LangGraph graph over ``langchain-openai``'s ``ChatOpenAI``, ``examples/client_agents/langgraph_agent.py``
* ``openai_chat``: the plain ``openai`` chat-completions agent, ``examples/openai_agent/agent.py`` (the reference)
* ``mcp``: ``examples/mcp_arithmetic`` (agentrl's own loop; ``add`` from a stdio MCP server)
* ``mixed``: one run whose copies play ``agents_sdk``, ``anthropic`` and ``langgraph`` in turn by slot
  (``examples/client_agents/by_slot.py``, ``--copies`` in all): one policy trained on all three clients'
  episodes, each client's reward per step read from the run's ``samples/step-N.jsonl`` (the sessions each
  agent's log names). Cheaper than three runs on a shared machine; each client's curve is then its own
  episodes' reward under the jointly trained policy.

Per client it writes ``OUT/<client>.json`` (reward and held-out accuracy per step, unproven trained tokens,
failed episodes, wall time, the load average seen while it ran) and ``OUT/<client>_metrics.jsonl`` (the run's
rows), and ``OUT/client_curves.json`` (all clients)::

    python benchmarks/client_curves.py --clients agents_sdk anthropic --steps 20 \\
        --model-path .cache/agentrl/warm-892307a0c21a --out benchmarks/results/client_curves_2026-12-07

``--python`` runs the agents with another interpreter (e.g. a venv that has langgraph); ``--timeout`` caps
each run (seconds). Extra arguments after ``--`` go to every ``agentrl train``.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
AGENTS = {"agents_sdk": "examples/client_agents/agents_sdk_agent.py",
          "anthropic": "examples/client_agents/anthropic_agent.py",
          "langgraph": "examples/client_agents/langgraph_agent.py",
          "openai_chat": "examples/openai_agent/agent.py"}
CLIENT_CONFIG = "examples/client_agents/config.yaml"
MCP_CONFIG = "examples/mcp_arithmetic/config.yaml"
MIXED = ("agents_sdk", "anthropic", "langgraph")


def train_command(client: str, args: argparse.Namespace, out_dir: Path) -> list[str]:
    base = ["agentrl", "train", MCP_CONFIG if client == "mcp" else CLIENT_CONFIG, "--output-dir", str(out_dir),
            "--overwrite", "--steps", str(args.steps)]
    if client == "mixed":
        scripts = " ".join(Path(AGENTS[c]).name for c in MIXED)
        base += ["--external_agent.command", f"{args.python} examples/client_agents/by_slot.py {scripts}",
                 "--external_agent.copies", str(args.copies)]
    elif client != "mcp":
        base += ["--external_agent.command", f"{args.python} {AGENTS[client]}"]
    if args.model_path:
        base += ["--model.path", args.model_path, "--expert", "null"]
    return base + list(args.extra)


class LoadSampler:
    """The 1-minute load average every ``every`` seconds while a run goes on."""

    def __init__(self, every: float = 10.0) -> None:
        self.every, self.samples, self._stop = every, [], threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.samples.append(round(os.getloadavg()[0], 2))
            self._stop.wait(self.every)

    def __enter__(self) -> LoadSampler:
        self._thread.start()
        return self

    def __exit__(self, *_: Any) -> None:
        self._stop.set()
        self._thread.join()


def curve(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Reward per GRPO step, held-out accuracy per evaluation, and the proof's counts over the run."""
    steps = [r for r in rows if "step" in r and "rollout/reward_mean" in r]
    evals = [(r["step"], r["eval_accuracy"]) for r in rows if "step" in r and "eval_accuracy" in r]
    rewards = [(r["step"], round(r["rollout/reward_mean"], 4)) for r in steps]
    half = len(rewards) // 2
    mean = lambda xs: round(sum(xs) / len(xs), 4) if xs else None  # noqa: E731
    return {
        "train_reward": rewards, "eval_accuracy": evals,
        "reward_first_half": mean([r for _, r in rewards[:half]]),
        "reward_second_half": mean([r for _, r in rewards[half:]]),
        "unproven_trained_tokens": sum(r.get("rollout/unproven_trained_tokens", 0) for r in steps),
        "refused_samples": sum(r.get("verify/refused", 0) for r in steps),
        "failed_episodes": sum(r.get("rollout/failed", 0) for r in steps),
        "episodes": sum(r.get("rollout/episodes", 0) for r in steps),
        "drift_clean": sum(r.get("drift/clean", 0) for r in steps),
        "drift_realigned": sum(r.get("drift/realigned", 0) for r in steps),
        "seconds_per_step": mean([r.get("rollout/seconds", 0) + r.get("train/seconds", 0) for r in steps]),
    }


def per_client(run_dir: Path, rows: list[dict[str, Any]]) -> dict[str, Any]:
    """A ``mixed`` run split by client. Slot ``k`` played ``MIXED[k % 3]``; each agent logs one JSON line per
    episode (session, its own reward by the env's rule, end time). Training sessions are
    ``<worker>-g<group>-<index>``: in a sync run every group of step ``s`` is played before any of step
    ``s + 1``, so the groups ordered by their first episode's end, ``prompts_per_step`` at a time, are the
    steps. Evaluation sessions are ``passk-<rollout>-<task>-<k>``, one rollout per evaluation. Each step's
    mean over all clients is checked against the run's own (env-scored) ``rollout/reward_mean``."""
    per_step = json.loads((run_dir / "config.json").read_text())["rollout"]["prompts_per_step"]
    groups: dict[str, list[tuple[float, str, float]]] = {}
    evals: dict[str, list[tuple[float, str, float]]] = {}
    for log in (run_dir / "logs").glob("agent-*.log"):
        client = MIXED[int(log.stem.removeprefix("agent-")) % len(MIXED)]
        for line in log.read_text(errors="replace").splitlines():
            if line.startswith('{"episode"'):
                row = json.loads(line)
                session = row["episode"]
                into, key = (evals, session.split("-")[1]) if session.startswith("passk-") else (
                    groups, session.rpartition("-")[0])
                into.setdefault(key, []).append((row["t"], client, row["own_reward"]))
    first = lambda table: sorted(table, key=lambda k: min(t for t, _, _ in table[k]))  # noqa: E731
    ordered = first(groups)
    run_reward = {r["step"]: r["rollout/reward_mean"] for r in rows if "step" in r and "rollout/reward_mean" in r}
    eval_steps = [r["step"] for r in rows if "step" in r and "eval_accuracy" in r]

    def mean(xs: list[float]) -> float | None:
        return round(sum(xs) / len(xs), 4) if xs else None

    out: dict[str, Any] = {c: {"train_reward": [], "eval_accuracy": [], "episodes": 0} for c in MIXED}
    checks = []
    for step in sorted(run_reward):  # steps the run finished (one still in flight at a kill is left out)
        played = [e for g in ordered[(step - 1) * per_step:step * per_step] for e in groups[g]]
        checks.append((step, mean([r for *_, r in played]), round(run_reward[step], 4), len(played)))
        for client in MIXED:
            got = [r for _, c, r in played if c == client]
            out[client]["train_reward"].append((step, mean(got), len(got)))
            out[client]["episodes"] += len(got)
    for step, key in zip(eval_steps, first(evals), strict=False):
        for client in MIXED:
            got = [r for _, c, r in evals[key] if c == client]
            out[client]["eval_accuracy"].append((step, mean(got), len(got)))
    for client in MIXED:
        points = [r for _, r, n in out[client]["train_reward"] if n]
        half = len(points) // 2
        out[client]["reward_first_half"], out[client]["reward_second_half"] = mean(points[:half]), mean(points[half:])
    # both sides rounded to 4 places: equal within 1e-4 when the agents scored as the env did
    out["own_reward_matches_run"] = all(m is not None and abs(m - r) <= 1e-4 for _, m, r, _ in checks)
    out["own_vs_run_reward"] = checks
    return out


def run_client(client: str, args: argparse.Namespace, out: Path) -> dict[str, Any]:
    run_dir = Path(args.run_root) / client
    cmd = train_command(client, args, run_dir)
    print("$", shlex.join(cmd), flush=True)
    started = time.monotonic()
    with LoadSampler() as load, (out / f"{client}.log").open("w") as log:
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
        try:
            rc: int | str = proc.wait(timeout=args.timeout)
        except subprocess.TimeoutExpired:  # interrupt first: the run stops its agents, engines and Ray
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            rc = "timeout"
    wall = round(time.monotonic() - started, 1)
    metrics = run_dir / "metrics.jsonl"
    rows = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()] if metrics.exists() else []
    if metrics.exists():
        shutil.copy(metrics, out / f"{client}_metrics.jsonl")
    result = {"client": client, "command": shlex.join(cmd), "returncode": rc, "wall_s": wall,
              "load_avg_1m": {"min": min(load.samples), "max": max(load.samples),
                              "mean": round(sum(load.samples) / len(load.samples), 2), "samples": load.samples},
              "cpus": os.cpu_count(), **curve(rows)}
    if client == "mixed":
        result["per_client"] = per_client(run_dir, rows)
    (out / f"{client}.json").write_text(json.dumps(result, indent=1) + "\n")
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", nargs="+", default=["agents_sdk", "anthropic", "langgraph", "mcp"],
                        choices=[*AGENTS, "mcp", "mixed"])
    parser.add_argument("--copies", type=int, default=12, help="agent copies of a mixed run")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--model-path", default=None, help="start from this warm model (skips the warm-up)")
    parser.add_argument("--python", default=sys.executable, help="interpreter of the agents")
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "client_curves"))
    parser.add_argument("--run-root", default="/tmp/client_curves", help="the runs' output dirs")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds per run")
    parser.add_argument("extra", nargs="*", help="after --: more agentrl train arguments")
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    summary_path = out / "client_curves.json"
    summary = json.loads(summary_path.read_text()) if summary_path.exists() else {}
    for client in args.clients:
        result = run_client(client, args, out)
        summary[client] = {k: v for k, v in result.items() if k != "load_avg_1m"} | {
            "load_avg_1m": {k: v for k, v in result["load_avg_1m"].items() if k != "samples"}}
        summary_path.write_text(json.dumps(summary, indent=1) + "\n")
        print(json.dumps({k: result[k] for k in ("client", "returncode", "wall_s", "reward_first_half",
                                                  "reward_second_half", "unproven_trained_tokens",
                                                  "failed_episodes")}), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
