"""Plumbing shared by every kernel family: when Triton runs, launch sizing, dtype helpers.

Dispatch rule (one place, used by every public op):

* CUDA tensors always run the Triton kernels.
* CPU tensors run the pure-PyTorch reference, unless ``TRITON_INTERPRET=1`` was set before
  ``kernels`` was imported; then the Triton kernels themselves run through Triton's interpreter.
  That is how the CPU test-suite and CI exercise the real kernel code.

Every op is registered in the ``ligermodels`` namespace, so ``torch.compile`` sees it as one custom
op (no graph break): most as a ``torch.library.triton_op`` (Inductor knows it launches Triton
kernels); the FLCE loops and the RMSNorm backward as an opaque ``torch.library.custom_op`` (see
those modules for why). In plain eager mode :class:`EagerOp` calls the op's Python body directly,
skipping the dispatcher's host time.
"""

from __future__ import annotations

import contextlib
import functools
import math
import os

import torch
import triton

#: True when Triton kernels run on the CPU through the interpreter (read once, at import).
INTERPRET: bool = os.environ.get("TRITON_INTERPRET", "0") == "1"

#: Namespace of every custom op this package registers (``torch.ops.ligermodels.*``).
LIB = "ligermodels"


def use_triton(x: torch.Tensor) -> bool:
    """Whether an op on ``x`` runs the Triton kernels (True) or the PyTorch reference (False)."""
    if x.device.type == "cuda":
        return True
    return INTERPRET and x.device.type == "cpu"


@functools.cache
def _multiprocessors(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def sm_count(device: torch.device) -> int:
    """Multiprocessors of a CUDA ``device`` (cached); 3 elsewhere (the interpreter: a few programs, each taking
    several rows)."""
    if device.type != "cuda":
        return 3
    return _multiprocessors(device.index if device.index is not None else torch.cuda.current_device())


def needs_capability(device: torch.device, least: tuple[int, int], what: str) -> str | None:
    """None when ``device`` is not CUDA or has compute capability ``least`` or newer; else one line saying that
    ``what`` needs it and what this GPU has."""
    if device.type != "cuda":
        return None
    have = torch.cuda.get_device_capability(device)
    if tuple(have) >= least:
        return None
    return (f"{what} needs a GPU of compute capability {least[0]}.{least[1]} or newer; "
            f"{torch.cuda.get_device_name(device)} is {have[0]}.{have[1]}")


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype a reference computes in: float32, or float64 when the input is float64."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def row_block(n: int) -> int:
    """Power-of-two block covering a row of ``n`` elements (Triton blocks must be powers of two)."""
    return triton.next_power_of_2(max(int(n), 1))


def row_warps(block: int) -> int:
    """Warps for a one-row-per-program kernel: enough threads to issue 16-byte loads over the row."""
    if block >= 16384:
        return 16
    if block >= 4096:
        return 8
    if block >= 1024:
        return 4
    return 2 if block >= 256 else 1


def n_rows(x: torch.Tensor) -> int:
    """Rows of ``x`` seen as (rows, last_dim): the product of the leading dims. Spelled out rather than
    ``-1``, which a view cannot infer when the last dim is 0."""
    return math.prod(x.shape[:-1])


def unit_last(x: torch.Tensor) -> torch.Tensor:
    """``x`` itself when its last dim is unit-stride (what the kernels need), else a contiguous copy."""
    return x if x.stride(-1) == 1 else x.contiguous()


def as_rows(x: torch.Tensor) -> torch.Tensor:
    """View ``x`` as (rows, last_dim) with a unit last stride, copying only if it cannot be viewed."""
    if x.dim() == 0:
        raise ValueError("expected a tensor with at least one dimension")
    if x.stride(-1) != 1:
        x = x.contiguous()
    try:
        return x.view(n_rows(x), x.shape[-1])
    except RuntimeError:
        return x.reshape(n_rows(x), x.shape[-1])


def check_same_device(*tensors: torch.Tensor) -> None:
    """Raise a clear error when tensors of one op live on different devices."""
    devs = {t.device for t in tensors if t is not None}
    if len(devs) > 1:
        raise ValueError(f"all tensors must be on one device, got {sorted(map(str, devs))}")


def check_floating(op: str, **tensors: torch.Tensor | None) -> None:
    """Raise ValueError naming the argument when a tensor is not floating point: the kernels would
    compute in fp32 and round the result to an integer dtype, a silently wrong answer."""
    for name, t in tensors.items():
        if t is not None and not t.dtype.is_floating_point:
            raise ValueError(f"{op}: {name} must be a floating-point tensor, got {t.dtype}")


class EagerOp:
    """A registered op (``torch.library.triton_op`` or ``custom_op``) whose calls in plain eager mode run its
    Python body directly; ``@eager_op`` above the op's decorator makes one.

    Why: a call through the dispatcher costs host time that a step of small kernels cannot hide. On an H200 host
    (torch 2.11, triton 3.6) launching the RMSNorm forward took 99 us through its op, 32 us as a bare Triton
    launch, against 18 us for a cuBLAS GEMM; a decoder step makes several hundred such calls.

    The registered op still runs whenever something must see it: under ``torch.compile`` (Dynamo reads
    ``is_compiling()`` as a constant and traces the op), under any ``TorchDispatchMode`` (fake tensors,
    ``make_fx``, selective activation checkpointing's caching mode, which saves ops by name), and for tensor
    subclasses (DTensor) or meta tensors. What the body skips is the dispatcher's bookkeeping, which for these
    ops is the version counter of a mutated argument: bumped here as the dispatcher would. Attributes
    (``register_fake``, ...) are the op's."""

    def __init__(self, op):
        self.op = op
        self.body = getattr(op, "_init_fn", None)  # what the op's backend runs (a triton_op's: wrap_triton off)
        overload = getattr(op, "_opoverload", None)
        if self.body is None or overload is None:  # another torch: always the op
            self.body, self.mutated = None, ()
            return
        arguments = overload._schema.arguments
        self.mutated = tuple((i, a.name) for i, a in enumerate(arguments)
                             if a.alias_info is not None and a.alias_info.is_write)

    def __getattr__(self, name: str):
        return getattr(self.op, name)

    def __call__(self, *args, **kwargs):
        if torch.compiler.is_compiling() or self.body is None or not _plain_eager(args, kwargs):
            return self.op(*args, **kwargs)
        out = self.body(*args, **kwargs)
        for i, name in self.mutated:
            torch.autograd.graph.increment_version(args[i] if i < len(args) else kwargs[name])
        return out


def eager_op(op) -> EagerOp:
    """Decorator form of :class:`EagerOp`."""
    return EagerOp(op)


_PLAIN = (torch.Tensor, torch.nn.Parameter)


def _plain_eager(args: tuple, kwargs: dict) -> bool:
    """No dispatch mode is active and every tensor argument is a plain tensor on a real device."""
    if torch._C._len_torch_dispatch_stack():
        return False
    for a in (*args, *kwargs.values()):
        if isinstance(a, torch.Tensor) and (type(a) not in _PLAIN or a.device.type == "meta"):
            return False
    return True


class _KernelsOnFirstRead(list):
    """The Triton kernels a registered op launches, found (``find(fn)``) the first time the list is read."""

    def __init__(self, find, fn):
        super().__init__()
        self._pending = (find, fn)

    def _found(self) -> list:
        if self._pending is not None:
            find, fn = self._pending
            self._pending = None
            self.extend(find(fn))
        return self

    def __iter__(self):
        return list.__iter__(self._found())

    def __len__(self) -> int:
        return list.__len__(self._found())

    def __getitem__(self, i):
        return list.__getitem__(self._found(), i)

    def __contains__(self, x) -> bool:
        return list.__contains__(self._found(), x)

    def __repr__(self) -> str:
        return list.__repr__(self._found())


@contextlib.contextmanager
def kernels_found_on_first_read():
    """While this package's ops register: the kernels each ``torch.library.triton_op`` launches are found when first
    read, not at registration.

    Why: at registration, torch (2.13) reads the source of the op and of every function it calls, recursively, and
    imports torch._inductor to do so, only to fill the list that torch.compile's AOTAutograd cache reads when it keys
    a compiled graph. Every process importing ``kernels`` paid it: on a 2-core CPU ``import ligermodels.train.loop``
    took 4.3-5.9 s with it and 2.9-3.5 s without, and a 3-step demo run 7.6-8.0 s against 6.6-7.6 s. The list is the
    same; it is built when the cache first reads it. Where torch has no such function, nothing changes."""
    try:
        import torch._library.triton as library_triton
    except ImportError:
        library_triton = None
    find = getattr(library_triton, "get_inner_triton_kernels", None)
    if find is None:
        yield
        return
    library_triton.get_inner_triton_kernels = lambda fn: _KernelsOnFirstRead(find, fn)
    try:
        yield
    finally:
        library_triton.get_inner_triton_kernels = find
