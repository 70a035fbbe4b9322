"""Checkpoint save/load edge cases: what a save may replace, what it may write, what a load accepts.

Each test pins one behaviour: saving never deletes non-checkpoint files and never writes a checkpoint
whose config.json or tensors do not describe the model; loading checks every tensor's shape and dtype
from the safetensors headers before allocating, names the file at fault, reads a sparse config.json
with transformers' defaults, and picks the weights file transformers picks.
"""

from __future__ import annotations

import glob
import json
import os
import shutil

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

from checkpoints_tools import CheckpointError
from ligermodels import LigerLlama, UnsupportedConfigError, config_from_hf
from ligermodels.hf_io import load_hf, save_hf_state
from ligermodels.verify import main as cli_main
from tests.test_models import SMALL, make_hf_checkpoint
from tests.utils import rel_err


@pytest.fixture
def model(tmp_path):
    """A tiny Llama loaded from a transformers checkpoint in ``tmp_path/src``."""
    make_hf_checkpoint("llama_gqa_untied", str(tmp_path / "src"))
    return load_hf(str(tmp_path / "src"))


def _rewrite_json(path, **changes):
    cfg = json.loads(path.read_text())
    cfg.update(changes)
    for k in [k for k, v in changes.items() if v is None]:
        del cfg[k]
    path.write_text(json.dumps(cfg))


# ----------------------------------------------------------------------------------------- saving
def test_save_refuses_a_directory_holding_other_files_and_leaves_it_intact(model, tmp_path):
    run = tmp_path / "run"
    (run / "optimizer_state").mkdir(parents=True)
    (run / "train_log.txt").write_text("3 days of logs")
    with pytest.raises(CheckpointError, match=r"run.*not checkpoint files.*optimizer_state.*train_log\.txt"):
        model.save_hf(str(run))
    assert sorted(os.listdir(run)) == ["optimizer_state", "train_log.txt"]
    assert not [p for p in os.listdir(tmp_path) if p.startswith(".run.")], "a temporary directory was left behind"


def test_save_refuses_the_working_directory_with_source_files(model, tmp_path, monkeypatch):
    work = tmp_path / "work"
    work.mkdir()
    (work / "notes.py").write_text("x")
    monkeypatch.chdir(work)
    with pytest.raises(CheckpointError, match="notes.py"):
        model.save_hf(".")
    assert os.listdir(work) == ["notes.py"]


def test_save_replaces_a_previous_checkpoint_with_tokenizer_files(model, tmp_path):
    out = tmp_path / "final"
    model.save_hf(str(out), max_shard_bytes=30_000)  # sharded: model-0000k-of-0000n + index
    (out / "tokenizer.json").write_text("{}")
    model.save_hf(str(out))  # a re-run writing OUT/final again: the tokenizer file it held is kept
    assert sorted(os.listdir(out)) == ["config.json", "generation_config.json", "model.safetensors", "tokenizer.json"]
    assert (out / "tokenizer.json").read_text() == "{}"
    (tmp_path / "empty").mkdir()
    model.save_hf(str(tmp_path / "empty"))
    assert load_hf(str(tmp_path / "empty")).config == model.config


def test_replace_then_save_writes_the_changed_config_and_reloads_equal(model, tmp_path):
    small = LigerLlama(model.config.replace(num_layers=1, tie_embeddings=True)).init_weights()
    small.save_hf(str(tmp_path / "out"))
    cfg = json.loads((tmp_path / "out" / "config.json").read_text())
    assert cfg["num_hidden_layers"] == 1 and cfg["tie_word_embeddings"] is True
    assert cfg["eos_token_id"] == model.config.hf_config["eos_token_id"]  # token ids are carried over
    back = load_hf(str(tmp_path / "out"))
    assert back.config == small.config
    for (n, a), (_, b) in zip(small.state_dict().items(), back.state_dict().items(), strict=True):
        assert torch.equal(a, b), n


def test_unchanged_config_is_written_back_verbatim(model, tmp_path):
    model.save_hf(str(tmp_path / "out"))
    src = json.loads((tmp_path / "src" / "config.json").read_text())
    out = json.loads((tmp_path / "out" / "config.json").read_text())
    assert {k: v for k, v in out.items() if k != "dtype"} == {k: v for k, v in src.items() if k != "dtype"}


def test_save_hf_state_refuses_missing_extra_and_misshaped_tensors_before_writing(model, tmp_path):
    state = dict(model.state_dict())
    del state["layers.1.mlp.down.weight"]
    state["embed.weight"] = state["embed.weight"][:50]
    state["layers.0.extra.weight"] = torch.zeros(2)
    expected = (r"missing.*layers\.1\.mlp\.down\.weight.*unexpected.*layers\.0\.extra\.weight.*"
                r"embed\.weight \(50, 64\) \(expected \(101, 64\)")
    with pytest.raises(CheckpointError, match=expected):
        save_hf_state(state, model.config, str(tmp_path / "out"))
    assert sorted(os.listdir(tmp_path)) == ["src"]


# ----------------------------------------------------------------------------------------- loading
def test_integer_tensor_is_refused_by_name_and_file(tmp_path):
    make_hf_checkpoint("llama_gqa_untied", str(tmp_path))
    tensors = load_file(str(tmp_path / "model.safetensors"))
    name = "model.layers.0.self_attn.q_proj.weight"
    tensors[name] = (tensors[name] * 100).to(torch.int8)
    save_file(tensors, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=rf"{name} in model\.safetensors has dtype I8"):
        load_hf(str(tmp_path))


def test_bad_last_tensor_is_refused_before_the_model_is_allocated(tmp_path, monkeypatch):
    make_hf_checkpoint("llama_gqa_untied", str(tmp_path))
    tensors = load_file(str(tmp_path / "model.safetensors"))
    tensors["lm_head.weight"] = tensors["lm_head.weight"][:, :32].contiguous()
    save_file(tensors, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})

    def no_allocation(*args, **kwargs):
        raise AssertionError("the model was allocated before the checkpoint was checked")

    monkeypatch.setattr(torch.nn.Module, "to_empty", no_allocation)
    with pytest.raises(CheckpointError, match=r"lm_head\.weight has shape \(101, 32\), expected \(101, 64\)"):
        load_hf(str(tmp_path))


def _misplace_tensor(d):
    p = os.path.join(d, "model.safetensors.index.json")
    j = json.load(open(p))
    last = sorted(set(j["weight_map"].values()))[-1]
    j["weight_map"]["model.layers.0.self_attn.q_proj.weight"] = last
    json.dump(j, open(p, "w"))
    return last + r": lacks tensor model\.layers\.0\.self_attn\.q_proj\.weight"


def _truncate_shard(d):
    f = sorted(glob.glob(os.path.join(d, "*.safetensors")))[0]
    data = open(f, "rb").read()
    open(f, "wb").write(data[: len(data) // 2])
    return os.path.basename(f) + ": not a readable safetensors file"


def _corrupt_config(d):
    open(os.path.join(d, "config.json"), "w").write("{")
    return r"config\.json: config\.json is not valid JSON"


def _index_without_weight_map(d):
    open(os.path.join(d, "model.safetensors.index.json"), "w").write('{"metadata": {}}')
    return r"model\.safetensors\.index\.json: the shard index has no \"weight_map\""


@pytest.mark.parametrize("corrupt", [_misplace_tensor, _truncate_shard, _corrupt_config, _index_without_weight_map])
def test_corrupt_checkpoint_files_are_named(corrupt, tmp_path):
    d = str(tmp_path / "c")
    make_hf_checkpoint("llama_gqa_untied", d, shard=True)
    pattern = corrupt(d)
    with pytest.raises(CheckpointError, match=pattern):
        load_hf(d)


def test_model_safetensors_wins_over_a_stale_index_as_in_transformers(tmp_path):
    d = str(tmp_path / "c")
    hf = make_hf_checkpoint("llama_gqa_untied", d, shard=True)
    index = open(os.path.join(d, "model.safetensors.index.json")).read()
    shutil.rmtree(d)
    hf.save_pretrained(d)  # unsharded; then a stale index naming shards that are gone
    open(os.path.join(d, "model.safetensors.index.json"), "w").write(index)
    ours = load_hf(d)
    ids = torch.randint(0, 101, (2, 8), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert rel_err(ours(ids), hf(input_ids=ids).logits) <= 1e-5


# ------------------------------------------------------------------------------ config.json reading
MINIMAL = {  # the required fields only; heads chosen so each family's default num_key_value_heads divides them
    "llama": dict(hidden_size=64, num_attention_heads=4),
    "qwen2": dict(hidden_size=256, num_attention_heads=32),
    "mistral": dict(hidden_size=64, num_attention_heads=8),
    "phi3": dict(hidden_size=64, num_attention_heads=4),
    "gemma": dict(hidden_size=64, num_attention_heads=16),
}


@pytest.mark.parametrize("model_type", list(MINIMAL))
def test_fields_missing_from_config_json_take_transformers_defaults(model_type):
    d = dict(model_type=model_type, vocab_size=101, intermediate_size=96, num_hidden_layers=2,
             **MINIMAL[model_type])
    ours = config_from_hf(d)
    theirs = transformers.AutoConfig.for_model(**d)
    head_dim = getattr(theirs, "head_dim", None) or theirs.hidden_size // theirs.num_attention_heads
    window = getattr(theirs, "sliding_window", None) if getattr(theirs, "use_sliding_window", True) else None
    assert ours.norm_eps == theirs.rms_norm_eps
    assert ours.num_kv_heads == theirs.num_key_value_heads
    assert ours.head_dim == head_dim
    assert ours.sliding_window == window
    assert ours.tie_embeddings == theirs.tie_word_embeddings
    assert ours.max_position_embeddings == theirs.max_position_embeddings
    assert ours.rope.theta == theirs.rope_parameters["rope_theta"]
    assert ours.activation == {"silu": "silu", "gelu_pytorch_tanh": "gelu_tanh"}[theirs.hidden_act]
    pad = theirs.pad_token_id if theirs.pad_token_id is not None and theirs.pad_token_id < 101 else None
    assert ours.pad_token_id == pad


def test_phi3_without_rms_norm_eps_matches_transformers_logits(tmp_path):
    make_hf_checkpoint("phi3_default", str(tmp_path))
    _rewrite_json(tmp_path / "config.json", rms_norm_eps=None)
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path), dtype=torch.float32).eval()
    ours = load_hf(str(tmp_path), dtype=torch.float32)
    ids = torch.randint(0, 101, (2, 8), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert rel_err(ours(ids), hf(input_ids=ids).logits) <= 1e-5


def test_partial_rotary_factor_inside_rope_parameters_is_refused_by_name():
    cfg = dict(model_type="mistral", **SMALL)  # Phi-3 and GLM-4 honour the factor; the others refuse it
    rope = {"rope_type": "default", "rope_theta": 1e4}
    config_from_hf({**cfg, "rope_parameters": {**rope, "partial_rotary_factor": 1.0}})
    with pytest.raises(UnsupportedConfigError, match=r"rope_parameters\.partial_rotary_factor=0\.5"):
        config_from_hf({**cfg, "rope_parameters": {**rope, "partial_rotary_factor": 0.5}})


# ---------------------------------------------------------------------------------------- verify CLI
def test_verify_exits_1_when_the_error_exceeds_the_tolerance(monkeypatch):
    monkeypatch.setattr("ligermodels.verify.verify", lambda *a, **k: 1e-3)
    assert cli_main(["x", "--device", "cpu"]) == 1  # fp32 default tolerance 1e-4
    assert cli_main(["x", "--device", "cpu", "--tol", "1e-2"]) == 0
    assert cli_main(["x", "--device", "cpu", "--dtype", "bf16"]) == 0
    monkeypatch.setattr("ligermodels.verify.verify", lambda *a, **k: float("nan"))
    assert cli_main(["x", "--device", "cpu"]) == 1


def test_verify_exits_2_naming_the_problem_when_the_check_cannot_run(tmp_path, capsys):
    assert cli_main([str(tmp_path / "absent"), "--device", "cpu"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error:") and "absent" in err and "Traceback" not in err
    for device in ("tpu", "mps", "meta"):
        assert cli_main([str(tmp_path), "--device", device]) == 2
        assert f"--device '{device}'" in capsys.readouterr().err
    d = tmp_path / "shards"  # shards without their index: ours reads them, transformers does not
    make_hf_checkpoint("llama_gqa_untied", str(d), shard=True)
    os.remove(d / "model.safetensors.index.json")
    assert cli_main([str(d), "--device", "cpu"]) == 2
    assert "transformers cannot load" in capsys.readouterr().err
    if not torch.cuda.is_available():
        assert cli_main([str(tmp_path), "--device", "cuda"]) == 2
        assert "no such CUDA device" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:  # argparse: an unknown dtype is a usage error
        cli_main([str(tmp_path), "--dtype", "int8"])
    assert e.value.code == 2


def test_verify_never_lets_transformers_unpickle_weights(tmp_path, monkeypatch):
    """Beside pickled weights, a safetensors file transformers would not read is no checkpoint for either side."""
    d = tmp_path / "ckpt"
    make_hf_checkpoint("llama_gqa_untied", str(d))
    os.rename(d / "model.safetensors", d / "weights.safetensors")
    torch.save({"x": torch.zeros(1)}, d / "pytorch_model.bin")
    monkeypatch.setattr(torch, "load", lambda *a, **k: pytest.fail("a checkpoint was unpickled"))
    with pytest.raises(CheckpointError, match=r"no model\*\.safetensors.*weights\.safetensors"):
        load_hf(str(d))
    assert cli_main([str(d), "--device", "cpu"]) == 2


# ------------------------------------------------------------------------------- review fixes, saving
def test_save_carries_every_tokenizer_file_and_can_save_back_into_its_source(tmp_path):
    src = tmp_path / "src"
    make_hf_checkpoint("llama_gqa_untied", str(src))
    extra = {"chat_template.jinja": "{{ messages }}", "vocab.json": "{}", "merges.txt": "#v\n",
             "added_tokens.json": "{}"}
    for name, text in extra.items():
        (src / name).write_text(text)
    m = load_hf(str(src))
    m.save_hf(str(tmp_path / "out"))
    for name, text in extra.items():
        assert (tmp_path / "out" / name).read_text() == text, name
    m.save_hf(str(src))  # its own source directory: only checkpoint and tokenizer files there
    assert (src / "chat_template.jinja").read_text() == "{{ messages }}"


def test_saved_checkpoint_directory_is_as_readable_as_a_new_directory(model, tmp_path):
    umask = os.umask(0o022)
    try:
        model.save_hf(str(tmp_path / "out"))
    finally:
        os.umask(umask)
    assert os.stat(tmp_path / "out").st_mode & 0o777 == 0o755


def test_a_save_interrupted_between_the_renames_puts_the_previous_checkpoint_back(model, tmp_path, monkeypatch):
    out = tmp_path / "final"
    model.save_hf(str(out))
    before = {p: (out / p).read_bytes() for p in os.listdir(out)}
    real, calls = os.replace, []

    def replace(a, b):
        calls.append((a, b))
        if len(calls) == 2:  # the new checkpoint's rename into place
            raise KeyboardInterrupt
        return real(a, b)

    monkeypatch.setattr(os, "replace", replace)
    with pytest.raises(KeyboardInterrupt):
        model.save_hf(str(out))
    monkeypatch.setattr(os, "replace", real)
    assert {p: (out / p).read_bytes() for p in os.listdir(out)} == before
    assert not [p for p in os.listdir(tmp_path) if p.startswith(".final.")], "a temporary directory was left behind"


def test_save_hf_state_refuses_a_distinct_head_for_a_tied_config(model, tmp_path):
    state = model.state_dict()
    assert not torch.equal(state["head.weight"], state["embed.weight"])
    with pytest.raises(CheckpointError, match="head.weight differs from embed.weight"):
        save_hf_state(state, model.config.replace(tie_embeddings=True), str(tmp_path / "out"))
    assert not (tmp_path / "out").exists()
    tied = {**state, "head.weight": state["embed.weight"].clone()}  # equal values: nothing is lost
    save_hf_state(tied, model.config.replace(tie_embeddings=True), str(tmp_path / "out"))


# ------------------------------------------------------------------------------ review fixes, loading
def test_dtype_defaults_to_the_stored_weights_when_config_json_names_none(tmp_path):
    d = tmp_path / "ckpt"
    make_hf_checkpoint("llama_gqa_untied", str(d))
    tensors = {k: v.to(torch.bfloat16) for k, v in load_file(str(d / "model.safetensors")).items()}
    save_file(tensors, str(d / "model.safetensors"), metadata={"format": "pt"})
    _rewrite_json(d / "config.json", dtype=None, torch_dtype=None)
    m = load_hf(str(d))
    assert {p.dtype for p in m.parameters()} == {torch.bfloat16}
    m.save_hf(str(tmp_path / "out"))  # and the round trip stays bf16, bit for bit
    again = load_file(str(tmp_path / "out" / "model.safetensors"))
    assert all(torch.equal(again[k], t) for k, t in tensors.items() if k in again)


def test_mixed_dtype_checkpoint_without_a_config_dtype_loads_in_transformers_choice(tmp_path):
    d = tmp_path / "ckpt"
    make_hf_checkpoint("llama_gqa_untied", str(d))
    tensors = {k: v if k == "lm_head.weight" else v.to(torch.bfloat16)
               for k, v in load_file(str(d / "model.safetensors")).items()}
    save_file(tensors, str(d / "model.safetensors"), metadata={"format": "pt"})
    _rewrite_json(d / "config.json", dtype=None, torch_dtype=None)
    theirs = transformers.AutoModelForCausalLM.from_pretrained(str(d)).dtype
    assert load_hf(str(d)).embed.weight.dtype == theirs


def test_a_tied_head_equal_to_the_embedding_passes_even_with_nan(model, tmp_path):
    state = dict(model.state_dict())
    embed = state["embed.weight"].clone()
    embed[0, 0] = float("nan")
    state.update({"embed.weight": embed, "head.weight": embed.clone()})  # separate but equal copies
    save_hf_state(state, model.config.replace(tie_embeddings=True), str(tmp_path / "out"))
    state["head.weight"] = embed.to(torch.bfloat16)  # another dtype: different, refused by name
    with pytest.raises(CheckpointError, match="head.weight differs"):
        save_hf_state(state, model.config.replace(tie_embeddings=True), str(tmp_path / "out2"))


def test_same_values_compares_bits_dtype_and_conjugation():
    from ligermodels.hf_io import same_values

    x = torch.randn(4, 6)
    assert same_values(x, x) and same_values(x, x.clone()) and same_values(x[:, ::2], x[:, ::2].clone())
    assert not same_values(x, x.view(torch.int32))  # one storage, another dtype
    assert not same_values(x, -x) and not same_values(x, x.t().contiguous().t() + 1)
    c = torch.randn(3, 2, dtype=torch.complex128)
    assert same_values(c, c.clone()) and not same_values(c, c.conj())


def test_a_saved_checkpoint_keeps_the_parents_setgid_bit(model, tmp_path):
    parent = tmp_path / "shared"
    parent.mkdir()
    os.chmod(parent, 0o2775)
    if not os.stat(parent).st_mode & 0o2000:
        pytest.skip("this filesystem does not keep setgid on directories")
    model.save_hf(str(parent / "out"))
    assert os.stat(parent / "out").st_mode & 0o2000


def test_a_tensor_in_two_unindexed_files_is_refused_naming_both(tmp_path):
    d = tmp_path / "ckpt"
    make_hf_checkpoint("llama_gqa_untied", str(d))
    tensors = load_file(str(d / "model.safetensors"))
    os.remove(d / "model.safetensors")
    save_file(tensors, str(d / "model-a.safetensors"), metadata={"format": "pt"})
    save_file({"model.norm.weight": tensors["model.norm.weight"] + 1}, str(d / "model-b.safetensors"),
              metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=r"model\.norm\.weight.*model-a\.safetensors.*model-b\.safetensors"):
        load_hf(str(d))


def test_source_dir_is_absolute_so_a_later_chdir_copies_the_right_tokenizer(tmp_path, monkeypatch):
    make_hf_checkpoint("llama_gqa_untied", str(tmp_path / "src"))
    monkeypatch.chdir(tmp_path)
    m = load_hf("src")
    assert m.source_dir == str(tmp_path / "src")


def test_a_revision_with_a_local_directory_is_refused(model, tmp_path):
    with pytest.raises(CheckpointError, match="revision='v2'.*local directory"):
        load_hf(str(tmp_path / "src"), revision="v2")


def test_an_uncached_revision_is_named_in_the_error(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "cache"))
    import huggingface_hub.constants as constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "cache"))
    nor = r"\(nor is there a local directory 'someone/tiny'\)"
    with pytest.raises(CheckpointError, match=rf"'someone/tiny' at revision 'v9' {nor}.*offline"):
        load_hf("someone/tiny", revision="v9")


@pytest.mark.parametrize("problem", ["unsupported", "other family"])
def test_a_hub_repo_is_refused_from_its_config_before_any_weight_downloads(problem, tmp_path, monkeypatch):
    import huggingface_hub

    cfg_dir = tmp_path / "snapshot"
    make_hf_checkpoint("qwen2_bias_tied_sliding", str(cfg_dir))
    if problem == "unsupported":
        _rewrite_json(cfg_dir / "config.json", model_type="mamba")
    fetched = []
    def config_only(repo_id, filename, revision=None, **kwargs):
        fetched.append(filename)
        return str(cfg_dir / filename)

    monkeypatch.setattr(huggingface_hub, "hf_hub_download", config_only)
    monkeypatch.setattr(huggingface_hub, "snapshot_download",
                        lambda *a, **k: pytest.fail("weights were downloaded before the config was checked"))
    error = UnsupportedConfigError if problem == "unsupported" else CheckpointError
    with pytest.raises(error, match="mamba" if problem == "unsupported" else "'qwen2' checkpoint, not 'llama'"):
        LigerLlama.from_hf("someone/tiny")
    assert fetched == ["config.json"]
