"""Warm-up probe: teacher-forced held-out accuracy vs steps for a tiny-model shape (no Ray)."""
import argparse, json, random, sys, time
import torch
sys.path[:0] = ["/work/main", "/tmp/helper-search"]
import synth
from agentrl.models.tiny import make_tiny_model
from agentrl.run.warmup import padded_batch, teacher_forced_accuracy
from agentrl.envs.render import ChatRenderer
from examples.search_r1.questions import make_questions
from examples.search_r1.env import expert_messages, SearchR1Env
from transformers import AutoModelForCausalLM, AutoTokenizer



p = argparse.ArgumentParser()
p.add_argument("--layers", type=int, default=2); p.add_argument("--hidden", type=int, default=128)
p.add_argument("--inter", type=int, default=512); p.add_argument("--heads", type=int, default=4)
p.add_argument("--kv", type=int, default=2); p.add_argument("--lr", type=float, default=3e-3)
p.add_argument("--bs", type=int, default=16); p.add_argument("--steps", type=int, default=600)
p.add_argument("--every", type=int, default=50); p.add_argument("--threads", type=int, default=1)
p.add_argument("--share", type=float, default=0.75); p.add_argument("--wkinds", default="all")
p.add_argument("--synth", type=float, default=0.0); p.add_argument("--out", required=True); p.add_argument("--save", default="")
a = p.parse_args()
torch.set_num_threads(a.threads)
kinds = ["capital", "neighbour_capital"]
wk = ["capital", "neighbour_capital", "country_of_capital", "population_by_capital"] if a.wkinds == "all" else a.wkinds.split(",")
kw = dict(kinds=kinds, holdout="question", warmup_share=a.share, warmup_kinds=wk)
train = make_questions(4000, split="warmup", seed=1, **kw)
held = make_questions(100, split="heldout", seed=0, **kw)
grpo = make_questions(100, split="train", seed=0, **kw)
d = f"/tmp/helper-search/m_{a.synth}_{a.layers}_{a.hidden}_{a.inter}_{a.heads}_{a.kv}"
make_tiny_model(d, seed=0, num_hidden_layers=a.layers, hidden_size=a.hidden, intermediate_size=a.inter,
                num_attention_heads=a.heads, num_key_value_heads=a.kv)
tok = AutoTokenizer.from_pretrained(d); r = ChatRenderer(tok)
tools = SearchR1Env.tool_schemas()
enc = lambda qs: [(x.ids, x.assistant_mask) for x in (r.render(expert_messages(q), tools, add_generation_prompt=False) for q in qs)]
tr, he, gr = enc(train), enc(held), enc(grpo)
srng = random.Random(5)
encm = lambda ms: [(x.ids, x.assistant_mask) for x in (r.render(mm, tools, add_generation_prompt=False) for mm in ms)]
sy = encm([synth.chat(srng) for _ in range(12000)]); syh = encm([synth.chat(random.Random(99)) for _ in range(1)] + [synth.chat(srng) for _ in range(99)])
he1 = [e for e, q in zip(he, held) if q["kind"] == "capital"]; he2 = [e for e, q in zip(he, held) if q["kind"] != "capital"]
torch.manual_seed(0); rng = random.Random(0)
m = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32); m.train()
print("params", sum(p.numel() for p in m.parameters()), flush=True)
opt = torch.optim.AdamW(m.parameters(), lr=a.lr); pad = tok.pad_token_id
t0 = time.time(); f = open(a.out, "w")
for step in range(1, a.steps + 1):
    nsy = sum(rng.random() < a.synth for _ in range(a.bs))
    ids, att, lab = padded_batch(rng.sample(tr, a.bs - nsy) + rng.sample(sy, nsy), pad)
    loss = m(input_ids=ids, attention_mask=att, labels=lab).loss
    opt.zero_grad(); loss.backward(); opt.step()
    if step % a.every == 0:
        rec = dict(step=step, t=round(time.time() - t0, 1), loss=round(loss.item(), 4),
                   h1=teacher_forced_accuracy(m, he1, pad), h2=teacher_forced_accuracy(m, he2, pad),
                   grpo=teacher_forced_accuracy(m, gr, pad), syn=teacher_forced_accuracy(m, syh, pad))
        print(json.dumps(rec), flush=True); f.write(json.dumps(rec) + "\n"); f.flush()
        if a.save:
            m.save_pretrained(f"{a.save}/step{step}"); tok.save_pretrained(f"{a.save}/step{step}")
