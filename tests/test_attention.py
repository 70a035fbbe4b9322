"""Causal attention (ligermodels.attention): every path against a float64 dense reference.

On the GPU the plain causal path runs cuDNN's fused attention (tried first, see ``SDPA_BACKENDS``),
sequences longer than one FlexAttention block with a window or documents run FlexAttention, and
the rest a dense mask through SDPA; on the CPU every path is SDPA. Inputs are strided views of one
packed q/k/v projection, as the decoder layer passes them.
"""

from __future__ import annotations

import pytest
import torch

from ligermodels import attention
from ligermodels.attention import AttentionMask, Documents, causal_attention
from tests.utils import DEVICE, assert_rel, randn, rel_err

CASES = {  # name: (batch, seq, q heads, kv heads, head_dim, window, documents)
    "causal_gqa_d64": (2, 37, 6, 2, 64, None, False),
    "causal_mha_d96": (1, 29, 3, 3, 96, None, False),
    "window_gqa": (2, 41, 4, 1, 64, 9, False),
    "documents_gqa_d96": (2, 33, 4, 2, 96, None, True),
}
if DEVICE.type == "cuda":  # longer than one FlexAttention block: the block-sparse path (fp32), FlashAttention (bf16)
    CASES |= {"causal_long": (2, 300, 8, 2, 128, None, False), "window_documents_long": (1, 300, 4, 2, 64, 50, True),
              "documents_mqa_d256_long": (2, 333, 8, 1, 256, None, True), "window_d80": (2, 150, 4, 2, 80, 21, False)}


def reference(q, k, v, window, doc, softcap=None, scale=None):
    """Dense float64 attention with repeated k/v (and HF Gemma 2's logit soft-capping): (B, S, Hq, D)."""
    q, k, v = (t.double().transpose(1, 2) for t in (q, k, v))
    g = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
    s = q.shape[2]
    pos = torch.arange(s, device=q.device)
    ok = pos[None, :] <= pos[:, None]
    if window is not None:
        ok &= pos[:, None] - pos[None, :] < window
    ok = ok[None, None]
    if doc is not None:
        ok = ok & (doc[:, None, :, None] == doc[:, None, None, :])
    scores = (q @ k.transpose(-1, -2)) * (q.shape[-1] ** -0.5 if scale is None else scale)
    if softcap is not None:
        scores = softcap * torch.tanh(scores / softcap)
    p = scores.masked_fill(~ok, float("-inf")).softmax(-1)
    return (p @ v).transpose(1, 2)


def _documents(batch, seq):
    doc = torch.zeros(batch, seq, dtype=torch.long)
    for b in range(batch):  # boundaries differ per row; a document of one token included
        for cut in (5 + 3 * b, 6 + 3 * b, seq // 2 + b):
            doc[b, cut:] += 1
    return doc.to(DEVICE)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("case", list(CASES))
def test_causal_attention_matches_float64_forward_and_gradients(case, dtype):
    b, s, hq, hkv, d, window, docs = CASES[case]
    qkv = randn(b, s, (hq + 2 * hkv) * d, dtype=dtype).requires_grad_()
    q, k, v = qkv.split([hq * d, hkv * d, hkv * d], dim=-1)
    q, k, v = (t.unflatten(-1, (-1, d)) for t in (q, k, v))
    doc = _documents(b, s) if docs else None
    mask = AttentionMask(s, Documents.from_ids(doc) if doc is not None else None) if (docs or window) else None
    out = causal_attention(q, k, v, mask=mask, window=window)
    grad = randn(*out.shape, dtype=dtype)
    (out * grad).sum().backward()

    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    ref = reference(q64, k64, v64, window, doc)
    (ref * grad.double()).sum().backward()
    # Grouped-query gradients sum over the group: compare them through the whole qkv gradient.
    ref_grad = torch.cat([t.grad.flatten(-2) for t in (q64, k64, v64)], dim=-1)
    bound = 1e-5 if dtype == torch.float32 else 1e-2
    assert_rel(out, ref, dtype, f"{case} output", bound)
    assert_rel(qkv.grad, ref_grad, dtype, f"{case} d(qkv)", bound)
    if dtype == torch.bfloat16:  # no worse than PyTorch's SDPA on a dense mask with repeated k/v, in bf16
        q16, k16, v16 = (t.detach().transpose(1, 2).requires_grad_() for t in (q, k, v))
        g = hq // hkv
        eager = torch.nn.functional.scaled_dot_product_attention(
            q16, k16.repeat_interleave(g, 1), v16.repeat_interleave(g, 1),
            attn_mask=(AttentionMask(s, doc).allowed(window, DEVICE)))
        assert rel_err(out, ref) <= 1.5 * rel_err(eager.transpose(1, 2), ref) + 1e-3


def test_a_window_applies_without_a_mask_argument():
    """causal_attention(..., window=w) and a block built with a window, called without a mask (one
    document), still attend within the window, as with an explicit AttentionMask."""
    q, k, v = (randn(2, 23, h, 32) for h in (4, 2, 2))
    out = causal_attention(q, k, v, window=5)
    assert_rel(out, reference(q, k, v, 5, None), torch.float32, "window without mask", 1e-5)
    assert torch.equal(out, causal_attention(q, k, v, mask=AttentionMask(23), window=5))


@pytest.mark.skipif(DEVICE.type != "cuda" or not torch.backends.cudnn.is_available(), reason="cuDNN needs CUDA")
def test_plain_causal_bf16_runs_cudnn_attention():
    qkv = randn(2, 256, 12 * 64, dtype=torch.bfloat16).requires_grad_()
    q, k, v = (t.unflatten(-1, (-1, 64)) for t in qkv.split([8 * 64, 2 * 64, 2 * 64], dim=-1))
    out = causal_attention(q, k, v)
    sdpa = type(out.grad_fn.next_functions[0][0]).__name__  # out is a transposed view of the SDPA output
    assert "Cudnn" in sdpa, f"plain causal attention ran {sdpa}, not cuDNN"


def test_unknown_backend_in_env_is_rejected_with_its_name():
    with pytest.raises(ValueError, match=r"LIGERMODELS_SDPA_BACKENDS=.*flashy"):
        attention.parse_sdpa_backends("cudnn,flashy")


def test_backend_order_is_parsed_from_the_env_spelling():
    assert attention.parse_sdpa_backends("flash, math") == [torch.nn.attention.SDPBackend.FLASH_ATTENTION,
                                                       torch.nn.attention.SDPBackend.MATH]


def _block_sets(bm) -> tuple[torch.Tensor, torch.Tensor]:
    """(partial, full) dense (B, nq, nkv) bool block maps of a FlexAttention BlockMask."""
    def dense(num, idx):
        b, _, nq, nkv = idx.shape
        out = torch.zeros(b, nq, nkv, dtype=torch.bool)
        for bi in range(b):
            for q in range(nq):
                out[bi, q, idx[bi, 0, q, :num[bi, 0, q]].long()] = True
        return out
    return dense(bm.kv_num_blocks, bm.kv_indices), dense(bm.full_kv_num_blocks, bm.full_kv_indices)


@pytest.mark.parametrize("seq, window", [(1000, None), (1000, 300), (384, 129), (640, None)])
def test_document_block_mask_equals_flex_attentions_own(seq, window):
    """The block mask built from block bounds holds the same partial and full blocks as create_block_mask
    evaluating the mask at every pair, for random documents, windows and a last partial block."""
    from torch.nn.attention.flex_attention import create_block_mask

    from ligermodels.attention import document_block_mask
    from ligermodels.model import document_ids_from_positions

    g = torch.Generator().manual_seed(seq + (window or 0))
    rows = []
    for _ in range(3):
        row = []
        while len(row) < seq:
            row += list(range(int(torch.randint(1, 400, (1,), generator=g))))
        rows.append(row[:seq])
    rows[0] = list(range(seq))  # one document filling the row
    doc = document_ids_from_positions(torch.tensor(rows))
    for d in (doc, None):
        def mask_mod(b, h, q, k, d=d):
            ok = k <= q
            if window is not None:
                ok = ok & (q - k < window)
            if d is not None:
                ok = ok & (d[b, q] == d[b, k])
            return ok

        theirs = create_block_mask(mask_mod, 3 if d is not None else None, None, seq, seq, device="cpu")
        ours = document_block_mask(d, window, seq, 3, torch.device("cpu"))
        for a, b, what in zip(_block_sets(ours), _block_sets(theirs), ("partial", "full"), strict=True):
            assert torch.equal(a, b), (what, d is None)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("case", list(CASES))
def test_softcapped_attention_matches_float64_forward_and_gradients(case, dtype):
    """Attention logit soft-capping (Gemma 2) on every path: plain causal, window, documents (FlexAttention's
    score_mod on CUDA past one block, the dense computation elsewhere), GQA, a custom scale."""
    b, s, hq, hkv, d, window, docs = CASES[case]
    qkv = randn(b, s, (hq + 2 * hkv) * d, dtype=dtype, scale=2.0, seed=7).requires_grad_()
    q, k, v = (t.unflatten(-1, (-1, d)) for t in qkv.split([hq * d, hkv * d, hkv * d], dim=-1))
    doc = _documents(b, s) if docs else None
    mask = AttentionMask(s, doc) if docs else None
    out = causal_attention(q, k, v, mask=mask, window=window, scale=0.3, softcap=2.5)
    grad = randn(*out.shape, dtype=dtype, seed=8)
    (out * grad).sum().backward()
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    ref = reference(q64, k64, v64, window, doc, softcap=2.5, scale=0.3)
    (ref * grad.double()).sum().backward()
    ref_grad = torch.cat([t.grad.flatten(-2) for t in (q64, k64, v64)], dim=-1)
    bound = 1e-5 if dtype == torch.float32 else 1.5e-2
    assert_rel(out, ref, dtype, f"{case} softcapped output", bound)
    assert_rel(qkv.grad, ref_grad, dtype, f"{case} softcapped d(qkv)", bound)
    assert rel_err(out, reference(q64, k64, v64, window, doc, scale=0.3)) > 10 * bound, "soft-capping had no effect"


@pytest.mark.parametrize("docs,window", [(False, None), (True, 7)], ids=["causal", "documents_window"])
def test_softcapped_attention_goes_to_the_triton_kernel_where_it_takes_it(monkeypatch, docs, window):
    """Where :func:`triton_softcap_takes` holds (forced here: on CUDA, bf16 at head dims 64 / 128 / 256), soft-capped
    attention runs kernels.document_attention, plain causal attention (bounds of whole rows) included, and matches
    float64 (the interpreter on the CPU)."""
    monkeypatch.setattr(attention, "triton_softcap_takes", lambda *args: True)
    b, s, hq, hkv, d = 2, 29, 4, 2, 16
    qkv = randn(b, s, (hq + 2 * hkv) * d, scale=2.0, seed=5).requires_grad_()
    q, k, v = (t.unflatten(-1, (-1, d)) for t in qkv.split([hq * d, hkv * d, hkv * d], dim=-1))
    doc = _documents(b, s) if docs else None
    out = causal_attention(q, k, v, mask=AttentionMask(s, doc) if docs else None, window=window, scale=0.3,
                           softcap=2.5)
    assert type(out.grad_fn).__name__ == "DocumentAttentionFunctionBackward"
    grad = randn(*out.shape, seed=6)
    (out * grad).sum().backward()
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    ref = reference(q64, k64, v64, window, doc, softcap=2.5, scale=0.3)
    (ref * grad.double()).sum().backward()
    ref_grad = torch.cat([t.grad.flatten(-2) for t in (q64, k64, v64)], dim=-1)
    assert_rel(out, ref, torch.float32, "triton softcapped output", 1e-5)
    assert_rel(qkv.grad, ref_grad, torch.float32, "triton softcapped d(qkv)", 1e-5)


def test_softcap_setting_picks_the_kernel_by_head_dim_and_names_a_bad_value(monkeypatch):
    """"auto": the kernel at TRITON_SOFTCAP_HEAD_DIMS (64, 128 and Gemma 2's 256) on CUDA in bf16 / fp16 without
    dropout, else FlexAttention; "triton": the kernel at head dims 16 to 256; "flex": never the kernel."""
    cuda, bf16 = torch.device("cuda"), torch.bfloat16
    expected = {"auto": {64: True, 128: True, 256: True, 96: False, 8: False},
                "triton": {64: True, 128: True, 256: True, 96: True, 8: False}, "flex": {64: False, 256: False}}
    for setting, by_dim in expected.items():
        monkeypatch.setattr(attention, "SOFTCAP_ATTENTION", setting)
        for d, takes in by_dim.items():
            assert attention.triton_softcap_takes(cuda, bf16, d, 0.0) == takes, (setting, d)
        for device, dtype, p in ((torch.device("cpu"), bf16, 0.0), (cuda, torch.float32, 0.0), (cuda, bf16, 0.1)):
            assert not attention.triton_softcap_takes(device, dtype, 64, p), (setting, device, dtype, p)
    assert attention.parse_softcap_setting("triton") == "triton"
    with pytest.raises(ValueError, match=r"LIGERMODELS_SOFTCAP_ATTENTION='tritonn'.*'auto', 'triton' or 'flex'"):
        attention.parse_softcap_setting("tritonn")


@pytest.mark.skipif(DEVICE.type != "cuda", reason="the routing is CUDA's")
@pytest.mark.parametrize("d,kernel", [(64, True), (128, True), (256, True), (96, False)])
def test_bf16_softcapped_attention_runs_the_triton_kernel_at_its_head_dims(d, kernel):
    """On CUDA in bf16, soft-capped attention (documents, a window, or neither) runs kernels.document_attention at
    head dims 64, 128 and 256 (Gemma 2's), and FlexAttention at others."""
    qkv = randn(2, 256, 12 * d, dtype=torch.bfloat16).requires_grad_()
    q, k, v = (t.unflatten(-1, (-1, d)) for t in qkv.split([8 * d, 2 * d, 2 * d], dim=-1))
    for mask, window in ((AttentionMask(256, Documents.from_ids(_documents(2, 256))), None), (None, 100),
                         (None, None)):
        out = causal_attention(q, k, v, mask=mask, window=window, softcap=50.0)
        ran = type(out.grad_fn).__name__ == "DocumentAttentionFunctionBackward"
        assert ran == kernel, f"head dim {d}, window {window}: {type(out.grad_fn).__name__}"


def test_cached_attention_softcap_matches_reference():
    """The decode path (new queries over a cache buffer with a bool mask) soft-caps as the training path."""
    from ligermodels.generation import cached_attention

    b, s, length, hq, hkv, d = 2, 3, 9, 4, 2, 32
    q, k, v = randn(b, s, hq, d, seed=1, scale=2.0), randn(b, length, hkv, d, seed=2), randn(b, length, hkv, d, seed=3)
    allowed = torch.rand(b, 1, s, length, generator=torch.Generator().manual_seed(4)).to(DEVICE) < 0.6
    allowed[..., 0] = True
    out = cached_attention(q, k, v, allowed, 0.25, softcap=1.5)
    q64, k64, v64 = (t.double().transpose(1, 2) for t in (q, k, v))
    k64, v64 = k64.repeat_interleave(2, 1), v64.repeat_interleave(2, 1)
    scores = 1.5 * torch.tanh((q64 @ k64.transpose(-1, -2)) * 0.25 / 1.5)
    ref = (scores.masked_fill(~allowed, float("-inf")).softmax(-1) @ v64).transpose(1, 2)
    assert_rel(out, ref, torch.float32, "cached softcapped attention", 1e-5)


def test_documents_bounds_split_rows_and_documents():
    """cu_seqlens starts a sequence at every document start and every row start (a document cut by a row
    end is two sequences); max_len is the longest; from positions and from ids agree."""
    pos = torch.tensor([[0, 1, 2, 0, 1, 0], [3, 4, 0, 1, 2, 3]])  # row 1 continues a document
    docs = Documents.from_positions(pos)
    assert docs.cu_seqlens.tolist() == [0, 3, 5, 6, 8, 12] and docs.cu_seqlens.dtype == torch.int32
    assert docs.max_len == 4
    again = Documents.from_ids(docs.ids)
    assert torch.equal(again.cu_seqlens, docs.cu_seqlens) and again.max_len == 4
    with pytest.raises(ValueError, match="document_ids must be"):
        Documents.from_ids(torch.zeros(6, dtype=torch.int32))


def test_padded_documents_repeat_the_last_bound_and_refuse_what_does_not_fit():
    """Room for more sequences is empty sequences at the end; a longer max_len is taken; more sequences than the
    room, or a longer one than max_len, give None (the step then runs eagerly)."""
    docs = Documents.from_positions(torch.tensor([[0, 1, 2, 0, 1, 0], [3, 4, 0, 1, 2, 3]]))
    padded = docs.padded(8, 6)
    assert padded.cu_seqlens.tolist() == [0, 3, 5, 6, 8, 12, 12, 12, 12] and padded.max_len == 6
    assert padded.cu_seqlens.dtype == torch.int32 and padded.ids is docs.ids
    assert docs.padded(5, 4).cu_seqlens.tolist() == [0, 3, 5, 6, 8, 12]
    assert docs.padded(4, 6) is None and docs.padded(8, 3) is None


@pytest.mark.skipif(DEVICE.type != "cuda", reason="FlashAttention needs CUDA")
def test_padded_bounds_give_the_same_attention_and_gradients():
    """FlashAttention over bounds padded with empty sequences and the row length as the longest (what a CUDA-graph
    step captures) gives the unpadded bounds' output and gradients."""
    b, s, hq, hkv, d = 2, 256, 8, 2, 96  # a head dim FlashAttention takes and kernels.document_attention does not
    pos = torch.cat([torch.arange(100), torch.arange(156), torch.arange(30), torch.arange(226)]).view(b, s)
    docs = Documents.from_positions(pos).to(DEVICE)
    padded = Documents.from_positions(pos).padded(64, s).to(DEVICE)
    results = []
    for bounds in (docs, padded):
        q, k, v = (randn(b, s, h, d, seed=i, dtype=torch.bfloat16).requires_grad_() for i, h in ((1, hq), (2, hkv),
                                                                                                    (3, hkv)))
        out = causal_attention(q, k, v, mask=AttentionMask(s, bounds))
        out.backward(randn(*out.shape, seed=4, dtype=torch.bfloat16))
        results.append((out, q.grad, k.grad, v.grad))
    for name, a, c in zip(("out", "dq", "dk", "dv"), *results, strict=True):
        assert_rel(c, a, torch.bfloat16, f"padded bounds: {name}", 1e-2)


def test_documents_and_plain_ids_give_the_same_attention():
    """AttentionMask(S, Documents) attends as AttentionMask(S, ids) does (whatever the path: FlashAttention
    from the bounds on CUDA in bf16, masks elsewhere), and a model forward takes either."""
    b, s, hq, hkv, d = 2, 40, 4, 2, 16
    q, k, v = randn(b, s, hq, d, seed=1), randn(b, s, hkv, d, seed=2), randn(b, s, hkv, d, seed=3)
    doc = _documents(b, s)
    out_ids = causal_attention(q, k, v, mask=AttentionMask(s, doc))
    out_docs = causal_attention(q, k, v, mask=AttentionMask(s, Documents.from_ids(doc)))
    assert torch.equal(out_ids, out_docs)
    assert_rel(out_docs, reference(q, k, v, None, doc), torch.float32, "documents", 1e-5)


@pytest.mark.skipif(DEVICE.type != "cuda", reason="FlashAttention needs CUDA")
@pytest.mark.parametrize("d,kernel", [(64, "DocumentAttentionFunctionBackward"),
                                      (128, "DocumentAttentionFunctionBackward"), (96, "FlashAttentionBackward0")])
def test_bf16_documents_and_windows_run_the_fused_kernels(d, kernel):
    """Packed documents and a window shorter than the sequence run kernels.document_attention at head dims 64
    and 128, FlashAttention's variable-length kernel at others, in bf16 on CUDA (not FlexAttention, not a
    dense mask)."""
    qkv = randn(2, 256, 12 * d, dtype=torch.bfloat16).requires_grad_()
    q, k, v = (t.unflatten(-1, (-1, d)) for t in qkv.split([8 * d, 2 * d, 2 * d], dim=-1))
    for mask, window in ((AttentionMask(256, Documents.from_ids(_documents(2, 256))), None), (None, 100)):
        out = causal_attention(q, k, v, mask=mask, window=window)
        node = out.grad_fn
        if type(node).__name__ != kernel:  # FlashAttention's output is a view of its (B*S, Hq, D) output
            node = node.next_functions[0][0]
        assert type(node).__name__ == kernel, f"head dim {d}, window {window}: {type(node).__name__}"


def test_host_built_bounds_move_to_the_device_once_for_every_layer():
    """Documents built on the host give every layer the same cu_seqlens on the device: moved at the first
    layer's call and kept (one copy per forward, not one per layer); without documents, one sequence per row."""
    docs = Documents.from_positions(torch.tensor([[0, 1, 2, 0, 1, 0], [3, 4, 0, 1, 2, 3]]))
    mask = AttentionMask(6, docs)
    meta = torch.device("meta")
    first, n = mask.varlen(2, meta)
    again, _ = mask.varlen(2, meta)
    assert first.device == meta and again is first and n == 4
    rows, longest = AttentionMask(6).varlen(2, torch.device("cpu"))
    assert rows.tolist() == [0, 6, 12] and longest == 6
