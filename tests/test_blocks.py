"""Decoder blocks: a layer's fused path (norm + projection, in-place rotary) equals composing its modules.

Users build custom models from RMSNorm, Attention and MLP called one by one; the decoder layer runs
the norm together with the projection it feeds and rotates q/k inside the projection buffer. Both
must give the same values and gradients, with and without biases, in the first layer and later ones.
"""

import pytest
import torch

from ligermodels.blocks import DecoderLayer, RotaryEmbedding, init_linear_
from ligermodels.config import DecoderConfig
from ligermodels.rope import RopeConfig
from tests.utils import DEVICE, assert_rel, randn


@pytest.mark.parametrize("bias", [False, True], ids=["no_bias", "qkv_mlp_bias"])
@pytest.mark.parametrize("first", [True, False], ids=["first_layer", "later_layer"])
def test_decoder_layer_equals_its_modules_composed(bias, first):
    torch.manual_seed(0)
    c = DecoderConfig(vocab_size=50, hidden_size=96, intermediate_size=160, num_layers=1, num_heads=6,
                      num_kv_heads=2, head_dim=32, qkv_bias=bias, mlp_bias=bias,
                      rope=RopeConfig(theta=10000.0, head_dim=32))
    layer = DecoderLayer(c).to(DEVICE)
    init_linear_(layer, 0.2)
    with torch.no_grad():
        for norm in (layer.attn_norm, layer.mlp_norm):
            norm.weight.add_(randn(96, scale=0.1, seed=1))
    rotary = RotaryEmbedding(c.rope).to(DEVICE)
    cos, sin = rotary(torch.arange(7, device=DEVICE))
    x = randn(3, 7, 96, seed=2).requires_grad_()
    res = None if first else randn(3, 7, 96, seed=3).requires_grad_()
    g_out, g_res = randn(3, 7, 96, seed=4), randn(3, 7, 96, seed=5)
    leaves = [x] + ([] if first else [res]) + list(layer.parameters())

    out, new_res = layer(x, res, cos, sin)
    fused = (out, new_res, *torch.autograd.grad([out, new_res], leaves, [g_out, g_res]))

    if first:
        r1, h = x, layer.attn_norm(x)
    else:
        h, r1 = layer.attn_norm(x, res)
    h, r2 = layer.mlp_norm(layer.attn(h, cos, sin), r1)
    out2 = layer.mlp(h)
    composed = (out2, r2, *torch.autograd.grad([out2, r2], leaves, [g_out, g_res]))

    names = ["out", "residual", "dx"] + ([] if first else ["dres"]) + [n for n, _ in layer.named_parameters()]
    for name, a, b in zip(names, fused, composed, strict=True):
        assert_rel(a, b, torch.float32, name, bound=1e-6)


def test_a_rope_config_for_another_head_size_is_refused_when_the_config_is_built():
    with pytest.raises(ValueError, match=r"rope.head_dim 128 != head_dim 32: give RopeConfig\(head_dim=32"):
        DecoderConfig(vocab_size=64, hidden_size=128, intermediate_size=64, num_layers=1, num_heads=4,
                      rope=RopeConfig(theta=5e5))
