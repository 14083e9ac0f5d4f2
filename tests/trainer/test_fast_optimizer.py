"""The foreach drop-ins for Megatron's local multi-tensor fallbacks compute what the fallbacks compute, and the
fused AdamW switch changes the kernel, not the update (GPU speed: benchmarks/trainer_bench.py)."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("megatron.core")

from agentrl.trainer import fast_optimizer  # noqa: E402


def tensors(seed: int, dtype=torch.float32) -> list:
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(shape, generator=g) * 3).to(dtype) for shape in [(7, 5), (300,), (1,), (64, 64)]]


@pytest.mark.parametrize("scale", [1.0, 0.37])
@pytest.mark.parametrize("dst_dtype", [torch.float32, torch.bfloat16])
def test_foreach_scale_is_bitwise_the_local_fallback(scale, dst_dtype):
    from megatron.core.utils import local_multi_tensor_scale

    src = tensors(0)
    want = [torch.empty_like(t, dtype=dst_dtype) for t in src]
    got = [torch.full_like(t, float("nan"), dtype=dst_dtype) for t in src]
    local_multi_tensor_scale(0, None, [src, want], scale)
    fast_optimizer.foreach_scale(0, None, [src, got], scale)
    assert all(torch.equal(a.view(-1).view(torch.uint8), b.view(-1).view(torch.uint8)) for a, b in zip(want, got, strict=True))
    inplace, reference = tensors(1), tensors(1)  # src is dst: clip_grad_by_total_norm_fp32's form
    fast_optimizer.foreach_scale(0, None, [inplace, inplace], scale)
    local_multi_tensor_scale(0, None, [reference, reference], scale)
    assert all(torch.equal(a, b) for a, b in zip(inplace, reference, strict=True))


def test_foreach_l2_norm_equals_the_local_fallback_to_fp32_rounding(monkeypatch):
    from megatron.core.utils import local_multi_tensor_l2_norm

    ts = tensors(2)
    monkeypatch.setattr(torch.Tensor, "cuda", lambda self, *a, **k: self)  # the fallback puts its result on "cuda"
    import megatron.core.utils as utils

    real_tensor = torch.tensor
    monkeypatch.setattr(utils.torch, "tensor", lambda data, *a, **k: real_tensor(data, *a, **{**k, "device": "cpu"}))
    want, _ = local_multi_tensor_l2_norm(0, None, [ts], False)
    monkeypatch.undo()
    got, per = fast_optimizer.foreach_l2_norm(0, None, [ts], False)
    exact = torch.linalg.vector_norm(torch.cat([t.double().reshape(-1) for t in ts]))
    assert got.shape == (1,) and got.dtype == torch.float32 and per is None
    # fp32 sums in two orders: both within a few fp32 ulps of the float64 norm
    assert abs(float(got) - float(exact)) <= 1e-6 * float(exact)
    assert abs(float(got) - float(want)) <= 1e-6 * float(exact)


def test_install_replaces_only_the_local_fallbacks(monkeypatch):
    from megatron.core import utils
    from megatron.core.optimizer import clip_grads
    from megatron.core.optimizer import optimizer as mp_optimizer

    for module, name in [(mp_optimizer, "multi_tensor_scale_impl"), (clip_grads, "multi_tensor_scale_impl"),
                         (clip_grads, "l2_norm_impl")]:
        monkeypatch.setattr(module, name, getattr(module, name))  # restored after the test
    monkeypatch.setattr(fast_optimizer, "_installed", False)
    monkeypatch.setattr(clip_grads, "l2_norm_impl", utils.local_multi_tensor_l2_norm)
    monkeypatch.setattr(mp_optimizer, "multi_tensor_scale_impl", utils.local_multi_tensor_scale)
    sentinel = object()  # stands for a TE/Apex kernel: left alone
    monkeypatch.setattr(clip_grads, "multi_tensor_scale_impl", sentinel)
    assert fast_optimizer.install()
    assert clip_grads.l2_norm_impl is fast_optimizer.foreach_l2_norm
    assert mp_optimizer.multi_tensor_scale_impl is fast_optimizer.foreach_scale
    assert clip_grads.multi_tensor_scale_impl is sentinel


def test_fuse_adam_leaves_cpu_parameters_alone():
    params = [torch.nn.Parameter(torch.randn(3))]
    opt = torch.optim.AdamW(params, lr=1e-3)
    assert fast_optimizer.fuse_adam(opt) == 0 and not opt.param_groups[0]["fused"]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no GPU")
def test_fused_adam_gives_the_foreach_update_to_fp32_rounding():
    g = torch.Generator(device="cuda").manual_seed(0)
    init = [torch.randn(shape, device="cuda", generator=g) for shape in [(300, 7), (5,), (1024,)]]
    grads = [[torch.randn_like(p) for p in init] for _ in range(3)]
    runs = []
    for fused in (False, True):
        params = [torch.nn.Parameter(p.clone()) for p in init]
        opt = torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1)
        if fused:
            assert fast_optimizer.fuse_adam(opt) == 1
        else:
            opt.param_groups[0]["foreach"] = True
        for step in grads:
            for p, gr in zip(params, step, strict=True):
                p.grad = gr.clone()
            opt.step()
        runs.append(params)
    for a, b in zip(*runs, strict=True):
        # three Adam steps of lr 1e-2 on O(1) weights: the two kernels' fp32 orders differ by a few ulps
        assert torch.allclose(a, b, rtol=0, atol=1e-6)
