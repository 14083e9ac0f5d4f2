# ruff: noqa: E402  (threads are set before the model libraries load)
"""Diagnosis: greedy first write on held-out tasks vs the reference body."""

import sys

import torch

torch.set_num_threads(1)
from transformers import AutoModelForCausalLM, AutoTokenizer

from agentrl.envs.render import ChatRenderer
from examples.coding_agent.function_env import FunctionEnv, expert_replies, make_tasks

d = sys.argv[1]
n = int(sys.argv[2]) if len(sys.argv) > 2 else 32
tok = AutoTokenizer.from_pretrained(d)
r = ChatRenderer(tok)
m = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval()
ok = 0
for t in make_tasks(n, seed=0, split="heldout"):
    x = r.render(FunctionEnv().reset(t), FunctionEnv.tool_schemas(), add_generation_prompt=True)
    out = m.generate(torch.tensor([x.ids]), max_new_tokens=48, do_sample=False)
    got = tok.decode(out[0, len(x.ids) :], skip_special_tokens=True)
    want = expert_replies(t)[0]
    ok += got.strip() == want.strip()
    print(
        "OK " if got.strip() == want.strip() else "BAD",
        t["prompt"].split('"""')[1].split("\n")[0],
        "|",
        got.strip()[-60:].replace("\n", " "),
    )
print(ok / n)
