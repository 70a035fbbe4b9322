"""benchmarks/bench_scale.py on the CPU: its arguments, the commands and torchtitan config it writes, the
numbers it reads from each trainer and the targets it computes; and one tiny run of ours end to end.

torchtitan itself is not installed here (a benchmark-only baseline) and trains on CUDA only: its side is
checked through the config text it would read and the log lines it prints.
"""

from __future__ import annotations

import json
import os
import sys

import pytest
import tomllib

from benchmarks import bench_scale as bs
from benchmarks import report


def _args(*flags: str):
    return bs.parse_args(["--out", "/tmp/unused", *flags])


# ------------------------------------------------------------------------------------------ arguments
def test_defaults_are_the_issues_shape():
    args = _args()
    assert (args.layers, args.seq_len, args.batch_size, args.steps, args.warmup) == (32, 8192, 1, 20, 5)
    assert args.gpus == [1, 2, 4, 8] and args.impls == list(bs.IMPLS) and args.ac == ["selective", "full"]
    assert (args.device, args.dtype, args.attention) == ("cuda", "bf16", "causal")
    assert args.results.endswith(os.path.join("benchmarks", "results"))
    tiny = bs.parse_args(["--out", "/tmp/t", "--tiny", "--gpus", "2", "1", "2"])
    assert (tiny.layers, tiny.seq_len, tiny.device, tiny.dtype, tiny.results) == (2, 64, "cpu", "fp32", "/tmp/t")
    assert tiny.gpus == [1, 2]


@pytest.mark.parametrize("flags, message", [
    (["--gpus", "0"], "--gpus needs positive counts"),
    (["--layers", "33"], "--layers must be between 1 and 32"),
    (["--layers", "0"], "--layers must be between 1 and 32"),
    (["--batch-size", "0"], "--batch-size must be at least 1"),
    (["--seq-len", "1"], "--seq-len must be at least 2"),
    (["--steps", "5"], "--steps 5 leaves no timed step after --warmup 5"),
    (["--profile", "--steps", "12"], "--profile profiles steps 6-7: give --steps at least 13"),
    (["--prefetch", "-1"], "--prefetch must be at least 0"),
    (["--doc-tokens", "0"], "--doc-tokens must be at least 1"),
    (["--impls", "deepspeed"], "invalid choice: 'deepspeed'"),
    (["--ac", "some"], "invalid choice: 'some'"),
])
def test_bad_arguments_are_refused_by_name(capsys, flags, message):
    with pytest.raises(SystemExit):
        _args(*flags)
    assert message in capsys.readouterr().err


# ------------------------------------------------------------------------------------------ commands
def test_ours_command():
    args = _args("--prefetch", "2", "--reshard-after-forward", "never", "--profile", "--shard-embedding", "vocab")
    cmd = bs.ours_command(args, "ours+compile", 4, "full", "M", "D/data.jsonl", "O")
    assert cmd[1:5] == ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node=4"]
    text = " ".join(cmd)
    for part in ("-m ligermodels.train --model M --from-scratch --data D/data.jsonl --out O --overwrite",
                 "--seq-len 8192 --batch-size 1 --grad-accum 1 --steps 20", "--ac full --attention causal",
                 "--dtype bf16 --device cuda --reshard-after-forward never --prefetch 2 --shard-embedding vocab",
                 "--lr-schedule constant --warmup-steps 0"):
        assert part in text, part
    assert cmd[-2:] == ["--compile", "--profile"]
    split = bs.ours_command(args, "ours", 1, "full", "M", "D", "O", grad_accum=8, steps=3)
    assert "--grad-accum 8 --steps 3" in " ".join(split) and "--compile" not in split and "--profile" not in split
    assert bs.label("ours+compile", args) == "ours+compile+reshard-never+prefetch2+vocab-embedding"
    assert bs.label("titan", args) == "titan" and bs.label("ours", _args()) == "ours"


def test_titan_config_round_trips_through_toml():
    tomllib = pytest.importorskip("tomllib")  # Python >= 3.11
    args = _args("--batch-size", "2", "--layers", "4", "--attention", "documents")
    config = bs.titan_config(args, "titan+compile", "selective", "/w/model", "/w/data/data.jsonl", "/w/run")
    parsed = tomllib.loads(bs.toml(config))
    assert parsed == config
    assert parsed["model"] == {"name": "llama3", "flavor": "8B_flex_layers4", "hf_assets_path": "/w/model"}
    assert parsed["training"]["dataset"] == "c4_test" and parsed["training"]["dataset_path"] == "/w/data"
    assert (parsed["training"]["local_batch_size"], parsed["training"]["seq_len"]) == (2, 8192)
    assert (parsed["training"]["mixed_precision_param"], parsed["training"]["mixed_precision_reduce"]) == (
        "bfloat16", "float32")
    assert parsed["activation_checkpoint"] == {"mode": "selective", "selective_ac_option": "op"}
    assert parsed["compile"] == {"enable": True, "components": ["model", "loss"]}
    assert parsed["lr_scheduler"] == {"warmup_steps": 0, "decay_ratio": 0.0}
    assert parsed["optimizer"]["lr"] == bs.LR and parsed["checkpoint"] == {"enable": False}
    assert parsed["experimental"] == {"custom_import": "benchmarks.titan.flavors"}
    full = bs.titan_config(_args(), "titan", "full", "m", "d/x.jsonl", "o")
    assert full["model"]["flavor"] == "8B" and "experimental" not in full and full["compile"]["enable"] is False
    with pytest.raises(TypeError, match="no TOML form"):
        bs.toml({"a": {"b": None}})


def test_titan_command_and_flavors():
    cmd = bs.titan_command(8, "/w/titan.toml")
    assert cmd[1:5] == ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node=8"]
    assert cmd[5:7] == ["--local-ranks-filter", "0"]
    assert cmd[-4:] == ["-m", "torchtitan.train", "--job.config_file", "/w/titan.toml"]
    assert [bs.titan_flavor(n, a) for n, a in ((32, "causal"), (32, "documents"), (1, "causal"))] == [
        "8B", "8B_flex", "8B_layers1"]


# ------------------------------------------------------------------------------------------ reading results
def test_timing_takes_the_median_after_warmup_and_leaves_out_profiled_steps():
    step_s = {1: 9.0, 2: 1.0, 3: 2.0, 4: 4.0, 5: 50.0, 6: 2.0}
    row = bs.timing(step_s, {k: 10.0 - k for k in step_s}, 8192, warmup=1, skip=(5,), flops_per_token=1e9,
                    peak=1e12)
    assert row["step_s_median"] == 2.0 and row["steps"] == 6 and row["steps_timed"] == 4
    assert row["tokens_per_s_per_gpu"] == 4096.0 and row["mfu"] == round(1e9 * 4096 / 1e12, 4)
    assert row["losses"] == [9.0, 8.0, 7.0, 6.0, 5.0, 4.0]
    assert bs.timing(step_s, {}, 1, warmup=1, flops_per_token=None, peak=1e12)["mfu"] is None
    assert "no timed steps" in bs.timing({1: 1.0}, {1: 1.0}, 1, warmup=1)["error"]
    assert bs.timing({1: 1.0, 2: 1.0}, {1: float("nan"), 2: 3.0}, 1, warmup=0)["losses"] == [None, 3.0]


def test_ours_steps_from_metrics():
    metrics = [{"step": 1, "loss": 12.0, "tokens_per_s": 1000.0}, {"step": 2, "loss": 11.5, "tokens_per_s": 4000.0}]
    step_s, losses = bs.ours_steps(metrics, 8000)
    assert step_s == {1: 8.0, 2: 2.0} and losses == {1: 12.0, 2: 11.5}


def _titan_line(step, loss, grad_norm, reserved, pct, tps, tflops, mfu):
    """torchtitan 0.2.2's console line (components/metrics.py) with colours off, behind its log prefixes."""
    return (f"[rank0]:[titan] 2026-11-25 12:00:00,000 - root - INFO - step: {step:2}  loss: {loss:8.5f}  "
            f"grad_norm: {grad_norm:7.4f}  memory: {reserved:5.2f}GiB({pct:.2f}%)  tps: {round(tps):,}  "
            f"tflops: {tflops:,.2f}  mfu: {mfu:.2f}%\n")


def test_titan_console_lines_are_read():
    text = ("[rank0]:[titan] ... - root - INFO - Training starts at step 1\n"
            + _titan_line(1, 12.25, 3.5, 61.25, 43.8, 1234.4, 58.1, 5.87)
            + _titan_line(2, 11.875, 2.0, 62.5, 44.7, 7021.0, 402.13, 40.66))
    steps = bs.parse_titan_log(text)
    assert steps == {1: {"loss": 12.25, "reserved_gib": 61.25, "tps": 1234.0, "mfu_pct": 5.87},
                     2: {"loss": 11.875, "reserved_gib": 62.5, "tps": 7021.0, "mfu_pct": 40.66}}
    row = bs.titan_fields(steps, 8192, 1, None, None)
    assert row["step_s_median"] == round(8192 / 7021, 4) and row["mfu_own"] == 0.4066
    assert row["peak_mem_gb"] == round(62.5 * 2**30 / 1e9, 2) and row["peak_mem_kind"].startswith("max reserved")
    assert row["losses"] == [12.25, 11.875]


def test_titan_tensorboard_numbers_give_step_time_and_active_memory():
    steps = {s: {"loss": 12.0 - s, "step_s": 3.0 if s == 1 else 0.5 + s / 100, "active_gib": 40.0 + s,
                 "reserved_gib": 50.0, "mfu_pct": 40.0 + s} for s in range(1, 6)}
    row = bs.titan_fields(steps, 4096, 2, 1e9, 989e12)
    assert row["step_s_median"] == 0.54 and row["tokens_per_s_per_gpu"] == round(4096 / 0.54, 1)
    assert row["peak_mem_gb"] == round(45 * 2**30 / 1e9, 2) and row["peak_mem_kind"].startswith("max active")
    assert row["peak_reserved_gb"] == round(50 * 2**30 / 1e9, 2) and row["mfu_own"] == 0.44


# ------------------------------------------------------------------------------------------ targets
def _row(label, gpus, tps, mem, ac="selective", **extra):
    return {"label": label, "impl": label.split("+reshard")[0], "gpus": gpus, "ac": ac, "grad_accum": 1,
            "tokens_per_s_per_gpu": tps, "peak_mem_gb": mem, "losses": [], **extra}


def test_targets_from_rows():
    rows = [_row("ours", 1, 1000.0, 60.0), _row("ours+compile", 1, 1100.0, 59.0),
            _row("titan+compile", 1, 1000.0, 70.0), _row("ours", 2, 960.0, 40.0), _row("ours+compile", 2, 1000.0, 41.0),
            _row("titan+compile", 2, 900.0, 40.0), _row("titan", 2, 800.0, 39.0), _row("ours", 4, 930.0, 30.0),
            _row("ours", 8, 899.0, 25.0),
            _row("titan+compile", 8, 700.0, 20.0, error="exit 1"),
            _row("ours", 1, 500.0, 60.0, ac="full"), _row("titan+compile", 1, 400.0, 50.0, ac="full")]
    checks = bs.targets(rows)
    sel = "titan+compile (selective)"
    assert checks["1:selective"] == {"ours": "ours+compile", "titan": sel, "speed_vs_titan_compile": 1.1,
                                     "memory_vs_titan_compile": round(59 / 70, 3), "holds": False}
    assert checks["2:selective"] == {"ours": "ours+compile", "titan": sel,
                                     "speed_vs_titan_compile": round(1000 / 900, 3),
                                     "memory_vs_titan_compile": 1.025, "holds": False}
    assert checks["1:full"] == {"ours": "ours", "titan": "titan+compile (full)", "speed_vs_titan_compile": 1.25,
                                "memory_vs_titan_compile": 1.2, "holds": False}
    assert "8:selective" not in checks  # torchtitan + compile failed there
    assert checks["ours:selective"] == {"scaling_2": {"ratio": 0.96, "holds": True},
                                        "scaling_4": {"ratio": 0.93, "holds": False},
                                        "scaling_8": {"ratio": 0.899, "holds": False}}
    assert checks["ours+compile:selective"] == {"scaling_2": {"ratio": round(1000 / 1100, 3), "holds": False}}
    assert "titan:selective" not in checks  # no 1-GPU run of plain torchtitan
    # a run with FSDP2 options is held to its implementation's plain one-GPU run (one GPU does not shard)
    vocab = {**_row("ours+vocab-embedding+reduce-bf16", 2, 955.0, 39.0), "impl": "ours"}
    assert bs.targets([*rows, vocab])["ours+vocab-embedding+reduce-bf16:selective"] == {
        "scaling_2": {"ratio": 0.955, "holds": True}}
    assert bs.one_gpu_run(vocab, rows)["tokens_per_s_per_gpu"] == 1000.0
    assert bs.one_gpu_run({**vocab, "impl": "ours+fp8"}, rows) is None
    fast = [_row("ours", 2, 1035.0, 40.0), _row("titan+compile", 2, 900.0, 40.0)]
    assert bs.targets(fast)["2:selective"]["holds"] is True  # 1.15x and the same memory


def test_lean_runs_face_torchtitans_selective_runs_and_fp8_runs_face_its_fastest_float8_run():
    rows = [_row("ours", 2, 1000.0, 60.0), _row("ours", 2, 900.0, 45.0, ac="lean"),
            _row("titan+compile", 2, 880.0, 50.0), _row("ours+fp8", 2, 1300.0, 58.0),
            _row("titan+compile+float8", 2, 1000.0, 52.0), _row("titan+compile+float8-rowwise", 2, 1100.0, 51.0),
            _row("ours+fp8", 2, 1200.0, 44.0, ac="lean")]
    checks = bs.targets(rows)
    assert checks["2:selective"]["ours"] == "ours" and checks["2:selective"]["speed_vs_titan_compile"] == 1.136
    assert checks["2:lean"] == {"ours": "ours", "titan": "titan+compile (selective)",
                                "speed_vs_titan_compile": round(900 / 880, 3), "memory_vs_titan_compile": 0.9,
                                "holds": False}
    assert checks["2:selective:fp8"] == {"ours": "ours+fp8", "titan": "titan+compile+float8-rowwise (selective)",
                                         "speed_vs_titan_compile": round(1300 / 1100, 3),
                                         "memory_vs_titan_compile": round(58 / 51, 3), "holds": False}
    lean8 = checks["2:lean:fp8"]
    assert (lean8["speed_vs_titan_compile"], lean8["memory_vs_titan_compile"]) == (1.091, 0.863)
    rows[-1]["tokens_per_s_per_gpu"] = 1265.0
    assert bs.targets(rows)["2:lean:fp8"]["holds"] is True  # 1.15x at less memory


def test_float8_runs_configure_torchtitans_float8_linear_with_the_head_left_in_bf16():
    args = bs.parse_args(["--out", "/w", "--gpus", "2"])
    for impl, want in (("titan+compile+float8", {"enable_fsdp_float8_all_gather": True}),
                       ("titan+compile+float8-rowwise", {"recipe_name": "rowwise"})):
        config = bs.titan_config(args, impl, "selective", "/w/model", "/w/data/data.jsonl", "/w/run")
        parsed = tomllib.loads(bs.toml(config))
        assert parsed["model"]["converters"] == ["quantize.linear.float8"] and parsed["compile"]["enable"]
        float8 = parsed["quantize"]["linear"]["float8"]
        assert float8["filter_fqns"] == ["output"] and want.items() <= float8.items()
    assert "--fp8" in bs.ours_command(args, "ours+fp8", 2, "lean", "/m", "/d", "/o")


def test_split_invariance_check():
    many = _row("ours", 4, 900.0, 30.0, losses=[12.0, 11.9, 11.8, 11.7])
    split = _row("ours", 1, 800.0, 60.0, role="split-check", grad_accum=4, losses=[12.0, 11.9 * (1 + 2e-6), 11.8])
    assert bs.targets([many, split])["split:4:selective"] == {"steps": 3, "max_rel_loss_diff": pytest.approx(2e-6),
                                                              "holds": True}
    split["losses"][2] = 11.8 * (1 + 3e-5)
    assert bs.targets([many, split])["split:4:selective"]["holds"] is False
    assert "ours:selective" not in bs.targets([many, split])  # a split-check run is no 1-GPU baseline


def test_rows_of_an_earlier_invocation_are_kept_unless_measured_again(tmp_path):
    old = [_row("ours", 1, 1.0, 1.0), _row("titan", 1, 2.0, 2.0), _row("ours", 1, 3.0, 3.0, ac="full")]
    new = [_row("ours", 1, 4.0, 4.0)]
    merged = bs.merge_rows(old, new)
    assert [(r["label"], r["ac"], r["tokens_per_s_per_gpu"]) for r in merged] == [
        ("titan", "selective", 2.0), ("ours", "full", 3.0), ("ours", "selective", 4.0)]
    path = tmp_path / "scale.json"
    assert bs.load_previous(str(path), "gpu-host") == {"rows": [], "notes": [], "titan_packages": {},
                                                       "invocations": []}
    titan = {"torchtitan": "0.2.2"}  # kept when a later invocation runs ours only
    first = {"command": "python -m benchmarks.bench_scale --impls titan", "commit": "a" * 40}
    path.write_text(json.dumps({"host": "gpu-host", "rows": old, "notes": ["n"], "titan_packages": titan, **first}))
    assert bs.load_previous(str(path), "gpu-host") == {"rows": old, "notes": ["n"], "titan_packages": titan,
                                                       "invocations": [first]}
    with pytest.raises(SystemExit, match="holds runs of host 'gpu-host', not 'other': pass another --tag"):
        bs.load_previous(str(path), "other")


# ------------------------------------------------------------------------------------------ end to end
def test_tiny_run_of_ours_writes_its_row_and_skips_titan_and_absent_gpus(tmp_path, monkeypatch):
    """One CPU process (gloo, fp32, a 2-layer Llama), two steps: the JSON row holds what the GPU rows hold."""
    def main(*argv):  # the command each results file records is the process's own
        monkeypatch.setattr(sys, "argv", ["bench_scale.py", *argv])
        bs.main(list(argv))

    main("--out", str(tmp_path), "--tiny", "--gpus", "1", "4096", "--ac", "none", "--steps", "2", "--warmup", "1",
         "--impls", "ours", "titan")
    files = [f for f in os.listdir(tmp_path) if f.startswith("scale-tiny-") and f.endswith(".json")]
    assert len(files) == 1
    with open(tmp_path / files[0]) as f:
        result = json.load(f)
    (row,) = result["rows"]
    assert (row["label"], row["gpus"], row["ac"], row["steps"], row["steps_timed"]) == ("ours", 1, "none", 2, 1)
    assert row["tokens_per_s_per_gpu"] > 0 and row["peak_mem_gb"] > 0 and len(row["losses"]) == 2
    assert row["mfu"] is None and "ligermodels.train" in row["command"]
    assert any(n.startswith("4096 GPUs skipped") for n in result["notes"])
    assert any(n.startswith("torchtitan skipped") for n in result["notes"])
    assert result["model_config"]["num_hidden_layers"] == 2 and result["host"]
    assert os.listdir(tmp_path / "data") == ["data.jsonl"]  # torchtitan reads the whole directory
    assert not (tmp_path / "runs" / "ours-n1-none" / "final").exists()
    # a second invocation into the same file: its rows merged, both invocations listed for the report
    main("--out", str(tmp_path), "--tiny", "--gpus", "1", "--ac", "full", "--steps", "2", "--warmup", "1",
         "--impls", "ours")
    with open(tmp_path / files[0]) as f:
        again = json.load(f)
    assert [r["ac"] for r in again["rows"]] == ["none", "full"]
    assert [("--ac none" in c["command"], "--ac full" in c["command"]) for c in again["invocations"]] == [
        (True, False), (False, True)]
    assert "2 invocations, in order: `python -m " in report._source({**again, "_file": "f"})


def test_report_renders_a_scaling_file_with_its_targets():
    """The many-GPU table: each run's per-GPU rate against its own one-GPU rate, a failed run named as failed,
    the targets of bench_scale's checks, and the file's command, commit and notes under it."""
    from benchmarks import report

    rows = [_row("ours", 1, 100.0, 40.0), _row("ours", 2, 90.0, 30.0), _row("titan+compile", 1, 80.0, 42.0),
            _row("titan+compile", 2, 78.0, 25.0), {**_row("ours+compile", 2, 0.0, 0.0), "error": "exit 1"}]
    d = {"gpu": "H100", "torch": "2.11", "triton": "3.6", "date": "2026-12-01", "_file": "scale.json",
         "command": "python -m benchmarks.bench_scale --gpus 1 2", "commit": "0123456789abcdef0123456789abcdef01234567",
         "model": "Llama-3.1-8B shape, 8 layers, random init",
         "settings": {"batch_size": 1, "seq_len": 8192, "steps": 12, "warmup_steps_dropped": 4, "attention": "causal"},
         "targets": bs.TARGETS, "checks": bs.targets(rows), "rows": rows, "notes": ["a note"]}
    text = report.scale_table(d)
    assert "| selective | ours | 2 | 90 | - | 30.0 | 0.900 |" in text
    assert "| selective | ours+compile | 2 | failed (see the JSON) | | | |" in text
    assert "| 1:selective | ours | titan+compile (selective) | 1.250 | 0.952 | holds |" in text
    assert "| 2:selective | ours | titan+compile (selective) | 1.154 | 1.200 | **misses** |" in text
    assert "ours:selective on 2 GPUs 0.900 (misses); titan+compile:selective on 2 GPUs 0.975 (holds)" in text
    source = text.split("Sources:")[1].strip()
    assert source == ("- `scale.json`: `python -m benchmarks.bench_scale --gpus 1 2` on H100 (torch 2.11, triton 3.6), "
                      "commit `0123456`, 2026-12-01. a note")
