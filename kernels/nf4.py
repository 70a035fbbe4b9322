"""NF4 weights: QLoRA's 4-bit NormalFloat storage of a frozen projection, dequantised by one pass before each GEMM.

A weight W (N, K) is stored as one or more *parts* (the Hugging Face tensors it is made of: q, k and v of a fused
q/k/v projection), each quantised on its own exactly as bitsandbytes' ``quantize_4bit(..., blocksize=64,
quant_type="nf4", compress_statistics=True)`` does, so that a checkpoint quantised here and by transformers +
bitsandbytes holds the same bits:

* the part, flattened, in blocks of 64 elements: ``absmax_b = max |w|`` over the block (fp32), each element scaled by
  ``1 / absmax_b`` (fp32) and mapped to the nearest of the 16 NF4 values (:data:`NF4_VALUES`; a value exactly
  between two goes to the lower), two 4-bit codes a byte, the first element in the high nibble;
* double quantisation of the block maxima: ``offset = mean(absmax)`` (one fp32 per part), ``absmax - offset`` in
  groups of 256 blocks, each group scaled by its own fp32 maximum ``absmax2_g`` and mapped to the nearest of the 256
  values of bitsandbytes' signed dynamic 8-bit map (:func:`dynamic_map`).

Dequantising element i of block b in group g: ``w = NF4[code_i] * (DYN[q_b] * absmax2_g + offset)``, every
operation in fp32 (the multiply and the add rounded separately, as bitsandbytes does), then rounded once to the
compute dtype. Storage: 4 bits an element plus 8 bits per 64 (the quantised maxima) plus 32 per 16384: 4.127 bits a
parameter.

:class:`NF4Tensor` holds those tensors behind the shape and dtype of the dense weight: any op on it (``F.linear``,
``x @ W``, a Triton op) first dequantises it (:func:`dequantize_nf4`, one Triton pass: 0.5 byte read and 2 written
an element) into a temporary that the op consumes, so no bf16 copy outlives the GEMM that reads it and autograd
saves the 4-bit tensor, not a dense one. Ops that would write into it are refused. It flattens into its inner
tensors for ``torch.compile`` (the dequantisation is the custom op ``ligermodels::nf4_dequantize``). Under FSDP2 its
bytes travel as one flat bf16 tensor (:func:`to_storage`, :func:`from_storage`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import triton
import triton.language as tl
from torch.library import triton_op, wrap_triton
from torch.utils._pytree import tree_map_only

from kernels._common import LIB, eager_op, needs_capability, use_triton

#: QLoRA's NF4 values (the quantiles of a standard normal, rescaled to [-1, 1], with an exact zero), as bitsandbytes
#: stores them.
NF4_VALUES = (-1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453, -0.28444138169288635,
              -0.18477343022823334, -0.09105003625154495, 0.0, 0.07958029955625534, 0.16093020141124725,
              0.24611230194568634, 0.33791524171829224, 0.44070982933044434, 0.5626170039176941,
              0.7229568362236023, 1.0)
#: Elements per quantisation block, block maxima per double-quantisation group (bitsandbytes' QLoRA defaults).
BLOCK, GROUP = 64, 256
#: Most parts a weight may be made of (q, k and v; gate and up).
MAX_PARTS = 4
_CHUNK = 1 << 24  # quantisation works over at most this many elements at once (bounds its temporaries)
_DEQUANT_BYTES = 1024  # packed bytes (2048 elements) per dequantisation program

_TABLES: dict[tuple[str, torch.device], torch.Tensor] = {}


def dynamic_map() -> torch.Tensor:
    """bitsandbytes' signed dynamic 8-bit map (``create_dynamic_map(signed=True)``), 256 fp32 values in ascending
    order: for each decade e = -6..0, the midpoints of 2^(e+6) + 1 evenly spaced points over [0.1, 1] times 10^e,
    with both signs, then 0 and 1."""
    values = []
    for i in range(7):
        edges = torch.linspace(0.1, 1, 2 ** i + 1, dtype=torch.float32)
        mids = (edges[:-1] + edges[1:]) / 2.0
        values += [(10 ** (i - 6)) * mids, -(10 ** (i - 6)) * mids]
    values += [torch.tensor([0.0, 1.0])]
    return torch.sort(torch.cat(values)).values


def _table(name: str, device: torch.device) -> torch.Tensor:
    """The NF4 values or the dynamic map (fp32) on ``device``, built once per device."""
    key = (name, device)
    if key not in _TABLES:
        _TABLES[key] = (torch.tensor(NF4_VALUES, dtype=torch.float32) if name == "nf4" else dynamic_map()).to(device)
    return _TABLES[key]


def _bucket(scaled: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """Index of the nearest value of ascending ``table`` to each fp32 value, ties to the lower one (the midpoints
    computed in fp32, as bitsandbytes computes them)."""
    return torch.bucketize(scaled, (table[:-1] + table[1:]) / 2, out_int32=True).to(torch.uint8)


def _blockwise(flat: torch.Tensor, size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(per-block maxima of |flat| (fp32), flat times its block's 1 / maximum (fp32), clamped to [-1, 1]) for blocks
    of ``size`` consecutive elements, the last one possibly short. An all-zero block keeps maximum 0."""
    n = flat.numel()
    blocks = torch.nn.functional.pad(flat, (0, -n % size)).view(-1, size)
    absmax = blocks.abs().amax(dim=1)
    scaled = blocks * (1.0 / absmax.clamp(min=1e-38))[:, None]
    return absmax, scaled.view(-1)[:n].clamp_(-1, 1)


def _quantize_part(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(packed uint8 (n/2,), quantised block maxima uint8 (blocks,), group maxima fp32 (groups,), offset fp32 ())
    of one part (any float dtype, read as fp32), in chunks of whole blocks to bound the temporaries."""
    flat = w.reshape(-1)
    if flat.numel() % 2:
        raise ValueError(f"NF4: a part of {flat.numel()} elements (odd) cannot be packed two to a byte")
    nf4 = _table("nf4", w.device)
    packed, absmax = [], []
    for start in range(0, flat.numel(), _CHUNK):
        am, scaled = _blockwise(flat[start:start + _CHUNK].float(), BLOCK)
        codes = _bucket(scaled, nf4)
        packed.append((codes[0::2] << 4) | codes[1::2])
        absmax.append(am)
    absmax = torch.cat(absmax)
    offset = absmax.mean()
    amax2, scaled2 = _blockwise(absmax - offset, GROUP)
    return torch.cat(packed), _bucket(scaled2, _table("dyn", w.device)), amax2, offset


# --------------------------------------------------------------------------------------- kernel
@triton.jit
def _nf4_dequant_kernel(packed_ptr, qabs_ptr, amax2_ptr, offset_ptr, starts_ptr, tables_ptr, out_ptr, n_bytes,
                        PARTS: tl.constexpr, BLOCK_BYTES: tl.constexpr):
    """BLOCK_BYTES packed bytes -> 2 * BLOCK_BYTES consecutive elements of the flat weight. ``starts`` (PARTS, 3)
    int64: each part's first element, first block and first group; parts hold an even number of elements, so a
    byte never straddles two. ``tables``: the 16 NF4 values, then the 256 of the dynamic map."""
    b = tl.program_id(0).to(tl.int64) * BLOCK_BYTES + tl.arange(0, BLOCK_BYTES)
    mask = b < n_bytes
    e = 2 * b  # the byte's first element
    part = tl.zeros([BLOCK_BYTES], dtype=tl.int32)
    for p in tl.static_range(1, PARTS):
        part += (e >= tl.load(starts_ptr + 3 * p)).to(tl.int32)
    local = e - tl.load(starts_ptr + 3 * part, mask=mask, other=0)
    blk = local // 64
    grp = tl.load(starts_ptr + 3 * part + 2, mask=mask, other=0) + blk // 256
    blk += tl.load(starts_ptr + 3 * part + 1, mask=mask, other=0)
    dyn = tl.load(tables_ptr + 16 + tl.load(qabs_ptr + blk, mask=mask, other=0).to(tl.int32))
    scaled = dyn * tl.load(amax2_ptr + grp, mask=mask, other=0.0)
    absmax = scaled + tl.load(offset_ptr + part, mask=mask, other=0.0)
    byte = tl.load(packed_ptr + b, mask=mask, other=0).to(tl.int32)
    hi = tl.load(tables_ptr + (byte >> 4)) * absmax
    lo = tl.load(tables_ptr + (byte & 15)) * absmax
    vals = tl.reshape(tl.join(hi, lo), (2 * BLOCK_BYTES,)).to(out_ptr.dtype.element_ty)
    offs = tl.program_id(0).to(tl.int64) * (2 * BLOCK_BYTES) + tl.arange(0, 2 * BLOCK_BYTES)
    tl.store(out_ptr + offs, vals, mask=offs < 2 * n_bytes)


@eager_op
@triton_op(f"{LIB}::nf4_dequantize", mutates_args={})
def _dequantize(packed: torch.Tensor, qabs: torch.Tensor, absmax2: torch.Tensor, offset: torch.Tensor,
                starts: torch.Tensor, tables: torch.Tensor, rows: int, cols: int, dtype: torch.dtype) -> torch.Tensor:
    """The dense (rows, cols) weight in ``dtype`` from its NF4 tensors (module docstring)."""
    out = torch.empty((rows, cols), dtype=dtype, device=packed.device)
    n_bytes = packed.numel()
    if n_bytes:
        # enable_fp_fusion off: the maxima's multiply and add round separately, as bitsandbytes' do
        wrap_triton(_nf4_dequant_kernel)[(triton.cdiv(n_bytes, _DEQUANT_BYTES),)](
            packed, qabs, absmax2, offset, starts, tables, out, n_bytes, PARTS=starts.shape[0],
            BLOCK_BYTES=_DEQUANT_BYTES, num_warps=4, enable_fp_fusion=False)
    return out


def dequantize_reference(packed: torch.Tensor, qabs: torch.Tensor, absmax2: torch.Tensor, offset: torch.Tensor,
                         starts: torch.Tensor, tables: torch.Tensor, rows: int, cols: int,
                         dtype: torch.dtype) -> torch.Tensor:
    """:func:`_dequantize` in PyTorch (fp32 arithmetic, then ``dtype``: float64 included)."""
    n = rows * cols
    st = starts.tolist() + [[n, qabs.numel(), absmax2.numel()]]
    blocks = []
    for p in range(len(st) - 1):
        (e0, b0, g0), (e1, b1, _) = st[p], st[p + 1]
        local = torch.arange(b1 - b0, device=packed.device)
        am = tables[16:][qabs[b0:b1].long()] * absmax2[g0 + local // GROUP] + offset[p]
        blocks.append(am.repeat_interleave(BLOCK)[:e1 - e0])
    absmax = torch.cat(blocks)
    codes = torch.stack([packed >> 4, packed & 15], dim=1).reshape(-1).long()
    return (tables[codes] * absmax).to(dtype).view(rows, cols)


# ---------------------------------------------------------------------------------------- tensor
_aten = torch.ops.aten
_INNER = ("packed", "qabs", "absmax2", "offset", "starts", "tables")
_KEEP = {_aten.detach.default, _aten.alias.default, _aten.clone.default}


class NF4Tensor(torch.Tensor):
    """A frozen (N, K) weight in NF4 (module docstring) that reads as a dense tensor of its compute ``dtype``.

    Inner tensors: ``packed`` uint8 (N*K/2,), ``qabs`` uint8 (blocks,), ``absmax2`` fp32 (groups,), ``offset`` fp32
    (parts,), ``starts`` int64 (parts, 3), ``tables`` fp32 (272,): the NF4 values and the dynamic map, as
    bitsandbytes keeps its ``quant_map`` and ``nested_quant_map`` with each weight. Never requires grad."""

    @staticmethod
    def __new__(cls, packed, qabs, absmax2, offset, starts, tables, shape, dtype):
        return torch.Tensor._make_wrapper_subclass(cls, shape, dtype=dtype, device=packed.device, requires_grad=False)

    def __init__(self, packed, qabs, absmax2, offset, starts, tables, shape, dtype):
        self.packed, self.qabs, self.absmax2, self.offset, self.starts = packed, qabs, absmax2, offset, starts
        self.tables = tables

    def __repr__(self) -> str:
        return (f"NF4Tensor(shape={tuple(self.shape)}, dtype={self.dtype}, device={self.device}, "
                f"parts={len(self.offset)})")

    def __tensor_flatten__(self):
        return list(_INNER), (tuple(self.shape), self.dtype)

    @staticmethod
    def __tensor_unflatten__(inner, meta, outer_size, outer_stride):
        return NF4Tensor(*(inner[k] for k in _INNER), meta[0], meta[1])

    def _map(self, fn) -> NF4Tensor:
        return NF4Tensor(*(fn(getattr(self, k)) for k in _INNER), self.shape, self.dtype)

    def dequantize(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        """The dense (N, K) weight in ``dtype`` (default: this tensor's)."""
        args = (*(getattr(self, k) for k in _INNER), self.shape[0], self.shape[1], dtype or self.dtype)
        if use_triton(self.packed) and (dtype or self.dtype) != torch.float64:
            return _dequantize(*args)
        return dequantize_reference(*args)

    def nbytes_stored(self) -> int:
        """Bytes its inner tensors take."""
        return sum(getattr(self, k).numel() * getattr(self, k).element_size() for k in _INNER)

    __torch_function__ = torch._C._disabled_torch_function_impl

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _KEEP:
            return args[0]._map(func)
        if func is _aten._to_copy.default:
            dtype = kwargs.get("dtype")
            if dtype is None or dtype == args[0].dtype:
                device = kwargs.get("device") or args[0].device
                return args[0]._map(lambda t: t.to(device))
            raise TypeError(f"an NF4 weight does not cast to {dtype}: call .dequantize({dtype}) for a dense copy")
        if any(isinstance(args[i], NF4Tensor) for i in _written(func) if i < len(args)):
            raise RuntimeError(f"{func}: an NF4 weight is frozen 4-bit storage and cannot be written in place; "
                               "call .dequantize() for a dense copy")
        args = tuple(a.dequantize() if isinstance(a, NF4Tensor) else a for a in args)
        if kwargs:
            kwargs = tree_map_only(NF4Tensor, lambda t: t.dequantize(), kwargs)
        return func(*args, **kwargs)


_WRITTEN: dict = {}


def _written(func) -> tuple[int, ...]:
    """The positions of the arguments ``func`` writes into (from its schema, looked up once per op)."""
    if func not in _WRITTEN:
        _WRITTEN[func] = tuple(i for i, a in enumerate(func._schema.arguments)
                               if a.alias_info is not None and a.alias_info.is_write)
    return _WRITTEN[func]


def quantize_nf4(weight: torch.Tensor, part_rows: Sequence[int] | None = None,
                 dtype: torch.dtype | None = None) -> NF4Tensor:
    """``weight`` (N, K) as an :class:`NF4Tensor` whose parts are its consecutive row blocks of ``part_rows`` rows
    (default: one part), each quantised as bitsandbytes quantises a tensor on its own (module docstring).

    Args:
        weight: (N, K) float; read as fp32 (quantise the tensor that a bf16 model holds, as transformers does).
        part_rows: the rows of each part, summing to N (at most :data:`MAX_PARTS` parts).
        dtype: the dense dtype it reads as (default ``weight``'s).
    """
    if weight.dim() != 2 or not weight.is_floating_point():
        raise ValueError(f"quantize_nf4: weight must be a 2-D float tensor, got {tuple(weight.shape)} {weight.dtype}")
    part_rows = [weight.shape[0]] if part_rows is None else [int(r) for r in part_rows]
    if sum(part_rows) != weight.shape[0] or any(r <= 0 for r in part_rows) or len(part_rows) > MAX_PARTS:
        raise ValueError(f"quantize_nf4: part_rows {part_rows} must be at most {MAX_PARTS} positive row counts "
                         f"summing to {weight.shape[0]}")
    pieces, starts, row = [], [], 0
    for rows in part_rows:
        part = _quantize_part(weight[row:row + rows])
        starts.append([row * weight.shape[1]] + [sum(p[i].numel() for p in pieces) for i in (1, 2)])
        pieces.append(part)
        row += rows
    packed, qabs, amax2, offset = (torch.cat([p[i].reshape(-1) for p in pieces]) for i in range(4))
    starts = torch.tensor(starts, dtype=torch.int64, device=weight.device)
    tables = torch.cat([_table("nf4", weight.device), _table("dyn", weight.device)])
    return NF4Tensor(packed, qabs, amax2, offset, starts, tables, weight.shape, dtype or weight.dtype)


def dequantize_nf4(weight: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """``weight`` dense: an :class:`NF4Tensor` dequantised into ``dtype`` (default its own), any other tensor as
    it is."""
    return weight.dequantize(dtype) if isinstance(weight, NF4Tensor) else weight


def nf4_supported(device: torch.device) -> str | None:
    """None when NF4 weights run on ``device``; else why not: the dequantisation kernel writes bf16, which Triton
    supports on CUDA from compute capability 8.0. The CPU runs the PyTorch reference."""
    return needs_capability(device, (8, 0), "the NF4 kernels (Ampere, Hopper)")


# --------------------------------------------------------------------------------- FSDP2 storage
#: The order and byte alignment of an NF4 weight's inner tensors in one flat buffer (:func:`to_storage`).
_STORAGE = (("starts", 8), ("absmax2", 4), ("offset", 4), ("tables", 4), ("qabs", 1), ("packed", 1))


def to_storage(t: NF4Tensor) -> tuple[torch.Tensor, tuple]:
    """An NF4 weight as one flat bf16 tensor holding its inner tensors' bytes (each aligned to its element size),
    and the layout :func:`from_storage` reads it back with. FSDP2 shards and all-gathers a plain tensor: bf16, so
    that its mixed-precision cast (to bf16, or none) leaves the bytes as they are (bitsandbytes' ``quant_storage``
    serves FSDP + QLoRA the same way)."""
    pieces, layout, offset = [], [], 0
    for name, align in _STORAGE:
        inner = getattr(t, name).contiguous()
        pad = -offset % align
        pieces.append(torch.zeros(pad, dtype=torch.uint8, device=inner.device))
        offset += pad
        raw = inner.view(-1).view(torch.uint8)
        layout.append((name, inner.dtype, tuple(inner.shape), offset))
        pieces.append(raw)
        offset += raw.numel()
    pieces.append(torch.zeros(offset % 2, dtype=torch.uint8, device=t.device))
    return torch.cat(pieces).view(torch.bfloat16), (tuple(t.shape), t.dtype, tuple(layout))


def from_storage(buffer: torch.Tensor, layout: tuple) -> NF4Tensor:
    """The NF4 weight whose inner tensors are views of ``buffer`` (:func:`to_storage`'s; no copy)."""
    shape, dtype, pieces = layout
    raw = buffer.view(torch.uint8)
    inner = {}
    for name, inner_dtype, inner_shape, offset in pieces:
        size = inner_dtype.itemsize * math.prod(inner_shape)
        piece = raw[offset:offset + size]
        try:
            inner[name] = piece.view(inner_dtype).view(inner_shape)
        except RuntimeError:  # the buffer itself not aligned to the dtype: a copy
            inner[name] = piece.clone().view(inner_dtype).view(inner_shape)
    return NF4Tensor(*(inner[k] for k in _INNER), shape, dtype)
