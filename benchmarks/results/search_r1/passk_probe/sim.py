"""Search-R1 probe without Ray or Megatron: the run's supervised warm-up (agentrl.run.warmup), then GRPO
with the run's agent loop (agentrl.envs.generate_rollout, SearchR1Env, TrajectoryManager samples) and the
trainer's loss (agentrl.trainer.losses.policy_loss, grpo_advantages, zero-variance groups dropped,
log-probs of logits / T, Adam, clip 1.0, linear warm-up then cosine), sampling with HF generate on one
batch per agent-loop turn. Meant for sweeps on a many-core / GPU machine; the acceptance is `agentrl train`.

python sim.py OUT_DIR --warm-steps 400 [--grpo-steps 90 ...]          (see --help)
Writes OUT_DIR/log.jsonl: warm-up checks, pass@k rows of the warm model, GRPO steps with held-out evals.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import tempfile
import time
from pathlib import Path

import torch
import yaml

from agentrl.run.warmup import padded_batch




class Batcher:
    """The agent loop's ``generate``: requests wait until every running episode has asked, then one HF
    ``generate`` call serves them all (left-padded)."""

    def __init__(self, model, tokenizer, device: str) -> None:
        self.model, self.device = model, device
        self.pad = tokenizer.pad_token_id
        self.eos = tokenizer.eos_token_id
        self.pending: list = []
        self.waiters = 0
        self.flusher: asyncio.Task | None = None

    async def generate(self, input_ids, *, session_id, sampling_params=None):
        from agentrl.trajectory import TurnRecord

        fut = asyncio.get_running_loop().create_future()
        self.pending.append((list(input_ids), dict(sampling_params or {}), fut))
        if self.flusher is None or self.flusher.done():
            self.flusher = asyncio.ensure_future(self._flush())
        prompt, out, reason = await fut
        return TurnRecord(prompt_ids=tuple(prompt), output_ids=tuple(out), output_logprobs=(), finish_reason=reason)

    async def _flush(self) -> None:
        seen = -1
        while len(self.pending) != seen:  # until no episode adds a request for a few loop turns
            seen = len(self.pending)
            for _ in range(4):
                await asyncio.sleep(0)
        batch, self.pending = self.pending, []
        by_params: dict = {}
        for item in batch:
            p = item[1]
            by_params.setdefault((p.get("temperature", 1.0),), []).append(item)
        for (temperature,), items in by_params.items():
            for chunk in range(0, len(items), 2048):
                self._run(items[chunk:chunk + 2048], temperature)

    @torch.no_grad()
    def _run(self, items, temperature: float) -> None:
        width = max(len(ids) for ids, _, _ in items)
        ids = torch.full((len(items), width), self.pad, dtype=torch.long)
        att = torch.zeros_like(ids)
        for r, (p, _, _) in enumerate(items):
            ids[r, width - len(p):] = torch.tensor(p)
            att[r, width - len(p):] = 1
        max_new = max(it[1].get("max_new_tokens", 64) for it in items)
        kwargs = dict(do_sample=False) if temperature == 0 else dict(do_sample=True, temperature=temperature,
                                                                     top_k=0, top_p=1.0)
        out = self.model.generate(input_ids=ids.to(self.device), attention_mask=att.to(self.device),
                                  max_new_tokens=max_new, eos_token_id=self.eos, pad_token_id=self.pad, **kwargs)
        new = out[:, width:].tolist()
        for (p, params, fut), toks in zip(items, new, strict=True):
            toks = toks[: params.get("max_new_tokens", 64)]
            reason = "length"
            if self.eos in toks:
                toks = toks[: toks.index(self.eos) + 1]
                reason = "stop"
            fut.set_result((p, toks, reason))


def rollout(batcher, renderer, tasks, k: int, temperature: float):
    from agentrl.envs import generate_rollout
    from examples.search_r1.env import SearchR1Env

    return asyncio.run(generate_rollout(SearchR1Env, tasks, batcher.generate, renderer, n_samples_per_task=k,
                                        concurrency=len(tasks) * k, max_context_tokens=512,
                                        sampling_params={"temperature": temperature, "max_new_tokens": 64}))


def _em(e) -> bool:
    from examples.search_r1.reward import score

    env_reply = next((m["content"] for m in reversed(e.messages) if m["role"] == "assistant"), "")
    return score(env_reply, e.task["answers"], metric="em") >= 1


def passk(batcher, renderer, tasks, k: int, temperature: float) -> dict:
    res = rollout(batcher, renderer, tasks, k, temperature)
    means = [sum(_em(e) for e in g) / len(g) for g in res.groups]
    rew = [[e.metrics.reward for e in g] for g in res.groups]
    return {"pass1": sum(means) / len(means), f"pass{k}": sum(m > 0 for m in means) / len(means),
            "mixed_em": sum(0 < m < 1 for m in means) / len(means),
            "mixed_reward": sum(len(set(r)) > 1 for r in rew) / len(rew),
            "searches": sum(e.metrics.tool_calls for e in res.episodes) / len(res.episodes)}


def greedy(batcher, renderer, tasks) -> dict:
    res = rollout(batcher, renderer, tasks, 1, 0.0)
    eps = res.episodes
    out = {"em": sum(map(_em, eps)) / len(eps)}
    for hops in (1, 2):
        sub = [e for e in eps if len(e.task["evidence"]) == hops]
        out[f"em_{hops}hop"] = sum(map(_em, sub)) / max(len(sub), 1)
    out["searches"] = sum(e.metrics.tool_calls for e in eps) / len(eps)
    return out


def lr_at(step: int, a) -> float:
    """Megatron-style: linear warm-up over lr_warmup_steps, then cosine to min_lr at lr_decay_steps."""
    if step < a.lr_warmup_steps:
        return a.lr * (step + 1) / a.lr_warmup_steps
    frac = min(1.0, (step - a.lr_warmup_steps) / max(1, a.lr_decay_steps - a.lr_warmup_steps))
    return a.min_lr + (a.lr - a.min_lr) * 0.5 * (1 + math.cos(math.pi * frac))


def token_logprobs(model, ids, att, temperature: float):
    logits = model(input_ids=ids, attention_mask=att).logits[:, :-1].float() / temperature
    return torch.log_softmax(logits, -1).gather(-1, ids[:, 1:, None]).squeeze(-1), logits


def grpo_step(model, ref, opt, samples, a, device, step: int) -> dict:
    from agentrl.trainer.losses import LossConfig, grpo_advantages, policy_loss

    groups: dict = {}
    for s in samples:
        groups.setdefault(s.group_id, []).append(s)
    kept = [g for g in groups.values() if len({s.reward for s in g}) > 1]
    info = {"groups": len(groups), "groups_kept": len(kept)}
    if not kept:
        return info
    flat = [s for g in kept for s in g]
    adv = grpo_advantages(torch.tensor([float(s.reward) for s in flat]), [s.group_id for s in flat])
    if a.credit_fn:
        from agentrl.plugins import load_function

        before = sum(sum(s.loss_mask) for s in flat)
        flat = load_function(a.credit_fn)(flat, adv.tolist())
        info["credit_withheld_tokens"] = before - sum(sum(s.loss_mask) for s in flat)
    width = max(len(s.tokens) for s in flat)
    ids = torch.zeros((len(flat), width), dtype=torch.long)
    att = torch.zeros_like(ids)
    mask = torch.zeros((len(flat), width - 1))
    for r, s in enumerate(flat):
        ids[r, : len(s.tokens)] = torch.tensor(s.tokens)
        att[r, : len(s.tokens)] = 1
        for i, m in enumerate(s.loss_mask):
            if m:
                mask[r, s.response_start + i - 1] = 1.0  # predicted from the position before
    ids, att, mask, adv = ids.to(device), att.to(device), mask.to(device), adv.to(device)
    cfg = LossConfig(eps_clip=0.2, eps_clip_high=0.28, kl_coef=a.kl_coef)
    for g in opt.param_groups:
        g["lr"] = lr_at(step, a)
    with torch.no_grad():
        ref_lp, _ = token_logprobs(ref, ids, att, a.temperature)
        old_lp, _ = token_logprobs(model, ids, att, a.temperature)
    order = torch.randperm(len(flat)).tolist()
    parts = [order[i::a.steps_per_batch] for i in range(a.steps_per_batch)]  # PPO mini-batches
    n_tokens = float(mask.sum())
    for part in parts:
        sel = torch.tensor(part, device=ids.device)
        lp, logits = token_logprobs(model, ids[sel], att[sel], a.temperature)
        probs = torch.softmax(logits, -1)
        entropy = -(probs * torch.log_softmax(logits, -1)).sum(-1)
        loss, metrics = policy_loss(lp, old_lp[sel], adv[sel], mask[sel], cfg, ref_logprobs=ref_lp[sel],
                                    entropy=entropy.detach(), n_tokens=float(mask[sel].sum()) or n_tokens)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        info["grad_norm"] = float(torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0))
        opt.step()
    info.update({k: float(v) for k, v in metrics.items()})
    return info


def warmup_on_device(base, out, chats, held_chats, w, a, probe_at, tokenizer, renderer, probe_pools, write):
    """agentrl.run.warmup.supervised_warmup's loop (same seeds, batches, AdamW) on ``a.device``; pass@k
    probes of the model at the ``probe_at`` steps; the model of ``a.warm_steps`` saved to ``out``."""
    from transformers import AutoModelForCausalLM


    torch.manual_seed(0)
    rng = random.Random(0)
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32).to(a.device)
    model.train()

    def encode(cs):
        rendered = (renderer.render(m, t, add_generation_prompt=False) for m, t in cs)
        return [(r.ids, r.assistant_mask) for r in rendered]

    train_rows, held_rows = encode(chats), encode(held_chats)
    opt = torch.optim.AdamW(model.parameters(), lr=w.get("lr", 3e-3))
    pad = tokenizer.pad_token_id
    bs = w.get("batch_size", 32)
    for step in range(1, a.warm_steps + 1):
        ids, att, labels = (x.to(a.device) for x in padded_batch(rng.sample(train_rows, min(bs, len(train_rows))), pad))
        loss = model(input_ids=ids, attention_mask=att, labels=labels).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        if step % 25 == 0 or step in probe_at:
            model.eval()
            with torch.no_grad():
                ids, att, labels = (x.to(a.device) for x in padded_batch(held_rows, pad))
                pred = model(input_ids=ids, attention_mask=att).logits[:, :-1].argmax(-1)
                tgt = labels[:, 1:]
                check = float((~((pred != tgt) & (tgt != -100)).any(1)).float().mean())
            row = {"warmup_step": step, "warmup_loss": loss.item(), "warmup_check": check}
            if step in probe_at:
                b = Batcher(model, tokenizer, a.device)
                for name, tasks in probe_pools.items():
                    row[f"{name}/greedy"] = greedy(b, renderer, tasks)
                    for t in [float(x) for x in a.probe_temps.split(",") if x]:
                        row[f"{name}/T{t}"] = passk(b, renderer, tasks, a.k, t)
            write(row)
            model.train()
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    return out


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("out")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--set", nargs="*", default=[], help="task_kwargs overrides key=json")
    p.add_argument("--grpo-set", nargs="*", default=[], help="task_kwargs overrides for GRPO's questions only")
    p.add_argument("--warm-set", nargs="*", default=[], help="warmup overrides key=json (num_conversations, lr, batch_size)")
    p.add_argument("--warm-steps", type=int, default=400, help="warm-up steps before GRPO")
    p.add_argument("--warm-from", default=None, help="start from this saved warm model instead")
    p.add_argument("--save-warm", default=None, help="save the warm model here")
    p.add_argument("--probe-at", default="", help="comma list of warm-up steps to measure pass@k at")
    p.add_argument("--k", type=int, default=16)
    p.add_argument("--probe-temps", default="0.7,1.0")
    p.add_argument("--grpo-steps", type=int, default=0)
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--samples", type=int, default=16)
    p.add_argument("--temperature", type=float, default=0.7)
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--min-lr", type=float, default=3e-5)
    p.add_argument("--lr-warmup-steps", type=int, default=20)
    p.add_argument("--lr-decay-steps", type=int, default=150)
    p.add_argument("--steps-per-batch", type=int, default=1, help="optimizer steps per rollout batch (PPO mini-batches)")
    p.add_argument("--credit-fn", default=None, help="trainer.credit_fn plug-in (module:function)")
    p.add_argument("--eval-pools", default="heldout,train,synthetic")
    p.add_argument("--kl-coef", type=float, default=0.001)
    p.add_argument("--eval-every", type=int, default=10)
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from agentrl.envs import ChatRenderer
    from agentrl.models.tiny import make_tiny_model
    from examples.search_r1.env import SearchR1Env, expert_messages
    from examples.search_r1.questions import make_questions
    from examples.search_r1.tokenizer import write_tokenizer

    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    log = (out / "log.jsonl").open("a")
    t0 = time.monotonic()

    def write(row: dict) -> None:
        row = {**row, "t": round(time.monotonic() - t0, 1)}
        log.write(json.dumps(row) + "\n")
        log.flush()
        print(json.dumps(row), flush=True)

    cfg = yaml.safe_load(Path("examples/search_r1/config.yaml").read_text())
    kw, w = dict(cfg["task_kwargs"]), dict(cfg["warmup"])
    for s in a.set:
        key, v = s.split("=", 1)
        kw[key] = json.loads(v)
    for s in a.warm_set:
        key, v = s.split("=", 1)
        w[key] = json.loads(v)
    write({"args": vars(a), "task_kwargs": kw, "warmup": w})
    heldout = make_questions(100, seed=0, split="heldout", **kw)
    real = {**kw, "train_synthetic": 0.0, "train_search_credit": 0.0}
    probe_pools = {"heldout": heldout, "train": make_questions(100, seed=12345, split="train", **real),
                   "synthetic": make_questions(100, seed=777, split="train", **{**real, "train_synthetic": 1.0})}
    tmp = Path(tempfile.mkdtemp())
    if a.warm_from:
        warm_dir = Path(a.warm_from)
    else:
        write_tokenizer(tmp / "tok")
        base = make_tiny_model(tmp / "base", seed=0, tokenizer_dir=tmp / "tok")
        tools = SearchR1Env.tool_schemas()
        chats = [(expert_messages(t), tools) for t in make_questions(w["num_conversations"], seed=1, split="warmup", **kw)]
        held_chats = [(expert_messages(t), tools) for t in heldout]
        probe_at = sorted({int(x) for x in a.probe_at.split(",") if x} | {a.warm_steps})
        tokenizer = AutoTokenizer.from_pretrained(base)
        renderer = ChatRenderer(tokenizer)
        warm_dir = warmup_on_device(base, tmp / "warm", chats, held_chats, w, a, probe_at, tokenizer, renderer,
                                    probe_pools, write)
        if a.save_warm:
            import shutil
            shutil.copytree(warm_dir, a.save_warm, dirs_exist_ok=True)
    if not a.grpo_steps:
        return
    for s in a.grpo_set:
        key, v = s.split("=", 1)
        kw[key] = json.loads(v)
    tokenizer = AutoTokenizer.from_pretrained(warm_dir)
    renderer = ChatRenderer(tokenizer)
    model = AutoModelForCausalLM.from_pretrained(warm_dir, dtype=torch.float32).to(a.device)
    ref = AutoModelForCausalLM.from_pretrained(warm_dir, dtype=torch.float32).to(a.device).eval()
    opt = torch.optim.Adam(model.parameters(), lr=a.lr, betas=(0.9, 0.999), eps=1e-8)
    random.seed(a.seed)
    torch.manual_seed(a.seed)
    batcher = Batcher(model, tokenizer, a.device)
    for step in range(a.grpo_steps + 1):
        if step % a.eval_every == 0 or step == a.grpo_steps:
            model.eval()
            pools = a.eval_pools.split(",")
            write({"step": step, "eval": greedy(batcher, renderer, heldout),
                   **{f"{name}_pool": greedy(batcher, renderer, probe_pools[name]) for name in pools if name != "heldout"}})
        if step == a.grpo_steps:
            break
        tasks = make_questions(a.prompts, seed=a.seed * 1_000_003 + step, split="train", **kw)
        model.eval()
        res = rollout(batcher, renderer, tasks, a.samples, a.temperature)
        model.train()
        info = grpo_step(model, ref, opt, res.samples, a, a.device, step)
        eps = res.episodes
        info.update(step=step, reward=sum(e.metrics.reward for e in eps) / len(eps),
                    em=sum(map(_em, eps)) / len(eps),
                    searches=sum(e.metrics.tool_calls for e in eps) / len(eps),
                    synthetic_em=_mean([_em(e) for e in eps if e.task.get("synthetic")]),
                    real_em=_mean([_em(e) for e in eps if not e.task.get("synthetic")]))
        write(info)


def _mean(xs):
    return sum(xs) / len(xs) if xs else None


if __name__ == "__main__":
    main()
