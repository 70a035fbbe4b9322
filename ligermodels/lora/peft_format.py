"""PEFT's file format for the adapters: ``save_lora`` / ``load_lora`` write and read ``adapter_config.json`` +
``adapter_model.safetensors`` as ``PeftModel.save_pretrained`` does, ``export_lora`` is a trainer's final export."""

from __future__ import annotations

import itertools
import json
import os

import torch
from torch import nn

from checkpoints_tools import read_json_object
from checkpoints_tools.keymap import KEYMAPS, expand, part_sizes
from checkpoints_tools.safetensors_io import copy_tokenizer_files
from ligermodels.blocks import MoE
from ligermodels.families import FAMILIES
from ligermodels.hf_io import save_hf_state
from ligermodels.lora.adapters import (
    EXPERT_TARGETS,
    PEFT_NAMES,
    LoRAError,
    LoRAExperts,
    LoRALinear,
    _all_adapters,
    _blocks,
    _refuse_merged,
    add_lora,
    expert_lora_modules,
    lora_modules,
    merge_lora_state,
)
from ligermodels.model import CausalLM

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
_PEFT_PREFIX = "base_model.model."
#: transformers 5's experts module of layer i, which PEFT's target_parameters adapt (Qwen3-MoE and Mixtral alike)
_PEFT_EXPERTS = "model.layers.{i}.mlp.experts"


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


def _check_uniform(mods: dict[str, LoRALinear | LoRAExperts]) -> tuple[int, float, float, bool]:
    settings = {(m.lora_r, m.lora_alpha, m.lora_dropout, m.lora_use_rslora) for m in mods.values()}
    if len(settings) != 1:
        raise LoRAError(f"save_lora: PEFT's format holds one (r, alpha, dropout, use_rslora) for all adapters; "
                        f"the model has {sorted(settings)}")
    return settings.pop()


def _expert_params(experts: dict[str, LoRAExperts]) -> list[str]:
    """Our expert targets present among ``experts``, in PEFT's nesting order."""
    present = {m.weight_name for m in experts.values()}
    return [t for t, (weight, _) in EXPERT_TARGETS.items() if weight in present]


def _expert_key(name: str, weight: str, params: list[str]) -> str:
    """PEFT's key stem of the adapter ``name`` (``layers.{i}.mlp.<weight>_lora``) on ``weight`` when ``params`` are
    the adapted expert weights: one ParamWrapper per weight on transformers' experts module, each later one wrapping
    the earlier, so the earlier ones sit under ``base_layer.`` once per wrapper outside them."""
    layer = int(name.split(".")[1])
    depth = len(params) - 1 - [EXPERT_TARGETS[t][0] for t in params].index(weight)
    return f"{_PEFT_PREFIX}{_PEFT_EXPERTS.format(i=layer)}" + ".base_layer" * depth


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
    experts = expert_lora_modules(model)
    if not mods and not experts:
        raise LoRAError("save_lora: the model has no LoRA adapters")
    r, alpha, dropout, rslora = _check_uniform({**mods, **experts})
    layout = _hf_layout(model)
    tensors, peft_targets = {}, set()
    params = _expert_params(experts)
    for name, m in experts.items():
        a = m.lora_A if state is None else state[f"{name}.lora_A"]
        b = m.lora_B if state is None else state[f"{name}.lora_B"]
        key = _expert_key(name, m.weight_name, params)
        tensors[f"{key}.lora_A.weight"] = a.detach().float().cpu().clone().contiguous()
        tensors[f"{key}.lora_B.weight"] = b.detach().float().cpu().clone().contiguous()
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
        "lora_dropout": dropout, "target_modules": sorted(peft_targets),
        "target_parameters": [f"mlp.experts.{EXPERT_TARGETS[t][1]}" for t in params] or None,
        "use_rslora": rslora, "bias": "none",
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
_PEFT_READ = {"peft_type", "r", "lora_alpha", "lora_dropout", "target_modules", "target_parameters", "use_rslora",
              "bias", "init_lora_weights"}
_PEFT_IGNORED = {"task_type", "base_model_name_or_path", "revision", "inference_mode", "peft_version",
                 "auto_mapping", "megatron_core", "qalora_group_size", "layers_pattern"}


def _read_peft_config(path: str) -> tuple[int, float, float, list[str], bool, list[str]]:
    """(r, alpha, dropout, PEFT target module names, use_rslora, our expert targets from ``target_parameters``) of
    a PEFT LoRA adapter_config.json; anything ligermodels does not implement refused by name."""
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
    params = cfg.get("target_parameters") or []
    by_peft = {peft: ours for ours, (_, peft) in EXPERT_TARGETS.items()}
    experts = []
    for name in params if isinstance(params, list) else [params]:
        last = name.rsplit(".", 1)[-1] if isinstance(name, str) else None
        if last not in by_peft or not (name == last or name.endswith("experts." + last)):
            raise LoRAError(f"{path}: target_parameters entry {name!r} is not supported (only the experts' "
                            f"{' and '.join(by_peft)}, e.g. 'mlp.experts.gate_up_proj')")
        experts.append(by_peft[last])
    experts = [t for t in EXPERT_TARGETS if t in experts]
    targets = cfg.get("target_modules") or ([] if experts else None)
    if not isinstance(targets, list) or not all(isinstance(t, str) for t in targets):
        raise LoRAError(f"{path}: target_modules={targets!r} is not supported (a list of module names is; "
                        "a regular expression or 'all-linear' is not)")
    return r, alpha, dropout, targets, bool(cfg.get("use_rslora", False)), experts


def load_lora(model: nn.Module, adapter_dir: str) -> nn.Module:
    """Attach the PEFT LoRA adapter in ``adapter_dir`` (``adapter_config.json`` + ``adapter_model.safetensors``,
    as ``PeftModel.save_pretrained`` writes) to ``model``: :func:`add_lora` with its settings, then its
    weights. Every key and shape is checked before the model is changed; an adapter for another
    architecture or shape, or with options ligermodels does not implement, is refused naming the culprit."""
    from safetensors import safe_open

    _refuse_merged(model, "load_lora")
    if _all_adapters(model):
        raise LoRAError("load_lora: the model already has LoRA adapters")
    r, alpha, dropout, peft_targets, rslora, experts = _read_peft_config(os.path.join(adapter_dir, ADAPTER_CONFIG))
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
    moe = [i for i, layer in enumerate(model.layers) if isinstance(layer.mlp, MoE)] if experts else []
    if experts and not moe:
        raise LoRAError(f"{adapter_dir}: target_parameters adapt experts, and this {model.config.model_type} model "
                        "has no mixture-of-experts layer")
    for i in moe:
        for t in experts:
            weight = EXPERT_TARGETS[t][0]
            name = f"layers.{i}.mlp.{weight}_lora"
            n_e, out, inp = getattr(model.layers[i].mlp, weight).shape
            key = _expert_key(name, weight, experts)
            expected[f"{key}.lora_A.weight"] = (name, None, None, (r * n_e, inp))
            expected[f"{key}.lora_B.weight"] = (name, None, None, (out, r * n_e))
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
    add_lora(model, r, alpha, dropout, [PEFT_NAMES[t] for t in peft_targets] + experts, rslora)
    mods = lora_modules(model)
    expert_mods = expert_lora_modules(model)
    with torch.no_grad():
        for key, (native, s, e, _) in expected.items():
            if native in expert_mods:
                m = expert_mods[native]
                (m.lora_A if ".lora_A." in key else m.lora_B).copy_(tensors[key])
                continue
            m = mods[native]
            _, a_rows, _, _, b_rows = next(blk for blk in _blocks(m) if blk[2:4] == (s, e))
            if ".lora_A." in key:
                m.lora_A[a_rows].copy_(tensors[key])
            else:
                m.lora_B[b_rows].copy_(tensors[key])
    return model



__all__ = ["save_lora", "load_lora", "export_lora"]
