"""Per-token teacher-minus-student gaps on the logged rollouts of the stored distillation run (steps 1-10):
teacher = GRPO's best (0.725), temperature 0.3 as in the run. Prints the distribution (gap_diag.txt).

    python benchmarks/results/distill_vs_grpo_2026-12-07b/gap_diag.py

Reads /tmp/distill/grpo/hf/best and /tmp/distill/distill/samples/step-N.jsonl (the stored run's output
dirs, not committed)."""

import json
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

T = 0.3
teacher = AutoModelForCausalLM.from_pretrained("/tmp/distill/grpo/hf/best").eval()
gaps, per_seq = [], []
for step in range(1, 11):
    for line in Path(f"/tmp/distill/distill/samples/step-{step}.jsonl").read_text().splitlines():
        s = json.loads(line)
        if "tokens" not in s:
            continue
        with torch.no_grad():
            lps = torch.log_softmax(teacher(torch.tensor([s["tokens"]])).logits[0].float() / T, -1)
        start, seq = s["response_start"], []
        for j, m in enumerate(s["loss_mask"]):
            if m:
                t = start + j
                seq.append(s["rollout_logprobs"][j] - float(lps[t - 1, s["tokens"][t]]))  # student - teacher
        gaps += seq
        per_seq.append((s["reward"], sum(seq), len(seq)))
g = torch.tensor(gaps)
print(f"tokens {len(g)}  sequences {len(per_seq)}")
print(f"mean gap (sampled reverse KL / token) {g.mean():.3f}; mean |gap| {g.abs().mean():.3f}")
for q in [0.5, 0.9, 0.99, 0.999, 1.0]:
    print(f"  |gap| quantile {q}: {g.abs().quantile(q):.3f}")
srt = g.abs().sort(descending=True).values
for top in [0.001, 0.01, 0.05]:
    n = max(1, int(top * len(g)))
    print(f"  top {top * 100:.1f}% tokens carry {float(srt[:n].sum() / srt.sum()) * 100:.1f}% of sum |gap|")
print("fraction of tokens |gap| > 1:", float((g.abs() > 1).float().mean()), " > 5:", float((g.abs() > 5).float().mean()))
ok = [x[1] for x in per_seq if x[0] >= 1]
bad = [x[1] for x in per_seq if x[0] < 1]
print(f"per-sequence summed reverse KL: reward 1: mean {sum(ok) / max(len(ok), 1):.2f} (n={len(ok)}); "
      f"reward 0: mean {sum(bad) / max(len(bad), 1):.2f} (n={len(bad)})")
print("mean tokens per sequence", sum(x[2] for x in per_seq) / len(per_seq))
