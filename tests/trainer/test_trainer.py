"""MegatronTrainer in one process (1-rank gloo group): log-probs vs HF, GRPO learning, checkpoint resume."""

from __future__ import annotations

import warnings

import pytest
import torch
from trainer_samples import synthetic_samples

from agentrl.trainer.actor import MegatronTrainer
from agentrl.trainer.trainer_config import TrainerConfig

warnings.filterwarnings("ignore")


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    from agentrl.models.tiny import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("tiny") / "model", seed=0)


def _hf_logprobs(model_dir, samples):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    out = []
    for s in samples:
        ids = torch.tensor(s["tokens"])[None]
        with torch.no_grad():
            logp = hf(ids).logits[0].log_softmax(-1)
        start = s["response_start"]
        out.append(logp[start - 1 : -1].gather(-1, ids[0, start:, None])[:, 0])
    return out


@pytest.mark.parametrize("attention", ["sdpa", "local"])
def test_logprobs_match_hf_across_micro_batches(tiny_dir, attention):
    samples = synthetic_samples(n_groups=3, per_group=3, seed=1)
    ref = _hf_logprobs(tiny_dir, samples)
    # A budget of 40 padded tokens forces several micro-batches of different widths.
    trainer = MegatronTrainer(tiny_dir, TrainerConfig(max_tokens_per_microbatch=40, attention=attention))
    got = trainer.compute_logprobs(samples)
    assert [len(g) for g in got] == [len(s["tokens"]) - s["response_start"] for s in samples]
    for g, r in zip(got, ref, strict=True):
        assert (torch.tensor(g) - r).abs().max().item() < 1e-5


# ---------------------------------------------------------------------------------------------- GRPO learns

TARGET = 512  # reward: fraction of response tokens with id < TARGET (about 0.5 at random init)


def _sync(hf_model, trainer):
    state = dict(trainer.export_hf_named_tensors())
    if hf_model.config.tie_word_embeddings:
        state["lm_head.weight"] = state["model.embed_tokens.weight"]
    hf_model.load_state_dict(state)


def _rollout(hf_model, prompts, per_prompt, new_tokens=8):
    """Sample ``per_prompt`` responses per (equal-length) prompt at T=1, no top-k/top-p, with log-probs."""
    ids = torch.tensor([p for p in prompts for _ in range(per_prompt)])
    with torch.no_grad():
        out = hf_model.generate(ids, do_sample=True, temperature=1.0, top_k=0, top_p=1.0, max_new_tokens=new_tokens,
                                min_new_tokens=new_tokens, output_logits=True, return_dict_in_generate=True,
                                pad_token_id=0)
    resp = out.sequences[:, ids.shape[1]:]
    lps = torch.stack(out.logits, 1).float().log_softmax(-1).gather(-1, resp[..., None])[..., 0]
    samples = []
    for row in range(ids.shape[0]):
        tokens = resp[row].tolist()
        samples.append(dict(tokens=ids[row].tolist() + tokens, response_start=ids.shape[1],
                            loss_mask=[1] * len(tokens), rollout_logprobs=lps[row].tolist(),
                            reward=sum(t < TARGET for t in tokens) / len(tokens), group_id=row // per_prompt))
    return samples


def test_grpo_raises_synthetic_reward(tiny_dir):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(0)
    prompts = [[1] + torch.randint(3, 1000, (6,), generator=gen).tolist() for _ in range(8)]
    cfg = TrainerConfig(lr=1e-2, loss={"eps_clip_high": 0.28, "importance_weights": "tis"})
    trainer = MegatronTrainer(tiny_dir, cfg)
    hf_model = AutoModelForCausalLM.from_pretrained(tiny_dir, dtype=torch.float32).eval()
    history = []
    for step in range(5):
        samples = _rollout(hf_model, prompts, 8)
        history.append(sum(s["reward"] for s in samples) / len(samples))
        metrics = trainer.train_step(samples)
        if step == 0:
            # Step-0 agreement: sampler and trainer log-probs of the same weights (fp32).
            assert metrics["train_rollout_logprob_abs_diff"] < 1e-4
            assert abs(metrics["ratio_mean"] - 1.0) < 1e-4
        _sync(hf_model, trainer)
    final = sum(s["reward"] for s in _rollout(hf_model, prompts, 16)) / (16 * len(prompts))
    assert final > history[0] + 0.15, (history, final)


# ---------------------------------------------------------------------------------------------- checkpoints


def test_resume_gives_the_same_next_step(tiny_dir, tmp_path):
    batch1 = synthetic_samples(n_groups=2, per_group=4, seed=5)
    batch2 = synthetic_samples(n_groups=2, per_group=4, seed=6)
    cfg = TrainerConfig(lr=1e-3, lr_warmup_steps=2, lr_decay_steps=10, lr_decay_style="cosine", min_lr=1e-4)
    a = MegatronTrainer(tiny_dir, cfg)
    a.train_step(batch1)
    a.save_checkpoint(tmp_path / "ckpt", extra_state={"buffer_cursor": 17, "weight_version": 1})
    rng_after_save = torch.rand(4)
    want = a.train_step(batch2)
    want_weights = dict(a.export_hf_named_tensors())

    b = MegatronTrainer(tiny_dir, cfg)  # fresh weights and optimizer
    extra = b.load_checkpoint(tmp_path / "ckpt")
    assert extra == {"buffer_cursor": 17, "weight_version": 1}
    assert b.step == 1
    assert torch.equal(torch.rand(4), rng_after_save)
    got = b.train_step(batch2)
    assert got == want
    for name, w in b.export_hf_named_tensors():
        assert torch.equal(w, want_weights[name]), name
    # Saving over a checkpoint (an earlier attempt's) replaces it; a directory that is none is refused.
    b.save_checkpoint(tmp_path / "ckpt", extra_state={"weight_version": 2})
    assert a.load_checkpoint(tmp_path / "ckpt") == {"weight_version": 2} and a.step == 2
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "notes.txt").write_text("not a checkpoint")
    with pytest.raises(FileExistsError):
        b.save_checkpoint(tmp_path / "other")
    with pytest.raises(FileNotFoundError):
        b.load_checkpoint(tmp_path)


# ---------------------------------------------------------------------------------------------- behaviour details


def test_zero_advantage_batch_is_skipped(tiny_dir):
    samples = synthetic_samples(n_groups=2, per_group=3, seed=2)
    for s in samples:
        s["reward"] = 1.0
    trainer = MegatronTrainer(tiny_dir, TrainerConfig())
    before = dict(trainer.export_hf_named_tensors())
    m = trainer.train_step(samples)
    assert m["skipped"] == 1.0 and m["n_samples"] == 6.0
    assert all(torch.equal(w, before[n]) for n, w in trainer.export_hf_named_tensors())


def test_kl_to_reference_and_entropy_bonus(tiny_dir):
    samples = synthetic_samples(n_groups=2, per_group=3, seed=4)
    cfg = TrainerConfig(lr=1e-3, loss={"kl_coef": 0.1, "kl_type": "k3", "entropy_coef": 0.01})
    trainer = MegatronTrainer(tiny_dir, cfg)
    first = trainer.train_step(samples)
    assert first["kl"] == pytest.approx(0.0, abs=1e-7)  # policy == reference before the first update
    second = trainer.train_step(samples)
    assert second["kl"] > 0.0 and second["entropy"] > 0.0
    in_reward = MegatronTrainer(tiny_dir, TrainerConfig(lr=1e-3, kl_in_reward=True, loss={"kl_coef": 0.1}))
    assert in_reward.train_step(samples)["kl_reward_penalty"] == pytest.approx(0.0, abs=1e-6)
    later = in_reward.train_step(samples)
    assert later["kl_reward_penalty"] > 0.0  # low_var_kl >= 0, and the policy has moved
    assert "kl" not in later  # KL went into the rewards, not into the loss


def test_dict_rewards_and_bad_samples(tiny_dir):
    samples = synthetic_samples(n_groups=1, per_group=2, seed=7)
    samples[0]["reward"] = {"score": 1.0}
    samples[1]["reward"] = {"score": 0.0}
    trainer = MegatronTrainer(tiny_dir, TrainerConfig())
    assert trainer.train_step(samples)["reward_mean"] == 0.5
    bad = dict(samples[0], loss_mask=[1])
    with pytest.raises(ValueError, match="loss_mask has 1 entries"):
        trainer.compute_logprobs([bad])
    with pytest.raises(KeyError, match="no 'score'"):
        trainer.train_step([dict(samples[0], reward={"acc": 1.0})])


def test_config_rejects_bad_values():
    with pytest.raises(ValueError):
        TrainerConfig(steps_per_batch=0)
    with pytest.raises(ValueError, match="temperature"):
        MegatronTrainer(None, temperature=0.0)  # the sampling temperature comes with the data, not the config
    with pytest.raises(ValueError, match="temperature"):
        TrainerConfig(temperature=0.7)  # ... so the trainer's config has no such key
    with pytest.raises(ValueError, match="only optimizer='adam'"):
        TrainerConfig(use_distributed_optimizer=True, optimizer="sgd")
    from agentrl.plugins import load_function as load_callable

    with pytest.raises(ValueError):
        load_callable("nodots")
    with pytest.raises(ValueError):
        load_callable("agentrl.trainer.losses.LossConfigX")


def test_bf16_trainer_with_two_mini_batches(tiny_dir):
    samples = synthetic_samples(n_groups=2, per_group=3, seed=0)
    fp32 = MegatronTrainer(tiny_dir, TrainerConfig()).compute_logprobs(samples)
    trainer = MegatronTrainer(tiny_dir, TrainerConfig(dtype="bfloat16", lr=1e-3, steps_per_batch=2))
    bf16 = trainer.compute_logprobs(samples)
    assert max(abs(x - y) for a, b in zip(bf16, fp32, strict=True) for x, y in zip(a, b, strict=True)) < 2e-2
    metrics = trainer.train_step(samples)
    # The second mini-batch is trained after the first update: off-policy, so the mean ratio moves off 1.
    assert abs(metrics["ratio_mean"] - 1.0) > 1e-4
    assert {w.dtype for _, w in trainer.export_hf_named_tensors()} == {torch.bfloat16}


def test_distributed_optimizer_matches_plain_adam_and_mini_batches_are_capped(tiny_dir):
    samples = synthetic_samples(n_groups=1, per_group=2, seed=8)
    plain = MegatronTrainer(tiny_dir, TrainerConfig(lr=1e-3))
    want = plain.train_step(samples)
    want_w = dict(plain.export_hf_named_tensors())
    sharded = MegatronTrainer(tiny_dir, TrainerConfig(lr=1e-3, use_distributed_optimizer=True))
    got = sharded.train_step(samples)
    assert got["loss"] == want["loss"]  # the same forward on the same weights in this process: bitwise
    # The sharded norm sums per-shard partials: reduction order differs (measured 9e-8 relative).
    assert got["grad_norm"] == pytest.approx(want["grad_norm"], rel=1e-6)
    # Clipping scales by 1/grad_norm, so the update inherits that rounding; 1e-6 is 0.1% of an lr-sized step.
    for n, w in sharded.export_hf_named_tensors():
        torch.testing.assert_close(w, want_w[n], rtol=0, atol=1e-6, msg=n)
    # 5 requested mini-batches but only 2 samples: two optimizer steps, none on an empty mini-batch.
    capped = MegatronTrainer(tiny_dir, TrainerConfig(lr=1e-3, steps_per_batch=5))
    capped.train_step(samples)
    assert capped.scheduler.num_steps == 2


def test_credit_fn_trains_exactly_like_the_narrowed_masks(tiny_dir):
    """A credit rule's narrowed masks give the same update as samples that came with those masks."""
    samples = synthetic_samples(n_groups=3, per_group=4, seed=5)
    for s in samples:  # two turns per response; the first had an ill-formed call
        start, n = s["response_start"], len(s["tokens"])
        half = start + (n - start) // 2
        s["provenance"] = [[0, start, "prompt", 0, None], [start, half, "model", 0, "0"], [half, n, "model", 1, "0"]]
        s["metadata"] = {"turns": [0, 1], "turn_metadata": [{"ill_formed": True}, {"ill_formed": False}]}
    rewards = [s["reward"] for s in samples]
    groups = [s["group_id"] for s in samples]
    from agentrl.trainer.losses import grpo_advantages

    advantages = grpo_advantages(torch.tensor(rewards), groups).tolist()
    by_hand = []
    for s, a in zip(samples, advantages, strict=True):
        mask = list(s["loss_mask"])
        if a > 0:
            first_turn = (len(s["tokens"]) - s["response_start"]) // 2
            mask[:first_turn] = [0] * first_turn
        by_hand.append({**s, "loss_mask": mask})
    withheld = sum(sum(s["loss_mask"]) for s in samples) - sum(sum(s["loss_mask"]) for s in by_hand)
    assert withheld > 0

    rule = "agentrl.trainer.credit.withhold_positive_credit_from_ill_formed_turns"
    credited = MegatronTrainer(tiny_dir, TrainerConfig(lr=1e-2, credit_fn=rule))
    metrics = credited.train_step(samples)
    assert metrics["credit_withheld_tokens"] == withheld
    reference = MegatronTrainer(tiny_dir, TrainerConfig(lr=1e-2))
    reference.train_step(by_hand)
    plain = MegatronTrainer(tiny_dir, TrainerConfig(lr=1e-2))
    plain.train_step(samples)
    ref = dict(reference.export_hf_named_tensors())
    assert all(torch.equal(w, ref[n]) for n, w in credited.export_hf_named_tensors())
    assert not all(torch.equal(w, ref[n]) for n, w in plain.export_hf_named_tensors())


def test_the_first_warm_up_step_trains_at_a_nonzero_lr(tiny_dir):
    """Optimizer step n runs at lr(n): with a 2-step warm-up, 5e-4 then 1e-3, and the first step moves weights."""
    trainer = MegatronTrainer(tiny_dir, TrainerConfig(lr=1e-3, lr_warmup_steps=2, lr_decay_steps=4,
                                                      lr_decay_style="linear", min_lr=1e-4))
    before = dict(trainer.export_hf_named_tensors())
    lrs = [trainer.train_step(synthetic_samples(n_groups=2, per_group=4, seed=s))["lr"] for s in range(5)]
    assert lrs == pytest.approx([5e-4, 1e-3, 5.5e-4, 1e-4, 1e-4])
    trainer2 = MegatronTrainer(tiny_dir, TrainerConfig(lr=1e-3, lr_warmup_steps=2))
    trainer2.train_step(synthetic_samples(n_groups=2, per_group=4, seed=0))
    assert not all(torch.equal(w, before[n]) for n, w in trainer2.export_hf_named_tensors())


# ---------------------------------------------------------------------------------------------- non-finite values


def _snapshot(trainer):
    return {n: w.clone() for n, w in trainer.export_hf_named_tensors()}


def _optimizer_tensors(trainer) -> list[torch.Tensor]:
    def walk(obj):
        if isinstance(obj, torch.Tensor):
            yield obj.detach().clone()
        elif isinstance(obj, dict):
            for v in obj.values():
                yield from walk(v)
        elif isinstance(obj, list | tuple):
            for v in obj:
                yield from walk(v)
    return list(walk(trainer.optimizer.state_dict()))


def _same_optimizer(trainer, before) -> bool:
    after = _optimizer_tensors(trainer)
    return len(after) == len(before) > 0 and all(torch.equal(a, b) for a, b in zip(after, before, strict=True))


def _same_weights(trainer, before) -> bool:
    return all(torch.equal(w, before[n]) for n, w in trainer.export_hf_named_tensors())


@pytest.mark.parametrize(("field", "value", "match"), [
    ("reward", float("nan"), r"sample 5 \(session None, group 1\): reward\[0\] is nan"),
    ("reward", float("-inf"), r"sample 5 .*reward\[0\] is -inf"),
    ("reward", {"score": float("inf")}, r"sample 5 .*reward\[0\] is inf"),
    ("rollout_logprobs", float("nan"), r"sample 5 .*rollout_logprobs\[1\] is nan"),
    ("rollout_logprobs", float("-inf"), r"sample 5 .*rollout_logprobs\[1\] is -inf"),
])
def test_a_batch_with_a_non_finite_value_is_refused_and_trains_nothing(tiny_dir, field, value, match):
    trainer = MegatronTrainer(tiny_dir, TrainerConfig(lr=1e-2))
    trainer.train_step(synthetic_samples(n_groups=2, per_group=4, seed=4))  # Adam has state to poison
    before, adam = _snapshot(trainer), _optimizer_tensors(trainer)
    batch = synthetic_samples(n_groups=2, per_group=4, seed=5)
    if field == "reward":
        batch[5]["reward"] = value
    else:
        batch[5]["rollout_logprobs"][1] = value
    with pytest.raises(ValueError, match=match + "; the batch is refused, nothing was trained"):
        trainer.train_step(batch)
    assert _same_weights(trainer, before) and trainer.step == 1 and trainer.scheduler.num_steps == 1
    assert _same_optimizer(trainer, adam)
    # The same trainer goes on with a good batch, and its weights stay finite.
    assert trainer.train_step(synthetic_samples(n_groups=2, per_group=4, seed=6))["step"] == 2.0
    assert all(torch.isfinite(w).all() for _, w in trainer.export_hf_named_tensors())


@pytest.mark.parametrize("kl_in_reward", [False, True])
def test_a_non_finite_advantage_is_refused(tiny_dir, kl_in_reward):
    import math

    loss = {"kl_coef": 0.01} if kl_in_reward else {}
    trainer = MegatronTrainer(tiny_dir, TrainerConfig(kl_in_reward=kl_in_reward, loss=loss))
    trainer.advantage_fn = lambda rewards, groups: torch.where(torch.arange(len(rewards)) == 2, math.nan, 1.0)
    before = _snapshot(trainer)
    with pytest.raises(ValueError, match=r"sample 2 .*: advantage.*\[0\] is nan"):
        trainer.train_step(synthetic_samples(n_groups=2, per_group=4, seed=5))
    assert _same_weights(trainer, before) and trainer.step == 0


@pytest.mark.parametrize("poison", ["loss", "grad"])
def test_a_non_finite_loss_or_gradient_skips_the_optimizer_step(tiny_dir, monkeypatch, poison):
    import math

    import agentrl.trainer.actor as actor

    real = actor.policy_loss

    def poisoned(lp, *args, **kwargs):
        loss, metrics = real(lp, *args, **kwargs)
        if poison == "loss":
            return loss * math.nan, metrics
        # sqrt'(0) is inf: the value stays finite, every gradient becomes NaN.
        return loss + 0.0 * torch.sqrt(lp - lp.detach()).sum(), metrics

    trainer = MegatronTrainer(tiny_dir, TrainerConfig(lr=1e-2, steps_per_batch=2))
    trainer.train_step(synthetic_samples(n_groups=2, per_group=4, seed=4))
    before, adam = _snapshot(trainer), _optimizer_tensors(trainer)
    monkeypatch.setattr(actor, "policy_loss", poisoned)
    metrics = trainer.train_step(synthetic_samples(n_groups=2, per_group=4, seed=5))
    assert metrics["nonfinite_steps"] == 2.0 and metrics["skipped"] == 1.0 and math.isnan(metrics["grad_norm"])
    assert math.isfinite(metrics["loss"]) == (poison == "grad")
    assert _same_weights(trainer, before) and _same_optimizer(trainer, adam)
    assert trainer.step == 2  # counted like any other skipped step (the LR schedule moves on)
    monkeypatch.setattr(actor, "policy_loss", real)
    good = trainer.train_step(synthetic_samples(n_groups=2, per_group=4, seed=6))
    assert "nonfinite_steps" not in good and math.isfinite(good["grad_norm"])
    assert not _same_weights(trainer, before)
    assert all(torch.isfinite(w).all() for _, w in trainer.export_hf_named_tensors())
