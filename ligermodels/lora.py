"""LoRA adapters on the fused projections, saved and loaded in PEFT's format.

``add_lora(model, r, alpha, dropout, targets)`` freezes every parameter of ``model`` (kept in its
dtype, no fp32 copy) and replaces each targeted projection by a :class:`LoRALinear`: the same
weight and bias Parameters (so the native names do not change) plus two fp32 adapter Parameters,
``lora_A`` (T*r, in) and ``lora_B`` (sum of the targets' widths, r). Our projections are fused:
``attn.qkv`` holds q, k, v (stacked along its output), ``mlp.gate_up`` gate then up; an adapter on
q is a LoRA on qkv's output rows ``[0, q_size)``. All targets of one projection share its input,
so their A's are stacked and run as one GEMM (N, H) -> (N, T*r); each B writes its own output slice
(:mod:`kernels.low_rank`). Inside a decoder layer the adapters run inside the fused kernels' autograd
Functions (:func:`kernels.rms_norm_linear` for qkv and gate_up, :func:`kernels.glu_linear` for down),
which write the norm output / GLU activation again in backward for dA as they do for dW, and skip dW
for the frozen base weights.

Targets: ``q, k, v, o, gate, up, down`` (PEFT's ``q_proj`` ... ``down_proj`` accepted), and ``qkv`` /
``gate_up`` (a LoRA on the whole fused projection, as PEFT does on Phi-3's ``qkv_proj`` /
``gate_up_proj``). The math is PEFT's: ``out = base(x) + B(A(dropout(x))) * alpha / r`` (``alpha /
sqrt(r)`` with ``use_rslora``), dropout on the adapters' input only (one keep-mask shared by the targets
of one fused projection, where PEFT draws one per target), the low-rank term in fp32.

``save_lora`` / ``load_lora`` write and read PEFT's ``adapter_config.json`` +
``adapter_model.safetensors`` (keys ``base_model.model.model.layers.{i}.self_attn.q_proj.lora_A.weight``
...), so ``peft.PeftModel.from_pretrained(hf_model, dir)`` loads what ``save_lora`` wrote and
``load_lora`` reads what PEFT saved; ``merge_lora`` folds the adapters into the base weights (then
``save_hf`` writes a plain checkpoint).
"""

from __future__ import annotations

import itertools
import json
import math
import os
from collections.abc import Iterable, Iterator
from contextlib import contextmanager

import torch
from torch import nn

from checkpoints_tools import read_json_object
from checkpoints_tools.keymap import KEYMAPS, expand, part_sizes
from checkpoints_tools.safetensors_io import copy_tokenizer_files
from kernels.low_rank import LowRank, lora_linear
from ligermodels.blocks import MLP, Attention, MoE
from ligermodels.families import FAMILIES
from ligermodels.hf_io import save_hf_state
from ligermodels.model import CausalLM

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
_PEFT_PREFIX = "base_model.model."


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
                 alpha: float, dropout: float = 0.0, use_rslora: bool = False):
        nn.Module.__init__(self)
        self.in_features, self.out_features = base.in_features, base.out_features
        self.register_parameter("weight", base.weight)
        self.register_parameter("bias", base.bias)
        self.lora_targets = tuple(targets)
        self.lora_slices = tuple((int(s), int(e)) for s, e in slices)
        self.lora_r, self.lora_alpha, self.lora_dropout, self.lora_use_rslora = r, alpha, dropout, use_rslora
        self.lora_scale = alpha / (math.sqrt(r) if use_rslora else r)
        self.lora_enabled = True  # False inside adapters_disabled(): the frozen base alone
        device = base.weight.device
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
        return lora_linear(x, self.weight, self.bias, self.low_rank())

    def extra_repr(self) -> str:
        return (f"{super().extra_repr()}, lora_targets={self.lora_targets}, r={self.lora_r}, "
                f"alpha={self.lora_alpha}, dropout={self.lora_dropout}, use_rslora={self.lora_use_rslora}")


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


@contextmanager
def adapters_disabled(model: nn.Module) -> Iterator[None]:
    """Inside, every LoRA projection of ``model`` computes its frozen base alone: the model before its adapters,
    with no second copy of the weights (a preference objective's reference model)."""
    mods = list(lora_modules(model).values())
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
        if name not in TARGETS:
            raise LoRAError(f"LoRA target {t!r} is not one of {', '.join(TARGETS)} "
                            f"(or PEFT's {', '.join(PEFT_NAMES)})")
        if name not in out:
            out.append(name)
    if not out:
        raise LoRAError("LoRA targets: none given")
    return out


def add_lora(model: nn.Module, r: int = 8, alpha: float = 16.0, dropout: float = 0.0,
             targets: str | Iterable[str] = ("q", "v"), use_rslora: bool = False) -> nn.Module:
    """Freeze ``model`` and put LoRA adapters on the ``targets`` of every Attention / MLP block in it.

    Works on a ``CausalLM`` (from ``from_hf`` or from scratch) and on any module built from the blocks.

    Args:
        r: rank (a positive int); alpha: the scale is ``alpha / r`` (``alpha / sqrt(r)`` with ``use_rslora``).
        dropout: probability, on the adapters' input only, in training mode.
        targets: among q, k, v, o, gate, up, down, qkv, gate_up (or PEFT's q_proj ... down_proj, qkv_proj,
            gate_up_proj).
    Returns:
        ``model``, changed in place: every parameter frozen (``requires_grad`` False, dtype unchanged), the
        adapters (fp32, B zero) the only trainable parameters.
    """
    _refuse_merged(model, "add_lora")
    existing = lora_modules(model)
    if existing:
        raise LoRAError(f"add_lora: the model already has LoRA adapters (on {', '.join(list(existing)[:4])} ...)")
    if isinstance(r, bool) or not isinstance(r, int) or r <= 0:
        raise LoRAError(f"add_lora: rank r must be a positive integer, got {r!r}")
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not math.isfinite(alpha):
        raise LoRAError(f"add_lora: alpha must be a finite number, got {alpha!r}")
    if isinstance(dropout, bool) or not isinstance(dropout, (int, float)) or not 0.0 <= dropout < 1.0:
        raise LoRAError(f"add_lora: dropout must be a probability in [0, 1), got {dropout!r}")
    names = normalize_targets(targets)
    plan = []  # (block, projection attribute, [(target, start, stop)])
    found = set()
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
    missing = [t for t in names if t not in found]
    if missing:
        raise LoRAError(f"add_lora: the model has no {' / '.join(missing)} projection to adapt (no "
                        f"{' or '.join(sorted({TARGETS[t][0].__name__ for t in missing}))} block in it)")
    for p in model.parameters():
        p.requires_grad_(False)
    for block, proj, parts in plan:
        base = getattr(block, proj)
        setattr(block, proj, LoRALinear(base, [p[0] for p in parts], [p[1:] for p in parts], r, float(alpha),
                                        float(dropout), bool(use_rslora)))
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

    The base weights stay frozen (``requires_grad_(True)`` them to train further). The model is marked
    merged: LoRA calls on it afterwards are refused.
    """
    _refuse_merged(model, "merge_lora")
    mods = lora_modules(model)
    if not mods:
        raise LoRAError("merge_lora: the model has no LoRA adapters")
    for m in mods.values():
        _merge_into(m.weight, m.lora_A, m.lora_B, m)
        plain = nn.Linear(m.in_features, m.out_features, bias=m.bias is not None, device="meta")
        plain.weight, plain.bias = m.weight, m.bias
        plain.train(m.training)
        _replace(model, m, plain)
    model.lora_merged = True
    return model


def _merge_into(w: torch.Tensor, a: torch.Tensor, b: torch.Tensor, m: LoRALinear) -> None:
    """W[s:e] += scale * B_t @ A_t for each target of ``m``, in fp32 (fp64 for fp64 W), rounded once."""
    cd = torch.float64 if w.dtype == torch.float64 else torch.float32
    a, b = a.to(w.device, cd), b.to(w.device, cd)
    for _, a_rows, s, e, b_rows in _blocks(m):
        w[s:e] = (w[s:e].to(cd) + m.lora_scale * (b[b_rows] @ a[a_rows])).to(w.dtype)


@torch.no_grad()
def merge_lora_state(state: dict[str, torch.Tensor], model: nn.Module) -> dict[str, torch.Tensor]:
    """A full state dict (``get_model_state_dict(..., full_state_dict=True)`` of a model with adapters,
    e.g. gathered from FSDP) with the adapters folded into the base weights as :func:`merge_lora` folds
    them, and the ``lora_A`` / ``lora_B`` entries dropped: what ``save_hf_state`` writes as a plain
    checkpoint. ``model`` (any rank's, sharded or not) gives the adapters' layout; ``state`` is not modified."""
    _refuse_merged(model, "merge_lora_state")
    mods = lora_modules(model)
    if not mods:
        raise LoRAError("merge_lora_state: the model has no LoRA adapters")
    out = {k: v for k, v in state.items() if not k.endswith((".lora_A", ".lora_B"))}
    for name, m in mods.items():
        missing = [k for k in (f"{name}.weight", f"{name}.lora_A", f"{name}.lora_B") if k not in state]
        if missing:
            raise LoRAError(f"merge_lora_state: the state dict lacks {missing}")
        w = out[f"{name}.weight"] = state[f"{name}.weight"].clone()
        _merge_into(w, state[f"{name}.lora_A"], state[f"{name}.lora_B"], m)
    return out


def lora_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The adapters' tensors by native name (``layers.0.attn.qkv.lora_A`` ...), from ``model.state_dict()``
    (DTensors under FSDP: gather them for :func:`save_lora`'s ``state``)."""
    return {n: t for n, t in model.state_dict().items() if n.endswith((".lora_A", ".lora_B"))}


def trainable_parameters(model: nn.Module) -> list[nn.Parameter]:
    """The parameters that require a gradient: after :func:`add_lora`, the adapters only (what an
    optimiser should be given)."""
    return [p for p in model.parameters() if p.requires_grad]


# ------------------------------------------------------------------------------------------- PEFT
def _hf_layout(model: nn.Module) -> dict[str, list[tuple[str, int, int]]]:
    """Native projection name (``layers.{i}.attn.qkv``) -> its HF modules (``model.layers.{i}.self_attn.q_proj``)
    with their output rows [start, stop), from the family's checkpoint key map."""
    if not isinstance(model, CausalLM):
        raise LoRAError(f"PEFT adapters need a CausalLM (the PEFT names come from its layers), got "
                        f"{type(model).__name__}")
    config = model.config
    family = FAMILIES.get(config.model_type)
    if family is None:
        raise LoRAError(f"PEFT adapters: model_type {config.model_type!r} has no checkpoint key map "
                        f"(supported: {', '.join(sorted(FAMILIES))})")
    table = expand(KEYMAPS[family.keymap], config.num_layers)
    layout = {}
    for i in range(config.num_layers):
        for proj in ("attn.qkv", "attn.o", "mlp.gate_up", "mlp.down"):
            native = f"layers.{i}.{proj}"
            if proj.startswith("mlp.") and isinstance(model.layers[i].mlp, MoE):
                continue  # a mixture-of-experts layer: no dense MLP projections
            parts = table[f"{native}.weight"]
            sizes = part_sizes(f"{native}.weight", config.fused_part_sizes, len(parts),
                               model.get_submodule(native).out_features)
            starts = [0, *itertools.accumulate(sizes)]
            layout[native] = [(p.removesuffix(".weight"), s, s + n) for p, s, n in zip(parts, starts, sizes,
                                                                                        strict=False)]
    return layout


def _check_uniform(mods: dict[str, LoRALinear]) -> tuple[int, float, float, bool]:
    settings = {(m.lora_r, m.lora_alpha, m.lora_dropout, m.lora_use_rslora) for m in mods.values()}
    if len(settings) != 1:
        raise LoRAError(f"save_lora: PEFT's format holds one (r, alpha, dropout, use_rslora) for all adapters; "
                        f"the model has {sorted(settings)}")
    return settings.pop()


def save_lora(model: nn.Module, out_dir: str, state: dict[str, torch.Tensor] | None = None,
              tokenizer_from: str | None = None) -> None:
    """Write the adapters as PEFT does: ``adapter_config.json`` + ``adapter_model.safetensors`` (fp32), which
    ``peft.PeftModel.from_pretrained(transformers_model, out_dir)`` loads.

    Args:
        state: the adapters' full tensors by native name (:func:`lora_state_dict` gathered from FSDP); default:
            the model's own.
        tokenizer_from: a checkpoint directory whose tokenizer files are copied along (as ``save_hf`` does).
    """
    from safetensors.torch import save_file

    _refuse_merged(model, "save_lora")
    mods = lora_modules(model)
    if not mods:
        raise LoRAError("save_lora: the model has no LoRA adapters")
    r, alpha, dropout, rslora = _check_uniform(mods)
    layout = _hf_layout(model)
    tensors, peft_targets = {}, set()
    for name, m in mods.items():
        if name not in layout:
            raise LoRAError(f"save_lora: adapted projection {name} is not one of the model's layer projections")
        a = m.lora_A if state is None else state[f"{name}.lora_A"]
        b = m.lora_B if state is None else state[f"{name}.lora_B"]
        for target, a_rows, s, e, b_rows in _blocks(m):
            hf = next((h for h, hs, he in layout[name] if (hs, he) == (s, e)), None)
            if hf is None:
                raise LoRAError(f"save_lora: target {target!r} of {name} has no module of its own in a "
                                f"{model.config.model_type} checkpoint (its modules: "
                                f"{', '.join(h.rsplit('.', 1)[-1] for h, _, _ in layout[name])}); PEFT cannot "
                                "hold it")
            key = f"{_PEFT_PREFIX}{hf}"
            tensors[f"{key}.lora_A.weight"] = a[a_rows].detach().float().cpu().clone().contiguous()
            tensors[f"{key}.lora_B.weight"] = b[b_rows].detach().float().cpu().clone().contiguous()
            peft_targets.add(hf.rsplit(".", 1)[-1])
    config = {
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": getattr(model, "source_dir", None),
        "revision": None, "r": r, "lora_alpha": int(alpha) if float(alpha).is_integer() else alpha,
        "lora_dropout": dropout, "target_modules": sorted(peft_targets), "use_rslora": rslora, "bias": "none",
        "fan_in_fan_out": False, "modules_to_save": None, "use_dora": False, "init_lora_weights": True,
        "inference_mode": True, "rank_pattern": {}, "alpha_pattern": {}, "layers_to_transform": None,
        "layers_pattern": None,
    }
    os.makedirs(out_dir, exist_ok=True)
    if tokenizer_from:
        copy_tokenizer_files(tokenizer_from, out_dir)
    # each file written under a temporary name and renamed into place, the config last: it marks the adapter
    # complete
    tmp = os.path.join(out_dir, f".{ADAPTER_WEIGHTS}.tmp")
    save_file(tensors, tmp, metadata={"format": "pt"})
    os.replace(tmp, os.path.join(out_dir, ADAPTER_WEIGHTS))
    tmp = os.path.join(out_dir, f".{ADAPTER_CONFIG}.tmp")
    with open(tmp, "w") as f:
        json.dump(config, f, indent=2)
    os.replace(tmp, os.path.join(out_dir, ADAPTER_CONFIG))


def export_lora(model: nn.Module, state: dict[str, torch.Tensor], out_dir: str, merge: bool = False,
                tokenizer_from: str | None = None, dtype: torch.dtype | None = None) -> None:
    """A trainer's final export from a full state dict (``get_model_state_dict(model,
    StateDictOptions(full_state_dict=True, cpu_offload=True))``, called on every rank; this on rank 0 only).

    ``merge`` False: the adapters only, in PEFT's format (:func:`save_lora`), plus the tokenizer files of
    ``tokenizer_from``. ``merge`` True: the adapters folded into the base weights (:func:`merge_lora_state`),
    written as a plain HF checkpoint by :func:`ligermodels.hf_io.save_hf_state` (with the tokenizer files),
    each tensor cast to ``dtype`` when given.
    """
    if not merge:
        save_lora(model, out_dir, state={k: v for k, v in state.items() if k.endswith((".lora_A", ".lora_B"))},
                  tokenizer_from=tokenizer_from)
        return
    merged = merge_lora_state(state, model)
    if dtype is not None:
        merged = {k: v.to(dtype) for k, v in merged.items()}
    save_hf_state(merged, model.config, out_dir, copy_from=tokenizer_from)


#: adapter_config.json keys read here, and keys that do not change the math (metadata, defaults-only options)
_PEFT_READ = {"peft_type", "r", "lora_alpha", "lora_dropout", "target_modules", "use_rslora", "bias",
              "init_lora_weights"}
_PEFT_IGNORED = {"task_type", "base_model_name_or_path", "revision", "inference_mode", "peft_version",
                 "auto_mapping", "megatron_core", "qalora_group_size", "layers_pattern"}


def _read_peft_config(path: str) -> tuple[int, float, float, list[str], bool]:
    """(r, alpha, dropout, PEFT target names, use_rslora) of a PEFT LoRA adapter_config.json; anything
    ligermodels does not implement refused by name."""
    cfg = read_json_object(path, LoRAError, ADAPTER_CONFIG)
    if cfg.get("peft_type") != "LORA":
        raise LoRAError(f"{path}: peft_type {cfg.get('peft_type')!r} is not supported (only 'LORA')")
    for key, value in cfg.items():
        if key in _PEFT_READ or key in _PEFT_IGNORED:
            continue
        if value not in (None, False, {}, [], ""):
            raise LoRAError(f"{path}: {key}={value!r} is not supported by ligermodels' LoRA (plain LoRA on "
                            "q/k/v/o/gate/up/down only)")
    if cfg.get("bias", "none") != "none":
        raise LoRAError(f"{path}: bias={cfg['bias']!r} is not supported (only 'none')")
    init = cfg.get("init_lora_weights", True)
    if init not in (True, False, "gaussian"):
        raise LoRAError(f"{path}: init_lora_weights={init!r} is not supported (its adapters are relative to "
                        "changed base weights)")
    r, alpha, dropout = cfg.get("r", 8), cfg.get("lora_alpha", 8), cfg.get("lora_dropout", 0.0)
    if isinstance(r, bool) or not isinstance(r, int) or r <= 0:
        raise LoRAError(f"{path}: r must be a positive integer, got {r!r}")
    targets = cfg.get("target_modules")
    if not isinstance(targets, list) or not all(isinstance(t, str) for t in targets) or not targets:
        raise LoRAError(f"{path}: target_modules={targets!r} is not supported (a list of module names is; "
                        "a regular expression or 'all-linear' is not)")
    return r, alpha, dropout, targets, bool(cfg.get("use_rslora", False))


def load_lora(model: nn.Module, adapter_dir: str) -> nn.Module:
    """Attach the PEFT LoRA adapter in ``adapter_dir`` (``adapter_config.json`` + ``adapter_model.safetensors``,
    as ``PeftModel.save_pretrained`` writes) to ``model``: :func:`add_lora` with its settings, then its
    weights. Every key and shape is checked before the model is changed; an adapter for another
    architecture or shape, or with options ligermodels does not implement, is refused naming the culprit."""
    from safetensors import safe_open

    _refuse_merged(model, "load_lora")
    if lora_modules(model):
        raise LoRAError("load_lora: the model already has LoRA adapters")
    r, alpha, dropout, peft_targets, rslora = _read_peft_config(os.path.join(adapter_dir, ADAPTER_CONFIG))
    layout = _hf_layout(model)
    short = {h.rsplit(".", 1)[-1] for parts in layout.values() for h, _, _ in parts}
    bad = [t for t in peft_targets if t not in short or t not in PEFT_NAMES]
    if bad:
        raise LoRAError(f"{adapter_dir}: target_modules {bad} are not projections of this "
                        f"{model.config.model_type} model (its projections: {', '.join(sorted(short))})")
    # the tensors each adapted module must hold: key -> (native projection, hf row range, "A" or "B")
    expected = {}
    for native, parts in layout.items():
        lin = model.get_submodule(native)
        for hf, s, e in parts:
            if hf.rsplit(".", 1)[-1] in peft_targets:
                key = f"{_PEFT_PREFIX}{hf}"
                expected[f"{key}.lora_A.weight"] = (native, s, e, (r, lin.in_features))
                expected[f"{key}.lora_B.weight"] = (native, s, e, (e - s, r))
    path = os.path.join(adapter_dir, ADAPTER_WEIGHTS)
    if not os.path.isfile(path):
        raise LoRAError(f"{adapter_dir}: no {ADAPTER_WEIGHTS} (pickled adapter_model.bin files are not read)")
    tensors = {}
    with safe_open(path, framework="pt") as f:
        keys = set(f.keys())
        unexpected = sorted(keys - set(expected))
        missing = sorted(set(expected) - keys)
        if unexpected or missing:
            raise LoRAError(f"{path}: does not match this {model.config.model_type} model with "
                            f"{model.config.num_layers} layers and targets {peft_targets}: unexpected tensors "
                            f"{unexpected[:4]}, missing tensors {missing[:4]}")
        for key, (_, _, _, shape) in expected.items():
            t = f.get_tensor(key)
            if tuple(t.shape) != shape:
                raise LoRAError(f"{path}: {key} has shape {tuple(t.shape)}, this model needs {shape} (an adapter "
                                "for another architecture or shape?)")
            if not t.is_floating_point():
                raise LoRAError(f"{path}: {key} has dtype {t.dtype}, not a floating dtype")
            tensors[key] = t
    add_lora(model, r, alpha, dropout, [PEFT_NAMES[t] for t in peft_targets], rslora)
    mods = lora_modules(model)
    with torch.no_grad():
        for key, (native, s, e, _) in expected.items():
            m = mods[native]
            _, a_rows, _, _, b_rows = next(blk for blk in _blocks(m) if blk[2:4] == (s, e))
            if ".lora_A." in key:
                m.lora_A[a_rows].copy_(tensors[key])
            else:
                m.lora_B[b_rows].copy_(tensors[key])
    return model


__all__ = ["LoRAError", "LoRALinear", "TARGETS", "PEFT_NAMES", "add_lora", "normalize_targets", "merge_lora",
           "merge_lora_state", "export_lora", "save_lora", "load_lora", "lora_modules", "lora_state_dict",
           "trainable_parameters", "adapters_disabled"]
