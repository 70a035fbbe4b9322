"""Checkpoint loading refuses bad input with errors that name the thing at fault, before any work."""

from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors.torch import load_file, save_file

from checkpoints_tools import CheckpointError
from checkpoints_tools.keymap import STANDARD, expand
from ligermodels import UnsupportedConfigError, config_from_hf
from ligermodels.hf_io import load_hf
from tests.test_models import make_hf_checkpoint


@pytest.fixture
def ckpt(tmp_path):
    make_hf_checkpoint("llama_gqa_untied", str(tmp_path))
    return tmp_path


def _edit_config(path, **changes):
    cfg = json.loads((path / "config.json").read_text())
    cfg.update(changes)
    (path / "config.json").write_text(json.dumps(cfg))


def _edit_tensors(path, fn):
    tensors = load_file(str(path / "model.safetensors"))
    fn(tensors)
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})


def test_unsupported_model_type_lists_the_supported_ones(ckpt):
    _edit_config(ckpt, model_type="gpt2")
    supported = "gemma, gemma2, gemma3, gemma3_text, glm4, llama, mistral, mixtral, phi3, qwen2, qwen3, qwen3_moe"
    with pytest.raises(UnsupportedConfigError, match=f"'gpt2'.*{supported}"):
        load_hf(str(ckpt))


def test_missing_tensor_is_named(ckpt):
    _edit_tensors(ckpt, lambda t: t.pop("model.layers.1.mlp.up_proj.weight"))
    with pytest.raises(CheckpointError, match=r"lacks tensor.*model\.layers\.1\.mlp\.up_proj\.weight"):
        load_hf(str(ckpt))


def test_unexpected_tensor_is_named(ckpt):
    _edit_tensors(ckpt, lambda t: t.update({"model.layers.0.extra.weight": torch.zeros(2)}))
    with pytest.raises(CheckpointError, match=r"unexpected tensor.*model\.layers\.0\.extra\.weight"):
        load_hf(str(ckpt))


def test_shape_mismatch_names_tensor_expected_and_found(ckpt):
    _edit_tensors(ckpt, lambda t: t.update({"model.layers.0.self_attn.k_proj.weight": torch.zeros(8, 64)}))
    with pytest.raises(CheckpointError, match=r"k_proj\.weight has shape \(8, 64\), expected \(32, 64\)"):
        load_hf(str(ckpt))


def test_pickled_checkpoints_are_refused_unread(ckpt):
    os.remove(ckpt / "model.safetensors")
    (ckpt / "pytorch_model.bin").write_bytes(b"not even a pickle")
    with pytest.raises(CheckpointError, match="pickled.*pytorch_model.bin.*never unpickles"):
        load_hf(str(ckpt))


def test_missing_directory_and_offline_repo_id_are_named(tmp_path, monkeypatch):
    with pytest.raises(CheckpointError, match="does not exist"):
        load_hf(str(tmp_path / "nope"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    import huggingface_hub.constants

    # huggingface_hub reads HF_HUB_OFFLINE once, at import (transformers imported it before this test): set
    # its flag too, or it tries the network (20 s of timeouts here) before giving up
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(CheckpointError, match="'someone/no-such-model'.*offline"):
        load_hf("someone/no-such-model")


@pytest.mark.parametrize("field,value,family", [
    ("resid_pdrop", 0.1, "phi3"), ("hidden_act", "relu", "llama"), ("use_bidirectional_attention", True, "gemma"),
    ("partial_rotary_factor", 0.5, "llama"), ("layer_types", ["sliding_attention"], "qwen2"),
    ("layer_types", ["chunked_attention"], "qwen3"), ("use_bidirectional_attention", True, "gemma3_text"),
    ("partial_rotary_factor", 0.5, "gemma2"),
])
def test_math_changing_config_fields_are_refused_by_name(field, value, family):
    cfg = dict(model_type=family, vocab_size=10, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
               num_attention_heads=2, num_key_value_heads=1)  # explicit: Gemma's default (16) needs 16k heads
    config_from_hf(cfg)
    with pytest.raises(UnsupportedConfigError, match=field):
        config_from_hf({**cfg, field: value})


def test_unsupported_rope_type_is_refused_by_name():
    cfg = dict(model_type="llama", vocab_size=10, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
               num_attention_heads=2, rope_parameters={"rope_type": "su-perfancy", "rope_theta": 1e4})
    with pytest.raises(ValueError, match="su-perfancy"):
        config_from_hf(cfg)


def test_keymap_expands_layers_and_lists_qkv_in_order():
    table = expand(STANDARD, 2)
    assert table["layers.1.attn.qkv.weight"] == tuple(f"model.layers.1.self_attn.{p}_proj.weight" for p in "qkv")
    assert "layers.2.attn.qkv.weight" not in table


def test_verify_command_prints_relative_error(ckpt):
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-m", "ligermodels.verify", str(ckpt), "--device", "cpu"],
                         capture_output=True, text=True, env={**os.environ, "TRITON_INTERPRET": "0"}, timeout=300)
    assert out.returncode == 0, out.stderr
    err = float(out.stdout.split("relative error vs transformers")[1].split(":")[1])
    assert err < 1e-4, out.stdout
