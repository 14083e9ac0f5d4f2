"""Replay the run's supervised warm-up (agentrl.run.warmup.supervised_warmup, the config's chats, seeds and
settings) without Ray, saving a checkpoint every EVERY steps up to MAX_STEPS, so the probes can measure
the warm model at any stopping point.

nice -n 19 python benchmarks/results/search_r1/passk_probe/warm_ckpts.py OUT_DIR [EVERY] [MAX_STEPS] [key=value ...]
(key=value overrides task_kwargs / warmup fields, e.g. num_conversations=4000 lr=1e-3)
"""
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch
import yaml

torch.set_num_threads(1)

from agentrl.models.tiny import make_tiny_model  # noqa: E402
from agentrl.run.warmup import WarmupConfig, supervised_warmup  # noqa: E402
from examples.search_r1.env import SearchR1Env, expert_messages  # noqa: E402
from examples.search_r1.questions import make_questions  # noqa: E402
from examples.search_r1.tokenizer import write_tokenizer  # noqa: E402

out = Path(sys.argv[1])
every = int(sys.argv[2]) if len(sys.argv) > 2 else 25
max_steps = int(sys.argv[3]) if len(sys.argv) > 3 else 800
cfg = yaml.safe_load(Path("examples/search_r1/config.yaml").read_text())
kw, w = dict(cfg["task_kwargs"]), dict(cfg["warmup"])
for arg in sys.argv[4:]:
    k, v = arg.split("=", 1)
    (w if k in WarmupConfig.model_fields else kw)[k] = json.loads(v)
out.mkdir(parents=True, exist_ok=True)
tmp = Path(tempfile.mkdtemp())
write_tokenizer(tmp / "tok")
base = make_tiny_model(tmp / "base", seed=0, tokenizer_dir=tmp / "tok")
tools = SearchR1Env.tool_schemas()
train = make_questions(w["num_conversations"], seed=1, split="warmup", **kw)
held = make_questions(100, seed=0, split="heldout", **kw)
chats = [(expert_messages(t), tools) for t in train]
held_chats = [(expert_messages(t), tools) for t in held]
w.update(target_accuracy=1.0, max_minutes=0, eval_every=every, check_every=every, max_steps=max_steps)
t0 = time.monotonic()
log = (out / "log.jsonl").open("w")


calls = {"n": 0}


def progress(record):
    record = {**record, "t": round(time.monotonic() - t0, 1)}
    log.write(json.dumps(record) + "\n")
    log.flush()
    if "eval_accuracy" in record:
        print(json.dumps(record), flush=True)


def evaluate_and_keep(path: Path) -> float:
    # target 1.0 is never reached, so evaluate runs exactly at every EVERY-th step (and at max_steps)
    calls["n"] += 1
    shutil.copytree(path, out / f"step-{min(calls['n'] * every, max_steps):04d}", dirs_exist_ok=True)
    return 0.0


supervised_warmup(base, tmp / "warm", chats, evaluate_and_keep, WarmupConfig(**w), progress=progress,
                  heldout=held_chats, seed=0)
