"""ligermodels.rope: RopeConfig.from_hf, inv_freq and rope_cos_sin against transformers for every rope type."""

import pytest
import torch
from transformers import LlamaConfig, Phi3Config
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding
from transformers.models.phi3.modeling_phi3 import Phi3RotaryEmbedding

from ligermodels.rope import RopeConfig, cos_sin, inv_freq, rope_cos_sin

_LLAMA = {"hidden_size": 256, "num_attention_heads": 4, "max_position_embeddings": 512}  # head_dim 64
_PHI3 = {"hidden_size": 384, "num_attention_heads": 4, "max_position_embeddings": 256}  # head_dim 96


def _factors(n: int, lo: float, hi: float, seed: int) -> list[float]:
    g = torch.Generator().manual_seed(seed)
    return (lo + (hi - lo) * torch.rand(n, generator=g, dtype=torch.float64)).tolist()


# name -> (model, config.json-like dict). "model" picks the HF config / rotary-embedding classes.
CASES = {
    "default": ("llama", {**_LLAMA, "rope_theta": 500000.0}),
    "default_v5": ("llama", {**_LLAMA, "head_dim": 48, "rope_parameters": {"rope_type": "default", "rope_theta": 1e6}}),
    "default_partial_phi3": ("phi3", {**_PHI3, "partial_rotary_factor": 0.5}),
    "linear_old": ("llama", {**_LLAMA, "rope_theta": 10000.0, "rope_scaling": {"type": "linear", "factor": 2.5}}),
    "linear_v5": ("llama", {**_LLAMA, "rope_parameters": {"rope_type": "linear", "factor": 4.0, "rope_theta": 1e4}}),
    "dynamic": ("llama", {**_LLAMA, "rope_theta": 10000.0, "rope_scaling": {"rope_type": "dynamic", "factor": 3.0}}),
    "dynamic_odd_factor": ("llama", {**_LLAMA, "max_position_embeddings": 300,
                                     "rope_scaling": {"type": "dynamic", "factor": 1.7}}),
    "llama3": ("llama", {**_LLAMA, "max_position_embeddings": 4096, "rope_theta": 500000.0,
                         "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                          "high_freq_factor": 4.0, "original_max_position_embeddings": 512}}),
    "llama3_v5": ("llama", {**_LLAMA, "max_position_embeddings": 8192, "head_dim": 128,
                            "rope_parameters": {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 32.0,
                                                "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                                "original_max_position_embeddings": 256}}),
    "yarn": ("llama", {**_LLAMA, "rope_theta": 1e6, "rope_scaling": {"type": "yarn", "factor": 4.0,
                                                                      "original_max_position_embeddings": 128}}),
    "yarn_mscale": ("llama", {**_LLAMA, "max_position_embeddings": 2048,
                              "rope_parameters": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 16.0,
                                                  "original_max_position_embeddings": 128, "mscale": 0.707,
                                                  "mscale_all_dim": 1.0, "beta_fast": 24, "beta_slow": 2,
                                                  "truncate": False}}),
    "yarn_attention_factor": ("llama", {**_LLAMA, "rope_scaling": {"type": "yarn", "factor": 2.0,
                                                                   "attention_factor": 0.9,
                                                                   "original_max_position_embeddings": 256}}),
    "longrope_phi3": ("phi3", {**_PHI3, "original_max_position_embeddings": 64, "rope_theta": 10000.0,
                               "rope_scaling": {"type": "longrope", "short_factor": _factors(48, 1.0, 1.2, 1),
                                                "long_factor": _factors(48, 1.0, 8.0, 2)}}),
    "longrope_v5": ("llama", {**_LLAMA, "rope_parameters": {
        "rope_type": "longrope", "rope_theta": 10000.0, "factor": 8.0, "attention_factor": 1.1,
        "original_max_position_embeddings": 128, "short_factor": _factors(32, 1.0, 1.3, 3),
        "long_factor": _factors(32, 1.0, 6.0, 4)}}),
}


def _hf(name: str):
    model, d = CASES[name]
    d = {k: (dict(v) if isinstance(v, dict) else v) for k, v in d.items()}  # HF edits the dicts it is given
    return (LlamaConfig if model == "llama" else Phi3Config)(**d)


def _ours(name: str) -> RopeConfig:
    model, d = CASES[name]
    return RopeConfig.from_hf({**d, "model_type": model})


def _hf_init(name: str, seq_len=None):
    hf = _hf(name)
    rope_type = hf.rope_parameters["rope_type"]
    if rope_type == "default":
        cls = LlamaRotaryEmbedding if CASES[name][0] == "llama" else Phi3RotaryEmbedding
        return cls.compute_default_rope_parameters(hf)
    return ROPE_INIT_FUNCTIONS[rope_type](hf, None, seq_len=seq_len)


def _hf_cos_sin(name: str, position_ids: torch.Tensor, dtype: torch.dtype):
    """A freshly built HF rotary embedding called once (its dynamic / longrope update included)."""
    cls = LlamaRotaryEmbedding if CASES[name][0] == "llama" else Phi3RotaryEmbedding
    emb = cls(_hf(name))
    return emb(torch.zeros(1, dtype=dtype), position_ids)


def _assert_same(ours: torch.Tensor, theirs: torch.Tensor, what: str, exact: bool = True):
    """Bit-identical, or (``exact=False``) equal to within one fp32 ulp."""
    assert ours.dtype == theirs.dtype and ours.shape == theirs.shape, f"{what}: {ours.dtype}{tuple(ours.shape)}"
    if exact:
        diff = (ours.double() - theirs.double()).abs().max().item() if ours.numel() else 0.0
        assert torch.equal(ours, theirs), f"{what}: not bit-identical to transformers (max abs diff {diff:.3e})"
    else:
        torch.testing.assert_close(ours, theirs, rtol=2.4e-7, atol=0.0, msg=lambda m: f"{what}: {m}")


@pytest.mark.parametrize("name", list(CASES))
def test_inv_freq_and_scaling_match_transformers_init(name):
    cfg = _ours(name)
    inv, scaling = inv_freq(cfg)
    ref_inv, ref_scaling = _hf_init(name)
    assert inv.shape == (cfg.rotary_dim // 2,)
    _assert_same(inv, ref_inv, "inv_freq")
    assert scaling == pytest.approx(ref_scaling, rel=1e-12, abs=0.0)


@pytest.mark.parametrize("name", ["dynamic", "dynamic_odd_factor", "longrope_phi3", "longrope_v5"])
def test_seq_len_dependent_inv_freq_matches_transformers(name):
    cfg = _ours(name)
    limit = cfg.max_position_embeddings if cfg.rope_type == "dynamic" else cfg.original_max
    for seq_len in (1, limit, limit + 1, 3 * limit + 17):
        for s in (seq_len, torch.tensor(seq_len)):  # Python int, or a 0-d tensor (the traceable path)
            ref_inv, ref_scaling = _hf_init(name, seq_len=s)
            inv, scaling = inv_freq(cfg, seq_len=s)
            # dynamic with a Python int: HF's init function rescales the base in float64, while its forward
            # (and inv_freq, which mirrors the forward) passes a tensor and rescales in fp32 -> one ulp apart
            exact = not (cfg.rope_type == "dynamic" and isinstance(s, int))
            _assert_same(inv, ref_inv, f"inv_freq(seq_len={seq_len!r}, {type(s).__name__})", exact=exact)
            assert scaling == pytest.approx(ref_scaling, rel=1e-12, abs=0.0)


def _position_ids(batch: int, seq: int, max_pos: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    pos = torch.randint(0, max_pos, (batch, seq), generator=g)
    pos[0, 0] = max_pos - 1  # pin the largest position: it decides dynamic / longrope
    return pos


def _position_cases(cfg: RopeConfig) -> list[int]:
    """Largest positions + 1 to try: inside the pre-training length, at its edge and beyond it."""
    if cfg.rope_type == "dynamic":
        return [cfg.max_position_embeddings // 2, cfg.max_position_embeddings, 3 * cfg.max_position_embeddings + 5]
    if cfg.rope_type == "longrope":
        return [cfg.original_max // 2, cfg.original_max, cfg.original_max + 1, cfg.max_position_embeddings]
    return [cfg.max_position_embeddings]


@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cos_sin_match_transformers_rotary_embedding(name, dtype):
    cfg = _ours(name)
    for i, max_pos in enumerate(_position_cases(cfg)):
        pos = _position_ids(2, 33, max_pos, seed=i)
        ref_cos, ref_sin = _hf_cos_sin(name, pos, dtype)
        cos, sin = cos_sin(cfg, pos, dtype)
        assert cos.shape == (2, 33, cfg.rotary_dim)
        _assert_same(cos, ref_cos, f"cos (max position {max_pos - 1})")
        _assert_same(sin, ref_sin, f"sin (max position {max_pos - 1})")
        # the two-step API with an explicit seq_len, and (S,) positions shared by the batch
        inv, scaling = inv_freq(cfg, seq_len=int(pos.max()) + 1)
        cos2, sin2 = rope_cos_sin(inv, scaling, pos, dtype)
        assert torch.equal(cos2, cos) and torch.equal(sin2, sin)
        cos1, sin1 = rope_cos_sin(inv, scaling, pos[1], dtype)
        assert cos1.shape == (33, cfg.rotary_dim)
        assert torch.equal(cos1, cos[1]) and torch.equal(sin1, sin[1])


def test_longrope_picks_factor_by_largest_position():
    """HF v5 switches to long_factor when max(position_ids) + 1 > original_max_position_embeddings."""
    cfg = _ours("longrope_phi3")
    short, _ = inv_freq(cfg, seq_len=cfg.original_max)
    long, _ = inv_freq(cfg, seq_len=cfg.original_max + 1)
    base = 1.0 / cfg.theta ** (torch.arange(0, cfg.rotary_dim, 2).float() / cfg.rotary_dim)
    torch.testing.assert_close(short, base / torch.tensor(cfg.short_factor, dtype=torch.float32))
    torch.testing.assert_close(long, base / torch.tensor(cfg.long_factor, dtype=torch.float32))
    _, scaling = inv_freq(cfg)  # factor None: max_pos / original_max = 4 sets the attention factor
    assert scaling == pytest.approx((1 + torch.log(torch.tensor(4.0)).item() / torch.log(torch.tensor(64.0)).item())
                                    ** 0.5)


def test_from_hf_reads_old_and_v5_layouts_alike():
    old = RopeConfig.from_hf({**_LLAMA, "rope_theta": 5e5, "rope_scaling": {
        "type": "llama3", "factor": 8, "low_freq_factor": 1, "high_freq_factor": 4,
        "original_max_position_embeddings": 128}})
    new = RopeConfig.from_hf({**_LLAMA, "rope_parameters": {
        "rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 128}})
    assert old == new and hash(old) == hash(new)
    assert old.rope_type == "llama3" and old.theta == 5e5 and old.head_dim == 64 and old.rotary_dim == 64
    # an HF config object works too (through to_dict), and gives the same frequencies
    from_obj = RopeConfig.from_hf(_hf("yarn"))
    assert from_obj == _ours("yarn")
    # Phi-3: the top-level original_max_position_embeddings wins; legacy "su" / "yarn" mean longrope
    phi = dict(CASES["longrope_phi3"][1], model_type="phi3")
    for legacy in ("su", "yarn"):
        cfg = RopeConfig.from_hf({**phi, "rope_scaling": {**phi["rope_scaling"], "type": legacy}})
        assert cfg.rope_type == "longrope" and cfg.original_max == 64


@pytest.mark.parametrize("name", list(CASES))
def test_to_hf_round_trips_and_transformers_reads_it_alike(name):
    cfg = _ours(name)
    model = CASES[name][0]
    fields = {"hidden_size": cfg.head_dim * 4, "num_attention_heads": 4, "head_dim": cfg.head_dim,
              "max_position_embeddings": cfg.max_position_embeddings}
    d = cfg.to_hf()
    assert RopeConfig.from_hf({**fields, **d, "model_type": model}) == cfg
    hf = (LlamaConfig if model == "llama" else Phi3Config)(**fields, **d)
    cls = LlamaRotaryEmbedding if model == "llama" else Phi3RotaryEmbedding
    pos = _position_ids(1, 17, _position_cases(cfg)[-1], seed=3)
    ref_cos, ref_sin = cls(hf)(torch.zeros(1), pos)
    cos, sin = cos_sin(cfg, pos, torch.float32)
    _assert_same(cos, ref_cos, "cos")
    _assert_same(sin, ref_sin, "sin")


def test_from_hf_nested_rope_parameters_need_layer_type():
    d = {**_LLAMA, "rope_parameters": {"full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
                                       "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}}
    with pytest.raises(ValueError, match="layer_type"):
        RopeConfig.from_hf(d)
    assert RopeConfig.from_hf(d, layer_type="full_attention").factor == 8.0
    assert RopeConfig.from_hf(d, layer_type="sliding_attention").theta == 1e4


@pytest.mark.parametrize("bad", ["proportional", "mrope", "ntk-by-parts"])
def test_unsupported_rope_type_raises_naming_it(bad):
    with pytest.raises(ValueError, match=rf"rope_type.*'{bad}'|'{bad}'.*rope_type"):
        RopeConfig.from_hf({**_LLAMA, "rope_scaling": {"type": bad, "factor": 2.0}})
    with pytest.raises(ValueError, match=bad):
        RopeConfig.from_hf({**_LLAMA, "rope_parameters": {"rope_type": bad, "rope_theta": 1e4}})
    with pytest.raises(ValueError, match=bad):
        RopeConfig(rope_type=bad)


def test_missing_or_malformed_fields_raise():
    with pytest.raises(ValueError, match="factor"):
        RopeConfig(rope_type="linear")
    with pytest.raises(ValueError, match="short_factor"):
        RopeConfig(rope_type="longrope", head_dim=8, short_factor=(1.0,) * 3, long_factor=(1.0,) * 4)
    with pytest.raises(ValueError, match="even"):
        RopeConfig(head_dim=10, partial_rotary_factor=0.5)
