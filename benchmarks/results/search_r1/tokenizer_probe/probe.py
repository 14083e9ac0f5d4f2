"""Probe: is copying learnable with one token per name? Supervised warm-up of the tiny model on the
config's warm-up chats, with the bundled tokenizer (``old``) or examples.search_r1.tokenizer (``new``);
every 25 steps, teacher-forced on 100 held-out expert chats (50 one-hop, 50 two-hop): share whose first
assistant turn (the first query) is all argmax-correct, whose last turn (the answer, given the true
search results) is, and whose every assistant token is (the warm-up's check).

nice -n 19 python benchmarks/results/search_r1/tokenizer_probe/probe.py old|new|words MINUTES OUT.jsonl
"""
import json
import random
import sys
import tempfile
import time
from pathlib import Path

import torch
import yaml

torch.set_num_threads(1)
from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: E402

from agentrl.envs.render import ChatRenderer  # noqa: E402
from agentrl.models.tiny import make_tiny_model  # noqa: E402
from agentrl.run.warmup import padded_batch  # noqa: E402
from examples.search_r1.env import SearchR1Env, expert_messages  # noqa: E402
from examples.search_r1.questions import make_questions  # noqa: E402

which, minutes, out_path = sys.argv[1], float(sys.argv[2]), sys.argv[3]
cfg = yaml.safe_load(Path("examples/search_r1/config.yaml").read_text())
kw = cfg["task_kwargs"]
tmp = Path(tempfile.mkdtemp())
tok_dir = None
if which in ("new", "words"):  # new: one token per name; words: and per template word and call piece
    from examples.search_r1.tokenizer import write_tokenizer
    tok_dir = tmp / "tok"
    write_tokenizer(tok_dir, words=which == "words")
model_dir = make_tiny_model(tmp / "m", seed=0, **({"tokenizer_dir": tok_dir} if tok_dir else {}))
tokenizer = AutoTokenizer.from_pretrained(model_dir)
renderer = ChatRenderer(tokenizer)
tools = SearchR1Env.tool_schemas()


def encode(tasks):
    rows = []
    for t in tasks:
        r = renderer.render(expert_messages(t), tools, add_generation_prompt=False)
        rows.append((r.ids, r.assistant_mask))
    return rows


train = encode(make_questions(3000, split="warmup", seed=1, **kw))
held = encode(make_questions(100, split="heldout", seed=0, **kw))
print(which, "vocab", len(tokenizer), "mean train len", sum(len(i) for i, _ in train) / len(train), flush=True)
model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
pad = tokenizer.pad_token_id
rng = random.Random(0)


def turns(mask):
    runs, start = [], None
    for i, m in enumerate(list(mask) + [0]):
        if m and start is None:
            start = i
        elif not m and start is not None:
            runs.append((start, i))
            start = None
    return runs


def measure():
    model.eval()
    first = last = whole = 0
    with torch.no_grad():
        ids, att, labels = padded_batch(held, pad)
        pred = model(input_ids=ids, attention_mask=att).logits[:, :-1].argmax(-1)
        for row, (tids, mask) in enumerate(held):
            ok = [bool(pred[row, p - 1] == tids[p]) for p in range(1, len(tids))]
            ok = [True] + ok
            rs = turns(mask)
            f = all(ok[rs[0][0]:rs[0][1]])
            l_ = all(ok[rs[-1][0]:rs[-1][1]])
            w = all(all(ok[a:b]) for a, b in rs)
            first += f
            last += l_
            whole += w
    model.train()
    n = len(held)
    return first / n, last / n, whole / n


t0 = time.monotonic()
step = 0
with open(out_path, "w") as out:
    while time.monotonic() - t0 < minutes * 60:
        step += 1
        ids, att, labels = padded_batch(rng.sample(train, 16), pad)
        loss = model(input_ids=ids, attention_mask=att, labels=labels).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
        if step % 25 == 0:
            f, l_, w = measure()
            rec = {"tokenizer": which, "step": step, "s": round(time.monotonic() - t0, 1), "loss": round(loss.item(), 4),
                   "first_query_tf": f, "answer_tf": l_, "all_tf": w}
            print(json.dumps(rec), flush=True)
            out.write(json.dumps(rec) + "\n")
            out.flush()
