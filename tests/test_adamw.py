"""kernels.AdamW: the update kernel against a float64 AdamW, and against torch.optim.AdamW."""

from __future__ import annotations

import pytest
import torch

from kernels import AdamW
from tests.utils import DEVICE, assert_rel, assert_triton_runs, randn, rel_err

SHAPES = [(37, 53), (1000,), (3, 5, 777)]
LR, BETAS, EPS, WD = 0.05, (0.9, 0.95), 1e-8, 0.1


def _float64_adamw(p, grads, lr, betas, eps, wd):
    """(p, exp_avg, exp_avg_sq) after len(grads) AdamW steps, in float64 from the same start."""
    p, m, v = p.double(), torch.zeros_like(p, dtype=torch.float64), torch.zeros_like(p, dtype=torch.float64)
    b1, b2 = betas
    for t, g in enumerate(grads, start=1):
        g = g.double()
        p = p * (1 - lr * wd)
        m = b1 * m + (1 - b1) * g
        v = b2 * v + (1 - b2) * g * g
        p = p - lr / (1 - b1**t) * m / ((v / (1 - b2**t)).sqrt() + eps)
    return p, m, v


def _run(opt_cls, p0, grads, **kw):
    assert_triton_runs(p0)  # kernels.AdamW falls back to torch's AdamW where the kernel cannot run
    p = torch.nn.Parameter(p0.clone())
    opt = opt_cls([p], lr=LR, betas=BETAS, eps=EPS, weight_decay=WD, **kw)
    for g in grads:
        p.grad = g.clone()
        opt.step()
    state = opt.state[p]
    return p.detach(), state["exp_avg"], state["exp_avg_sq"], state["step"]


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_adamw_matches_float64_and_is_no_worse_than_torch(shape, dtype):
    p0 = randn(*shape, dtype=dtype)
    assert_triton_runs(p0)
    grads = [randn(*shape, dtype=dtype, scale=s) for s in (1.0, 0.1, 3.0)]
    p, m, v, step = _run(AdamW, p0, grads)
    ref_p, ref_m, ref_v = _float64_adamw(p0, grads, LR, BETAS, EPS, WD)
    assert step.item() == 3 and step.device == p.device
    errs = {"exp_avg": assert_rel(m, ref_m, dtype, "exp_avg"), "exp_avg_sq": assert_rel(v, ref_v, dtype, "exp_avg_sq"),
            "update": assert_rel(p.double() - p0.double(), ref_p - p0.double(), dtype, "p - p0",
                                 bound=1e-5 if dtype == torch.float32 else 5e-2)}
    torch_p, torch_m, torch_v, _ = _run(torch.optim.AdamW, p0, grads, foreach=False)
    for what, theirs, ref in [("exp_avg", torch_m, ref_m), ("exp_avg_sq", torch_v, ref_v),
                              ("update", torch_p.double() - p0.double(), ref_p - p0.double())]:
        assert errs[what] <= 1.05 * rel_err(theirs, ref) + 1e-6, f"{what}: worse than torch.optim.AdamW"


def test_adamw_with_beta1_zero_is_rmsprop_like_and_exact():
    """beta1 = 0 (no first moment, no bias correction of it) is allowed by torch and must not fail here."""
    p0 = randn(17, 9)
    assert_triton_runs(p0)
    grads = [randn(17, 9) for _ in range(3)]
    p = torch.nn.Parameter(p0.clone())
    opt = AdamW([p], lr=LR, betas=(0.0, 0.95), eps=EPS, weight_decay=WD)
    for g in grads:
        p.grad = g.clone()
        opt.step()
    ref_p, _, _ = _float64_adamw(p0, grads, LR, (0.0, 0.95), EPS, WD)
    assert_rel(p.detach().double() - p0.double(), ref_p - p0.double(), torch.float32, "p - p0")


def test_adamw_takes_the_lr_from_a_device_tensor_that_a_scheduler_changes():
    p0 = randn(64, 33)
    assert_triton_runs(p0)
    grads = [randn(64, 33) for _ in range(3)]
    results = []
    for lr in (torch.tensor(LR, device=DEVICE), LR):
        p = torch.nn.Parameter(p0.clone())
        opt = AdamW([p], lr=lr, betas=BETAS, eps=EPS, weight_decay=WD)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda i: 1.0 / (1 + i))
        for g in grads:
            p.grad = g.clone()
            opt.step()
            sched.step()
        results.append(p.detach())
    torch.testing.assert_close(results[0], results[1], rtol=1e-6, atol=1e-7)
    assert rel_err(results[0], p0) > 1e-3  # the steps did move the parameter


def test_adamw_state_dict_is_torch_adamw_s():
    """A checkpoint of one continues in the other (same keys, step moved to the parameter's device)."""
    p0 = randn(40, 7)
    assert_triton_runs(p0)
    grads = [randn(40, 7) for _ in range(4)]

    def run(first, second):
        p = torch.nn.Parameter(p0.clone())
        opt = first([p], lr=LR, betas=BETAS, eps=EPS, weight_decay=WD)
        for g in grads[:2]:
            p.grad = g.clone()
            opt.step()
        state = opt.state_dict()
        opt = second([p], lr=LR, betas=BETAS, eps=EPS, weight_decay=WD)
        opt.load_state_dict(state)
        for g in grads[2:]:
            p.grad = g.clone()
            opt.step()
        return p.detach()

    ref = run(torch.optim.AdamW, torch.optim.AdamW)
    for first, second in [(AdamW, torch.optim.AdamW), (torch.optim.AdamW, AdamW)]:
        torch.testing.assert_close(run(first, second), ref, rtol=1e-5, atol=1e-6)


def test_adamw_transposed_parameter_and_gradient_match_torch():
    """A parameter dense in another order (a transpose) with a gradient of either layout: the same
    result as torch.optim.AdamW, never an error after other parameters were already stepped."""
    a0, b0 = randn(40), randn(7, 9).t()  # b: (9, 7) with strides (1, 9)
    assert_triton_runs(a0)
    grads = [(randn(40, seed=s), randn(7, 9, seed=s + 1).t()) for s in (1, 5, 9)]
    results = []
    for cls in (AdamW, torch.optim.AdamW):
        a, b = torch.nn.Parameter(a0.clone()), torch.nn.Parameter(b0.clone())  # clone keeps b's strides
        assert not b.is_contiguous()
        opt = cls([a, b], lr=LR, betas=BETAS, eps=EPS, weight_decay=WD)
        for i, (ga, gb) in enumerate(grads):  # b's gradient in b's layout, then contiguous, then b's again
            a.grad, b.grad = ga.clone(), (gb.contiguous() if i == 1 else gb.clone())
            opt.step()
        results.append((a.detach().clone(), b.detach().clone()))
    for ours, theirs in zip(*results, strict=True):
        torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-6)


def test_adamw_checks_every_parameter_before_stepping_any():
    a = torch.nn.Parameter(torch.zeros(4, device=DEVICE))
    b = torch.nn.Parameter(torch.zeros(6, 8, device=DEVICE)[:, :3])  # not dense: a slice of a wider buffer
    a.grad, b.grad = torch.ones_like(a), torch.ones_like(b)
    assert_triton_runs(a)  # torch's AdamW (the fallback) would take b
    opt = AdamW([a, b], lr=0.1)
    with pytest.raises(ValueError, match="not dense"):
        opt.step()
    assert torch.equal(a, torch.zeros_like(a)) and not opt.state[a]  # a untouched, no step counted


def test_adamw_accepts_torchs_default_values_of_the_options_it_refuses():
    p = torch.nn.Parameter(torch.zeros(3))
    AdamW([p], amsgrad=False, maximize=False, foreach=None, fused=None, differentiable=False)


def test_adamw_refuses_options_it_does_not_implement():
    p = torch.nn.Parameter(torch.zeros(3))
    with pytest.raises(ValueError, match="amsgrad"):
        AdamW([p], amsgrad=True)
    with pytest.raises(ValueError, match="maximize"):
        AdamW([p], maximize=True)
    q = torch.nn.Parameter(torch.zeros(3, device=DEVICE))
    q.grad = torch.ones_like(q)
    opt = AdamW([{"params": [q], "maximize": True}])  # set per group: refused at the step
    with pytest.raises(ValueError, match=r"param group 0 sets \['maximize'\]"):
        opt.step()
    z = torch.nn.Parameter(torch.zeros(3, dtype=torch.complex64, device=DEVICE))
    z.grad = torch.ones_like(z)
    with pytest.raises(ValueError, match="complex parameter"):
        AdamW([z]).step()


# ------------------------------------------------------------------------------ mixed precision
def _master_run(p32, grads):
    """A bf16 parameter whose fp32 master starts at ``p32``, stepped once per gradient; (param, optimizer)."""
    p = torch.nn.Parameter(p32.clone())
    opt = AdamW([p], lr=LR, betas=BETAS, eps=EPS, weight_decay=WD, master_weights=True)
    opt.init_master_weights_(torch.bfloat16)
    for g in grads:
        p.grad = g.clone()
        opt.step()
    return p, opt


@pytest.mark.parametrize("shape", SHAPES)
def test_master_weights_step_the_fp32_master_and_round_it_into_the_bf16_parameter(shape):
    p32 = randn(*shape)
    assert_triton_runs(p32)
    grads = [randn(*shape, scale=s).to(torch.bfloat16) for s in (1.0, 0.1, 3.0)]
    p, opt = _master_run(p32, grads)
    master = opt.master_params()[p]
    assert p.dtype == torch.bfloat16 and master.dtype == torch.float32
    assert opt.state[p]["master_lo"].dtype == torch.int16
    assert opt.state[p]["exp_avg"].dtype == torch.float32 and opt.state[p]["exp_avg_sq"].dtype == torch.float32
    ref_p, ref_m, ref_v = _float64_adamw(p32, [g.float() for g in grads], LR, BETAS, EPS, WD)  # from the fp32 start
    assert_rel(master.double() - p32.double(), ref_p - p32.double(), torch.float32, "master - p0")
    assert_rel(opt.state[p]["exp_avg"], ref_m, torch.float32, "exp_avg")
    assert torch.equal(p.detach(), master.to(torch.bfloat16)), "the parameter is not its master rounded"


def test_the_master_split_is_exact_but_for_ties_rounded_down():
    """fp32 -> (bf16 rounded to nearest even, int16 low bits) -> fp32 gives the same bits, except where the low
    16 bits are a tie that rounds down (0x8000 over an even bf16): there the master is 1 ulp lower."""
    from kernels.adamw import join_master, split_master

    w = torch.randn(1 << 16, dtype=torch.float64).float() * torch.logspace(-30, 30, 1 << 16).float()
    bits = w.view(torch.int32)
    ties = (bits & 0xFFFF) == 0x8000
    w = torch.cat([w, (bits[:50] & ~0xFFFF | 0x8000).view(torch.float32), torch.tensor([0.0, -0.0, 1.0, -2.5])])
    hi, lo = split_master(w)
    assert torch.equal(hi, w.to(torch.bfloat16)), "not rounded to nearest even as torch rounds"
    back = join_master(hi, lo)
    bits, back_bits = w.view(torch.int32), back.view(torch.int32)
    tie_down = ((bits & 0xFFFF) == 0x8000) & ((bits >> 16) & 1 == 0)
    assert torch.equal(back_bits[~tie_down], bits[~tie_down])
    assert torch.equal(back_bits[tie_down], bits[tie_down] - 1) and tie_down.any() and not ties.all()


def test_clip_scales_the_gradient_inside_the_step_with_torchs_norm():
    shapes = [(37, 53), (1000,)]
    p32s = [randn(*s) for s in shapes]
    assert_triton_runs(p32s[0])
    grads = [randn(*s, scale=4.0).to(torch.bfloat16) for s in shapes]
    params = [torch.nn.Parameter(p.clone()) for p in p32s]
    opt = AdamW(params, lr=LR, betas=BETAS, eps=EPS, weight_decay=WD, master_weights=True)
    opt.init_master_weights_(torch.bfloat16)
    for p, g in zip(params, grads, strict=True):
        p.grad = g.clone()
    norm = opt.clip_grad_norm_(1.0)
    ref_grads = [g.float() for g in grads]  # what an fp32 parameter's gradient would be
    fp32 = [torch.nn.Parameter(torch.zeros_like(g)) for g in ref_grads]
    for q, g in zip(fp32, ref_grads, strict=True):
        q.grad = g
    ref_norm = torch.nn.utils.clip_grad_norm_(fp32, 1.0, foreach=True)
    assert abs(norm.item() - ref_norm.item()) <= 1e-6 * ref_norm.item() and norm.item() > 1.0
    opt.step()
    for p, p32, q in zip(params, p32s, fp32, strict=True):
        ref_p, _, _ = _float64_adamw(p32, [q.grad], LR, BETAS, EPS, WD)  # torch clipped q.grad in place
        assert_rel(opt.master_params()[p].double() - p32.double(), ref_p - p32.double(), torch.float32, "clipped")
    assert opt._grad_scale is None, "the clipping factor must apply to one step only"


def test_accumulated_micro_batch_gradients_are_summed_in_fp32():
    p32 = randn(64, 33)
    assert_triton_runs(p32)
    parts = [randn(64, 33).to(torch.bfloat16) for _ in range(3)]
    p = torch.nn.Parameter(p32.clone())
    opt = AdamW([p], lr=LR, betas=BETAS, eps=EPS, weight_decay=WD, master_weights=True)
    opt.init_master_weights_(torch.bfloat16)
    for g in parts:
        p.grad = g.clone()
        opt.accumulate_grads_()
        assert p.grad is None
    total = sum(g.float() for g in parts)
    assert torch.equal(opt.state[p]["grad_sum"], total), "not the fp32 sum of the bf16 micro-batch gradients"
    opt.step()
    ref_p, _, _ = _float64_adamw(p32, [total], LR, BETAS, EPS, WD)
    assert_rel(opt.master_params()[p].double() - p32.double(), ref_p - p32.double(), torch.float32, "master - p0")
    opt.zero_grad()
    assert "grad_sum" not in opt.state[p]


def test_the_pytorch_path_of_master_weights_equals_the_kernel(monkeypatch):
    p32 = randn(37, 53)
    assert_triton_runs(p32)
    grads = [randn(37, 53, scale=3.0).to(torch.bfloat16) for _ in range(3)]
    results = []
    for kernel in (True, False):
        if not kernel:
            monkeypatch.setattr("kernels.adamw.use_triton", lambda t: False)
        p = torch.nn.Parameter(p32.clone())
        opt = AdamW([p], lr=LR, betas=BETAS, eps=EPS, weight_decay=WD, master_weights=True)
        opt.init_master_weights_(torch.bfloat16)
        for g in grads:
            p.grad = g.clone()
            opt.clip_grad_norm_(1.0)
            opt.step()
        results.append((p.detach().clone(), opt.master_params()[p]))
    assert rel_err(results[1][1], results[0][1]) <= 1e-6
    assert (results[1][0].float() != results[0][0].float()).float().mean() <= 1e-3  # rounding ties at most


def test_a_state_dict_round_trip_keeps_the_fp32_masters_and_moments():
    p32 = randn(16, 8)
    p = torch.nn.Parameter(p32.clone())
    opt = AdamW([p], lr=LR, betas=BETAS, eps=EPS, weight_decay=WD, master_weights=True)
    opt.init_master_weights_(torch.bfloat16)
    p.grad = randn(16, 8).to(torch.bfloat16)
    opt.step()
    saved = {k: v.clone() for k, v in opt.state[p].items()}
    q = torch.nn.Parameter(p.detach().clone())
    other = AdamW([q], lr=LR, betas=BETAS, eps=EPS, weight_decay=WD, master_weights=True)
    other.load_state_dict(opt.state_dict())
    for k in ("master_lo", "exp_avg", "exp_avg_sq"):
        assert other.state[q][k].dtype == saved[k].dtype != torch.bfloat16 and torch.equal(other.state[q][k], saved[k])
    assert torch.equal(other.master_params()[q], opt.master_params()[p])


# ------------------------------------------------------------------------------ multi-tensor step
def _bits(t: torch.Tensor) -> torch.Tensor:
    """The bit pattern of ``t`` (-0.0 and 0.0 differ; NaNs compare)."""
    return t.detach().view({8: torch.int64, 4: torch.int32, 2: torch.int16}[t.element_size()])


def _mixed_params():
    """(parameter, fp32 master or None, param group) of every kind the multi-tensor step groups: fp32 without a
    master and bf16 with one, odd sizes, empty, under and over one block, a transpose; two param groups."""
    from kernels.adamw import _BLOCK

    shapes = [(37, 53), (1000,), (0,), (5,), (3, 5, 777), (_BLOCK + 1,), "t"]
    out = []
    for group in (0, 1):
        for dtype in (torch.float32, torch.bfloat16):
            for k, shape in enumerate(shapes):
                seed = 100 * group + 10 * k + (dtype == torch.bfloat16)
                w = randn(7, 9, seed=seed).t() if shape == "t" else randn(*shape, seed=seed)  # (9, 7), strides (1, 9)
                p = torch.nn.Parameter(w.clone().to(dtype))  # .to keeps the transpose's strides
                out.append((p, w if dtype == torch.bfloat16 else None, group))
    return out


@pytest.mark.parametrize("clip", [False, True])
def test_the_multi_tensor_step_equals_per_tensor_updates_bit_for_bit(clip):
    """AdamW.step (one launch per group of tensors) against adamw_update_ on each tensor, over steps where some
    parameters have no gradient, a gradient's strides differ from its parameter's, and bf16 gradients are
    accumulated in fp32; lr a float in one param group, a device tensor in the other."""
    from kernels.adamw import adamw_update_

    params = _mixed_params()
    assert_triton_runs(params[0][0])
    lrs, wds = (LR, torch.tensor(0.01, device=DEVICE)), (WD, 0.0)
    groups = [{"params": [p for p, _, g in params if g == i], "lr": lrs[i], "weight_decay": wds[i]} for i in (0, 1)]
    opt = AdamW(groups, betas=BETAS, eps=EPS, master_weights=True)
    opt.load_masters_({p: w for p, w, _ in params if w is not None})
    ref = []  # per parameter: [p, master_lo, exp_avg, exp_avg_sq, step], stepped by adamw_update_
    for p, w, _ in params:
        moments = torch.float32 if w is not None else p.dtype
        ref.append([p.detach().clone(), opt._master_lo(p).clone() if w is not None else None,
                    torch.zeros_like(p, dtype=moments), torch.zeros_like(p, dtype=moments),
                    torch.zeros((), device=DEVICE)])
    for step in range(4):
        grads = [None if (step == 1 and k % 3 == 0) else randn(*p.shape, seed=1000 * step + k, scale=3.0).to(p.dtype)
                 for k, (p, _, _) in enumerate(params)]
        if step == 2:  # a gradient in another layout than its transposed parameter's: copied
            grads = [g.contiguous() if g is not None else None for g in grads]
        for (p, _, _), g in zip(params, grads, strict=True):
            p.grad = g
        if step == 3:  # two micro-batches: the bf16 parameters' gradients summed in fp32 (another grad dtype)
            opt.accumulate_grads_()
            for (p, _, _), g in zip(params, grads, strict=True):
                p.grad = g
            opt.accumulate_grads_()
            grads = [opt._grad(p) for p, _, _ in params]  # every parameter has one at this step
        if clip:
            opt.clip_grad_norm_(1.0)
        scale = opt._grad_scale
        for (_, _, i), g, (rp, lo, m, v, t) in zip(params, grads, ref, strict=True):
            if g is None:
                continue
            t += 1
            g = g if g.stride() == rp.stride() else torch.empty_like(rp, dtype=g.dtype).copy_(g)
            adamw_update_(rp, g, m, v, t, lrs[i], *BETAS, EPS, wds[i], master_lo=lo, grad_scale=scale)
        opt.step()
        opt.zero_grad()
        for k, ((p, _, _), (rp, lo, m, v, t)) in enumerate(zip(params, ref, strict=True)):
            state = opt.state[p]
            assert torch.equal(_bits(p), _bits(rp)), f"step {step}, parameter {k}: p differs"
            assert torch.equal(_bits(state["exp_avg"]), _bits(m)) and torch.equal(_bits(state["exp_avg_sq"]), _bits(v))
            assert torch.equal(state["step"], t)
            if lo is not None:
                assert torch.equal(state["master_lo"], lo), f"step {step}, parameter {k}: master_lo differs"
    assert all(rel_err(p, w.to(p.dtype)) > 1e-3 for p, w, _ in params if w is not None and p.numel())  # they moved


class _CountingLaunches:
    """Stands in for a Triton kernel: counts launches and runs the kernel."""

    def __init__(self, kernel):
        self.kernel, self.launches = kernel, 0

    def __getitem__(self, grid):
        self.launches += 1
        return self.kernel[grid]


def test_a_step_launches_one_kernel_per_group_of_tensors(monkeypatch):
    """Groups: param group x (fp32 without a master, bf16 with one); parameters without a gradient or without
    elements add none."""
    import kernels.adamw as adamw

    multi = _CountingLaunches(adamw._adamw_multi_kernel)
    single = _CountingLaunches(adamw._adamw_kernel)
    monkeypatch.setattr(adamw, "_adamw_multi_kernel", multi)
    monkeypatch.setattr(adamw, "_adamw_kernel", single)
    params = _mixed_params()
    assert_triton_runs(params[0][0])
    groups = [{"params": [p for p, _, g in params if g == i], "weight_decay": (WD, 0.0)[i]} for i in (0, 1)]
    opt = AdamW(groups, lr=LR, master_weights=True)
    for step, expected in enumerate((4, 4, 2)):
        for k, (p, _, group) in enumerate(params):
            p.grad = None if step == 2 and group == 1 else randn(*p.shape, seed=k).to(p.dtype)
        before = multi.launches
        opt.step()
        assert multi.launches - before == expected and single.launches == 0


def test_aligned_tensors_share_a_vectorized_launch_and_large_unaligned_ones_keep_their_own(monkeypatch):
    """Tensors whose addresses and sizes are multiples of 16 bytes (16 elements) share one ALIGNED launch of
    _adamw_multi_kernel whatever their size; small unaligned ones share another; one larger than
    MULTI_TENSOR_MAX_NUMEL that is not aligned (an odd size, or a view at an odd offset) gets its own _adamw_kernel
    launch. Every tensor takes the numbers of adamw_update_ alone, bit for bit."""
    import kernels.adamw as adamw

    multi = _CountingLaunches(adamw._adamw_multi_kernel)
    single = _CountingLaunches(adamw._adamw_kernel)
    monkeypatch.setattr(adamw, "_adamw_multi_kernel", multi)
    monkeypatch.setattr(adamw, "_adamw_kernel", single)
    monkeypatch.setattr(adamw, "MULTI_TENSOR_MAX_NUMEL", 1000)
    sizes = (304, 5008, 7, 1000, 1001, 4096)
    params = [torch.nn.Parameter(randn(n, seed=s)) for s, n in enumerate(sizes)]
    offset = torch.nn.Parameter(randn(2001, seed=9)[1:])  # 2000 elements, 4 bytes past an aligned address
    params.append(offset)
    sizes += (2000,)
    assert_triton_runs(params[0])
    assert offset.data_ptr() % 16 == 4
    reference = [p.detach().clone() for p in params]
    opt = AdamW(params, lr=LR, betas=BETAS, eps=EPS, weight_decay=WD)
    launched = []
    for _ in range(2):  # the second step reuses the cached tables
        for p, n in zip(params, sizes, strict=True):
            p.grad = randn(n, seed=20 + n)
        opt.step()
        launched.append((multi.launches, single.launches))
    assert launched == [(2, 2), (4, 4)]  # {304, 5008, 4096} and {7, 1000} share; 1001 and the view alone
    groups = sorted(key[3] for key in opt._tables)
    assert groups == [False, True]  # the key's alignment flag
    for p, ref, n in zip(params, reference, sizes, strict=True):
        m, v, t = torch.zeros_like(ref), torch.zeros_like(ref), torch.zeros((), device=ref.device)
        for _ in range(2):
            t += 1
            adamw.adamw_update_(ref, randn(n, seed=20 + n), m, v, t, LR, *BETAS, EPS, WD)
        assert torch.equal(p.detach(), ref), f"a tensor of {n} elements"


def test_a_replaced_parameter_storage_rebuilds_the_cached_tables():
    from kernels.adamw import adamw_update_

    params = [torch.nn.Parameter(randn(300, seed=s)) for s in range(3)]
    assert_triton_runs(params[0])
    opt = AdamW(params, lr=LR, betas=BETAS, eps=EPS, weight_decay=WD)
    grads = [randn(300, seed=10 + s) for s in range(3)]
    for p, g in zip(params, grads, strict=True):
        p.grad = g.clone()
    opt.step()
    (tables,) = opt._tables.values()
    old = params[1].data
    params[1].data = randn(300, seed=7)  # a new storage (as init_master_weights_ or a checkpoint load may do)
    expected = params[1].detach().clone()
    state = opt.state[params[1]]
    m, v, t = state["exp_avg"].clone(), state["exp_avg_sq"].clone(), state["step"] + 1
    adamw_update_(expected, grads[1], m, v, t, LR, *BETAS, EPS, WD)
    old_before = old.clone()
    for p, g in zip(params, grads, strict=True):
        p.grad = g.clone()
    opt.step()
    (rebuilt,) = opt._tables.values()
    assert rebuilt is not tables and rebuilt.ptrs != tables.ptrs
    assert torch.equal(old, old_before), "the step wrote into the replaced storage"
    assert torch.equal(_bits(params[1]), _bits(expected))
    opt.step()
    assert next(iter(opt._tables.values())) is rebuilt, "nothing was replaced: the tables are kept"


#: Compiles AdamW's kernels for an H100 (sm90) on any machine, with Triton's own LLVM and ptxas (in a process of
#: its own: the suite's TRITON_INTERPRET=1 leaves no compilable kernels), its pointers 16-byte aligned and the single
#: tensor's element count a multiple of 16, as Triton specializes them at a launch; prints the 16-byte vector loads
#: and stores of each PTX.
_SM90_VECTORS = """
import json
import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget
import kernels.adamw as adamw

def vectors(kernel, types, constants):
    signature, constexprs, attrs = {}, {}, {}
    for i, name in enumerate(kernel.arg_names):
        if name in constants:
            signature[name], constexprs[(i,)] = "constexpr", constants[name]
        else:
            signature[name] = types[name]
            if types[name].startswith("*") or name == "n":
                attrs[(i,)] = [["tt.divisibility", 16]]
    source = triton.compiler.ASTSource(kernel, signature, constexprs, attrs)
    ptx = triton.compile(source, target=GPUTarget("cuda", 90, 32), options={"num_warps": 8}).asm["ptx"]
    return ptx.count("ld.global.v4"), ptx.count("st.global.v4")

scalars = dict(lr="fp32", beta1="fp32", beta2="fp32", log2_beta1="fp32", log2_beta2="fp32", eps="fp32",
               weight_decay="fp32", lr_ptr="*fp32", scale_ptr="*fp32")
flags = dict(LR_ON_DEVICE=True, MASTER=True, SCALE=True, BLOCK=adamw._BLOCK)
out = {"single": vectors(adamw._adamw_kernel, dict(scalars, p_ptr="*bf16", lo_ptr="*i16", g_ptr="*bf16",
                                                   m_ptr="*fp32", v_ptr="*fp32", step_ptr="*fp32", n="i32"), flags)}
for aligned in (True, False):
    out[f"multi aligned={aligned}"] = vectors(adamw._adamw_multi_kernel, dict(
        scalars, table_ptr="*i64", g_table_ptr="*i64", programs_ptr="*i32", base_ptr="*u8", n_programs="i32"),
        dict(flags, P_DTYPE=tl.bfloat16, G_DTYPE=tl.bfloat16, M_DTYPE=tl.float32, V_DTYPE=tl.float32,
             STEP_DTYPE=tl.float32, ALIGNED=aligned))
print(json.dumps(out))
"""


def test_an_aligned_multi_tensor_launch_compiles_to_the_vector_loads_of_a_single_tensor_launch():
    """The ALIGNED multi-tensor kernel moves 16-byte vectors as _adamw_kernel does on aligned arguments (bf16 p and
    gradient, int16 master bits, fp32 moments), where the kernel that reads raw addresses from its tables loads
    element by element (on an H200 that took Qwen2-1.5B's step from 10.2 ms to 44 ms)."""
    import json
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run = subprocess.run([sys.executable, "-c", _SM90_VECTORS], env=env, capture_output=True, text=True, timeout=300,
                         cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert run.returncode == 0, run.stderr[-3000:]
    loads_stores = {k: tuple(v) for k, v in json.loads(run.stdout.strip().splitlines()[-1]).items()}
    assert loads_stores["single"] == (14, 12)  # per thread: 16 elements of p, lo, g (2 vectors each), m, v (4 each)
    assert loads_stores["multi aligned=True"] == loads_stores["single"]
    assert loads_stores["multi aligned=False"] == (0, 0)
