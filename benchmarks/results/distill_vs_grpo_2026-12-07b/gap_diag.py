"""Per-token teacher-minus-student gaps on the logged rollouts of the stored distillation run (steps 1-10):
teacher = GRPO's best (0.725), temperature 0.3 as in the run. Prints the distribution."""
import json, glob, sys, torch
from transformers import AutoModelForCausalLM
T = 0.3
teacher = AutoModelForCausalLM.from_pretrained("/tmp/distill/grpo/hf/best").eval()
gaps, rewards = [], []
per_seq = []
for step in range(1, 11):
    for line in open(f"/tmp/distill/distill/samples/step-{step}.jsonl"):
        s = json.loads(line)
        if "tokens" not in s: continue
        toks = torch.tensor([s["tokens"]])
        with torch.no_grad():
            logits = teacher(toks).logits[0].float() / T
        lps = torch.log_softmax(logits, -1)
        start = s["response_start"]
        seq = []
        for j, m in enumerate(s["loss_mask"]):
            if not m: continue
            t = start + j
            tlp = float(lps[t - 1, s["tokens"][t]])
            g = s["rollout_logprobs"][j] - tlp   # student minus teacher (reverse-KL sample)
            gaps.append(g); seq.append(g)
        per_seq.append((s["reward"], sum(seq), len(seq)))
g = torch.tensor(gaps)
print(f"tokens {len(g)}  sequences {len(per_seq)}")
print(f"mean gap (sampled reverse KL / token) {g.mean():.3f}; mean |gap| {g.abs().mean():.3f}")
for q in [0.5, 0.9, 0.99, 0.999, 1.0]:
    print(f"  |gap| quantile {q}: {g.abs().quantile(q):.3f}")
srt = g.abs().sort(descending=True).values
for top in [0.001, 0.01, 0.05]:
    n = max(1, int(top * len(g)))
    print(f"  top {top*100:.1f}% tokens carry {float(srt[:n].sum() / srt.sum())*100:.1f}% of sum |gap|")
print("fraction of tokens |gap| > 1:", float((g.abs() > 1).float().mean()), " > 5:", float((g.abs() > 5).float().mean()))
# sequence-level: sum of gaps for correct vs wrong
ok = [x[1] for x in per_seq if x[0] >= 1]; bad = [x[1] for x in per_seq if x[0] < 1]
print(f"per-sequence summed reverse KL: reward 1: mean {sum(ok)/max(len(ok),1):.2f} (n={len(ok)}); reward 0: mean {sum(bad)/max(len(bad),1):.2f} (n={len(bad)})")
print("mean tokens per sequence", sum(x[2] for x in per_seq) / len(per_seq))
