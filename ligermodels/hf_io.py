"""Hugging Face checkpoints <-> models: ``from_hf`` and ``save_hf`` (safetensors only).

A family (``ligermodels.families``) reads the checkpoint's ``config.json`` into a :class:`DecoderConfig` and
names its key map (``checkpoints_tools.keymap``): native parameter name -> the HF tensors it is made of.

Loading builds the model on the meta device, checks every planned tensor's presence, shape and dtype
from the safetensors headers (and refuses unexpected ones), allocates the model once on the target
device and dtype, and copies tensors in one at a time from memory-mapped files: host memory never holds
a second copy of the model. Saving splits fused tensors back into their HF parts and writes them with
:func:`checkpoints_tools.write_checkpoint` (a temporary directory renamed into place).
"""

from __future__ import annotations

import os
import re
import warnings
from collections.abc import Callable, Iterator

import torch

from checkpoints_tools import CheckpointError, CheckpointReader, read_config, resolve, to_dtype, write_checkpoint
from checkpoints_tools.keymap import IGNORED_HF, native_to_hf, part_sizes
from checkpoints_tools.safetensors_io import check_replaceable
from kernels.nf4 import dequantize_nf4, quantize_nf4
from ligermodels.config import DecoderConfig
from ligermodels.families import Family, config_to_hf, family_of
from ligermodels.model import CausalLM


def _checked_config(directory: str, repo_or_dir: str, expect: type[CausalLM] | None
                    ) -> tuple[dict, Family, DecoderConfig]:
    """(config.json dict, family, native config) of a checkpoint directory; refuses a checkpoint stored
    quantised, an unsupported model type, a config the family cannot read, and a family other than ``expect``'s."""
    hf_cfg = read_config(directory)
    quantized = hf_cfg.get("quantization_config")
    if quantized:
        method = quantized.get("quant_method", "an unnamed method") if isinstance(quantized, dict) else quantized
        raise CheckpointError(f"{repo_or_dir!r} is stored quantised ({method!r}, config.json quantization_config): "
                              "ligermodels loads unquantised safetensors (from_hf(..., quantize='nf4') quantises "
                              "one while loading)")
    family = family_of(hf_cfg.get("model_type"))
    if expect is not None and expect is not CausalLM and getattr(expect, "model_type", None) != family.cls.model_type:
        raise CheckpointError(f"{repo_or_dir!r} is a {family.model_type!r} checkpoint, not {expect.model_type!r}: "
                              f"use {family.cls.__name__} or AutoLigerModel")
    return hf_cfg, family, family.read_config(hf_cfg)


def load_hf(repo_or_dir: str, dtype: torch.dtype | str | None = None, device: str | torch.device | None = None,
            revision: str | None = None, expect: type[CausalLM] | None = None,
            quantize: str | None = None, each_layer: Callable[[CausalLM, int], None] | None = None) -> CausalLM:
    """Load an HF checkpoint into the family's model class (what ``CausalLM.from_hf`` calls).

    Args:
        repo_or_dir: local directory, or hub repo id (only safetensors/json/tokenizer files are fetched).
        dtype: parameter dtype; default the checkpoint's ``dtype``/``torch_dtype`` from config.json, else
            the dtype its weights are stored in (transformers' ``dtype="auto"``).
        device: target device (default CPU). Weights go straight there, one tensor at a time.
        expect: a family class (e.g. LigerQwen2); loading a checkpoint of another family is an error.
        quantize: None, or "nf4": the decoder layers' projections (q/k/v, o, gate/up, down) stored in NF4 with
            double-quantised block maxima (:mod:`kernels.nf4`, bitsandbytes' QLoRA format), frozen, for LoRA on a
            4-bit base; embeddings, norms and the head stay in ``dtype`` (as transformers + bitsandbytes leave
            them). Each weight is read, cast to ``dtype`` and quantised on ``device`` one at a time: neither the
            host nor the device holds the dense model.
        each_layer: called as ``each_layer(model, i)`` once decoder layer ``i``'s weights are in place, layer by
            layer, before the next layer's are read (the weights outside the layers come first); with
            ``quantize``, a caller that shards each layer there (``ligermodels.train``'s QLoRA under FSDP2) never
            holds more than one layer's weights whole. Nothing here keeps a reference to a layer's weights after
            its call.
    Returns:
        The model in eval mode, with ``source_dir`` set to the checkpoint's directory.

    A hub repo's config.json is fetched and checked (family, ``expect``) before its weights download.
    """
    if quantize is not None:
        _check_quantize(quantize, None, "from_hf")
    directory = resolve(repo_or_dir, revision, check=lambda d: _checked_config(d, repo_or_dir, expect))
    hf_cfg, family, config = _checked_config(directory, repo_or_dir, expect)
    if quantize is not None:
        _check_quantize(quantize, config, repr(repo_or_dir), CheckpointError)
    try:
        cfg_dtype = to_dtype(hf_cfg.get("dtype") or hf_cfg.get("torch_dtype")) if dtype is None else None
    except ValueError as e:
        raise CheckpointError(f"{directory}/config.json: field dtype/torch_dtype: {e}; pass dtype= explicitly") from e
    dtype = to_dtype(dtype) or cfg_dtype  # None: the dtype of the stored weights, read from the headers below
    device = torch.device(device or "cpu")

    with torch.device("meta"):
        model = family.cls(config)
    # each parameter as rows: a 3-D one (stacked experts) is read as its (E * rows, columns) view
    shapes = {name: _rows_shape(p.shape) for name, p in model.named_parameters()}
    plan = native_to_hf(list(shapes), config.num_layers, family.keymap, config.num_experts)
    with CheckpointReader(directory) as reader:
        missing = sorted({p for parts in plan.values() for p in parts if p not in reader.index})
        if missing:
            raise CheckpointError(f"{directory}: checkpoint lacks tensor(s) {missing[:8]}"
                                  + (f" and {len(missing) - 8} more" if len(missing) > 8 else ""))
        used = {p for parts in plan.values() for p in parts}
        ignorable = {"lm_head.weight"} if config.tie_embeddings else set()
        if config.tie_embeddings and family.text_family is not None:  # the language model's own tied-head name
            ignorable.add("language_model.lm_head.weight")
        skipped = sorted(k for k in reader.index if family.skipped and re.match(family.skipped, k))
        if skipped:
            warnings.warn(f"{directory}: a {family.model_type} checkpoint: only its language model loads; "
                          f"{len(skipped)} tensor(s) of other towers skipped ({skipped[0]}, ...)", stacklevel=2)
        unexpected = sorted(k for k in reader.index if k not in used and k not in ignorable
                            and not IGNORED_HF.match(k) and k not in skipped)
        if unexpected:
            raise CheckpointError(f"{directory}: unexpected tensor(s) {unexpected[:8]} for a {family.model_type} "
                                  f"model with this config.json")
        # Every planned tensor's presence, shape and dtype from the safetensors headers, before allocating.
        pieces = []  # (native name, HF name, first row, rows): what the copy below reads
        for name, shape in shapes.items():
            offset = 0
            for hf_name, size in zip(plan[name], part_sizes(name, config.fused_part_sizes, len(plan[name]), shape[0]),
                                     strict=True):
                reader.check(hf_name, (size, *shape[1:]))
                pieces.append((name, hf_name, offset, size))
                offset += size
        dtype = dtype or reader.stored_dtype()
        quantized = _make_room(model, quantize)
        model = model.to(dtype=dtype).to_empty(device=device)
        by_layer: dict[int | None, list] = {}  # the pieces of each layer (None: outside the layers), in order
        for piece in pieces:
            layer = re.match(r"layers\.(\d+)\.", piece[0])
            by_layer.setdefault(layer and int(layer.group(1)), []).append(piece)
        with torch.no_grad():
            for layer in [None, *range(config.num_layers)]:
                layer_pieces = by_layer.get(layer, [])
                for name, hf_name, offset, size in layer_pieces:
                    if name not in quantized:
                        model.get_parameter(name).view(shapes[name])[offset:offset + size].copy_(reader.tensor(hf_name))
                for name in dict.fromkeys(p[0] for p in layer_pieces if p[0] in quantized):  # one weight at a time:
                    parts = [p for p in layer_pieces if p[0] == name]  # its parts read, cast on the device, quantised
                    dense = torch.cat([reader.tensor(p[1]).to(device, dtype) for p in parts])
                    _set_weight(model, name, quantize_nf4(dense, [p[3] for p in parts]))
                    del dense
                if layer is not None and each_layer is not None:
                    each_layer(model, layer)
    model.init_buffers()
    model.source_dir = directory
    return model.eval()


#: The parameters ``quantize`` stores in 4 bits: the decoder layers' projections.
QUANTIZED = re.compile(r"layers\.\d+\.(attn\.(qkv|o)|mlp\.(gate_up|down))\.weight")


def _check_quantize(quantize: str, config: DecoderConfig | None, what: str,
                    error: type[Exception] = ValueError) -> None:
    """Refuse a scheme other than "nf4", and (given the config) a mixture-of-experts model, naming ``what``."""
    if quantize != "nf4":
        raise ValueError(f"{what}: quantize must be None or 'nf4', got {quantize!r}")
    if config is not None and config.num_experts:
        raise error(f"{what}: quantize={quantize!r} covers dense models; this {config.model_type} model has "
                    "mixture-of-experts layers")


def _set_weight(model: CausalLM, name: str, tensor: torch.Tensor) -> None:
    """The parameter ``name`` (``...weight``) replaced by ``tensor``, frozen."""
    model.get_submodule(name.rpartition(".")[0]).weight = torch.nn.Parameter(tensor, requires_grad=False)


def _make_room(model: CausalLM, quantize: str | None) -> set[str]:
    """The names of the parameters ``quantize`` stores quantised (none without it), each replaced by an empty
    placeholder so that allocating the model does not allocate them dense."""
    if not quantize:
        return set()
    names = {n for n, _ in model.named_parameters() if QUANTIZED.fullmatch(n)}
    for name in names:
        _set_weight(model, name, torch.empty(0, device="meta"))
    return names


def quantize_model(model: CausalLM, quantize: str = "nf4") -> CausalLM:
    """Store ``model``'s decoder-layer projections in NF4 in place (as ``from_hf(..., quantize="nf4")`` loads them,
    each fused projection quantised part by part, its parts the Hugging Face tensors it is saved as); returns it.
    The weights are quantised from their values in their current dtype, which they keep reading as."""
    config = model.config
    _check_quantize(quantize, config, "quantize_model")
    names = [n for n, _ in model.named_parameters() if QUANTIZED.fullmatch(n)]
    plan = native_to_hf(names, config.num_layers, family_of(config.model_type).keymap, config.num_experts)
    with torch.no_grad():
        for name in names:
            weight = model.get_parameter(name).detach()
            _set_weight(model, name, quantize_nf4(weight, part_sizes(name, config.fused_part_sizes,
                                                                     len(plan[name]), weight.shape[0])))
    return model


def _rows_shape(shape: tuple[int, ...] | torch.Size) -> tuple[int, ...]:
    """A parameter's shape as the key maps see it: a 3-D (E, rows, columns) stack as (E * rows, columns)."""
    return (shape[0] * shape[1], shape[2]) if len(shape) == 3 else tuple(shape)


def hf_tensors(state: dict[str, torch.Tensor], config: DecoderConfig) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF name, tensor) pairs for a native state dict, splitting fused tensors back into their parts."""
    family = family_of(config.model_type)
    names = [n for n in state if not (config.tie_embeddings and n == "head.weight")]
    for native, parts in native_to_hf(names, config.num_layers, family.keymap, config.num_experts).items():
        t = dequantize_nf4(state[native])
        t = t.reshape(_rows_shape(t.shape))
        sizes = part_sizes(native, config.fused_part_sizes, len(parts), t.shape[0])
        yield from zip(parts, torch.split(t, sizes, dim=0), strict=True)


def same_values(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two tensors hold the same values bit for bit (one storage, or equal copies, NaNs included);
    another dtype or device counts as different."""
    if a.dtype != b.dtype or a.device != b.device or a.shape != b.shape:
        return False
    a, b = a.resolve_conj().resolve_neg(), b.resolve_conj().resolve_neg()
    if a.data_ptr() == b.data_ptr() and a.stride() == b.stride():
        return True
    bits = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}.get(a.element_size())
    if bits is None:  # e.g. complex128: compare the bytes
        return torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))
    return torch.equal(a.view(bits), b.view(bits))


def _check_state(state: dict[str, torch.Tensor], config: DecoderConfig) -> None:
    """Refuse a state dict whose names or shapes are not those of the family's model for ``config``
    (compared with the model built on the meta device; a tied config may omit ``head.weight``)."""
    with torch.device("meta"):
        model = family_of(config.model_type).cls(config)
    expected = {name: tuple(p.shape) for name, p in model.named_parameters()}
    if config.tie_embeddings:
        expected.setdefault("head.weight", expected["embed.weight"])
    optional = {"head.weight"} if config.tie_embeddings else set()
    missing = sorted(n for n in expected if n not in state and n not in optional)
    extra = sorted(n for n in state if n not in expected)
    shapes = sorted(f"{n} {tuple(t.shape)} (expected {expected[n]})" for n, t in state.items()
                    if n in expected and tuple(t.shape) != expected[n])
    problems = [f"{what} {names[:8]}" + (f" and {len(names) - 8} more" if len(names) > 8 else "")
                for what, names in (("missing tensor(s)", missing), ("unexpected tensor(s)", extra),
                                    ("wrong shape(s)", shapes)) if names]
    head, embed = state.get("head.weight"), state.get("embed.weight")
    if (config.tie_embeddings and head is not None and embed is not None and head.shape == embed.shape
            and not same_values(head, embed)):
        problems.append("head.weight differs from embed.weight, but the config ties them (only embed.weight "
                        "would be written)")
    if any(n.endswith((".lora_A", ".lora_B")) for n in extra):
        problems.append("the model carries LoRA adapters: fold them in with ligermodels.lora.merge_lora "
                        "(merge_lora_state for a state dict) first, or write them alone with save_lora")
    if problems:
        raise CheckpointError(f"state dict does not match a {config.model_type} model with this config: "
                              + "; ".join(problems))


def save_hf_state(state: dict[str, torch.Tensor], config: DecoderConfig, out_dir: str,
                  max_shard_bytes: int = 5 << 30, copy_from: str | None = None) -> None:
    """Write ``state`` (native names) as an HF checkpoint: config.json + (sharded) safetensors.

    Written to a temporary directory beside ``out_dir`` and renamed into place last, so an
    interrupted save leaves no directory that looks like a complete checkpoint. Tokenizer files
    found in ``copy_from`` are copied along. Refused before anything is written (CheckpointError):
    a state whose tensor names or shapes do not match ``config``'s model, and an existing ``out_dir``
    that holds anything but checkpoint files (config.json, safetensors, index, tokenizer files) --
    it is replaced as a whole, so a previous checkpoint there is overwritten but nothing else is lost.
    """
    check_replaceable(os.path.abspath(out_dir))
    _check_state(state, config)
    write_checkpoint(hf_tensors(state, config), config_to_hf(config), out_dir, max_shard_bytes, copy_from)


def save_hf(model: CausalLM, out_dir: str, max_shard_bytes: int = 5 << 30, copy_from: str | None = None) -> None:
    """Save a (non-sharded) model as an HF checkpoint that ``transformers`` loads back bit for bit."""
    copy_from = copy_from or getattr(model, "source_dir", None)
    save_hf_state(model.state_dict(), model.config, out_dir, max_shard_bytes, copy_from)


__all__ = ["load_hf", "save_hf", "save_hf_state", "hf_tensors", "same_values"]
