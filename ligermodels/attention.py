"""Causal attention over the (batch, seq, heads, head_dim) layout, with optional sliding window and
document masking, through PyTorch's fused attention kernels and this package's own (kernels.attention).

* Plain causal attention (no window shorter than the sequence, no document boundaries) goes to
  ``scaled_dot_product_attention(is_causal=True)``, never a mask tensor, with the backends tried in
  the order ``SDPA_BACKENDS``: cuDNN's fused attention first. PyTorch 2.11 already picks it for these
  calls on an H100; the order pins that choice across PyTorch versions. Forcing the flash backend
  instead made a Llama-3.2-1B training step 4% slower (benchmarks/results/e2e-*-2026-11-23.json).
  A backend that cannot take a call falls through to the next one.
  Grouped-query attention uses ``enable_gqa``, so k/v are never repeated in memory.
* A sliding window shorter than the sequence, or packed documents (attention must not cross a
  document boundary), need more than ``is_causal``. On CUDA in bf16/fp16 at head dims 64 and 128 (no
  dropout) that is this package's kernel, :func:`kernels.document_attention`: per-token document bounds
  (:meth:`AttentionMask.bounds`, from the ids on the device) and the window, tiles across documents
  skipped; it measured faster than the next option there (``benchmarks/results/attention-*.json``). At
  other head dims (a multiple of 8, at most 256) it is FlashAttention-2's variable-length kernel, through
  PyTorch's own ``aten._flash_attention_forward`` / ``_backward``: the (B, S) rows are flattened to B*S
  tokens and each document is one sequence of ``cu_seqlens`` (:class:`Documents`), so no work is spent on
  pairs across documents and no mask is built; a window is FlashAttention's ``window_size_left``. Elsewhere
  on CUDA (fp32, other head dims), for sequences longer than one FlexAttention block (128), it is
  FlexAttention with a block-sparse mask (only the blocks that hold allowed pairs are computed); on
  other devices, and for short sequences where one block holds everything, a dense boolean mask
  through SDPA. ``LIGERMODELS_MASKED_ATTENTION=flash`` (or ``flex``) sends the CUDA cases to
  FlashAttention-2 (or FlexAttention) instead (for comparisons; ``benchmarks/bench_attention.py``).

A query at position q sees a key at position k when ``k <= q``, ``q - k < window`` and both lie in
the same document (HF's sliding-window convention: the window counts the query itself).

Attention logit soft-capping (Gemma 2), ``scores = cap * tanh(scale * q.k / cap)`` before the mask and the
softmax, is something SDPA cannot express. On CUDA in bf16/fp16 at head dims 64, 128 and 256 (Gemma 2's;
:data:`TRITON_SOFTCAP_HEAD_DIMS`, no dropout) it is this package's kernel, :func:`kernels.document_attention`
with ``softcap``, plain causal attention included (one document per row: starts 0, ends S); at 256 it ran 1.5x
faster than FlexAttention on an H100. At other head dims, and in fp32, on CUDA (longer than one block, no
dropout) it is FlexAttention's ``score_mod`` on the same block mask (plain causal attention then gets a causal
block mask); elsewhere an exact dense computation with HF's arithmetic (``softcap_attention``).
``LIGERMODELS_SOFTCAP_ATTENTION=triton`` (or ``flex``) sends CUDA bf16/fp16 soft-capped attention without
dropout to the kernel at any head dim from 16 to 256 (or always to FlexAttention), for comparisons
(``benchmarks/bench_attention.py``).
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from kernels.attention import CONFIGS as _TRITON_CONFIGS
from kernels.attention import document_attention, document_bounds


def document_ids_from_positions(position_ids: torch.Tensor) -> torch.Tensor:
    """(B, S) document ids from positions that restart at 0 at each document start (no host sync)."""
    return torch.cumsum((position_ids == 0).to(torch.int32), dim=-1)


@dataclass(frozen=True)
class Documents:
    """Packed documents of a (B, S) batch, in both forms the attention paths read.

    Attributes:
        ids: (B, S) int document ids, non-decreasing along each row (the masks' form); None for whole rows.
        cu_seqlens: (N + 1,) int32, FlashAttention's variable-length form: where each of the N
            documents starts among the B*S tokens of the flattened batch, then B*S. A row always
            starts a new sequence, so a document cut by a row end is two sequences, as it is for
            the masks (each row attends within itself).
        max_len: the longest of the N sequences (a host int: it sizes the kernel's grid).

    Build it where the positions are still on the host (``Documents.from_positions(pos).to("cuda")``,
    as ``ligermodels.train`` does) and no step waits for the device; from device ids,
    :meth:`from_ids` copies them to the host once.
    """

    ids: torch.Tensor | None
    cu_seqlens: torch.Tensor
    max_len: int

    @classmethod
    def from_positions(cls, position_ids: torch.Tensor) -> Documents:
        """From (B, S) positions that restart at 0 at each document start."""
        return cls.from_ids(document_ids_from_positions(position_ids))

    @classmethod
    def from_ids(cls, document_ids: torch.Tensor) -> Documents:
        """From (B, S) document ids (one device-to-host copy when they are on a GPU)."""
        if document_ids.dim() != 2:
            raise ValueError(f"document_ids must be (batch, seq), got shape {tuple(document_ids.shape)}")
        ids = document_ids.cpu()
        b, s = ids.shape
        start = torch.ones(b, s, dtype=torch.bool)
        start[:, 1:] = ids[:, 1:] != ids[:, :-1]
        cu = torch.cat([start.flatten().nonzero().flatten(), torch.tensor([b * s])]).to(torch.int32)
        return cls(document_ids, to_device(cu, document_ids.device), int(cu.diff().max()))

    def padded(self, capacity: int, max_len: int) -> Documents | None:
        """The same documents with room for ``capacity`` sequences and ``max_len`` as their longest, for a
        step replayed from a CUDA graph (whose shapes and host ints are those of the capture): the bounds are
        repeated after the last sequence (empty sequences, which FlashAttention skips), and a larger
        ``max_len`` only adds blocks that find no query. None when there are more than ``capacity`` sequences
        or one longer than ``max_len``."""
        n = self.cu_seqlens.numel() - 1
        if n > capacity or self.max_len > max_len:
            return None
        cu = self.cu_seqlens
        return Documents(self.ids, torch.cat([cu, cu[-1:].expand(capacity - n)]), max_len)

    def to(self, device: torch.device | str) -> Documents:
        """The same documents on ``device`` (from pinned host memory, without waiting, to a GPU)."""
        device = torch.device(device)
        ids = None if self.ids is None else to_device(self.ids, device)
        return Documents(ids, to_device(self.cu_seqlens, device), self.max_len)


@dataclass(frozen=True)
class SharedPrefixes:
    """Packed sequences whose common prefixes (a preference pair's prompt) are stored once in the model's row.

    The model's per-token work (projections, MLPs, norms, rotary) runs on the row of distinct tokens (1, T); attention
    runs on the row with every sequence whole (1, Ta), as if each had been packed in full, so every token sees exactly
    the keys it would see there and the outputs are those of the full packing. A prefix shared by two sequences has
    the same tokens at the same positions in both, so its hidden states are the same in both: computing them once
    changes nothing but the work.

    Attributes:
        documents: the sequences of the attention row (1, Ta) (:class:`Documents`, from its restarting positions).
        gather: (Ta,) int64, the token of the model's row at each attention position (a shared prefix's tokens
            appear once per sequence that holds it).
        scatter: (T,) int64, the attention position whose output each token takes (its first occurrence).
        repeats: (R,) int64, the attention positions that are not a first occurrence; ``repeat_rows`` (R,) their
            tokens. The gradients of the two moves read them (:meth:`to_attention`, :meth:`from_attention`).
    """

    documents: Documents
    gather: torch.Tensor
    scatter: torch.Tensor
    repeats: torch.Tensor
    repeat_rows: torch.Tensor

    @property
    def length(self) -> int:
        """Ta, the attention row's length."""
        return self.gather.numel()

    def to(self, device: torch.device | str) -> SharedPrefixes:
        device = torch.device(device)
        return SharedPrefixes(self.documents.to(device), *(to_device(t, device) for t in (
            self.gather, self.scatter, self.repeats, self.repeat_rows)))

    def to_attention(self, x: torch.Tensor) -> torch.Tensor:
        """(1, T, C) rows of the model -> (1, Ta, C) rows of the attention row."""
        return _MoveRows.apply(x, self, True)

    def from_attention(self, o: torch.Tensor) -> torch.Tensor:
        """(1, Ta, C) attention outputs -> (1, T, C): each token's first occurrence's."""
        return _MoveRows.apply(o, self, False)


class _MoveRows(torch.autograd.Function):
    """The two moves of :class:`SharedPrefixes`, each an ``index_select`` along dim 1 whose backward reads the
    repeats instead of zeroing a buffer and adding every row into it (``index_select``'s own backward).

    To the attention row (``gather``): a token's gradient is its first occurrence's (gathered by ``scatter``) plus
    its repeats' (an ``index_add`` over the repeats only). From it (``scatter``): the gradient gathered back to
    every attention position, zero at the repeats (whose outputs nothing read)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, shared: SharedPrefixes, to_attention: bool) -> torch.Tensor:
        ctx.shared, ctx.to_attention = shared, to_attention
        return x.index_select(1, shared.gather if to_attention else shared.scatter)

    @staticmethod
    def backward(ctx, g: torch.Tensor):
        s = ctx.shared
        if ctx.to_attention:
            dx = g.index_select(1, s.scatter).index_add_(1, s.repeat_rows, g.index_select(1, s.repeats))
        else:
            dx = g.index_select(1, s.gather).index_fill_(1, s.repeats, 0)
        return dx, None, None


def to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``t`` on ``device`` without making the host wait for the GPU: a host tensor goes to a GPU from pinned
    memory (a copy from pageable memory waits for the stream; one from pinned memory is queued like a
    kernel)."""
    if t.device == device:
        return t
    if device.type == "cuda" and t.device.type == "cpu":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)


@dataclass
class AttentionMask:
    """What each layer's attention may look at, built once per forward and shared by all layers.

    Attributes:
        seq_len: query/key length S.
        document_ids: (B, S) int tensor, equal ids = same document, or :class:`Documents` (which also
            carries FlashAttention's variable-length bounds); None = one document per row. Or
            :class:`SharedPrefixes` (one row): then attention runs on its attention row of ``Ta`` tokens
            (``seq_len`` becomes Ta; its documents are the mask's; :attr:`shared` moves rows there and back).
        cache: per-window masks built on first use (dense bool (B, 1, S, S) or a FlexAttention BlockMask),
            and the variable-length bounds.
    """

    seq_len: int
    document_ids: torch.Tensor | Documents | SharedPrefixes | None = None
    cache: dict = field(default_factory=dict)
    #: the :class:`SharedPrefixes` given as ``document_ids``, or None: attention runs on the model's row itself
    shared: SharedPrefixes | None = None

    def __post_init__(self):
        if isinstance(self.document_ids, SharedPrefixes):
            self.shared, self.seq_len = self.document_ids, self.document_ids.length
            self.document_ids = self.shared.documents
        if isinstance(self.document_ids, Documents):
            self.cache["varlen"] = self.document_ids
            self.document_ids = self.document_ids.ids

    def needs_mask(self, window: int | None) -> bool:
        """Whether attention with this window needs more than plain causal masking."""
        return self.document_ids is not None or (window is not None and window < self.seq_len)

    def varlen(self, batch: int, device: torch.device) -> tuple[torch.Tensor, int]:
        """(cu_seqlens (N + 1,) int32, longest sequence) of the flattened batch: the documents', or one
        sequence per row without documents."""
        if "varlen" not in self.cache:
            if self.document_ids is not None:
                self.cache["varlen"] = Documents.from_ids(self.document_ids)
            else:
                rows = torch.arange(0, (batch + 1) * self.seq_len, self.seq_len, dtype=torch.int32, device=device)
                self.cache["varlen"] = Documents(None, rows, self.seq_len)
        spans = self.cache["varlen"]
        if spans.cu_seqlens.device != device:  # host-built bounds: moved once, for every layer
            spans = self.cache["varlen"] = spans.to(device)
        return spans.cu_seqlens, spans.max_len

    def bounds(self, batch: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """(starts, ends) (B, S) int32 of :func:`kernels.attention.document_bounds`, on ``device``."""
        if "bounds" not in self.cache:
            ids = self.document_ids
            self.cache["bounds"] = document_bounds(None if ids is None else to_device(ids, device), batch,
                                                   self.seq_len, device)
        return self.cache["bounds"]

    def allowed(self, window: int | None, device: torch.device) -> torch.Tensor:
        """Dense (B or 1, 1, S, S) bool mask: True where a query may attend to a key."""
        key = ("dense", window)
        if key not in self.cache:
            pos = torch.arange(self.seq_len, device=device)
            ok = pos[None, :] <= pos[:, None]
            if window is not None:
                ok &= (pos[:, None] - pos[None, :]) < window
            ok = ok[None, None]
            if self.document_ids is not None:
                doc = self.document_ids
                ok = ok & (doc[:, None, :, None] == doc[:, None, None, :])
            self.cache[key] = ok
        return self.cache[key]

    def block_mask(self, window: int | None, batch: int, device: torch.device):
        """FlexAttention BlockMask for this window and these documents (CUDA)."""
        key = ("flex", window)
        if key not in self.cache:
            self.cache[key] = document_block_mask(self.document_ids, window, self.seq_len, batch, device)
        return self.cache[key]


#: FlexAttention's block size (queries and keys).
FLEX_BLOCK = 128


def document_block_mask(document_ids: torch.Tensor | None, window: int | None, seq_len: int, batch: int,
                        device: torch.device):
    """The FlexAttention BlockMask of causal attention within documents and a window, built from block
    bounds instead of evaluating the mask at every (query, key) pair as ``create_block_mask`` does
    (6 ms a forward at 4 x 2048 tokens on an H100, against a few small kernels here).

    Document ids never decrease along a row (:func:`ligermodels.model.document_ids_from_positions`), so a
    block of 128 positions spans the documents ``first .. last``. A (query block i, key block j) pair holds
    an allowed pair when ``j <= i``, the key block's last document reaches the query block's first, and the
    nearest pair lies inside the window; every pair is allowed ("full": the mask is not evaluated) when
    ``j < i``, both blocks lie in one and the same document and the farthest pair lies inside the window
    (and neither is a last block cut short by ``seq_len``).
    """
    from torch.nn.attention.flex_attention import BlockMask

    doc, win = document_ids, window

    def mask_mod(b, h, q, k):
        ok = k <= q
        if win is not None:
            ok = ok & (q - k < win)
        if doc is not None:
            ok = ok & (doc[b, q] == doc[b, k])
        return ok

    n = -(-seq_len // FLEX_BLOCK)
    i = torch.arange(n, device=device)
    qi, kj = i[:, None], i[None, :]
    some = kj <= qi  # (n, n): causal
    whole = (i + 1) * FLEX_BLOCK <= seq_len  # a last block cut short is never full (as create_block_mask)
    full = (kj < qi) & whole[:, None] & whole[None, :]
    if win is not None:
        some = some & ((qi - kj - 1) * FLEX_BLOCK + 1 < win)  # nearest pair: last key of j, first query of i
        full = full & ((qi - kj + 1) * FLEX_BLOCK - 1 < win)  # farthest pair: first key of j, last query of i
    if doc is None:
        some, full = some[None], full[None]
    else:
        pad = n * FLEX_BLOCK - seq_len  # a last, partial block repeats its last document
        d = torch.nn.functional.pad(doc, (0, pad), mode="replicate") if pad else doc
        d = d.view(doc.shape[0], n, FLEX_BLOCK)
        first, last = d[..., 0], d[..., -1]  # (B, n)
        some = some & (last[:, None, :] >= first[:, :, None])
        one = first == last
        full = full & one[:, :, None] & one[:, None, :] & (first[:, :, None] == first[:, None, :])
    partial = some & ~full

    def blocks(m: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(count, indices) per query block, the set key blocks first, as BlockMask takes them."""
        m = m[:, None].expand(batch if doc is not None else 1, 1, n, n)
        order = torch.argsort((~m).to(torch.int8), dim=-1, stable=True)
        return m.sum(-1, dtype=torch.int32), order.to(torch.int32)

    kv_num, kv_idx = blocks(partial)
    full_num, full_idx = blocks(full)
    return BlockMask.from_kv_blocks(kv_num, kv_idx, full_num, full_idx, BLOCK_SIZE=FLEX_BLOCK, mask_mod=mask_mod,
                                    seq_lengths=(seq_len, seq_len))


_BACKEND_NAMES = {"cudnn": SDPBackend.CUDNN_ATTENTION, "flash": SDPBackend.FLASH_ATTENTION,
                  "efficient": SDPBackend.EFFICIENT_ATTENTION, "math": SDPBackend.MATH}


def parse_sdpa_backends(spec: str) -> list[SDPBackend]:
    names = [n.strip() for n in spec.split(",") if n.strip()]
    unknown = [n for n in names if n not in _BACKEND_NAMES]
    if unknown or not names:
        raise ValueError(f"LIGERMODELS_SDPA_BACKENDS={spec!r}: unknown backend(s) {unknown}; "
                         f"choose a comma-separated order of {sorted(_BACKEND_NAMES)}")
    return [_BACKEND_NAMES[n] for n in names]


#: The order in which SDPA backends are tried for plain causal attention (env LIGERMODELS_SDPA_BACKENDS,
#: e.g. "flash,efficient,math" for PyTorch's default choice). Only these backends are allowed.
SDPA_BACKENDS: list[SDPBackend] = parse_sdpa_backends(os.environ.get("LIGERMODELS_SDPA_BACKENDS",
                                                                      "cudnn,flash,efficient,math"))

_compiled_flex = None


def reset_flex_compile() -> None:
    """Drop the compiled FlexAttention, so that the next call compiles it again (with the current
    :data:`FLEX_KERNEL_OPTIONS`: benchmarks that sweep them)."""
    global _compiled_flex
    _compiled_flex = None


#: Sequences up to this length use the dense mask even on CUDA: one FlexAttention block covers them.
FLEX_MIN_SEQ = 128


_softcap_mods: dict = {}


def _softcap_mod(cap: float):
    """FlexAttention score_mod ``cap * tanh(score / cap)`` (one function per cap, so compiled graphs are reused)."""
    if cap not in _softcap_mods:
        def softcap(score, b, h, q_idx, kv_idx):
            return cap * torch.tanh(score / cap)

        _softcap_mods[cap] = softcap
    return _softcap_mods[cap]


#: FlexAttention ``kernel_options`` by head_dim for bf16/fp16 on Hopper (compute capability 9.0); Inductor's
#: defaults elsewhere. At head_dim 256 its default backward (64x64 blocks, 4 warps) ran one Gemma-2-2B layer
#: (batch 4 x 2048, documents, soft-capping) in 2.33 ms fwd+bwd on an H100, 8 warps in 1.86 ms
#: (benchmarks/results/attention-NVIDIA_H100_80GB_HBM3-2026-11-25.json).
FLEX_KERNEL_OPTIONS: dict[int, dict] = {256: {"bwd_num_warps": 8}}


def _flex_attention(q, k, v, block_mask, scale, enable_gqa, softcap=None):
    global _compiled_flex
    if _compiled_flex is None:
        from torch.nn.attention.flex_attention import flex_attention

        _compiled_flex = torch.compile(flex_attention, dynamic=False)
    mod = None if softcap is None else _softcap_mod(softcap)
    tuned = q.dtype != torch.float32 and _capability(q.device) == (9, 0)
    return _compiled_flex(q, k, v, score_mod=mod, block_mask=block_mask, scale=scale, enable_gqa=enable_gqa,
                          kernel_options=FLEX_KERNEL_OPTIONS.get(q.shape[-1]) if tuned else None)


#: Where masked attention (documents, windows) runs on CUDA: "triton" (this package's kernel,
#: :func:`kernels.document_attention`, at the head dims of :data:`TRITON_HEAD_DIMS`, else as "flash"), "flash"
#: (FlashAttention-2's variable-length kernel where it applies, else FlexAttention) or "flex" (always
#: FlexAttention). Env LIGERMODELS_MASKED_ATTENTION.
MASKED_ATTENTION = os.environ.get("LIGERMODELS_MASKED_ATTENTION", "triton")
if MASKED_ATTENTION not in ("triton", "flash", "flex"):
    raise ValueError(f"LIGERMODELS_MASKED_ATTENTION={MASKED_ATTENTION!r}: choose 'triton', 'flash' or 'flex'")

#: Head dims where the Triton kernel measured faster than FlashAttention-2's varlen kernel (H100, bf16).
TRITON_HEAD_DIMS = (64, 128)


def triton_documents_takes(device: torch.device, dtype: torch.dtype, head_dim: int, dropout_p: float) -> bool:
    """Whether masked attention of this kind runs through :func:`kernels.document_attention`: CUDA, bf16 / fp16,
    a head dim of :data:`TRITON_HEAD_DIMS`, no dropout."""
    return (MASKED_ATTENTION == "triton" and device.type == "cuda" and dtype in (torch.bfloat16, torch.float16)
            and head_dim in TRITON_HEAD_DIMS and dropout_p == 0.0)


def parse_softcap_setting(value: str) -> str:
    if value not in ("auto", "triton", "flex"):
        raise ValueError(f"LIGERMODELS_SOFTCAP_ATTENTION={value!r}: choose 'auto', 'triton' or 'flex'")
    return value


#: Where soft-capped attention (Gemma 2) runs on CUDA: "auto" (this package's kernel at the head dims of
#: :data:`TRITON_SOFTCAP_HEAD_DIMS`, else FlexAttention), "triton" (the kernel at every head dim it has tiles for,
#: 16 to 256) or "flex" (always FlexAttention); the kernel only in bf16 / fp16 without dropout. Env
#: LIGERMODELS_SOFTCAP_ATTENTION.
SOFTCAP_ATTENTION = parse_softcap_setting(os.environ.get("LIGERMODELS_SOFTCAP_ATTENTION", "auto"))
#: Head dims where soft-capped attention goes to the Triton kernel by default. At 256 (Gemma 2) it measured
#: 1.21 ms a layer forward + backward against FlexAttention's 1.87 (H100, Gemma-2-2B batch 4 x 2048 within
#: documents, benchmarks/results/experiments/attention-NVIDIA_H100_80GB_HBM3-2026-11-26-softcap-*.json);
#: at 64 and 128 the kernel is the masked-attention default already.
TRITON_SOFTCAP_HEAD_DIMS = (*TRITON_HEAD_DIMS, 256)


def triton_softcap_takes(device: torch.device, dtype: torch.dtype, head_dim: int, dropout_p: float) -> bool:
    """Whether soft-capped attention of this kind runs through :func:`kernels.document_attention` (per
    :data:`SOFTCAP_ATTENTION`): CUDA, bf16 / fp16, no dropout, and a head dim of :data:`TRITON_SOFTCAP_HEAD_DIMS`
    ("auto") or from 16 to 256 ("triton")."""
    if SOFTCAP_ATTENTION == "flex" or not (device.type == "cuda" and dtype in (torch.bfloat16, torch.float16)
                                           and dropout_p == 0.0):
        return False
    if SOFTCAP_ATTENTION == "auto":
        return head_dim in TRITON_SOFTCAP_HEAD_DIMS
    return 16 <= head_dim <= max(_TRITON_CONFIGS)


def flash_varlen_takes(device: torch.device, dtype: torch.dtype, head_dim: int, dropout_p: float) -> bool:
    """Whether FlashAttention-2's variable-length kernel takes queries of this kind: CUDA (compute capability
    8+), bf16 / fp16, head_dim a multiple of 8 up to 256, no dropout."""
    return (MASKED_ATTENTION != "flex" and device.type == "cuda" and dtype in (torch.bfloat16, torch.float16)
            and head_dim % 8 == 0 and head_dim <= 256 and dropout_p == 0.0 and _capability(device)[0] >= 8)


def flash_varlen_applies(q: torch.Tensor, dropout_p: float) -> bool:
    """:func:`flash_varlen_takes` for the queries ``q`` (..., head_dim)."""
    return flash_varlen_takes(q.device, q.dtype, q.shape[-1], dropout_p)


@functools.lru_cache
def _capability(device: torch.device) -> tuple[int, int]:
    """The CUDA device's compute capability, asked once per device (the attention paths ask every layer)."""
    return torch.cuda.get_device_capability(device)


def flash_varlen_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor,
                           max_len: int, window: int | None = None, scale: float | None = None) -> torch.Tensor:
    """Causal attention within each sequence of a packed batch, by FlashAttention-2 (PyTorch's ``aten`` build).

    q (B, S, Hq, D), k / v (B, S, Hkv, D), strided views of one projection buffer read in place (only the
    last dimension must be contiguous); the B*S tokens are split into sequences by ``cu_seqlens`` (N + 1,)
    int32, the longest ``max_len`` tokens (:meth:`AttentionMask.varlen`). Grouped-query heads are native to
    the kernel (k / v never repeated). ``window``: a key at most ``window - 1`` tokens before its query
    (HF's convention counts the query itself). Returns (B, S, Hq, D). Differentiable through PyTorch's own
    backward formula; that kernel accumulates dq with atomics, so the gradients are not bit-for-bit
    repeatable (as with SDPA's cuDNN and flash backends).
    """
    b, s, hq, d = q.shape
    left = -1 if window is None or window >= max_len else window - 1
    o = torch.ops.aten._flash_attention_forward(
        q.flatten(0, 1), k.flatten(0, 1), v.flatten(0, 1), cu_seqlens, cu_seqlens, max_len, max_len, 0.0, True,
        False, scale=d ** -0.5 if scale is None else scale, window_size_left=left, window_size_right=0)[0]
    return o.view(b, s, hq, d)


def softcap_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, allowed: torch.Tensor,
                      scale: float | None, softcap: float, dropout_p: float = 0.0) -> torch.Tensor:
    """Dense attention with logit soft-capping, HF Gemma 2's eager arithmetic (the CPU / dropout path).

    q (B, Hq, Sq, D), k / v (B, Hkv, Sk, D) (heads first, as SDPA), ``allowed`` (B or 1, 1, Sq, Sk) bool.
    ``softmax(mask(cap * tanh(q.k * scale / cap)))`` in fp32, rounded to q's dtype, then dropout and @ v.
    Returns (B, Hq, Sq, D). Every query row needs one allowed key.
    """
    b, hq, sq, d = q.shape
    hkv = k.shape[1]
    g = hq // hkv
    qg = q.reshape(b, hkv, g * sq, d)  # the G query heads sharing a kv head, stacked: k / v are not repeated
    scores = torch.matmul(qg, k.transpose(-1, -2)) * (d ** -0.5 if scale is None else scale)
    scores = (torch.tanh(scores / softcap) * softcap).view(b, hkv, g, sq, -1)
    scores = scores.masked_fill(~allowed[:, :, None], float("-inf"))
    p = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    if dropout_p > 0.0:
        p = F.dropout(p, p=dropout_p)
    return torch.matmul(p.view(b, hkv, g * sq, -1), v).view(b, hq, sq, d)


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: AttentionMask | None = None,
                     window: int | None = None, scale: float | None = None, dropout_p: float = 0.0,
                     softcap: float | None = None) -> torch.Tensor:
    """Causal grouped-query attention.

    Args:
        q: (B, S, Hq, D); k, v: (B, S, Hkv, D) with Hq a multiple of Hkv. Strided views are fine.
        mask: document ids and mask cache shared across layers (None: one document; a window still
            applies, through a mask built for this call).
        window: sliding window in tokens, or None.
        scale: softmax scale (default D ** -0.5).
        softcap: attention logit soft-capping ``cap * tanh(scores / cap)`` (Gemma 2), or None.
    Returns:
        (B, S, Hq, D), contiguous when the fused kernels produce it so (flash/cuDNN do).
    """
    gqa = q.shape[2] != k.shape[2]
    qt, kt, vt = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
    if mask is None and (softcap is not None or window is not None and window < q.shape[1]):
        mask = AttentionMask(q.shape[1])  # a window shorter than the sequence needs a mask, document or not
    if softcap is not None:  # SDPA has no soft-capping: our kernel, FlexAttention's score_mod, or the dense computation
        if triton_softcap_takes(q.device, q.dtype, q.shape[-1], dropout_p):  # documents or not (bounds of whole rows)
            return document_attention(q, k, v, *mask.bounds(q.shape[0], q.device), window=window, scale=scale,
                                      softcap=softcap)
        if q.is_cuda and dropout_p == 0.0 and q.shape[1] > FLEX_MIN_SEQ:
            o = _flex_attention(qt, kt, vt, mask.block_mask(window, q.shape[0], q.device), scale, gqa, softcap)
        else:
            o = softcap_attention(qt, kt, vt, mask.allowed(window, q.device), scale, softcap, dropout_p)
    elif mask is None or not mask.needs_mask(window):
        with sdpa_kernel(SDPA_BACKENDS, set_priority=True):
            o = F.scaled_dot_product_attention(qt, kt, vt, is_causal=True, scale=scale, dropout_p=dropout_p,
                                               enable_gqa=gqa)
    elif triton_documents_takes(q.device, q.dtype, q.shape[-1], dropout_p):
        return document_attention(q, k, v, *mask.bounds(q.shape[0], q.device), window=window, scale=scale)
    elif flash_varlen_applies(q, dropout_p):
        return flash_varlen_attention(q, k, v, *mask.varlen(q.shape[0], q.device), window=window, scale=scale)
    elif q.is_cuda and dropout_p == 0.0 and q.shape[1] > FLEX_MIN_SEQ:
        o = _flex_attention(qt, kt, vt, mask.block_mask(window, q.shape[0], q.device), scale, gqa)
    else:
        o = F.scaled_dot_product_attention(qt, kt, vt, attn_mask=mask.allowed(window, q.device), scale=scale,
                                           dropout_p=dropout_p, enable_gqa=gqa)
    return o.transpose(1, 2)
