"""The performance tables of docs/performance.md and the README's headline table, generated from the JSON under
benchmarks/results/ (never typed by hand).

    python -m benchmarks.report            # rewrite every generated block
    python -m benchmarks.report --check    # exit 1 when a committed file differs from what it would write
    python -m benchmarks.report --print    # print the blocks instead

A block sits between ``<!-- report:NAME -->`` and ``<!-- /report:NAME -->`` in the files of :data:`TARGETS`.
Every table names the results files it reads, with the command, the machine and the commit each records.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import re
import sys
from collections import defaultdict

from benchmarks.bench_scale import one_gpu_run
from benchmarks.common import MODELS, RESULTS, ROOT, GPUClocks, newest_results

#: The generated blocks each file holds (paths relative to the repository root).
TARGETS = {
    "README.md": ("headline",),
    "docs/performance.md": ("summary", "training", "lora", "step", "scale", "attention", "kernels", "flce",
                            "linear", "decode"),
    "docs/preference.md": ("preference", "dpo_head"),
    "docs/moe.md": ("moe",),
    "docs/fp8.md": ("fp8",),
    "docs/qlora.md": ("qlora",),
    "docs/kernels.md": ("adamw_step",),
}
#: Display names of the benchmark shapes (public configs, benchmarks/common.py MODELS).
MODEL_NAMES = {"llama-1b": "Llama-3.2-1B", "llama-3.1-8b": "Llama-3.1-8B",
               "qwen2-1.5b": "Qwen2-1.5B", "qwen2-7b": "Qwen2-7B",
               "qwen3-1.7b": "Qwen3-1.7B", "gemma-2b": "Gemma-2B", "gemma2-2b": "Gemma-2-2B",
               "qwen3-30b-a3b-l4": "Qwen3-30B-A3B (4 of 48 layers)", "mixtral-8x7b-l2": "Mixtral-8x7B (2 of 32 layers)",
               "qwen3-30b-a3b": "Qwen3-30B-A3B"}


def _latest(prefix: str) -> dict | None:
    path = newest_results(prefix, results=RESULTS)
    if path is None:
        return None
    with open(path) as f:
        data = json.load(f)
    data["_file"] = os.path.relpath(path, ROOT)
    return data


def _files(prefix: str) -> list[dict]:
    """Every ``<prefix>-*.json`` under RESULTS (with its path as ``_file``), newest first: by the date it
    records, then by file name."""
    runs = []
    for f in glob.glob(os.path.join(RESULTS, f"{prefix}-*.json")):
        with open(f) as fh:
            data = json.load(fh)
        data["_file"] = os.path.relpath(f, ROOT)
        runs.append(data)
    return sorted(runs, key=lambda d: (d.get("date", ""), d["_file"]), reverse=True)


# ------------------------------------------------------------------------------------------ provenance
def _commit(c: str | None) -> str:
    """A recorded commit as shown: 7 hex digits (and ``+dirty``), or what the file says when it is not a hash."""
    if not c:
        return "not recorded"
    head, plus = (c[:-6], "+dirty") if c.endswith("+dirty") else (c, "")
    return (head[:7] if re.fullmatch(r"[0-9a-f]{8,40}", head) else head) + plus


def _versions(d: dict) -> str:
    extra = f", transformers {d['transformers']}" if "transformers" in d else ""
    h = d.get("host_cpu")
    if h:  # files written before the host was recorded have none
        launch = f", {h['launch_us']:.1f} us a small launch" if "launch_us" in h else ""
        extra += f"; host {h['cpu']}, {h['cpus']} CPUs{launch}"
    return f"torch {d['torch']}, triton {d['triton']}{extra}"


def _notes(d: dict) -> list[str]:
    notes = d.get("notes", [])
    return [notes] if isinstance(notes, str) else list(notes)


def _source(d: dict) -> str:
    """One results file: its path, command, machine, versions, commit and date, then its notes."""
    calls = d.get("invocations") or []
    if len(calls) > 1:  # a file that several invocations filled, one after another on one machine
        ran = "; ".join(f"`{c['command']}` at `{_commit(c['commit'])}`" for c in calls)
        line = (f"- `{d['_file']}`, {len(calls)} invocations, in order: {ran}; on {d['gpu']} ({_versions(d)}), "
                f"{d['date']}.")
    else:
        line = (f"- `{d['_file']}`: `{d.get('command', 'command not recorded')}` on {d['gpu']} ({_versions(d)}), "
                f"commit `{_commit(d.get('commit'))}`, {d['date']}.")
    return " ".join([line, *_notes(d)])


def _sources(runs: list[dict]) -> list[str]:
    return ["", "Sources:", "", *[_source(d) for d in runs]]


def _short_gpu(gpu: str) -> str:
    return gpu.replace("NVIDIA ", "").replace(" HBM3", "")


def _name(model: str) -> str:
    return MODEL_NAMES.get(model, model)


# ------------------------------------------------------------------------------------------ training
_COMPARISON_IMPLS = ("hf", "hf+liger", "hf+compile")
_LORA_COMPARISON_IMPLS = ("hf+peft+liger", "hf+peft+compile", "hf+peft")
_TRAIN_IMPLS = {"ligermodels": "`python -m ligermodels.train`", "ligermodels-causal": "the same, `--attention causal`",
                "ligermodels-tokens": "the same, `--loss-strategy tokens`",
                "ligermodels-vocab": "the same, `--loss-strategy vocab`",
                "ligermodels-graph": "the same, `--cuda-graph`",
                "bare": "bare step (bench_e2e, same precision)", "hf+liger": "Trainer + Liger-Kernel",
                "hf+compile": "Trainer + torch.compile", "hf": "Trainer"}
_LORA_IMPLS = {"ligermodels-lora": "`python -m ligermodels.train --lora-rank ...`",
               "ligermodels-lora-graph": "the same, `--cuda-graph`",
               "hf+peft+liger": "Trainer + PEFT + Liger-Kernel", "hf+peft+compile": "Trainer + PEFT + torch.compile",
               "hf+peft": "Trainer + PEFT", "ligermodels-lora-fp8": "the same, `--fp8 rowwise` (frozen base in FP8)"}


def _shape(r: dict) -> tuple:
    return r["model"], r["batch"], r.get("ac", "none")


def _compared_runs(prefix: str, comparison: tuple[str, ...]) -> list[dict]:
    """``<prefix>-*.json`` (benchmarks/bench_train.py), newest first, each keeping the shapes of its GPU that no
    newer file of that GPU compared: a file counts for a shape only where it ran one of the ``comparison``
    implementations (a transformers Trainer) beside ligermodels.train in the same run; its rows of other shapes
    are left to :func:`_alone_runs`."""
    seen: set = set()
    out = []
    for data in _files(prefix):
        gpu = data.get("gpu")
        compared = {(gpu, *_shape(r)) for r in data.get("rows", []) if r["impl"] in comparison}
        rows = [r for r in data.get("rows", []) if (gpu, *_shape(r)) in compared - seen]
        seen |= compared
        if rows:
            out.append({**data, "rows": rows})
    return out


def _alone_runs(prefix: str, comparison: tuple[str, ...]) -> list[dict]:
    """Rows of ``<prefix>-*.json`` files that ran ligermodels.train at a shape without a Trainer beside it (no
    comparison of their own): the newest row of each shape and implementation, newest file first."""
    seen: set = set()
    out = []
    for data in _files(prefix):
        compared = {_shape(r) for r in data.get("rows", []) if r["impl"] in comparison}
        rows = [r for r in data.get("rows", []) if _shape(r) not in compared and (*_shape(r), r["impl"]) not in seen]
        seen |= {(*_shape(r), r["impl"]) for r in rows}
        if rows:
            out.append({**data, "rows": rows})
    return out


def _train_runs() -> list[dict]:
    return _compared_runs("train", _COMPARISON_IMPLS)


def _loop_only_runs() -> list[dict]:
    return _alone_runs("train", _COMPARISON_IMPLS)


def _lora_runs() -> list[dict]:
    """``lora-*.json`` (benchmarks/bench_train.py --lora), newest first: the shapes each file compared with a
    Trainer + PEFT that no newer file compared (:func:`_compared_runs`), and the max-batch searches (impl,
    model, seq, activation checkpointing) no newer file made; files left with neither are dropped."""
    compared = {d["_file"]: d["rows"] for d in _compared_runs("lora", _LORA_COMPARISON_IMPLS)}
    seen_fits = set()
    out = []
    for data in _files("lora"):
        keys = {(f["impl"], f["model"], f["seq"], f.get("ac", "none")) for f in data.get("max_batch", [])}
        fits = [f for f in data.get("max_batch", []) if (f["impl"], f["model"], f["seq"], f.get("ac", "none"))
                not in seen_fits]
        seen_fits |= keys
        rows = compared.get(data["_file"], [])
        if rows or fits:
            out.append({**data, "rows": rows, "max_batch": fits})
    return out


def _groups(runs: list[dict]) -> list[list[dict]]:
    """Runs of one GPU together, each group's files by name (the order they ran in)."""
    groups: dict[str, list[dict]] = {}
    for d in runs:
        groups.setdefault(d.get("gpu") or "", []).append(d)
    return [sorted(groups[gpu], key=lambda d: d["_file"]) for gpu in sorted(groups)]


def _checks_table(runs: list[dict], names: dict[str, str], at_most: tuple[str, ...], goals: dict) -> list[str]:
    """The targets table of the shapes these runs show: one column per check in ``names`` (its target from
    ``goals``, an upper bound for the keys in ``at_most``), each cell the ratio and whether it holds."""
    heads = [f"{n} (target {'≤' if k in at_most else '≥'} {goals[k]})" for k, n in names.items()]
    lines = ["", "| shape | " + " | ".join(heads) + " |", "|---|" + "---|" * len(names)]
    for run in runs:
        for shape, checks in run["checks"].items():
            if not any(f"{r['model']}:b{r['batch']}" == shape for r in run["rows"]):
                continue
            cells = []
            for k in names:
                c = checks.get(k)
                value = None if c is None else c.get("ratio", c.get("fraction"))
                cells.append("-" if c is None else f"{value:.3f} {'holds' if c['holds'] else '**misses**'}")
            lines.append(f"| {shape} | " + " | ".join(cells) + " |")
    return lines


def train_table(runs: list[dict]) -> str:
    """What users run, on one GPU: the CLI against transformers.Trainer at each shape (its newest compared run),
    every run of the shape, then the targets of each shape."""
    d = runs[0]
    st = d["settings"]
    lines = [f"**{d['gpu']}.** `python -m ligermodels.train` against `transformers.Trainer` on the same packed rows "
             f"(documents of {st['doc_words'][0]}-{st['doc_words'][1]} words, attention within documents on both "
             f"sides), {st['precision']}, AdamW, clipping {st['grad_clip']}, seq {st['seq']}, random init, median of "
             f"steps {st['warmup_steps_dropped'] + 1}-{st['steps']}; each shape's runs one after the other on one "
             "machine. Peak memory is max allocated (GB = 1e9 B).", "",
             "| model | batch | run | tokens/s | peak memory (GB) |", "|---|---|---|---|---|"]
    for r in (r for run in runs for r in run["rows"]):
        attention = f" ({r['hf_attention']} attention)" if r.get("hf_attention") else ""
        head = f"| {r['model']} | {r['batch']} | {_TRAIN_IMPLS.get(r['impl'], r['impl'])}{attention} |"
        if "error" in r:
            lines.append(f"{head} {'out of memory' if r.get('oom') else 'failed'} | |")
        else:
            lines.append(f"{head} {r['tokens_per_s']:,.0f} | {r['peak_mem_gb']:.1f} |")
    names = {"speed_vs_fastest_hf": "speed vs fastest Trainer", "memory_vs_hf_liger": "memory vs Trainer + Liger",
             "speed_vs_bare": "speed vs bare step", "document_attention_cost": "cost of document attention"}
    return "\n".join(lines + _checks_table(runs, names, ("memory_vs_hf_liger", "document_attention_cost"),
                                            d["targets"]) + _sources(runs))


def lora_table(runs: list[dict]) -> str:
    """LoRA training (``lora-*.json``, runs of one GPU): the CLI with ``--lora-rank`` against
    ``transformers.Trainer`` + PEFT, the checks of each shape, and the largest micro-batch of each."""
    d = runs[0]
    measured = [run for run in runs if run["rows"]]
    lines = []
    if measured:
        st = measured[0]["settings"]
        lo = st["lora"]
        lines += [f"**{d['gpu']}.** `python -m ligermodels.train --lora-rank {lo['rank']} --lora-alpha "
                  f"{lo['alpha']:g}` against `transformers.Trainer` on `peft.get_peft_model(model, "
                  f"LoraConfig(r={lo['rank']}, lora_alpha={lo['alpha']:g}))`, adapters on {', '.join(lo['targets'])} "
                  f"(dropout {lo['dropout']:g}), every run loading the same base checkpoint ({st['base']}) and "
                  f"training on the same packed rows (documents of {st['doc_words'][0]}-{st['doc_words'][1]} words, "
                  f"attention within documents), {st['precision']}, lr {st['lr']:g} {st['lr_schedule']}, clipping "
                  f"{st['grad_clip']}, seq {st['seq']}, median of steps {st['warmup_steps_dropped'] + 1}-"
                  f"{st['steps']}; each shape's runs one after the other on one machine. Peak memory is max "
                  "allocated (GB = 1e9 B): ours over the whole process (loading included), the Trainer's from the "
                  "loaded model on.", "",
                  "| model | batch | run | tokens/s | peak memory (GB) |", "|---|---|---|---|---|"]
        for r in (r for run in measured for r in run["rows"]):
            head = f"| {r['model']} | {r['batch']} | {_LORA_IMPLS.get(r['impl'], r['impl'])} |"
            if "error" in r:
                lines.append(f"{head} {'out of memory' if r.get('oom') else 'failed'} | |")
            else:
                lines.append(f"{head} {r['tokens_per_s']:,.0f} | {r['peak_mem_gb']:.1f} |")
        names = {"speed_vs_fastest_peft": "speed vs faster Trainer + PEFT",
                 "memory_vs_peft_liger": "memory vs Trainer + PEFT + Liger"}
        goals = dict(measured[0]["targets"])
        if any("fp8_speed_vs_fastest_peft" in c for run in measured for c in run["checks"].values()):
            names["fp8_speed_vs_fastest_peft"] = "`--fp8 rowwise`: speed vs faster Trainer + PEFT"
            goals["fp8_speed_vs_fastest_peft"] = goals["speed_vs_fastest_peft"]
        lines += _checks_table(measured, names, ("memory_vs_peft_liger",), goals)
    fits = [f for run in runs for f in run.get("max_batch", [])]
    if fits:
        def found(f: dict) -> str:
            if "error" in f:
                return "failed"
            return f"{f['max_batch']}" + (f" ({f['first_oom_batch']} ran out of memory)" if f.get("first_oom_batch")
                                          else " (the largest tried)")

        names = {**_LORA_IMPLS, "ligermodels-lora": "ligermodels (the trainer's model, optimiser and step, in-process)"}
        sentence = (f"Largest LoRA micro-batch that runs {fits[0].get('steps_per_try', 2)} steps (seq "
                    f"{fits[0]['seq']}; doubling, then bisection to the exact boundary, in one process per "
                    "implementation; the compiled Trainer recompiling as dynamo does when the batch changes): "
                    + "; ".join(f"{f['model']} {names.get(f['impl'], f['impl'])} {found(f)}" for f in fits) + ".")
        lines += ["", sentence] if lines else [f"**{d['gpu']}.**", "", sentence]
    return "\n".join(lines + _sources(runs))


def loop_only_table(runs: list[dict], compared: list[dict], lora: bool = False) -> str:
    """ligermodels.train alone (:func:`_alone_runs`; ``lora``: of ``lora-*.json``): runs without a Trainer beside
    them, each shape's step cost of attending within documents from the same run, and, for orientation only, the
    ratio to the fastest Trainer of the comparison table at that shape (another run, so not a target check)."""
    names, comparison = (_LORA_IMPLS, _LORA_COMPARISON_IMPLS) if lora else (_TRAIN_IMPLS, _COMPARISON_IMPLS)
    trainers = {}
    for run in compared:
        for r in run["rows"]:
            if r["impl"] in comparison and "error" not in r:
                trainers.setdefault(_shape(r), []).append(r)
    what = "ligermodels.train --lora-rank" if lora else "ligermodels.train"
    lines = [f"**{what} alone**, at shapes or on commits without a Trainer run beside it: the last column is the "
             "ratio to the fastest Trainer of the comparison above (another run and machine: for orientation, not "
             "a target check).", "",
             "| GPU | model | batch | run | activation checkpointing | tokens/s | peak memory (GB) | "
             "vs fastest Trainer above |", "|---|---|---|---|---|---|---|---|"]
    for run in runs:
        by, gpu = {}, run["gpu"].replace("NVIDIA ", "")
        for r in run["rows"]:
            by.setdefault(_shape(r), {})[r["impl"]] = r
            hf = trainers.get(_shape(r), [])
            fastest = max(hf, key=lambda x: x["tokens_per_s"]) if hf else None
            ac = r.get("ac", run.get("settings", {}).get("ac", "none"))
            head = f"| {gpu} | {r['model']} | {r['batch']} | {names.get(r['impl'], r['impl'])} | {ac} |"
            if "error" in r:
                lines.append(f"{head} {'out of memory' if r.get('oom') else 'failed'} | | |")
                continue
            ratio = f"{r['tokens_per_s'] / fastest['tokens_per_s']:.3f} ({fastest['impl']})" if fastest else "-"
            lines.append(f"{head} {r['tokens_per_s']:,.0f} | {r['peak_mem_gb']:.1f} | {ratio} |")
        for shape, impls in by.items():
            if "ligermodels" in impls and "ligermodels-causal" in impls:
                cost = impls["ligermodels-causal"]["tokens_per_s"] / impls["ligermodels"]["tokens_per_s"] - 1
                lines.append(f"| {gpu} | {shape[0]} | {shape[1]} | cost of attending within documents (same run) "
                             f"| | {cost:.3f} | | |")
    return "\n".join(lines + _sources(runs))


def _cell(r: dict | None) -> str:
    if r is None:
        return "-"
    if "error" in r:
        return "out of memory" if r.get("oom") else "failed"
    return f"{r['tokens_per_s']:,.0f} tok/s, {r['peak_mem_gb']:.1f} GB"


def _headline_lora_runs() -> list[dict]:
    """The LoRA comparisons of the headline: dense shapes (LoRA on all seven projections; a mixture-of-experts
    shape's LoRA adapts the attention alone and is tabled in docs/moe.md)."""
    return [d for d in _of_kind(_lora_runs(), moe=False) if d["rows"]]


def headline_rows() -> list[str]:
    """The headline table: per GPU and shape, ours (full training, then LoRA) against the two accelerated
    Trainers, with the two ratios the checks record and the commit the row ran on."""
    lines = ["| model | GPU | batch × seq | training | ours: tokens/s | ours: peak GB | Trainer + Liger-Kernel "
             "| Trainer + torch.compile | speed vs faster Trainer | memory vs Trainer + Liger | commit |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    kinds = (("full", _train_runs(), "ligermodels", "hf+liger", "hf+compile", "speed_vs_fastest_hf",
              "memory_vs_hf_liger"),
             ("LoRA r16", _headline_lora_runs(), "ligermodels-lora", "hf+peft+liger",
              "hf+peft+compile", "speed_vs_fastest_peft", "memory_vs_peft_liger"))
    for kind, runs, ours, liger, comp, speed, memory in kinds:
        for group in _groups(runs):
            for d in group:
                by: dict[tuple, dict] = {}
                for r in d["rows"]:
                    by.setdefault((r["model"], r["batch"]), {})[r["impl"]] = r
                for (model, batch), impls in by.items():
                    if ours not in impls:
                        continue
                    me = impls[ours]
                    checks = d.get("checks", {}).get(f"{model}:b{batch}", {})
                    s, m = checks.get(speed), checks.get(memory)
                    s = f"{s['ratio']:.3f}x" if s else "-"
                    m = f"{m['ratio']:.3f}" if m else "-"
                    lines.append(
                        f"| {_name(model)} | {_short_gpu(d['gpu'])} | {batch} × {me['seq']} | {kind} | "
                        f"{me['tokens_per_s']:,.0f} | {me['peak_mem_gb']:.1f} | {_cell(impls.get(liger))} | "
                        f"{_cell(impls.get(comp))} | {s} | {m} | `{_commit(d.get('commit'))}` |")
    return lines


_HEADLINE_TEXT = (
    "Full training: `python -m ligermodels.train` (fp32 master weights, bf16 compute, AdamW, clipping 1.0) against "
    "`transformers.Trainer` with Liger-Kernel and with torch.compile. LoRA: `--lora-rank 16 --lora-alpha 32` on all "
    "seven projections of a frozen bf16 base against Trainer + PEFT with each. Every run of a row trains on the same "
    "packed rows (documents of 200-3000 words, attention within documents, random init) on the same machine, one "
    "after the other. tokens/s: median step after warm-up; peak: max allocated, GB = 1e9 B. Speed: ours / the faster "
    "Trainer; memory: ours / the Trainer with Liger-Kernel. Shapes: the public configs of the named models.")


def headline() -> str:
    return "\n".join(headline_rows() + ["", _HEADLINE_TEXT])


def summary() -> str:
    """The headline table with the files, commands and commits behind its rows."""
    runs = _train_runs() + _headline_lora_runs()
    files = sorted({d["_file"] for d in runs})
    by_file = {d["_file"]: d for d in runs}
    sources = [f"- `{f}`: `{by_file[f].get('command', 'command not recorded')}` on {by_file[f]['gpu']}, commit "
               f"`{_commit(by_file[f].get('commit'))}`." for f in files]
    return "\n".join(headline_rows() + ["", _HEADLINE_TEXT, "", "Sources:", "", *sources])


def _moe_model(model: str) -> bool:
    d = MODELS.get(model, {})
    return bool(d.get("num_experts") or d.get("num_local_experts"))


def _of_kind(runs: list[dict], moe: bool) -> list[dict]:
    """The runs with only their rows (and ``--max-batch`` entries) of mixture-of-experts shapes (``moe``) or only
    the dense ones; runs left with neither dropped. The two kinds have different targets, so they are tabled
    apart."""
    out = []
    for d in runs:
        rows = [r for r in d["rows"] if _moe_model(r["model"]) == moe]
        fits = [f for f in d.get("max_batch", []) if _moe_model(f["model"]) == moe]
        if rows or fits:
            out.append({**d, "rows": rows, **({"max_batch": fits} if "max_batch" in d else {})})
    return out


def training() -> str:
    parts = [train_table(g) for g in _groups(_of_kind(_train_runs(), moe=False))]
    alone = _of_kind(_loop_only_runs(), moe=False)
    if alone:
        parts.append(loop_only_table(alone, _of_kind(_train_runs(), moe=False)))
    return "\n\n".join(parts) or "No results committed yet."


def lora() -> str:
    dense = _of_kind(_lora_runs(), moe=False)
    parts = [lora_table(g) for g in _groups(dense)]
    alone = _of_kind(_alone_runs("lora", _LORA_COMPARISON_IMPLS), moe=False)
    if alone:
        parts.append(loop_only_table(alone, dense, lora=True))
    return "\n\n".join(parts) or "No results committed yet."


# ------------------------------------------------------------------------------------------ the bare step
def _e2e_runs() -> list[dict]:
    """End-to-end runs to show: per GPU, each ``e2e-<gpu>-<date>.json`` newest first, keeping only the shapes
    (model, batch, activation checkpointing; or a model's max-batch search) that no newer file of that GPU
    measured. Each table is then one run's comparison; GPUs with the most rows first."""
    by_gpu: dict[str, list[dict]] = {}
    for data in _files("e2e"):
        by_gpu.setdefault(data.get("gpu", "?"), []).append(data)

    def shape(r):
        return (r["model"], "max" if r.get("max_batch") else r["batch"], r.get("activation_checkpointing", False))

    out = []
    for runs in by_gpu.values():
        seen: set = set()
        kept = []
        for data in runs:
            rows = [r for r in data["rows"] if shape(r) not in seen]
            seen |= {shape(r) for r in data["rows"]}
            if rows:
                kept.append({**data, "rows": rows})
        out.append(kept)
    return [d for kept in sorted(out, key=lambda k: -sum(len(d["rows"]) for d in k)) for d in kept]


def _e2e_variant(r: dict) -> str:
    """eager / compile, plus the loss-head strategy and the SDPA backend order when the run chose them, and a
    transformers baseline's attention when it is not SDPA (Gemma 2: eager, for its soft-capping)."""
    v = r.get("variant", "")
    v += f", loss head: {r['flce_strategy']}" if r.get("flce_strategy") else ""
    v += f", {r['hf_attention']} attention" if r.get("hf_attention") else ""
    return v + (f", attention: {r['sdpa_backends']}" if r.get("sdpa_backends") else "")


def e2e_table(d: dict) -> str:
    """One row per (model, batch, impl): tokens/s, MFU, peak memory, and ours against the baselines; then the
    largest batch each fits, where searched."""
    rows = [r for r in d["rows"] if not r.get("max_batch")]
    best = {}  # (model, batch, impl) -> the faster of eager / compiled
    for r in rows:
        k = (r["model"], r["batch"], r["impl"])
        if "tokens_per_s" in r and (k not in best or r["tokens_per_s"] > best[k]["tokens_per_s"]):
            best[k] = r
    lines = [f"**{d['gpu']}.**", ""]
    if rows:
        lines += ["| model | batch | impl | variant | tokens/s | MFU | peak memory (GB) | ours vs HF+Liger | "
                  "ours vs HF+compile |", "|---|---|---|---|---|---|---|---|---|"]
    order = {"ligermodels": 0, "hf+liger": 1, "hf+compile": 2, "hf": 3}
    for r in sorted(rows, key=lambda r: (r["model"], r["batch"], order.get(r["impl"], 9), _e2e_variant(r))):
        variant = _e2e_variant(r) + (" + full act. checkpointing" if r.get("activation_checkpointing") else "")
        head = f"| {r['model']} | {r['batch']} | {r['impl']} | {variant} |"
        if r.get("oom"):
            lines.append(f"{head} out of memory | | | | |")
            continue
        if "error" in r:
            lines.append(f"{head} error: {r['error'][:60]} | | | | |")
            continue
        mfu = f"{100 * r['mfu']:.1f}%" if r.get("mfu") is not None else "n/a"
        vs = []
        for base in ("hf+liger", "hf+compile"):
            b = best.get((r["model"], r["batch"], base))
            if r["impl"] == "ligermodels" and b:
                vs.append(f"{r['tokens_per_s'] / b['tokens_per_s']:.2f}x speed, "
                          f"{r['peak_mem_gb'] / b['peak_mem_gb']:.2f}x memory")
            else:
                vs.append("")
        lines.append(f"{head} {r['tokens_per_s']:,.0f} | {mfu} | {r['peak_mem_gb']:.1f} | {vs[0]} | {vs[1]} |")
    fits = [r for r in d["rows"] if r.get("max_batch")]
    if fits:
        lines += ["" if rows else None, "Largest batch that runs a step (seq 2048; doubling, then bisection until the "
                  "first batch that ran out of memory is within 1/8 above it): " + ", ".join(
                      f"{r['model']} {r['impl']} ({r.get('variant', '')}) {r['batch']}"
                      + (f" ({r['first_oom_batch']} ran out of memory)" if r.get("first_oom_batch") else "")
                      for r in fits) + "."]
    return "\n".join([x for x in lines if x is not None] + _sources([d]))


_STEP_TEXT = (
    "One training step of `benchmarks/bench_e2e.py` (forward + backward + fused AdamW, bf16 weights, seq 2048, "
    "median of timed steps), one process per implementation. MFU against 989 TFLOP/s; memory is peak allocated "
    "(GB = 1e9 B). The last two columns compare each ligermodels variant with the faster variant of HF + "
    "Liger-Kernel and of HF + torch.compile in the same run (speed: >1 is faster; memory: <1 is less).")


def step() -> str:
    runs = _e2e_runs()
    return "\n\n".join([_STEP_TEXT, *[e2e_table(d) for d in runs]]) if runs else "No results committed yet."


# ------------------------------------------------------------------------------------------ many GPUs
def _scale_label(r: dict) -> str:
    if r.get("role") == "split-check":
        accum = re.search(r"--grad-accum (\d+)", r.get("command", ""))
        return f"{r['label']} (split check{', --grad-accum ' + accum[1] if accum else ''})"
    return r["label"]


def scale_table(d: dict) -> str:
    """Many GPUs (``scale-*.json``, benchmarks/bench_scale.py): ligermodels.train against torchtitan under
    torchrun, per-GPU tokens/s, MFU and peak memory of each run, each run's per-GPU rate against its own one-GPU
    rate, and the targets (speed and memory against torchtitan + compile, scaling)."""
    st = d["settings"]
    titan = d.get("titan_packages", {}).get("torchtitan", "0.2.2")
    lines = [f"**{d['gpu']}, {d['model']}.** `torchrun -m ligermodels.train` against torchtitan {titan}, FSDP2 with "
             "bf16 compute and fp32 gradient reduction (bf16 in runs labelled `+reduce-bf16`), "
             f"{st['batch_size']} x {st['seq_len']} tokens per GPU a step ({st['attention']} attention), AdamW, "
             f"clipping 1.0, median of steps {st['warmup_steps_dropped'] + 1}-"
             f"{st['steps']}, the runs one after the other on one machine. MFU: the same flop count for both sides "
             "against 989 TFLOP/s. Peak memory of rank 0 (GB = 1e9 B): ours max allocated, torchtitan's max active "
             "bytes from its log.", "",
             "| AC | run | GPUs | tokens/s per GPU | MFU | peak memory (GB) | per GPU vs 1 GPU |",
             "|---|---|---|---|---|---|---|"]
    ok = [r for r in d["rows"] if "error" not in r and r.get("role") != "split-check"]
    for r in sorted(d["rows"], key=lambda r: (r["ac"], r["label"], r["gpus"], _scale_label(r))):
        head = f"| {r['ac']} | {_scale_label(r)} | {r['gpus']} |"
        if "error" in r:
            lines.append(f"{head} failed (see the JSON) | | | |")
            continue
        base = one_gpu_run(r, ok) if r["gpus"] > 1 else None
        scaling = f"{r['tokens_per_s_per_gpu'] / base['tokens_per_s_per_gpu']:.3f}" if base else "-"
        mfu = f"{100 * r['mfu']:.1f}%" if r.get("mfu") is not None else "-"
        lines.append(f"{head} {r['tokens_per_s_per_gpu']:,.0f} | {mfu} | {r['peak_mem_gb']:.1f} | {scaling} |")
    goals = d["targets"]
    checks = d.get("checks", {})
    versus = [(k, c) for k, c in checks.items() if "speed_vs_titan_compile" in c]
    if versus:
        lines += ["", f"| GPUs:AC | fastest of ours | against (AC) | speed (target ≥ "
                      f"{goals['speed_vs_titan_compile']}) | memory (target ≤ "
                      f"{goals['memory_vs_titan_compile']}) | both hold |", "|---|---|---|---|---|---|"]
        for k, c in versus:
            memory = "-" if c["memory_vs_titan_compile"] is None else f"{c['memory_vs_titan_compile']:.3f}"
            against = c.get("titan", f"titan+compile ({k.split(':')[1]})")
            lines.append(f"| {k} | {c['ours']} | {against} | {c['speed_vs_titan_compile']:.3f} | {memory} | "
                         f"{'holds' if c['holds'] else '**misses**'} |")
    scaling = [(k, n, v) for k, c in checks.items() for n, v in c.items() if n.startswith("scaling_")]
    if scaling:
        lines += ["", "Scaling, per-GPU tokens/s against the same run on 1 GPU (targets: "
                  + ", ".join(f"{n} GPUs ≥ {t}" for n, t in goals["scaling"].items()) + "): "
                  + "; ".join(f"{k} on {n.split('_')[1]} GPUs {v['ratio']:.3f}"
                              + ("" if v["holds"] is None else f" ({'holds' if v['holds'] else 'misses'})")
                              for k, n, v in scaling) + "."]
    return "\n".join(lines + _sources([d]))


def fsdp_table(d: dict) -> str:
    """The training loop under torchrun on 1 and N GPUs (weak scaling: the same batch per GPU)."""
    lines = [f"**{d['gpu']}.** Training loop (`ligermodels.train`, FSDP2), {d.get('model', '')}. Same micro-batch "
             "per GPU; MFU per GPU against 989 TFLOP/s; peak memory of rank 0.", "",
             "| GPUs | batch x seq per GPU | tokens/s total | tokens/s per GPU | scaling | MFU | peak memory (GB) |",
             "|---|---|---|---|---|---|---|"]
    for r in d["rows"]:
        mfu = f"{100 * r['mfu']:.1f}%" if r.get("mfu") is not None else "n/a"
        lines.append(f"| {r['nproc']} | {r['batch_size']} x {r['seq_len']} | {r['tokens_per_s_total']:,.0f} | "
                     f"{r['tokens_per_s_per_gpu']:,.0f} | {100 * r['scaling_efficiency']:.0f}% | {mfu} | "
                     f"{r['peak_mem_gb']:.1f} |")
    return "\n".join(lines + _sources([d]))


def scale() -> str:
    parts = [scale_table(d) for d in _files("scale")] + [fsdp_table(d) for d in _files("fsdp")]
    return "\n\n".join(parts) or "No results committed yet."


# ------------------------------------------------------------------------------------------ attention
def attention_table(files: list[dict]) -> str:
    """One layer's attention forward + backward within packed documents against causal over whole rows
    (``attention-*.json``, benchmarks/bench_attention.py), each shape's rows from its newest file."""
    seen, rows, used = set(), [], []
    for d in files:
        new = [r for r in d["rows"] if r["shape"] not in seen]
        seen |= {r["shape"] for r in d["rows"]}
        if new:
            rows += new
            used.append(d)
    lines = ["One layer's attention, forward + backward, kernel time, bf16, seq 2048, rows packed from documents of "
             "200-3000 tokens (`benchmarks/bench_attention.py`). Useful TFLOP/s count only the (query, key) pairs "
             "each computes (within documents: about 0.65 of whole rows), also as a share of the bf16 dense peak "
             "(989 TFLOP/s); the forward alone where measured; errors are against float64. A JSON after an "
             "implementation's name is the tile or option set it ran with.", "",
             "| shape | impl | ms | forward ms | useful TFLOP/s | of peak | output error | d(qkv) error |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if "ms" in r:  # the block-mask build
            lines.append(f"| {r['shape']} | {r['impl']} | {r['ms']:.3f} | | | | | |")
        elif "error" in r:
            lines.append(f"| {r['shape']} | {r['impl']} | failed: {r['error'][:80]} | | | | | |")
        else:
            fwd = f"{r['fwd_ms']:.3f}" if "fwd_ms" in r else ""
            lines.append(f"| {r['shape']} | {r['impl']} | {r['fwd_bwd_ms']:.3f} | {fwd} | {r['useful_tflops']:.0f} | "
                         f"{100 * r['useful_tflops'] / 989:.0f}% | {r.get('out_rel_err', float('nan')):.1e} | "
                         f"{r.get('dqkv_rel_err', float('nan')):.1e} |")
    return "\n".join(lines + _sources(used))


def attention() -> str:
    files = _files("attention")
    return attention_table(files) if files else "No results committed yet."


# ------------------------------------------------------------------------------------------ kernels
def kernels_table(d: dict) -> str:
    """Per op and pass: our GB/s and share of copy bandwidth, torch.compile's share, our speed relative
    to eager and torch.compile, and our wall time per call.

    Rows with ``timing: "cuda-kernels"`` carry kernel time in ``ms`` (host overhead excluded; see
    benchmarks/common.py) and wall time in ``wall_ms``; rows of older runs (no ``timing``) carry wall
    time in ``ms`` and are marked as such. Rows carried from an earlier run (``from_run``) name their own
    command and commit.
    """
    by = defaultdict(dict)  # (op, shape, pass) -> impl -> row
    for r in d["rows"]:
        if "error" not in r:
            by[(r["op"], r["shape"], r["pass"])][r["impl"]] = r
    agg = defaultdict(lambda: defaultdict(list))
    for (op, _shape, pas), impls in by.items():
        ours = impls.get("ligermodels")
        if not ours:
            continue
        a = agg[(op, pas)]
        kernel = ours.get("timing") == "cuda-kernels"
        a["timing"].append("kernel" if kernel else "wall")
        a["from_run"].append(ours.get("from_run") or d["date"])
        a["gbs"].append(ours["gbs"])
        a["bw"].append(ours["frac_copy_bw"])
        if "frac_same_size_copy" in ours:
            a["same"].append(ours["frac_same_size_copy"])
        a["wall"].append(ours["wall_ms"] if kernel else ours["ms"])
        if "compile" in impls:
            a["compile_bw"].append(impls["compile"]["frac_copy_bw"])
        for base in ("eager", "compile"):
            if base in impls and ours["ms"] > 0:
                a[base].append(impls[base]["ms"] / ours["ms"])
    wall_only = {k for k, a in agg.items() if "kernel" not in a["timing"]}
    all_wall = bool(agg) and len(wall_only) == len(agg)
    if all_wall:
        timing = ("Times are wall times (CUDA events around each call, the CPU launching every call: host "
                  "overhead included), so bandwidth and ratios understate the GPU work at small shapes.")
    else:
        timing = ("Times are kernel times: the summed GPU duration of each call's kernels, memcpys and memsets "
                  "after an L2 flush, host overhead excluded (what the op costs the GPU inside a training step, "
                  "where the CPU runs ahead); the last column is our wall time per call with the CPU launching "
                  "it (host overhead included).")
    lines = [f"Kernels, bf16, on {d['gpu']}. Copy bandwidth measured in the same run: {d['copy_gbs']:.0f} GB/s. "
             f"{timing} Bandwidth counts the fewest bytes each op must move; a same-size copy is a device copy "
             "moving those bytes, timed the same way (small copies do not reach the large-buffer bandwidth "
             "either; a kernel can pass 100% of either, since torch's copy kernel is itself below the "
             "hardware's limit, by more at small sizes); speed-ups are time ratios "
             "(>1: ours faster); min-max over the shapes in the JSON.", "",
             "| op | pass | ours, GB/s | ours, % of copy bandwidth | ours, % of a same-size copy "
             "| torch.compile, % of copy bandwidth | vs eager | vs torch.compile | ours, wall ms |",
             "|---|---|---|---|---|---|---|---|---|"]

    def rng(v, fmt):
        return "n/a" if not v else (fmt.format(min(v)) + ("" if len(v) == 1 else " - " + fmt.format(max(v))))

    for (op, pas), a in sorted(agg.items()):
        mark = " \\*" if (op, pas) in wall_only and not all_wall else ""
        lines.append(f"| {op}{mark} | {pas} | {rng(a['gbs'], '{:.0f}')} | {rng([100 * x for x in a['bw']], '{:.0f}%')} "
                     f"| {rng([100 * x for x in a['same']], '{:.0f}%')} "
                     f"| {rng([100 * x for x in a['compile_bw']], '{:.0f}%')} | {rng(a['eager'], '{:.2f}x')} "
                     f"| {rng(a['compile'], '{:.2f}x')} | {rng(a['wall'], '{:.3f}')} |")
    other = {k: impls for k, impls in sorted(by.items())
             if "ligermodels" in impls and set(impls) - {"ligermodels", "eager", "compile"}}
    if other:  # ops measured against other baselines (the optimiser step against torch's AdamW)
        lines += ["", "Against other baselines, kernel time and share of copy bandwidth: " + "; ".join(
            f"{op} {pas}, {shape}: " + ", ".join(f"{impl} {r['ms']:.2f} ms ({100 * r['frac_copy_bw']:.0f}%)"
                                                 for impl, r in impls.items())
            for (op, shape, pas), impls in other.items()) + "."]
    short = []  # the kernel targets, per shape: >= 80% of copy bandwidth, no slower than torch.compile
    for (op, shape, pas), impls in sorted(by.items()):
        ours, comp = impls.get("ligermodels"), impls.get("compile")
        if not ours or ours.get("timing") != "cuda-kernels":
            continue
        why = [f"{100 * ours['frac_copy_bw']:.1f}% of copy bandwidth"] if ours["frac_copy_bw"] < 0.8 else []
        if comp and comp["ms"] < ours["ms"]:
            why.append(f"{100 * (ours['ms'] / comp['ms'] - 1):.1f}% behind torch.compile "
                       f"({ours['ms'] * 1e3:.1f} vs {comp['ms'] * 1e3:.1f} us)")
        if why:
            short.append(f"{op} {pas} {shape}: {', '.join(why)}")
    if short:
        lines += ["", "Shapes short of the kernel targets (at least 80% of copy bandwidth, no slower than "
                  "torch.compile) in this file: " + "; ".join(short) + "."]
    if wall_only and not all_wall:
        runs = sorted({r for k in wall_only for r in agg[k]["from_run"]})
        lines += ["", f"\\* From an earlier run ({', '.join(runs)}) timed as wall time (host overhead included): "
                  "its GB/s and ratios are not comparable with the kernel-time rows."]
    carried = defaultdict(set)  # (from_run, command, commit) -> ops
    for r in d["rows"]:
        if r.get("from_run"):
            carried[(r["from_run"], r.get("command", "command not recorded"), r.get("commit"))].add(r["op"])
    if carried:
        lines += ["", "Rows carried from earlier runs: " + "; ".join(
            f"{', '.join(sorted(ops))}: `{command}`, {run}, commit `{_commit(commit)}`"
            for (run, command, commit), ops in sorted(carried.items(), key=lambda x: (x[0][0], x[0][2] or ""))) + "."]
    if "_file" in d:
        lines += _sources([d])
    return "\n".join(lines)


def adamw_step_table(d: dict) -> str:
    """The optimiser step of one-GPU full fine-tuning (bench_adamw_step): host and device time per implementation."""
    lines = [f"`clip_grad_norm_(1.0)` and `step()` of the optimiser as one-GPU full fine-tuning runs it (fp32 masters "
             f"beside bf16 weights, bf16 gradients) over {_name(d['model'])}'s {d['tensors']} parameter tensors "
             f"({d['params'] / 1e9:.2f}B parameters, {d['tensors_above_multi_tensor_size']} tensors above a million "
             f"elements), on {d['gpu']} (`benchmarks/bench_adamw_step.py`). Host: the median time to enqueue both "
             "while the GPU is still busy, so none of it waits for the device. Device: kernel time after an L2 flush, "
             f"and {d['bytes_per_param']} bytes a parameter against the copy bandwidth measured in the same run "
             f"({d['copy_gbs']} GB/s).", "",
             "| implementation | host ms | device ms | device launches | GB/s | of copy bandwidth |",
             "|---|---|---|---|---|---|"]
    for r in d["rows"]:
        lines.append(f"| {r['impl']} | {r['host_ms_median']:.2f} | {r['kernel_ms_median']:.2f} | "
                     f"{r['launches'][-1]:g} | {r['gbs']} | {100 * r['frac_copy_bw']:.0f}% |")
    return "\n".join(lines + _sources([d]))


def kernels() -> str:
    d = _latest("kernels")
    return kernels_table(d) if d else "No results committed yet."


def flce_table(d: dict) -> str:
    n, h = d.get("tokens", d.get("N")), d.get("hidden", d.get("H"))
    lines = [f"Fused linear cross-entropy, N={n} tokens, H={h}, bf16, forward + backward, on {d['gpu']}. Matmul "
             f"rate measured in the same run: {d.get('matmul_tflops', float('nan')):.0f} TFLOP/s; the floor is "
             "the three GEMMs (6·N·H·V flops) at that rate (the vocab strategy runs a fourth, so its own floor is "
             "4/3 of that). Peak extra memory: peak allocated during one forward+backward, minus the inputs and the "
             "gradients it returns. eager / compile: the logits materialised, in eager PyTorch and under "
             "torch.compile; liger: Liger-Kernel's fused linear cross-entropy (liger-fp32acc: with fp32 "
             "accumulation).", "",
             "| V | impl | ms | x floor | peak extra memory (GB) |", "|---|---|---|---|---|"]
    for r in d["rows"]:
        if "error" in r or "skipped" in r:
            lines.append(f"| {r.get('V')} | {r['impl']} | {r.get('error') or r.get('skipped')} | | |")
            continue
        lines.append(f"| {r['V']} | {r['impl']} | {r['ms']:.1f} | {r['ratio_to_floor']:.2f} | "
                     f"{r['peak_extra_gb']:.2f} |")
    split = [r for r in d["rows"] if "gemms_only_ms" in r]
    if split:
        lines += ["", "Of our time, cuBLAS alone running the same three GEMMs at our chunk shapes takes: " + "; ".join(
            f"V={r['V']} {r['gemms_only_ms']:.1f} ms ({r['gemms_only_ratio_to_floor']:.2f}x floor), the loss "
            f"kernel, casts and gaps the other {r['overhead_ms']:.1f} ms" for r in split) + "."]
    return "\n".join(lines + _sources([d]))


def linear_table(d: dict) -> str:
    """Projection GEMMs (bench_linear): one fused q/k/v or gate+up GEMM against one GEMM per part, per pass."""
    rows = {(r["model"], r["batch"], r["proj"], r["layout"], r["pass"]): r for r in d["rows"]}
    lines = [f"Projection GEMMs of one decoder layer (`benchmarks/bench_linear.py`), kernel time, on {d['gpu']}; "
             f"square bf16 matmul {d['matmul_tflops']:.0f} TFLOP/s. Fused: one GEMM over the (q+k+v) or "
             "(gate+up) weight, as ligermodels runs them; split: one GEMM per part, as transformers does.", "",
             "| model, batch | projection | fwd fused / split (ms) | input grad fused / split | "
             "weight grad fused / split |", "|---|---|---|---|---|"]
    for model, batch, proj, layout, pas in rows:
        if layout != "fused" or pas != "fwd" or (model, batch, proj, "split", "fwd") not in rows:
            continue
        cells = []
        for p in ("fwd", "dgrad", "wgrad"):
            f, s = rows[(model, batch, proj, "fused", p)], rows[(model, batch, proj, "split", p)]
            cells.append(f"{f['ms']:.3f} / {s['ms']:.3f} ({f['tflops']:.0f} / {s['tflops']:.0f} TFLOP/s)")
        lines.append(f"| {model}, {batch} x 2048 | {proj} | " + " | ".join(cells) + " |")
    return "\n".join(lines + _sources([d]))


def decode_table(d: dict) -> str:
    """bench_decode's rows: decode tokens/s, time a step, and the ratio to transformers' compiled static-cache
    generate of the same batch in the same file (one machine)."""
    hf = {r["batch"]: r["tokens_per_s"] for r in d["rows"]
          if r["impl"] == "transformers-static" and "tokens_per_s" in r}
    lines = [f"Greedy decoding, on {d['gpu']}.", "", "| impl | batch | tokens/s | ms a step | vs transformers-static |",
             "|---|---|---|---|---|"]
    for r in d["rows"]:
        if "tokens_per_s" not in r:
            lines.append(f"| {r['impl']} | {r['batch']} | {r.get('error', '')} | - | - |")
            continue
        ratio = f"{r['tokens_per_s'] / hf[r['batch']]:.2f}x" if r["batch"] in hf else "-"
        lines.append(f"| {r['impl']} | {r['batch']} | {r['tokens_per_s']:,.0f} | {r['ms_per_step']:.2f} | {ratio} |")
    return "\n".join(lines + _sources([d]))


def _all(prefix: str, table) -> str:
    """Every ``<prefix>-*.json`` file's table, newest first (each file one machine's comparisons)."""
    files = _files(prefix)
    return "\n\n".join(table(d) for d in files) if files else "No results committed yet."


def _newest(prefix: str, table) -> str:
    d = _latest(prefix)
    return table(d) if d else "No results committed yet."


# ------------------------------------------------------------------------------------------ preference tuning
_PREFERENCE_IMPLS = {"ligermodels": "`python -m ligermodels.train --objective ...`",
                     "ligermodels-graph": "the same, `--cuda-graph`",
                     "ligermodels-prompt-twice": "the same, `--prompt-pass twice`",
                     "ligermodels-graph-prompt-twice": "the same, `--cuda-graph --prompt-pass twice`", "trl": "TRL",
                     "trl+liger": "TRL, `use_liger_kernel=True`", "trl+compile": "TRL, `torch_compile=True`"}


def preference_table(d: dict) -> str:
    """bench_preference's rows: one table a (model, objective), rows by reference mode, activation checkpointing and
    implementation; the target checks; each row's own command and commit (a file merges several calls)."""
    s = d["settings"]
    lines = [f"On {d['gpu']} ({_versions(d)}), {s['batch']} pairs a micro-batch of {s['prompt_words']}-word prompts "
             f"and {s['completion_words']}-word chosen and rejected completions, {s['steps']} steps (median of the "
             f"last {s['steps'] - s['warmup']}), fp32 master weights, bf16 compute.", ""]
    for model, objective, rank in sorted({(r["model"], r["objective"], r.get("lora_rank", 0)) for r in d["rows"]}):
        lora = (f", LoRA rank {rank} on the seven projections of a bf16 base (TRL: + PEFT; the reference: the base "
                "with the adapters off)") if rank else ""
        rows = [r for r in d["rows"] if (r["model"], r["objective"], r.get("lora_rank", 0)) == (model, objective, rank)]
        clocks = any(r.get("gpu_clocks") for r in rows)
        lines += [f"**{_name(model)}, {objective.upper()}{lora}**", "",
                  "| reference | activation checkpointing | implementation | tokens/s | peak memory (GB) |"
                  + (" SM clock, median (power-capped samples) |" if clocks else ""),
                  "|---|---|---|---|---|" + ("---|" if clocks else "")]
        for r in sorted(rows, key=lambda r: (r["reference"], r["ac"], list(_PREFERENCE_IMPLS).index(r["impl"]))):
            failed = "error" in r
            speed = "failed: " + r["error"].strip().splitlines()[-1] if failed else f"{r['tokens_per_s']:,.0f}"
            memory = f"{r['peak_mem_gb']:.1f}" if "error" not in r else ""
            reference = ("none" if objective not in ("dpo", "kto") else
                         "a forward every step" if r["reference"] == "model" else "precomputed")
            c = r.get("gpu_clocks")
            clock = f" {c['sm_clock_mhz_median']:.0f} MHz ({100 * c['power_capped']:.0f}%) |" if c else " |"
            clock = clock if clocks else ""
            lines.append(f"| {reference} | {r['ac']} | {_PREFERENCE_IMPLS[r['impl']]} | {speed} | {memory} |{clock}")
        lines.append("")
    sampled = next((r["gpu_clocks"] for r in d["rows"] if r.get("gpu_clocks")), None)
    if sampled:
        lines += [f"SM clock: the median of `nvidia-smi`'s samples every {sampled['period_ms']} ms while the GPU drew "
                  f"more than {GPUClocks().busy_w:.0f} W (`--gpu-clocks`), against its "
                  f"{sampled['sm_clock_mhz_max']:,.0f} MHz maximum; in brackets, the share of those samples held "
                  f"down by the software power cap ({sampled['power_limit_w']:.0f} W on the "
                  f"{d['gpu'].removeprefix('NVIDIA ')}).", ""]
    targets = [f"- {setting}, {name}: {c['ratio']} ({'holds' if c['holds'] else 'does not hold'}"
               + (f"; fastest {c['fastest']}" if "fastest" in c else "") + ")"
               for setting, checks in sorted(d["checks"].items()) for name, c in checks.items()]
    lines += ["Targets (ours / the fastest TRL variant run, at least 1.3; ours / TRL + Liger-Kernel's memory, at most "
              "0.7), per setting:", "", *(targets or ["- none: no TRL run finished beside ours here"])]
    lines += ["", "Sources:", "", f"- `{d['_file']}`, commit and command per row:"]
    for r in d["rows"]:
        lines.append(f"  - {r['impl']}, {r['objective']}, {r['reference']}, ac {r['ac']}: `{r['command']}` at "
                     f"`{_commit(r['commit'])}`")
    return "\n".join(lines)


def dpo_head_table(d: dict) -> str:
    """bench_dpo_head: the DPO loss head alone, ours against LigerFusedLinearDPOLoss, per output head."""
    st = d["settings"]
    lines = [f"The DPO loss head alone on {d['gpu']}, {st['dtype']}: {st['pairs']} pairs of {st['prompt_tokens']} "
             f"prompt + {st['completion_tokens']} completion tokens, policy log-probs with gradients, reference "
             f"log-probs without, sigmoid DPO (beta {st['beta']}); forward + backward. Wall time with the host; GPU "
             "time of the same call; peak memory beyond the inputs and the gradient buffers (GB = 1e9 B).", "",
             "| head (V x H) | implementation | loss | wall ms | GPU ms | peak extra GB |", "|---|---|---|---|---|---|"]
    names = {"ligermodels": "ligermodels (`fused_linear_logprob_loss` + `dpo_terms`: the trainer's)",
             "ligermodels-per-token": "ligermodels (`fused_linear_logprobs` + `dpo_terms`)",
             "liger-kernel": f"Liger-Kernel {d.get('liger_kernel') or ''} `LigerFusedLinearDPOLoss`".replace("  ", " ")}
    for r in d["rows"]:
        head = f"{_name(r['head'])} ({r.get('vocab', '?')} x {r.get('hidden', '?')})"
        if "error" in r:
            lines.append(f"| {head} | {names.get(r['impl'], r['impl'])} | failed | | | |")
        else:
            lines.append(f"| {head} | {names.get(r['impl'], r['impl'])} | {r['loss']:.4f} | {r['ms']:.1f} | "
                         f"{r['kernel_ms']:.1f} | {r['peak_extra_gb']:.2f} |")
    return "\n".join(lines + _sources([d]))


# ------------------------------------------------------------------------------------------ FP8
_FP8_MODES = {"bf16": "bf16", "rowwise": "`--fp8 rowwise`", "rowwise-e5m2": "`--fp8 rowwise-e5m2`",
              "rowwise-gw-bf16": "`--fp8 rowwise-gw-bf16`"}


def _fp8_speed(d: dict) -> list[str]:
    sp = d["speed"]
    lines = [f"**{sp['shape']}, micro-batch {sp['batch']} x {sp['seq']} tokens, activation checkpointing "
             f"{sp['ac']}** ({_short_gpu(d['gpu'])}):", "",
             "| mode | tokens/s | step ms | MFU (of the bf16 peak) | peak memory (GB) | / bf16 |",
             "|---|---|---|---|---|---|"]
    base = next((r for r in sp["rows"] if r["mode"] == "bf16" and "tokens_per_s" in r), None)
    for r in sp["rows"]:
        if "error" in r:
            lines.append(f"| {_FP8_MODES[r['mode']]} | failed: {r['error'].strip().splitlines()[-1]} | | | | |")
            continue
        ratio = f"{r['tokens_per_s'] / base['tokens_per_s']:.3f}" if base else ""
        lines.append(f"| {_FP8_MODES[r['mode']]} | {r['tokens_per_s']:,.0f} | {r['step_ms']:.1f} | "
                     f"{100 * r['mfu_bf16_peak']:.1f}% | {r['peak_mem_gb']:.1f} | {ratio} |")
    for name, c in sp["checks"].items():
        lines.append(f"\nTarget {name}: {c['value']} against at least {c['target']} "
                     f"({'holds' if c['holds'] else 'does not hold'}).")
    return lines + [""]


def _fp8_curve(d: dict) -> list[str]:
    cv = d["curve"]
    runs = [r for r in cv["runs"] if "losses" in r]
    m = cv["model"]
    lines = [f"**Loss curves** ({_short_gpu(d['gpu'])}): a Llama of hidden {m['hidden_size']}, "
             f"{m['num_hidden_layers']} layers, intermediate {m['intermediate_size']} on the demo's corpus "
             f"(character tokens), seq {cv['seq']}, batch {cv['batch']}, lr {cv['lr']}, {cv['steps']} steps from the "
             f"same init on the same rows; the final loss is the mean of the last {cv['tail']} steps.", "",
             "| step | " + " | ".join(_FP8_MODES[r["mode"]] for r in runs) + " |",
             "|---|" + "---|" * len(runs)]
    steps = len(runs[0]["losses"]) if runs else 0
    for i in [0, *range(49, steps, 50)]:
        window = slice(max(0, i - 9), i + 1)  # the mean of the 10 steps ending here
        cells = [f"{sum(r['losses'][window]) / len(r['losses'][window]):.4f}" for r in runs]
        lines.append(f"| {i + 1} | " + " | ".join(cells) + " |")
    lines.append("| final (mean of the tail) | " + " | ".join(f"{r['final_loss']:.4f}" for r in runs) + " |")
    for name, c in cv["checks"].items():
        lines.append(f"\nTarget {name}: {c['value']} against at most {c['target']} "
                     f"({'holds' if c['holds'] else 'does not hold'}).")
    return lines + ["", "(Each row but the first and the last: the mean of the 10 steps ending at that step.)", ""]


def _fp8_kernels(d: dict) -> list[str]:
    k = d["kernels"]
    lines = [f"**Pieces at one Llama-3.1-8B layer, {k['tokens']} tokens** ({_short_gpu(d['gpu'])}; kernel time after "
             f"an L2 flush; copy bandwidth {k['copy_gbs']:.0f} GB/s measured in the same run):", "",
             "| piece | ms | TFLOP/s | bytes moved (MB) | % of copy bandwidth |", "|---|---|---|---|---|"]
    for r in k["rows"]:
        lines.append(f"| {r['piece']} | {r['ms']:.3f} | {r.get('tflops', '')} | "
                     f"{r['bytes'] / 1e6:.0f} | {100 * r['copy_fraction']:.0f}% |" if "bytes" in r else
                     f"| {r['piece']} | {r['ms']:.3f} | {r.get('tflops', '')} | | |")
    return lines + [""]


def _fp8_logits(d: dict) -> list[str]:
    lg = d["logits"]
    lines = [f"**Distance from bf16** ({_short_gpu(d['gpu'])}, {lg['shape']}, {lg['tokens']} tokens of held-out "
             "text): the same weights with and without FP8 projections.", "",
             "| mode | logits, relative distance | next-token loss (bf16: same tokens) |", "|---|---|---|"]
    for r in lg["rows"]:
        lines.append(f"| {_FP8_MODES[r['mode']]} | {r['logits_rel']:.4f} | {r['loss']:.4f} ({r['loss_bf16']:.4f}) |")
    return lines + [""]


def fp8() -> str:
    """bench_fp8's files: speed against bf16 per shape and batch, the loss curves, the kernel breakdown."""
    files = _files("fp8")
    if not files:
        return "No results committed yet."
    lines = []
    for part, table in (("speed", _fp8_speed), ("curve", _fp8_curve), ("logits", _fp8_logits),
                        ("kernels", _fp8_kernels)):
        for d in sorted((d for d in files if part in d), key=lambda d: d["_file"]):
            lines += table(d)
    for d in (d for d in files if os.path.basename(d["_file"]).startswith("fp8-lora-")):
        lines += ["**LoRA with the frozen base in FP8** (`python -m benchmarks.bench_train --lora` with "
                  "`ligermodels-lora-fp8`):", "", lora_table([d]).split("\n\nSources:")[0], ""]
    return "\n".join(lines + _sources(files)[1:])


# ------------------------------------------------------------------------------------------ QLoRA
_QLORA_IMPLS = {"ligermodels-qlora": "`ligermodels.train --quantize nf4 --lora-rank 16`",
                "ligermodels-qlora-graph": "`ligermodels.train --quantize nf4 --lora-rank 16 --cuda-graph`",
                "hf+peft+bnb": "Trainer + PEFT + bitsandbytes",
                "hf+peft+bnb+liger": "Trainer + PEFT + bitsandbytes + Liger",
                "hf+peft+bnb+compile": "Trainer + PEFT + bitsandbytes + torch.compile"}


def _qlora_max_batch(d: dict) -> list[str]:
    """A qlora-lora file's ``--max-batch`` entries: the largest micro-batch each run fits (within ``--memory-cap``)."""
    fits = d.get("max_batch", [])
    if not fits:
        return []
    cap = fits[0].get("memory_cap_gb")
    lines = [f"**Largest micro-batch{f' within {cap:g} GB' if cap else ''}** ({_short_gpu(d['gpu'])}): seq "
             f"{fits[0]['seq']}, activation checkpointing `{fits[0]['ac']}`, {fits[0].get('steps_per_try', 2)} "
             "optimiser steps a try; doubling, then bisection to the boundary, one process per implementation"
             + (", its memory capped by `torch.cuda.set_per_process_memory_fraction`" if cap else "") + ".", "",
             "| model | run | largest micro-batch | its peak memory (GB) | first out of memory |",
             "|---|---|---|---|---|"]
    for f in fits:
        name = _QLORA_IMPLS.get(f["impl"], f["impl"])
        if "error" in f:
            lines.append(f"| {_name(f['model'])} | {name} | failed | | |")
            continue
        peak = next((t["peak_mem_gb"] for t in f.get("tries", []) if t["batch"] == f["max_batch"]), None)
        lines.append(f"| {_name(f['model'])} | {name} | {f['max_batch']} | "
                     f"{'' if peak is None else f'{peak:.2f}'} | {f.get('first_oom_batch') or '-'} |")
    return lines + [""]


def _qlora_training(d: dict) -> list[str]:
    """One qlora-lora file: a table per (model, micro-batch), ours against each Trainer, with the checks; its
    ``--max-batch`` entries (a file may hold only those)."""
    if not d.get("rows"):
        return _qlora_max_batch(d)
    st, lo = d["settings"], d["settings"]["lora"]
    lines = [f"**{_name(d['rows'][0]['model'])}, seq {st['seq']}, activation checkpointing `{st['ac']}`** "
             f"({_short_gpu(d['gpu'])}): rank {lo['rank']}, alpha {lo['alpha']:g} on {', '.join(lo['targets'])}; "
             f"{st['precision']}; the same base checkpoint ({st['base']}) and packed rows for every run; median of "
             f"steps {st['warmup_steps_dropped'] + 1}-{st['steps']}. Peak memory is max allocated (GB = 1e9 B): ours "
             "over the whole process (loading included), the Trainer's from the loaded model on.", "",
             "| micro-batch | run | tokens/s | peak memory (GB) | speed / fastest Trainer | memory / leanest Trainer |",
             "|---|---|---|---|---|---|"]
    for batch in sorted({r["batch"] for r in d["rows"]}):
        rows = [r for r in d["rows"] if r["batch"] == batch and "error" not in r]
        rivals = [r for r in rows if r["impl"].startswith("hf")]
        fast = max(rivals, key=lambda r: r["tokens_per_s"], default=None)
        lean = min(rivals, key=lambda r: r["peak_mem_gb"], default=None)
        for r in sorted(rows, key=lambda r: (not r["impl"].startswith("ligermodels"), -r["tokens_per_s"])):
            speed = f"{r['tokens_per_s'] / fast['tokens_per_s']:.2f}x" if fast else "-"
            memory = f"{r['peak_mem_gb'] / lean['peak_mem_gb']:.2f}x" if lean else "-"
            lines.append(f"| {batch} | {_QLORA_IMPLS.get(r['impl'], r['impl'])} | {r['tokens_per_s']:,.0f} | "
                         f"{r['peak_mem_gb']:.2f} | {speed} | {memory} |")
    names = {"speed_vs_fastest_peft_bnb": "ours (faster of eager and graph) vs fastest Trainer",
             "memory_vs_peft_bnb": "memory vs leanest Trainer"}
    if any(d["checks"].get(k) for k in d["checks"]) and any(r["impl"].startswith("hf") for r in d["rows"]):
        lines += _checks_table([d], names, ("memory_vs_peft_bnb",), d["targets"])
    return lines + [""] + _qlora_max_batch(d)


def _nf4_exact(d: dict) -> list[str]:
    rows = d["exact"]
    return [f"**The format against bitsandbytes' CUDA kernels** ({_short_gpu(d['gpu'])}; random bf16 weights of std "
            "0.02 at each Llama-3.1-8B projection's shape, quantised by `kernels.nf4.quantize_nf4` and by "
            "`bitsandbytes.functional.quantize_4bit(blocksize=64, quant_type=\"nf4\", compress_statistics=True)`):",
            "", "| part | shape | values | packed bytes differing | block codes differing | group maxima differing "
            "| offset equal | dequantised bf16 values differing |", "|---|---|---|---|---|---|---|---|",
            *[f"| {r['part']} | {r['shape'][0]} x {r['shape'][1]} | {r['values']:,} | {r['packed_bytes_differing']} | "
              f"{r['block_codes_differing']} of {r['blocks']:,} | {r['group_maxima_differing']} | "
              f"{'yes' if r['offset_equal'] else '**no**'} | {r['dequantised_values_differing']} |" for r in rows], ""]


def _nf4_kernels(d: dict) -> list[str]:
    k = d["kernels"]
    lines = [f"**Dequantisation at one Llama-3.1-8B layer** ({_short_gpu(d['gpu'])}; kernel time after an L2 flush; "
             "bytes: 0.5 read and 2 written a value, plus the maxima; copy bandwidth "
             f"{k['copy_bandwidth_gbs']:.0f} GB/s measured in the same run), against the bf16 GEMM that reads the "
             "weight:", "",
             "| projection | weight | ours, ms | % of copy bandwidth | bitsandbytes `dequantize_4bit`, ms "
             "| GEMM at 2048 tokens, ms | dequantisation / that GEMM | GEMM at 8192 tokens, ms |",
             "|---|---|---|---|---|---|---|---|"]
    for r in k["rows"]:
        lines.append(f"| {r['projection']} | {r['shape'][0]} x {r['shape'][1]} | {r['ours_ms']:.3f} | "
                     f"{100 * r['ours_frac_copy_bw']:.0f}% | {r['bnb_ms']:.3f} | {r['gemm_2048_ms']:.3f} | "
                     f"{r['ours_ms'] / r['gemm_2048_ms']:.0%} | {r['gemm_8192_ms']:.3f} |")
    return lines + [""]


def _nf4_load(d: dict) -> list[str]:
    ld = d["load"]
    lines = [f"**Loading** ({_short_gpu(d['gpu'])}): `LigerLlama.from_hf(base, dtype=\"bf16\", device=\"cuda\", "
             f"quantize=...)` of a {ld['checkpoint_gb']:.1f} GB bf16 checkpoint of {_name(ld['checkpoint'])}'s shape, "
             "each load in a process of its own. Host memory: the peak growth of the process's anonymous memory "
             "(what the loader allocated) and of `ru_maxrss` (which also counts the checkpoint's memory-mapped pages "
             "while they are mapped: page cache the kernel reclaims under pressure).", "",
             "| quantize | seconds | host anonymous memory, peak growth (GB) | host `ru_maxrss` growth (GB) | GPU peak "
             "(GB) | weights on the GPU (GB) |", "|---|---|---|---|---|---|"]
    for q, r in ld["rows"].items():
        if "error" in r:
            lines.append(f"| {q} | failed | | | | |")
            continue
        lines.append(f"| {q} | {r['seconds']:.1f} | {r.get('host_anonymous_peak_growth_gb', float('nan')):.2f} | "
                     f"{r['host_peak_growth_gb']:.2f} | {r['gpu_peak_gb']:.2f} | {r['weights_gb']:.2f} |")
    return lines + [""]


def qlora() -> str:
    """bench_train's QLoRA files (``qlora-lora-*``) and bench_nf4's (``nf4-*``)."""
    training, nf4 = _files("qlora-lora"), _files("nf4")
    if not training and not nf4:
        return "No results committed yet."
    lines = []
    for d in sorted(training, key=lambda d: d["_file"]):
        lines += _qlora_training(d)
    for part, table in (("exact", _nf4_exact), ("kernels", _nf4_kernels), ("load", _nf4_load)):
        for d in sorted((d for d in nf4 if part in d), key=lambda d: d["_file"]):
            lines += table(d)
    return "\n".join(lines + _sources(training + nf4)[1:])


# ------------------------------------------------------------------------------------------ mixture of experts
def moe_kernels_table(d: dict) -> str:
    """bench_moe's rows: the data movement ops against eager PyTorch, the grouped GEMMs against a dense GEMM of the
    same flops, and one MoE layer against transformers' experts implementations."""
    rows = [r for r in d["rows"] if "error" not in r]
    lines = [f"Mixture-of-experts kernels, bf16, {d['tokens']} tokens through one sparse layer, on {d['gpu']}; kernel "
             f"times (GPU time after an L2 flush, host excluded). Copy bandwidth measured in the same run: "
             f"{d['copy_gbs']:.0f} GB/s.", "",
             "| op | shape | ours, ms | ours, % of copy bandwidth | ours, % of a same-size copy | with `torch.sort` "
             "placing the picks, ms | eager PyTorch, ms |",
             "|---|---|---|---|---|---|---|"]
    by = defaultdict(dict)
    for r in rows:
        by[(r["op"], r["shape"], r.get("pass"))][r["impl"]] = r

    def ms(r: dict | None) -> str:
        return "-" if not r else format(r["ms"], ".3f")

    for (op, shape, _), impls in by.items():
        ours = impls.get("ligermodels")
        if op not in ("route", "place", "permute", "expand", "combine") or not ours:
            continue
        lines.append(f"| {op} | {shape} | {ours['ms']:.3f} | {100 * ours['frac_copy_bw']:.0f}% | "
                     f"{100 * ours['frac_same_size_copy']:.0f}% | {ms(impls.get('ligermodels-torch-sort'))} | "
                     f"{ms(impls.get('torch-eager'))} |")
    chunks = sorted({r["chunk"] for r in rows if r["op"] == "place" and r["impl"].startswith("ligermodels-chunk-")})
    if chunks:
        lines += ["", "| place, us, by picks a chunk | " + " | ".join(str(c) for c in chunks) + " | chosen |",
                  "|---" * (len(chunks) + 2) + "|"]
        for (op, shape, _), impls in by.items():
            if op == "place" and "ligermodels" in impls:
                cells = " | ".join("-" if f"ligermodels-chunk-{c}" not in impls else
                                   format(1000 * impls[f"ligermodels-chunk-{c}"]["ms"], ".1f") for c in chunks)
                lines.append(f"| {shape} | {cells} | {impls['ligermodels']['chunk']} |")
    lines += ["", "| grouped GEMM (`torch._grouped_mm`) | pass | ms | TFLOP/s | dense GEMM of the same flops, TFLOP/s "
              "| grouped / dense |", "|---|---|---|---|---|---|"]
    for r in rows:
        if r["op"] == "grouped_gemm":
            lines.append(f"| {r['shape']} | {r['pass']} | {r['ms']:.3f} | {r['tflops']:.0f} | "
                         f"{r['dense_tflops']:.0f} | {r['frac_dense']:.2f} |")
    lines += ["", "| one MoE layer, router included | implementation | forward ms | backward ms |", "|---|---|---|---|"]
    layer = defaultdict(dict)
    for r in d["rows"]:
        if r["op"] == "moe_layer":
            layer[(r["shape"], r["impl"])][r.get("pass", "error")] = r
    for (shape, impl), passes in layer.items():
        if "error" in passes:
            err = passes["error"]["error"]
            cells = "out of memory | out of memory" if err.startswith("OutOfMemoryError") else "failed | failed"
        else:
            cells = f"{passes['fwd']['ms']:.2f} | {passes['bwd']['ms']:.2f}"
        lines.append(f"| {shape} | {impl} | {cells} |")
    return "\n".join(lines + _sources([d]))


def moe() -> str:
    parts = [train_table(g) for g in _groups(_of_kind(_train_runs(), moe=True))]
    alone = _of_kind(_loop_only_runs(), moe=True)
    if alone:
        parts.append(loop_only_table(alone, _of_kind(_train_runs(), moe=True)))
    parts += [lora_table(g) for g in _groups(_of_kind(_lora_runs(), moe=True))]
    d = _latest("moe")
    if d:
        parts.append(moe_kernels_table(d))
    return "\n\n".join(parts) or "No results committed yet."


# ------------------------------------------------------------------------------------------ the files
def blocks() -> dict[str, str]:
    """Every generated block by name."""
    return {"headline": headline(), "summary": summary(), "training": training(), "lora": lora(), "step": step(),
            "scale": scale(), "attention": attention(), "kernels": kernels(),
            "flce": _newest("flce", flce_table), "linear": _newest("linear", linear_table),
            "decode": _all("decode", decode_table), "adamw_step": _newest("adamw-step", adamw_step_table),
            "preference": _all("preference", preference_table),
            "moe": moe(), "dpo_head": _newest("dpo-head", dpo_head_table), "fp8": fp8(), "qlora": qlora()}


def render(text: str, names: tuple[str, ...], generated: dict[str, str], path: str = "") -> str:
    """``text`` with each named block replaced by its generated content; a missing marker is an error."""
    for name in names:
        start, end = f"<!-- report:{name} -->", f"<!-- /report:{name} -->"
        pattern = re.escape(start) + ".*?" + re.escape(end)
        if not re.search(pattern, text, flags=re.S):
            raise ValueError(f"{path}: no {start} ... {end} block")
        block = f"{start}\n{generated[name]}\n{end}"
        text = re.sub(pattern, lambda _, b=block: b, text, flags=re.S)
    return text


def update(root: str = ROOT, write: bool = True) -> list[str]:
    """Regenerate the blocks of every file of :data:`TARGETS` under ``root``; returns the files whose committed
    text differed (rewritten when ``write``)."""
    generated = blocks()
    changed = []
    for rel, names in TARGETS.items():
        path = os.path.join(root, rel)
        with open(path, encoding="utf-8") as f:
            old = f.read()
        new = render(old, names, generated, rel)
        if new != old:
            changed.append(rel)
            if write:
                with open(path, "w", encoding="utf-8") as f:
                    f.write(new)
    return changed


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    mode = ap.add_mutually_exclusive_group()
    mode.add_argument("--check", action="store_true", help="exit 1 when a file differs from what it would write")
    mode.add_argument("--print", action="store_true", help="print the blocks instead of rewriting the files")
    args = ap.parse_args(argv)
    if args.print:
        for name, text in blocks().items():
            print(f"<!-- report:{name} -->\n{text}\n<!-- /report:{name} -->\n")
        return 0
    changed = update(write=not args.check)
    if args.check and changed:
        print(f"out of date with benchmarks/results: {', '.join(changed)} (run python -m benchmarks.report)",
              file=sys.stderr)
        return 1
    for rel in changed:
        print(f"rewrote {rel}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
