"""Load and save Hugging Face checkpoints (safetensors only) through the key maps.

Loading builds the model on the meta device, allocates it once on the target device and dtype,
and copies tensors in one at a time from memory-mapped safetensors files: host memory never holds
a second copy of the model. Saving writes into a temporary sibling directory and renames it into
place at the end, so a crash never leaves a half-written checkpoint that looks complete.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import tempfile
import warnings
from collections.abc import Iterator

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from checkpoints_tools.hub import CheckpointError, resolve, safetensors_files
from checkpoints_tools.keymap import IGNORED_HF, native_to_hf, part_sizes
from ligermodels.config import DecoderConfig, read_json_object
from ligermodels.families import config_from_hf, config_to_hf, family_of
from ligermodels.model import CausalLM

#: Files a checkpoint directory carries besides its weights and config: the tokenizer (every format
#: transformers saves, chat template included) and the generation defaults. Copied along on save.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
                   "vocab.json", "vocab.txt", "merges.txt", "added_tokens.json", "chat_template.jinja",
                   "chat_template.json", "generation_config.json")
_DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
           "float16": torch.float16, "fp16": torch.float16}
#: safetensors header dtype -> torch dtype, for the tensors a checkpoint may hold (see LOADABLE_DTYPES).
_HEADER_DTYPES = {"F16": torch.float16, "BF16": torch.bfloat16, "F32": torch.float32, "F64": torch.float64}


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
    return _read_json(path, "config.json")


def _read_json(path: str, what: str) -> dict:
    """A JSON object from ``path``; unreadable or non-object JSON is a CheckpointError naming the file."""
    return read_json_object(path, CheckpointError, what)


def _open_safetensors(path: str):
    """An open ``safe_open`` handle (entered); a truncated or corrupt file is a CheckpointError naming it."""
    try:
        return safe_open(path, framework="pt").__enter__()
    except (SafetensorError, OSError) as e:
        raise CheckpointError(f"{path}: not a readable safetensors file ({e})") from e


def _hf_index(directory: str) -> dict[str, str]:
    """HF tensor name -> safetensors file path, for single-file and sharded checkpoints.

    As in transformers, ``model.safetensors`` wins when it exists, even beside an index (a directory
    re-saved unsharded may keep a stale ``model.safetensors.index.json``); otherwise the index names the
    shards; otherwise every ``*.safetensors`` file is read.
    """
    single = os.path.join(directory, "model.safetensors")
    index_path = os.path.join(directory, "model.safetensors.index.json")
    if os.path.isfile(single):
        paths = [single]
    elif os.path.isfile(index_path):
        weight_map = _read_json(index_path, "the shard index").get("weight_map")
        if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
            raise CheckpointError(f"{index_path}: the shard index has no \"weight_map\" object "
                                  "(tensor name -> shard file)")
        files = {os.path.join(directory, v) for v in weight_map.values()}
        absent = sorted(os.path.basename(p) for p in files if not os.path.isfile(p))
        if absent:
            raise CheckpointError(f"{directory}: shard(s) {absent} named by model.safetensors.index.json are missing")
        return {k: os.path.join(directory, v) for k, v in weight_map.items()}
    else:
        paths = safetensors_files(directory)
    index: dict[str, str] = {}
    for path in paths:
        handle = _open_safetensors(path)
        try:
            for k in handle.keys():
                if k in index:
                    raise CheckpointError(f"{directory}: tensor {k} is in both {os.path.basename(index[k])} and "
                                          f"{os.path.basename(path)}, and no model.safetensors.index.json says "
                                          "which to read")
                index[k] = path
        finally:
            handle.__exit__(None, None, None)
    return index


#: safetensors header dtypes a checkpoint tensor may have: floating point, converted to the load dtype.
#: Integer / bool / fp8 tensors (quantized weights without their scales, ...) are refused, not cast.
LOADABLE_DTYPES = tuple(_HEADER_DTYPES)


def _stored_dtype(directory: str, index: dict[str, str], handles: dict) -> torch.dtype:
    """The dtype transformers' ``dtype="auto"`` picks when config.json names none: the index's
    ``metadata.dtype`` if given, else the first floating tensor, in name order, of the first file."""
    index_path = os.path.join(directory, "model.safetensors.index.json")
    if not os.path.isfile(os.path.join(directory, "model.safetensors")) and os.path.isfile(index_path):
        meta = _read_json(index_path, "the shard index").get("metadata") or {}
        if isinstance(meta, dict) and isinstance(meta.get("dtype"), str):
            try:
                return to_dtype(meta["dtype"])
            except ValueError:
                pass
    first = sorted(set(index.values()))[0]
    handle = handles.get(first) or _open_safetensors(first)
    try:
        for name in sorted(handle.keys()):
            header = handle.get_slice(name).get_dtype()
            if header in _HEADER_DTYPES:
                return _HEADER_DTYPES[header]
    finally:
        if first not in handles:
            handle.__exit__(None, None, None)
    return torch.float32


def _checked_config(directory: str, repo_or_dir: str, expect: type[CausalLM] | None):
    """(config.json dict, family, native config) of a checkpoint directory; refuses an unsupported model
    type, a config the family cannot read, and a family other than ``expect``'s."""
    hf_cfg = read_config(directory)
    family = family_of(hf_cfg.get("model_type"))
    if expect is not None and expect is not CausalLM and getattr(expect, "model_type", None) != family.cls.model_type:
        raise CheckpointError(f"{repo_or_dir!r} is a {family.model_type!r} checkpoint, not {expect.model_type!r}: "
                              f"use {family.cls.__name__} or AutoLigerModel")
    return hf_cfg, family, family.read_config(hf_cfg)


def load_hf(repo_or_dir: str, dtype: torch.dtype | str | None = None, device: str | torch.device | None = None,
            revision: str | None = None, expect: type[CausalLM] | None = None) -> CausalLM:
    """Load an HF checkpoint into the family's model class.

    Args:
        repo_or_dir: local directory, or hub repo id (only safetensors/json/tokenizer files are fetched).
        dtype: parameter dtype; default the checkpoint's ``dtype``/``torch_dtype`` from config.json, else
            the dtype its weights are stored in (transformers' ``dtype="auto"``).
        device: target device (default CPU). Weights go straight there, one tensor at a time.
        expect: a family class (e.g. LigerQwen2); loading a checkpoint of another family is an error.
    Returns:
        The model in eval mode.

    A hub repo's config.json is fetched and checked (family, ``expect``) before its weights download.
    """
    directory = resolve(repo_or_dir, revision, check=lambda d: _checked_config(d, repo_or_dir, expect))
    hf_cfg, family, config = _checked_config(directory, repo_or_dir, expect)
    try:
        cfg_dtype = to_dtype(hf_cfg.get("dtype") or hf_cfg.get("torch_dtype")) if dtype is None else None
    except ValueError as e:
        raise CheckpointError(f"{directory}/config.json: field dtype/torch_dtype: {e}; pass dtype= explicitly") from e
    dtype = to_dtype(dtype) or cfg_dtype  # None: the dtype of the stored weights, read from the headers below
    device = torch.device(device or "cpu")
    index = _hf_index(directory)

    with torch.device("meta"):
        model = family.cls(config)
    shapes = {name: tuple(p.shape) for name, p in model.named_parameters()}
    plan = native_to_hf(list(shapes), config, family.keymap)
    missing = sorted({p for parts in plan.values() for p in parts if p not in index})
    if missing:
        raise CheckpointError(f"{directory}: checkpoint lacks tensor(s) {missing[:8]}"
                              + (f" and {len(missing) - 8} more" if len(missing) > 8 else ""))
    used = {p for parts in plan.values() for p in parts}
    ignorable = {"lm_head.weight"} if config.tie_embeddings else set()
    if config.tie_embeddings and family.text_family is not None:  # the language model's own tied-head name
        ignorable.add("language_model.lm_head.weight")
    skipped = sorted(k for k in index if family.skipped and re.match(family.skipped, k))
    if skipped:
        warnings.warn(f"{directory}: a {family.model_type} checkpoint: only its language model loads; "
                      f"{len(skipped)} tensor(s) of other towers skipped ({skipped[0]}, ...)", stacklevel=2)
    unexpected = sorted(k for k in index if k not in used and k not in ignorable and not IGNORED_HF.match(k)
                        and k not in skipped)
    if unexpected:
        raise CheckpointError(f"{directory}: unexpected tensor(s) {unexpected[:8]} for a {family.model_type} "
                              f"model with this config.json")

    handles: dict[str, object] = {}
    try:
        # Every planned tensor's presence, shape and dtype from the safetensors headers, before allocating.
        keys: dict[str, set[str]] = {}
        for path in sorted({index[p] for p in used}):
            handles[path] = _open_safetensors(path)
            keys[path] = set(handles[path].keys())
        pieces = []  # (native name, HF name, file, first row, rows): what the copy below reads
        for name, shape in shapes.items():
            parts = plan[name]
            offset = 0
            for hf_name, size in zip(parts, part_sizes(name, config, len(parts), shape[0]), strict=True):
                path = index[hf_name]
                pieces.append((name, hf_name, path, offset, size))
                offset += size
                if hf_name not in keys[path]:
                    raise CheckpointError(f"{path}: lacks tensor {hf_name} (model.safetensors.index.json places "
                                          "it in this file)")
                info = handles[path].get_slice(hf_name)
                found, expected = tuple(info.get_shape()), (size, *shape[1:])
                if found != expected:
                    raise CheckpointError(f"{directory}: tensor {hf_name} has shape {found}, expected {expected} "
                                          f"(from config.json) in {os.path.basename(path)}")
                if info.get_dtype() not in LOADABLE_DTYPES:
                    raise CheckpointError(f"{directory}: tensor {hf_name} in {os.path.basename(path)} has dtype "
                                          f"{info.get_dtype()}; only floating-point tensors "
                                          f"({', '.join(LOADABLE_DTYPES)}) are loaded (quantized checkpoints are "
                                          "not supported)")
        if dtype is None:
            dtype = _stored_dtype(directory, index, handles)
        model = model.to(dtype=dtype).to_empty(device=device)
        params = dict(model.named_parameters())
        with torch.no_grad():
            for name, hf_name, path, offset, size in pieces:
                params[name][offset:offset + size].copy_(handles[path].get_tensor(hf_name))
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


#: Entries a directory may hold for ``save_hf_state`` to replace it: what a checkpoint consists of.
_CHECKPOINT_FILE = re.compile(r"config\.json|model\.safetensors|model-\d{5}-of-\d{5}\.safetensors|"
                              r"model\.safetensors\.index\.json")


def _check_replaceable(out_dir: str) -> None:
    """Refuse to replace ``out_dir`` unless it is absent, empty, or holds only checkpoint files.

    Saving replaces the whole directory (atomically, by a rename), so anything else in it -- logs,
    optimiser state, source files of a working directory given as ``"."`` -- would be deleted.
    """
    if not os.path.lexists(out_dir):
        return
    if not os.path.isdir(out_dir) or os.path.islink(out_dir):
        raise CheckpointError(f"{out_dir} exists and is not a directory: refusing to replace it with a checkpoint")
    others = sorted(e for e in os.listdir(out_dir) if not (_CHECKPOINT_FILE.fullmatch(e) or e in TOKENIZER_FILES)
                    or not os.path.isfile(os.path.join(out_dir, e)))
    if others:
        raise CheckpointError(f"{out_dir} holds entries that are not checkpoint files ({others[:5]}"
                              + (f" and {len(others) - 5} more" if len(others) > 5 else "")
                              + "): saving replaces the whole directory, so give an empty or new directory")


def _same_values(a: torch.Tensor, b: torch.Tensor) -> bool:
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
            and not _same_values(head, embed)):
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
    out_dir = os.path.abspath(out_dir)
    _check_replaceable(out_dir)
    _check_state(state, config)
    hf_cfg = config_to_hf(config)
    tensors = list(hf_tensors(state, config))
    if tensors:
        hf_cfg["dtype"] = str(tensors[0][1].dtype).removeprefix("torch.")
        hf_cfg.pop("torch_dtype", None)
    parent = os.path.dirname(out_dir)
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=f".{os.path.basename(out_dir)}.tmp-", dir=parent)
    old = None
    try:
        umask = os.umask(0)
        os.umask(umask)
        # mkdtemp makes it 0700: a checkpoint is as readable as a new directory (setgid kept from the parent)
        os.chmod(tmp, (os.stat(tmp).st_mode & 0o7000) | (0o777 & ~umask))
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
        for fname in TOKENIZER_FILES:  # from copy_from; else kept from the checkpoint being replaced
            src = next((p for p in (os.path.join(d, fname) for d in (copy_from, out_dir) if d) if os.path.isfile(p)),
                       None)
            if src:
                shutil.copy2(src, os.path.join(tmp, fname))
        with open(os.path.join(tmp, "config.json"), "w") as f:  # written last: marks the checkpoint complete
            json.dump(hf_cfg, f, indent=2)
        if os.path.exists(out_dir):
            old = tempfile.mkdtemp(prefix=f".{os.path.basename(out_dir)}.old-", dir=parent)
            os.replace(out_dir, os.path.join(old, "x"))
        os.replace(tmp, out_dir)
    except BaseException:
        if old and not os.path.lexists(out_dir) and os.path.isdir(os.path.join(old, "x")):
            os.replace(os.path.join(old, "x"), out_dir)  # interrupted between the renames: the previous one back
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    finally:
        if old:
            shutil.rmtree(old, ignore_errors=True)


def save_hf(model: CausalLM, out_dir: str, max_shard_bytes: int = 5 << 30, copy_from: str | None = None) -> None:
    """Save a (non-sharded) model as an HF checkpoint that ``transformers`` loads back bit for bit."""
    copy_from = copy_from or getattr(model, "source_dir", None)
    save_hf_state(model.state_dict(), model.config, out_dir, max_shard_bytes, copy_from)


__all__ = ["load_hf", "save_hf", "save_hf_state", "hf_tensors", "config_from_hf", "to_dtype", "read_config"]
