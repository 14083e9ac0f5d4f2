# ruff: noqa: E402  (threads are set before the model libraries load)
"""Host-side warm-up probe (diagnosis only): teacher-forced held-out check vs steps for a tiny-model shape."""

import json
import random
import sys
import time

import torch

torch.set_num_threads(int(sys.argv[2]) if len(sys.argv) > 2 else 1)
from transformers import AutoModelForCausalLM, AutoTokenizer

from agentrl.envs.render import ChatRenderer
from agentrl.models.tiny import make_tiny_model
from agentrl.run.warmup import padded_batch, teacher_forced_accuracy  # noqa: E402
from examples.coding_agent.function_env import FunctionEnv, expert_messages, make_tasks



shape = json.loads(sys.argv[1])
steps = int(sys.argv[3]) if len(sys.argv) > 3 else 800
lr = float(sys.argv[4]) if len(sys.argv) > 4 else 3e-3
tag = "_".join(f"{k[:3]}{v}" for k, v in shape.items())
d = f"/tmp/helper-code/base_{tag}"
make_tiny_model(d, seed=0, **shape)
tok = AutoTokenizer.from_pretrained(d)
r = ChatRenderer(tok)
schemas = FunctionEnv.tool_schemas()


def enc(tasks):
    out = []
    for t in tasks:
        x = r.render(expert_messages(t), schemas, add_generation_prompt=False)
        out.append((x.ids, x.assistant_mask))
    return out


train = enc(make_tasks(4000, seed=1, split="train"))
held = enc(make_tasks(64, seed=0, split="heldout"))
model = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32)
model.train()
print(tag, "params", sum(p.numel() for p in model.parameters()), flush=True)
opt = torch.optim.AdamW(model.parameters(), lr=lr)
rng = random.Random(0)
torch.manual_seed(0)
t0 = time.time()
for step in range(1, steps + 1):
    ids, att, lab = padded_batch(rng.sample(train, 16), tok.pad_token_id)
    loss = model(input_ids=ids, attention_mask=att, labels=lab).loss
    opt.zero_grad()
    loss.backward()
    opt.step()
    if step % 25 == 0:
        acc = teacher_forced_accuracy(model, held, tok.pad_token_id)
        print(
            json.dumps({"step": step, "t": round(time.time() - t0, 1), "loss": round(loss.item(), 4), "check": acc}),
            flush=True,
        )
        if step % 100 == 0:
            model.save_pretrained(f"{d}/s{step}")
            tok.save_pretrained(f"{d}/s{step}")
