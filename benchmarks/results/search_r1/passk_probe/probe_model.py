"""pass@k of one saved model with sim.py's sampler: held-out, GRPO-pool and made-up-pool questions, greedy and
k samples at each temperature.

nice -n 19 python benchmarks/results/search_r1/passk_probe/probe_model.py MODEL_DIR [--k 16] [--temps 0.7,1.0]
"""
import argparse
import json
import sys
from pathlib import Path

import torch
import yaml

sys.path.insert(0, str(Path(__file__).parent))
import sim  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("model")
    p.add_argument("--k", type=int, default=16)
    p.add_argument("--temps", default="0.7,1.0")
    p.add_argument("--pools", default="heldout,train,synthetic")
    a = p.parse_args()
    torch.set_num_threads(1)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from agentrl.envs import ChatRenderer
    from examples.search_r1.questions import make_questions

    kw = yaml.safe_load(Path("examples/search_r1/config.yaml").read_text())["task_kwargs"]
    real = {**kw, "train_synthetic": 0.0, "train_search_credit": 0.0}
    pools = {"heldout": make_questions(100, seed=0, split="heldout", **kw),
             "train": make_questions(100, seed=12345, split="train", **real),
             "synthetic": make_questions(100, seed=777, split="train", **{**real, "train_synthetic": 1.0})}
    tok = AutoTokenizer.from_pretrained(a.model)
    model = AutoModelForCausalLM.from_pretrained(a.model, dtype=torch.float32).eval()
    b, r = sim.Batcher(model, tok, "cpu"), ChatRenderer(tok)
    row = {"model": a.model}
    for name in a.pools.split(","):
        row[f"{name}/greedy"] = sim.greedy(b, r, pools[name])
        for t in [float(x) for x in a.temps.split(",") if x]:
            row[f"{name}/T{t}"] = sim.passk(b, r, pools[name], a.k, t)
        print(json.dumps({k: v for k, v in row.items() if k.startswith(name)}), flush=True)
    print(json.dumps(row))


if __name__ == "__main__":
    main()
