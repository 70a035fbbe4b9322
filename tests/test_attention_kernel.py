"""kernels.document_attention: forward and the q / k / v gradients against float64 dense attention, on odd
shapes with packed documents (one-token documents, documents cut by row ends), grouped-query heads, windows,
head dims that are not powers of two, tiles of different sizes, strided views of one packed projection; the
bounds helper; and errors that name the bad argument."""

import pytest
import torch

import kernels.attention as attn_mod
from kernels.attention import allowed_pairs, document_attention, document_attention_reference, document_bounds
from tests.utils import DEVICE, assert_rel, assert_triton_runs, randn


def _ids(batch: int, seq: int, seed: int, max_doc: int = 20) -> torch.Tensor:
    """(B, S) non-decreasing document ids: random document lengths 1..max_doc, each row cut independently."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.empty(batch, seq, dtype=torch.int32)
    for b in range(batch):
        pos, doc = 0, int(torch.randint(0, 5, (1,), generator=g))
        while pos < seq:
            n = int(torch.randint(1, max_doc + 1, (1,), generator=g))
            ids[b, pos:pos + n] = doc
            pos, doc = pos + n, doc + 1
    return ids.to(DEVICE)


def _qkv(batch, seq, hq, hkv, d, dtype, seed):
    """q, k, v: strided views of one packed (B, S, (Hq + 2*Hkv) * D) leaf, as the decoder layer passes them."""
    qkv = randn(batch, seq, (hq + 2 * hkv) * d, dtype=dtype, seed=seed).requires_grad_()
    heads = qkv.view(batch, seq, hq + 2 * hkv, d)
    return qkv, heads[:, :, :hq], heads[:, :, hq:hq + hkv], heads[:, :, hq + hkv:]


def _check(batch, seq, hq, hkv, d, dtype, window, ids, seed=0):
    qkv, q, k, v = _qkv(batch, seq, hq, hkv, d, dtype, seed)
    starts, ends = document_bounds(ids, batch, seq, DEVICE)
    grad = randn(batch, seq, hq, d, dtype=dtype, seed=seed + 1)
    scale = 0.7 * d ** -0.5
    out = document_attention(q, k, v, starts, ends, window, scale)
    out.backward(grad)
    assert_triton_runs(out)

    ref_leaf = qkv.detach().double().requires_grad_()
    h = ref_leaf.view(batch, seq, hq + 2 * hkv, d)
    ref = document_attention_reference(h[:, :, :hq], h[:, :, hq:hq + hkv], h[:, :, hq + hkv:], starts, window, scale)
    ref.backward(grad.double())
    what = f"B{batch} S{seq} Hq{hq} Hkv{hkv} D{d} window {window}"
    assert_rel(out, ref, dtype, f"{what}: output")
    hd = (hq + 2 * hkv) * d
    for name, lo, hi in (("dq", 0, hq * d), ("dk", hq * d, (hq + hkv) * d), ("dv", (hq + hkv) * d, hd)):
        assert_rel(qkv.grad[..., lo:hi], ref_leaf.grad[..., lo:hi], dtype, f"{what}: {name}")


@pytest.mark.parametrize("hq,hkv,d", [(4, 2, 16), (3, 1, 24), (2, 2, 32)])
def test_attention_within_documents_matches_float64_forward_and_gradients(hq, hkv, d):
    _check(2, 77, hq, hkv, d, torch.float32, None, _ids(2, 77, seed=d))


@pytest.mark.parametrize("window", [1, 5, 23, 40])
def test_a_sliding_window_inside_documents_matches_float64(window):
    _check(2, 70, 2, 1, 16, torch.float32, window, _ids(2, 70, seed=window, max_doc=45))


def test_whole_rows_and_a_window_without_documents_match_float64():
    _check(1, 65, 2, 1, 16, torch.float32, None, None)
    _check(1, 65, 2, 1, 16, torch.float32, 17, None)


def test_bf16_attention_within_documents_is_within_the_bf16_bound():
    _check(2, 50, 4, 2, 32, torch.bfloat16, None, _ids(2, 50, seed=3))


@pytest.mark.parametrize("cfg", [{"fwd": (32, 16, 1, 1), "kv": (32, 16, 1, 1), "q": (16, 32, 1, 1)},
                                 {"fwd": (16, 32, 1, 1), "kv": (16, 16, 1, 1), "q": (16, 16, 1, 1), "kv_programs": 0},
                                 {"fwd": (16, 16, 1, 1), "kv": (16, 32, 1, 1), "q": (16, 16, 1, 1), "kv_programs": 9}])
def test_tiles_of_other_shapes_give_the_same_attention(monkeypatch, cfg):
    """The runs of masked / unmasked blocks are derived from the tile sizes, and the dK/dV kernel splits a
    group's q heads over programs or not: other tiles and splits, same numbers."""
    if DEVICE.type == "cuda":
        pytest.skip("interpreter tile sizes (the CUDA tiles are CONFIGS)")
    monkeypatch.setattr(attn_mod, "_INTERPRET_CONFIG", cfg)
    _check(2, 83, 6, 1, 16, torch.float32, None, _ids(2, 83, seed=7, max_doc=50))
    _check(1, 83, 4, 2, 16, torch.float32, 21, _ids(1, 83, seed=8, max_doc=50))


def test_document_bounds_are_the_first_and_past_last_token_of_each_document():
    ids = torch.tensor([[0, 0, 1, 2, 2, 2], [5, 5, 5, 5, 6, 6]], dtype=torch.int32, device=DEVICE)
    starts, ends = document_bounds(ids, 2, 6, DEVICE)
    assert starts.tolist() == [[0, 0, 2, 3, 3, 3], [0, 0, 0, 0, 4, 4]]
    assert ends.tolist() == [[2, 2, 3, 6, 6, 6], [4, 4, 4, 4, 6, 6]]
    assert starts.dtype == ends.dtype == torch.int32
    whole, end = document_bounds(None, 2, 6, DEVICE)
    assert whole.eq(0).all() and end.eq(6).all()


def test_allowed_pairs_are_causal_within_documents_and_the_window():
    starts = torch.tensor([[0, 0, 2, 2, 2]], dtype=torch.int32)
    ok = allowed_pairs(starts, window=2)[0, 0]
    expected = [[1, 0, 0, 0, 0], [1, 1, 0, 0, 0], [0, 0, 1, 0, 0], [0, 0, 1, 1, 0], [0, 0, 0, 1, 1]]
    assert ok.int().tolist() == expected


def test_bad_arguments_are_named():
    q = torch.zeros(1, 8, 3, 16, device=DEVICE)
    kv = torch.zeros(1, 8, 2, 16, device=DEVICE)
    starts, ends = document_bounds(None, 1, 8, DEVICE)
    with pytest.raises(ValueError, match="not a multiple"):
        document_attention(q, kv, kv, starts, ends)
    with pytest.raises(ValueError, match="int32"):
        document_attention(q, q, q, starts.long(), ends)
    with pytest.raises(ValueError, match=r"q \(B, S, Hq, D\)"):
        document_attention(q, q[:, :4], q, starts, ends)


def test_document_attention_custom_ops_pass_opcheck():
    """The forward and backward are torch.library ops (torch.compile sees one op each, no graph break)."""
    ids = _ids(1, 40, seed=11)
    _, q, k, v = _qkv(1, 40, 4, 2, 16, torch.float32, seed=12)
    q, k, v = (t.detach() for t in (q, k, v))
    starts, ends = document_bounds(ids, 1, 40, DEVICE)
    checks = ("test_schema", "test_faketensor") if DEVICE.type == "cuda" else ("test_schema",)
    torch.library.opcheck(torch.ops.ligermodels.doc_attention_fwd.default, (q, k, v, starts, 0, 0.25),
                          test_utils=checks)
    o, lse = torch.ops.ligermodels.doc_attention_fwd(q, k, v, starts, 0, 0.25)
    torch.library.opcheck(torch.ops.ligermodels.doc_attention_bwd.default,
                          (torch.randn_like(o), q, k, v, o, lse, starts, ends, 7, 0.25), test_utils=checks)


def test_document_attention_compiles_without_a_graph_break():
    """Under torch.compile (fullgraph) the op gives the eager output and gradient, q / k / v split from the
    packed projection inside the compiled region as the decoder layer does."""
    if DEVICE.type != "cuda":
        pytest.skip("Inductor's Triton needs CUDA here")
    ids = _ids(2, 96, seed=13)
    qkv, *_ = _qkv(2, 96, 4, 2, 64, torch.bfloat16, seed=14)
    starts, ends = document_bounds(ids, 2, 96, DEVICE)
    grad = randn(2, 96, 4, 64, dtype=torch.bfloat16, seed=15)

    def attend(packed):
        heads = packed.view(2, 96, 8, 64)
        return document_attention(heads[:, :, :4], heads[:, :, 4:6], heads[:, :, 6:], starts, ends, 33)

    results = []
    for fn in (attend, torch.compile(attend, fullgraph=True)):
        leaf = qkv.detach().clone().requires_grad_()
        out = fn(leaf)
        out.backward(grad)
        results.append((out, leaf.grad))
    (eager, eager_grad), (compiled, compiled_grad) = results
    assert torch.equal(eager, compiled) and torch.equal(eager_grad, compiled_grad)
