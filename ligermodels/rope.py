"""Rotary frequencies from a model's rope configuration, in PyTorch: the one shared place every model uses.

Three steps, each mirroring what transformers (v5) computes, bit for bit where the arithmetic allows:

1. :meth:`RopeConfig.from_hf` reads a Hugging Face ``config.json`` dict (old layout: ``rope_theta`` +
   ``rope_scaling {"type" | "rope_type": ...}``; v5 layout: ``rope_parameters``) into a frozen
   :class:`RopeConfig`.
2. :func:`inv_freq` gives the inverse frequencies (rotary_dim/2,) fp32 and the attention scaling that
   multiplies cos and sin, for rope types default, linear, dynamic, llama3, yarn and longrope.
3. :func:`rope_cos_sin` turns positions into cos / sin (..., rotary_dim) in the model dtype, as the HF
   rotary embedding's forward does; :func:`cos_sin` chains 2 and 3 for a batch of position ids.

Sequence-length dependent types (how HF v5 does it, and what is mirrored here)
-----------------------------------------------------------------------------
HF's ``dynamic_rope_update`` wraps the rotary embedding's forward and, before each call, takes
``seq_len = max(position_ids) + 1`` -- the largest position in the whole batch plus one, not the
length of the forward's input (a packed batch whose documents restart at 0 counts its largest
position):

* ``longrope``: uses the ``long_factor`` frequencies when ``seq_len > original_max_position_embeddings``
  and the ``short_factor`` ones otherwise (``torch.where`` on the scalar, for every position of the
  call). The attention scaling does not depend on it: it comes from ``factor`` (or
  ``max_position_embeddings / original_max_position_embeddings``).
* ``dynamic`` (NTK): when ``seq_len > max_position_embeddings`` the base is rescaled to
  ``theta * (factor * seq_len / max_pos - (factor - 1)) ** (dim / (dim - 2))``, computed with
  ``seq_len`` as a tensor, i.e. in fp32 as HF's forward does; otherwise the frequencies of ``theta``.
  HF's module is stateful -- after growing it keeps the grown frequencies for shorter calls until
  ``seq_len`` drops below ``max_position_embeddings`` -- whereas :func:`inv_freq` is a pure function of
  ``seq_len``: it equals a freshly built HF module called once with those position ids.

Config quirks mirrored from HF: ``rope_scaling`` wins over ``rope_parameters`` when both are present;
for llama3 / yarn / longrope a top-level ``original_max_position_embeddings`` wins over the one in the
rope dict (Phi-3 stores it there; a Phi-3 config without it gets Phi3Config's default 4096); Phi-3's
legacy types ``"su"`` and ``"yarn"`` mean longrope (``"su"`` is read as longrope for any model).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

SUPPORTED_ROPE_TYPES = ("default", "linear", "dynamic", "llama3", "yarn", "longrope")

_USES_ORIGINAL_MAX = ("llama3", "yarn", "longrope")
_SCALING_FIELDS = ("factor", "low_freq_factor", "high_freq_factor", "beta_fast", "beta_slow", "mscale",
                   "mscale_all_dim", "attention_factor", "truncate", "short_factor", "long_factor")
_PHI3_ORIGINAL_MAX = 4096  # Phi3Config.original_max_position_embeddings default


@dataclass(frozen=True)
class RopeConfig:
    """Everything that determines the rotary frequencies of one model (immutable, hashable).

    ``head_dim`` is the attention head size; the rotary dim is ``int(head_dim * partial_rotary_factor)``.
    The scaling fields are used only by the rope types that read them (None: the type's default):

    * linear, dynamic: ``factor``.
    * llama3: ``factor``, ``low_freq_factor``, ``high_freq_factor``, ``original_max_position_embeddings``.
    * yarn: ``factor`` (None: max_pos / original_max), ``original_max_position_embeddings``, ``beta_fast``
      (32), ``beta_slow`` (1), ``mscale``, ``mscale_all_dim``, ``attention_factor``, ``truncate`` (True).
    * longrope: ``short_factor``, ``long_factor`` (rotary_dim/2 each), ``original_max_position_embeddings``,
      ``factor`` (None: max_pos / original_max), ``attention_factor``.

    ``original_max_position_embeddings`` None means ``max_position_embeddings`` (and is set so for the types
    that read it, as HF's standardisation does).
    """

    rope_type: str = "default"
    theta: float = 10000.0
    head_dim: int = 128
    max_position_embeddings: int = 2048
    partial_rotary_factor: float = 1.0
    factor: float | None = None
    low_freq_factor: float | None = None
    high_freq_factor: float | None = None
    original_max_position_embeddings: int | None = None
    beta_fast: float | None = None
    beta_slow: float | None = None
    mscale: float | None = None
    mscale_all_dim: float | None = None
    attention_factor: float | None = None
    truncate: bool | None = None
    short_factor: tuple[float, ...] | None = None
    long_factor: tuple[float, ...] | None = None

    def __post_init__(self) -> None:
        if self.rope_type not in SUPPORTED_ROPE_TYPES:
            raise ValueError(f"unsupported rope_type {self.rope_type!r} (field 'rope_type'); "
                             f"supported: {', '.join(SUPPORTED_ROPE_TYPES)}")
        for name in ("short_factor", "long_factor"):  # lists from JSON -> tuples, so the config stays hashable
            val = getattr(self, name)
            if val is not None and not isinstance(val, tuple):
                object.__setattr__(self, name, tuple(float(v) for v in val))
        if self.rope_type in _USES_ORIGINAL_MAX and self.original_max_position_embeddings is None:
            object.__setattr__(self, "original_max_position_embeddings", self.max_position_embeddings)
        if self.rotary_dim < 2 or self.rotary_dim % 2:
            raise ValueError(f"rotary dim int(head_dim * partial_rotary_factor) = {self.rotary_dim} must be even "
                             f"and >= 2 (head_dim={self.head_dim}, partial_rotary_factor={self.partial_rotary_factor})")
        required = {"linear": ("factor",), "dynamic": ("factor",),
                    "llama3": ("factor", "low_freq_factor", "high_freq_factor"),
                    "longrope": ("short_factor", "long_factor")}.get(self.rope_type, ())
        for name in required:
            if getattr(self, name) is None:
                raise ValueError(f"rope_type {self.rope_type!r} needs the field {name!r}")
        if self.rope_type == "longrope":
            for name in ("short_factor", "long_factor"):
                if len(getattr(self, name)) != self.rotary_dim // 2:
                    raise ValueError(f"longrope field {name!r} has {len(getattr(self, name))} entries, "
                                     f"expected rotary_dim / 2 = {self.rotary_dim // 2}")

    @property
    def rotary_dim(self) -> int:
        """Number of leading head dims that are rotated: ``int(head_dim * partial_rotary_factor)``."""
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def original_max(self) -> int:
        """Pre-training context length: ``original_max_position_embeddings``, else ``max_position_embeddings``."""
        om = self.original_max_position_embeddings
        return self.max_position_embeddings if om is None else om

    @classmethod
    def from_hf(cls, hf_config: Mapping[str, Any] | Any, layer_type: str | None = None) -> RopeConfig:
        """Read a Hugging Face config (a ``config.json`` dict, or a config object with ``to_dict()``).

        Reads both layouts: old ``rope_theta`` + ``rope_scaling`` (``"type"`` or ``"rope_type"``) and v5
        ``rope_parameters`` (with ``rope_theta`` inside). ``layer_type`` picks one entry of a
        ``rope_parameters`` nested by layer type (e.g. ``"sliding_attention"``). Raises ValueError naming
        the field for an unsupported rope type.
        """
        d = dict(hf_config.to_dict() if hasattr(hf_config, "to_dict") else hf_config)
        params = d.get("rope_scaling") or d.get("rope_parameters") or {}
        if params and all(isinstance(v, Mapping) or v is None for v in params.values()):  # nested by layer type
            if layer_type is None:
                raise ValueError(f"rope_parameters is nested by layer type ({sorted(params)}): pass layer_type")
            params = params[layer_type] or {}
        params = dict(params)

        rope_type = params.get("rope_type", params.get("type", "default"))
        if rope_type == "su" or (rope_type == "yarn" and d.get("model_type") == "phi3"):
            rope_type = "longrope"
        if rope_type not in SUPPORTED_ROPE_TYPES:
            raise ValueError(f"unsupported rope_type {rope_type!r} in the config's rope_parameters/rope_scaling "
                             f"field 'rope_type'; supported: {', '.join(SUPPORTED_ROPE_TYPES)}")

        theta = params.get("rope_theta")
        if theta is None:
            theta = d.get("rope_theta")
        partial = params.get("partial_rotary_factor")
        if partial is None:
            partial = d.get("partial_rotary_factor")
        head_dim = d.get("head_dim") or d["hidden_size"] // d["num_attention_heads"]
        max_pos = int(d.get("max_position_embeddings", 2048))

        original_max = None
        if rope_type in _USES_ORIGINAL_MAX:
            if d.get("original_max_position_embeddings") is not None:
                original_max = d["original_max_position_embeddings"]
            elif d.get("model_type") == "phi3":
                original_max = _PHI3_ORIGINAL_MAX
            else:
                original_max = params.get("original_max_position_embeddings", max_pos)
            original_max = int(original_max)

        def num(name: str) -> float | None:
            v = params.get(name)
            return None if v is None else float(v)

        def seq(name: str) -> tuple[float, ...] | None:
            v = params.get(name)
            return None if v is None else tuple(float(x) for x in v)

        return cls(
            rope_type=rope_type,
            theta=float(10000.0 if theta is None else theta),
            head_dim=int(head_dim),
            max_position_embeddings=max_pos,
            partial_rotary_factor=float(1.0 if partial is None else partial),
            factor=num("factor"),
            low_freq_factor=num("low_freq_factor"),
            high_freq_factor=num("high_freq_factor"),
            original_max_position_embeddings=original_max,
            beta_fast=num("beta_fast"),
            beta_slow=num("beta_slow"),
            mscale=num("mscale"),
            mscale_all_dim=num("mscale_all_dim"),
            attention_factor=num("attention_factor"),
            truncate=None if params.get("truncate") is None else bool(params["truncate"]),
            short_factor=seq("short_factor"),
            long_factor=seq("long_factor"),
        )


    def to_hf(self) -> dict[str, Any]:
        """The config.json fields of this rope (``head_dim`` and ``max_position_embeddings`` excluded: they are
        model fields). Old layout -- ``rope_theta`` + ``rope_scaling`` (None for default) -- which transformers
        v4 and v5 both read; ``original_max_position_embeddings`` also top-level, where HF (and Phi-3) look
        first. ``RopeConfig.from_hf({**model_fields, **cfg.to_hf()}) == cfg``.
        """
        out: dict[str, Any] = {"rope_theta": self.theta, "rope_scaling": None}
        if self.partial_rotary_factor != 1.0:
            out["partial_rotary_factor"] = self.partial_rotary_factor
        if self.rope_type != "default":
            scaling: dict[str, Any] = {"rope_type": self.rope_type}
            for name in _SCALING_FIELDS:
                val = getattr(self, name)
                if val is not None:
                    scaling[name] = list(val) if isinstance(val, tuple) else val
            if self.rope_type in _USES_ORIGINAL_MAX:
                scaling["original_max_position_embeddings"] = self.original_max
                out["original_max_position_embeddings"] = self.original_max
            out["rope_scaling"] = scaling
        return out


# ----------------------------------------------------------------------------------- frequencies
def _exponents(dim: int, device) -> torch.Tensor:
    """(dim/2,) fp32: 0, 2, 4, ... divided by dim -- the exponents of theta."""
    return torch.arange(0, dim, 2, dtype=torch.int64, device=device).float() / dim


def _theta_inv_freq(base: float | torch.Tensor, dim: int, device) -> torch.Tensor:
    return 1.0 / (base ** _exponents(dim, device))


def _llama3(cfg: RopeConfig, device) -> torch.Tensor:
    """Llama 3.1: long wavelengths divided by ``factor``, short ones kept, a smooth blend between."""
    inv = _theta_inv_freq(cfg.theta, cfg.rotary_dim, device)
    factor, low, high, ctx = cfg.factor, cfg.low_freq_factor, cfg.high_freq_factor, cfg.original_max
    low_wavelen, high_wavelen = ctx / low, ctx / high
    wavelen = 2 * math.pi / inv
    scaled = torch.where(wavelen > low_wavelen, inv / factor, inv)
    smooth = (ctx / wavelen - low) / (high - low)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(medium, blended, scaled)


def _yarn_factor(cfg: RopeConfig) -> float:
    return cfg.factor if cfg.factor is not None else cfg.max_position_embeddings / cfg.original_max


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _yarn(cfg: RopeConfig, device) -> tuple[torch.Tensor, float]:
    """YaRN: per-dimension blend of interpolated (/factor) and original frequencies, plus an mscale on cos/sin."""
    dim, base, factor = cfg.rotary_dim, cfg.theta, _yarn_factor(cfg)
    attention = cfg.attention_factor
    if attention is None:
        if cfg.mscale and cfg.mscale_all_dim:
            attention = float(_yarn_mscale(factor, cfg.mscale) / _yarn_mscale(factor, cfg.mscale_all_dim))
        else:
            attention = _yarn_mscale(factor)
    beta_fast = cfg.beta_fast or 32
    beta_slow = cfg.beta_slow or 1
    truncate = True if cfg.truncate is None else cfg.truncate

    def correction_dim(rotations: float) -> float:  # the dim whose wavelength fits `rotations` times in the context
        return (dim * math.log(cfg.original_max / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001

    pos_freqs = base ** (torch.arange(0, dim, 2).to(device=device, dtype=torch.float) / dim)
    extrapolation, interpolation = 1.0 / pos_freqs, 1.0 / (factor * pos_freqs)
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    keep = 1 - ramp.to(device=device, dtype=torch.float)  # weight of the original (extrapolated) frequency
    return interpolation * (1 - keep) + extrapolation * keep, attention


def _longrope_attention(cfg: RopeConfig) -> float:
    if cfg.attention_factor is not None:
        return cfg.attention_factor
    factor = cfg.factor if cfg.factor is not None else cfg.max_position_embeddings / cfg.original_max
    return 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(cfg.original_max))


def _longrope(cfg: RopeConfig, ext: Sequence[float], device) -> torch.Tensor:
    ext_t = torch.tensor(ext, dtype=torch.float32, device=device)
    return 1.0 / (ext_t * cfg.theta ** _exponents(cfg.rotary_dim, device))


def _dynamic_grown(cfg: RopeConfig, seq_len: torch.Tensor, device) -> torch.Tensor:
    """NTK frequencies for a (0-d integer tensor) ``seq_len``, clamped below at max_position_embeddings, in fp32."""
    dim, max_pos, factor = cfg.rotary_dim, cfg.max_position_embeddings, cfg.factor
    seq_len = torch.maximum(seq_len, torch.tensor(max_pos, dtype=seq_len.dtype, device=seq_len.device))
    base = cfg.theta * ((factor * seq_len / max_pos) - (factor - 1)) ** (dim / (dim - 2))
    return _theta_inv_freq(base.to(device), dim, device)


def inv_freq(cfg: RopeConfig, seq_len: int | torch.Tensor | None = None,
             device: torch.device | str | None = None) -> tuple[torch.Tensor, float]:
    """Inverse frequencies and attention scaling of ``cfg``, as transformers computes them.

    Args:
        cfg: the rope configuration.
        seq_len: ``max(position_ids) + 1`` of the call, for the types that depend on it (dynamic, longrope;
            see the module docstring); None means "within the pre-training length". An int, or a 0-d
            integer tensor (then the choice is made with ``torch.where``: traceable, no host sync).
        device: where to build the frequencies (default: seq_len's device if a tensor, else CPU).
    Returns:
        (inv_freq fp32 of shape (rotary_dim/2,), attention_scaling): cos and sin are multiplied by the latter.
    """
    if isinstance(seq_len, torch.Tensor) and device is None:
        device = seq_len.device
    t = cfg.rope_type
    base_inv = None
    if t in ("default", "linear"):
        base_inv = _theta_inv_freq(cfg.theta, cfg.rotary_dim, device)
    elif t == "dynamic":  # the base HF builds at init (seq_len = max_pos, in Python floats): theta up to rounding
        f, dim, m = cfg.factor, cfg.rotary_dim, cfg.max_position_embeddings
        base_inv = _theta_inv_freq(cfg.theta * ((f * m / m) - (f - 1)) ** (dim / (dim - 2)), dim, device)
    if t == "default":
        return base_inv, 1.0
    if t == "linear":
        return base_inv / cfg.factor, 1.0
    if t == "llama3":
        return _llama3(cfg, device), 1.0
    if t == "yarn":
        return _yarn(cfg, device)
    if t == "dynamic":
        if seq_len is None or (not isinstance(seq_len, torch.Tensor) and seq_len <= cfg.max_position_embeddings):
            return base_inv, 1.0
        s = seq_len if isinstance(seq_len, torch.Tensor) else torch.tensor(int(seq_len))
        s = s.to(torch.int64).reshape(())
        grown = _dynamic_grown(cfg, s, device)  # rescaled in fp32 from a tensor seq_len, as HF's forward does
        if not isinstance(seq_len, torch.Tensor):
            return grown, 1.0
        return torch.where(s.to(grown.device) > cfg.max_position_embeddings, grown, base_inv), 1.0
    # longrope
    attention = _longrope_attention(cfg)
    short = _longrope(cfg, cfg.short_factor, device)
    if seq_len is None:
        return short, attention
    long = _longrope(cfg, cfg.long_factor, device)
    if not isinstance(seq_len, torch.Tensor):
        return (long if int(seq_len) > cfg.original_max else short), attention
    return torch.where(seq_len.reshape(()).to(long.device) > cfg.original_max, long, short), attention


def rope_cos_sin(inv_freq: torch.Tensor, attention_scaling: float, position_ids: torch.Tensor,
                 dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of ``position_ids * inv_freq``, duplicated over the two halves, as HF's rotary forward.

    Args:
        inv_freq: (rotary_dim/2,) from :func:`inv_freq`.
        attention_scaling: multiplies cos and sin (1.0 except yarn / longrope).
        position_ids: (B, S) per-token positions, or (S,) shared by the batch; any integer dtype.
    Returns:
        (cos, sin), each (B, S, rotary_dim) or (S, rotary_dim) in ``dtype``, on position_ids' device;
        computed in fp32 (outer product, cos / sin, scaling) and cast once.
    """
    freqs = position_ids[..., None].float() * inv_freq.to(device=position_ids.device, dtype=torch.float)
    emb = torch.cat((freqs, freqs), dim=-1)
    return (emb.cos() * attention_scaling).to(dtype), (emb.sin() * attention_scaling).to(dtype)


def cos_sin(cfg: RopeConfig, position_ids: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos / sin for one forward call: :func:`inv_freq` (with ``seq_len = max(position_ids) + 1`` for the
    dynamic and longrope types, on the device, without a host sync) then :func:`rope_cos_sin`.

    Shapes as in :func:`rope_cos_sin`. Equals a fresh HF rotary embedding called with these position ids.
    """
    seq_len = position_ids.max() + 1 if cfg.rope_type in ("dynamic", "longrope") and position_ids.numel() else None
    inv, scaling = inv_freq(cfg, seq_len=seq_len, device=position_ids.device)
    return rope_cos_sin(inv, scaling, position_ids, dtype)
