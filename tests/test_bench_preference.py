"""benchmarks/bench_preference.py: the pairs it writes give every implementation the same tokens a step, and its
target checks compare the right rows."""

from __future__ import annotations

import json

import pytest

from benchmarks.bench_preference import checks, main, ours_command, parse_args, setting, trl_tokenizer, write_inputs
from ligermodels.train.config import TrainConfig
from ligermodels.train.data import load_inputs


def test_every_pair_is_prompt_completion_and_eos_tokens_long(tmp_path):
    model_dir, data = write_inputs(str(tmp_path), "qwen2-1.5b", pairs=6, prompt_words=7, completion_words=11,
                                   shrink=True)
    config = TrainConfig(model=model_dir, data=data, out=str(tmp_path / "out"), objective="dpo", batch_size=2,
                         seq_len=64, from_scratch=True, device="cpu")
    examples = load_inputs(config).examples
    assert len(examples) == 6
    for e in examples:
        assert [(len(s.ids), s.prompt_len) for s in e.sequences] == [(7 + 11 + 1, 7)] * 2
        assert e.sequences[0].ids != e.sequences[1].ids


def test_checks_take_the_fastest_trl_variant_and_trl_liger_memory_per_setting():
    base = {"model": "m", "objective": "dpo", "reference": "model", "ac": "full"}
    rows = [{**base, "impl": "ligermodels", "tokens_per_s": 130.0, "peak_mem_gb": 7.0},
            {**base, "impl": "trl", "tokens_per_s": 90.0, "peak_mem_gb": 12.0},
            {**base, "impl": "trl+liger", "tokens_per_s": 100.0, "peak_mem_gb": 10.0},
            {**base, "impl": "trl+compile", "error": "failed"},
            {**base, "impl": "ligermodels-graph", "tokens_per_s": 120.0, "peak_mem_gb": 8.0},
            {**base, "ac": "none", "impl": "trl", "tokens_per_s": 1000.0, "peak_mem_gb": 1.0}]
    out = checks(rows)["m/dpo/model/full"]
    assert out["speed_vs_fastest_trl"]["ratio"] == 1.3 and out["speed_vs_fastest_trl"]["fastest"] == "trl+liger"
    assert out["speed_vs_fastest_trl"]["holds"] and out["memory_vs_trl_liger"] == {"ratio": 0.7, "holds": True}
    graph = checks(rows)["m/dpo/model/full/--cuda-graph"]  # each of our impls against the same TRL rows
    assert graph["speed_vs_fastest_trl"]["ratio"] == 1.2 and not graph["speed_vs_fastest_trl"]["holds"]
    assert graph["memory_vs_trl_liger"] == {"ratio": 0.8, "holds": False}
    assert "m/dpo/model/none" not in checks(rows)  # no ligermodels row there


def test_trl_side_trains_on_every_token_of_the_pairs(tmp_path):
    """TRL's tokenised pairs have the tokens ours have (transformers' AutoTokenizer would read this tokenizer as
    Qwen2's BPE without merges and drop every word); a worker that finds otherwise writes an error row, not a speed."""
    pytest.importorskip("trl")
    results = tmp_path / "results"
    main(["--out", str(tmp_path), "--shrink", "--impls", "trl", "--steps", "2", "--warmup", "1", "--prompt-words",
          "5", "--completion-words", "9", "--timeout", "200", "--results", str(results)])
    (row,) = json.loads(next(results.iterdir()).read_text())["rows"]
    assert "error" not in row, row.get("error")
    assert row["tokens_per_step"] == 4 * 2 * (5 + 9 + 1)
    model_dir = tmp_path / "qwen2-1.5b" / "model"
    assert len(trl_tokenizer(str(model_dir))("w7 w8 w9")["input_ids"]) == 3


def test_lora_rows_run_ours_on_the_base_with_the_adapter_flags_and_compare_among_themselves():
    args = parse_args(["--lora", "--model", "qwen2-7b"])
    cmd = ours_command(args, "base", "pairs.jsonl", "out")
    assert "--from-scratch" not in cmd and cmd[cmd.index("--model") + 1] == "base"
    assert cmd[cmd.index("--lora-rank") + 1] == "16" and cmd[cmd.index("--lora-targets") + 1] == "q,k,v,o,gate,up,down"
    base = {"model": "m", "objective": "dpo", "reference": "model", "ac": "full"}
    assert setting({**base, "lora_rank": 16}) == ("m", "dpo", "model", "full", "lora") != setting(base)
    rows = [{**base, "impl": "ligermodels", "tokens_per_s": 100.0, "peak_mem_gb": 7.0},
            {**base, "impl": "trl", "lora_rank": 16, "tokens_per_s": 50.0, "peak_mem_gb": 12.0}]
    assert checks(rows)["m/dpo/model/full"] == {}  # the full-training row has no TRL row of its own setting


def test_a_timed_out_run_is_an_error_row_naming_the_childs_last_line(tmp_path, monkeypatch):
    """A run past --timeout writes an error row that says how far it got (the TRL worker prints each step's time)."""
    import subprocess

    import benchmarks.bench_preference as bench

    def slow(*_):
        raise subprocess.TimeoutExpired("worker", 5, stderr=b"compiling\nTRL step 1 done at 67.3 s\n")

    monkeypatch.setattr(bench, "run_trl", slow)
    results = tmp_path / "results"
    main(["--out", str(tmp_path), "--shrink", "--impls", "trl+compile", "--steps", "2", "--warmup", "1",
          "--timeout", "5", "--results", str(results)])
    (row,) = json.loads(next(results.iterdir()).read_text())["rows"]
    assert row["error"] == "did not finish 2 steps within --timeout 5 s (its last line: TRL step 1 done at 67.3 s)"
