"""AdamW update: one Triton launch per group of parameter tensors, reading each byte once.

``AdamW`` is ``torch.optim.AdamW`` (same hyper-parameters, same state keys, so its state dict and
checkpoints are interchangeable with torch's) whose ``step`` runs its own elementwise kernel. Why:
torch's fused AdamW ran at about 70% of the H100's copy bandwidth in our training profiles (16.5 ms
of a 238 ms Gemma-2B step; benchmarks/results/profiles); an elementwise Triton kernel over large
tensors runs near the copy bandwidth (the GLU kernels: 94-100%).

Multi-tensor apply: ``step`` launches ``_adamw_multi_kernel`` once per group of tensors that share a param
group, device, dtypes, master-or-not and alignment, not ``_adamw_kernel`` once per tensor. Why: a launch
costs the host tens of microseconds (Python and Triton's launcher), and a LoRA step's 224 small
adapter tensors kept the GPU idle for 10-20 ms of host time a step; a full fine-tuning step of Qwen2-1.5B
has 113 tensors above a million elements. Tensors whose addresses and sizes are multiples of 16 bytes (what
PyTorch's allocator gives whole tensors) share a launch whose loads are vectorized (``ALIGNED``: the kernel is
told so); a tensor above ``MULTI_TENSOR_MAX_NUMEL`` that is not aligned keeps its own ``_adamw_kernel``
launch, where Triton finds out what alignment it has. The kernel finds its tensors
through int64 address tables: those of the parameters, moments, masters and step counts are kept on
the device between steps (rebuilt when an address changes), the gradients' are copied each step
from pinned memory. Both kernels share the arithmetic (``_adamw_block``), so the results are the same
bits. Inside a CUDA-graph capture ``step`` launches per tensor (no table copies to capture; a replay
pays no launch cost anyway). ``adamw_update_`` updates one tensor.

Per element, in fp32, rounded once to each tensor's dtype (torch's decoupled weight decay):

    p <- p * (1 - lr * wd)
    m <- m + (1 - b1) * (g - m)            v <- b2 * v + (1 - b2) * g^2
    p <- p - lr / (1 - b1^t) * m / (sqrt(v) / sqrt(1 - b2^t) + eps)

with t the step count after this step. Bytes moved per element: read p, g, m, v; write p, m, v.

Mixed precision (``master_weights=True``): the parameters are bf16 and the optimiser keeps, for
each, the low 16 bits of its fp32 master (``state["master_lo"]``, int16): the master's bit pattern is
``(p_bits << 16) + master_lo``, p being the master rounded to nearest-even. So the fp32 weights cost
2 bytes a parameter beyond the bf16 ones, not 4, and p is exactly what a cast of the fp32 weights
before the next forward would give (without that pass). When the master's low bits are exactly a
rounding tie that rounds down (a difference of 2^15, one past int16), the master moves 1 fp32 ulp
down: a rounding error of the fp32 update, in about one element in 65536. Moments are fp32. Per
element the kernel reads p, lo, g, m, v and writes p, lo, m, v (24 bytes, against 28 for fp32
parameters and their gradient). Gradients of several micro-batches are summed in fp32
(``accumulate_grads_``), and ``clip_grad_norm_`` computes the global norm in fp32 and hands the
clipping factor to the kernel, which scales g as it reads it (no pass over the gradients).
``master_params`` gives the fp32 weights (for checkpoints: the same state as a run with fp32
parameters) and ``load_masters_`` sets them.

The step count and (optionally) the learning rate live on the device, so a step has no host
synchronisation and can be captured in a CUDA graph (``capturable=True`` is accepted, and needed by
``ligermodels.train.cuda_graph.CUDAGraphStep``; the kernel path is always capturable). Parameters that are
DTensors (FSDP2 shards) are updated through their local shards. Where the kernels do not run (CPU
tensors without ``TRITON_INTERPRET=1``), ``step`` is torch's own AdamW, the reference.
"""

from __future__ import annotations

import functools
import itertools
import math
from collections.abc import Callable

import torch
import triton
import triton.language as tl

from kernels._common import use_triton

#: Elements per program and warps: 16 elements a thread (as the GLU kernels).
_BLOCK = 4096
#: A tensor above this many elements that is not 16-byte aligned (``_aligned``) gets its own ``_adamw_kernel``
#: launch. Triton specializes that kernel's pointer and size arguments on their alignment; the multi-tensor
#: kernel reads its addresses from a table and knows them aligned only when told (``ALIGNED``). Without
#: vectorized loads, Qwen2-1.5B's fp32-master step took 48.7 ms against 13.9 (H100, benchmarks/results/profiles);
#: at this size a tensor's update (24 MB moved, ~10 us) outweighs its launch.
MULTI_TENSOR_MAX_NUMEL = 1 << 20
#: The alignment, in bytes, of every address and size in an ``ALIGNED`` launch.
_ALIGN = 16
_WARPS = 8


@triton.jit
def _adamw_block(p_ptr, lo_ptr, g_ptr, m_ptr, v_ptr, step_ptr, lr_ptr, scale_ptr, lr, offs, mask, beta1, beta2,
                 log2_beta1, log2_beta2, eps, weight_decay, LR_ON_DEVICE: tl.constexpr, MASTER: tl.constexpr,
                 SCALE: tl.constexpr):
    """The update of the elements ``offs`` (where ``mask``) of one parameter: p (with MASTER: the fp32 master
    held as bf16 p and its int16 low bits), m (exp_avg), v (exp_avg_sq) in place; with SCALE, g is
    multiplied by ``*scale_ptr`` first. The arithmetic of both kernels, written once."""
    t = tl.load(step_ptr).to(tl.float32)  # already incremented for this step
    if LR_ON_DEVICE:
        lr = tl.load(lr_ptr).to(tl.float32)
    bc1 = 1.0 - tl.exp2(t * log2_beta1)
    bc2_sqrt = tl.sqrt(1.0 - tl.exp2(t * log2_beta2))
    if MASTER:
        hi = tl.load(p_ptr + offs, mask=mask, other=0.0).to(tl.int16, bitcast=True).to(tl.int32)
        lo = tl.load(lo_ptr + offs, mask=mask, other=0).to(tl.int32)
        p = ((hi << 16) + lo).to(tl.float32, bitcast=True)
    else:
        p = tl.load(p_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    g = tl.load(g_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    if SCALE:
        g = g * tl.load(scale_ptr)
    m = tl.load(m_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    v = tl.load(v_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    p = p * (1.0 - lr * weight_decay)
    m = m + (1.0 - beta1) * (g - m)
    v = beta2 * v + (1.0 - beta2) * g * g
    p = p - (lr / bc1) * m / (tl.sqrt(v) / bc2_sqrt + eps)
    if MASTER:
        bits = p.to(tl.int32, bitcast=True)
        hi = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16  # round to nearest even, on the bit pattern
        lo = bits - (hi << 16)
        lo = tl.where(lo == 32768, 32767, lo)  # a tie rounded down: the master moves 1 ulp down (see above)
        tl.store(p_ptr + offs, hi.to(tl.int16).to(tl.bfloat16, bitcast=True), mask=mask)
        tl.store(lo_ptr + offs, lo.to(tl.int16), mask=mask)
    else:
        tl.store(p_ptr + offs, p.to(p_ptr.dtype.element_ty), mask=mask)
    tl.store(m_ptr + offs, m.to(m_ptr.dtype.element_ty), mask=mask)
    tl.store(v_ptr + offs, v.to(v_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _adamw_kernel(p_ptr, lo_ptr, g_ptr, m_ptr, v_ptr, step_ptr, lr_ptr, scale_ptr, lr, n, beta1, beta2, log2_beta1,
                  log2_beta2, eps, weight_decay, LR_ON_DEVICE: tl.constexpr, MASTER: tl.constexpr,
                  SCALE: tl.constexpr, BLOCK: tl.constexpr):
    """One BLOCK of one parameter (``adamw_update_``)."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    _adamw_block(p_ptr, lo_ptr, g_ptr, m_ptr, v_ptr, step_ptr, lr_ptr, scale_ptr, lr, offs, offs < n, beta1, beta2,
                 log2_beta1, log2_beta2, eps, weight_decay, LR_ON_DEVICE, MASTER, SCALE)


@triton.jit
def _table_pointer(base_ptr, slot, DTYPE: tl.constexpr, ALIGNED: tl.constexpr):
    """A ``DTYPE`` pointer from an int64 of a launch's tables: the address itself, or (ALIGNED) its distance from
    ``base_ptr`` in 16-byte units. The second form tells Triton that the address is 16-byte aligned (``base_ptr``,
    a launch argument, is specialized as such), so the loads and stores through it are vectorized; a hint on a
    loaded address (``tl.multiple_of``) does not reach them."""
    value = tl.load(slot)
    if ALIGNED:
        return (base_ptr + value * 16).to(tl.pointer_type(DTYPE), bitcast=True)
    return value.to(tl.pointer_type(DTYPE), bitcast=True)


@triton.jit
def _adamw_multi_kernel(table_ptr, g_table_ptr, programs_ptr, base_ptr, n_programs, lr_ptr, scale_ptr, lr, beta1,
                        beta2, log2_beta1, log2_beta2, eps, weight_decay, P_DTYPE: tl.constexpr,
                        G_DTYPE: tl.constexpr, M_DTYPE: tl.constexpr, V_DTYPE: tl.constexpr,
                        STEP_DTYPE: tl.constexpr, LR_ON_DEVICE: tl.constexpr, MASTER: tl.constexpr,
                        SCALE: tl.constexpr, ALIGNED: tl.constexpr, BLOCK: tl.constexpr):
    """One BLOCK of one tensor of a group (``AdamW.step``). ``table_ptr``: int64 (tensors, 6), per tensor the
    addresses of p, master_lo (p's without a master), exp_avg, exp_avg_sq, step, then its element count;
    ``g_table_ptr``: int64 gradient addresses; ``programs_ptr``: int32 (2, n_programs), per program its
    tensor's row in the tables and its block in that tensor. ALIGNED: the addresses but the step's are
    distances from ``base_ptr`` and the element count a count of 16 elements, all in 16-byte units
    (``_table_pointer``)."""
    pid = tl.program_id(0)
    i = tl.load(programs_ptr + pid).to(tl.int64)
    block = tl.load(programs_ptr + n_programs + pid).to(tl.int64)
    row = table_ptr + i * 6
    p_ptr = _table_pointer(base_ptr, row, P_DTYPE, ALIGNED)
    if MASTER:
        lo_ptr = _table_pointer(base_ptr, row + 1, tl.int16, ALIGNED)
    else:
        lo_ptr = p_ptr
    m_ptr = _table_pointer(base_ptr, row + 2, M_DTYPE, ALIGNED)
    v_ptr = _table_pointer(base_ptr, row + 3, V_DTYPE, ALIGNED)
    step_ptr = tl.load(row + 4).to(tl.pointer_type(STEP_DTYPE), bitcast=True)
    n = tl.load(row + 5)
    if ALIGNED:
        n = n * 16
    g_ptr = _table_pointer(base_ptr, g_table_ptr + i, G_DTYPE, ALIGNED)
    offs = block * BLOCK + tl.arange(0, BLOCK)
    _adamw_block(p_ptr, lo_ptr, g_ptr, m_ptr, v_ptr, step_ptr, lr_ptr, scale_ptr, lr, offs, offs < n, beta1, beta2,
                 log2_beta1, log2_beta2, eps, weight_decay, LR_ON_DEVICE, MASTER, SCALE)


def join_master(param: torch.Tensor, lo: torch.Tensor) -> torch.Tensor:
    """The fp32 master of a bf16 ``param`` and its int16 low bits (a new tensor)."""
    hi = param.detach().view(torch.int16).to(torch.int32)
    return ((hi << 16) + lo.to(torch.int32)).view(torch.float32)


def split_master(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(bf16 ``w`` rounded to nearest even, int16 low bits) of fp32 ``w``, as the kernel stores them."""
    bits = w.detach().contiguous().view(torch.int32)
    hi = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
    lo = bits - (hi << 16)
    lo = torch.where(lo == 32768, 32767, lo)
    return hi.to(torch.int16).view(torch.bfloat16), lo.to(torch.int16)


def adamw_reference_(param: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor,
                     step: torch.Tensor, lr: float | torch.Tensor, beta1: float, beta2: float, eps: float,
                     weight_decay: float, master_lo: torch.Tensor | None = None,
                     grad_scale: torch.Tensor | None = None) -> None:
    """The kernel's arithmetic in PyTorch (fp32; the CPU path of master-weight and scaled steps)."""
    w = join_master(param, master_lo) if master_lo is not None else param.float()
    g = grad.float() if grad_scale is None else grad.float() * grad_scale
    m, v = exp_avg.float(), exp_avg_sq.float()
    t = step.float()
    w.mul_(1.0 - lr * weight_decay)
    m.add_((1.0 - beta1) * (g - m))
    v.mul_(beta2).add_((1.0 - beta2) * g * g)
    w.sub_((lr / (1.0 - beta1 ** t)) * m / (v.sqrt() / (1.0 - beta2 ** t).sqrt() + eps))
    if master_lo is not None:
        hi, lo = split_master(w)
        param.copy_(hi.view_as(param))
        master_lo.copy_(lo.view_as(master_lo))
    else:
        param.copy_(w)
    for dst, src in ((exp_avg, m), (exp_avg_sq, v)):
        if dst is not src:
            dst.copy_(src)


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


def _aligned(tensors: tuple[torch.Tensor, ...]) -> bool:
    """Whether (p, lo, g, m, v, step) may go to an ``ALIGNED`` launch: the first five addresses multiples of
    ``_ALIGN`` bytes and the element count a multiple of 16 (so that no vector of the last block straddles the
    end)."""
    return tensors[0].numel() % 16 == 0 and all(t.data_ptr() % _ALIGN == 0 for t in tensors[:5])


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


def _check_lr_device(lr: float | torch.Tensor, device: torch.device) -> None:
    """ValueError when an lr tensor, which the kernel reads, sits on another device than the parameter."""
    if isinstance(lr, torch.Tensor) and lr.device != device:
        raise ValueError(f"kernels.AdamW: the lr tensor is on {lr.device}, the parameter on {device}; "
                         "put the lr on the parameters' device")


def adamw_update_(param: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor,
                  step: torch.Tensor, lr: float | torch.Tensor, beta1: float, beta2: float, eps: float,
                  weight_decay: float, master_lo: torch.Tensor | None = None,
                  grad_scale: torch.Tensor | None = None) -> None:
    """Apply one AdamW update in place to ``param``, ``exp_avg``, ``exp_avg_sq`` (one shape, dense, equal
    strides; ``grad`` and ``master_lo`` too).

    ``step``: a 0-dim float tensor on the parameter's device holding the step count *after* this update
    (1 on the first). ``lr``: a float, or a 0-dim tensor on the device (read by the kernel).
    ``master_lo``: the int16 low bits of a bf16 ``param``'s fp32 master: the master is updated, ``param``
    set to it rounded to nearest even and ``master_lo`` to the rest.
    ``grad_scale``: a 0-dim fp32 tensor on the device multiplying the gradient (gradient clipping).
    """
    p, g, m, v = (_flat(_local(t)) for t in (param, grad, exp_avg, exp_avg_sq))
    lo = _flat(_local(master_lo)) if master_lo is not None else p
    n = p.numel()
    if n == 0:
        return
    on_device = isinstance(lr, torch.Tensor)
    _check_lr_device(lr, p.device)
    step = _local(step)
    _adamw_kernel[(triton.cdiv(n, _BLOCK),)](
        p, lo, g, m, v, step, lr if on_device else step, step if grad_scale is None else grad_scale,
        0.0 if on_device else float(lr), n, beta1, beta2, _log2(beta1), _log2(beta2), eps, weight_decay,
        LR_ON_DEVICE=on_device, MASTER=master_lo is not None, SCALE=grad_scale is not None, BLOCK=_BLOCK,
        num_warps=_WARPS)


#: torch -> Triton dtypes of the tensors the multi-tensor kernel addresses through its tables.
_TL_DTYPES = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16,
              torch.float64: tl.float64}


@functools.cache
def _triton_dtypes(*dtypes: torch.dtype) -> tuple | None:
    """The Triton dtypes of (g, m, v, step, p), or None where the multi-tensor kernel takes one of them not."""
    out = tuple(_TL_DTYPES.get(d) for d in dtypes)
    return None if any(d is None for d in out) else out


class _Tables:
    """The device tables of one launch group that do not change between steps: ``table`` (int64, tensors x 6:
    the addresses of p, master_lo, exp_avg, exp_avg_sq, step, and the element count) and ``programs`` (int32,
    2 x programs: each program's tensor and block within it), built from ``ptrs`` (the addresses and counts,
    ``table`` flat). ``aligned``: the addresses but the step's are kept as distances from ``table``'s own address
    and the counts as counts of 16, all in 16-byte units (``_table_pointer``); ``entry`` encodes another address so."""

    def __init__(self, ptrs: list[int], device: torch.device, aligned: bool):
        self.table = torch.empty(len(ptrs), dtype=torch.int64, device=device)
        # (the tables' own address is the base: PyTorch's allocators align far more than 16 bytes, but if not, the
        # launch reads raw addresses)
        self.ptrs, self.aligned = ptrs, aligned and self.table.data_ptr() % _ALIGN == 0
        counts = torch.tensor(ptrs[5::6], dtype=torch.int64)
        blocks = (counts + _BLOCK - 1) // _BLOCK
        tensor = torch.repeat_interleave(torch.arange(len(counts)), blocks)
        first = torch.cumsum(blocks, 0) - blocks  # each tensor's first program
        programs = torch.stack([tensor, torch.arange(len(tensor)) - first[tensor]]).to(torch.int32)
        self.n_programs = len(tensor)
        entries = ptrs if not self.aligned else [x if k == 4 else x // 16 if k == 5 else self.entry(x)
                                                 for k, x in zip(itertools.cycle(range(6)), ptrs, strict=False)]
        table = torch.tensor(entries, dtype=torch.int64)
        if device.type == "cuda":
            table, programs = table.pin_memory(), programs.pin_memory()
        self.table.copy_(table, non_blocking=True)
        self.programs = programs.to(device, non_blocking=True)

    def entry(self, address: int) -> int:
        """How the kernel reads ``address`` from this group's tables."""
        return (address - self.table.data_ptr()) // 16 if self.aligned else address


class AdamW(torch.optim.AdamW):
    """``torch.optim.AdamW`` whose step runs the Triton update (one launch per group of tensors, no host sync).

    Args as ``torch.optim.AdamW``: ``params``, ``lr`` (float or 0-dim tensor), ``betas``, ``eps``,
    ``weight_decay``, ``capturable``. Refused: ``amsgrad``, ``maximize``, ``foreach``, ``fused``,
    ``differentiable`` (the kernel implements plain AdamW). State per parameter: ``step`` (0-dim float32 on
    the parameter's device), ``exp_avg``, ``exp_avg_sq`` (the parameter's shape and dtype), as torch's.

    ``master_weights=True``: bf16 parameters get the low bits of an fp32 master in their state
    (``master_lo``) and fp32 moments (see the module docstring); :meth:`init_master_weights_` makes the
    masters from fp32 parameters and casts those to bf16, so no precision is lost at the start.
    """

    def __init__(self, params, lr: float | torch.Tensor = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 1e-2, *, capturable: bool = False,
                 master_weights: bool = False, **unsupported):
        unsupported = {k: v for k, v in unsupported.items() if v}  # torch's defaults (None / False) ask for nothing
        if unsupported:
            raise ValueError(f"kernels.AdamW does not take {sorted(unsupported)} (plain AdamW only); "
                             "use torch.optim.AdamW for those")
        super().__init__(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, capturable=capturable)
        self.master_weights = master_weights
        if master_weights:
            other = sorted({str(p.dtype) for p in self._params() if p.dtype not in (torch.float32, torch.bfloat16)})
            if other:
                raise ValueError(f"kernels.AdamW(master_weights=True) keeps fp32 masters of bf16 parameters only; "
                                 f"got {other}")
        self._grad_scale: torch.Tensor | None = None  # set by clip_grad_norm_, used by the next step
        self._tables: dict[tuple, _Tables] = {}  # launch group -> its device tables (see _launch)

    # ------------------------------------------------------------------------------ mixed precision
    def _params(self) -> list[torch.Tensor]:
        return [p for group in self.param_groups for p in group["params"]]

    def _has_master(self, p: torch.Tensor) -> bool:
        return self.master_weights and p.dtype == torch.bfloat16

    def _master_lo(self, p: torch.Tensor) -> torch.Tensor:
        """The int16 low bits of p's master (zeros, the master being p itself, unless set)."""
        state = self.state[p]
        if "master_lo" not in state:
            state["master_lo"] = torch.zeros_like(p, dtype=torch.int16, memory_format=torch.preserve_format)
        return state["master_lo"]

    @torch.no_grad()
    def init_master_weights_(self, dtype: torch.dtype = torch.bfloat16) -> None:
        """Take each fp32 parameter as its master: the parameter becomes bf16 (its storage replaced, the
        Parameter object kept; plain tensors, not DTensors) and its state keeps the remaining bits."""
        if dtype != torch.bfloat16:
            raise ValueError(f"master weights are kept for bf16 parameters only, not {dtype}")
        self.master_weights = True
        for p in self._params():
            if p.dtype == torch.float32:
                hi, lo = split_master(p.data)
                p.data = hi.view(p.shape)
                self.state[p]["master_lo"] = lo.view(p.shape)

    @torch.no_grad()
    def master_params(self, device: torch.device | str | None = None) -> dict[torch.Tensor, torch.Tensor]:
        """parameter -> its fp32 weights (a new tensor, on ``device`` if given, for a bf16 parameter with a
        master; the parameter itself otherwise)."""
        out = {}
        for p in self._params():
            if self._has_master(p):
                w = join_master(p, self._master_lo(p))
                out[p] = w if device is None else w.to(device)
            else:
                out[p] = p
        return out

    @torch.no_grad()
    def load_masters_(self, weights: dict[torch.Tensor, torch.Tensor]) -> None:
        """Set the fp32 masters (parameter -> fp32 weights): each parameter becomes its weights rounded
        to bf16, its ``master_lo`` the rest."""
        for p, w in weights.items():
            if self._has_master(p):
                hi, lo = split_master(w.to(p.device, torch.float32))
                p.copy_(hi.view(p.shape))
                self._master_lo(p).copy_(lo.view(p.shape))

    @torch.no_grad()
    def accumulate_grads_(self) -> None:
        """Add each low-precision parameter's gradient to its fp32 sum and clear it (call after every
        micro-batch's backward when accumulating): the sum is what ``clip_grad_norm_`` and ``step`` use.
        fp32 parameters are left alone (autograd already accumulates their gradients in fp32)."""
        for p in self._params():
            if p.grad is not None and self._has_master(p):
                state = self.state[p]
                if "grad_sum" in state:
                    state["grad_sum"].add_(p.grad)
                else:
                    state["grad_sum"] = p.grad.float()
                p.grad = None

    def _grad(self, p: torch.Tensor) -> torch.Tensor | None:
        """The gradient a step uses: the fp32 sum of accumulated micro-batches, else ``p.grad``."""
        return self.state[p]["grad_sum"] if "grad_sum" in self.state.get(p, {}) else p.grad

    @torch.no_grad()
    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        """The global L2 norm of the gradients (fp32, over every rank's shards; no host sync), as
        ``torch.nn.utils.clip_grad_norm_`` computes it; the next ``step`` scales the gradients by
        ``min(1, max_norm / (norm + 1e-6))`` inside the kernel."""
        grads = [g for g in (self._grad(p) for p in self._params()) if g is not None]
        if not grads:
            return torch.zeros(())
        if any(hasattr(g, "to_local") for g in grads):  # DTensor shards: torch reduces the partial norms
            norm = torch.nn.utils.get_total_norm(grads, 2.0, foreach=True)
            norm = norm.full_tensor() if hasattr(norm, "full_tensor") else norm
        else:
            norms = torch._foreach_norm(grads, 2, dtype=torch.float32)
            norm = torch.linalg.vector_norm(torch.stack(norms))
        self._grad_scale = torch.clamp(max_norm / (norm + 1e-6), max=1.0).to(torch.float32)
        return norm

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p in self._params():
            self.state.get(p, {}).pop("grad_sum", None)
        super().zero_grad(set_to_none)

    def load_state_dict(self, state_dict: dict) -> None:
        """torch's, keeping the fp32 moments of bf16 parameters fp32 and ``master_lo`` int16 (torch casts every
        state tensor to its parameter's dtype), and the current ``master_lo`` where the loaded state has none
        (a checkpoint keeps the masters as the model's weights: see ``master_params``)."""
        saved_ids = [i for group in state_dict["param_groups"] for i in group["params"]]
        kept = {}
        for saved_id, p in zip(saved_ids, self._params(), strict=False):
            if not self._has_master(p):
                continue
            state = state_dict["state"].get(saved_id, {})
            kept[p] = {k: v for k, v in state.items() if k != "step" and isinstance(v, torch.Tensor)}
            if "master_lo" not in kept[p] and "master_lo" in self.state.get(p, {}):
                kept[p]["master_lo"] = self.state[p]["master_lo"]
        super().load_state_dict(state_dict)
        for p, tensors in kept.items():
            for k, v in tensors.items():
                self.state[p][k] = v.to(device=p.device)

    # ------------------------------------------------------------------------------------------ step
    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        scale, self._grad_scale = self._grad_scale, None
        grads = {p: g for p in self._params() if (g := self._grad(p)) is not None}  # each looked up once
        with_grad = list(grads)
        if with_grad and not all(use_triton(_local(p)) for p in with_grad):
            self._reference_step(with_grad, scale)
            return loss
        for i, group in enumerate(self.param_groups):  # every check first: an error leaves nothing half-stepped
            params = [p for p in group["params"] if p in grads]
            refused = [k for k in ("amsgrad", "maximize", "differentiable") if group.get(k)]
            if refused and params:  # add_param_group / state dict
                raise ValueError(f"kernels.AdamW: param group {i} sets {refused}; plain AdamW only")
            for p in params:
                _check_layout(p, grads[p], self.state.get(p, {}))
                _check_lr_device(self._lr(group, [p]), _local(p).device)  # (a host tensor: read as a float)
        capturing = bool(with_grad) and with_grad[0].device.type == "cuda" and torch.cuda.is_current_stream_capturing()
        index = {id(group): i for i, group in enumerate(self.param_groups)}
        launches: dict[tuple, list[tuple[torch.Tensor, ...]]] = {}  # launch group -> (p, lo, g, m, v, step) each
        groups: dict[int, tuple[dict, float | torch.Tensor]] = {}
        for group, params in self._prepare(with_grad):
            lr = self._lr(group, params)
            groups[index[id(group)]] = group, lr
            beta1, beta2 = group["betas"]
            for p in params:
                state, grad = self.state[p], grads[p]
                grad = grad if grad.stride() == p.stride() else torch.empty_like(p, dtype=grad.dtype).copy_(grad)
                lo = state.get("master_lo")
                tensors = (p, p if lo is None else lo, grad, state["exp_avg"], state["exp_avg_sq"], state["step"])
                if hasattr(p, "to_local"):  # DTensor shards: their local tensors
                    tensors = tuple(_local(t) for t in tensors)
                if tensors[0].numel() == 0:
                    continue
                dtypes = _triton_dtypes(*(t.dtype for t in tensors[2:] + tensors[:1]))
                aligned = _aligned(tensors)
                if capturing or dtypes is None or (tensors[0].numel() > MULTI_TENSOR_MAX_NUMEL and not aligned):
                    adamw_update_(p, grad, state["exp_avg"], state["exp_avg_sq"], state["step"], lr, beta1, beta2,
                                  group["eps"], group["weight_decay"], master_lo=lo, grad_scale=scale)
                    continue
                key = (index[id(group)], tensors[0].device, lo is not None, aligned, *dtypes)
                launches.setdefault(key, []).append(tensors)
        for key, tensors in launches.items():
            self._launch(key, tensors, *groups[key[0]], scale)
        return loss

    def _launch(self, key: tuple, tensors: list[tuple[torch.Tensor, ...]], group: dict, lr: float | torch.Tensor,
                scale: torch.Tensor | None) -> None:
        """One ``_adamw_multi_kernel`` launch over ``tensors`` ((p, lo, g, m, v, step) each, local shards, one
        param group, device, set of dtypes and alignment). Parameter, moment and step addresses stay put between steps,
        so their table (and the per-program table) is kept and rebuilt only when one of them changes (a
        storage replaced, a parameter without a gradient this step); the gradient table is built each step,
        copied from pinned memory without a host sync."""
        _, device, master, aligned, g_dtype, m_dtype, v_dtype, step_dtype, p_dtype = key
        ptrs = [x for p, lo, _, m, v, step in tensors
                for x in (p.data_ptr(), lo.data_ptr(), m.data_ptr(), v.data_ptr(), step.data_ptr(), p.numel())]
        tables = self._tables.get(key)
        if tables is None or tables.ptrs != ptrs:
            tables = self._tables[key] = _Tables(ptrs, device, aligned)
        g_table = torch.tensor([tables.entry(t[2].data_ptr()) for t in tensors], dtype=torch.int64,
                               pin_memory=device.type == "cuda")
        g_table = g_table.to(device, non_blocking=True)
        beta1, beta2 = group["betas"]
        on_device = isinstance(lr, torch.Tensor)
        _adamw_multi_kernel[(tables.n_programs,)](
            tables.table, g_table, tables.programs, tables.table.view(torch.uint8), tables.n_programs,
            lr if on_device else g_table,
            g_table if scale is None else scale, 0.0 if on_device else float(lr), beta1, beta2, _log2(beta1),
            _log2(beta2), group["eps"], group["weight_decay"], P_DTYPE=p_dtype, G_DTYPE=g_dtype, M_DTYPE=m_dtype,
            V_DTYPE=v_dtype, STEP_DTYPE=step_dtype, LR_ON_DEVICE=on_device, MASTER=master, SCALE=scale is not None,
            ALIGNED=tables.aligned, BLOCK=_BLOCK, num_warps=_WARPS)

    def _init_state(self, p: torch.Tensor) -> None:
        """torch's layout: step on the device (as with capturable), moments like p (fp32 for a master's)."""
        state = self.state[p]
        if self._has_master(p):
            self._master_lo(p)
        if "step" not in state:
            dtype = torch.float32 if self._has_master(p) else None
            state["step"] = torch.zeros((), dtype=torch.float32, device=p.device)
            state["exp_avg"] = torch.zeros_like(p, dtype=dtype, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(p, dtype=dtype, memory_format=torch.preserve_format)
        elif state["step"].device != p.device:  # a state dict loaded from torch's AdamW keeps it on the CPU
            state["step"] = state["step"].to(device=p.device, dtype=torch.float32)

    @torch.no_grad()
    def init_state_(self) -> None:
        """Make every parameter's state (zero moments, step 0) without stepping: the layout a checkpoint
        is loaded into."""
        for p in self._params():
            self._init_state(p)

    def _prepare(self, with_grad: list[torch.Tensor]) -> list[tuple[dict, list[torch.Tensor]]]:
        """Per group: (group, its parameters with a gradient), their state made and steps advanced."""
        out, ids = [], {id(p) for p in with_grad}
        for group in self.param_groups:
            params = [p for p in group["params"] if id(p) in ids]
            if not params:
                continue
            for p in params:
                self._init_state(p)
            steps = [self.state[p]["step"] for p in params]
            torch._foreach_add_(steps, 1.0)
            out.append((group, params))
        return out

    @staticmethod
    def _lr(group: dict, params: list[torch.Tensor]) -> float | torch.Tensor:
        lr = group["lr"]
        if isinstance(lr, torch.Tensor) and lr.device.type == "cpu" and params[0].device.type != "cpu":
            lr = lr.item()  # a host tensor (torch.distributed.checkpoint makes one): read without a GPU sync
        return lr

    def _reference_step(self, with_grad: list[torch.Tensor], scale: torch.Tensor | None) -> None:
        """Where the kernel cannot run: torch's AdamW, or the kernel's arithmetic in PyTorch for master
        weights and accumulated or scaled gradients (which torch's AdamW does not have)."""
        plain = not self.master_weights and not any("grad_sum" in self.state.get(p, {}) for p in with_grad)
        if plain:
            if scale is not None:
                torch._foreach_mul_([p.grad for p in with_grad], scale.to(with_grad[0].grad.device))
            super().step()
            return
        for group, params in self._prepare(with_grad):
            lr = group["lr"].item() if isinstance(group["lr"], torch.Tensor) else group["lr"]
            beta1, beta2 = group["betas"]
            for p in params:
                state = self.state[p]
                adamw_reference_(_local(p), _local(self._grad(p)), _local(state["exp_avg"]),
                                 _local(state["exp_avg_sq"]), _local(state["step"]), lr, beta1, beta2, group["eps"],
                                 group["weight_decay"],
                                 master_lo=_local(state["master_lo"]) if "master_lo" in state else None,
                                 grad_scale=scale)
