"""Sequence packing: layout round trips, per-sequence attention, and the packed trainer against the padded one."""

from __future__ import annotations

import warnings

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from trainer_samples import synthetic_samples

from agentrl.trainer.batch import collate, make_micro_batches, pack_layout, plan_packed_micro_batches
from agentrl.trainer.trainer_config import TrainerConfig

warnings.filterwarnings("ignore")


@settings(max_examples=100, deadline=None)
@given(st.lists(st.integers(1, 50), min_size=1, max_size=40), st.integers(1, 120))
def test_packed_plan_covers_every_sequence_once_within_budget(lengths, budget):
    plans = plan_packed_micro_batches(lengths, budget)
    assert sorted(i for p in plans for i in p) == list(range(len(lengths)))
    for p in plans:
        assert len(p) == 1 or sum(lengths[i] for i in p) <= budget


def test_packing_needs_fewer_micro_batches_than_padding_for_ragged_lengths():
    lengths = [50, 5, 5, 5, 5, 5, 5, 5, 5, 5]  # padded: 50 x rows; packed: 95 real tokens
    assert len(plan_packed_micro_batches(lengths, 100)) == 1
    assert len(make_micro_batches([dict(tokens=[1] * n, response_start=1, loss_mask=[1] * (n - 1))
                                   for n in lengths], 100)) > 1


@settings(max_examples=50, deadline=None)
@given(st.lists(st.integers(1, 12), min_size=1, max_size=8))
def test_layout_is_the_real_tokens_end_to_end_with_positions_restarting(lengths):
    width = max(lengths)
    tokens = torch.full((len(lengths), width), -1, dtype=torch.long)
    for r, n in enumerate(lengths):
        tokens[r, :n] = torch.arange(n) + 100 * r
    layout = pack_layout(lengths, tokens)
    expected = torch.cat([torch.arange(n) + 100 * r for r, n in enumerate(lengths)])
    assert torch.equal(layout.tokens[0], expected)
    assert torch.equal(layout.position_ids[0], torch.cat([torch.arange(n) for n in lengths]))
    assert layout.cu_seqlens.tolist() == [sum(lengths[:i]) for i in range(len(lengths) + 1)]
    assert layout.max_seqlen == width and layout.tokens.shape[1] == sum(lengths)


def test_rope_reads_the_sequence_boundaries_from_the_host_copy():
    """Megatron's thd RoPE calls .tolist() on cu_seqlens in every layer: on a device copy that is a device
    sync per call. The SDPA backend hands it the host copy (TE's attention needs the device one)."""
    from agentrl.trainer.attention import packed_seq_params

    layout = pack_layout([3, 5], torch.arange(10).reshape(2, 5)).to("meta")  # "meta" stands for the GPU
    host = packed_seq_params(layout, host_cu_seqlens=True)
    assert host.cu_seqlens_q.device.type == host.cu_seqlens_kv.device.type == "cpu"
    assert host.cu_seqlens_q.tolist() == [0, 3, 8]
    assert packed_seq_params(layout).cu_seqlens_q.device.type == "meta" and host.flat_index.device.type == "meta"


def test_unpack_puts_shifted_values_where_the_padded_layout_has_them():
    samples = synthetic_samples(n_groups=2, per_group=3, seed=3)
    mb = collate(samples, list(range(len(samples))), packed=True)
    packed = mb.packed
    # Value at packed position p: its token id; unpacked, row r column t must hold tokens[r, t] for
    # 1 <= t < length, and 0 at column 0 (a sequence's first token is predicted by nothing) and padding.
    values = packed.tokens.to(torch.float32).requires_grad_()
    out = mb.unpack(values)
    for r, n in enumerate(mb.lengths):
        assert out[r, 0] == 0 and out[r, n:].abs().sum() == 0
        assert torch.equal(out[r, 1:n], mb.tokens[r, 1:n].float())
    out.sum().backward()  # differentiable; each interior position reaches exactly one slot
    assert values.grad.sum() == sum(n - 1 for n in mb.lengths)


def test_packed_attention_stays_within_each_sequence(tiny_dir):
    """Changing one packed sequence changes no log-prob of its neighbours in the same micro-batch."""
    from agentrl.trainer.actor import MegatronTrainer

    samples = synthetic_samples(n_groups=2, per_group=3, seed=4)
    trainer = MegatronTrainer(tiny_dir, TrainerConfig(packing="packed", max_tokens_per_microbatch=10_000))
    assert len(trainer._micro_batches(samples)) == 1
    before = trainer.compute_logprobs(samples)
    changed = [dict(s) for s in samples]
    changed[2]["tokens"] = [7] * len(changed[2]["tokens"])
    after = trainer.compute_logprobs(changed)
    for i, (b, a) in enumerate(zip(before, after, strict=True)):
        if i != 2:
            # The block layout moves no neighbour; SDPA's per-row arithmetic is the same: equal to rounding.
            assert torch.allclose(torch.tensor(a), torch.tensor(b), atol=1e-6), i
    assert not torch.allclose(torch.tensor(after[2]), torch.tensor(before[2]))


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    from agentrl.models.tiny import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("tiny") / "model", seed=0)


def test_packed_trainer_matches_padded_in_log_probs_loss_and_update(tiny_dir):
    """Same log-probs, metrics and weights after a KL + entropy GRPO step; only float reduction order differs
    (matmuls over [T, h] rows instead of [b * L, h]), hence fp32 tolerances. SGD, whose update is linear in
    the gradient: Adam's first step is sign-like and would flip on rounding-size gradients."""
    from agentrl.trainer.actor import MegatronTrainer
    from agentrl.trainer.losses import LossConfig

    samples = synthetic_samples(n_groups=3, per_group=4, seed=5)
    loss = LossConfig(kl_coef=0.01, entropy_coef=0.01)
    trainers = {p: MegatronTrainer(tiny_dir, TrainerConfig(packing=p, max_tokens_per_microbatch=64, lr=0.1, optimizer="sgd",
                                                     loss=loss))
                for p in ("padded", "packed")}
    initial = dict(trainers["padded"].export_hf_named_tensors())
    lp = {p: t.compute_logprobs(samples) for p, t in trainers.items()}
    for a, b in zip(lp["padded"], lp["packed"], strict=True):
        assert (torch.tensor(a) - torch.tensor(b)).abs().max().item() < 1e-5
    metrics = {p: t.train_step(samples) for p, t in trainers.items()}
    for k in ("loss", "kl", "entropy", "grad_norm", "n_tokens", "clip_frac"):
        assert metrics["packed"][k] == pytest.approx(metrics["padded"][k], rel=1e-4, abs=1e-6), k
    padded = dict(trainers["padded"].export_hf_named_tensors())
    assert max((padded[n] - initial[n]).abs().max().item() for n in padded) > 1e-4  # the step moved weights
    for name, w in trainers["packed"].export_hf_named_tensors():
        assert torch.allclose(w, padded[name], atol=1e-6, rtol=1e-5), name


def test_packing_with_local_attention_is_refused_early():
    with pytest.raises(ValueError, match="packing='packed' needs attention"):
        TrainerConfig(packing="packed", attention="local")
    from agentrl.trainer.model import resolve_packing

    assert resolve_packing("auto", "local") is False and resolve_packing("auto", "sdpa") is True
    assert resolve_packing("padded", "sdpa") is False


@pytest.mark.parametrize("packing", ["packed", "padded"])
def test_behaviour_log_probs_from_the_training_forward_train_bitwise_like_a_fresh_forward(tiny_dir, monkeypatch,
                                                                                           packing):
    """One mini-batch: the training forward's detached log-probs replace the separate behaviour forward.
    Same weights, same micro-batches, same kernels: the step is bitwise the one with the extra forward."""
    from agentrl.trainer.actor import MegatronTrainer
    from agentrl.trainer.losses import LossConfig

    samples = synthetic_samples(n_groups=3, per_group=4, seed=6)
    cfg = TrainerConfig(packing=packing, max_tokens_per_microbatch=64, lr=1e-3, loss=LossConfig(kl_coef=0.01))
    reused, fresh = MegatronTrainer(tiny_dir, cfg), MegatronTrainer(tiny_dir, cfg)
    assert reused._old_from_train_forward(1) and not reused._old_from_train_forward(2)
    monkeypatch.setattr(fresh, "_old_from_train_forward", lambda n_chunks: False)
    calls = {"reused": 0, "fresh": 0}
    for name, t in (("reused", reused), ("fresh", fresh)):
        forward = t._forward
        monkeypatch.setattr(t, "_forward", lambda model, mb, f=forward, n=name, **kw: (calls.__setitem__(n, calls[n] + 1),
                                                                                    f(model, mb, **kw))[1])
    m_reused, m_fresh = reused.train_step(samples), fresh.train_step(samples)
    assert calls["fresh"] - calls["reused"] == len(reused._micro_batches(samples))  # one forward fewer per micro-batch
    assert m_reused == m_fresh
    fresh_w = dict(fresh.export_hf_named_tensors())
    for name, w in reused.export_hf_named_tensors():
        assert torch.equal(w, fresh_w[name]), name


def test_logits_at_trained_positions_only_train_like_logits_everywhere(tiny_dir, monkeypatch):
    """On the CPU the packed train step runs the output layer only where a trained token is predicted. The
    loss, metrics and update read only those positions, so they match a step with logits everywhere up to
    float summation order (fp32 tolerances); SGD, as above, so the update is linear in the gradient."""
    from agentrl.trainer import chunked_logprobs
    from agentrl.trainer.actor import MegatronTrainer
    from agentrl.trainer.losses import LossConfig

    samples = synthetic_samples(n_groups=3, per_group=4, seed=7)
    cfg = TrainerConfig(packing="packed", max_tokens_per_microbatch=64, lr=0.1, optimizer="sgd", old_logprobs="rollout",
                        loss=LossConfig(kl_coef=0.01, entropy_coef=0.01))
    everywhere, trained = MegatronTrainer(tiny_dir, cfg), MegatronTrainer(tiny_dir, cfg)
    monkeypatch.setattr(everywhere, "_trained_positions", lambda mb: None)
    rows = []
    head = chunked_logprobs.linear_logprobs_and_entropy  # the output layer and log-softmax, in chunks

    def counted(hidden, *args, **kwargs):
        rows.append(hidden.shape[0])
        return head(hidden, *args, **kwargs)

    m_everywhere = everywhere.train_step(samples)
    monkeypatch.setattr(chunked_logprobs, "linear_logprobs_and_entropy", counted)
    m_trained = trained.train_step(samples)
    mbs = trained._micro_batches(samples)
    trained_tokens = sum(int(mb.loss_mask.sum()) for mb in mbs)
    # the policy forward and the reference forward: each runs the head on the trained positions alone
    assert sum(rows) == 2 * trained_tokens < 2 * sum(mb.packed.tokens.shape[1] for mb in mbs)
    for k in ("loss", "kl", "entropy", "grad_norm", "n_tokens", "clip_frac"):
        assert m_trained[k] == pytest.approx(m_everywhere[k], rel=1e-5, abs=1e-7), k
    reference = dict(everywhere.export_hf_named_tensors())
    for name, w in trained.export_hf_named_tensors():
        assert torch.allclose(w, reference[name], atol=1e-6, rtol=1e-5), name
