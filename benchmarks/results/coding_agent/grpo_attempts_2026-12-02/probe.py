"""Teacher-forced probability of the reference write turn under a model: per-task p(correct write) at T=1
and approximate at T=0.3/0.5 (per-token renormalised p^(1/T)), and which token position is the bottleneck."""

import collections
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[4]))  # the repo root
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from examples.coding_agent import function_env as fe
from examples.coding_agent import oneliners as o

torch.set_num_threads(1)
model_dir = sys.argv[1]
tok = AutoTokenizer.from_pretrained(model_dir)
model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
SYS = fe.SYSTEM_PROMPT + "\nTools: write(code) run_tests() submit()"


def prompt(t):
    return f"<|im_start|>system\n{SYS}<|im_end|>\n<|im_start|>user\n{t['prompt']}<|im_end|>\n<|im_start|>assistant\n"


res = {}
for split, seed in (("heldout", 0), ("train", 12345)):
    tasks = o.make_tasks(128, seed=seed, split=split)
    rows = []
    for t in tasks:
        p = tok(prompt(t))["input_ids"]
        r = tok(fe.expert_replies(t)[0] + "<|im_end|>")["input_ids"]
        ids = torch.tensor([p + r])
        with torch.no_grad():
            logits = model(ids).logits[0, len(p) - 1 : -1].double()
        out = {}
        for T in (1.0, 0.5, 0.3):
            lp = torch.log_softmax(logits / T, -1)
            tl = lp[torch.arange(len(r)), torch.tensor(r)]
            out[T] = tl.sum().exp().item()
        lp1 = torch.log_softmax(logits, -1)
        tl1 = lp1[torch.arange(len(r)), torch.tensor(r)]
        worst = int(tl1.argmin())
        top = int(lp1[worst].argmax())
        greedy_ok = bool((lp1.argmax(-1) == torch.tensor(r)).all())
        rows.append(
            dict(
                task=t["task_id"],
                spec=o.spec_key(t["spec"]),
                p=out,
                greedy_ok=greedy_ok,
                worst_tok=tok.decode([r[worst]]),
                worst_p=tl1[worst].exp().item(),
                argmax_there=tok.decode([top]),
            )
        )
    res[split] = rows
    for T in (1.0, 0.5, 0.3):
        ps = [x["p"][T] for x in rows]
        var = sum(1 - q**8 - (1 - q) ** 8 for q in ps) / len(ps)
        print(
            json.dumps(
                dict(
                    model=model_dir.split("/")[-1],
                    split=split,
                    T=T,
                    mean_p_correct=round(sum(ps) / len(ps), 3),
                    frac_groups8_with_variance=round(var, 3),
                    frac_tasks_p_lt_1pct=round(sum(q < 0.01 for q in ps) / len(ps), 3),
                )
            )
        )
    print(split, "greedy-correct (teacher-forced argmax)", sum(x["greedy_ok"] for x in rows) / len(rows))
    c = collections.Counter((x["worst_tok"], x["argmax_there"]) for x in rows if not x["greedy_ok"])
    print(split, "bottleneck (reference token, argmax there):", c.most_common(12))
Path(sys.argv[2]).write_text(json.dumps(res))
