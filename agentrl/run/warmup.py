"""Supervised warm-up on expert conversations, so that RL starts from a policy that sometimes succeeds.

Plain PyTorch on the Hugging Face model: the warm-up is a few hundred tiny steps, where Megatron's setup
cost would dominate. Only assistant tokens (content and the closing ``<|im_end|>``) carry loss.

Held-out accuracy jumps abruptly and seed-dependently (measured here: 3% → 14% → 54% in 20 steps), so
the phase stops on measured accuracy, never on time. Two measurements. The cheap one, every
``check_every`` steps and every step once it is above zero: the fraction of held-out expert chats whose
every assistant token is the greedy argmax under teacher forcing (one batched forward; for an
environment that answers deterministically this is greedy-rollout accuracy). The real one,
``evaluate(saved_dir)``, runs once the cheap one reaches the target (and every ``eval_every`` steps)
and decides when to stop. Because one step can jump from well below the target to well above it
(0.265 → 0.41 for a 0.3 target here), ``stop_nearest_target`` keeps the weights of the last checked step
before the crossing and, if its check is nearer the target, evaluates it for real and keeps whichever of
the two measured nearer.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pydantic import Field

from agentrl.settings import Settings

Conversation = tuple[list[dict[str, Any]], list[dict[str, Any]] | None]  # (messages, tools)
Encoded = tuple[list[int], list[int]]  # (token ids, assistant mask)


class WarmupConfig(Settings):
    """The ``warmup`` section: supervised fine-tuning on expert chats before RL (runs only when the run
    names an ``expert``)."""

    lr: float = Field(3e-3, gt=0, description="AdamW learning rate")
    batch_size: int = Field(32, ge=1, description="conversations per step")
    max_steps: int = Field(3000, ge=1, description="step cap (ends with a real evaluation)")
    check_every: int = Field(10, ge=1, description="steps between teacher-forced held-out checks")
    eval_every: int = Field(100, ge=1, description="steps between real evaluations while the check is below target")
    target_accuracy: float = Field(0.3, ge=0, le=1, description="stop once a real evaluation reaches this")
    max_minutes: float = Field(0.0, ge=0, description="> 0: also stop at the first real evaluation after this long")
    num_conversations: int = Field(4000, ge=1, description="expert chats to train on")
    stop_nearest_target: bool = Field(True, description="keep the step before the crossing if it measures nearer")


@dataclass
class WarmupResult:
    steps: int
    accuracy: float
    history: list[dict[str, float]] = field(default_factory=list)


def padded_batch(rows: Sequence[Encoded], pad: int):
    """Right-padded input ids, attention mask and labels (-100 off the trained tokens) of ``rows``."""
    import torch

    width = max(len(ids) for ids, _ in rows)
    input_ids = torch.full((len(rows), width), pad, dtype=torch.long)
    labels = torch.full((len(rows), width), -100, dtype=torch.long)
    attention = torch.zeros((len(rows), width), dtype=torch.long)
    for row, (ids, mask) in enumerate(rows):
        input_ids[row, : len(ids)] = torch.tensor(ids)
        attention[row, : len(ids)] = 1
        labels[row, : len(ids)] = torch.tensor([t if m else -100 for t, m in zip(ids, mask, strict=True)])
    return input_ids, attention, labels


def teacher_forced_accuracy(model, rows: Sequence[Encoded], pad: int, chunk: int = 64) -> float:
    """Fraction of ``rows`` whose every assistant token is the model's argmax given the tokens before it."""
    import torch

    if not rows:
        return 0.0
    was_training = model.training
    model.eval()
    exact = 0
    with torch.no_grad():
        for start in range(0, len(rows), chunk):
            input_ids, attention, labels = padded_batch(rows[start : start + chunk], pad)
            predicted = model(input_ids=input_ids, attention_mask=attention).logits[:, :-1].argmax(-1)
            targets = labels[:, 1:]
            wrong = (predicted != targets) & (targets != -100)
            exact += int((~wrong.any(dim=1)).sum())
    model.train(was_training)
    return exact / len(rows)


def supervised_warmup(
    model_dir: str | Path,
    out_dir: str | Path,
    conversations: Sequence[Conversation],
    evaluate: Callable[[Path], float],
    config: WarmupConfig | None = None,
    progress: Callable[[dict[str, float]], None] | None = None,
    heldout: Sequence[Conversation] = (),
    seed: int = 0,
    chat_template_kwargs: Mapping[str, Any] | None = None,
) -> WarmupResult:
    """Fine-tune ``model_dir`` on ``conversations``; save to ``out_dir`` before each real evaluation.

    ``heldout`` (expert chats of held-out tasks) feeds the cheap check; ``evaluate(out_dir)`` returns the
    real held-out accuracy of the saved model; ``chat_template_kwargs`` render the chats as the rollouts do.
    Training stops as soon as that reaches
    ``config.target_accuracy`` (the saved model is the one that reached it), at ``max_steps``, or at the
    first real evaluation after ``max_minutes`` (a budget, so a run always finishes).
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from agentrl.envs.render import ChatRenderer

    cfg = config or WarmupConfig()
    torch.manual_seed(seed)
    rng = random.Random(seed)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    renderer = ChatRenderer(tokenizer, **(chat_template_kwargs or {}))

    def encode(chats: Sequence[Conversation]) -> list[Encoded]:
        rendered = (renderer.render(m, t, add_generation_prompt=False) for m, t in chats)
        return [(r.ids, r.assistant_mask) for r in rendered]

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model.train()
    train_rows, heldout_rows = encode(conversations), encode(heldout)
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr)
    out = Path(out_dir)
    pad = tokenizer.pad_token_id
    history: list[dict[str, float]] = []
    accuracy, check, step, last_eval = 0.0, 0.0, 0, 0
    below: tuple[int, float, dict[str, Any]] | None = None  # (step, check, weights) of the last check under target
    deadline = time.monotonic() + cfg.max_minutes * 60 if cfg.max_minutes > 0 else float("inf")
    for step in range(1, cfg.max_steps + 1):
        input_ids, attention, labels = padded_batch(rng.sample(train_rows, min(cfg.batch_size, len(train_rows))), pad)
        loss = model(input_ids=input_ids, attention_mask=attention, labels=labels).loss
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        record: dict[str, float] = {"warmup_step": step, "warmup_loss": loss.item()}
        if heldout_rows and (step % cfg.check_every == 0 or check > 0):
            check = record["warmup_check_accuracy"] = teacher_forced_accuracy(model, heldout_rows, pad)
            if cfg.stop_nearest_target and 0 < check < cfg.target_accuracy:
                below = (step, check, _snapshot(model))
        due = step % cfg.eval_every == 0 or step == cfg.max_steps or time.monotonic() > deadline
        promising = record.get("warmup_check_accuracy", 0.0) >= cfg.target_accuracy
        if due or (promising and step - last_eval >= cfg.check_every):  # a failed real eval is not redone at once
            _save(model, tokenizer, out)
            accuracy = record["eval_accuracy"] = evaluate(out)
            last_eval = step
            history.append(record)
        if progress and len(record) > 2:
            progress(record)
        if "eval_accuracy" in record and (accuracy >= cfg.target_accuracy or time.monotonic() > deadline):
            if accuracy >= cfg.target_accuracy and below is not None and below[0] == step - 1:
                step, accuracy = _keep_nearer(model, tokenizer, out, evaluate, cfg.target_accuracy, below,
                                              (step, accuracy), history, progress)
            break
    return WarmupResult(steps=step, accuracy=accuracy, history=history)


def _keep_nearer(model, tokenizer, out: Path, evaluate: Callable[[Path], float], target: float,
                 below: tuple[int, float, dict[str, Any]], above: tuple[int, float],
                 history: list[dict[str, float]], progress: Callable[[dict[str, float]], None] | None,
                 ) -> tuple[int, float]:
    """Evaluate the weights checked just under ``target`` if their check is nearer it than ``above``'s real
    accuracy; leave saved in ``out`` whichever measured nearer. Returns its (step, accuracy)."""
    step, check, weights = below
    if abs(check - target) >= abs(above[1] - target):
        return above
    crossing = _snapshot(model)
    model.load_state_dict(weights)
    _save(model, tokenizer, out)
    accuracy = evaluate(out)
    record = {"warmup_step": above[0], "warmup_kept_step": step, "warmup_check_accuracy": check,
              "eval_accuracy": accuracy}
    if abs(accuracy - target) < abs(above[1] - target):
        history.append(record)
        if progress:
            progress(record)
        return step, accuracy
    model.load_state_dict(crossing)
    _save(model, tokenizer, out)
    return above


def _snapshot(model) -> dict[str, Any]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _save(model, tokenizer, out: Path) -> None:
    from agentrl.engine.weight_loading import write_checksum_manifest

    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    write_checksum_manifest(out, sorted(Path(out).glob("*.safetensors")))  # engines refuse unchecked weights
