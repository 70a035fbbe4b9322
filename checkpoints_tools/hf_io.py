"""Load and save Hugging Face checkpoints (safetensors only) through the key maps.

Loading builds the model on the meta device, allocates it once on the target device and dtype,
and copies tensors in one at a time from memory-mapped safetensors files: host memory never holds
a second copy of the model. Saving writes into a temporary sibling directory and renames it into
place at the end, so a crash never leaves a half-written checkpoint that looks complete.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Iterator

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from checkpoints_tools.hub import CheckpointError, resolve, safetensors_files
from checkpoints_tools.keymap import IGNORED_HF, native_to_hf, part_sizes
from ligermodels.config import DecoderConfig
from ligermodels.families import config_from_hf, config_to_hf, family_of
from ligermodels.model import CausalLM

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
                   "generation_config.json")
_DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
           "float16": torch.float16, "fp16": torch.float16}


def to_dtype(dtype: torch.dtype | str | None) -> torch.dtype | None:
    """torch dtype from a torch dtype or a name ("bf16", "bfloat16", "float32", ...)."""
    if dtype is None or isinstance(dtype, torch.dtype):
        return dtype
    name = str(dtype).removeprefix("torch.")
    if name not in _DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; use one of {sorted(_DTYPES)}")
    return _DTYPES[name]


def read_config(directory: str) -> dict:
    """The ``config.json`` of a checkpoint directory as a dict; a CheckpointError naming what is wrong."""
    path = os.path.join(directory, "config.json")
    if not os.path.isfile(path):
        raise CheckpointError(f"{directory} has no config.json")
    with open(path) as f:
        return json.load(f)


def _hf_index(directory: str) -> dict[str, str]:
    """HF tensor name -> safetensors file path, for single-file and sharded checkpoints."""
    index_path = os.path.join(directory, "model.safetensors.index.json")
    if os.path.isfile(index_path):
        with open(index_path) as f:
            weight_map = json.load(f)["weight_map"]
        files = {os.path.join(directory, v) for v in weight_map.values()}
        absent = sorted(os.path.basename(p) for p in files if not os.path.isfile(p))
        if absent:
            raise CheckpointError(f"{directory}: shard(s) {absent} named by model.safetensors.index.json are missing")
        return {k: os.path.join(directory, v) for k, v in weight_map.items()}
    index = {}
    for path in safetensors_files(directory):
        with safe_open(path, framework="pt") as f:
            index.update({k: path for k in f.keys()})
    return index


def load_hf(repo_or_dir: str, dtype: torch.dtype | str | None = None, device: str | torch.device | None = None,
            revision: str | None = None, expect: type[CausalLM] | None = None) -> CausalLM:
    """Load an HF checkpoint into the family's model class.

    Args:
        repo_or_dir: local directory, or hub repo id (only safetensors/json/tokenizer files are fetched).
        dtype: parameter dtype; default the checkpoint's ``torch_dtype``/``dtype``, else float32.
        device: target device (default CPU). Weights go straight there, one tensor at a time.
        expect: a family class (e.g. LigerQwen2); loading a checkpoint of another family is an error.
    Returns:
        The model in eval mode.
    """
    directory = resolve(repo_or_dir, revision)
    hf_cfg = read_config(directory)
    family = family_of(hf_cfg.get("model_type"))
    if expect is not None and expect is not CausalLM and getattr(expect, "model_type", None) != family.model_type:
        raise CheckpointError(f"{repo_or_dir!r} is a {family.model_type!r} checkpoint, not {expect.model_type!r}: "
                              f"use {family.cls.__name__} or AutoLigerModel")
    config = family.read_config(hf_cfg)
    dtype = to_dtype(dtype) or to_dtype(hf_cfg.get("dtype") or hf_cfg.get("torch_dtype")) or torch.float32
    device = torch.device(device or "cpu")
    index = _hf_index(directory)

    with torch.device("meta"):
        model = family.cls(config)
    model = model.to(dtype=dtype).to_empty(device=device)
    params = dict(model.named_parameters())
    plan = native_to_hf(list(params), config, family.keymap)
    missing = sorted({p for parts in plan.values() for p in parts if p not in index})
    if missing:
        raise CheckpointError(f"{directory}: checkpoint lacks tensor(s) {missing[:8]}"
                              + (f" and {len(missing) - 8} more" if len(missing) > 8 else ""))
    used = {p for parts in plan.values() for p in parts}
    ignorable = {"lm_head.weight"} if config.tie_embeddings else set()
    unexpected = sorted(k for k in index if k not in used and k not in ignorable and not IGNORED_HF.match(k))
    if unexpected:
        raise CheckpointError(f"{directory}: unexpected tensor(s) {unexpected[:8]} for a {family.model_type} "
                              f"model with this config.json")

    handles: dict[str, object] = {}
    try:
        with torch.no_grad():
            for name, param in params.items():
                parts = plan[name]
                sizes = part_sizes(name, config, len(parts), param.shape[0])
                offset = 0
                for hf_name, size in zip(parts, sizes, strict=True):
                    path = index[hf_name]
                    if path not in handles:
                        handles[path] = safe_open(path, framework="pt").__enter__()
                    tensor = handles[path].get_tensor(hf_name)
                    expected = (size, *param.shape[1:])
                    if tuple(tensor.shape) != expected:
                        raise CheckpointError(f"{directory}: tensor {hf_name} has shape {tuple(tensor.shape)}, "
                                              f"expected {expected} (from config.json)")
                    param[offset:offset + size].copy_(tensor)
                    offset += size
                    del tensor
    finally:
        for h in handles.values():
            h.__exit__(None, None, None)
    model.init_buffers()
    model.source_dir = directory
    return model.eval()


def hf_tensors(state: dict[str, torch.Tensor], config: DecoderConfig) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF name, tensor) pairs for a native state dict, splitting fused tensors back into their parts."""
    family = family_of(config.model_type)
    names = [n for n in state if not (config.tie_embeddings and n == "head.weight")]
    for native, parts in native_to_hf(names, config, family.keymap).items():
        t = state[native]
        sizes = part_sizes(native, config, len(parts), t.shape[0])
        yield from zip(parts, torch.split(t, sizes, dim=0), strict=True)


def save_hf_state(state: dict[str, torch.Tensor], config: DecoderConfig, out_dir: str,
                  max_shard_bytes: int = 5 << 30, copy_from: str | None = None) -> None:
    """Write ``state`` (native names) as an HF checkpoint: config.json + (sharded) safetensors.

    Written to a temporary directory beside ``out_dir`` and renamed into place last, so an
    interrupted save leaves no directory that looks like a complete checkpoint. Tokenizer files
    found in ``copy_from`` are copied along.
    """
    hf_cfg = config_to_hf(config)
    tensors = list(hf_tensors(state, config))
    if tensors:
        hf_cfg["dtype"] = str(tensors[0][1].dtype).removeprefix("torch.")
        hf_cfg.pop("torch_dtype", None)
    out_dir = os.path.abspath(out_dir)
    parent = os.path.dirname(out_dir)
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=f".{os.path.basename(out_dir)}.tmp-", dir=parent)
    try:
        shards: list[list[tuple[str, torch.Tensor]]] = [[]]
        size = 0
        for name, t in tensors:
            nbytes = t.numel() * t.element_size()
            if shards[-1] and size + nbytes > max_shard_bytes:
                shards.append([])
                size = 0
            shards[-1].append((name, t))
            size += nbytes
        weight_map = {}
        for k, shard in enumerate(shards):
            fname = "model.safetensors" if len(shards) == 1 else f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors"
            save_file({n: t.detach().contiguous().cpu() for n, t in shard}, os.path.join(tmp, fname),
                      metadata={"format": "pt"})
            weight_map.update({n: fname for n, _ in shard})
        if len(shards) > 1:
            total = sum(t.numel() * t.element_size() for _, t in tensors)
            with open(os.path.join(tmp, "model.safetensors.index.json"), "w") as f:
                json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)
        if copy_from:
            for fname in TOKENIZER_FILES:
                src = os.path.join(copy_from, fname)
                if os.path.isfile(src):
                    shutil.copy2(src, os.path.join(tmp, fname))
        with open(os.path.join(tmp, "config.json"), "w") as f:  # written last: marks the checkpoint complete
            json.dump(hf_cfg, f, indent=2)
        old = None
        if os.path.exists(out_dir):
            old = tempfile.mkdtemp(prefix=f".{os.path.basename(out_dir)}.old-", dir=parent)
            os.replace(out_dir, os.path.join(old, "x"))
        os.replace(tmp, out_dir)
        if old:
            shutil.rmtree(old, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def save_hf(model: CausalLM, out_dir: str, max_shard_bytes: int = 5 << 30, copy_from: str | None = None) -> None:
    """Save a (non-sharded) model as an HF checkpoint that ``transformers`` loads back bit for bit."""
    copy_from = copy_from or getattr(model, "source_dir", None)
    save_hf_state(model.state_dict(), model.config, out_dir, max_shard_bytes, copy_from)


__all__ = ["load_hf", "save_hf", "save_hf_state", "hf_tensors", "config_from_hf", "to_dtype", "read_config"]
