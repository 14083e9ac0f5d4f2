# ruff: noqa: E402  (threads are set before the model libraries load)
"""Diagnosis: teacher-forced probability of the whole expert chat's assistant tokens per held-out task."""

import json
import sys

import torch

torch.set_num_threads(1)
from transformers import AutoModelForCausalLM, AutoTokenizer

from agentrl.envs.render import ChatRenderer
from agentrl.run.warmup import padded_batch
from examples.coding_agent.function_env import FunctionEnv, expert_messages, make_tasks



d = sys.argv[1]
split = sys.argv[2] if len(sys.argv) > 2 else "heldout"
tok = AutoTokenizer.from_pretrained(d)
r = ChatRenderer(tok)
m = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval()
tasks = make_tasks(64, seed=0, split=split)
rows = [
    (x.ids, x.assistant_mask)
    for x in (r.render(expert_messages(t), FunctionEnv.tool_schemas(), add_generation_prompt=False) for t in tasks)
]
ps = []
with torch.no_grad():
    ids, att, lab = padded_batch(rows, tok.pad_token_id)
    lp = torch.log_softmax(m(input_ids=ids, attention_mask=att).logits[:, :-1], -1)
    tgt = lab[:, 1:]
    g = lp.gather(-1, tgt.clamp(min=0).unsqueeze(-1)).squeeze(-1) * (tgt != -100)
    ps = g.sum(1).exp().tolist()
greedy = sum(p > 0.5 for p in ps) / len(ps)
print(
    json.dumps(
        {
            "model": d,
            "mean_p": round(sum(ps) / len(ps), 3),
            "frac_p>0.05": sum(p > 0.05 for p in ps) / len(ps),
            "frac_p>0.3": sum(p > 0.3 for p in ps) / len(ps),
            "frac_p<0.01": sum(p < 0.01 for p in ps) / len(ps),
            "pass@16_est": round(sum(1 - (1 - p) ** 16 for p in ps) / len(ps), 3),
        }
    )
)
