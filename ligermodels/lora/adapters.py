"""The adapters: :class:`LoRALinear` on the fused projections, :class:`LoRAExperts` on stacked experts; attaching
(:func:`add_lora`), switching off (:func:`adapters_disabled`) and folding them in (:func:`merge_lora`). The package
docstring (:mod:`ligermodels.lora`) says what they compute."""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator
from contextlib import contextmanager

import torch
from torch import nn

from kernels._common import compute_dtype
from kernels.low_rank import LowRank, lora_linear
from kernels.nf4 import NF4Tensor, dequantize_nf4
from ligermodels.blocks import MLP, Attention, MoE


class LoRAError(ValueError):
    """A LoRA request or a PEFT adapter that ligermodels cannot honour; the message names the culprit."""


def _q(a: Attention) -> int:
    return a.num_heads * a.head_dim


def _kv(a: Attention) -> int:
    return a.num_kv_heads * a.head_dim


def _i(m: MLP) -> int:
    return m.gate_up.out_features // 2


#: target -> (block class, projection attribute, the target's output rows [start, stop) of that projection)
TARGETS = {
    "q": (Attention, "qkv", lambda a: (0, _q(a))),
    "k": (Attention, "qkv", lambda a: (_q(a), _q(a) + _kv(a))),
    "v": (Attention, "qkv", lambda a: (_q(a) + _kv(a), _q(a) + 2 * _kv(a))),
    "qkv": (Attention, "qkv", lambda a: (0, a.qkv.out_features)),
    "o": (Attention, "o", lambda a: (0, a.o.out_features)),
    "gate": (MLP, "gate_up", lambda m: (0, _i(m))),
    "up": (MLP, "gate_up", lambda m: (_i(m), 2 * _i(m))),
    "gate_up": (MLP, "gate_up", lambda m: (0, 2 * _i(m))),
    "down": (MLP, "down", lambda m: (0, m.down.out_features)),
}
#: Expert targets: ours -> (the MoE block's stacked weight (E, out, in), PEFT's ``target_parameters`` name of it on
#: transformers 5's experts module ``model.layers.{i}.mlp.experts``, for Qwen3-MoE and Mixtral alike). In the order
#: transformers registers them, which is PEFT's nesting order (the first is the innermost wrapper).
EXPERT_TARGETS = {"experts_gate_up": ("experts_gate_up", "gate_up_proj"), "experts_down": ("experts_down", "down_proj")}
#: ``experts``: both.
EXPERT_ALIASES = {"experts": tuple(EXPERT_TARGETS)}
#: PEFT's (transformers') module names -> ours
PEFT_NAMES = {"q_proj": "q", "k_proj": "k", "v_proj": "v", "o_proj": "o", "gate_proj": "gate", "up_proj": "up",
              "down_proj": "down", "qkv_proj": "qkv", "gate_up_proj": "gate_up"}


class LoRALinear(nn.Linear):
    """A frozen projection (the base ``nn.Linear``'s own weight and bias Parameters) with LoRA adapters on
    some blocks of its output rows.

    ``lora_A`` (T*r, in) stacks the T targets' A matrices, ``lora_B`` (sum of widths, r) their B matrices,
    both fp32; target t writes output rows ``lora_slices[t]``. ``forward(x)`` is
    :func:`kernels.low_rank.lora_linear`; the fused blocks read :meth:`low_rank` instead.
    """

    def __init__(self, base: nn.Linear, targets: Iterable[str], slices: Iterable[tuple[int, int]], r: int,
                 alpha: float, dropout: float = 0.0, use_rslora: bool = False,
                 device: torch.device | str | None = None):
        nn.Module.__init__(self)
        self.in_features, self.out_features = base.in_features, base.out_features
        self.register_parameter("weight", base.weight)
        self.register_parameter("bias", base.bias)
        self.lora_targets = tuple(targets)
        self.lora_slices = tuple((int(s), int(e)) for s, e in slices)
        self.lora_r, self.lora_alpha, self.lora_dropout, self.lora_use_rslora = r, alpha, dropout, use_rslora
        self.lora_scale = alpha / (math.sqrt(r) if use_rslora else r)
        self.lora_enabled = True  # False inside adapters_disabled(): the frozen base alone
        self.fp8 = getattr(base, "fp8", None)  # the base projection's FP8 mode (CausalLM.use_fp8)
        device = base.weight.device if device is None else device
        width = sum(e - s for s, e in self.lora_slices)
        self.lora_A = nn.Parameter(torch.empty(len(self.lora_targets) * r, self.in_features, device=device))
        self.lora_B = nn.Parameter(torch.empty(width, r, device=device))
        self.reset_lora_parameters()
        self.train(base.training)

    def reset_lora_parameters(self) -> None:
        """PEFT's default init: each A Kaiming-uniform (a = sqrt(5)), B zero (the adapters start as a no-op)."""
        r = self.lora_r
        with torch.no_grad():
            for t in range(len(self.lora_targets)):
                nn.init.kaiming_uniform_(self.lora_A[t * r:(t + 1) * r], a=math.sqrt(5))
            self.lora_B.zero_()

    def low_rank(self) -> LowRank | None:
        """The adapters as :class:`kernels.low_rank.LowRank` (dropout only in training mode); None while disabled."""
        if not self.lora_enabled:
            return None
        return LowRank(self.lora_A, self.lora_B, self.lora_slices, self.lora_scale,
                       self.lora_dropout if self.training else 0.0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return lora_linear(x, self.weight, self.bias, self.low_rank(), self.fp8)

    @staticmethod
    def weight_key(name: str) -> str:
        """The state-dict key of the adapted weight, for this module's name ``name``."""
        return f"{name}.weight"

    def merge_into(self, w: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
        """W[s:e] += scale * B_t @ A_t for each target, in fp32 (fp64 for fp64 W), rounded once."""
        cd = compute_dtype(w.dtype)
        a, b = a.to(w.device, cd), b.to(w.device, cd)
        for _, a_rows, s, e, b_rows in _blocks(self):
            w[s:e] = (w[s:e].to(cd) + self.lora_scale * (b[b_rows] @ a[a_rows])).to(w.dtype)

    def extra_repr(self) -> str:
        return (f"{super().extra_repr()}, lora_targets={self.lora_targets}, r={self.lora_r}, "
                f"alpha={self.lora_alpha}, dropout={self.lora_dropout}, use_rslora={self.lora_use_rslora}")


class LoRAExperts(nn.Module):
    """LoRA adapters on a MoE block's stacked expert weight (E, out, in): expert e's weight is used as
    ``W_e + scale * B_e @ A_e``, PEFT's ``target_parameters`` LoRA (its ``ParamWrapper``).

    The Parameters are PEFT's, in its layout: ``lora_A`` (r*E, in), expert e's A in rows ``e*r .. e*r + r``;
    ``lora_B`` (out, r*E), column ``j*E + e`` expert e's column j; fp32. ``adapted(weight)`` returns the adapted
    stack in the weight's dtype (a ``baddbmm``, the factors cast to that dtype as PEFT casts them), which the
    experts' kernels then use as they use the frozen weight; gradients reach A and B through it. The adapted stack
    is as large as the weight it adapts and is kept for backward, as PEFT's is. No dropout: the update is applied to
    the weight, where an input dropout cannot act (PEFT refuses it too)."""

    def __init__(self, base: nn.Parameter, weight_name: str, r: int, alpha: float, use_rslora: bool = False,
                 device: torch.device | str | None = None):
        super().__init__()
        self.weight_name = weight_name  # the MoE block's attribute it adapts: experts_gate_up or experts_down
        experts, out_features, in_features = base.shape
        self.num_experts, self.in_features, self.out_features = experts, in_features, out_features
        self.lora_r, self.lora_alpha, self.lora_dropout, self.lora_use_rslora = r, alpha, 0.0, use_rslora
        self.lora_scale = alpha / (math.sqrt(r) if use_rslora else r)
        self.lora_enabled = True  # False inside adapters_disabled()
        device = base.device if device is None else device
        self.lora_A = nn.Parameter(torch.empty(r * experts, in_features, device=device))
        self.lora_B = nn.Parameter(torch.zeros(out_features, r * experts, device=device))
        with torch.no_grad():  # PEFT's init: A as one Linear(in, r*E), Kaiming-uniform (a = sqrt(5)); B zero
            nn.init.kaiming_uniform_(self.lora_A, a=math.sqrt(5))

    def factors(self, a: torch.Tensor | None = None, b: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """(B (E, out, r), A (E, r, in)) of ``lora_A`` / ``lora_B`` (or of the given tensors in their layout)."""
        a = self.lora_A if a is None else a
        b = self.lora_B if b is None else b
        e, r = self.num_experts, self.lora_r
        return b.reshape(self.out_features, r, e).permute(2, 0, 1), a.reshape(e, r, self.in_features)

    def adapted(self, weight: torch.Tensor) -> torch.Tensor:
        if not self.lora_enabled:
            return weight
        b, a = self.factors()
        return torch.baddbmm(weight, b.to(weight.dtype), a.to(weight.dtype), alpha=self.lora_scale)

    def weight_key(self, name: str) -> str:
        """The state-dict key of the adapted weight, for this module's name ``name`` (``layers.0.mlp.<w>_lora``)."""
        return f"{name.rpartition('.')[0]}.{self.weight_name}"

    def merge_into(self, w: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
        """W_e += scale * B_e @ A_e for every expert, in fp32 (fp64 for fp64 W), rounded once."""
        cd = compute_dtype(w.dtype)
        b, a = self.factors(a.to(w.device, cd), b.to(w.device, cd))
        w.copy_((w.to(cd) + self.lora_scale * torch.bmm(b, a)).to(w.dtype))

    def extra_repr(self) -> str:
        return (f"experts={self.num_experts}, in={self.in_features}, out={self.out_features}, r={self.lora_r}, "
                f"alpha={self.lora_alpha}, use_rslora={self.lora_use_rslora}")


# ------------------------------------------------------------------------------------ attach / merge
#: Name parts that wrappers insert (activation checkpointing, torch.compile, FSDP1) and state dicts drop.
_WRAPPER_PARTS = ("_checkpoint_wrapped_module.", "_orig_mod.", "_fsdp_wrapped_module.")


def _clean(name: str) -> str:
    for part in _WRAPPER_PARTS:
        name = name.replace(part, "")
    return name


def lora_modules(model: nn.Module) -> dict[str, LoRALinear]:
    """The adapted projections of ``model`` by their module names (``layers.0.attn.qkv`` ...; the parts
    wrappers insert, such as activation checkpointing's ``_checkpoint_wrapped_module``, left out as
    ``get_model_state_dict`` leaves them out)."""
    return {_clean(n): m for n, m in model.named_modules() if isinstance(m, LoRALinear)}


def expert_lora_modules(model: nn.Module) -> dict[str, LoRAExperts]:
    """The experts' adapters of ``model`` by module name (``layers.0.mlp.experts_gate_up_lora`` ...; the adapted
    weight is that name without ``_lora``)."""
    return {_clean(n): m for n, m in model.named_modules() if isinstance(m, LoRAExperts)}


def _all_adapters(model: nn.Module) -> dict[str, LoRALinear | LoRAExperts]:
    return {**lora_modules(model), **expert_lora_modules(model)}


@contextmanager
def adapters_disabled(model: nn.Module) -> Iterator[None]:
    """Inside, every LoRA projection and adapted expert stack of ``model`` computes its frozen base alone: the model
    before its adapters, with no second copy of the weights (a preference objective's reference model)."""
    mods = list(_all_adapters(model).values())
    for m in mods:
        m.lora_enabled = False
    try:
        yield
    finally:
        for m in mods:
            m.lora_enabled = True


def _refuse_merged(model: nn.Module, what: str) -> None:
    if getattr(model, "lora_merged", False):
        raise LoRAError(f"{what}: this model's LoRA adapters were already merged into its base weights "
                        "(merge_lora); save it with save_hf and load that checkpoint to start new adapters")


def normalize_targets(targets: str | Iterable[str]) -> list[str]:
    """Our target names for ``targets`` (ours or PEFT's; a string is one name), duplicates dropped; an unknown
    name or none at all raises :class:`LoRAError` (for a trainer to check its flags before building a model)."""
    if isinstance(targets, str):
        targets = [targets]
    out = []
    for t in targets:
        name = PEFT_NAMES.get(t, t)
        if name not in TARGETS and name not in EXPERT_TARGETS and name not in EXPERT_ALIASES:
            known = [*TARGETS, *EXPERT_ALIASES, *EXPERT_TARGETS]
            raise LoRAError(f"LoRA target {t!r} is not one of {', '.join(known)} (or PEFT's {', '.join(PEFT_NAMES)})")
        for n in EXPERT_ALIASES.get(name, (name,)):
            if n not in out:
                out.append(n)
    if not out:
        raise LoRAError("LoRA targets: none given")
    return out


def add_lora(model: nn.Module, r: int = 8, alpha: float = 16.0, dropout: float = 0.0,
             targets: str | Iterable[str] = ("q", "v"), use_rslora: bool = False,
             device: torch.device | str | None = None) -> nn.Module:
    """Freeze ``model`` and put LoRA adapters on the ``targets`` of every Attention / MLP block in it.

    Works on a ``CausalLM`` (from ``from_hf`` or from scratch) and on any module built from the blocks.

    Args:
        r: rank (a positive int); alpha: the scale is ``alpha / r`` (``alpha / sqrt(r)`` with ``use_rslora``).
        dropout: probability, on the adapters' input only, in training mode.
        targets: among q, k, v, o, gate, up, down, qkv, gate_up (or PEFT's q_proj ... down_proj, qkv_proj,
            gate_up_proj), and on mixture-of-experts blocks ``experts`` (= ``experts_gate_up`` and
            ``experts_down``: every expert's weights, :class:`LoRAExperts`; dropout must then be 0).
        device: where the adapters are created and their init drawn (default: each base weight's device); e.g.
            "cpu" draws the same init whatever device the base is on (move them after).
    Returns:
        ``model``, changed in place: every parameter frozen (``requires_grad`` False, dtype unchanged), the
        adapters (fp32, B zero) the only trainable parameters.
    """
    _refuse_merged(model, "add_lora")
    existing = _all_adapters(model)
    if existing:
        raise LoRAError(f"add_lora: the model already has LoRA adapters (on {', '.join(list(existing)[:4])} ...)")
    if isinstance(r, bool) or not isinstance(r, int) or r <= 0:
        raise LoRAError(f"add_lora: rank r must be a positive integer, got {r!r}")
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not math.isfinite(alpha):
        raise LoRAError(f"add_lora: alpha must be a finite number, got {alpha!r}")
    if isinstance(dropout, bool) or not isinstance(dropout, (int, float)) or not 0.0 <= dropout < 1.0:
        raise LoRAError(f"add_lora: dropout must be a probability in [0, 1), got {dropout!r}")
    names = normalize_targets(targets)
    experts = [t for t in names if t in EXPERT_TARGETS]
    names = [t for t in names if t not in EXPERT_TARGETS]
    if experts and dropout:
        raise LoRAError(f"add_lora: LoRA dropout ({dropout}) cannot act on the experts' adapters (their update is "
                        "added to the weights, as PEFT's target_parameters does, which refuses dropout too); use "
                        "dropout 0 or leave out the experts targets")
    plan = []  # (block, projection attribute, [(target, start, stop)])
    found = set(t for t in experts if any(isinstance(b, MoE) for b in model.modules()))
    for block in model.modules():
        per_proj: dict[str, list[tuple[str, int, int]]] = {}
        for t in names:
            cls, proj, rows = TARGETS[t]
            if isinstance(block, cls):
                per_proj.setdefault(proj, []).append((t, *rows(block)))
                found.add(t)
        for proj, parts in per_proj.items():
            parts.sort(key=lambda p: p[1])
            for (t0, _, e0), (t1, s1, _) in zip(parts, parts[1:], strict=False):
                if s1 < e0:
                    raise LoRAError(f"add_lora: targets {t0!r} and {t1!r} overlap on the {proj} projection")
            plan.append((block, proj, parts))
    missing = [t for t in names + experts if t not in found]
    if missing:
        kinds = {TARGETS[t][0].__name__ if t in TARGETS else MoE.__name__ for t in missing}
        hint = ("; its mixture-of-experts layers take the target 'experts'"
                if any(isinstance(b, MoE) for b in model.modules()) and not experts else "")
        raise LoRAError(f"add_lora: the model has no {' / '.join(missing)} projection to adapt (no "
                        f"{' or '.join(sorted(kinds))} block in it){hint}")
    for p in model.parameters():
        p.requires_grad_(False)
    for block, proj, parts in plan:
        base = getattr(block, proj)
        setattr(block, proj, LoRALinear(base, [p[0] for p in parts], [p[1:] for p in parts], r, float(alpha),
                                        float(dropout), bool(use_rslora), device))
    for block in [m for m in model.modules() if isinstance(m, MoE)]:
        for t in experts:
            weight = EXPERT_TARGETS[t][0]
            setattr(block, f"{weight}_lora", LoRAExperts(getattr(block, weight), weight, r, float(alpha),
                                                        bool(use_rslora), device))
    return model


def _blocks(m: LoRALinear):
    """(target, A's rows, output rows [s, e), B's rows) of each target of ``m``."""
    r, row = m.lora_r, 0
    for t, (name, (s, e)) in enumerate(zip(m.lora_targets, m.lora_slices, strict=True)):
        yield name, slice(t * r, (t + 1) * r), s, e, slice(row, row + e - s)
        row += e - s


def _replace(model: nn.Module, old: nn.Module, new: nn.Module) -> None:
    for name, m in model.named_modules():
        if m is old:
            parent, _, attr = name.rpartition(".")
            setattr(model.get_submodule(parent) if parent else model, attr, new)
            return


@torch.no_grad()
def merge_lora(model: nn.Module) -> nn.Module:
    """Fold the adapters into the base weights (W[s:e] += scale * B_t @ A_t, in fp32, rounded once to W's
    dtype) and put plain ``nn.Linear`` modules back, so ``state_dict`` / ``save_hf`` hold a plain checkpoint.

    The base weights stay frozen (``requires_grad_(True)`` them to train further). A 4-bit (NF4) base weight is
    dequantised first: the merged weight is dense. The model is marked merged: LoRA calls on it afterwards are
    refused.
    """
    _refuse_merged(model, "merge_lora")
    mods = _all_adapters(model)
    if not mods:
        raise LoRAError("merge_lora: the model has no LoRA adapters")
    for name, m in mods.items():
        parent = model.get_submodule(name.rpartition(".")[0])
        if isinstance(m, LoRAExperts):
            m.merge_into(getattr(parent, m.weight_name).data, m.lora_A, m.lora_B)
            setattr(parent, f"{m.weight_name}_lora", None)
            continue
        if isinstance(m.weight, NF4Tensor):  # a 4-bit base: merged into a dense copy of its values
            m.weight = nn.Parameter(m.weight.dequantize(), requires_grad=False)
        m.merge_into(m.weight, m.lora_A, m.lora_B)
        plain = nn.Linear(m.in_features, m.out_features, bias=m.bias is not None, device="meta")
        plain.weight, plain.bias = m.weight, m.bias
        plain.train(m.training)
        _replace(model, m, plain)
    model.lora_merged = True
    return model


@torch.no_grad()
def merge_lora_state(state: dict[str, torch.Tensor], model: nn.Module) -> dict[str, torch.Tensor]:
    """A full state dict (``get_model_state_dict(..., full_state_dict=True)`` of a model with adapters,
    e.g. gathered from FSDP) with the adapters folded into the base weights as :func:`merge_lora` folds
    them, and the ``lora_A`` / ``lora_B`` entries dropped: what ``save_hf_state`` writes as a plain
    checkpoint. ``model`` (any rank's, sharded or not) gives the adapters' layout; ``state`` is not modified."""
    _refuse_merged(model, "merge_lora_state")
    mods = _all_adapters(model)
    if not mods:
        raise LoRAError("merge_lora_state: the model has no LoRA adapters")
    out = {k: v for k, v in state.items() if not k.endswith((".lora_A", ".lora_B"))}
    for name, m in mods.items():
        weight = m.weight_key(name)
        missing = [k for k in (weight, f"{name}.lora_A", f"{name}.lora_B") if k not in state]
        if missing:
            raise LoRAError(f"merge_lora_state: the state dict lacks {missing}")
        w = out[weight] = dequantize_nf4(state[weight]).clone()  # an NF4 base: merged into its dense values
        m.merge_into(w, state[f"{name}.lora_A"], state[f"{name}.lora_B"])
    return out


def lora_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The adapters' tensors by native name (``layers.0.attn.qkv.lora_A`` ...), from ``model.state_dict()``
    (DTensors under FSDP: gather them for :func:`save_lora`'s ``state``)."""
    return {n: t for n, t in model.state_dict().items() if n.endswith((".lora_A", ".lora_B"))}


def trainable_parameters(model: nn.Module) -> list[nn.Parameter]:
    """The parameters that require a gradient: after :func:`add_lora`, the adapters only (what an
    optimiser should be given)."""
    return [p for p in model.parameters() if p.requires_grad]


__all__ = ["LoRAError", "LoRALinear", "LoRAExperts", "TARGETS", "EXPERT_TARGETS", "PEFT_NAMES", "add_lora",
           "normalize_targets", "merge_lora", "merge_lora_state", "lora_modules", "expert_lora_modules",
           "lora_state_dict", "trainable_parameters", "adapters_disabled"]
