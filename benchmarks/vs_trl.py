"""agentrl vs TRL's GRPOTrainer on the same warmed-up tiny model, task, reward and group size (issue 8).

Runs ``agentrl train`` first (subprocess, GRPO budget ``--minutes``), then TRL 1.16's ``GRPOTrainer`` (CPU, no
vLLM, its own multi-turn tool path: ``environment_factory``) from the *same* warm model directory for the same
wall time agentrl's GRPO phase took, never both at once. Both sides are scored by the same code: agentrl's
greedy held-out evaluation (``RolloutManager.evaluate``: engines behind smg, the agent loop, the environment's
reward) on the same held-out tasks at the same cadence (every ``eval.every`` steps and at the end). For TRL the
trained weights are saved to disk and loaded into those engines before each evaluation, as agentrl syncs its
weights into its engines.

Clock: both clocks start after the step-0 evaluation of the warm model and *include* the periodic evaluations
(and agentrl's checkpoint saves), since agentrl's ``elapsed_s`` does; start-up (engines, Ray, TRL's trainer
construction) is excluded on both sides. TRL's own time spent evaluating is also reported separately.

Matched settings, read from the config: prompts x generations per optimizer step, temperature, the LR schedule
(agentrl's Megatron scheduler, step for step: ``megatron_lr_factor``), Adam
(0.9, 0.999), grad clip 1.0, KL coef 0.001 (k3 on both), clip eps 0.2 / 0.28, token-mean loss ('dapo' in
TRL), std-scaled group advantages, one optimizer step per batch, the same train tasks at each step, the same
prompt text (checked). agentrl also drops zero-variance groups before the loss (TRL keeps them at advantage 0,
so they only add KL and dilute the token mean) and saves a checkpoint at each evaluation (inside its clock). Differences TRL's design forces (said in the
JSON too): its ``max_completion_length`` covers the whole multi-turn completion, so each generate call (turn)
is capped at agentrl's per-turn ``max_new_tokens`` and the whole at ``max_new_tokens * max_turns``; it runs
at most ``max_turns - 1`` tool rounds; and it has no "episode done", so after ``submit`` the model replies once
more (the adapter then ignores further tool calls, so the first submission decides the reward,
as in agentrl).

Priorities: Ray starts its workers 15 nice levels below the raylet; agentrl's local cluster keeps them at the
driver's since 2026-12-03. Before, under the timing harness (nice 0, other jobs at nice 19) TRL's process ran
at nice 0 while agentrl's trainer, rollout actor and engines ran partly at nice 15, so a loaded machine slowed
agentrl's phase more than TRL's (main job, sync loop, load 6-7: 4.41 s/step before, 3.09 after).

Precision: both sides compute in the config's dtype (float32 for the main job). TRL's ``GRPOConfig`` defaults to
``bf16=True`` (autocast), which this script did not override until 2026-12-05. On an AVX2-only CPU (AMD EPYC, no
AVX-512/AMX; ``cpu`` in the JSON) autocast bf16 made the warm model's forward + backward of 128 x 124 tokens take
11.6-11.8 s against 0.82-0.89 s in float32 (2 threads), and a TRL step 27 s (42 CPU-s) against ~4 s on the machine
of 2026-12-03. The CPUs of earlier runs were not recorded, so which of them lacked native bf16 is unknown.

What made the stored 2026-11-29/30 TRL runs slow (53-56 s/step against 3.70 s/step on a quiet rerun at the same
settings; agentrl 8.6-9.3 against 3.35): likely bf16 autocast on a CPU without native bf16 (above; not proven). The
script's TRL arguments did not change between those runs and the rerun, and TRL logged the same completion lengths
(~70 tokens) and tool calls. Load also played a part then: the two phases run one after the other on a shared
2-core machine, and those runs overlapped other work (load averages of 15-20 are usual there while helpers run
tests): a process pinned to one torch thread then gets a small share of a core, and the phase that ran under more
load looked slower. The load was not recorded then. Now each phase records the load average at its start and end
and TRL's own CPU seconds per step (``trl_cpu_s_per_step``: wall time far above CPU time means the machine, not
TRL, set the pace), and a start with the load above the CPU count is flagged (``loaded_machine``) and printed. Seen
again on 2026-12-02 with other helpers' niced jobs keeping the load at 5-9: within one 1.5-minute agentrl run under
the machine-wide timing lock (nice 0 against niced neighbours), identical 128-episode rollouts took 1.4-3.3 s
(benchmarks/results/main_job_step_profile.md); the vs_trl.json run stored then (load 8-11 through the agentrl phase,
7-11 through TRL's) measured agentrl at 5.10 s/step (3.35 on the quiet rerun) and TRL with two threads at 4.95.
Under such load TRL's one compute-bound process keeps both cores busy (7.5 CPU-s per 4.95 s step), while agentrl's
engines, rollout actor and trainer hand work to each other and used ~1.3 of the 2 cores.

Threads: agentrl's CPU trainer rank of a ``sync`` run uses the machine's cores while it trains (the engines
wait then; :func:`agentrl.run.actors.training_cpu_threads`), so TRL's single process (generation and
training) gets as many torch threads by default (``--trl-threads``: this machine's cores, 2 here); its
evaluation engines keep one thread each, as agentrl's.

    python3 benchmarks/vs_trl.py [--config examples/arithmetic/config.yaml] [--minutes M] [--cache-dir C]
                                 [--single-turn] [--eval-tasks N] [--work-dir D] [--results R.json]
"""

from __future__ import annotations

import argparse
import asyncio
import inspect
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results" / "vs_trl.json"
TARGET_GAIN = 0.2
SINGLE_TURN = ["--env", "agentrl.envs.arithmetic:ArithmeticEnv", "--task_kwargs", '{"multi_turn": false}']


# ------------------------------------------------------------------------------------------- agentrl side


def run_agentrl(config: str, overrides: list[str], minutes: float, out_dir: Path) -> list[dict[str, Any]]:
    """``agentrl train`` with a GRPO wall budget of ``minutes`` (steps unbounded); its metrics rows."""
    cmd = [sys.executable, "-m", "agentrl.cli", "train", config, "--output-dir", str(out_dir),
           "--max_minutes", str(minutes), "--steps", "100000", *overrides]
    print("+", " ".join(cmd), flush=True)
    log = out_dir.with_suffix(".log")
    with log.open("w") as f:
        rc = subprocess.run(cmd, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT).returncode
    if rc != 0:
        tail = log.read_text()[-3000:]
        raise RuntimeError(f"agentrl train exited {rc}; last output ({log}):\n{tail}")
    return [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]


def agentrl_curve(rows: list[dict[str, Any]]) -> tuple[str, list[dict[str, float]]]:
    """(warm model dir, evaluations as {step, seconds, eval_accuracy}), seconds since the step-0 evaluation."""
    start = next((r for r in rows if r.get("step") == 0 and "model_dir" in r), None)
    if start is None:
        raise RuntimeError("agentrl metrics have no step-0 row with model_dir (did the run reach GRPO?)")
    t0 = start["elapsed_s"]
    curve = [{"step": r["step"], "seconds": round(r["elapsed_s"] - t0, 2), "eval_accuracy": r["eval_accuracy"]}
             for r in rows if "step" in r and "eval_accuracy" in r]
    return start["model_dir"], curve


# ----------------------------------------------------------------------------------------------- TRL side


def trl_environment(env_cls: type) -> type:
    """An adapter class for TRL's ``environment_factory`` that runs ``env_cls`` (an agentrl Environment).

    Tool calls go through ``Environment.call_tool`` (same validation, same result text, errors shown to the
    model as agentrl shows them). TRL lists the tools by *attribute* name, sorted, and names them by the
    function's ``__name__``: attributes ``t0_<name>``, ``t1_<name>``... keep agentrl's tool order, so the
    prompt TRL renders is byte-identical to the one the model was warmed up on (checked before training).
    """
    from agentrl.envs.environment import ToolCallError
    from agentrl.envs.formats import ToolCall

    def reset(self: Any, task: str, **_: Any) -> None:
        self._env = env_cls()
        self._env.task = json.loads(task)
        self._env.messages = list(self._env.reset(self._env.task))

    def get_reward(self: Any) -> float:
        value = self._env.reward()
        return float(asyncio.run(value) if inspect.isawaitable(value) else value)

    def make_tool(name: str, function: Any) -> Any:
        async def call(self: Any, **arguments: Any) -> str:
            if self._env.done:  # agentrl ends the episode here; TRL generates once more, which must not count
                return "the episode is over"
            try:
                return await self._env.call_tool(ToolCall(name, arguments))
            except ToolCallError as err:
                return str(err)

        call.__name__ = call.__qualname__ = name
        call.__doc__ = function.__doc__
        call.__signature__ = inspect.signature(function)
        call.__annotations__ = dict(function.__annotations__)
        return call

    body: dict[str, Any] = {"reset": reset, "get_reward": get_reward}
    for i, (name, spec) in enumerate(env_cls.tools.items()):
        body[f"t{i}_{name}"] = make_tool(name, spec.function)
    return type(f"TRL{env_cls.__name__}", (), body)


class AgentrlEvaluator:
    """agentrl's held-out evaluation of in-memory weights: save, load into the engines, ``evaluate``."""

    def __init__(self, model_dir: str, env_cls: type, settings: Any, heldout: list[Any], scratch: Path) -> None:
        from agentrl.rollout.manager import RolloutManager

        self.heldout, self.scratch = heldout, scratch
        self.manager = RolloutManager(model_dir, env_cls, settings).start()
        self.loop = asyncio.new_event_loop()
        self.seconds = 0.0
        self.failed_episodes = 0

    def __call__(self, model: Any | None, version: str) -> float:
        started = time.monotonic()
        if model is not None:
            path = self.scratch / f"eval-{version}"
            model.save_pretrained(path)
            from agentrl.engine.weight_loading import write_checksum_manifest

            write_checksum_manifest(path, sorted(path.glob("*.safetensors")))  # engines refuse unchecked weights
            self.manager.router.update_weights_from_disk(str(path), version)
        for _attempt in range(3):
            # RolloutManager.evaluate's own numbers, plus its failed-episode count: on this loaded 2-core machine
            # smg's circuit breaker sometimes opens right after a weight load, and failed episodes score 0.
            batch = self.loop.run_until_complete(self.manager.rollout(self.heldout, 1, temperature=0.0))
            failed = int(batch.metrics.get("rollout/failed", 0))
            if not failed:
                break
            print(f"evaluation {version}: {failed} episodes failed, retrying", flush=True)
            self.failed_episodes += failed
            time.sleep(2.0)
        self.seconds += time.monotonic() - started
        return sum(g[0].reward for g in batch.groups) / max(len(self.heldout), 1)

    def close(self) -> None:
        self.loop.run_until_complete(self.manager.aclose_client())
        self.loop.close()
        self.manager.shutdown()


def run_trl(cfg: Any, model_dir: str, budget_s: float, scratch: Path, threads: int = 1) -> dict[str, Any]:
    """TRL GRPO from ``model_dir`` for at most ``budget_s`` seconds (evaluations included; the final
    evaluation may end past it); its curve and log. ``threads``: torch CPU threads of TRL (the evaluation
    engines set their own: one each of this machine's cores, as agentrl's engines)."""
    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
    os.environ["OMP_NUM_THREADS"] = str(threads)
    import torch

    torch.set_num_threads(threads)
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer
    from trl.chat_template_utils import qwen3_template

    from agentrl.envs import load_function
    from agentrl.rollout.manager import RolloutSettings

    env_cls = load_function(cfg.env)
    make_tasks = load_function(cfg.tasks)
    heldout = make_tasks(cfg.eval.num_tasks, seed=cfg.seed, split="heldout", **cfg.task_kwargs)
    r = cfg.rollout
    # The same per-step draws agentrl makes (seed * 1_000_003 + step), in order, enough for any budget.
    tasks = [t for step in range(3000)
             for t in make_tasks(r.prompts_per_step, seed=cfg.seed * 1_000_003 + step, split="train", **cfg.task_kwargs)]
    dataset = Dataset.from_list([{"prompt": env_cls().reset(t), "task": json.dumps(t)} for t in tasks])

    tokenizer = AutoTokenizer.from_pretrained(model_dir, padding_side="left")
    # Our template renders tool calls as Hermes JSON, exactly what TRL's Qwen3 parser reads.
    tokenizer.response_template = qwen3_template
    adapter = trl_environment(env_cls)
    expected = tokenizer.apply_chat_template(dataset[0]["prompt"], tools=env_cls.tool_schemas(), tokenize=False,
                                             add_generation_prompt=True)
    probe = adapter()
    trl_tools = [getattr(probe, n) for n, _ in inspect.getmembers(adapter, inspect.isfunction)
                 if n not in ("reset", "get_reward") and not n.startswith("_")]
    rendered = tokenizer.apply_chat_template(dataset[0]["prompt"], tools=trl_tools, tokenize=False,
                                             add_generation_prompt=True)
    if rendered != expected:
        raise RuntimeError(f"TRL would render a different prompt:\n{rendered!r}\nagentrl:\n{expected!r}")

    loss = cfg.trainer.loss.model_dump()
    per_step = r.prompts_per_step * r.samples_per_prompt
    args = GRPOConfig(
        output_dir=str(scratch / "trl"), use_cpu=True, seed=cfg.seed, report_to="none", save_strategy="no",
        logging_steps=1, disable_tqdm=True, max_steps=len(tasks) // r.prompts_per_step,
        shuffle_dataset=False,  # in order: step k samples exactly agentrl's step-k tasks
        per_device_train_batch_size=per_step, gradient_accumulation_steps=1, steps_per_generation=1,
        num_generations=r.samples_per_prompt, num_iterations=1,
        temperature=r.temperature, top_p=1.0, top_k=0,
        # agentrl caps each turn at max_new_tokens; TRL's max_completion_length bounds the whole multi-turn
        # completion, so the per-turn cap goes into every generate call and the total gets one cap per turn.
        generation_kwargs={"max_new_tokens": r.max_new_tokens},
        max_completion_length=r.max_new_tokens * env_cls.max_turns, max_tool_calling_iterations=env_cls.max_turns - 1,
        learning_rate=cfg.trainer.lr, weight_decay=0.0,  # schedule: megatron_lr_factor
        max_grad_norm=1.0, beta=loss["kl_coef"], epsilon=loss["eps_clip"], epsilon_high=loss["eps_clip_high"],
        loss_type="dapo", scale_rewards="group", gradient_checkpointing=False,  # agentrl: recompute off
        # GRPOConfig defaults to bf16 autocast; agentrl computes in the config's dtype without autocast. On a CPU
        # without native bf16 (AVX2 only) autocast made TRL's forward + backward 14x slower (module docstring).
        bf16=False, fp16=False,
    )
    settings = RolloutSettings(num_engines=r.num_engines, temperature=r.temperature,
                               max_new_tokens=r.max_new_tokens, concurrency=r.concurrency, policy=r.policy)
    evaluate = AgentrlEvaluator(model_dir, env_cls, settings, heldout, scratch)
    curve = [{"step": 0, "seconds": 0.0, "eval_accuracy": evaluate(None, "0")}]
    print(json.dumps({"trl": curve[0]}), flush=True)
    log_rows: list[dict[str, Any]] = []
    cpu_per_step: list[float] = []

    class Clock(TrainerCallback):
        """Evaluates every ``eval.every`` steps and stops the run once the wall budget is spent."""

        started = 0.0
        step_cpu = 0.0

        def on_train_begin(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            self.started = time.monotonic()

        def on_step_begin(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            self.step_cpu = time.process_time()

        def on_log(self, args: Any, state: Any, control: Any, logs: dict | None = None, **kw: Any) -> None:
            if logs:
                log_rows.append({"step": state.global_step, **{k: v for k, v in logs.items() if isinstance(v, int | float)}})

        def on_step_end(self, args: Any, state: Any, control: Any, model: Any = None, **kw: Any) -> None:
            cpu_per_step.append(round(time.process_time() - self.step_cpu, 3))  # TRL's own CPU, this step
            # Stop before a step that would end past the budget (at its mean pace so far, evaluations
            # included): a TRL step is long here, and finishing one more would give TRL up to a step extra.
            elapsed = time.monotonic() - self.started
            out_of_time = elapsed * (state.global_step + 1) / state.global_step > budget_s
            if state.global_step % cfg.eval.every == 0 or out_of_time:
                accuracy = evaluate(model, str(state.global_step))
                point = {"step": state.global_step, "seconds": round(time.monotonic() - self.started, 2),
                         "eval_accuracy": accuracy}
                curve.append(point)
                print(json.dumps({"trl": point}), flush=True)
            if out_of_time:
                control.should_training_stop = True

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=cfg.trainer.dtype)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.learning_rate, betas=(0.9, 0.999), eps=1e-8,
                                  weight_decay=0.0)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, megatron_lr_factor(cfg.trainer))
    try:
        trainer = GRPOTrainer(model=model, args=args, train_dataset=dataset, processing_class=tokenizer,
                              environment_factory=adapter, callbacks=[Clock()], optimizers=(optimizer, schedule))
        trainer.train()
    finally:
        evaluate.close()
    return {"curve": curve, "eval_seconds": round(evaluate.seconds, 2), "cpu_s_per_step": cpu_per_step,
            "eval_failed_episodes_retried": evaluate.failed_episodes, "log": log_rows,
            "settings": {"max_completion_length": args.max_completion_length, "generation_kwargs": args.generation_kwargs,
                         "max_tool_calling_iterations": args.max_tool_calling_iterations,
                         "per_device_train_batch_size": per_step, "num_generations": args.num_generations,
                         "beta": args.beta, "epsilon": args.epsilon, "epsilon_high": args.epsilon_high,
                         "loss_type": args.loss_type, "learning_rate": args.learning_rate,
                         "dtype": cfg.trainer.dtype, "bf16_autocast": args.bf16}}


def megatron_lr_factor(cfg: Any):
    """LambdaLR factor giving TRL's k-th optimizer step the LR agentrl's trainer gives its k-th: read from
    the same Megatron scheduler (:func:`agentrl.trainer.actor.make_lr_scheduler`) over a dummy optimizer."""
    import torch

    from agentrl.trainer.actor import make_lr_scheduler

    scheduler = make_lr_scheduler(torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=cfg.lr), cfg)
    group = scheduler.optimizer.param_groups[0]

    def factor(last_epoch: int) -> float:
        scheduler.num_steps = last_epoch + 1  # LambdaLR counts from 0 before the first step
        return scheduler.get_lr(group) / cfg.lr

    return factor


# ------------------------------------------------------------------------------------------------- report


def cpu_description() -> dict[str, Any]:
    """The CPU's model and its native bf16 support: what sets a CPU run's speed in each dtype."""
    info = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    fields = {key.strip(): value.strip() for key, _, value in (line.partition(":") for line in info.splitlines())}
    flags = set(fields.get("flags", "").split())
    return {"model": fields.get("model name", ""),
            "flags": sorted(flags & {"avx2", "avx512f", "avx512_bf16", "amx_bf16"})}


def ratio_bound(agentrl: dict[str, Any], trl: dict[str, Any]) -> float | None:
    """Upper bound on agentrl's / TRL's time to the target: exact if both reached it; if only agentrl
    did, TRL needed more than its whole run, so agentrl's time over TRL's run time bounds the ratio."""
    a, t = agentrl["seconds_to_target"], trl["seconds_to_target"]
    if a is None:
        return None
    return round(a / (t if t is not None else trl["seconds"]), 3)


def summarize(name: str, curve: list[dict[str, float]]) -> dict[str, Any]:
    start = curve[0]["eval_accuracy"]
    reached = next((p["seconds"] for p in curve[1:] if p["eval_accuracy"] >= start + TARGET_GAIN - 1e-9), None)
    steps, seconds = curve[-1]["step"], curve[-1]["seconds"]
    return {"framework": name, "start_accuracy": start, "final_accuracy": curve[-1]["eval_accuracy"],
            "best_accuracy": max(p["eval_accuracy"] for p in curve),
            "seconds_to_target": reached, "steps": steps, "seconds": seconds,
            "s_per_step": round(seconds / steps, 3) if steps else None}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", default="examples/arithmetic/config.yaml")
    p.add_argument("--minutes", type=float, default=7.0, help="agentrl's GRPO budget; TRL gets the same wall time")
    p.add_argument("--cache-dir", default=".cache/agentrl", help="agentrl's model / warm-up cache")
    p.add_argument("--single-turn", action="store_true", help="ArithmeticEnv (submit only) on both sides")
    p.add_argument("--eval-tasks", type=int, help="held-out tasks per evaluation (default: the config's)")
    p.add_argument("--trl-threads", type=int, default=len(os.sched_getaffinity(0)),
                   help="torch threads for TRL (default: this machine's cores, as agentrl's sync trainer uses)")
    p.add_argument("--work-dir", help="where both runs write (default: a temporary directory)")
    p.add_argument("--results", default=str(RESULTS), help="JSON to write (smoke runs: elsewhere)")
    args = p.parse_args(argv)

    from agentrl.run.config import load_config

    overrides = ["--cache_dir", args.cache_dir] + (SINGLE_TURN if args.single_turn else [])
    if args.eval_tasks:
        overrides += ["--eval.num_tasks", str(args.eval_tasks)]
    config = str(Path(args.config).resolve())
    cfg = load_config(config, overrides)
    work = Path(args.work_dir or tempfile.mkdtemp(prefix="vs_trl-"))
    work.mkdir(parents=True, exist_ok=True)

    load: dict[str, list[float]] = {"agentrl_start": list(os.getloadavg())}
    model_dir, agentrl_points = agentrl_curve(run_agentrl(config, overrides, args.minutes, work / "agentrl"))
    load["agentrl_end"] = load["trl_start"] = list(os.getloadavg())
    budget = agentrl_points[-1]["seconds"]
    print(f"agentrl: {len(agentrl_points)} evaluations in {budget:.0f} s; TRL gets {budget:.0f} s from {model_dir}",
          flush=True)
    trl = run_trl(cfg, model_dir, budget, work, args.trl_threads)
    load["trl_end"] = list(os.getloadavg())
    # Only before the run: from then on each phase keeps the cores busy itself (agentrl's engines, trainer and
    # router; TRL's threads and evaluation engines: 1-minute averages of 2.3-3.6 on 2 cores when nothing else
    # ran), so the later averages cannot tell a neighbour's load from the phase's own.
    loaded = load["agentrl_start"][0] > (os.cpu_count() or 1)
    table = [summarize("agentrl", agentrl_points), summarize("trl", trl["curve"])]
    a, t = table[0]["seconds_to_target"], table[1]["seconds_to_target"]
    result = {
        "task": "single-turn (ArithmeticEnv)" if args.single_turn else "multi-turn (ArithmeticToolEnv)",
        "env": cfg.env, "minutes": args.minutes, "eval_tasks": cfg.eval.num_tasks, "eval_every": cfg.eval.every,
        "clock": "from after the step-0 evaluation; periodic evaluations included on both sides",
        "target": f"+{TARGET_GAIN} held-out accuracy over the warm model", "model_dir": model_dir,
        "table": table, "steps_per_minute_ratio_agentrl_over_trl": (
            round(table[1]["s_per_step"] / table[0]["s_per_step"], 3)
            if table[0]["s_per_step"] and table[1]["s_per_step"] else None),
        "time_ratio_agentrl_over_trl": round(a / t, 3) if a and t else None,
        "time_ratio_agentrl_over_trl_at_most": ratio_bound(table[0], table[1]),
        "agentrl_curve": agentrl_points, "trl_curve": trl["curve"], "trl_eval_seconds": trl["eval_seconds"],
        "trl_eval_failed_episodes_retried": trl["eval_failed_episodes_retried"],
        "load_average": load, "cpu_count": os.cpu_count(), "cpu": cpu_description(), "loaded_machine": loaded,
        "trl_cpu_s_per_step": trl["cpu_s_per_step"],
        "trl_s_per_step_training_only": (round((table[1]["seconds"] - trl["eval_seconds"]) / table[1]["steps"], 3)
                                         if table[1]["steps"] else None),
        "agentrl_settings": {"schedule": cfg.schedule, "old_logprobs": cfg.trainer.old_logprobs,
                             "importance_weights": cfg.trainer.loss.importance_weights},
        "trl_settings": {**trl["settings"], "torch_threads": args.trl_threads}, "trl_log": trl["log"],
        "trl_differences": ["per-turn cap max_new_tokens (generation_kwargs), whole completion max_new_tokens * max_turns",
                            "no episode end after submit: one more reply is generated (later calls ignored)"],
    }
    results = Path(args.results)
    results.parent.mkdir(parents=True, exist_ok=True)
    results.write_text(json.dumps(result, indent=2) + "\n")
    print(f"\n{result['task']}, {cfg.eval.num_tasks} held-out tasks, eval every {cfg.eval.every} steps")
    print(f"{'framework':<10}{'start acc':>10}{'final acc':>10}{'s to +0.2':>14}{'steps':>7}{'wall s':>8}{'s/step':>8}")
    for row in table:
        reached = f"{row['seconds_to_target']:.0f}" if row["seconds_to_target"] is not None else "not reached"
        print(f"{row['framework']:<10}{row['start_accuracy']:>10.3f}{row['final_accuracy']:>10.3f}{reached:>14}"
              f"{row['steps']:>7}{row['seconds']:>8.0f}{row['s_per_step'] or float('nan'):>8.2f}")
    if result["steps_per_minute_ratio_agentrl_over_trl"] is not None:
        print(f"agentrl / TRL steps per minute: {result['steps_per_minute_ratio_agentrl_over_trl']} (target >= 2)")
    if result["time_ratio_agentrl_over_trl"] is not None:
        print(f"agentrl / TRL time to +0.2: {result['time_ratio_agentrl_over_trl']} (target <= 0.25)")
    elif result["time_ratio_agentrl_over_trl_at_most"] is not None:
        print(f"agentrl / TRL time to +0.2: at most {result['time_ratio_agentrl_over_trl_at_most']} "
              "(TRL did not reach it in its whole run; target <= 0.25)")
    print(f"load average (1, 5, 15 min) at each phase's start and end on {os.cpu_count()} CPUs: {load}")
    if loaded:
        print("WARNING: the machine was loaded above its CPU count before the run; the timings measure the load")
    print(f"wrote {results}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
