"""Hugging Face safetensors <-> native checkpoints: key maps, hub resolution, loading, export."""

from ligermodels.dependencies import require_runtime_dependencies

require_runtime_dependencies()  # names a missing package before torch or safetensors is imported

from checkpoints_tools.hf_io import hf_tensors, load_hf, read_config, save_hf, save_hf_state, to_dtype
from checkpoints_tools.hub import CheckpointError, resolve
from checkpoints_tools.keymap import KEYMAPS

__all__ = ["load_hf", "save_hf", "save_hf_state", "hf_tensors", "read_config", "to_dtype", "resolve",
           "CheckpointError", "KEYMAPS"]
