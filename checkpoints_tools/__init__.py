"""Hugging Face checkpoints as files: hub resolution, key maps (HF names <-> native names), safetensors reading
and atomic sharded writing, and the transformers reference of ``python -m ligermodels.verify``.

Works on names, tensors and config dicts; imports nothing of ``ligermodels`` or ``kernels`` (``ligermodels``
builds its models' loading and saving on it: ``ligermodels.hf_io``).
"""

from checkpoints_tools.hub import CheckpointError, resolve, safetensors_files
from checkpoints_tools.keymap import KEYMAPS
from checkpoints_tools.safetensors_io import (
    TOKENIZER_FILES,
    CheckpointReader,
    read_config,
    read_json_object,
    to_dtype,
    write_checkpoint,
)

__all__ = ["CheckpointError", "resolve", "safetensors_files", "KEYMAPS", "TOKENIZER_FILES", "CheckpointReader",
           "read_config", "read_json_object", "to_dtype", "write_checkpoint"]
