"""benchmarks/bench_train.py on the CPU: what can be checked without a GPU.

The targets (the full fine-tuning ones reproduce the committed results' checks; the LoRA ones), the flags,
the results file's merge, the max-batch search (against a fake step that runs out of memory above a batch),
and, on a tiny Llama shape, the LoRA inputs end to end: the bf16 base checkpoint written once and reused,
``ligermodels.train --lora-rank`` on it as the bench runs it, the in-process max-batch step giving the CLI's
losses and going on after an out-of-memory try, and the PEFT model and Trainer of the hf+peft impls on the
same base and rows (their first loss is ours).
"""

from __future__ import annotations

import glob
import importlib.util
import json
import math
import os

import pytest
import torch

from benchmarks import bench_train as bt
from benchmarks import common

RESULTS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks", "results")
TINY = dict(model_type="llama", vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=256, rms_norm_eps=1e-5,
            tie_word_embeddings=False, hidden_act="silu", rope_parameters={"rope_type": "default", "rope_theta": 1e4})
SEQ, BATCH, STEPS = 64, 2, 2


def _row(impl, tokens_per_s, peak, **extra):
    return {"impl": impl, "model": "m", "batch": 4, "seq": 2048, "ac": "none", "tokens_per_s": tokens_per_s,
            "peak_mem_gb": peak, **extra}


# ------------------------------------------------------------------------------------------ targets
@pytest.mark.parametrize("path", sorted(glob.glob(os.path.join(RESULTS, "train-*.json"))), ids=os.path.basename)
def test_full_fine_tuning_targets_reproduce_the_committed_checks(path):
    with open(path) as f:
        d = json.load(f)
    for shape, checks in d["checks"].items():
        rows = [r for r in d["rows"] if f"{r['model']}:b{r['batch']}" == shape]
        assert bt.targets(rows) == checks, shape


def test_a_run_cut_short_keeps_the_shapes_finished_runs_in_the_file(tmp_path, monkeypatch):
    """Rows are written after every run: a call's time limit that kills the third run of a shape leaves the
    first two (with their shape's checks) in the results file."""
    monkeypatch.setattr(bt, "write_inputs", lambda work, model, tokens, words: ("model_dir", "data.jsonl"))
    monkeypatch.setattr(bt, "run_ligermodels", lambda *a: {"tokens_per_s": 300.0, "peak_mem_gb": 5.0})

    def worker(args, impl, *rest):
        if impl == "hf+compile":
            raise KeyboardInterrupt  # what the outer timeout's signal does to the bench
        return {"tokens_per_s": 200.0, "peak_mem_gb": 10.0}

    monkeypatch.setattr(bt, "run_worker", worker)
    argv = ["--out", str(tmp_path / "work"), "--results", str(tmp_path), "--runs", "qwen2-1.5b:4",
            "--impls", "ligermodels", "hf+liger", "hf+compile", "--tag=-cut"]
    with pytest.raises(KeyboardInterrupt):
        bt.main(argv)
    (path,) = glob.glob(str(tmp_path / "train-*-cut.json"))
    with open(path) as f:
        written = json.load(f)
    assert [r["impl"] for r in written["rows"]] == ["ligermodels", "hf+liger"]
    assert written["checks"]["qwen2-1.5b:b4"]["memory_vs_hf_liger"]["ratio"] == 0.5


def test_lora_targets():
    rows = [_row("ligermodels-lora", 13000.0, 14.0), _row("hf+peft+liger", 9000.0, 20.0),
            _row("hf+peft+compile", 10000.0, 24.0), _row("hf+peft", 50000.0, 10.0)]  # hf+peft: no rival
    assert bt.lora_targets(rows) == {"speed_vs_fastest_peft": {"ratio": 1.3, "fastest": "hf+peft+compile",
                                                               "holds": True},
                                     "memory_vs_peft_liger": {"ratio": 0.7, "holds": True}}
    rows[0] = _row("ligermodels-lora", 12000.0, 15.0)
    checks = bt.lora_targets(rows)
    assert checks["speed_vs_fastest_peft"]["ratio"] == 1.2 and not checks["speed_vs_fastest_peft"]["holds"]
    assert checks["memory_vs_peft_liger"]["ratio"] == 0.75 and not checks["memory_vs_peft_liger"]["holds"]
    # a failed or missing rival: only the checks it does not enter
    failed = [rows[0], {**rows[1], "error": "out of memory", "oom": True}, rows[2]]
    assert set(bt.lora_targets(failed)) == {"speed_vs_fastest_peft"}
    assert bt.lora_targets([rows[0], rows[1]])["speed_vs_fastest_peft"]["fastest"] == "hf+peft+liger"
    assert bt.lora_targets(rows[1:]) == {}  # ours failed or missing: nothing to check


# ------------------------------------------------------------------------------------------ flags
def test_lora_flags():
    args = bt.parse_args(["--out", "o", "--lora", "--runs", "llama-1b:8", "qwen2-7b:4"])
    assert args.impls == ["ligermodels-lora", "hf+peft+liger", "hf+peft+compile"] and args.lora
    assert args.runs == [("llama-1b", 8), ("qwen2-7b", 4)]
    args = bt.parse_args(["--out", "o", "--impls", "ligermodels-lora", "hf+peft"])
    assert args.lora and args.impls == ["ligermodels-lora", "hf+peft"]
    args = bt.parse_args(["--out", "o", "--max-batch", "--runs", "qwen2-7b", "llama-1b:8"])
    assert args.lora and args.impls[0] == "ligermodels-lora" and args.runs == [("qwen2-7b", 1), ("llama-1b", 8)]
    args = bt.parse_args(["--out", "o"])  # the full fine-tuning runs as before
    assert not args.lora and args.impls == list(bt.DEFAULT_FULL_IMPLS) and args.runs == [("qwen2-1.5b", 4)]


def test_lora_on_a_mixture_of_experts_shape_adapts_the_attention_projections_on_both_sides():
    """transformers keeps a mixture-of-experts layer's experts as stacked parameters, out of reach of PEFT's
    target_modules: both sides then adapt q, k, v, o; a call mixing such a shape with a dense one is refused."""
    assert bt.lora_modules(common.MODELS["qwen3-30b-a3b"]) == bt.lora_modules(common.MODELS["mixtral-8x7b-l2"]) == (
        "q", "k", "v", "o")
    assert bt.lora_modules(common.MODELS["llama-1b"]) == bt.LORA["targets"]
    args = bt.parse_args(["--out", "o", "--lora", "--runs", "qwen3-30b-a3b:1"])
    cmd = bt.train_command(args, "ligermodels-lora", "m", "d", 1, "o")
    assert cmd[cmd.index("--lora-targets") + 1] == "q,k,v,o"
    assert bt.lora_settings(args, 1, 2)["lora"]["targets"] == ["q", "k", "v", "o"]
    with pytest.raises(SystemExit):
        bt.parse_args(["--out", "o", "--lora", "--runs", "qwen3-30b-a3b:1", "llama-1b:1"])


def test_train_commands():
    """The full fine-tuning commands are those of the committed runs; LoRA loads the base, with the LoRA flags."""
    import sys

    args = bt.parse_args(["--out", "o", "--runs", "llama-1b:8", "--steps", "16"])
    common = ["--data", "d", "--out", "o", "--overwrite", "--seq-len", "2048", "--batch-size", "8", "--steps", "16",
              "--save-every", "0", "--log-every", "10"]
    rest = ["--lr-schedule", "constant", "--warmup-steps", "0", "--seed", "0", "--ac", "none", "--attention"]
    head = [sys.executable, "-m", "ligermodels.train", "--model", "m"]
    assert bt.train_command(args, "ligermodels", "m", "d", 8, "o", True) == \
        [*head, "--from-scratch", *common, "--lr", "1e-05", *rest, "documents", "--profile"]
    assert bt.train_command(args, "ligermodels-causal", "m", "d", 8, "o") == \
        [*head, "--from-scratch", *common, "--lr", "1e-05", *rest, "causal"]
    assert bt.train_command(args, "ligermodels-vocab", "m", "d", 8, "o") == \
        [*head, "--from-scratch", *common, "--lr", "1e-05", *rest, "documents", "--loss-strategy", "vocab"]
    assert bt.train_command(args, "ligermodels-tokens", "m", "d", 8, "o")[-2:] == ["--loss-strategy", "tokens"]
    assert "ligermodels-tokens" not in bt.DEFAULT_FULL_IMPLS and "bare" in bt.DEFAULT_FULL_IMPLS
    assert bt.train_command(args, "ligermodels-graph", "m", "d", 8, "o")[-1] == "--cuda-graph"
    graph_lora = bt.train_command(args, "ligermodels-lora-graph", "m", "d", 8, "o")
    assert "--cuda-graph" in graph_lora and "--lora-rank" in graph_lora and "--from-scratch" not in graph_lora
    assert "ligermodels-graph" not in bt.DEFAULT_FULL_IMPLS
    assert bt.train_command(args, "ligermodels-lora", "m", "d", 8, "o") == \
        [*head, *common, "--lr", "0.0001", *rest, "documents", "--lora-rank", "16", "--lora-alpha", "32.0",
         "--lora-dropout", "0.0", "--lora-targets", "q,k,v,o,gate,up,down"]


@pytest.mark.parametrize("argv, message", [
    (["--impls", "ligermodels", "hf+peft+liger"], "--impls mixes full fine-tuning (ligermodels) and LoRA"),
    (["--lora", "--impls", "hf+liger"], "--lora runs the LoRA impls"),
    (["--max-batch", "--impls", "ligermodels"], "--max-batch is for the LoRA impls"),
    (["--lora", "--runs", "qwen2-9b:4"], "--runs qwen2-9b:4: unknown model 'qwen2-9b'"),
    (["--lora", "--runs", "qwen2-7b"], "--runs qwen2-7b: give MODEL:BATCH"),
    (["--lora", "--runs", "qwen2-7b:0"], "--runs qwen2-7b:0: the batch must be a whole number of at least 1"),
    (["--max-batch", "--runs", "qwen2-7b:512"], "each first batch must be at most --max-batch-limit 256"),
    (["--lora", "--runs", "qwen2-7b:4", "--doc-words", "300"], "--doc-words must be LOW,HIGH"),
])
def test_bad_flags_are_refused_by_name(capsys, argv, message):
    with pytest.raises(SystemExit) as e:
        bt.parse_args(["--out", "o", *argv])
    assert e.value.code == 2 and message in capsys.readouterr().err


def test_lora_results_merge_by_shape_and_refuse_other_settings():
    """Rows replace those of the same impl and shape; the checks come from the merged rows (one shape's impls
    run by two calls); max-batch entries alone leave the rows; other settings are refused."""
    settings = {"seq": 2048, "steps": 16}
    a = [_row("ligermodels-lora", 1.0, 1.0), _row("hf+peft+liger", 1.0, 2.0)]
    old = bt.merge_lora_results({}, a, [], settings, "f.json")
    assert old["checks"] == {"m:b4": bt.lora_targets(a)}
    fit = {"impl": "ligermodels-lora", "model": "m", "seq": 2048, "ac": "none", "max_batch": 8}
    new = bt.merge_lora_results(old, [_row("hf+peft+compile", 0.5, 9.0), _row("ligermodels-lora", 2.0, 1.0)], [fit],
                                settings, "f.json")
    assert [(r["impl"], r["tokens_per_s"]) for r in new["rows"]] == [
        ("hf+peft+liger", 1.0), ("hf+peft+compile", 0.5), ("ligermodels-lora", 2.0)]
    assert new["checks"]["m:b4"] == {"speed_vs_fastest_peft": {"ratio": 2.0, "fastest": "hf+peft+liger",
                                                               "holds": True},
                                     "memory_vs_peft_liger": {"ratio": 0.5, "holds": True}}
    assert new["max_batch"] == [fit] and new["targets"] == bt.LORA_TARGETS
    again = bt.merge_lora_results(new, [], [{**fit, "max_batch": 9}], {"other": 1}, "f.json")  # max batch alone
    assert again["rows"] == new["rows"] and again["settings"] == settings and again["max_batch"][0]["max_batch"] == 9
    with pytest.raises(ValueError, match="f.json holds runs with other settings"):
        bt.merge_lora_results(new, a, [], {"seq": 4096}, "f.json")


# ------------------------------------------------------------------------------------------ max batch
@pytest.mark.parametrize("start", [1, 3, 4, 16])
@pytest.mark.parametrize("largest", [0, 1, 2, 3, 5, 8, 13, 100, 255, 256, 1000])
def test_largest_batch_finds_the_exact_boundary_in_few_tries(start, largest):
    calls = []

    def fit(b):
        calls.append(b)
        return b <= largest

    good, bad, tries = bt.largest_batch(fit, start, limit=256)
    assert (good, bad) == ((largest, largest + 1) if largest < 256 else (256, None))
    assert [t["batch"] for t in tries] == calls and len(set(calls)) == len(calls)  # each batch tried once
    assert all(t["fits"] == (t["batch"] <= largest) for t in tries)
    assert len(calls) <= 2 * 8 + 1  # log2(256) doublings or halvings, then as many bisections


def test_largest_batch_refuses_a_start_outside_the_limit():
    with pytest.raises(ValueError, match="the first batch to try, 8, must be between 1 and the limit 4"):
        bt.largest_batch(lambda b: True, 8, 4)


def test_fits_catches_out_of_memory_only():
    def run(error):
        def step(batch):
            raise error
        return step

    assert bt.fits(lambda b: None, 4)
    assert not bt.fits(run(torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")), 4)
    assert not bt.fits(run(RuntimeError("CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling cublasCreate")), 4)
    with pytest.raises(RuntimeError, match="shape mismatch"):
        bt.fits(run(RuntimeError("shape mismatch")), 4)
    with pytest.raises(KeyError):
        bt.fits(run(KeyError("x")), 4)


# ------------------------------------------------------------------------------------------ a tiny shape, end to end
@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """WORK/tiny/{model, data.jsonl, base}: the bench's inputs and bf16 base checkpoint for the TINY shape."""
    work = str(tmp_path_factory.mktemp("bench_train"))
    common.MODELS["tiny"] = TINY
    try:
        model_dir, data = bt.write_inputs(work, "tiny", 4 * BATCH * SEQ * STEPS, (20, 100))
        base = os.path.join(work, "tiny", "base")
        bt.write_base(model_dir, base, "cpu")  # what `--worker base` runs (ensure_base's child)
        args = bt.parse_args(["--out", work, "--lora", "--runs", f"tiny:{BATCH}", "--seq", str(SEQ), "--steps",
                              str(STEPS), "--warmup", "0"])
        yield {"work": work, "base": base, "data": data, "args": args}
    finally:
        del common.MODELS["tiny"]


def test_the_base_is_bf16_and_reused(tiny, monkeypatch):
    from safetensors import safe_open

    with safe_open(os.path.join(tiny["base"], "model.safetensors"), "pt") as f:
        assert {f.get_slice(k).get_dtype() for k in f.keys()} == {"BF16"}
    assert os.path.isfile(os.path.join(tiny["base"], "tokenizer.json"))

    def no_child(*a, **k):
        raise AssertionError("the base was written again")

    monkeypatch.setattr(bt.subprocess, "run", no_child)
    assert bt.ensure_base(tiny["work"], "tiny", 60) == tiny["base"]


def test_cli_lora_run_on_the_base_and_the_in_process_step_agree(tiny, reference_kernels):
    """The CLI as the bench runs it (no --from-scratch: the base is loaded), then LigermodelsTries on the same
    flags: its steps are the loop's (the same losses), and an out-of-memory try is survived."""
    args, base, data = tiny["args"], tiny["base"], tiny["data"]
    cmd = bt.train_command(args, "ligermodels-lora", base, data, BATCH, "o")
    assert "--from-scratch" not in cmd and cmd[cmd.index("--lora-targets") + 1] == "q,k,v,o,gate,up,down"
    row = bt.run_ligermodels(args, "ligermodels-lora", base, data, BATCH, os.path.join(tiny["work"], "cli"), False)
    assert "error" not in row, row.get("error")
    assert len(row["losses"]) == STEPS
    assert os.path.isfile(os.path.join(tiny["work"], "cli", "final", "adapter_model.safetensors"))

    tries = bt.LigermodelsTries(args, base, data)
    try:
        tries(BATCH)
        assert tries.losses == pytest.approx(row["losses"], rel=1e-5, abs=1e-5)

        def too_big(_module, inputs):
            if inputs[0].shape[0] > 3:
                raise torch.OutOfMemoryError("CUDA out of memory (fake)")

        hook = tries.model.embed.register_forward_pre_hook(too_big)
        good, bad, _ = bt.largest_batch(lambda b: bt.fits(tries, b), 1, 8)
        hook.remove()
        assert (good, bad) == (3, 4)
        assert all(p.grad is None for p in tries.model.parameters())  # the failed tries left no gradients
    finally:
        tries.close()


def test_qlora_tries_build_the_4bit_base_and_train_its_adapters(tiny, reference_kernels):
    """``ligermodels-qlora``'s --max-batch tries: the CLI flags with ``--quantize nf4`` (``--cuda-graph`` for the
    graph impl), the model built as the trainer builds it (NF4 projections, fp32 adapters), steps that train."""
    from kernels.nf4 import NF4Tensor

    args, base, data = tiny["args"], tiny["base"], tiny["data"]
    cmd = bt.train_command(args, "ligermodels-qlora-graph", base, data, BATCH, "o")
    assert cmd[cmd.index("--quantize") + 1] == "nf4" and "--cuda-graph" in cmd and "--lora-rank" in cmd
    tries = bt.LigermodelsTries(args, base, data, "ligermodels-qlora")
    try:
        assert isinstance(tries.model.layers[0].mlp.down.weight, NF4Tensor)
        adapters = sum(p.numel() for p in tries.model.parameters() if p.requires_grad)
        assert {p.dtype for p in tries.model.parameters() if p.requires_grad} == {torch.float32}
        tries(BATCH)
        assert len(tries.losses) == bt.MAX_BATCH_STEPS and all(math.isfinite(x) for x in tries.losses)
    finally:
        tries.close()
    if importlib.util.find_spec("bitsandbytes"):  # their side: the same adapters on a bitsandbytes 4-bit base
        theirs = bt.peft_model(base, "cpu", four_bit=True)
        kinds = {type(m).__name__ for m in theirs.modules()}
        assert "Linear4bit" in kinds and sum(p.numel() for p in theirs.parameters() if p.requires_grad) == adapters


def test_peft_model_and_trainer_on_the_same_base(tiny, reference_kernels):
    """The hf+peft impls' model: bf16 frozen base, fp32 adapters as many as ours; its first loss on row 0..B-1
    is ours (B zero: the base's loss, with attention within documents from the position ids); the Trainer
    tries go on after an out-of-memory one."""
    from ligermodels import AutoLigerModel
    from ligermodels.lora import add_lora, trainable_parameters
    from ligermodels.model import document_ids_from_positions

    args, base = tiny["args"], tiny["base"]
    args.model_dir, args.data = base, tiny["data"]
    run = bt.hf_tries(args, "hf+peft", device="cpu")
    model = run.model
    assert {(p.dtype, p.requires_grad) for p in model.parameters()} == {(torch.bfloat16, False),
                                                                        (torch.float32, True)}
    ours = AutoLigerModel.from_hf(base, dtype=torch.float32)
    add_lora(ours, r=bt.LORA["rank"], alpha=bt.LORA["alpha"], targets=bt.LORA["targets"])
    assert sum(p.numel() for p in model.parameters() if p.requires_grad) == \
        sum(p.numel() for p in trainable_parameters(ours))

    fp32 = bt.peft_model(base, "cpu", torch.float32)
    ids, labels, positions = bt.packed_rows(base, tiny["data"], SEQ).rows(0, BATCH)
    with torch.no_grad():
        theirs = fp32(input_ids=ids, labels=labels, position_ids=positions).loss
        mine = ours.loss(ids, labels, position_ids=positions, document_ids=document_ids_from_positions(positions))
    assert theirs.item() == pytest.approx(mine.item(), rel=1e-5)

    def too_big(_module, _args, kwargs):
        if kwargs["input_ids"].shape[0] > 1:
            raise torch.OutOfMemoryError("CUDA out of memory (fake)")

    hook = model.register_forward_pre_hook(too_big, with_kwargs=True)
    good, bad, _ = bt.largest_batch(lambda b: bt.fits(run, b), 1, 4)
    hook.remove()
    assert (good, bad) == (1, 2)


# ------------------------------------------------------------------------------------------ the report's tables
def test_report_renders_the_lora_runs(tmp_path, monkeypatch):
    """Rows, checks and max-batch entries of two files: the newer one's shapes and searches win."""
    from benchmarks import report

    env = {"gpu": "NVIDIA H100 80GB HBM3", "torch": "2.11", "triton": "3.6", "transformers": "5.17"}
    args = bt.parse_args(["--out", "o", "--lora", "--runs", "qwen2-7b:4", "--steps", "16"])
    settings = bt.lora_settings(args, 200, 3000)
    rows = [_row("ligermodels-lora", 13000.0, 40.0), _row("hf+peft+liger", 9000.0, 50.0),
            {**_row("hf+peft+compile", 0, 0), "error": "CUDA out of memory", "oom": True}]
    fit = {"impl": "ligermodels-lora", "model": "m", "seq": 2048, "ac": "none", "steps_per_try": 2, "max_batch": 6,
           "first_oom_batch": 7}
    old = bt.merge_lora_results({}, [{**r, "tokens_per_s": 1.0} for r in rows[:2]], [{**fit, "max_batch": 1}],
                                settings, "x")
    new = bt.merge_lora_results({}, rows, [fit], settings, "x")
    for name, payload in (("lora-H100-2026-12-01.json", old), ("lora-H100-2026-12-02.json", new)):
        date = name[-15:-5]
        (tmp_path / name).write_text(json.dumps({**env, "date": date, **payload}))
    monkeypatch.setattr(report, "RESULTS", str(tmp_path))
    runs = report._lora_runs()
    assert [r["date"] for r in runs] == ["2026-12-02"]  # the older file's shape and search are superseded
    text = report.lora_table(runs)
    assert "| m | 4 | `python -m ligermodels.train --lora-rank ...` | 13,000 | 40.0 |" in text
    assert "| m | 4 | Trainer + PEFT + torch.compile | out of memory | |" in text
    assert "| m:b4 | 1.444 holds | 0.800 **misses** |" in text
    assert "m ligermodels (the trainer's model, optimiser and step, in-process) 6 (7 ran out of memory)." in text
    assert "--lora-rank 16 --lora-alpha 32" in text and "lr 0.0001 constant" in text


def test_report_keeps_a_shapes_comparison_and_lists_newer_runs_without_a_trainer_apart(tmp_path, monkeypatch):
    """A newer file that ran ligermodels.train alone at a shape does not replace the older file's comparison
    with the Trainer there: its rows go to the table of runs without a Trainer, with the same run's cost of
    attending within documents and the ratio to the comparison's fastest Trainer."""
    from benchmarks import report

    env = {"gpu": "NVIDIA H100 80GB HBM3", "torch": "2.11", "triton": "3.6", "transformers": "5.17"}
    settings = {"seq": 2048, "steps": 16, "warmup_steps_dropped": 5, "ac": "none", "doc_words": [200, 3000],
                "lr": 1e-5, "lr_schedule": "constant", "precision": "fp32 master weights, bf16 compute",
                "grad_clip": 1.0}

    def row(impl, tps, model="m", batch=4):
        return {"impl": impl, "model": model, "batch": batch, "seq": 2048, "ac": "none", "tokens_per_s": tps,
                "peak_mem_gb": 30.0}

    full = [row("ligermodels", 100.0), row("hf+liger", 60.0), row("hf+compile", 80.0)]
    alone = [row("ligermodels", 110.0), row("ligermodels-causal", 121.0), row("ligermodels", 50.0, model="n")]
    for name, rows in (("train-H100-2026-12-01a.json", full), ("train-H100-2026-12-02b.json", alone)):
        payload = {**env, "date": name[10:20], "settings": settings, "targets": bt.TARGETS,
                   "checks": {}, "rows": rows}
        (tmp_path / name).write_text(json.dumps(payload))
    monkeypatch.setattr(report, "RESULTS", str(tmp_path))
    compared = report._train_runs()
    assert [(r["impl"], r["tokens_per_s"]) for d in compared for r in d["rows"]] == \
        [("ligermodels", 100.0), ("hf+liger", 60.0), ("hf+compile", 80.0)]
    alone_runs = report._loop_only_runs()
    assert [(r["model"], r["impl"]) for d in alone_runs for r in d["rows"]] == \
        [("m", "ligermodels"), ("m", "ligermodels-causal"), ("n", "ligermodels")]
    text = report.loop_only_table(alone_runs, compared)
    assert "| H100 80GB HBM3 | m | 4 | `python -m ligermodels.train` | none | 110 | 30.0 | 1.375 (hf+compile) |" in text
    assert "| H100 80GB HBM3 | m | 4 | cost of attending within documents (same run) | | 0.100 | | |" in text
    assert "| H100 80GB HBM3 | n | 4 | `python -m ligermodels.train` | none | 50 | 30.0 | - |" in text


def test_report_keeps_a_lora_comparison_when_a_newer_file_ran_ours_alone(tmp_path, monkeypatch):
    """As for full training: a newer LoRA file without Trainer + PEFT rows (ours eagerly and with --cuda-graph)
    leaves the older comparison in the LoRA table and lists its rows apart, named as LoRA runs."""
    from benchmarks import report

    env = {"gpu": "NVIDIA H100 80GB HBM3", "torch": "2.11", "triton": "3.6", "transformers": "5.17"}
    args = bt.parse_args(["--out", "o", "--lora", "--runs", "qwen2-7b:4", "--steps", "16"])
    settings = bt.lora_settings(args, 200, 3000)
    compared = [_row("ligermodels-lora", 13000.0, 40.0), _row("hf+peft+compile", 10000.0, 60.0)]
    alone = [_row("ligermodels-lora", 13500.0, 40.0), _row("ligermodels-lora-graph", 13400.0, 40.1)]
    for name, rows in (("lora-H100-2026-12-01.json", compared), ("lora-H100-2026-12-02.json", alone)):
        payload = {**env, "date": name[-15:-5], **bt.merge_lora_results({}, rows, [], settings, "x")}
        (tmp_path / name).write_text(json.dumps(payload))
    monkeypatch.setattr(report, "RESULTS", str(tmp_path))
    runs = report._lora_runs()
    assert [(r["impl"], r["tokens_per_s"]) for d in runs for r in d["rows"]] == \
        [("ligermodels-lora", 13000.0), ("hf+peft+compile", 10000.0)]
    text = report.loop_only_table(report._alone_runs("lora", report._LORA_COMPARISON_IMPLS), runs, lora=True)
    assert "**ligermodels.train --lora-rank alone**" in text
    lora = "`python -m ligermodels.train --lora-rank ...`"
    assert f"| H100 80GB HBM3 | m | 4 | {lora} | none | 13,500 | 40.0 | 1.350 (hf+peft+compile) |" in text
    graph = "the same, `--cuda-graph`"
    assert f"| H100 80GB HBM3 | m | 4 | {graph} | none | 13,400 | 40.1 | 1.340 (hf+peft+compile) |" in text


def test_ac_choices_are_the_trainers_modes():
    """bench_train keeps ligermodels out of its Trainer workers' imports, so its --ac choices are written out: the
    same as ligermodels.train's: each of them accepted, an unknown one refused."""
    from ligermodels.train.config import AC_MODES

    for mode in AC_MODES:
        assert bt.parse_args(["--out", "o", "--ac", mode]).ac == mode
    with pytest.raises(SystemExit):
        bt.parse_args(["--out", "o", "--ac", "partial"])
