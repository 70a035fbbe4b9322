"""The benchmark definitions that can be checked without a GPU: the end-to-end model shapes (benchmarks/common.py
MODELS) describe the same model to ligermodels and to transformers, the flop count, the transformers attention
each family needs, the eager baselines of the rope-variant kernel cases compute what our ops compute, the attention
benchmark's rows at a soft-capped shape, the report (docs/performance.md and the README's headline table) reads the
newest results file by its recorded date, shows the transformers attention used and is what the committed JSON
generates, every results file records its command and commit and is cited by the docs, and the one-pass LoRA
gradient prototype that bench_lora_paths times computes what it is timed as."""

from __future__ import annotations

import dataclasses
import glob
import json
import os
import re
import shutil
import subprocess
import sys
import time

import pytest
import torch

from benchmarks import bench_attention, common, report
from benchmarks.kernel_cases import rope_variants as rv
from ligermodels.families import config_from_hf, family_of
from tests.utils import DEVICE, assert_triton_runs

transformers = pytest.importorskip("transformers")


# ------------------------------------------------------------------------------------ e2e shapes
@pytest.mark.parametrize("name", sorted(common.MODELS))
def test_model_shape_builds_the_same_model_in_ligermodels_and_transformers(name):
    """Each MODELS entry reads as a ligermodels config, and the model built from it has as many parameters as
    transformers' model of the same dict (both on the meta device: no memory)."""
    d = common.MODELS[name]
    config = config_from_hf(d)
    hf_config = transformers.AutoConfig.for_model(**d)
    with torch.device("meta"):
        ours = family_of(d["model_type"]).cls(config)
        theirs = transformers.AutoModelForCausalLM.from_config(
            hf_config, attn_implementation=common.hf_attention(d["model_type"]))
    assert sum(p.numel() for p in ours.parameters()) == sum(p.numel() for p in theirs.parameters())
    assert config.tie_embeddings == hf_config.tie_word_embeddings
    assert config.head_dim == (getattr(hf_config, "head_dim", None) or d["hidden_size"] // d["num_attention_heads"])
    assert config.rope.theta == hf_config.rope_parameters["rope_theta"]


def test_new_model_shapes_read_their_mechanisms_as_transformers_does():
    """Qwen3-1.7B (q/k head norms, no window) and Gemma-2-2B (soft-capping, attention scale, alternate windows)
    mean the same thing to both libraries."""
    qwen3 = config_from_hf(common.MODELS["qwen3-1.7b"])
    assert qwen3.qk_norm and qwen3.layer_windows == (None,) * 28 and qwen3.rope.theta == 1_000_000.0
    with torch.device("meta"):  # (allocating 1.7B parameters on the host took 17 s)
        assert sum(p.numel() for p in family_of("qwen3").cls(qwen3).parameters()) == 1_720_574_976

    d = common.MODELS["gemma2-2b"]
    gemma2, hf = config_from_hf(d), transformers.AutoConfig.for_model(**d)
    assert gemma2.attn_softcap == hf.attn_logit_softcapping == 50.0
    assert gemma2.final_softcap == hf.final_logit_softcapping == 30.0
    assert gemma2.attn_scale == hf.query_pre_attn_scalar ** -0.5 == 256 ** -0.5
    assert gemma2.layer_windows == tuple(4096 if t == "sliding_attention" else None for t in hf.layer_types)
    assert gemma2.layer_windows[:2] == (4096, None)


def test_hf_baselines_use_an_attention_that_computes_the_models_math():
    """Gemma 2's transformers baseline attends eagerly (the soft-cap applied); the other families through SDPA.
    Every model type has a Liger-Kernel patch named."""
    assert common.hf_attention("gemma2") == "eager"
    assert {common.hf_attention(d["model_type"]) for d in common.MODELS.values()} == {"sdpa", "eager"}
    assert {d["model_type"] for d in common.MODELS.values()} <= set(common.LIGER_PATCH)
    cfg = transformers.Gemma2Config(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                    num_attention_heads=2, num_key_value_heads=1, head_dim=16)
    model = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation=common.hf_attention("gemma2"))
    assert model.config._attn_implementation == "eager" and model.config.attn_logit_softcapping == 50.0


def test_step_flops_counts_sliding_windows():
    """Without windows (or windows no shorter than the sequence) the count is the causal half S^2 / 2 per layer;
    Gemma-2-2B's 13 sliding layers at S = 8192 count S*W - W^2/2 pairs with W = 4096."""
    def closed_form(name, batch, seq):
        d = common.MODELS[name]
        h, layers, hq = d["hidden_size"], d["num_hidden_layers"], d["num_attention_heads"]
        hd, hkv = d.get("head_dim", h // hq), d["num_key_value_heads"]
        experts = d.get("num_experts") or d.get("num_local_experts")
        mlp = (h * experts + 3 * h * d["num_experts_per_tok"] * d.get("moe_intermediate_size", d["intermediate_size"])
               if experts else 3 * h * d["intermediate_size"])
        params = layers * (h * (hq + 2 * hkv) * hd + hq * hd * h + mlp) + d["vocab_size"] * h
        return 6 * params * batch * seq + 3 * 4 * batch * seq * seq * hq * hd * layers / 2, 12 * batch * hq * hd

    for name in common.MODELS:
        assert common.step_flops(name, 4, 2048) == pytest.approx(closed_form(name, 4, 2048)[0], rel=1e-12)
    full, per_pair = closed_form("gemma2-2b", 2, 8192)
    saved = 13 * (8192 * 8192 / 2 - (8192 * 4096 - 4096 * 4096 / 2))
    assert common.step_flops("gemma2-2b", 2, 8192) == pytest.approx(full - per_pair * saved, rel=1e-12)


# --------------------------------------------------------------------------- rope-variant kernel cases
@pytest.mark.parametrize("case", rv.CASES, ids=lambda c: c.op + c.tag)
def test_rope_variant_baselines_compute_what_our_op_computes(case):
    """On each case's head_dim, rotary width, pairing and norm (fewer heads, a few tokens, fp32; our kernels on
    the GPU where there is one, else in Triton's interpreter): the eager baseline's q and k and their gradients
    equal ours, our in-place op leaves the v heads and passes their gradient through, through the same alias the
    benchmark times."""
    case = dataclasses.replace(case, heads=(4, 2, case.heads[2]))
    hq, hkv, d = case.heads
    batch, seq = 2, 5
    packed = case.inplace
    ours_in = rv.make_inputs(case, batch, seq, torch.float32, DEVICE.type, packed, seed=3)
    base_in = rv.make_inputs(case, batch, seq, torch.float32, DEVICE.type, False, seed=3)
    assert_triton_runs(ours_in[0])
    eager_q, eager_k = rv.eager_fn(case)(*base_in)
    g = torch.Generator().manual_seed(4)
    dq, dk = (torch.randn(t.shape, generator=g).to(DEVICE) for t in (eager_q, eager_k))
    weights = base_in[4:]
    eager_grads = torch.autograd.grad((eager_q, eager_k), [base_in[0], base_in[1], *weights], (dq, dk))

    if packed:
        v_before = ours_in[0].detach().view(batch, seq, hq + 2 * hkv, d)[:, :, hq + hkv:].clone()
        out = rv.ours_fn(case)(*ours_in)
        assert out.data_ptr() == ours_in[0].data_ptr()  # in place, on the leaf's storage
        heads = out.view(batch, seq, hq + 2 * hkv, d)
        q, k, v = heads[:, :, :hq], heads[:, :, hq:hq + hkv], heads[:, :, hq + hkv:]
        dv = torch.randn(v.shape, generator=g).to(DEVICE)
        grads = torch.autograd.grad(out, [ours_in[0], *ours_in[3:]], torch.cat((dq, dk, dv), dim=2).flatten(2))
        dheads = grads[0].view(batch, seq, hq + 2 * hkv, d)
        torch.testing.assert_close(v, v_before, rtol=0, atol=0)
        torch.testing.assert_close(dheads[:, :, hq + hkv:], dv, rtol=0, atol=0)
        ours_grads = (dheads[:, :, :hq], dheads[:, :, hq:hq + hkv], *grads[1:])
    else:
        q, k = rv.ours_fn(case)(*ours_in)
        ours_grads = torch.autograd.grad((q, k), ours_in[:2], (dq, dk))
    torch.testing.assert_close(q, eager_q, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(k, eager_k, rtol=1e-5, atol=1e-5)
    for ours_g, eager_g in zip(ours_grads, eager_grads, strict=True):
        torch.testing.assert_close(ours_g, eager_g, rtol=1e-4, atol=1e-4)


def test_rope_variant_bytes_follow_the_stated_count():
    """The bytes compare_impls divides by: Qwen3-1.7B q/k norm + RoPE at 4 x 2048 tokens in bf16 (24 q/k heads of
    128: read + write forward, 3x backward, plus cos and sin), and the partial in-place rotation (96 channels,
    both passes: the backward rotates the incoming gradient in place too)."""
    t, qk = 4 * 2048, 4 * 2048 * 24 * 128 * 2
    tables = 2 * t * 128 * 2
    assert rv.CASES[0].nbytes(t, 2) == (3 * qk + tables, 3 * qk + tables)
    partial = next(c for c in rv.CASES if c.op == "rope_partial_inplace")
    qk = t * (24 + 8) * 2
    assert partial.nbytes(t, 2) == (2 * qk * 96 + 2 * t * 96 * 2, 2 * qk * 96 + 2 * t * 96 * 2)
    assert partial.shape(4, 2048) == "4x2048x24/8x128-r96"


# ------------------------------------------------------------------------------------ attention rows
def test_softcapped_attention_shape_times_our_kernel_with_its_tiles_against_flexattention():
    """gemma2-2b:4 (soft-capping, head dim 256) runs kernels.document_attention with the cap (whole rows, within
    documents, and each --triton-configs tile set) beside FlexAttention; no SDPA row, which cannot soft-cap."""
    _, hq, hkv, d, softcap = bench_attention.SHAPES["gemma2-2b:4"]
    assert (hq, hkv, d, softcap) == (8, 4, 256, 50.0)
    tiles = {"fwd": [32, 32, 4, 2], "kv": [32, 32, 4, 2], "q": [32, 32, 4, 2]}
    rows = {impl: rest for impl, *rest in bench_attention.implementations(softcap, [tiles], [{"bwd_num_warps": 8}])}
    assert rows["triton-documents"] == ["triton", None, "within_documents", True]
    assert rows["triton-causal"] == ["triton", None, "whole_rows", False]
    assert rows[f"triton-documents {json.dumps(tiles, separators=(',', ':'))}"] == ["triton", tiles,
                                                                                     "within_documents", True]
    assert rows["flex-documents"][0] == rows["flex-causal"][0] == "flex"
    assert not any(impl.startswith(("cudnn", "flash")) for impl in rows)
    plain = [impl for impl, *_ in bench_attention.implementations(None)]
    assert plain[:2] == ["cudnn-causal", "triton-documents"] and "triton-causal" not in plain


# --------------------------------------------------------------------------------------- report
def test_report_reads_the_newest_results_by_date_and_shows_new_ops(tmp_path):
    """Files of equal modification time (a checkout) are ordered by their recorded date, then name; the kernel
    table has a line per (op, pass) for the new ops, the baselines measured in a separate call included."""
    def write(name, date, gpu, rows):
        (tmp_path / name).write_text(json.dumps({"gpu": gpu, "date": date, "rows": rows}))

    write("kernels-H100-2026-11-30.json", "2026-11-30", "H100", [])
    write("kernels-H100-2026-12-01.json", "2026-12-01", "H100", [])
    write("kernels-H100-2026-12-01b.json", "2026-12-01", "H100", [])
    write("kernels-H200-2026-12-02.json", "2026-12-02", "H200", [])
    assert common.newest_results("kernels", results=str(tmp_path)).endswith("H200-2026-12-02.json")
    assert common.newest_results("kernels", gpu="H100", results=str(tmp_path)).endswith("H100-2026-12-01b.json")
    assert common.newest_results("kernels", gpu="A100", results=str(tmp_path)) is None

    def row(op, impl, pas, ms):
        return {"op": op, "shape": "4x2048x16/8x128", "impl": impl, "pass": pas, "ms": ms, "wall_ms": ms,
                "timing": "cuda-kernels", "gbs": 100.0 / ms, "frac_copy_bw": 0.03 / ms, "frac_same_size_copy": 0.9}

    rows = [row(op, impl, pas, ms) for op in ("qk_norm_rope", "rope_partial_inplace") for pas in ("fwd", "bwd")
            for impl, ms in (("ligermodels", 0.04), ("eager", 0.4), ("compile", 0.05))]
    table = report.kernels_table({"gpu": "H100", "torch": "2.13", "triton": "3.6", "date": "2026-12-01",
                                  "_file": "x.json", "copy_gbs": 3000.0, "rows": rows})
    for op in ("qk_norm_rope", "rope_partial_inplace"):
        for pas in ("fwd", "bwd"):
            assert f"| {op} | {pas} | 2500 | 75% | 90% | 60% | 10.00x | 1.25x | 0.040 |" in table


def test_report_names_a_baselines_attention_when_it_is_not_sdpa():
    """Gemma 2's transformers rows say they attend eagerly, in the end-to-end and the training tables."""
    assert report._e2e_variant({"variant": "compile", "hf_attention": "eager"}) == "compile, eager attention"
    assert report._e2e_variant({"variant": "eager"}) == "eager"


def test_the_committed_docs_are_what_the_results_json_generates():
    """docs/performance.md and the README's headline table equal what benchmarks/report.py generates from
    benchmarks/results/: after a new results file, run python -m benchmarks.report."""
    assert report.update(write=False) == []
    res = subprocess.run([sys.executable, "-m", "benchmarks.report", "--check"], cwd=report.ROOT, capture_output=True,
                         text=True, timeout=120)
    assert res.returncode == 0, res.stderr


def test_report_check_finds_a_changed_number_and_the_report_restores_it(tmp_path):
    """A number edited by hand inside a generated block is found (the file named), and the rewrite puts the
    JSON's number back; text outside the blocks is kept."""
    for rel in report.TARGETS:
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(os.path.join(report.ROOT, rel), tmp_path / rel)
    readme = tmp_path / "README.md"
    text = readme.read_text(encoding="utf-8")
    block = text[text.index("<!-- report:headline -->"):text.index("<!-- /report:headline -->")]
    number = re.search(r"\| (\d{2},\d{3}) \|", block)[1]
    readme.write_text(text.replace(f"| {number} |", "| 99,999 |", 1) + "\nA line of my own.\n", encoding="utf-8")
    assert report.update(str(tmp_path), write=False) == ["README.md"]
    assert report.update(str(tmp_path)) == ["README.md"]
    again = readme.read_text(encoding="utf-8")
    assert f"| {number} |" in again and "99,999" not in again and again.endswith("A line of my own.\n")
    assert report.update(str(tmp_path), write=False) == []
    readme.write_text(again.replace("<!-- /report:headline -->", ""), encoding="utf-8")
    with pytest.raises(ValueError, match="README.md: no <!-- report:headline -->"):
        report.update(str(tmp_path), write=False)


def _results_files() -> list[str]:
    return sorted(f for f in glob.glob(os.path.join(report.RESULTS, "**", "*"), recursive=True)
                  if os.path.isfile(f) and not f.endswith(".md"))


def test_results_record_the_host_cpu_and_the_report_names_it():
    """Every results file records its host CPU (and, on a GPU, what a small launch costs it): an eager step of many
    small launches runs at its host's pace. The report's platform line names it; files without it read as before."""
    host = common.environment()["host_cpu"]
    assert isinstance(host["cpu"], str) and host["cpu"] and host["cpus"] == os.cpu_count()
    assert ("launch_us" in host) == torch.cuda.is_available()
    d = {"torch": "2.11.0", "triton": "3.6.0"}
    assert report._versions(d) == "torch 2.11.0, triton 3.6.0"
    assert report._versions({**d, "host_cpu": {"cpu": "Xeon", "cpus": 16, "launch_us": 6.25}}) == (
        "torch 2.11.0, triton 3.6.0; host Xeon, 16 CPUs, 6.2 us a small launch")


def test_every_results_file_records_its_command_and_commit():
    """The report prints each table's command and commit from the file itself."""
    for path in _results_files():
        if path.endswith(".json"):
            with open(path) as f:
                d = json.load(f)
            assert d.get("command") and re.fullmatch(r"[0-9a-f]{40}(\+dirty)?", d.get("commit", "")), path


def test_every_results_file_is_cited_by_the_docs():
    """A results file that no doc table or sentence cites does not stay in the tree (git keeps history)."""
    docs = [os.path.join(report.ROOT, "README.md"), *glob.glob(os.path.join(report.ROOT, "docs", "*.md"))]
    text = "".join(open(p, encoding="utf-8").read() for p in docs)
    uncited = [os.path.relpath(p, report.RESULTS) for p in _results_files() if os.path.basename(p) not in text]
    assert not uncited, uncited


def test_docs_and_results_state_facts_not_the_teams_process():
    """The docs, the results files and the report's text state facts: nothing matches the pattern of the team's
    working process below."""
    paths = [os.path.join(report.ROOT, "README.md"), os.path.join(report.ROOT, "benchmarks", "report.py"),
             *glob.glob(os.path.join(report.ROOT, "docs", "**", "*"), recursive=True),
             *glob.glob(os.path.join(report.RESULTS, "**", "*"), recursive=True)]
    pattern = re.compile(r"\bsessions? [0-9]+|\bissues? #?[0-9]+|\bleases?\b", re.I)
    found = [f"{os.path.relpath(p, report.ROOT)}: {m[0]}" for p in paths if os.path.isfile(p)
             for m in [pattern.search(open(p, encoding="utf-8").read())] if m]
    assert not found, found


# ------------------------------------------------------------------------------------ LoRA paths
def test_lora_paths_one_pass_prototype_computes_dz_and_db():
    """The one-pass LoRA gradient prototype that bench_lora_paths times against cuBLAS computes what it is timed
    as: dz = scale * d2 @ bb.T and dbb = z.T @ d2 (float64 reference), with partials over several row blocks and
    column groups, odd sizes and a padded rank (48 -> 64)."""
    from benchmarks.bench_lora_paths import onepass_dz_dbb

    dev = "cuda" if torch.cuda.is_available() else "cpu"  # the interpreter on the CPU
    g = torch.Generator().manual_seed(0)
    m, n, tr = 101, 203, 48
    d2 = torch.randn(m, n, generator=g).to(dev, torch.bfloat16)
    z = torch.randn(m, tr, generator=g).to(dev, torch.bfloat16)
    bb = (torch.randn(tr, n, generator=g) * 0.05).to(dev, torch.bfloat16)
    dz, dbb = onepass_dz_dbb(d2, z, bb, 2.0, bm=32, bn=32, row_tiles=2, col_tiles=2)
    dz_ref = 2.0 * d2.double() @ bb.double().t()
    dbb_ref = z.double().t() @ d2.double()
    assert dz.dtype == torch.bfloat16 and dz.shape == (m, tr) and dbb.shape == (tr, n)
    assert (dz.double() - dz_ref).norm() / dz_ref.norm() < 8e-3
    assert (dbb.double() - dbb_ref).norm() / dbb_ref.norm() < 1e-5


# ------------------------------------------------------------------------------------ DPO loss head
def test_dpo_head_benchmark_times_the_sigmoid_dpo_loss_of_its_pairs():
    """bench_dpo_head's ligermodels sides (the trainer's head, and the per-token one) are the sigmoid DPO loss
    (beta 0.1) of the pairs' summed completion log-probs, policy against reference: a float64 computation from full
    logits agrees (fp32 inputs, odd sizes)."""
    import torch.nn.functional as F

    from benchmarks.bench_dpo_head import BETA, make_inputs, ours, ours_fused

    inp = make_inputs(97, 16, device=DEVICE.type, pairs=3, prompt=5, completion=7, dtype=torch.float32)

    def logps(h, w):
        t = inp["target"]
        z = (h.double() @ w.double().T).log_softmax(-1)
        return (z.gather(-1, t.clamp(min=0)[..., None])[..., 0] * (t != -100)).sum(-1)

    pol, ref = logps(inp["hidden"], inp["weight"]), logps(inp["ref_hidden"], inp["ref_weight"])
    delta = (pol[:3] - ref[:3]) - (pol[3:] - ref[3:])
    expected = float(-F.logsigmoid(BETA * delta).mean())
    assert float(ours(inp)) == pytest.approx(expected, rel=1e-6)
    assert float(ours_fused(inp)) == pytest.approx(expected, rel=1e-6)


def test_gpu_clocks_summarises_the_busy_samples_and_the_power_capped_share(tmp_path, monkeypatch):
    """benchmarks.common.GPUClocks reads nvidia-smi's samples: only those above the busy power count, the clock's
    median and the share held by the software power cap (reason bit 0x4); without nvidia-smi, no summary."""
    from benchmarks.common import GPUClocks

    fake = tmp_path / "nvidia-smi"
    fake.write_text("#!/bin/sh\ncase \"$*\" in *power.limit*) echo '700.00, 1980'; exit;; esac\n"
                    "printf '1980, 90.5, 0x0000000000000001\\n1700, 650.0, 0x0000000000000004\\n"
                    "1500, 699.0, 0x0000000000000004\\n1900, 400.0, 0x0000000000000000\\n[N/A], 500, 0x0\\n'\n"
                    "exec sleep 30\n")
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}:{os.environ['PATH']}")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,3")
    with GPUClocks(busy_w=250) as clocks:
        assert clocks.index == "2"
        time.sleep(0.5)
    assert clocks.summary == {"samples": 3, "period_ms": 200, "sm_clock_mhz_median": 1700.0, "sm_clock_mhz_max": 1980.0,
                              "power_w_median": 650.0, "power_limit_w": 700.0, "power_capped": 0.667}
    monkeypatch.setenv("PATH", str(tmp_path / "nowhere"))
    with GPUClocks() as clocks:
        pass
    assert clocks.summary is None


def test_nccl_bench_settings_are_nccl_variables_or_default():
    from benchmarks.bench_nccl import parse_setting

    assert parse_setting("default") == {}
    assert parse_setting("NCCL_PROTO=Simple NCCL_MAX_CTAS=8") == {"NCCL_PROTO": "Simple", "NCCL_MAX_CTAS": "8"}
    for bad in ("PROTO=Simple", "NCCL_PROTO", "NCCL_PROTO="):
        with pytest.raises(ValueError, match="NCCL_NAME=VALUE"):
            parse_setting(bad)


def test_nccl_bench_names_a_failed_runs_error_line_not_torchruns_rule():
    from benchmarks.bench_nccl import last_error

    out = "[rank1]: Traceback\nRuntimeError: Duplicate GPU detected\n" + "=" * 60 + "\nroot cause: rank 1\n" + "=" * 60
    assert last_error(out) == "RuntimeError: Duplicate GPU detected"
    assert last_error("starting\nexit code 3\n" + "=" * 20) == "exit code 3" and last_error("") == ""


def test_nccl_bench_tiny_run_times_each_collective_and_the_gemm_over_gloo(tmp_path):
    """--tiny: two gloo ranks on the CPU (where a GPU is too) time the three collectives and the GEMM; the row
    records its setting."""
    res = subprocess.run([sys.executable, "-m", "benchmarks.bench_nccl", "--tiny", "--out", str(tmp_path),
                          "--settings", "NCCL_PROTO=Simple"], capture_output=True, text=True, timeout=180,
                         env=common.child_env("cpu"))
    assert res.returncode == 0, res.stderr[-2000:]
    (path,) = glob.glob(str(tmp_path / "nccl-*.json"))
    row = json.loads(open(path).read())["rows"][0]
    assert row["setting"] == "NCCL_PROTO=Simple" and row["env"] == {"NCCL_PROTO": "Simple"} and row["ranks"] == 2
    for op in ("all_gather_bf16", "reduce_scatter_fp32", "reduce_scatter_bf16", "gemm"):
        assert row[f"{op}_ms"] > 0, (op, row)
