"""kernels.decode_attention: one query token per row over a key/value cache, against a float64 reference, on both
of its launch paths (one split writing the output, several splits combined), with grouped-query heads, odd lengths
and head dims, and masks that leave whole splits empty."""

from __future__ import annotations

import pytest
import torch

from kernels import decode_attention
from kernels._common import sm_count
from kernels.decode_attention import _splits, _tiles, decode_attention_reference
from tests.utils import DEVICE, assert_rel, assert_triton_runs

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
#: (B, L, Hq, Hkv, D): GQA groups of 1, 3, 4, 6 and 8, head dims that are not powers of two and 256 (Gemma),
#: lengths that leave a partial tile.
SHAPES = [(2, 37, 4, 1, 24), (1, 200, 8, 2, 64), (3, 5, 9, 3, 16), (1, 130, 6, 1, 96), (2, 70, 4, 4, 128),
          (1, 75, 8, 1, 256)]


def _inputs(B, L, Hq, Hkv, D, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(*s, generator=g).to(DEVICE, dtype) for s in ((B, Hq, D), (B, L, Hkv, D), (B, L, Hkv, D)))
    return q, k, v


def _mask(B, L, kind, seed=0):
    g = torch.Generator().manual_seed(seed)
    if kind == "random":  # padding and past-the-query slots anywhere
        allowed = torch.rand(B, L, generator=g) < 0.6
        allowed[:, 0] = True
    elif kind == "tail":  # a sliding window at the end: the first splits hold no allowed slot
        allowed = torch.zeros(B, L, dtype=torch.bool)
        allowed[:, -3:] = True
    else:  # only the first slot: every later split is empty
        allowed = torch.zeros(B, L, dtype=torch.bool)
        allowed[:, 0] = True
    return allowed.to(DEVICE)


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("mask", ["random", "tail", "first"])
def test_decode_attention_matches_float64_reference(shape, dtype, mask):
    B, L, Hq, Hkv, D = shape
    q, k, v = _inputs(B, L, Hq, Hkv, D, dtype)
    allowed = _mask(B, L, mask)
    assert_triton_runs(q)
    with torch.no_grad():
        out = decode_attention(q, k, v, allowed, scale=0.7 * D ** -0.5)
    ref = decode_attention_reference(q.double(), k.double(), v.double(), allowed, scale=0.7 * D ** -0.5)
    assert out.dtype == dtype
    assert_rel(out, ref, dtype, f"decode attention {shape} {mask}")


def test_the_shapes_take_both_launch_paths():
    """One split (the output written by the split kernel) and several (their rows combined) are both covered."""
    splits = set()
    for B, L, _, Hkv, D in SHAPES:
        block_d, block_n = _tiles(D)
        n, chunk = _splits(B, Hkv, L, block_n, block_d, sm_count(DEVICE))
        assert (n - 1) * chunk < L <= n * chunk
        splits.add(n > 1)
    assert splits == {False, True}


@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_a_long_cache_of_one_kv_head_splits_into_as_many_tiles_as_the_combine_holds(head_dim):
    """132 multiprocessors, a batch of one, one kv head, 131072 slots: the split count stops at what the combine
    kernel holds in registers (64 at head dim 128, 32 at 256), and the splits still cover the cache once."""
    L = 131072
    block_d, block_n = _tiles(head_dim)
    n, chunk = _splits(1, 1, L, block_n, block_d, 132)
    assert n == 8192 // block_d and (n - 1) * chunk < L <= n * chunk
    assert _splits(1, 8, 384, 64, 128, 132) == (6, 64)  # Llama-3.2-1B's benchmark: one tile a split


def test_masked_slots_weigh_nothing_whatever_finite_values_they_hold():
    B, L, Hq, Hkv, D = 2, 150, 4, 2, 32
    q, k, v = _inputs(B, L, Hq, Hkv, D, torch.float32)
    allowed = _mask(B, L, "random")
    k2, v2 = k.clone(), v.clone()
    k2[~allowed], v2[~allowed] = 1e4, -3e4
    with torch.no_grad():
        assert torch.equal(decode_attention(q, k, v, allowed), decode_attention(q, k2, v2, allowed))


def test_bad_input_is_refused_with_the_reason():
    q, k, v = _inputs(1, 8, 4, 2, 16, torch.float32)
    allowed = torch.ones(1, 8, dtype=torch.bool, device=DEVICE)
    with pytest.raises(ValueError, match="allowed must be"):
        decode_attention(q, k, v, allowed.float())
    with pytest.raises(ValueError, match="kv heads dividing"):
        decode_attention(q[:, :3], k, v, allowed)
    with pytest.raises(ValueError, match="no backward"):
        decode_attention(q.requires_grad_(), k, v, allowed)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="torch.compile of Triton ops needs CUDA")
def test_decode_attention_compiles_without_graph_break_and_matches_eager():
    q, k, v = _inputs(2, 300, 8, 2, 64, torch.bfloat16)
    allowed = _mask(2, 300, "random")
    torch._dynamo.reset()
    with torch.no_grad():
        eager = decode_attention(q, k, v, allowed)
        compiled = torch.compile(decode_attention, fullgraph=True)(q, k, v, allowed)
    assert torch.equal(compiled, eager)


def test_the_decode_attention_op_passes_opcheck():
    """Its schema, fake (meta) implementation and dispatch hold, as torch.compile and CUDA graphs need them."""
    q, k, v = _inputs(2, 40, 4, 2, 16, torch.bfloat16)
    allowed = _mask(2, 40, "random")
    torch.library.opcheck(torch.ops.ligermodels.decode_attention.default, (q, k, v, allowed, 0.25))


def test_generation_reads_the_cache_through_the_kernel_at_every_decode_step(monkeypatch):
    """generate's decode steps (one token a row, no gradient) call decode_attention once a layer a step, with the
    cache buffers and the step's mask; the prefill does not."""
    import ligermodels.generation as generation
    from ligermodels import DecoderConfig, LigerLlama

    calls = []

    def counting(q, k, v, allowed, scale=None):
        calls.append((tuple(q.shape), tuple(k.shape), tuple(allowed.shape)))
        return decode_attention(q, k, v, allowed, scale)

    monkeypatch.setattr(generation, "decode_attention", counting)
    torch.manual_seed(0)
    cfg = DecoderConfig(vocab_size=64, hidden_size=64, intermediate_size=64, num_layers=2, num_heads=4,
                        num_kv_heads=2, max_position_embeddings=64)
    model = LigerLlama(cfg).init_weights(std=0.2).to(DEVICE).eval()
    ids = torch.randint(0, 64, (3, 5), generator=torch.Generator().manual_seed(0)).to(DEVICE)
    out = model.generate(ids, 4)
    assert out.shape == (3, 9)
    assert calls == [((3, 4, 16), (3, 9, 2, 16), (3, 9))] * (3 * 2)  # 3 decode steps (the prefill gives the first)
