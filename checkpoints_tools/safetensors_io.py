"""Hugging Face checkpoint directories of safetensors: reading their tensors, writing them atomically.

Nothing here knows a model: :class:`CheckpointReader` reads named tensors (one file or shards, memory-mapped)
and checks their presence, shape and dtype before anything is allocated; :func:`write_checkpoint` writes
named tensors and a config dict as an HF checkpoint. ``ligermodels.hf_io`` maps those names to a model's
parameters through the key maps (:mod:`checkpoints_tools.keymap`).

Writing goes into a temporary sibling directory, ``config.json`` last, which is then renamed into place,
so a crash never leaves a half-written checkpoint that looks complete.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import tempfile
from collections.abc import Iterable

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from checkpoints_tools.hub import CheckpointError, safetensors_files

#: Files a checkpoint directory carries besides its weights and config: the tokenizer (every format
#: transformers saves, chat template included) and the generation defaults. Copied along on save.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
                   "vocab.json", "vocab.txt", "merges.txt", "added_tokens.json", "chat_template.jinja",
                   "chat_template.json", "generation_config.json")
#: dtype names accepted by :func:`to_dtype`.
DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
          "float16": torch.float16, "fp16": torch.float16}
#: safetensors header dtype -> torch dtype, for the tensors a checkpoint may hold.
_HEADER_DTYPES = {"F16": torch.float16, "BF16": torch.bfloat16, "F32": torch.float32, "F64": torch.float64}
#: safetensors header dtypes a checkpoint tensor may have: floating point, converted to the load dtype.
#: Integer / bool / fp8 tensors (quantized weights without their scales, ...) are refused, not cast.
LOADABLE_DTYPES = tuple(_HEADER_DTYPES)


def to_dtype(dtype: torch.dtype | str | None) -> torch.dtype | None:
    """torch dtype from a torch dtype or a name ("bf16", "bfloat16", "float32", ...)."""
    if dtype is None or isinstance(dtype, torch.dtype):
        return dtype
    name = str(dtype).removeprefix("torch.")
    if name not in DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; use one of {sorted(DTYPES)}")
    return DTYPES[name]


def read_json_object(path: str, error: type[Exception] = ValueError, what: str = "JSON") -> dict:
    """The JSON object in the file ``path``; invalid JSON, or JSON that is not an object, raises
    ``error`` with a message naming the file (``what`` names its role, e.g. "config.json")."""
    try:
        with open(path, encoding="utf-8") as f:
            obj = json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise error(f"{path}: {what} is not valid JSON ({e})") from None
    if not isinstance(obj, dict):
        raise error(f"{path}: {what} holds a JSON {type(obj).__name__}, not an object")
    return obj


def read_config(directory: str) -> dict:
    """The ``config.json`` of a checkpoint directory as a dict; a CheckpointError naming what is wrong."""
    path = os.path.join(directory, "config.json")
    if not os.path.isfile(path):
        raise CheckpointError(f"{directory} has no config.json")
    return read_json_object(path, CheckpointError, "config.json")


def _open(path: str):
    """An open ``safe_open`` handle (entered); a truncated or corrupt file is a CheckpointError naming it."""
    try:
        return safe_open(path, framework="pt").__enter__()
    except (SafetensorError, OSError) as e:
        raise CheckpointError(f"{path}: not a readable safetensors file ({e})") from e


class CheckpointReader:
    """The tensors of a checkpoint directory, by HF name, read from memory-mapped safetensors files.

    ``index`` maps each tensor name to its file. As in transformers, ``model.safetensors`` wins when it
    exists, even beside an index (a directory re-saved unsharded may keep a stale
    ``model.safetensors.index.json``); otherwise the index names the shards; otherwise every
    ``model*.safetensors`` file is read. Use as a context manager: files are opened on first use and
    closed at exit.
    """

    def __init__(self, directory: str):
        self.directory = directory
        self._handles: dict[str, object] = {}
        self._names: dict[str, frozenset[str]] = {}  # each open file's tensor names (keys() builds a list a call)
        self.index = self._read_index()

    def _read_index(self) -> dict[str, str]:
        single = os.path.join(self.directory, "model.safetensors")
        index_path = os.path.join(self.directory, "model.safetensors.index.json")
        if os.path.isfile(single):
            paths = [single]
        elif os.path.isfile(index_path):
            weight_map = read_json_object(index_path, CheckpointError, "the shard index").get("weight_map")
            if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
                raise CheckpointError(f"{index_path}: the shard index has no \"weight_map\" object "
                                      "(tensor name -> shard file)")
            files = {os.path.join(self.directory, v) for v in weight_map.values()}
            absent = sorted(os.path.basename(p) for p in files if not os.path.isfile(p))
            if absent:
                raise CheckpointError(f"{self.directory}: shard(s) {absent} named by model.safetensors.index.json "
                                      "are missing")
            return {k: os.path.join(self.directory, v) for k, v in weight_map.items()}
        else:
            paths = safetensors_files(self.directory)
        index: dict[str, str] = {}
        for path in paths:
            self._handle(path)
            for k in sorted(self._names[path]):
                if k in index:
                    raise CheckpointError(f"{self.directory}: tensor {k} is in both {os.path.basename(index[k])} "
                                          f"and {os.path.basename(path)}, and no model.safetensors.index.json says "
                                          "which to read")
                index[k] = path
        return index

    def __enter__(self) -> CheckpointReader:
        return self

    def __exit__(self, *exc) -> None:
        for h in self._handles.values():
            h.__exit__(None, None, None)
        self._handles.clear()
        self._names.clear()

    def _handle(self, path: str):
        if path not in self._handles:
            self._handles[path] = _open(path)
            self._names[path] = frozenset(self._handles[path].keys())
        return self._handles[path]

    def check(self, name: str, shape: tuple[int, ...]) -> None:
        """Refuse (CheckpointError naming it) a tensor that is absent, of another shape, or not floating point."""
        path = self.index[name]
        handle = self._handle(path)
        if name not in self._names[path]:
            raise CheckpointError(f"{path}: lacks tensor {name} (model.safetensors.index.json places it in this "
                                  "file)")
        info = handle.get_slice(name)
        if tuple(info.get_shape()) != tuple(shape):
            raise CheckpointError(f"{self.directory}: tensor {name} has shape {tuple(info.get_shape())}, expected "
                                  f"{tuple(shape)} (from config.json) in {os.path.basename(path)}")
        if info.get_dtype() not in LOADABLE_DTYPES:
            raise CheckpointError(f"{self.directory}: tensor {name} in {os.path.basename(path)} has dtype "
                                  f"{info.get_dtype()}; only floating-point tensors ({', '.join(LOADABLE_DTYPES)}) "
                                  "are loaded (quantized checkpoints are not supported)")

    def tensor(self, name: str) -> torch.Tensor:
        """The tensor ``name`` as stored (on the host, memory-mapped until copied)."""
        return self._handle(self.index[name]).get_tensor(name)

    def stored_dtype(self) -> torch.dtype:
        """The dtype transformers' ``dtype="auto"`` picks when config.json names none: the index's
        ``metadata.dtype`` if given, else the first floating tensor, in name order, of the first file."""
        index_path = os.path.join(self.directory, "model.safetensors.index.json")
        if not os.path.isfile(os.path.join(self.directory, "model.safetensors")) and os.path.isfile(index_path):
            meta = read_json_object(index_path, CheckpointError, "the shard index").get("metadata") or {}
            if isinstance(meta, dict) and isinstance(meta.get("dtype"), str):
                try:
                    return to_dtype(meta["dtype"])
                except ValueError:
                    pass
        handle = self._handle(sorted(set(self.index.values()))[0])
        for name in sorted(handle.keys()):
            header = handle.get_slice(name).get_dtype()
            if header in _HEADER_DTYPES:
                return _HEADER_DTYPES[header]
        return torch.float32


#: Entries a directory may hold for :func:`write_checkpoint` to replace it: what a checkpoint consists of.
_CHECKPOINT_FILE = re.compile(r"config\.json|model\.safetensors|model-\d{5}-of-\d{5}\.safetensors|"
                              r"model\.safetensors\.index\.json")


def check_replaceable(out_dir: str) -> None:
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


def write_checkpoint(tensors: Iterable[tuple[str, torch.Tensor]], hf_config: dict, out_dir: str,
                     max_shard_bytes: int = 5 << 30, copy_from: str | None = None) -> None:
    """Write ``(HF name, tensor)`` pairs and ``hf_config`` as an HF checkpoint in ``out_dir``: config.json +
    safetensors shards of at most ``max_shard_bytes`` (+ model.safetensors.index.json when sharded).

    ``hf_config["dtype"]`` is set to the first tensor's dtype. Tokenizer files (:data:`TOKENIZER_FILES`) found
    in ``copy_from``, else in the checkpoint being replaced, are copied along. Written to a temporary directory
    beside ``out_dir``, config.json last, and renamed into place; refused first (CheckpointError) when
    ``out_dir`` holds anything but checkpoint files (:func:`check_replaceable`).
    """
    out_dir = os.path.abspath(out_dir)
    check_replaceable(out_dir)
    tensors = list(tensors)
    hf_cfg = dict(hf_config)
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
        copy_tokenizer_files(copy_from or out_dir, tmp, fallback=out_dir)
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


def copy_tokenizer_files(src: str | None, dst: str, fallback: str | None = None) -> None:
    """Copy the :data:`TOKENIZER_FILES` present in ``src`` (each missing one from ``fallback`` when given)
    into the directory ``dst``."""
    for fname in TOKENIZER_FILES:
        path = next((p for p in (os.path.join(d, fname) for d in (src, fallback) if d) if os.path.isfile(p)), None)
        if path:
            shutil.copy2(path, os.path.join(dst, fname))


__all__ = ["TOKENIZER_FILES", "DTYPES", "LOADABLE_DTYPES", "to_dtype", "read_json_object", "read_config",
           "CheckpointReader", "check_replaceable", "write_checkpoint", "copy_tokenizer_files"]
