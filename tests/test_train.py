"""The training loop (``python -m ligermodels.train``) end to end, on the CPU with gloo.

The runs start from a tiny random Llama made with transformers (``save_pretrained``) and the demo's
character tokenizer, train a few fp32 steps with the PyTorch reference kernels
(``TRITON_INTERPRET=0`` in the children), and are shared by the tests below:

* ``one``: 1 process, grad-accum 2, no activation checkpointing;
* ``two``: 2 processes (torchrun), grad-accum 1, ``--ac full``, checkpoints at steps 2 and 4;
* ``resumed``: a copy of ``two`` cut back to its step-2 checkpoint (plus a half-written step-6 one),
  continued with ``--resume`` (and ``--ac selective``);
* ``tuned``: ``two`` with each layer compiled (``--compile``), ``--reshard-after-forward never`` and
  ``--prefetch 1`` (the options a multi-GPU run tunes; none may change the numbers).

In-process tests (packing, document masking, activation checkpointing) run the Triton kernels
through the interpreter like the rest of the suite.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
import re
import shutil
import subprocess
import sys
import types

import pytest
import torch
from safetensors.torch import load_file, save_file

import ligermodels.train.cuda_graph as cuda_graph_module
import ligermodels.train.parallelize as parallelize_module
from kernels import AdamW
from ligermodels import LigerLlama, document_ids_from_positions
from ligermodels.blocks import MLP, RMSNorm
from ligermodels.config import DecoderConfig
from ligermodels.train import TrainConfig, TrainError, parse_args
from ligermodels.train.checkpointing import RESUME_FLAGS, check_out_dir, check_resume
from ligermodels.train.cuda_graph import check_cuda_graph
from ligermodels.train.data import (
    IGNORE_INDEX,
    DataError,
    Example,
    PackedRows,
    load_inputs,
    read_jsonl,
    special_token_ids,
    tokenize,
)
from ligermodels.train.demo import build_tokenizer, save_tokenizer
from ligermodels.train.metrics import metrics_up_to
from ligermodels.train.objectives import SFTTask
from ligermodels.train.parallelize import (
    apply_activation_checkpointing,
    device_memory_bytes,
    init_device,
    load_full_state,
    loss_strategy,
    lr_factor,
)
from ligermodels.train.profiling import (
    StepProfiler,
    device_time_by_category,
    exposed_by_label,
    exposed_us,
    idle_by_launch_site,
    memory_at_peak,
    union_us,
)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENV = {**os.environ, "TRITON_INTERPRET": "0", "OMP_NUM_THREADS": "1", "PYTHONPATH": ROOT, "HF_HUB_OFFLINE": "1"}
TIMEOUT = 240


def _train(args: list[str], nproc: int = 1) -> subprocess.CompletedProcess:
    launcher = ([sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}"]
                if nproc > 1 else [sys.executable])
    return subprocess.run([*launcher, "-m", "ligermodels.train", *args], cwd=ROOT, env=ENV, capture_output=True,
                          text=True, timeout=TIMEOUT)


def _metrics(out) -> list[dict]:
    with open(os.path.join(out, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def _weights(out) -> dict[str, torch.Tensor]:
    return load_file(os.path.join(out, "final", "model.safetensors"))


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm().clamp(min=1e-30)).item()


# ---------------------------------------------------------------------------------------------- fixtures
def _flags(checkpoint: str, data: str, out) -> list[str]:
    return ["--model", checkpoint, "--data", data, "--out", str(out), "--seq-len", "32", "--batch-size", "2",
            "--steps", "4", "--lr", "1e-2", "--warmup-steps", "1", "--dtype", "fp32", "--device", "cpu"]


@pytest.fixture(scope="module")
def run_one(checkpoint, data, workdir):
    out = workdir / "one"
    res = _train([*_flags(checkpoint, data, out), "--grad-accum", "2", "--save-every", "0"])
    assert res.returncode == 0, res.stderr[-4000:]
    return out


def _two_ranks(checkpoint: str, data: str, out, *flags: str):
    """:func:`_flags` under torchrun on two ranks, one micro-batch a step, checkpoints at steps 2 and 4, full
    activation checkpointing, then ``flags``; returns ``out`` once the run succeeded."""
    res = _train([*_flags(checkpoint, data, out), "--grad-accum", "1", "--save-every", "2", "--ac", "full", *flags],
                 nproc=2)
    assert res.returncode == 0, res.stderr[-4000:]
    return out


@pytest.fixture(scope="module")
def run_two(checkpoint, data, workdir):
    return _two_ranks(checkpoint, data, workdir / "two", "--report-to", "tensorboard")


def _cut_back_to_step_2(run, out):
    """A copy of ``run`` (checkpoints at steps 2 and 4) as if it had stopped after step 2's checkpoint."""
    shutil.copytree(run, out)
    shutil.rmtree(out / "checkpoints" / "step_00000004")
    shutil.rmtree(out / "final")
    return out


@pytest.fixture(scope="module")
def run_resumed(checkpoint, data, workdir, run_two):
    out = _cut_back_to_step_2(run_two, workdir / "resumed")
    # a crash in the middle of writing step 6 leaves this: --resume must not take it
    (out / "checkpoints" / "step_00000006.tmp").mkdir()
    (out / "checkpoints" / "step_00000006.tmp" / ".metadata").write_text("truncated")
    res = _train([*_flags(checkpoint, data, out), "--grad-accum", "1", "--save-every", "2", "--ac", "selective",
                  "--report-to", "tensorboard", "--resume"], nproc=2)
    assert res.returncode == 0, res.stderr[-4000:]
    assert "resumed from" in res.stdout and "step_00000002" in res.stdout
    return out


# ---------------------------------------------------------------------------------------------- torchrun runs
def test_split_invariance_one_rank_accum2_equals_two_ranks(run_one, run_two):
    """(1 rank, grad-accum 2) and (2 ranks, grad-accum 1): same global batches, losses, updates."""
    one, two = _metrics(run_one), _metrics(run_two)
    assert [m["step"] for m in one] == [m["step"] for m in two] == [1, 2, 3, 4]
    for a, b in zip(one, two, strict=True):
        assert a["tokens"] == b["tokens"] > 0
        assert a["lr"] == b["lr"]
        assert abs(a["loss"] - b["loss"]) <= 1e-5 * abs(b["loss"]), (a, b)
        assert abs(a["grad_norm"] - b["grad_norm"]) <= 1e-5 * abs(b["grad_norm"]), (a, b)
    assert one[-1]["loss"] < one[0]["loss"]
    w1, w2 = _weights(run_one), _weights(run_two)
    assert w1.keys() == w2.keys()
    for k in w1:
        assert _rel(w1[k], w2[k]) <= 1e-5, k


def test_an_embedding_sharded_by_vocabulary_takes_the_gathered_embeddings_steps(checkpoint, data, workdir, run_two):
    """--shard-embedding vocab (each rank looks up its own rows for both ranks' tokens) against FSDP2 gathering
    the table: the same losses, gradient norms and exported weights within fp32 rounding; a checkpoint written
    by the gathering run resumes under vocab sharding (one DCP layout) and ends where that run ended."""
    from ligermodels.train.config import TrainConfig
    from ligermodels.train.parallelize import embedding_sharding

    config = TrainConfig(out="o", seq_len=32, batch_size=2)  # run_two's: auto gathers this tiny vocabulary
    assert embedding_sharding(config, LigerLlama.from_hf(checkpoint).config, 2) == "gather"
    vocab = load_file(os.path.join(checkpoint, "model.safetensors"))["model.embed_tokens.weight"].shape[0]
    assert vocab % 2 == 1  # the two blocks differ in length: ceil(V / 2) rows and one fewer
    run_vocab_sharded = _two_ranks(checkpoint, data, workdir / "vocab-sharded", "--shard-embedding", "vocab")
    two, sharded = _metrics(run_two), _metrics(run_vocab_sharded)
    assert [m["step"] for m in sharded] == [1, 2, 3, 4]
    for a, b in zip(two, sharded, strict=True):
        assert abs(a["loss"] - b["loss"]) <= 1e-6 * abs(a["loss"]), (a, b)
        assert abs(a["grad_norm"] - b["grad_norm"]) <= 1e-6 * abs(a["grad_norm"]), (a, b)
    w1, w2 = _weights(run_two), _weights(run_vocab_sharded)
    assert w1.keys() == w2.keys()
    for k in w1:
        assert _rel(w2[k], w1[k]) <= 1e-6, k
    out = _cut_back_to_step_2(run_two, workdir / "vocab-resumed")
    w3 = _weights(_two_ranks(checkpoint, data, out, "--shard-embedding", "vocab", "--resume"))
    for k in w1:
        assert _rel(w3[k], w1[k]) <= 1e-6, k


@pytest.fixture(scope="module")
def run_tuned(checkpoint, data, workdir):
    out = workdir / "tuned"
    res = _train([*_flags(checkpoint, data, out), "--grad-accum", "1", "--save-every", "0", "--ac", "full",
                  "--compile", "--reshard-after-forward", "never", "--prefetch", "1"], nproc=2)
    assert res.returncode == 0, res.stderr[-4000:]
    return out


def test_compile_reshard_and_prefetch_take_the_same_steps(run_two, run_tuned):
    """Compiled layers (inside full activation checkpointing, attention within documents), no resharding after
    forward and explicit prefetching: the uncompiled run's losses and updates within fp32 rounding."""
    two, tuned = _metrics(run_two), _metrics(run_tuned)
    assert [m["step"] for m in tuned] == [1, 2, 3, 4]
    for a, b in zip(two, tuned, strict=True):
        assert a["tokens"] == b["tokens"] > 0
        assert abs(a["loss"] - b["loss"]) <= 1e-5 * abs(a["loss"]), (a, b)
        assert abs(a["grad_norm"] - b["grad_norm"]) <= 1e-5 * abs(a["grad_norm"]), (a, b)
    w1, w2 = _weights(run_two), _weights(run_tuned)
    assert w1.keys() == w2.keys()  # compiling changes no parameter name
    for k in w1:
        assert _rel(w2[k], w1[k]) <= 1e-5, k


def test_overlap_of_communication_with_computation():
    """The profile's exposed communication: the time NCCL runs while nothing else does."""
    assert union_us([]) == 0.0
    assert union_us([(0.0, 4.0), (2.0, 6.0), (10.0, 11.0), (1.0, 3.0)]) == 7.0
    compute = [(0.0, 5.0), (8.0, 12.0)]
    assert exposed_us([(1.0, 4.0)], compute) == 0.0  # hidden behind compute
    assert exposed_us([(4.0, 9.0)], compute) == 3.0  # 5..8 alone
    assert exposed_us([(4.0, 9.0), (6.0, 7.0), (11.0, 14.0)], compute) == 5.0  # 5..8 and 12..14
    assert exposed_us([(1.0, 2.0)], []) == 1.0


def test_exposed_communication_is_charged_to_the_collective_that_ran():
    """Each collective's exposed time is the time some kernel of it runs and no compute does (two kernels of one
    collective side by side counted once, as the step's own exposed time is), labelled by the collective its NCCL
    kernel runs."""
    compute = [(0.0, 5.0), (3.0, 6.0), (8.0, 12.0)]
    comm = [(4.0, 9.0, "gather embed"), (11.0, 14.0, "reduce head"), (13.0, 15.0, "reduce head"), (1.0, 2.0, "x")]
    assert exposed_by_label(comm, compute) == {"gather embed": 2.0, "reduce head": 3.0, "x": 0.0}  # 12..15 once
    label = StepProfiler.collective_label
    assert label("ncclDevKernel_ReduceScatter_Sum_f32_RING_LL(ncclDevKernelArgsStorage<4096ul>)") == \
        "ReduceScatter f32"
    assert label("ncclDevKernel_AllReduce_Sum_u64_RING_LL(ncclDevKernelArgsStorage<4096ul>)") == "AllReduce u64"
    assert label("ncclDevKernel_AllGather_RING_LL(ncclDevKernelArgsStorage<4096ul>)") == "AllGather"
    assert label("ncclKernel_unknown(args)") == "ncclKernel_unknown"


def test_profile_categories_count_kernels_and_skip_annotations_that_span_them():
    """FSDP2's GPU-side annotations cover the NCCL kernels and copies they launch: counting them too read
    a 2-GPU step's busy time as 159% of its wall time."""
    from types import SimpleNamespace as E

    cuda, cpu = torch.autograd.DeviceType.CUDA, torch.autograd.DeviceType.CPU
    averages = [E(key="ncclDevKernel_AllGather_RING_LL(args)", device_type=cuda, self_device_time_total=6000.0),
                E(key="FSDP::all_gather (layers.0)", device_type=cuda, self_device_time_total=7000.0,
                  is_user_annotation=True),
                E(key="nvjet_sm90_tst_192x192", device_type=cuda, self_device_time_total=20000.0),
                E(key="Optimizer.step#AdamW.step", device_type=cuda, self_device_time_total=9000.0),
                E(key="elementwise_kernel", device_type=cuda, self_device_time_total=2000.0),
                E(key="aten::mm", device_type=cpu, self_device_time_total=20000.0)]
    per_cat, kernels = device_time_by_category(averages, StepProfiler.CATEGORIES, steps=2)
    assert per_cat == {"communication (NCCL)": 3.0, "matmul": 10.0, "other elementwise": 1.0}
    assert set(kernels) == {"ncclDevKernel_AllGather_RING_LL(args)", "nvjet_sm90_tst_192x192", "elementwise_kernel"}


@pytest.fixture(scope="module")
def runs_bf16(checkpoint, data, workdir):
    """bf16 on the CPU: one rank (master weights in the optimiser, no FSDP) with grad-accum 2 and a
    checkpoint at step 2, two FSDP ranks (fp32 shards, bf16 compute), and the one-rank run resumed
    from its step-2 checkpoint."""
    flags = {"one": ["--grad-accum", "2"], "two": ["--grad-accum", "1"]}
    outs = {}
    for name, extra in flags.items():
        out = workdir / f"bf16-{name}"
        f = _flags(checkpoint, data, out)
        f[f.index("--dtype") + 1] = "bf16"
        res = _train([*f, *extra, "--save-every", "2"], nproc=1 if name == "one" else 2)
        assert res.returncode == 0, res.stderr[-4000:]
        outs[name] = out
    resumed = _cut_back_to_step_2(outs["one"], workdir / "bf16-resumed")
    f = _flags(checkpoint, data, resumed)
    f[f.index("--dtype") + 1] = "bf16"
    res = _train([*f, "--grad-accum", "2", "--save-every", "2", "--resume"])
    assert res.returncode == 0 and "(step 2)" in res.stdout, res.stderr[-4000:]
    return {**outs, "resumed": resumed}


def test_bf16_one_rank_with_master_weights_takes_the_steps_of_two_fsdp_ranks(runs_bf16):
    """The one-rank bf16 loop (fp32 masters in the optimiser, bf16 parameters, fp32 gradient sums) computes
    what FSDP2's mixed precision computes (fp32 shards cast to bf16, gradients reduced in fp32): the same
    bf16 weights every step, up to fp32 rounding of the update."""
    one, two = _metrics(runs_bf16["one"]), _metrics(runs_bf16["two"])
    for a, b in zip(one, two, strict=True):
        assert a["tokens"] == b["tokens"] and a["lr"] == b["lr"]
        assert abs(a["loss"] - b["loss"]) <= 2e-3 * abs(b["loss"]), (a, b)
        assert abs(a["grad_norm"] - b["grad_norm"]) <= 1e-2 * abs(b["grad_norm"]), (a, b)
    w1, w2 = _weights(runs_bf16["one"]), _weights(runs_bf16["two"])
    for k in w1:
        assert w1[k].dtype == w2[k].dtype == torch.bfloat16
        assert _rel(w1[k], w2[k]) <= 1e-2, k


def test_bf16_master_weight_checkpoints_hold_fp32_weights_and_resume_exactly(runs_bf16):
    from torch.distributed.checkpoint import FileSystemReader

    meta = FileSystemReader(str(runs_bf16["one"] / "checkpoints" / "step_00000002")).read_metadata()
    weights = {k: v for k, v in meta.state_dict_metadata.items() if k.startswith("model.")}
    assert weights and all(v.properties.dtype == torch.float32 for v in weights.values()), weights
    assert not [k for k in meta.state_dict_metadata if "master" in k]  # the low bits are folded into the weights
    one, resumed = _metrics(runs_bf16["one"]), _metrics(runs_bf16["resumed"])
    assert [(m["loss"], m["grad_norm"]) for m in one] == [(m["loss"], m["grad_norm"]) for m in resumed]
    w1, w2 = _weights(runs_bf16["one"]), _weights(runs_bf16["resumed"])
    for k in w1:
        assert torch.equal(w1[k], w2[k]), k


@pytest.fixture(scope="module")
def runs_lora(checkpoint, data, workdir):
    """LoRA (rank 4 on all seven projections): one rank with grad-accum 2 and --merge, two FSDP ranks, and the
    one-rank run resumed from its step-2 checkpoint."""
    lora = ["--lora-rank", "4", "--lora-alpha", "8", "--save-every", "2"]
    outs = {}
    for name, extra, nproc in (("one", ["--grad-accum", "2", "--merge"], 1), ("two", ["--grad-accum", "1"], 2)):
        out = workdir / f"lora-{name}"
        res = _train([*_flags(checkpoint, data, out), *lora, *extra], nproc=nproc)
        assert res.returncode == 0, res.stderr[-4000:]
        outs[name] = out
    resumed = _cut_back_to_step_2(outs["one"], workdir / "lora-resumed")
    res = _train([*_flags(checkpoint, data, resumed), *lora, "--grad-accum", "2", "--merge", "--resume"])
    assert res.returncode == 0 and "(step 2)" in res.stdout, res.stderr[-4000:]
    return {**outs, "resumed": resumed}


def test_lora_training_trains_the_adapters_only_and_exports_a_peft_adapter(runs_lora, checkpoint):
    from torch.distributed.checkpoint import FileSystemReader

    from ligermodels import AutoLigerModel
    from ligermodels.lora import load_lora

    one, two = _metrics(runs_lora["one"]), _metrics(runs_lora["two"])
    for a, b in zip(one, two, strict=True):  # the same global batches split two ways
        assert abs(a["loss"] - b["loss"]) <= 1e-5 * abs(b["loss"]), (a, b)
    assert one[-1]["loss"] < one[0]["loss"]
    meta = FileSystemReader(str(runs_lora["one"] / "checkpoints" / "step_00000002")).read_metadata()
    weights = [k for k in meta.state_dict_metadata if k.startswith("model.")]
    assert weights and all(k.endswith((".lora_A", ".lora_B")) for k in weights), weights  # no frozen base
    final = runs_lora["one"] / "final"
    assert {"adapter_config.json", "adapter_model.safetensors", "tokenizer.json"} <= set(os.listdir(final))
    adapted = load_lora(AutoLigerModel.from_hf(checkpoint, dtype=torch.float32), str(final))
    ids = torch.randint(4, adapted.config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    merged = AutoLigerModel.from_hf(str(runs_lora["one"] / "merged"), dtype=torch.float32)
    with torch.no_grad():
        assert _rel(adapted(ids), merged(ids)) <= 1e-5
        assert _rel(adapted(ids), AutoLigerModel.from_hf(checkpoint, dtype=torch.float32)(ids)) > 1e-4  # it trained
    resumed = _metrics(runs_lora["resumed"])
    assert [(m["loss"], m["grad_norm"]) for m in one] == [(m["loss"], m["grad_norm"]) for m in resumed]
    assert (runs_lora["resumed"] / "final" / "adapter_model.safetensors").read_bytes() == \
        (final / "adapter_model.safetensors").read_bytes()


def test_lora_over_an_embedding_sharded_by_vocabulary_takes_the_two_rank_lora_steps(runs_lora, checkpoint, data,
                                                                                      workdir):
    """The frozen embedding under --shard-embedding vocab (no gradient, out of FSDP2's root): the same losses and
    adapters as the two-rank LoRA run that gathers it."""
    out = workdir / "lora-vocab"
    res = _train([*_flags(checkpoint, data, out), "--lora-rank", "4", "--lora-alpha", "8", "--save-every", "2",
                  "--grad-accum", "1", "--shard-embedding", "vocab"], nproc=2)
    assert res.returncode == 0, res.stderr[-4000:]
    two, vocab = _metrics(runs_lora["two"]), _metrics(out)
    assert len(two) == len(vocab) == 4
    for a, b in zip(two, vocab, strict=True):
        assert abs(a["loss"] - b["loss"]) <= 1e-6 * abs(a["loss"]), (a, b)
    a, b = (load_file(str(run / "final" / "adapter_model.safetensors")) for run in (runs_lora["two"], out))
    assert a.keys() == b.keys() and all(_rel(b[k], a[k]) <= 1e-6 for k in a)


def test_lora_on_one_rank_in_bf16_allocates_the_frozen_base_in_bf16(checkpoint, data, workdir):
    """One rank, bf16 compute, LoRA: the frozen base is built in bf16 (never an fp32 copy on the device) and the
    adapters in fp32; the run trains, and its first loss is the loss of the base rounded to bf16 once."""
    from ligermodels import AutoLigerModel
    from ligermodels.train.parallelize import build_model, build_optimizer

    out = workdir / "lora-bf16"
    args = parse_args([*_flags(checkpoint, data, out), "--dtype", "bf16", "--lora-rank", "4", "--save-every", "0"])
    assert isinstance(args, TrainConfig)
    torch.distributed.init_process_group("gloo", init_method=f"file://{workdir / 'lora-bf16.store'}", rank=0,
                                         world_size=1)  # a file store: no port to collide with another run
    try:
        model = build_model(load_inputs(args), args, 0, 1, torch.device("cpu"))
        build_optimizer(model, args, 1)
    finally:
        torch.distributed.destroy_process_group()
    dtypes = {n: p.dtype for n, p in model.named_parameters()}
    assert {d for n, d in dtypes.items() if "lora_" in n} == {torch.float32}
    assert {d for n, d in dtypes.items() if "lora_" not in n} == {torch.bfloat16}
    base = AutoLigerModel.from_hf(checkpoint, dtype=torch.float32).state_dict()
    frozen = {n: p for n, p in model.state_dict().items() if "lora_" not in n}
    assert frozen.keys() == base.keys()
    for name, p in frozen.items():  # the checkpoint's weights, rounded to bf16 once
        assert torch.equal(p, base[name].to(torch.bfloat16)), name
    res = _train([*_flags(checkpoint, data, out), "--dtype", "bf16", "--lora-rank", "4", "--save-every", "0",
                  "--merge"])
    assert res.returncode == 0, res.stderr[-4000:]
    assert all(math.isfinite(m["loss"]) for m in _metrics(out))


@pytest.mark.parametrize("flags, message", [
    (["--lora-rank", "-1"], "--lora-rank must be at least 0"),
    (["--lora-rank", "4", "--lora-targets", "q,bogus"], "--lora-targets"),
    (["--lora-rank", "4", "--lora-dropout", "1"], "--lora-dropout must be in [0, 1)"),
    (["--merge"], "--merge folds LoRA adapters into the base: it needs --lora-rank"),
    (["--fp8", "e4m3"], "--fp8: invalid choice"),
    (["--fp8", "rowwise", "--compile"], "--fp8 with --compile"),
])
def test_bad_lora_flags_are_refused_by_name(capsys, flags, message):
    with pytest.raises(SystemExit):
        parse_args(["--model", "m", "--data", "d.jsonl", "--out", "o", *flags])
    assert message in capsys.readouterr().err


def test_lora_on_a_random_base_needs_merge(capsys):
    with pytest.raises(SystemExit):
        parse_args(["--out", "o", "--lora-rank", "4"])  # the demo: a random base saved nowhere
    assert "needs --merge" in capsys.readouterr().err


def test_metrics_lines(run_two):
    m = _metrics(run_two)[0]
    assert set(m) == {"step", "loss", "lr", "grad_norm", "tokens", "tokens_per_s", "mfu", "peak_mem_gb"}
    assert m["mfu"] is None and m["tokens_per_s"] > 0 and m["peak_mem_gb"] > 0


def test_the_last_step_is_timed_like_the_others(run_one):
    # It is read at once, not behind a queued step: timed from the host's read, it measured almost nothing
    speeds = [m["tokens_per_s"] for m in _metrics(run_one)]
    assert speeds[-1] < 5 * max(speeds[1:-1]), speeds


def test_resume_reproduces_the_uninterrupted_run(run_two, run_resumed):
    two, resumed = _metrics(run_two), _metrics(run_resumed)
    assert [m["step"] for m in resumed] == [1, 2, 3, 4]
    for a, b in zip(two, resumed, strict=True):
        assert (a["loss"], a["grad_norm"], a["lr"], a["tokens"]) == (b["loss"], b["grad_norm"], b["lr"], b["tokens"])
    w1, w2 = _weights(run_two), _weights(run_resumed)
    for k in w1:
        assert torch.equal(w1[k], w2[k]), k
    # the run checkpointed step 4 itself; the stale .tmp was removed
    assert sorted(os.listdir(run_resumed / "checkpoints")) == ["step_00000002", "step_00000004"]


def test_tensorboard_scalars_are_the_metrics_lines_and_a_resume_replaces_the_steps_past_its_checkpoint(
        run_two, run_resumed):
    """--report-to tensorboard: every metrics.jsonl value (mfu is null on the CPU) as a scalar train/<name> per
    step; the resumed copy of the run (cut back to step 2, its events of steps 3-4 still on disk) reads as one
    run of steps 1-4, the resumed run's own."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    for run in (run_two, run_resumed):
        events = EventAccumulator(str(run / "tensorboard"))
        events.Reload()
        assert set(events.Tags()["scalars"]) == {"train/loss", "train/lr", "train/grad_norm", "train/tokens",
                                                 "train/tokens_per_s", "train/peak_mem_gb"}
        metrics = _metrics(run)
        for name in ("loss", "lr", "grad_norm", "tokens"):
            scalars = events.Scalars(f"train/{name}")
            assert [e.step for e in scalars] == [m["step"] for m in metrics] == [1, 2, 3, 4], (run, name)
            assert [e.value for e in scalars] == pytest.approx([m[name] for m in metrics], rel=1e-6), (run, name)


def test_wandb_gets_each_steps_metrics_with_the_runs_config(monkeypatch, tmp_path):
    """--report-to wandb: one W&B run named after OUT with the TrainConfig as its config, each step's non-null
    metrics logged as train/<name> at that step, finished at the end (a stand-in module records the calls:
    wandb is an optional extra, not a test dependency)."""
    import types as module_types

    from ligermodels.train.metrics import MetricsLog

    calls = []

    class Run:
        def log(self, values, step):
            calls.append(("log", values, step))

        def finish(self):
            calls.append(("finish",))

    def init(**kwargs):
        calls.append(("init", kwargs))
        return Run()

    monkeypatch.setitem(sys.modules, "wandb", module_types.SimpleNamespace(init=init))
    config = TrainConfig(out=str(tmp_path / "run"), report_to="wandb", steps=2)
    log = MetricsLog(config, rank=0, resumed_step=None)
    step = {"lr": 1e-3, "grad_norm": 0.5, "tokens": 10, "tokens_per_s": 100.0, "mfu": None, "peak_mem_gb": 1.0}
    log.log({"step": 1, "loss": 2.5, **step})
    log.log({"step": 2, "loss": float("nan"), **step})
    log.close()
    assert calls[0][0] == "init" and calls[0][1]["name"] == "run" and calls[0][1]["config"]["steps"] == 2
    logged = {f"train/{k}": v for k, v in step.items() if v is not None}
    assert calls[1:] == [("log", {"train/loss": 2.5, **logged}, 1), ("log", logged, 2), ("finish",)]
    assert [json.loads(line)["loss"] for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()] == \
        [2.5, None]


def test_checkpoint_layout(run_two):
    ckpt = run_two / "checkpoints" / "step_00000002"
    files = set(os.listdir(ckpt))
    assert {".metadata", "train_state.json", "rng_rank00000.pt", "rng_rank00001.pt"} <= files
    state = json.loads((ckpt / "train_state.json").read_text())
    assert state["step"] == 2 and state["rows_consumed"] == 2 * 2 * 2 and state["scheduler"]["last_epoch"] == 2
    flags = {"seq_len": 32, "seed": 0, "lr": 1e-2, "lr_schedule": "cosine", "warmup_steps": 1, "min_lr_ratio": 0.1,
             "steps": 4, "weight_decay": 0.1, "lora_rank": 0, "lora_alpha": 16.0, "lora_dropout": 0.0,
             "lora_targets": "q,k,v,o,gate,up,down", "objective": "sft", "beta": 0.1, "dpo_loss": "sigmoid",
             "label_smoothing": 0.0, "simpo_gamma": 0.5, "cpo_alpha": 0.0, "desirable_weight": 1.0,
             "undesirable_weight": 1.0, "reference": "precompute"}
    assert {key: state[key] for key in RESUME_FLAGS} == flags


def test_the_python_api_takes_the_command_lines_steps(checkpoint, data, workdir, run_one, reference_kernels):
    """train(TrainConfig(...)) in this process (a process group of its own, torn down after) takes the steps of
    the same flags on the command line (run_one), within fp32 rounding; the config is frozen. Both run the
    PyTorch kernels (the Triton ones through the interpreter are the kernel tests')."""
    from ligermodels.train import train

    out = workdir / "python-api"
    config = TrainConfig(model=checkpoint, data=data, out=str(out), seq_len=32, batch_size=2, grad_accum=2, steps=4,
                         lr=1e-2, warmup_steps=1, dtype="fp32", device="cpu", save_every=0)
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.lr = 1.0
    assert train(config) == str(out / "final")
    assert not torch.distributed.is_initialized()
    for a, b in zip(_metrics(run_one), _metrics(out), strict=True):
        assert (a["step"], a["tokens"], a["lr"]) == (b["step"], b["tokens"], b["lr"])
        assert abs(a["loss"] - b["loss"]) <= 1e-5 * abs(a["loss"]), (a, b)
    w1, w2 = _weights(run_one), _weights(out)
    for k in w1:
        assert _rel(w2[k], w1[k]) <= 1e-5, k
    with pytest.raises(TrainError, match="give both --model and --data"):
        TrainConfig(model=checkpoint, out=str(out))


def test_a_lora_export_gathers_the_adapters_alone_unless_merging(checkpoint, data, workdir, monkeypatch,
                                                                reference_kernels):
    """OUT/final of a LoRA run is the adapter: only the trained parameters are gathered to the host for it (the
    frozen base stays where it is: 61 GB at Qwen3-30B-A3B); --merge gathers the whole model, base included."""
    import ligermodels.train.checkpointing as checkpointing
    from ligermodels.train import train

    gathered, real = [], checkpointing.get_model_state_dict

    def spy(model, options=None):
        state = real(model, options=options)
        gathered.append(set(state))
        return state

    monkeypatch.setattr(checkpointing, "get_model_state_dict", spy)
    for merge in (False, True):
        out = workdir / f"lora-export-{merge}"
        train(TrainConfig(model=checkpoint, data=data, out=str(out), seq_len=32, batch_size=2, steps=1,
                          dtype="fp32", device="cpu", save_every=0, lora_rank=4, merge=merge))
        assert (out / "final" / "adapter_model.safetensors").exists() and (out / "merged").exists() == merge
    adapter, merged = gathered
    assert adapter and all(k.endswith((".lora_A", ".lora_B")) for k in adapter)
    assert adapter < merged and "embed.weight" in merged


def test_fp8_training_takes_the_steps_of_full_precision_within_quantisation_error(checkpoint, data, workdir,
                                                                                      run_one):
    """--fp8 rowwise on the command line (the CPU runs the recipe's quantised math in PyTorch; the kernels
    themselves are tests/test_fp8.py's): the projections run on e4m3-quantised operands, so each step's loss is
    run_one's within a few percent (not equal: the FP8 path ran), the loss falls as run_one's does, and the
    checkpoint holds plain fp32 weights."""
    out = workdir / "fp8"
    res = _train([*_flags(checkpoint, data, out), "--grad-accum", "2", "--save-every", "0", "--fp8", "rowwise"])
    assert res.returncode == 0, res.stderr[-4000:]
    full, fp8 = _metrics(run_one), _metrics(out)
    for a, b in zip(full, fp8, strict=True):
        assert a["loss"] != b["loss"] and abs(a["loss"] - b["loss"]) <= 0.03 * a["loss"], (a, b)
    assert fp8[-1]["loss"] < fp8[0]["loss"]
    assert all(w.dtype == torch.float32 for w in _weights(out).values())


def test_hf_export_loads_in_transformers_with_equal_logits(run_two):
    import transformers

    final = str(run_two / "final")
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"} <= set(os.listdir(final))
    hf = transformers.AutoModelForCausalLM.from_pretrained(final, dtype=torch.float32).eval()
    ours = LigerLlama.from_hf(final, dtype=torch.float32)
    ids = torch.randint(0, ours.config.vocab_size, (2, 20), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref, out = hf(ids).logits, ours(ids)
    assert _rel(out, ref) <= 1e-5
    tok = transformers.AutoTokenizer.from_pretrained(final)
    plain = build_tokenizer().encode("12+7=", add_special_tokens=False).ids
    assert tok("12+7=", add_special_tokens=False)["input_ids"] == plain
    assert tok("12+7=")["input_ids"] == build_tokenizer().encode("12+7=").ids  # BOS from tokenizer.json, as ours


# ---------------------------------------------------------------------------------------------- bad input
def _main_error(capsys, argv: list[str]) -> str:
    """Run ``main`` in this process; it must exit with code 2 before training. Returns its stderr."""
    from ligermodels.train import main

    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    return capsys.readouterr().err


def test_bad_inputs_stop_before_training(capsys, tmp_path, checkpoint, data, run_two):
    out = tmp_path / "out"
    flags = _flags(checkpoint, data, out)

    def with_(**changes):
        f = list(flags)
        for k, v in changes.items():
            f[f.index("--" + k.replace("_", "-")) + 1] = v
        return f

    err = _main_error(capsys, with_(data=str(tmp_path / "missing.jsonl")))
    assert "missing.jsonl" in err and "does not exist" in err
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "ok"}\n\n{"text": "fine"}\n{"text": oops}\n')
    err = _main_error(capsys, with_(data=str(bad)))
    assert "line 4: not valid JSON" in err
    bad.write_text('{"text": "ok"}\n{"prompt": "1+1="}\n')
    err = _main_error(capsys, with_(data=str(bad)))
    assert "line 2: expected" in err and "completion" in err
    err = _main_error(capsys, with_(seq_len="100"))
    assert "--seq-len 100 exceeds the model's max_position_embeddings (64)" in err
    assert not out.exists() or not (out / "metrics.jsonl").exists()
    err = _main_error(capsys, with_(out=str(run_two)))  # holds another run, no --resume
    assert "already holds a run" in err and "--resume" in err
    assert len(_metrics(run_two)) == 4  # untouched


def test_resume_without_a_checkpoint_stops_before_training(capsys, tmp_path, checkpoint, data):
    """--resume into an OUT with no finished checkpoint must not start over (and overwrite metrics, final/)."""
    out = tmp_path / "out"
    (out / "checkpoints" / "step_00000002.tmp").mkdir(parents=True)  # half-written: not a checkpoint
    (out / "metrics.jsonl").write_text('{"step": 1}\n')
    err = _main_error(capsys, [*_flags(checkpoint, data, out), "--resume"])
    assert f"no complete checkpoint in {out / 'checkpoints'}" in err
    assert (out / "metrics.jsonl").read_text() == '{"step": 1}\n'


def test_resume_with_other_lr_flags_stops_before_training(capsys, tmp_path, checkpoint, data, run_two):
    """The restored optimiser and scheduler carry the old lr: a resume must repeat the flags that set it."""
    out = tmp_path / "two"
    shutil.copytree(run_two, out)
    flags = [*_flags(checkpoint, data, out), "--save-every", "2", "--resume", "--grad-accum", "2"]  # 1 rank x 2 x 2
    err = _main_error(capsys, [*flags, "--lr", "2e-2"])
    assert "step_00000004 was written with --lr 0.01; resume with the same value (got 0.02)" in err
    err = _main_error(capsys, [*flags, "--steps", "6"])  # cosine decays over --steps
    assert "--steps 4" in err and "(got 6)" in err
    err = _main_error(capsys, flags[:-2])  # 1 rank x 2 rows: the global batch of 2 ranks x 2 is not kept
    assert "written for --batch-size x ranks x --grad-accum = 4; this run has 2" in err
    assert len(_metrics(out)) == 4


def test_a_damaged_checkpoint_is_one_error_line_naming_it(capsys, tmp_path, checkpoint, data, run_two):
    """torch.distributed.checkpoint raises a BaseException holding whole tracebacks: the CLI names the
    checkpoint and the missing file in one line instead."""
    out = tmp_path / "two"
    shutil.copytree(run_two, out)
    step = out / "checkpoints" / "step_00000004"
    for shard in step.glob("*.distcp"):
        shard.unlink()
    err = _main_error(capsys, [*_flags(checkpoint, data, out), "--save-every", "2", "--resume",
                               "--grad-accum", "2"])  # 1 rank x 2 rows x 2: run_two's global batch
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"error: the checkpoint {step} cannot be read"), err
    assert ".distcp" in lines[0] and "--overwrite" in lines[0]


def _resume_args(**changes):
    flags = {"model": "m", "data": "d.jsonl", "out": "o", "seq-len": 32, "steps": 4, "warmup-steps": 1, **changes}
    return parse_args([f for k, v in flags.items() for f in ("--" + k, str(v))])


@pytest.mark.parametrize("flag, value", [("lr", "0.0003"), ("lr-schedule", "linear"), ("warmup-steps", "2"),
                                         ("min-lr-ratio", "0.5"), ("steps", "8"), ("weight-decay", "0.5"),
                                         ("seq-len", "16"), ("seed", "1")])
def test_check_resume_refuses_each_changed_flag(flag, value):
    state = {key: getattr(_resume_args(), key) for key in RESUME_FLAGS}
    check_resume(state, _resume_args(), {}, "ckpt")  # the same flags resume
    with pytest.raises(TrainError, match=f"ckpt was written with --{flag} .*got {value}"):
        check_resume(state, _resume_args(**{flag: value}), {}, "ckpt")


def test_check_resume_lets_steps_change_under_the_constant_schedule():
    state = {key: getattr(_resume_args(**{"lr-schedule": "constant"}), key) for key in RESUME_FLAGS}
    check_resume(state, _resume_args(**{"lr-schedule": "constant", "steps": 8}), {}, "ckpt")


def test_resume_keeps_the_runs_default_warmup_when_steps_change():
    """A 4-step run fitted the default warmup to 4; resumed with --steps 8 and no --warmup-steps, it keeps 4.
    The config is resolved once (the default warmup from the checkpoint) and then only checked."""
    first = parse_args(["--model", "m", "--data", "d.jsonl", "--out", "o", "--steps", "4", "--lr-schedule",
                        "constant"]).resolved(max_position_embeddings=64)
    state = {key: getattr(first, key) for key in RESUME_FLAGS}
    assert state["warmup_steps"] == 4
    again = parse_args(["--model", "m", "--data", "d.jsonl", "--out", "o", "--steps", "8", "--lr-schedule", "constant",
                        "--resume"]).resolved(64, state)
    check_resume(state, again, {}, "ckpt")
    assert again.warmup_steps == 4
    explicit = parse_args(["--model", "m", "--data", "d.jsonl", "--out", "o", "--steps", "8", "--lr-schedule",
                           "constant", "--warmup-steps", "8", "--resume"]).resolved(64, state)
    with pytest.raises(TrainError, match="--warmup-steps 4"):
        check_resume(state, explicit, {}, "ckpt")


def test_check_out_dir_refuses_resume_without_a_checkpoint(tmp_path):
    """--resume with a previous run but no checkpoint is refused; into a new OUT it starts the run
    (a job script that always passes --resume, requeued or not)."""
    check_out_dir(parse_args(["--out", str(tmp_path / "new"), "--resume"]))
    args = parse_args(["--out", str(tmp_path), "--resume"])
    (tmp_path / "metrics.jsonl").write_text('{"step": 1}\n')
    with pytest.raises(TrainError, match="no complete checkpoint in .*checkpoints"):
        check_out_dir(args)
    (tmp_path / "checkpoints" / "step_00000002").mkdir(parents=True)
    (tmp_path / "checkpoints" / "step_00000002" / "train_state.json").write_text("{}")
    check_out_dir(args)


def test_data_without_loss_tokens_is_refused(tmp_path, checkpoint):
    """No BOS, no EOS and one-token texts: every token starts a document, so nothing would be trained."""
    model = tmp_path / "model"
    shutil.copytree(checkpoint, model)
    cfg = json.loads((model / "tokenizer_config.json").read_text())
    del cfg["eos_token"]
    (model / "tokenizer_config.json").write_text(json.dumps(cfg))
    build_tokenizer(add_bos=False).save(str(model / "tokenizer.json"))  # its post-processor adds no BOS
    data = tmp_path / "d.jsonl"
    data.write_text('{"text": "a"}\n{"prompt": "12", "completion": ""}\n')
    args = parse_args(["--model", str(model), "--data", str(data), "--out", str(tmp_path / "o")])
    with pytest.raises(DataError, match=f"{data}: no token carries a loss"):
        load_inputs(args)
    data.write_text('{"text": "ab"}\n')
    assert load_inputs(args).documents[0].ids == build_tokenizer().encode("ab", add_special_tokens=False).ids


def test_bad_input_stops_every_rank_under_torchrun(tmp_path, checkpoint):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "ok"}\n{"text": "fine"}\nnot json\n')
    out = tmp_path / "out"
    res = _train(_flags(checkpoint, str(bad), out), nproc=2)
    assert res.returncode != 0
    assert "line 3: not valid JSON" in res.stderr
    assert not (out / "metrics.jsonl").exists()


def test_config_file_stands_for_flags(tmp_path):
    cfg = tmp_path / "run.json"
    cfg.write_text(json.dumps({"model": "m", "data": "d.jsonl", "out": "o", "seq-len": 16, "lr": 0.5,
                               "ac": "selective"}))
    args = parse_args(["--config", str(cfg), "--lr", "0.1"])
    assert (args.model, args.seq_len, args.lr, args.ac, args.grad_accum) == ("m", 16, 0.1, "selective", 1)
    assert args.loss_strategy == "auto"
    assert parse_args(["--config", str(cfg), "--loss-strategy", "vocab"]).loss_strategy == "vocab"
    cfg.write_text(json.dumps({"learning_rate": 1.0}))
    with pytest.raises(SystemExit):
        parse_args(["--config", str(cfg)])


@pytest.mark.parametrize("value, message", [
    ({"dtype": "fp16"}, "'dtype': invalid choice 'fp16'"), ({"lr-schedule": "cosin"}, "invalid choice 'cosin'"),
    ({"ac": "ful"}, "'ac': invalid choice 'ful'"), ({"device": "tpu"}, "invalid choice 'tpu'"),
    ({"seq-len": 3.5}, "'seq-len': invalid int value 3.5"), ({"lr": "fast"}, "'lr': invalid float value 'fast'"),
    ({"resume": "no"}, "'resume' must be true or false"), ({"steps": True}, "'steps' must be a string or a number"),
    ({"seq-len": 1}, "--seq-len must be at least 2"),
])
def test_config_values_meet_the_flags_types_and_choices(tmp_path, capsys, value, message):
    cfg = tmp_path / "run.json"
    cfg.write_text(json.dumps({"model": "m", "data": "d.jsonl", "out": "o", **value}))
    with pytest.raises(SystemExit):
        parse_args(["--config", str(cfg)])
    err = capsys.readouterr().err
    assert message in err and (str(cfg) in err or "--seq-len" in message)


def test_config_values_are_converted_like_flags(tmp_path):
    cfg = tmp_path / "run.json"
    cfg.write_text(json.dumps({"model": "m", "data": "d.jsonl", "out": "o", "seq-len": "32", "lr": 1, "resume": True,
                               "steps": 1000.0, "batch-size": None}))  # null: not given, the default applies
    args = parse_args(["--config", str(cfg)])
    assert (args.seq_len, args.lr, args.resume, args.steps, args.batch_size) == (32, 1.0, True, 1000, 1)
    assert type(args.seq_len) is int and type(args.lr) is float and type(args.steps) is int


@pytest.mark.parametrize("flags, message", [
    (["--seq-len", "1"], "--seq-len must be at least 2, got 1"),
    (["--warmup-steps", "-1"], "--warmup-steps must be at least 0"),
    (["--min-lr-ratio", "1.5"], "--min-lr-ratio must be between 0 and 1, got 1.5"),
    (["--min-lr-ratio", "nan"], "--min-lr-ratio must be between 0 and 1, got nan"),
    (["--save-every", "-2"], "--save-every must be at least 0"),
    (["--keep-checkpoints", "-1"], "--keep-checkpoints must be at least 0"),
    (["--max-grad-norm", "-1"], "--max-grad-norm must be at least 0"),
    (["--lr", "0"], "--lr must be positive and finite, got 0.0"),
    (["--lr", "inf"], "--lr must be positive and finite, got inf"),
    (["--weight-decay", "inf"], "--weight-decay must be finite, got inf"),
    (["--seed", "100000000000000"], "--seed must be in [0, 2**32), got 100000000000000"),
    (["--seed", "-1"], "--seed must be in [0, 2**32), got -1"),
    (["--log-every", "0"], "--log-every must be at least 1"),
    (["--prefetch", "-1"], "--prefetch must be at least 0, got -1"),
    (["--reshard-after-forward", "sometimes"], "--reshard-after-forward: invalid choice: 'sometimes'"),
    (["--steps", "10", "--warmup-steps", "11"], "--warmup-steps 11 exceeds --steps 10"),
])
def test_out_of_range_flags_are_refused(capsys, flags, message):
    with pytest.raises(SystemExit):
        parse_args(["--model", "m", "--data", "d.jsonl", "--out", "o", *flags])
    assert message in capsys.readouterr().err


def test_default_warmup_shrinks_to_a_short_run():
    """Only an explicit --warmup-steps above --steps is refused; the default warmup (50) fits a 10-step run."""
    run = ["--model", "m", "--data", "d.jsonl", "--out", "o"]
    assert parse_args([*run, "--steps", "10"]).resolved(64).warmup_steps == 10
    assert parse_args([*run, "--steps", "100"]).resolved(64).warmup_steps == 50


def test_edge_values_of_flags_are_accepted():
    args = parse_args(["--out", "o", "--seq-len", "2", "--steps", "5", "--warmup-steps", "5", "--min-lr-ratio", "0",
                       "--save-every", "0", "--keep-checkpoints", "0", "--max-grad-norm", "0"])
    assert (args.seq_len, args.warmup_steps, args.max_grad_norm) == (2, 5, 0.0)


def test_lr_schedules():
    f = lambda i, s: lr_factor(i, s, warmup=4, steps=104, min_ratio=0.1)  # noqa: E731
    assert [f(i, "cosine") for i in range(4)] == [0.25, 0.5, 0.75, 1.0]
    assert f(4, "cosine") == 1.0 and f(4, "linear") == 1.0
    assert f(54, "cosine") == pytest.approx(0.55) and f(54, "linear") == pytest.approx(0.55)
    assert f(103, "cosine") == pytest.approx(0.1, abs=1e-3) and f(103, "linear") == pytest.approx(0.109)
    assert f(103, "constant") == 1.0


def test_finetune_example_script(tmp_path, checkpoint, data):
    out = tmp_path / "ft"
    res = subprocess.run(["bash", os.path.join(ROOT, "examples", "finetune.sh"), checkpoint, data, str(out),
                          "--seq-len", "32", "--batch-size", "2", "--grad-accum", "1", "--steps", "2",
                          "--warmup-steps", "1", "--device", "cpu", "--dtype", "fp32"],
                         cwd=ROOT, env={**ENV, "PYTHON": sys.executable, "NGPU": "1"}, capture_output=True, text=True,
                         timeout=TIMEOUT)
    assert res.returncode == 0, res.stderr[-4000:]
    assert len(_metrics(out)) == 2 and (out / "final" / "config.json").exists()


# ---------------------------------------------------------------------------------------------- the demo
def test_demo_runs_end_to_end(tmp_path):
    out = tmp_path / "demo"
    res = _train(["--out", str(out), "--steps", "40", "--batch-size", "8", "--log-every", "10"])
    assert res.returncode == 0, res.stderr[-4000:]
    losses = [m["loss"] for m in _metrics(out)]
    assert len(losses) == 40 and losses[-1] < losses[0] - 1.0, losses
    for text in ("step 40/40", "greedy completions", "additions answered right"):
        assert text in res.stdout
    final = set(os.listdir(out / "final"))
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"} <= final
    assert (out / "demo" / "data.jsonl").exists() and (out / "checkpoints" / "step_00000040").exists()


def test_demo_with_lora_trains_adapters_and_completes_from_the_merged_model(tmp_path):
    out = tmp_path / "demo"
    res = _train(["--out", str(out), "--steps", "30", "--batch-size", "8", "--log-every", "10", "--lora-rank", "8",
                  "--lora-alpha", "16", "--merge", "--lr", "1e-2"])
    assert res.returncode == 0, res.stderr[-4000:]
    losses = [m["loss"] for m in _metrics(out)]
    assert losses[-1] < losses[0] - 0.5, losses  # the adapters alone lower the loss on a random base
    assert {"adapter_config.json", "adapter_model.safetensors"} <= set(os.listdir(out / "final"))
    assert (out / "merged" / "model.safetensors").exists() and "additions answered right" in res.stdout


# ---------------------------------------------------------------------------------------------- in process
def test_read_jsonl_errors_name_the_line(tmp_path):
    p = tmp_path / "d.jsonl"
    p.write_text('{"text": "a"}\n["text"]\n')
    with pytest.raises(DataError, match=r"line 2: expected"):
        read_jsonl(str(p))
    p.write_text("\n\n")
    with pytest.raises(DataError, match="holds no examples"):
        read_jsonl(str(p))


def test_read_jsonl_refuses_text_that_is_not_utf8(tmp_path):
    p = tmp_path / "d.jsonl"
    p.write_bytes(b'{"text": "ok"}\n{"text": "caf\xe9"}\n')  # Latin-1
    with pytest.raises(DataError, match=f"{p} line 2: not valid UTF-8"):
        read_jsonl(str(p))
    p.write_text('{"text": "ok \\ud83d\\ude00"}\n{"prompt": "a", "completion": "bad \\ud800 here"}\n')
    with pytest.raises(DataError, match=f"{p} line 2: not valid Unicode"):  # a surrogate pair is fine
        read_jsonl(str(p))


def test_packing_labels_positions_and_determinism(checkpoint):
    tok = build_tokenizer()
    bos, eos = special_token_ids(tok, checkpoint)
    assert (bos, eos) == (tok.token_to_id("<s>"), tok.token_to_id("</s>"))
    docs = tokenize([Example("", "abc"), Example("1+2=", "3"), Example("", "hello world.")], tok, bos, eos)
    assert docs[1].ids == [bos, *tok.encode("1+2=", add_special_tokens=False).ids, tok.token_to_id("3"), eos]
    assert docs[1].no_loss == 5

    rows = PackedRows(docs, seq_len=7, seed=3)
    n = rows.epoch_len
    assert n == sum(len(d.ids) for d in docs) == 26
    ids, labels, pos = rows.rows(0, 12)  # 84 tokens: more than three epochs
    flat_ids, flat_labels, flat_pos = ids.flatten(), labels.flatten(), pos.flatten()
    starts = (pos == 0)
    assert starts[:, 0].all() and (labels[starts] == IGNORE_INDEX).all()
    assert (flat_labels[flat_ids == bos] == IGNORE_INDEX).all()
    assert ((flat_labels == flat_ids) | (flat_labels == IGNORE_INDEX)).all()
    for e in range(3):  # every epoch holds every token once, in its own order
        assert sorted(flat_ids[n * e:n * (e + 1)].tolist()) == sorted(t for d in docs for t in d.ids)
    # the prompt "1+2=" carries no loss; its completion and EOS do
    prompt_at = [i for i in range(len(flat_ids) - 6) if flat_ids[i:i + 7].tolist() == docs[1].ids and flat_pos[i] == 0]
    assert prompt_at, "doc 1 never sits whole in a row"
    i = prompt_at[0]
    assert flat_labels[i:i + 5].eq(IGNORE_INDEX).all() and (flat_labels[i + 5:i + 7] == flat_ids[i + 5:i + 7]).all()
    # rows depend only on their index and the seed
    a = rows.rows(0, 5)
    b = [torch.cat(t) for t in zip(PackedRows(docs, 7, 3).rows(0, 2), PackedRows(docs, 7, 3).rows(2, 3), strict=True)]
    assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True))
    assert not torch.equal(PackedRows(docs, 7, 4).rows(0, 5)[0], a[0])


def test_document_masking_packed_equals_alone(checkpoint):
    """A document packed next to another gets the logits and loss it gets alone."""
    model = LigerLlama.from_hf(checkpoint, dtype=torch.float32)
    tok = build_tokenizer()
    bos, eos = special_token_ids(tok, checkpoint)
    docs = tokenize([Example("", "alice has 3 red apples."), Example("12+7=", "19")], tok, bos, eos)
    ids, labels, pos = PackedRows(docs, sum(len(d.ids) for d in docs), seed=0).rows(0, 1)
    doc_ids = document_ids_from_positions(pos)
    cuts = [*(pos[0] == 0).nonzero().flatten().tolist(), ids.shape[1]]
    assert len(cuts) == 3  # two documents in the row
    with torch.no_grad():
        packed = model(ids, pos, doc_ids)
        unmasked = model(ids, pos)
        packed_loss = model.loss(ids, labels, num_items=1, position_ids=pos, document_ids=doc_ids)
        alone_loss = 0.0
        for a, b in zip(cuts, cuts[1:], strict=False):
            alone = model(ids[:, a:b])
            assert _rel(packed[:, a:b], alone) <= 1e-5
            alone_loss += model.loss(ids[:, a:b], labels[:, a:b], num_items=1)
        assert _rel(unmasked[:, cuts[1]:], packed[:, cuts[1]:]) > 1e-3  # without the mask the 2nd doc differs
    assert abs(packed_loss.item() - float(alone_loss)) <= 1e-5 * abs(float(alone_loss))


@pytest.mark.parametrize("mode", ["full", "selective", "lean"])
def test_activation_checkpointing_keeps_gradients(checkpoint, mode):
    torch.manual_seed(0)
    ids = torch.randint(4, 40, (2, 24))
    pos = torch.cat([torch.arange(10), torch.arange(14)]).expand(2, 24)
    docs = document_ids_from_positions(pos)

    def grads(ac: str) -> dict[str, torch.Tensor]:
        model = LigerLlama.from_hf(checkpoint, dtype=torch.float32).train()
        apply_activation_checkpointing(model, ac)
        model.loss(ids, ids, position_ids=pos, document_ids=docs).backward()
        return {n.replace("_checkpoint_wrapped_module.", ""): p.grad for n, p in model.named_parameters()}

    ref, got = grads("none"), grads(mode)
    assert ref.keys() == got.keys()
    model = LigerLlama.from_hf(checkpoint, dtype=torch.float32)
    apply_activation_checkpointing(model, mode)  # checkpointed layers keep their norm and GLU outputs
    assert all(m.keep_output for m in model.modules() if isinstance(m, RMSNorm) and m is not model.norm)
    assert all(m.keep_activation for m in model.modules() if isinstance(m, MLP)) and not model.norm.keep_output
    assert model.sum_residual  # the layers' inputs are the summed residual stream
    for k in ref:
        assert _rel(got[k], ref[k]) <= 1e-6, k


def test_checkpointed_layers_keep_one_hidden_sized_tensor_each_for_backward(checkpoint):
    """Under full activation checkpointing the residual stream is summed into each layer's input first, so each
    checkpoint keeps one (B, S, H) tensor, not the previous layer's output and the stream; the loss is the same."""
    ids = torch.randint(4, 40, (2, 24), generator=torch.Generator().manual_seed(0))
    counts, losses = {}, {}
    for summed in (False, True):
        model = LigerLlama.from_hf(checkpoint, dtype=torch.float32).train()
        apply_activation_checkpointing(model, "full")
        model.sum_residual = summed
        hidden = []

        def pack(t, hidden=hidden, width=model.config.hidden_size):
            if t.dim() and t.shape[-1] == width and t.numel() == ids.numel() * width:
                hidden.append(t.data_ptr())
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            losses[summed] = model.loss(ids, ids)
        counts[summed] = len(set(hidden))
    assert counts[False] - counts[True] == model.config.num_layers - 1, counts
    assert losses[True].item() == losses[False].item()


@pytest.mark.parametrize("op", ["doc_attention_fwd", "rope_qkv_", "qk_norm_rope_qkv_"])
def test_selective_checkpointing_keeps_our_attention_and_rotary_outputs(op):
    """Selective checkpointing saves what this package's own attention kernel returns (its output and
    log-sum-exp: recomputing it costs a third of attention's flops) and does not run the in-place rotary ops
    again; the norms and activations around them are recomputed."""
    from torch.utils.checkpoint import CheckpointPolicy

    from ligermodels.train.parallelize import selective_policy

    assert selective_policy(None, getattr(torch.ops.ligermodels, op).default) == CheckpointPolicy.MUST_SAVE
    assert selective_policy(None, torch.ops.ligermodels.rms_norm_fwd.default) == CheckpointPolicy.PREFER_RECOMPUTE


# --------------------------------------------------------------------------- overwrite, divergence, resume inputs
def test_overwrite_with_a_bad_input_leaves_the_previous_run_in_place(capsys, tmp_path, checkpoint, data, run_two):
    out = tmp_path / "two"
    shutil.copytree(run_two, out)
    flags = _flags(checkpoint, data, out)
    flags[flags.index("--data") + 1] = str(tmp_path / "typo.jsonl")
    err = _main_error(capsys, [*flags, "--overwrite"])
    assert "typo.jsonl" in err and "does not exist" in err
    bad = tmp_path / "bad-model"  # weights that only fail when loaded (after the inputs were checked)
    shutil.copytree(checkpoint, bad)
    tensors = load_file(str(bad / "model.safetensors"))
    tensors["model.norm.weight"] = tensors["model.norm.weight"][:-1].clone()
    save_file(tensors, str(bad / "model.safetensors"), metadata={"format": "pt"})
    flags = _flags(str(bad), data, out)
    err = _main_error(capsys, [*flags, "--overwrite"])
    assert "model.norm.weight" in err
    assert sorted(os.listdir(out / "checkpoints")) == sorted(os.listdir(run_two / "checkpoints"))
    assert (out / "final" / "model.safetensors").is_file()


def test_a_diverging_run_stops_with_strict_json_metrics_and_no_export(capsys, tmp_path, checkpoint, data):
    out = tmp_path / "out"
    err = _main_error(capsys, [*_flags(checkpoint, data, out), "--lr", "1e30", "--save-every", "0"])
    assert "non-finite weights" in err and "--lr" in err
    lines = (out / "metrics.jsonl").read_text().splitlines()
    rows = [json.loads(line, parse_constant=lambda c: pytest.fail(f"{c} in metrics.jsonl")) for line in lines]
    assert rows[-1]["loss"] is None or rows[-1]["grad_norm"] is None
    assert not (out / "final").exists()


def test_resume_reads_metrics_up_to_a_line_cut_short(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1, "loss": 2.0}\n{"step": 2, "loss": 1.5}\n\n{"step": 3, "loss": 1.2}\n{"step": 4, "lo')
    assert metrics_up_to(str(path), 2) == ['{"step": 1, "loss": 2.0}\n', '{"step": 2, "loss": 1.5}\n']
    assert len(metrics_up_to(str(path), 9)) == 3  # the cut line and what would follow it are dropped


def test_check_resume_refuses_a_checkpoint_past_steps_and_other_inputs(tmp_path):
    args = _resume_args(**{"lr-schedule": "constant", "steps": 2})
    inputs = {"data_sha256": "aa", "model_sha256": "bb", "data_documents": 300, "data_tokens": 6399, "global_rows": 4}
    state = {**{key: getattr(args, key) for key in RESUME_FLAGS}, "step": 3}
    with pytest.raises(TrainError, match="at step 3, past --steps 2"):
        check_resume(state, args, inputs, "ckpt")
    state.update(step=2, model="elsewhere/model", data="moved.jsonl", **inputs)
    check_resume(state, args, inputs, "ckpt")  # paths may differ (a moved run or data file): the values decide
    check_resume({k: v for k, v in state.items() if k not in inputs}, args, inputs, "ckpt")  # older checkpoint
    older = {k: v for k, v in state.items() if k not in ("data_sha256", "model_sha256")}  # counts only
    with pytest.raises(TrainError, match="tokens in --data.* = 6099; this run has 6399"):
        check_resume({**older, "data_tokens": 6099}, args, inputs, "ckpt")
    for key, value, what in [("data_sha256", "cc", "the tokenized --data"), ("model_sha256", "dd", "--model's config"),
                             ("global_rows", 8, "--batch-size x ranks x --grad-accum")]:
        with pytest.raises(TrainError, match=f"written for {re.escape(what)}.* = {value}; this run has"):
            check_resume({**state, key: value}, args, inputs, "ckpt")


def test_resume_inputs_tell_shuffled_data_and_another_architecture_apart(checkpoint):
    from checkpoints_tools import read_config
    from ligermodels import config_from_hf
    from ligermodels.train.checkpointing import resume_inputs
    from ligermodels.train.data import Inputs

    tok = build_tokenizer()
    docs = tokenize([Example("", "abc"), Example("", "de")], tok, 2, 3)
    cfg = config_from_hf(read_config(checkpoint))

    def fingerprint(documents, c):
        return resume_inputs(Inputs(c, LigerLlama, None, checkpoint, tok, 2, 3, documents), 4)

    base = fingerprint(docs, cfg)
    assert fingerprint(list(docs), cfg) == base
    assert fingerprint(docs[::-1], cfg)["data_sha256"] != base["data_sha256"]  # same counts, another order
    assert fingerprint(docs, cfg.replace(intermediate_size=96))["model_sha256"] != base["model_sha256"]
    assert fingerprint(docs, cfg.replace(qk_norm=True))["model_sha256"] != base["model_sha256"]
    moe = cfg.replace(num_experts=4, experts_per_token=2)
    assert fingerprint(docs, moe)["model_sha256"] != base["model_sha256"]
    unnormalised = fingerprint(docs, moe.replace(norm_topk_prob=False))["model_sha256"]
    assert unnormalised != fingerprint(docs, moe)["model_sha256"]
    # Checkpoints written before DecoderConfig grew fields keep resuming: a config without them hashes as then.
    before = ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads", "num_kv_heads",
              "head_dim", "norm_eps", "norm_offset", "norm_casting", "activation", "qkv_bias", "o_bias", "mlp_bias",
              "rope", "sliding_window", "layer_windows", "tie_embeddings", "embed_scale", "attn_scale",
              "attention_dropout", "max_position_embeddings", "pad_token_id", "model_type")
    old = hashlib.sha256(repr({k: getattr(cfg, k) for k in before}).encode()).hexdigest()
    assert base["model_sha256"] == old


def test_check_out_dir_refuses_a_file(tmp_path):
    (tmp_path / "out").write_text("not a directory")
    with pytest.raises(TrainError, match="exists and is not a directory"):
        check_out_dir(parse_args(["--out", str(tmp_path / "out")]))


def _tokenizer_dir(tmp_path, add_bos: bool = True, **files) -> str:
    d = tmp_path / "tok"
    save_tokenizer(build_tokenizer(add_bos=add_bos), str(d))  # writes a tokenizer_config.json; files below replace it
    for name, obj in files.items():
        (d / f"{name}.json").write_text(obj if isinstance(obj, str) else json.dumps(obj))
    return str(d)


def test_special_tokens_unknown_to_the_tokenizer_are_an_error_naming_them(tmp_path):
    d = _tokenizer_dir(tmp_path, tokenizer_config={"bos_token": "<s>", "eos_token": "<|endoftext|>"})
    with pytest.raises(DataError, match="tokenizer_config.json: eos_token '<|endoftext|>' is not a token"):
        special_token_ids(build_tokenizer(), d)


def test_special_tokens_are_those_transformers_reports(tmp_path):
    """BOS/EOS as AutoTokenizer reports them, BOS added where its tokenizer.json adds it; each case is
    checked against transformers (the ids, and whether its encoding starts with BOS)."""
    import transformers

    tok = build_tokenizer()
    s, e = tok.token_to_id("<s>"), tok.token_to_id("</s>")
    fast = {"tokenizer_class": "PreTrainedTokenizerFast"}
    current = {**fast, "added_tokens_decoder": {str(s): {"content": "<s>", "special": True}}}
    cases = [  # (tokenizer.json adds BOS, files, expected (bos added, eos))
        (True, dict(tokenizer_config={**fast, "bos_token": None, "eos_token": "</s>"},
                    config={"bos_token_id": e, "eos_token_id": e}), (None, e)),  # Qwen2: no BOS
        (True, dict(tokenizer_config=fast, special_tokens_map={"bos_token": {"content": "<s>"}, "eos_token": "</s>"}),
         (s, e)),
        (True, dict(tokenizer_config={**fast, "eos_token": "</s>"}, config={"bos_token_id": s}), (None, e)),
        (True, dict(tokenizer_config={**current, "bos_token": "<s>", "eos_token": "</s>"},  # a stale map
                    special_tokens_map={"bos_token": "<s>", "eos_token": "<pad>"}), (s, e)),
        (True, dict(tokenizer_config={**fast, "add_bos_token": False, "bos_token": "<s>", "eos_token": "</s>"}),
         (s, e)),  # transformers 5 ignores add_bos_token beside a tokenizer.json
        (False, dict(tokenizer_config={**fast, "bos_token": "<s>", "eos_token": "</s>"}), (None, e)),
    ]
    for k, (adds_bos, files, expected) in enumerate(cases):
        d = _tokenizer_dir(tmp_path / str(k), add_bos=adds_bos, **files)
        assert special_token_ids(build_tokenizer(add_bos=adds_bos), d) == expected, files
        hf = transformers.AutoTokenizer.from_pretrained(d)
        assert hf.eos_token_id == expected[1], files
        assert (hf("ab")["input_ids"][:1] == [hf.bos_token_id]) == (expected[0] is not None), files
    d = _tokenizer_dir(tmp_path / "x", tokenizer_config=fast)
    os.remove(os.path.join(d, "tokenizer_config.json"))
    (tmp_path / "x" / "tok" / "config.json").write_text(json.dumps({"bos_token_id": s, "eos_token_id": [e, 7]}))
    assert special_token_ids(tok, d) == (s, e)  # no tokenizer files: the model's ids


def test_corrupt_tokenizer_files_are_named(tmp_path):
    from checkpoints_tools import CheckpointError
    from ligermodels import load_tokenizer

    d = _tokenizer_dir(tmp_path, tokenizer_config="{oops")
    with pytest.raises(DataError, match="tokenizer_config.json is not valid JSON"):
        special_token_ids(build_tokenizer(), d)
    (tmp_path / "tok" / "tokenizer.json").write_text('{"version": "1.0"}')
    with pytest.raises(CheckpointError, match="tokenizer.json: not a readable tokenizer.json"):
        load_tokenizer(d)


def test_a_hub_model_is_refused_from_its_config_before_any_weight_downloads(tmp_path, monkeypatch, checkpoint, data):
    import huggingface_hub

    snap = tmp_path / "snap"
    shutil.copytree(checkpoint, snap)
    cfg = json.loads((snap / "config.json").read_text())
    (snap / "config.json").write_text(json.dumps({**cfg, "model_type": "mamba"}))
    monkeypatch.setattr(huggingface_hub, "hf_hub_download", lambda repo_id, filename, **k: str(snap / filename))
    monkeypatch.setattr(huggingface_hub, "snapshot_download",
                        lambda *a, **k: pytest.fail("the repo was downloaded before its config was checked"))
    from ligermodels import UnsupportedConfigError

    with pytest.raises(UnsupportedConfigError, match="mamba"):
        load_inputs(parse_args(["--model", "org/model", "--data", data, "--out", str(tmp_path / "o")]))


def test_padding_or_truncation_saved_in_tokenizer_json_is_turned_off(tmp_path):
    from ligermodels import load_tokenizer

    tok = build_tokenizer()
    tok.enable_padding(length=8, direction="left", pad_id=0, pad_token="<pad>")
    tok.enable_truncation(max_length=3)
    save_tokenizer(tok, str(tmp_path))
    loaded = load_tokenizer(str(tmp_path))
    assert loaded.encode("hello").ids == build_tokenizer().encode("hello").ids  # <s> h e l l o: not cut, not padded
    assert special_token_ids(loaded, str(tmp_path)) == (tok.token_to_id("<s>"), tok.token_to_id("</s>"))


def test_memory_at_peak_replays_the_allocator_trace():
    """The peak of allocated memory and what is live then, grouped by the allocating site in this package;
    frees of tensors allocated before the trace lower the base."""
    ours = {"filename": "/x/ligermodels/blocks.py", "line": 7, "name": "forward"}
    torch_frame = {"filename": "/y/torch/nn/functional.py", "line": 3, "name": "linear"}
    kern = {"filename": "/x/kernels/glu.py", "line": 9, "name": "glu"}
    events = [
        {"action": "alloc", "addr": 1, "size": 100, "frames": [torch_frame, ours]},
        {"action": "alloc", "addr": 2, "size": 50, "frames": [kern, ours]},
        {"action": "free_completed", "addr": 99, "size": 30},  # from before the trace
        {"action": "alloc", "addr": 3, "size": 40, "frames": [kern]},
        {"action": "free_requested", "addr": 3, "size": 40},
        {"action": "free_completed", "addr": 3, "size": 40},
        {"action": "free_completed", "addr": 1, "size": 100},
        {"action": "alloc", "addr": 4, "size": 60, "frames": [torch_frame]},
    ]
    peak, site, rows = memory_at_peak(events, base_bytes=1000)
    assert peak == 1000 + 100 + 50 - 30 + 40  # 1160, reached by the third allocation
    assert site == "kernels/glu.py:9 glu"
    assert rows[0][1:] == (970, 0)
    assert rows[1:] == [("ligermodels/blocks.py:7 forward <- nn/functional.py:3 linear", 100, 1),
                        ("kernels/glu.py:9 glu", 90, 2)]


@pytest.mark.parametrize("vocab, hidden, memory_gb, lora, expected", [
    (256000, 2304, 80, 0, "tokens"),  # Gemma 2: a 2.2 GiB fp32 (V, H) buffer, under 1/32 of an 80 GB GPU
    (128256, 4096, 80, 0, "tokens"),  # Llama-3-8B: 1.96 GiB
    (256000, 2304, 24, 0, "vocab"),  # the same buffer on a 24 GB GPU
    (256000, 4608, 80, 0, "vocab"),  # Gemma-2-27B's 4.4 GiB
    (151936, 1536, 24, 0, "vocab"),  # Qwen2-1.5B's 0.87 GiB, over a 24 GB GPU's 0.70 GiB
    (128256, 2048, 40, 0, "tokens"),  # Llama-3.2-1B's 0.98 GiB, under a 40 GB GPU's 1.16 GiB
    (256000, 4608, 24, 16, "tokens"),  # LoRA: the head is frozen, no weight-gradient buffer
])
def test_auto_loss_strategy_keeps_the_faster_head_unless_its_buffer_takes_a_32nd_of_the_device(
        monkeypatch, vocab, hidden, memory_gb, lora, expected):
    monkeypatch.setattr(parallelize_module, "device_memory_bytes", lambda device: memory_gb * 10**9)
    args = parse_args(["--model", "m", "--data", "d.jsonl", "--out", "o", "--lora-rank", str(lora)])
    config = DecoderConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=4 * hidden, num_layers=1,
                           num_heads=8, num_kv_heads=8)
    assert loss_strategy(args, config, torch.device("cuda")) == expected
    args = dataclasses.replace(args, loss_strategy="tokens")
    assert loss_strategy(args, config, torch.device("cuda")) == "tokens"  # a strategy asked for is kept


def test_device_memory_is_the_hosts_for_the_cpu(monkeypatch):
    assert device_memory_bytes(torch.device("cpu")) > 2**30

    def unknown(name):
        raise ValueError(name)

    monkeypatch.setattr(os, "sysconf", unknown)  # an OS that does not say: "tokens", the faster head
    assert device_memory_bytes(torch.device("cpu")) == 2**40


def test_load_full_state_copies_every_tensor_and_names_a_mismatch():
    """One rank: rank 0's full state lands in a model materialised empty; a state with another key set is refused
    by name before any copy."""
    config = DecoderConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_layers=2, num_heads=4,
                           num_kv_heads=2)
    torch.manual_seed(0)
    source = LigerLlama(config).init_weights()
    with torch.device("meta"):
        target = LigerLlama(config)
    target.to_empty(device="cpu")
    load_full_state(target, source.state_dict(), rank=0, world=1, device=torch.device("cpu"))
    for (name, a), (_, b) in zip(source.state_dict().items(), target.state_dict().items(), strict=True):
        assert torch.equal(a, b), name
    partial = {k: v for k, v in source.state_dict().items() if k != "norm.weight"}
    with pytest.raises(TrainError, match="missing \\['norm.weight'\\]"):
        load_full_state(target, partial, rank=0, world=1, device=torch.device("cpu"))
    assert init_device(config, torch.device("cpu")) == torch.device("cpu")


def test_exposed_communication_and_other_device_work_are_charged_to_the_host_range_that_launched_them():
    """--profile's timeline names the range around each kernel's launching op: the innermost FSDP2 range, one of
    this package's or the optimiser's step (else the outermost op); GEMMs and attention are left out of the
    other-work table."""
    cpu, cuda = torch.autograd.DeviceType.CPU, torch.autograd.DeviceType.CUDA

    def event(name, id_, device, span=(0.0, 0.0), corr=0, parent=None):
        return types.SimpleNamespace(name=name, id=id_, device_type=device, activity_type=None,
                                     is_user_annotation=False, time_range=types.SimpleNamespace(start=span[0],
                                                                                                end=span[1]),
                                     linked_correlation_id=corr, cpu_parent=parent, stack=[])

    gather = event("FSDP::all_gather (layers.0)", 1, cpu)
    lookup = event("ligermodels::vocab_embedding_backward", 3, cpu)
    step = event("Optimizer.step#AdamW.step", 5, cpu)
    host = [gather, event("nccl:_all_gather_base", 2, cpu, parent=gather), lookup,
            event("c10d::allgather_", 4, cpu, parent=event("aten::empty", 9, cpu, parent=lookup)), step,
            event("aten::_foreach_norm", 6, cpu, parent=step), event("aten::add", 7, cpu)]
    device = [event("ncclDevKernel_AllGather_RING_LL(args)", 11, cuda, (0.0, 10000.0), corr=2),
              event("nvjet_sm90_tst_256x128_64x4(args)", 12, cuda, (5000.0, 20000.0), corr=7),
              event("ncclDevKernel_AllGather_RING_LL(args)", 13, cuda, (20000.0, 24000.0), corr=4),
              event("void at::native::multi_tensor_apply_kernel<Meta<4>>(args)", 14, cuda, (30000.0, 33000.0),
                    corr=6),
              event("vectorized_elementwise_kernel<8>(args)", 15, cuda, (33000.0, 34000.0), corr=7),
              event("vectorized_elementwise_kernel<8>(args)", 16, cuda, (34000.0, 35000.0), corr=99)]
    profiler = StepProfiler(True, steps=8, memory_trace=False, stacks=False)  # steps 6-7: times / 2
    profiler.prof = types.SimpleNamespace(events=lambda: host + device, key_averages=lambda: [])
    t = profiler.timeline(wall_ms=20.0)
    assert t["nccl_exposed_by"] == [{"collective": "AllGather", "ms": 4.5}]
    assert t["nccl_exposed_by_launch"] == [
        {"collective": "AllGather <- FSDP::all_gather (layers.0)", "ms": 2.5},
        {"collective": "AllGather <- ligermodels::vocab_embedding_backward", "ms": 2.0}]
    assert t["other_kernels_by_launch"] == [
        {"launched_in": "Optimizer.step#AdamW.step", "kernel": "void at::native::multi_tensor_apply_kernel",
         "ms": 1.5},
        {"launched_in": "aten::add", "kernel": "vectorized_elementwise_kernel", "ms": 0.5},
        {"launched_in": "(unknown host op)", "kernel": "vectorized_elementwise_kernel", "ms": 0.5}]
    text = profiler.report(20.0, t)
    assert "AllGather <- ligermodels::vocab_embedding_backward" in text
    assert "Optimizer.step#AdamW.step" in text.split("by the host range that launched it (ms/step):")[2]


def test_idle_time_is_charged_to_the_op_that_launched_the_work_after_it():
    """Gaps between device work (overlaps counted once) go to the host op of the next kernel, by its innermost
    frame in this package; gaps under the threshold are ignored."""
    stack_norm = ["/x/kernels/rms_norm.py(260): _rms_norm_fwd", "/x/ligermodels/blocks.py(70): project"]
    stack_step = ["/t/torch/optim/optimizer.py(5): wrapper", "/x/ligermodels/train.py(1200): train"]
    ops = {1: ("ligermodels::rms_norm_fwd", stack_norm), 2: ("aten::mm", ["/t/torch/nn/functional.py(9): linear"]),
           3: ("Optimizer.step", stack_step)}
    kernels = [(0.0, 100.0, 1), (50.0, 120.0, 2),  # overlapping: one busy span 0..120
               (125.0, 200.0, 2),  # a 5 us gap: below the threshold
               (260.0, 300.0, 1),  # 60 us idle before a norm kernel
               (400.0, 410.0, 3),  # 100 us before the optimizer's
               (430.0, 440.0, 1)]  # 20 more before a norm kernel
    rows = idle_by_launch_site(kernels, ops, min_gap_us=10.0)
    assert rows == [("Optimizer.step", "/x/ligermodels/train.py(1200): train", 100.0, 1),
                    ("ligermodels::rms_norm_fwd", "/x/kernels/rms_norm.py(260): _rms_norm_fwd", 80.0, 2)]
    assert idle_by_launch_site([(0.0, 1.0, 9), (50.0, 60.0, 9)], {}) == [("(unknown host op)", "(no Python stack)",
                                                                         49.0, 1)]


@pytest.mark.parametrize("stacks", ["auto", "off"])
def test_profile_writes_the_step_budget_and_its_numbers(checkpoint, data, workdir, stacks):
    """--profile on the CPU: profile.txt with the category table, profile.json with the per-step totals (no device
    work there, so no idle attribution and no memory part). One rank records Python stacks unless
    ``--profile-stacks off``."""
    out = workdir / f"profiled-{stacks}"
    res = _train([*_flags(checkpoint, data, out), "--steps", "8", "--save-every", "0", "--profile",
                  "--profile-stacks", stacks])
    assert res.returncode == 0, res.stderr[-3000:]
    text = (out / "profile.txt").read_text()
    assert "steps 6-7" in text and "Top 30 host ops" in text
    assert ("recording Python stacks slows the host" in text) == (stacks == "auto")
    numbers = json.loads((out / "profile.json").read_text())
    assert numbers["steps"] == [6, 7] and numbers["wall_ms"] > 0 and numbers["idle_by_launch_site"] == []
    assert "memory_at_peak" not in numbers
    assert [m["step"] for m in _metrics(out)] == list(range(1, 9))


@pytest.mark.parametrize("stacks", [True, False])
def test_a_profile_says_whether_it_recorded_python_stacks(stacks, tmp_path):
    """Several ranks profile without Python stacks (a rank slowed by recording them makes the others wait in their
    collectives); the table's header says which."""
    profiler = StepProfiler(True, steps=1, memory_trace=False, first=0, count=1, stacks=stacks)
    profiler.before(1, torch.device("cpu"))
    assert profiler.wants(1)
    assert profiler.prof.with_stack == stacks
    torch.ones(64, 64) @ torch.ones(64, 64)
    profiler.after(1, str(tmp_path / "profile.txt"), rank=0)
    text = (tmp_path / "profile.txt").read_text()
    assert ("recording Python stacks slows the host" in text) == stacks
    assert ("no Python stacks recorded" in text) == (not stacks)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the allocator trace is CUDA's")
@pytest.mark.parametrize("ac", ["none", "selective"])
def test_profile_on_one_gpu_records_memory_only_without_activation_checkpointing(ac, checkpoint, data, workdir):
    """--profile on one GPU: with --ac none the memory at the peak comes from the allocator's trace; under
    activation checkpointing that trace (with Python stacks) aborted the process on an H100 (torch 2.11,
    benchmarks/results/experiments/profile-crash-1gpu-selective.log), so it is left out and the run profiles."""
    out = workdir / f"profiled-gpu-{ac}"
    flags = [*_flags(checkpoint, data, out), "--steps", "8", "--save-every", "0", "--profile", "--device", "cuda",
             "--dtype", "bf16", "--ac", ac]
    res = _train(flags)
    assert res.returncode == 0, res.stderr[-3000:]
    numbers = json.loads((out / "profile.json").read_text())
    assert numbers["steps"] == [6, 7] and numbers["wall_ms"] > 0
    assert ("memory_at_peak" in numbers) == (ac == "none")


@pytest.mark.parametrize("argv, message", [
    (["--cuda-graph", "--device", "cpu"], "--cuda-graph replays a CUDA graph: it needs --device cuda"),
    (["--cuda-graph", "--grad-accum", "2"], "--cuda-graph captures one micro-batch a step: it needs --grad-accum 1"),
    (["--cuda-graph", "--compile"], "--cuda-graph and --compile exclude each other"),
    (["--graph-documents", "0"], "--graph-documents must be at least 1, got 0"),
])
def test_cuda_graph_flags_are_refused_where_no_graph_can_run(argv, message, capsys):
    with pytest.raises(SystemExit):
        parse_args(["--model", "m", "--data", "d.jsonl", "--out", "o", "--device", "cpu", *argv])
    assert message in capsys.readouterr().err


def test_cuda_graph_is_refused_on_several_ranks_in_fp32_and_where_masked_attention_would_run_flexattention():
    config = DecoderConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_layers=1, num_heads=4,
                           num_kv_heads=2)
    cuda = torch.device("cuda")
    # (a TrainConfig with --cuda-graph needs a CUDA device: the flags check_cuda_graph reads, as the run has them)
    args = types.SimpleNamespace(cuda_graph=True, dtype="bf16", attention="documents", seq_len=64)
    with pytest.raises(TrainError, match="--cuda-graph runs on one rank"):
        check_cuda_graph(args, config, world=2, device=cuda)
    args.dtype = "fp32"
    with pytest.raises(TrainError, match="--cuda-graph needs --dtype bf16"):
        check_cuda_graph(args, config, world=1, device=cuda)
    args.dtype = "bf16"
    wide = DecoderConfig(vocab_size=64, hidden_size=256, intermediate_size=48, num_layers=1, num_heads=4,
                         num_kv_heads=2)  # head dim 64: the Triton kernel's
    check_cuda_graph(args, wide, world=1, device=cuda)
    for attention in ("documents", "causal"):  # soft-capping, at any head dim, documents or not
        args.attention = attention
        with pytest.raises(TrainError, match="does not capture llama's soft-capped attention"):
            check_cuda_graph(args, dataclasses.replace(wide, attn_softcap=50.0), world=1, device=cuda)
    args.attention = "documents"
    # dropout sends attention within documents (and windows shorter than the rows) to FlexAttention at every head dim
    dropped = dataclasses.replace(wide, attention_dropout=0.1)
    with pytest.raises(TrainError, match="attention within documents \\(head_dim 64, attention dropout 0.1\\)"):
        check_cuda_graph(args, dropped, world=1, device=cuda)
    args.attention = "causal"
    check_cuda_graph(args, dropped, world=1, device=cuda)  # plain causal attention: SDPA, dropout included
    windowed = dataclasses.replace(dropped, layer_windows=(16,))
    with pytest.raises(TrainError, match="windowed attention"):
        check_cuda_graph(args, windowed, world=1, device=cuda)
    check_cuda_graph(args, dataclasses.replace(windowed, layer_windows=(64,)), world=1, device=cuda)  # >= the rows
    args.cuda_graph = False
    check_cuda_graph(args, config, world=2, device=cuda)  # nothing to check without the flag


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need CUDA")
@pytest.mark.parametrize("attention", ["documents", "causal"])
def test_a_cuda_graph_step_takes_the_eager_steps(checkpoint, data, workdir, attention):
    """--cuda-graph (bf16 on one GPU; packed documents through the attention kernels' bounds, or causal): the same
    losses, gradient norms and final weights as the eager loop, within bf16 rounding (the attention backward kernels
    accumulate with atomics, so neither loop repeats itself bit for bit); a batch with more documents than the
    captured room runs eagerly and says so."""
    runs = {}
    for name, extra in (("eager", []), ("graph", ["--cuda-graph"]), ("tight", ["--cuda-graph", "--graph-documents",
                                                                                 "1"])):
        if name == "tight" and attention == "causal":
            continue
        out = workdir / f"graph-{attention}-{name}"
        flags = [a for a in _flags(checkpoint, data, out) if a not in ("fp32", "cpu", "--dtype", "--device")]
        res = _train([*flags, "--device", "cuda", "--dtype", "bf16", "--steps", "6", "--save-every", "0",
                      "--attention", attention, *extra])
        assert res.returncode == 0, res.stderr[-3000:]
        runs[name] = (_metrics(out), _weights(out), res.stdout)
    eager = runs["eager"]
    for name, (metrics, weights, _) in runs.items():
        for a, b in zip(eager[0], metrics, strict=True):
            assert abs(a["loss"] - b["loss"]) <= 2e-2 * abs(a["loss"]), (name, a, b)
            assert abs(a["grad_norm"] - b["grad_norm"]) <= 5e-2 * abs(a["grad_norm"]), (name, a, b)
        for k in weights:
            assert _rel(weights[k].float(), eager[1][k].float()) <= 2e-2, (name, k)
    if "tight" in runs:
        assert "run eagerly (warned once)" in runs["tight"][2]


def test_graphed_step_captures_tensor_learning_rates_and_gives_the_schedule_back_its_floats(monkeypatch):
    """The capture sees each group's lr as a device tensor (so a replay reads the schedule's value) and
    capturable=True; afterwards the groups hold floats again, which every call copies into those tensors; the
    documents' bounds are padded to batch x --graph-documents sequences, and a batch with more runs eagerly."""
    captured = {}

    class FakeGraph:
        def __init__(self, loss_fn, optimizer, *inputs, after_backward=None):
            captured["lrs"] = [g["lr"] for g in optimizer.param_groups]
            captured["capturable"] = [g["capturable"] for g in optimizer.param_groups]
            captured["shapes"] = [tuple(t.shape) for t in inputs]
            self.after_backward_out = torch.tensor(2.0)

        def __call__(self, *inputs):
            captured["calls"] = captured.get("calls", 0) + 1
            return torch.tensor(1.0)

    monkeypatch.setattr(cuda_graph_module, "CUDAGraphStep", FakeGraph)
    p = torch.nn.Parameter(torch.zeros(3))
    optimizer = AdamW([{"params": [p]}, {"params": [], "lr": 0.5}], lr=0.1)
    args = parse_args(["--model", "m", "--data", "d.jsonl", "--out", "o", "--device", "cpu", "--batch-size", "2",
                       "--seq-len", "6", "--graph-documents", "3"])
    graphed = cuda_graph_module.GraphedStep(None, optimizer, SFTTask(args, None), torch.device("cpu"))
    positions = torch.tensor([[0, 1, 2, 0, 1, 0], [3, 4, 0, 1, 2, 3]])
    batch = (torch.zeros(2, 6, dtype=torch.long), torch.zeros(2, 6, dtype=torch.long), positions)
    inputs = graphed.inputs(batch, {"num_items": torch.tensor(12)})
    assert inputs[4].tolist() == [0, 3, 5, 6, 8, 12, 12]  # 5 sequences, room for 2 x 3
    loss, norm = graphed(inputs, max_norm=1.0)
    assert all(isinstance(lr, torch.Tensor) for lr in captured["lrs"]) and captured["capturable"] == [True, True]
    assert captured["shapes"] == [(2, 6), (2, 6), (2, 6), (), (7,)]
    assert [g["lr"] for g in optimizer.param_groups] == [0.1, 0.5] and float(norm) == 2.0
    optimizer.param_groups[0]["lr"] = 0.05  # the schedule moved
    graphed(inputs, max_norm=1.0)
    assert [float(t) for t in graphed.lrs] == [float(torch.tensor(0.05)), 0.5] and captured["calls"] == 2
    crowded = torch.zeros(2, 6, dtype=torch.long)  # 12 one-token documents: more than 2 x 3
    assert graphed.inputs((batch[0], batch[1], crowded), {"num_items": torch.tensor(12)}) is None


NEW_FAMILIES = ["qwen3_tied_sliding_bias", "gemma2_tied_softcap_sliding", "gemma3_tied_two_ropes", "glm4_bias_untied",
                "phi3_partial_rotary"]


def one_rank_and_two(checkpoint: str, data: str, out, flags: list[str], two_flags: list[str],
                     bounds: tuple[float, float]):
    """The same global batches trained by one rank with --grad-accum 2 (into ``OUT-one``) and by two ranks under
    torchrun with --grad-accum 1 and ``two_flags`` (``OUT-two``), both with :func:`_flags` then ``flags``; every
    step's loss and gradient norm agree within ``bounds`` (relative). Returns the two output directories."""
    runs = []
    for name, extra, nproc in (("one", ["--grad-accum", "2"], 1), ("two", ["--grad-accum", "1", *two_flags], 2)):
        run = f"{out}-{name}"
        res = _train([*_flags(checkpoint, data, run), *flags, *extra], nproc=nproc)
        assert res.returncode == 0, res.stderr[-3000:]
        runs.append(run)
    one, two = (_metrics(r) for r in runs)
    assert len(one) == len(two) > 0
    for a, b in zip(one, two, strict=True):
        assert abs(a["loss"] - b["loss"]) <= bounds[0] * abs(a["loss"]), (a, b)
        assert abs(a["grad_norm"] - b["grad_norm"]) <= bounds[1] * abs(a["grad_norm"]), (a, b)
    return runs


def _one_rank_against_two(case: str, data: str, workdir, device: str, bounds: tuple[float, float, float]) -> None:
    """A family's tiny checkpoint trained 3 fp32 steps on one rank (gradient accumulation 2) and on two FSDP2
    ranks with selective activation checkpointing (lean for every other family): losses, gradient norms and
    exported weights agree within ``bounds`` = (loss, grad norm, weights) relative, and the export reloads in
    transformers."""
    import transformers

    from tests.test_models import make_hf_checkpoint

    loss_bound, norm_bound, weight_bound = bounds
    model_dir = workdir / f"family-{case}-{device}"
    make_hf_checkpoint(case, str(model_dir))
    save_tokenizer(build_tokenizer(), str(model_dir))
    one, two = one_rank_and_two(str(model_dir), data, workdir / f"family-{case}-{device}",
                                ["--steps", "3", "--save-every", "0", "--device", device],
                                ["--ac", "lean" if NEW_FAMILIES.index(case) % 2 else "selective"],
                                (loss_bound, norm_bound))
    w1, w2 = _weights(one), _weights(two)
    assert w1.keys() == w2.keys()
    for k in w1:
        # Partial rotary (GLM-4): the key bias's unrotated channels add q.b, the same to every score of a query,
        # which softmax ignores: their true gradient is 0 (nearly so for the slowest-turning rotated channels over
        # 32 positions), their computed one rounding noise that AdamW scales to lr-sized steps, different on one
        # rank and two (checked: the differing channels are those).
        bound = 1e-2 if case.startswith("glm4") and k.endswith("k_proj.bias") else weight_bound
        assert _rel(w2[k], w1[k]) <= bound, (case, k)
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(os.path.join(two, "final"))
    assert sum(p.numel() for p in reloaded.parameters()) > 0


@pytest.mark.parametrize("case", NEW_FAMILIES)
def test_new_families_train_the_same_steps_on_one_rank_and_on_two_fsdp_ranks(case, data, workdir):
    """Qwen3, Gemma 2 and 3, GLM-4 and Phi-3 (partial rotary) through the CLI on the CPU (gloo)."""
    _one_rank_against_two(case, data, workdir, "cpu", (1e-5, 1e-4, 1e-5))


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices (NCCL)")
@pytest.mark.parametrize("case", NEW_FAMILIES)
def test_new_families_train_the_same_steps_on_one_gpu_and_on_two_gpus_with_nccl(case, data, workdir):
    """The same on two GPUs over NCCL, fp32 (the CUDA kernels and NCCL's fp32 reduce-scatter, whose summation
    order differs from one rank's accumulation: bounds 10x the CPU's)."""
    _one_rank_against_two(case, data, workdir, "cuda", (1e-4, 1e-3, 1e-4))


def test_gradients_reduced_in_bf16_take_the_fp32_reduced_steps_within_bf16_rounding(checkpoint, data, workdir, run_two):
    """``--reduce-dtype bf16`` reduce-scatters the gradients in bf16: the first forward is the fp32-reduced run's, the
    gradient norm differs by bf16 rounding (at most 2^-8 relative) and the later losses by little, but they do
    differ (the flag reaches FSDP2)."""
    bf16 = _two_ranks(checkpoint, data, workdir / "reduce-bf16", "--reduce-dtype", "bf16")
    fp32, low = _metrics(run_two), _metrics(bf16)
    assert low[0]["loss"] == fp32[0]["loss"]
    norms = [abs(a["grad_norm"] - b["grad_norm"]) / a["grad_norm"] for a, b in zip(fp32, low, strict=True)]
    assert 0 < norms[0] <= 2 ** -8, norms
    losses = [abs(a["loss"] - b["loss"]) / a["loss"] for a, b in zip(fp32, low, strict=True)]
    assert 0 < max(losses) <= 3e-4, losses
