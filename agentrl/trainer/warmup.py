"""Supervised warm-up on expert conversations, so that RL starts from a policy that sometimes succeeds.

Plain PyTorch on the Hugging Face model: the warm-up is a few hundred tiny steps, where Megatron's setup
cost would dominate. Only assistant tokens (content and the closing ``<|im_end|>``) carry loss. The
held-out accuracy jumps abruptly and seed-dependently (DESIGN.md §4), so the phase stops on a measured
accuracy, checked every ``eval_every`` steps, never on time.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

Conversation = tuple[list[dict[str, Any]], list[dict[str, Any]] | None]  # (messages, tools)


@dataclass
class WarmupConfig:
    lr: float = 3e-3
    batch_size: int = 32
    max_steps: int = 3000
    eval_every: int = 100
    target_accuracy: float = 0.3
    max_minutes: float = 0.0  # > 0: also stop at the first evaluation after this much wall time
    seed: int = 0


@dataclass
class WarmupResult:
    steps: int
    accuracy: float
    history: list[dict[str, float]] = field(default_factory=list)


def supervised_warmup(
    model_dir: str | Path,
    out_dir: str | Path,
    conversations: Sequence[Conversation],
    evaluate: Callable[[Path], float],
    config: WarmupConfig | None = None,
    progress: Callable[[dict[str, float]], None] | None = None,
) -> WarmupResult:
    """Fine-tune ``model_dir`` on ``conversations``; save to ``out_dir`` at each evaluation.

    ``evaluate(out_dir)`` returns held-out accuracy of the saved model; training stops as soon as it
    reaches ``config.target_accuracy`` (the saved model is the one that reached it), at ``max_steps``, or
    at the first evaluation after ``max_minutes`` (a budget, so a run always finishes).
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    cfg = config or WarmupConfig()
    torch.manual_seed(cfg.seed)
    rng = random.Random(cfg.seed)
    from agentrl.envs.render import ChatRenderer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    renderer = ChatRenderer(tokenizer)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model.train()
    encoded = [(r.ids, r.assistant_mask)
               for r in (renderer.render(m, t, add_generation_prompt=False) for m, t in conversations)]
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr)
    out = Path(out_dir)
    history: list[dict[str, float]] = []
    accuracy = 0.0
    step = 0
    pad = tokenizer.pad_token_id
    deadline = time.monotonic() + cfg.max_minutes * 60 if cfg.max_minutes > 0 else float("inf")
    for step in range(1, cfg.max_steps + 1):
        batch = rng.sample(encoded, min(cfg.batch_size, len(encoded)))
        width = max(len(ids) for ids, _ in batch)
        input_ids = torch.full((len(batch), width), pad, dtype=torch.long)
        labels = torch.full((len(batch), width), -100, dtype=torch.long)
        attention = torch.zeros((len(batch), width), dtype=torch.long)
        for row, (ids, mask) in enumerate(batch):
            input_ids[row, : len(ids)] = torch.tensor(ids)
            attention[row, : len(ids)] = 1
            labels[row, : len(ids)] = torch.tensor([t if m else -100 for t, m in zip(ids, mask, strict=True)])
        loss = model(input_ids=input_ids, attention_mask=attention, labels=labels).loss
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        if step % cfg.eval_every == 0 or step == cfg.max_steps:
            model.save_pretrained(out, safe_serialization=True)
            tokenizer.save_pretrained(out)
            accuracy = evaluate(out)
            record = {"warmup_step": step, "warmup_loss": loss.item(), "eval_accuracy": accuracy}
            history.append(record)
            if progress:
                progress(record)
            if accuracy >= cfg.target_accuracy or time.monotonic() > deadline:
                break
    return WarmupResult(steps=step, accuracy=accuracy, history=history)
