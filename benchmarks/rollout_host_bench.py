"""Host ceiling of the rollout path on CPU: real agent loop, chat template, tokenizer, RolloutClient, smg router,
engine HTTP server and scheduler, trajectory manager and proof -- against an engine whose model answers at once
(``python -m agentrl.engine --null-model``: the real server with :class:`agentrl.engine.null_model.NullRunner`).

Episodes are the main job's (``examples/arithmetic/config.yaml``): the arithmetic tool env, multi-turn, Hermes
tool calls; the null model replies ``add`` then ``submit`` (two turns an episode, a tool run between), its token
ids from the same tokenizer. ``--concurrency`` episodes run at once in this process (the rollout worker's
shape); each finished group of ``--group`` episodes is proved (``agentrl.rollout.proof.prove_groups``).

Reported: ``turns_per_s`` (wall), ``host_cpu_ms_per_turn`` (utime + stime of every process -- this one, the
smg router, each engine server -- over the timed window, per turn) and per-component CPU ms per turn; with
``--profile``, the top functions of this process (cProfile); ``gc``: the client process's time in the garbage
collector (after ``gc.freeze``, as the rollout worker runs; ``--no-gc-freeze`` without). Goal on 2 cores:
>= 1,000 turns/s and <= 2 ms.

    python benchmarks/rollout_host_bench.py --out benchmarks/results/rollout_host_bench.json
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
CLIENT = "client (this process)"
# The client process's split: these are inside its CPU time; "client" is what is left (RolloutClient and its HTTP,
# the event loop, the agent loop's own glue).
TEMPLATE, TRAJECTORY, PROOF, ENV = "  template + tokenize", "  trajectory manager", "  proof", "  env (tools, reward)"


def null_script(renderer, tokenizer, task) -> dict:
    """The null model's replies (``add``, then ``submit``) and how it tells the turns apart (``<|im_end|>`` count)."""
    from agentrl.envs.arithmetic import ArithmeticToolEnv, expert_messages
    from agentrl.envs.formats import HermesFormat, ToolCall

    fmt = HermesFormat()
    end = tokenizer.eos_token_id
    replies = [tokenizer.encode(fmt.render_calls([call]), add_special_tokens=False) + [end]
               for call in (ToolCall("add", {"a": 1, "b": 2}), ToolCall("submit", {"answer": 3}))]
    messages = expert_messages(task)
    tools = ArithmeticToolEnv.tool_schemas()
    first = renderer.render(messages[:-3], tools).ids.count(end)
    second = renderer.render(messages[:-1], tools).ids.count(end)
    return {"replies": replies, "marker": end, "first": first, "per_turn": max(second - first, 1), "logprob": -0.25}


class ComponentClock:
    """CPU seconds of this thread spent inside wrapped calls, summed per component (the client process's split)."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}

    def wrap(self, component: str, fn):
        self.seconds.setdefault(component, 0.0)

        def timed(*args, **kwargs):
            start = time.thread_time()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds[component] += time.thread_time() - start

        return timed

    def wrap_async(self, component: str, fn):
        """For coroutines that finish without suspending (the arithmetic tools): else other tasks' CPU counts."""
        self.seconds.setdefault(component, 0.0)

        async def timed(*args, **kwargs):
            start = time.thread_time()
            try:
                return await fn(*args, **kwargs)
            finally:
                self.seconds[component] += time.thread_time() - start

        return timed


class GcClock:
    """CPU seconds this process spends in the garbage collector, and its collections per generation, while on
    (``gc.callbacks``). Informational: a collection runs inside whatever allocated, so it is in the split too."""

    def __init__(self) -> None:
        self.seconds = [0.0, 0.0, 0.0]  # per generation
        self.collections = [0, 0, 0]
        self._started = 0.0

    def __call__(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._started = time.thread_time()
        else:
            self.seconds[info["generation"]] += time.thread_time() - self._started
            self.collections[info["generation"]] += 1

    def __enter__(self) -> GcClock:
        gc.callbacks.append(self)
        return self

    def __exit__(self, *exc) -> None:
        gc.callbacks.remove(self)


def instrument(clock: ComponentClock, renderer, manager) -> None:
    """Time the renderer's and the trajectory manager's entry points the agent loop calls."""
    for name in ("render", "render_continuation", "decode_response"):
        setattr(renderer, name, clock.wrap(TEMPLATE, getattr(renderer, name)))
    for name in ("record_turn", "get_trajectory"):
        setattr(manager, name, clock.wrap(TRAJECTORY, getattr(manager, name)))


def timed_env(clock: ComponentClock):
    """A fresh arithmetic env whose reset, tool calls and reward are timed."""
    from agentrl.envs.arithmetic import ArithmeticToolEnv

    env = ArithmeticToolEnv()
    env.reset = clock.wrap(ENV, env.reset)
    env.reward = clock.wrap(ENV, env.reward)
    env.call_tool = clock.wrap_async(ENV, env.call_tool)
    return env


def cpu_seconds(pid: int) -> float:
    import psutil

    t = psutil.Process(pid).cpu_times()
    return t.user + t.system


async def play(args, renderer, client, tasks) -> dict:
    """Every episode, ``args.concurrency`` at a time; groups proved as they complete."""
    from agentrl.envs.loop import run_episode
    from agentrl.rollout.proof import RecordingTrajectoryManager, prove_groups

    manager = RecordingTrajectoryManager()
    clock = ComponentClock()
    instrument(clock, renderer, manager)
    prove = clock.wrap(PROOF, prove_groups)
    gate = asyncio.Semaphore(args.concurrency)
    sampling = {"temperature": 0.3, "max_new_tokens": 40}
    counts = {"turns": 0, "tool_calls": 0, "episodes": 0, "samples": 0, "proved": 0, "errors": 0}

    async def episode(i: int, task) -> object:
        async with gate:
            try:
                result = await run_episode(timed_env(clock), task, client.generate_turn, renderer,
                                           session_id=f"ep-{i}", group_id=f"g-{i // args.group}",
                                           sampling_params=sampling, trajectory_manager=manager)
            except Exception as exc:  # noqa: BLE001 - counted, as the pool does
                counts["errors"] += 1
                print(f"episode {i} failed: {type(exc).__name__}: {exc}", file=sys.stderr)
                return None
            counts["turns"] += result.metrics.turns
            counts["tool_calls"] += result.metrics.tool_calls
            counts["episodes"] += 1
            return result

    async def group(g: int) -> None:
        results = await asyncio.gather(*(episode(i, tasks[i]) for i in range(g * args.group, (g + 1) * args.group)))
        done = [r for r in results if r is not None]
        samples = [s for r in done for s in r.samples]
        records = {r.session_id: manager.emitted.pop(r.session_id) for r in done if r.session_id in manager.emitted}
        proved, _, _ = prove([samples] if samples else [], records)
        counts["samples"] += len(samples)
        counts["proved"] += sum(len(p) for p in proved)

    await asyncio.gather(*(group(g) for g in range(args.episodes // args.group)))
    counts["component_s"] = clock.seconds
    return counts


async def run_timed(args, renderer, url, tasks, pids) -> dict:
    from agentrl.rollout.client import RolloutClient

    async with RolloutClient(url) as client:
        if args.client_http == "aiohttp":  # for comparison: /generate through aiohttp, as before agentrl.rollout.http1
            client._http1_origin = None
        await play(argparse.Namespace(**{**vars(args), "episodes": args.group * 2}), renderer, client, tasks)  # warm
        if args.gc_freeze:  # what the rollout worker does once set up: the heap of torch, transformers and
            gc.collect()     # the tokenizer is never garbage, yet every full collection walks it
            gc.freeze()
        before = {name: cpu_seconds(pid) for name, pid in pids.items()}
        start = time.perf_counter()
        if args.profile:
            import cProfile
            import pstats

            # cpu: time.thread_time, so a loaded machine's waits are not charged to whatever ran when preempted
            profiler = cProfile.Profile(time.thread_time) if args.profile_timer == "cpu" else cProfile.Profile()
            profiler.enable()
        with GcClock() as gc_clock:
            counts = await play(args, renderer, client, tasks)
        wall = time.perf_counter() - start
        after = {name: cpu_seconds(pid) for name, pid in pids.items()}
        if args.profile:
            profiler.disable()
            stats = pstats.Stats(profiler)
            stats.sort_stats(args.profile_sort).print_stats(args.profile_lines)
            if args.profile_out:
                stats.dump_stats(args.profile_out)
    counts["wall_s"] = wall
    counts["gc"] = {"seconds": gc_clock.seconds, "collections": gc_clock.collections, "frozen": gc.get_freeze_count()}
    counts["cpu_s"] = {name: after[name] - before[name] for name in pids}
    return counts


def split(counts: dict) -> dict[str, float]:
    """CPU ms per turn of each process, the client's broken down into its timed components."""
    turns = max(counts["turns"], 1)
    per_turn = {name: 1000 * sec / turns for name, sec in counts["cpu_s"].items()}
    parts = {name: 1000 * sec / turns for name, sec in counts["component_s"].items()}
    out = {CLIENT: per_turn.pop(CLIENT)}
    out |= parts
    out["  client: RolloutClient + HTTP, event loop, agent loop"] = out[CLIENT] - sum(parts.values())
    out |= per_turn
    return {name: round(ms, 3) for name, ms in out.items()}


def report(args, counts: dict, load: tuple) -> dict:
    per_turn = split(counts)
    total = sum(ms for name, ms in per_turn.items() if not name.startswith(" "))
    out = {
        "benchmark": "rollout_host_bench",
        "turns_per_s": round(counts["turns"] / counts["wall_s"], 1),
        "host_cpu_ms_per_turn": round(total, 3),
        "cpu_ms_per_turn": {name.strip(): ms for name, ms in per_turn.items()},
        "goals": {"turns_per_s": 1000, "host_cpu_ms_per_turn": 2.0},
        "turns": counts["turns"], "tool_calls": counts["tool_calls"], "episodes": counts["episodes"], "errors": counts["errors"],
        "gc": {"client_ms_per_turn": round(1000 * sum(counts["gc"]["seconds"]) / max(counts["turns"], 1), 3),
               "client_ms_per_turn_by_generation": [round(1000 * sec / max(counts["turns"], 1), 3)
                                                    for sec in counts["gc"]["seconds"]],
               "collections": counts["gc"]["collections"], "frozen_objects": counts["gc"]["frozen"]},
        "samples": counts["samples"], "proved": counts["proved"], "wall_s": round(counts["wall_s"], 3),
        "concurrency": args.concurrency, "engines": args.engines, "gc_freeze": args.gc_freeze,
        "client_http": args.client_http,
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version(), "load_avg_before": load,
                    "load_avg_after": os.getloadavg()},
        "command": "python " + " ".join(sys.argv),
    }
    print(f"{'component':<56}{'CPU ms / turn':>14}")
    for name, ms in per_turn.items():
        print(f"{name:<56}{ms:>14.3f}")
    print(f"{'total':<56}{out['host_cpu_ms_per_turn']:>14.3f}")
    gcs = out["gc"]
    print(f"{'(client in the garbage collector, inside the above)':<56}{gcs['client_ms_per_turn']:>14.3f}"
          f"   by generation {gcs['client_ms_per_turn_by_generation']}, collections {gcs['collections']}, "
          f"{gcs['frozen_objects']} objects frozen")
    print(f"turns/s {out['turns_per_s']}  ({counts['turns']} turns, {counts['episodes']} episodes, "
          f"{counts['errors']} errors, {counts['proved']}/{counts['samples']} samples proved, load {load})")
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--episodes", type=int, default=512)
    p.add_argument("--concurrency", type=int, default=128)
    p.add_argument("--group", type=int, default=8, help="episodes per proved group (samples_per_prompt)")
    p.add_argument("--engines", type=int, default=1)
    p.add_argument("--client-http", choices=("http1", "aiohttp"), default="http1",
                   help="the RolloutClient's /generate transport (aiohttp: the one it used before, to compare)")
    p.add_argument("--profile", action="store_true", help="cProfile this process (the client side) meanwhile")
    p.add_argument("--gc-freeze", action=argparse.BooleanOptionalAction, default=True,
                   help="gc.freeze() this process after the warm-up, as the rollout worker does after its setup "
                        "(agentrl.run.actors.freeze_setup_heap); --no-gc-freeze to measure without")
    p.add_argument("--profile-sort", default="tottime", help="pstats sort key (tottime, cumulative, ...)")
    p.add_argument("--profile-lines", type=int, default=25)
    p.add_argument("--profile-timer", choices=("wall", "cpu"), default="wall", help="cProfile's clock")
    p.add_argument("--profile-out", type=Path, default=None, help="also write the pstats file here")
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args()
    args.episodes -= args.episodes % args.group
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")  # as in a run's rollout workers (run/session.py)
    from transformers import AutoTokenizer

    from agentrl.engine.launch import EngineProcess
    from agentrl.envs.arithmetic import make_tasks
    from agentrl.envs.render import ChatRenderer
    from agentrl.models.tiny import make_tiny_model
    from agentrl.rollout.router import SmgRouter

    load = os.getloadavg()
    tmp = Path(tempfile.mkdtemp(prefix="rollout_host_bench_"))
    model = make_tiny_model(tmp / "model", seed=0)
    tokenizer = AutoTokenizer.from_pretrained(model)
    renderer = ChatRenderer(tokenizer)
    tasks = make_tasks(args.episodes + 2 * args.group, seed=0, multi_turn=True)
    script = tmp / "null_model.json"
    script.write_text(json.dumps(null_script(renderer, tokenizer, tasks[0])))
    engines = [EngineProcess(model, threads=1, extra_args=["--null-model", str(script), "--max-batch-size", "256"])
               for _ in range(args.engines)]
    for e in engines:
        e.__enter__()
    try:
        with SmgRouter([e.url for e in engines]) as router:
            pids = {CLIENT: os.getpid(), "smg router": router.pid}
            pids |= {f"engine server {i}": e.pid for i, e in enumerate(engines)}
            counts = asyncio.run(run_timed(args, renderer, router.url, tasks, pids))
    finally:
        for e in engines:
            e.__exit__(None, None, None)
    out = report(args, counts, load)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
