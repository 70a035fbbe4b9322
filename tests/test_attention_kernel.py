"""kernels.document_attention: forward and the q / k / v gradients against float64 dense attention, on odd
shapes with packed documents (one-token documents, documents cut by row ends), grouped-query heads, windows,
head dims that are not powers of two, tiles of different sizes, strided views of one packed projection;
Gemma 2's attention-logit soft-capping (where the cap bites, and at Gemma's cap of 50 where it mostly does not);
the bounds helper; and errors that name the bad argument."""

import pytest
import torch

import kernels.attention as attn_mod
from kernels.attention import allowed_pairs, document_attention, document_attention_reference, document_bounds
from tests.utils import BOUNDS, DEVICE, assert_rel, assert_triton_runs, randn, rel_err


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


def _qkv(batch, seq, hq, hkv, d, dtype, seed, spread=1.0):
    """q, k, v: strided views of one packed (B, S, (Hq + 2*Hkv) * D) leaf, as the decoder layer passes them
    (normal, standard deviation ``spread``)."""
    qkv = randn(batch, seq, (hq + 2 * hkv) * d, dtype=dtype, scale=spread, seed=seed).requires_grad_()
    heads = qkv.view(batch, seq, hq + 2 * hkv, d)
    return qkv, heads[:, :, :hq], heads[:, :, hq:hq + hkv], heads[:, :, hq + hkv:]


def _check(batch, seq, hq, hkv, d, dtype, window, ids, seed=0, softcap=None, spread=1.0, cap_bites=False):
    """Output and dq / dk / dv against float64 (``softcap``: soft-capped attention, inputs of std ``spread``).
    ``cap_bites``: also require the uncapped float64 attention to miss the output and every gradient by more than
    10 x the bound, so that a kernel ignoring the cap (forward or backward) could not pass."""
    qkv, q, k, v = _qkv(batch, seq, hq, hkv, d, dtype, seed, spread)
    starts, ends = document_bounds(ids, batch, seq, DEVICE)
    grad = randn(batch, seq, hq, d, dtype=dtype, seed=seed + 1)
    scale = 0.7 * d ** -0.5
    out = document_attention(q, k, v, starts, ends, window, scale, softcap=softcap)
    out.backward(grad)
    assert_triton_runs(out)

    hd = (hq + 2 * hkv) * d
    grads = (("dq", 0, hq * d), ("dk", hq * d, (hq + hkv) * d), ("dv", (hq + hkv) * d, hd))
    what = f"B{batch} S{seq} Hq{hq} Hkv{hkv} D{d} window {window} softcap {softcap}"
    for cap in (softcap, None) if cap_bites else (softcap,):
        ref_leaf = qkv.detach().double().requires_grad_()
        h = ref_leaf.view(batch, seq, hq + 2 * hkv, d)
        ref = document_attention_reference(h[:, :, :hq], h[:, :, hq:hq + hkv], h[:, :, hq + hkv:], starts, window,
                                           scale, softcap=cap)
        ref.backward(grad.double())
        pairs = [("output", out, ref)] + [(n, qkv.grad[..., lo:hi], ref_leaf.grad[..., lo:hi]) for n, lo, hi in grads]
        for name, got, want in pairs:
            if cap == softcap:
                assert_rel(got, want, dtype, f"{what}: {name}")
            else:  # a kernel that ignored the cap would be this far off
                err = rel_err(got, want)
                assert err > 10 * BOUNDS[dtype], f"{what}: {name} is within {err:.1e} of uncapped attention"


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


#: The interpreter's exp2 (numpy) warns where 2^x overflows to inf: the tanh of a large logit saturating to 1.
_EXP2_OVERFLOW = pytest.mark.filterwarnings("ignore:overflow encountered in exp2:RuntimeWarning")


@_EXP2_OVERFLOW
@pytest.mark.parametrize("batch,seq,hq,hkv,d,window,docs", [(2, 61, 4, 2, 16, None, True),
                                                            (2, 57, 3, 1, 24, 9, True),
                                                            (1, 45, 2, 1, 32, 13, False)])
def test_softcapped_attention_matches_float64_where_the_cap_bites(batch, seq, hq, hkv, d, window, docs):
    """Logits of a few times the cap (inputs of std 2: scale * q.k has std about 2.8 against a cap of 2): a mix of
    the tanh's linear and saturated ranges; GQA, packed documents, a window shorter than the sequence."""
    ids = _ids(batch, seq, seed=seq, max_doc=40) if docs else None
    _check(batch, seq, hq, hkv, d, torch.float32, window, ids, seed=seq, softcap=2.0, spread=2.0, cap_bites=True)


@_EXP2_OVERFLOW
def test_softcapped_attention_at_gemmas_cap_matches_float64():
    """Gemma 2's cap of 50 on logits mostly below it: the tanh near its linear range, where a tanh from exp2
    loses relative precision, still within the fp32 bound."""
    _check(2, 53, 4, 2, 16, torch.float32, 20, _ids(2, 53, seed=5), seed=3, softcap=50.0, spread=2.0)


@_EXP2_OVERFLOW
def test_bf16_softcapped_attention_is_within_the_bf16_bound():
    _check(2, 50, 4, 2, 32, torch.bfloat16, 17, _ids(2, 50, seed=4), seed=4, softcap=2.0, spread=2.0,
           cap_bites=True)


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
    with pytest.raises(ValueError, match="softcap must be a float > 0"):
        document_attention(q, q, q, starts, ends, softcap=0.0)


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
    torch.library.opcheck(torch.ops.ligermodels.doc_attention_fwd.default, (q, k, v, starts, 0, 0.25, 3.0),
                          test_utils=checks)
    o, lse = torch.ops.ligermodels.doc_attention_fwd(q, k, v, starts, 0, 0.25, 3.0)
    torch.library.opcheck(torch.ops.ligermodels.doc_attention_bwd.default,
                          (torch.randn_like(o), q, k, v, o, lse, starts, ends, 7, 0.25, 3.0), test_utils=checks)


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


def test_a_documents_bf16_output_depends_on_its_offset_in_the_row_only_through_the_block_grid():
    """The same document packed after another one: at an offset that is a multiple of the kernel's blocks (64
    tokens on a GPU, 16 in the interpreter) its bf16 output is bit for bit the same as at offset 0; at other offsets
    the key blocks split it elsewhere, the online softmax sums in another order, and some outputs move by about one
    bf16 step. (Why a preference step's bf16 log-probs can differ in the last bits from a reference pass that packed
    the same sequence elsewhere.)"""
    gen = torch.Generator().manual_seed(0)
    doc = [torch.randn(1, 150, h, 64, generator=gen).to(DEVICE, torch.bfloat16) for h in (2, 1, 1)]
    out = {}
    for before in (0, 37, 64):
        other = [torch.randn(1, before, h, 64, generator=gen).to(DEVICE, torch.bfloat16) for h in (2, 1, 1)]
        q, k, v = (torch.cat([o, d], 1) for o, d in zip(other, doc, strict=True))
        ids = torch.tensor([[0] * before + [1] * 150], device=DEVICE)
        starts, ends = document_bounds(ids, 1, before + 150, ids.device)
        out[before] = document_attention(q, k, v, starts, ends)[:, before:].float()
    assert torch.equal(out[64], out[0])
    step = (out[37] - out[0]).abs()
    assert 0 < step.max() <= 2 ** -8 * out[0].abs().max()  # within one bf16 step of the largest output
