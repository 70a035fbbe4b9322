"""AdamW update: one Triton kernel per parameter tensor, reading each byte once.

``AdamW`` is ``torch.optim.AdamW`` (same hyper-parameters, same state keys, so its state dict and
checkpoints are interchangeable with torch's) whose ``step`` launches ``_adamw_kernel`` per
parameter. Why: torch's fused AdamW ran at about 70% of the H100's copy bandwidth in our training
profiles (16.5 ms of a 238 ms Gemma-2B step; benchmarks/results/profiles); an elementwise Triton
kernel over large tensors runs near the copy bandwidth (the GLU kernels: 94-100%).

Per element, in fp32, rounded once to each tensor's dtype (torch's decoupled weight decay):

    p <- p * (1 - lr * wd)
    m <- m + (1 - b1) * (g - m)            v <- b2 * v + (1 - b2) * g^2
    p <- p - lr / (1 - b1^t) * m / (sqrt(v) / sqrt(1 - b2^t) + eps)

with t the step count after this step. Bytes moved per element: read p, g, m, v; write p, m, v.

The step count and (optionally) the learning rate live on the device, so a step has no host
synchronisation and can be captured in a CUDA graph (``capturable=True`` is accepted, and needed by
``ligermodels.cuda_graph.CUDAGraphStep``; the kernel path is always capturable). Parameters that are
DTensors (FSDP2 shards) are updated through their local shards. Where the kernels do not run (CPU
tensors without ``TRITON_INTERPRET=1``), ``step`` is torch's own AdamW, the reference.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from kernels._common import use_triton

#: Elements per program and warps: 16 elements a thread (as the GLU kernels).
_BLOCK = 4096
_WARPS = 8


@triton.jit
def _adamw_kernel(p_ptr, g_ptr, m_ptr, v_ptr, step_ptr, lr_ptr, lr, n, beta1, beta2, log2_beta1, log2_beta2,
                  eps, weight_decay, LR_ON_DEVICE: tl.constexpr, BLOCK: tl.constexpr):
    """One BLOCK of one parameter: the AdamW update of p, m (exp_avg), v (exp_avg_sq) in place."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    t = tl.load(step_ptr).to(tl.float32)  # already incremented for this step
    if LR_ON_DEVICE:
        lr = tl.load(lr_ptr).to(tl.float32)
    bc1 = 1.0 - tl.exp2(t * log2_beta1)
    bc2_sqrt = tl.sqrt(1.0 - tl.exp2(t * log2_beta2))
    p = tl.load(p_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    g = tl.load(g_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    m = tl.load(m_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    v = tl.load(v_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    p = p * (1.0 - lr * weight_decay)
    m = m + (1.0 - beta1) * (g - m)
    v = beta2 * v + (1.0 - beta2) * g * g
    p = p - (lr / bc1) * m / (tl.sqrt(v) / bc2_sqrt + eps)
    tl.store(p_ptr + offs, p.to(p_ptr.dtype.element_ty), mask=mask)
    tl.store(m_ptr + offs, m.to(m_ptr.dtype.element_ty), mask=mask)
    tl.store(v_ptr + offs, v.to(v_ptr.dtype.element_ty), mask=mask)


def _log2(beta: float) -> float:
    """log2(beta), -inf for beta 0 (then beta^t = exp2(t * -inf) = 0: no bias correction)."""
    return math.log2(beta) if beta > 0 else float("-inf")


def _local(t: torch.Tensor) -> torch.Tensor:
    """The tensor itself, or a DTensor's local shard (same storage)."""
    return t.to_local() if hasattr(t, "to_local") else t


def _dense(t: torch.Tensor) -> bool:
    """Whether ``t`` covers one gap-free block of memory exactly once, in some order of its dims."""
    expected = 1
    for stride, size in sorted((st, sz) for st, sz in zip(t.stride(), t.shape, strict=True) if sz > 1):
        if stride != expected:
            return False
        expected *= size
    return True


def _flat(t: torch.Tensor) -> torch.Tensor:
    """A 1-D view over the memory of a dense tensor (contiguous, or dense in another order such as a
    transpose): the kernel is elementwise, so tensors of equal strides pair up element for element."""
    return t.view(-1) if t.is_contiguous() else t.as_strided((t.numel(),), (1,), t.storage_offset())


def _check_layout(param: torch.Tensor, grad: torch.Tensor, state: dict) -> None:
    """Raise before any update when the kernel cannot pair ``param`` with its gradient and moments."""
    p, g = _local(param), _local(grad)
    if p.is_complex():
        raise ValueError(f"kernels.AdamW: complex parameter of shape {tuple(p.shape)} is not supported")
    if g.is_sparse:
        raise RuntimeError("kernels.AdamW does not support sparse gradients")
    moments = [_local(state[k]) for k in ("exp_avg", "exp_avg_sq") if k in state]
    if p.is_contiguous() and all(m.is_contiguous() for m in moments):  # the usual case, checked cheaply
        return
    what = f"kernels.AdamW: parameter of shape {tuple(p.shape)}"
    if not _dense(p):
        raise ValueError(f"{what} is not dense in memory (strides {p.stride()}); use torch.optim.AdamW")
    for name, m in zip(("exp_avg", "exp_avg_sq"), moments, strict=False):
        if m.stride() != p.stride():
            raise ValueError(f"{what}: its {name} has strides {m.stride()}, the parameter {p.stride()}")


def adamw_update_(param: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor,
                  step: torch.Tensor, lr: float | torch.Tensor, beta1: float, beta2: float, eps: float,
                  weight_decay: float) -> None:
    """Apply one AdamW update in place to ``param``, ``exp_avg``, ``exp_avg_sq`` (one shape, dense, equal
    strides; ``grad`` too).

    ``step``: a 0-dim float tensor on the parameter's device holding the step count *after* this update
    (1 on the first). ``lr``: a float, or a 0-dim tensor on the device (read by the kernel).
    """
    p, g, m, v = (_flat(_local(t)) for t in (param, grad, exp_avg, exp_avg_sq))
    n = p.numel()
    if n == 0:
        return
    on_device = isinstance(lr, torch.Tensor)
    if on_device and lr.device != p.device:
        raise ValueError(f"kernels.AdamW: the lr tensor is on {lr.device}, the parameter on {p.device}; "
                         "put the lr on the parameters' device")
    _adamw_kernel[(triton.cdiv(n, _BLOCK),)](
        p, g, m, v, _local(step), lr if on_device else step, 0.0 if on_device else float(lr), n, beta1, beta2,
        _log2(beta1), _log2(beta2), eps, weight_decay, LR_ON_DEVICE=on_device, BLOCK=_BLOCK,
        num_warps=_WARPS)


class AdamW(torch.optim.AdamW):
    """``torch.optim.AdamW`` whose step runs ``_adamw_kernel`` (one launch per parameter, no host sync).

    Args as ``torch.optim.AdamW``: ``params``, ``lr`` (float or 0-dim tensor), ``betas``, ``eps``,
    ``weight_decay``, ``capturable``. Refused: ``amsgrad``, ``maximize``, ``foreach``, ``fused``,
    ``differentiable`` (the kernel implements plain AdamW). State per parameter: ``step`` (0-dim float32 on
    the parameter's device), ``exp_avg``, ``exp_avg_sq`` (the parameter's shape and dtype), as torch's.
    """

    def __init__(self, params, lr: float | torch.Tensor = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 1e-2, *, capturable: bool = False, **unsupported):
        unsupported = {k: v for k, v in unsupported.items() if v}  # torch's defaults (None / False) ask for nothing
        if unsupported:
            raise ValueError(f"kernels.AdamW does not take {sorted(unsupported)} (plain AdamW only); "
                             "use torch.optim.AdamW for those")
        super().__init__(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, capturable=capturable)

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        with_grad = [p for group in self.param_groups for p in group["params"] if p.grad is not None]
        if with_grad and not all(use_triton(_local(p)) for p in with_grad):
            super().step()  # the reference: torch's AdamW (CPU tensors without the interpreter)
            return loss
        for i, group in enumerate(self.param_groups):  # every check first: an error leaves nothing half-stepped
            refused = [k for k in ("amsgrad", "maximize", "differentiable") if group.get(k)]
            if refused and any(p.grad is not None for p in group["params"]):  # set by add_param_group / a state dict
                raise ValueError(f"kernels.AdamW: param group {i} sets {refused}; plain AdamW only")
            for p in group["params"]:
                if p.grad is not None:
                    _check_layout(p, p.grad, self.state.get(p, {}))
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            if not params:
                continue
            lr = group["lr"]
            if isinstance(lr, torch.Tensor) and lr.device.type == "cpu" and params[0].device.type != "cpu":
                lr = lr.item()  # a host tensor (torch.distributed.checkpoint makes one): read without a GPU sync
            steps = []
            for p in params:
                state = self.state[p]
                if not state:  # torch's layout: step on the device (as with capturable), moments like p
                    state["step"] = torch.zeros((), dtype=torch.float32, device=p.device)
                    state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                    state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                elif state["step"].device != p.device:  # a state dict loaded from torch's AdamW keeps it on the CPU
                    state["step"] = state["step"].to(device=p.device, dtype=torch.float32)
                steps.append(state["step"])
            torch._foreach_add_(steps, 1.0)
            beta1, beta2 = group["betas"]
            for p in params:
                state = self.state[p]
                grad = p.grad if p.grad.stride() == p.stride() else torch.empty_like(p).copy_(p.grad)  # p's layout
                adamw_update_(p, grad, state["exp_avg"], state["exp_avg_sq"], state["step"], lr,
                              beta1, beta2, group["eps"], group["weight_decay"])
        return loss
