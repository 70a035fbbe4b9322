"""Preference objectives (``--objective dpo|orpo|simpo|kto``) against TRL 1.16 on the same tiny model and data: the
loss, TRL's metrics and every parameter's gradient, in fp32; and ``python -m ligermodels.train`` running them.

TRL's trainers are built on the transformers twin of our checkpoint and give ``compute_loss`` on their own collated
batch of all the examples (one micro-batch); ours is :class:`PreferenceTask` on a micro-batch of the same examples.
The reference log-probs are given to both sides as the same numbers (TRL's precomputed-reference mode reads them from
the batch): they come from a perturbed copy of the model, so the rewards are not zero. Our reference pass itself is
compared with transformers' float64 log-softmax of the same sequences. These run the kernels' PyTorch references on
the CPU (the Triton path of the log-probs is checked against float64 in tests/test_logprobs.py).
"""

from __future__ import annotations

import copy
import dataclasses
import json
import subprocess
import sys

import pytest
import safetensors.torch
import torch

import kernels.logprobs
from ligermodels import CausalLM
from ligermodels.attention import SharedPrefixes
from ligermodels.hf_io import hf_tensors
from ligermodels.train.checkpointing import load_reference_logps
from ligermodels.train.config import TrainConfig, TrainError, parse_args
from ligermodels.train.data import load_inputs
from ligermodels.train.objectives import PreferenceTask
from ligermodels.train.preference import head_row_count, shared_prefix_count
from tests.test_chat import _checkpoint_dir
from tests.test_train import ENV, ROOT, TIMEOUT
from tests.utils import DEVICE, assert_triton_runs, rel_err

transformers = pytest.importorskip("transformers")
trl = pytest.importorskip("trl")
datasets = pytest.importorskip("datasets")

CPU = torch.device("cpu")
PAIRS = [{"prompt": f"what is {i}+{i}?", "chosen": f"it is {2 * i}.", "rejected": f"no idea, {i * 7 % 10}"}
         for i in range(3)]
CHAT_PAIRS = [{"prompt": [{"role": "user", "content": p["prompt"]}],
               "chosen": [{"role": "assistant", "content": p["chosen"]}],
               "rejected": [{"role": "assistant", "content": p["rejected"]}]} for p in PAIRS]
UNPAIRED = [{"prompt": f"what is {i}+{i}?", "completion": f"it is {2 * i + i % 2}.", "label": i % 2 == 0}
            for i in range(4)]

#: (our TrainConfig options, TRL trainer, TRL config options)
CASES = {
    "dpo-sigmoid": ({"objective": "dpo", "beta": 0.3}, "dpo", {"beta": 0.3}),
    "dpo-hinge": ({"objective": "dpo", "beta": 0.3, "dpo_loss": "hinge"}, "dpo", {"beta": 0.3, "loss_type": ["hinge"]}),
    "dpo-ipo": ({"objective": "dpo", "beta": 0.4, "dpo_loss": "ipo"}, "dpo", {"beta": 0.4, "loss_type": ["ipo"]}),
    "dpo-robust": ({"objective": "dpo", "beta": 0.3, "dpo_loss": "robust", "label_smoothing": 0.2}, "dpo",
                   {"beta": 0.3, "loss_type": ["robust"], "label_smoothing": 0.2}),
    "dpo-prompt-twice": ({"objective": "dpo", "beta": 0.3, "prompt_pass": "twice"}, "dpo", {"beta": 0.3}),
    "orpo": ({"objective": "orpo", "beta": 0.2}, "orpo", {"beta": 0.2}),
    "orpo-prompt-twice": ({"objective": "orpo", "beta": 0.2, "prompt_pass": "twice"}, "orpo", {"beta": 0.2}),
    "simpo": ({"objective": "simpo", "beta": 2.0, "simpo_gamma": 0.7, "cpo_alpha": 0.5}, "cpo",
              {"loss_type": "simpo", "beta": 2.0, "simpo_gamma": 0.7, "cpo_alpha": 0.5}),
    "simpo-smoothed": ({"objective": "simpo", "beta": 2.0, "label_smoothing": 0.1}, "cpo",
                       {"loss_type": "simpo", "beta": 2.0, "cpo_alpha": 0.0, "label_smoothing": 0.1}),
    "kto": ({"objective": "kto", "beta": 0.2, "desirable_weight": 1.3, "undesirable_weight": 0.8}, "kto",
            {"beta": 0.2, "desirable_weight": 1.3, "undesirable_weight": 0.8}),
}


def _tiny_checkpoint(tmp_path, style: str, heads: int = 4) -> str:
    d = _checkpoint_dir(tmp_path, style)
    cfg = transformers.LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=heads, num_key_value_heads=heads // 2,
                                   max_position_embeddings=256)
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(cfg).save_pretrained(d)
    return d


def _write(path, records) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return str(path)


def _trl_trainer(kind: str, model, tokenizer, records, options: dict, out: str):
    common = {"output_dir": out, "per_device_train_batch_size": len(records), "report_to": [], "use_cpu": True,
              "max_length": 128, **options}
    ds = datasets.Dataset.from_list(records)
    if kind == "dpo":
        return trl.DPOTrainer(model=model, args=trl.DPOConfig(precompute_ref_log_probs=True, **common),
                              train_dataset=ds, processing_class=tokenizer)
    if kind == "kto":
        return trl.KTOTrainer(model=model, args=trl.KTOConfig(precompute_ref_log_probs=True, **common),
                              train_dataset=ds, processing_class=tokenizer)
    if kind == "orpo":
        from trl.experimental.orpo import ORPOConfig, ORPOTrainer
        return ORPOTrainer(model=model, args=ORPOConfig(**common), train_dataset=ds, processing_class=tokenizer)
    from trl.experimental.cpo import CPOConfig, CPOTrainer
    return CPOTrainer(model=model, args=CPOConfig(**common), train_dataset=ds, processing_class=tokenizer)


def _ours(checkpoint: str, data: str, options: dict, out: str, n: int, graph: bool = False):
    """(task, model) on the CPU; ``graph``: the task as ``--cuda-graph`` makes it (its layout only: no capture)."""
    config = TrainConfig(model=checkpoint, data=data, out=out, batch_size=n, seq_len=128, dtype="fp32", device="cpu",
                         **options)
    inputs = load_inputs(config)
    if graph:  # (a CPU config refuses the flag itself)
        config = copy.copy(config)
        object.__setattr__(config, "cuda_graph", True)
    task = PreferenceTask(config, inputs.examples, "tokens", inputs.config)
    model = CausalLM.from_hf(checkpoint, dtype=torch.float32)
    return task, model


def _tiny_moe_checkpoint(tmp_path, output_router_logits: bool) -> str:
    """A Qwen3-MoE twin of :func:`_tiny_checkpoint` (a dense layer among two sparse ones, top-2 of 4 experts)."""
    d = _checkpoint_dir(tmp_path, "llama3")
    cfg = transformers.Qwen3MoeConfig(vocab_size=128, hidden_size=32, intermediate_size=48, num_hidden_layers=3,
                                      num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_experts=4,
                                      num_experts_per_tok=2, moe_intermediate_size=16, mlp_only_layers=[1],
                                      norm_topk_prob=True, output_router_logits=output_router_logits,
                                      router_aux_loss_coef=0.7, max_position_embeddings=256)
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(cfg).save_pretrained(d)
    return d


#: Mixture-of-experts policies: TRL adds the load-balancing loss (DPO / KTO: whenever the model has experts and a
#: coefficient; ORPO: when the config also sets output_router_logits)
MOE_CASES = {"dpo-moe": (CASES["dpo-sigmoid"], False), "kto-moe": (CASES["kto"], False),
             "orpo-moe": (CASES["orpo"], True)}


@pytest.mark.parametrize("case", sorted(CASES) + sorted(MOE_CASES))
def test_objective_matches_trl_loss_metrics_and_gradients(tmp_path, case, reference_kernels):
    from tests.test_models import hub_layout

    moe = case in MOE_CASES
    ours_options, kind, trl_options = MOE_CASES[case][0] if moe else CASES[case]
    style, records = ("gemma", CHAT_PAIRS) if case == "dpo-sigmoid" else ("llama3", PAIRS)
    records = UNPAIRED if kind == "kto" else records
    checkpoint = _tiny_moe_checkpoint(tmp_path, MOE_CASES[case][1]) if moe else _tiny_checkpoint(tmp_path, style)
    data = _write(tmp_path / "data.jsonl", records)
    n = len(records)
    task, ours = _ours(checkpoint, data, ours_options, str(tmp_path / "out"), n)
    if kind in ("dpo", "kto"):  # the reference: a perturbed copy, so the rewards are not zero
        task.reference_model = copy.deepcopy(ours)
        with torch.no_grad():
            for p in task.reference_model.parameters():
                p.add_(0.02 * torch.randn_like(p))
        task.reference_logps = task.compute_reference_logps(ours, 0, 1, CPU)
        task.reference_model = None
    counts = task.counts(list(range(n)), 1, CPU)
    reference_passes = []
    task.reference_forward = lambda *a: reference_passes.append(a)  # DPO, KTO: precomputed; ORPO, SimPO: none
    batch = task.make_batch(list(range(n)))  # --prompt-pass once, unless the case says twice or its MoE loss counts
    assert isinstance(batch.rows.documents, SharedPrefixes) == (ours_options.get("prompt_pass", "once") == "once"
                                                                and kind != "kto" and case not in ("dpo-moe",
                                                                                                   "orpo-moe"))
    stats = task.forward_backward(ours, batch, counts, 1, CPU)
    assert not reference_passes
    our_metrics = task.metrics(stats[1:].tolist(), counts)

    tokenizer = transformers.AutoTokenizer.from_pretrained(checkpoint)
    hf = transformers.AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32)
    trainer = _trl_trainer(kind, hf, tokenizer, records, trl_options, str(tmp_path / "trl"))
    batch = trainer.data_collator([trainer.train_dataset[i] for i in range(n)])
    if kind == "dpo":
        batch["ref_chosen_logps"], batch["ref_rejected_logps"] = task.reference_logps.unbind(1)
    if kind == "kto":
        batch["ref_logps"], batch["ref_KL_logps"] = task.reference_logps.unbind(1)
    hf.train()
    loss = trainer.compute_loss(hf, batch)
    loss.backward()
    logged = getattr(trainer, "_metrics", None) or trainer._stored_metrics
    theirs = {k: float(v[-1]) for k, v in logged["train"].items()}

    assert rel_err(stats[0], loss.detach()) <= 1e-5, (stats[0].item(), loss.item())
    assert set(our_metrics) <= set(theirs), sorted(set(our_metrics) - set(theirs))
    if kind in ("dpo", "kto"):
        assert abs(theirs["rewards/chosen"]) > 1e-3  # the perturbed reference makes them count
    for name, value in our_metrics.items():
        assert abs(value - theirs[name]) <= 1e-5 * max(1.0, abs(theirs[name])), (name, value, theirs[name])
    ours_grads = dict(hf_tensors({n: p.grad for n, p in ours.named_parameters()}, ours.config))
    hf_grads = hub_layout({n: p.grad for n, p in hf.named_parameters()}, hf.config.model_type)
    assert set(ours_grads) == set(hf_grads)
    for name, g in hf_grads.items():
        assert rel_err(ours_grads[name], g) <= 1e-4, (name, rel_err(ours_grads[name], g))


@pytest.mark.parametrize("case", ["dpo-sigmoid", "orpo", "simpo", "kto", "dpo-prompt-twice", "orpo-prompt-twice"])
def test_a_padded_micro_batch_takes_the_loss_metrics_and_gradients_of_the_packed_one(tmp_path, case,
                                                                                       reference_kernels):
    """--cuda-graph's step (:meth:`PreferenceTask.graph_loss` on :meth:`graph_inputs`: rows padded to the longest
    micro-batch the data makes, counts as device tensors) gives the eager step's loss, metric sums and gradients.
    Pairs with each prompt once pad the model's row, the attention row, the repeats and the head rows each to its
    own fixed size (:class:`SharedRoom`); with each prompt twice, one row."""
    options, kind, _ = CASES[case]
    key = "completion" if kind == "kto" else "chosen"  # examples of different lengths
    records = [{**r, key: r[key] + " and so on" * i} for i, r in enumerate(UNPAIRED if kind == "kto" else PAIRS)]
    task, model = _ours(_tiny_checkpoint(tmp_path, "llama3"), _write(tmp_path / "data.jsonl", records),
                        options, str(tmp_path / "out"), 2, graph=True)
    assert task.shares_prompts == (kind in ("dpo", "orpo", "cpo") and "twice" not in case)
    if kind in ("dpo", "kto"):
        task.reference_logps = -10 * torch.rand(len(task.examples), 2, generator=torch.Generator().manual_seed(0))
    index = [2, 0] if kind != "kto" else [3, 0]
    counts, batch = task.counts(index, 1, CPU), task.make_batch(index)
    eager = task.forward_backward(model, batch, counts, 1, CPU)
    eager_grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)

    inputs = task.graph_inputs(batch, counts)
    room = task.graph_shared_room.tokens if task.shares_prompts else task.graph_room[0]
    assert inputs[0].shape[1] == room > batch.rows.input_ids.shape[1]  # padded
    if task.shares_prompts:
        assert isinstance(batch.rows.documents, SharedPrefixes)
        assert inputs[2].numel() == task.graph_shared_room.head > batch.rows.head_rows.numel()
    loss, stats = task.graph_loss(model, *inputs)
    loss.backward()
    assert stats.shape == eager.shape and rel_err(stats, eager) <= 1e-6, (stats, eager)
    for n, p in model.named_parameters():
        assert rel_err(p.grad, eager_grads[n]) <= 1e-5, n

    # the room holds distinct examples; one repeated across an epoch boundary may not fit: that step runs eagerly
    lengths = [e.tokens for e in task.examples]
    longest, shortest = max(range(len(lengths)), key=lengths.__getitem__), min(range(len(lengths)),
                                                                                key=lengths.__getitem__)
    assert lengths[longest] > lengths[shortest]
    if task.shares_prompts:  # the attention row one filler position longer than the two, the model's row as much
        shared = [shared_prefix_count(task.examples[i]) for i in (longest, shortest)]
        whole = lengths[longest] + lengths[shortest] + 1
        task.graph_shared_room = dataclasses.replace(task.graph_shared_room, attention=whole,
                                                     tokens=whole - sum(shared))
    else:
        task.graph_room = (lengths[longest] + lengths[shortest], task.graph_room[1] and 10_000)
    assert task.graph_inputs(task.make_batch([longest, shortest]), counts) is not None
    assert task.graph_inputs(task.make_batch([longest, longest]), counts) is None


@pytest.mark.parametrize("case", ["dpo-sigmoid", "orpo", "kto"])
def test_the_head_taking_the_gradient_in_its_forward_takes_the_per_token_heads_step(tmp_path, case, monkeypatch):
    """The step on the device under test (the Triton kernels; on the CPU through the interpreter): chunks of whole
    pairs (KTO: examples), the loss's gradient taken inside the head's forward, against the per-token head and
    autograd through the loss (every pair made longer than a chunk): the same loss, metric sums and gradients.
    ORPO adds a per-token term (the chosen NLL) to the per-pair one."""
    options, kind, _ = CASES[case]
    records = UNPAIRED if kind == "kto" else PAIRS
    checkpoint = _tiny_checkpoint(tmp_path, "llama3", heads=2)  # head_dim 16: fp32 attention on a GPU takes >= 16
    task, model = _ours(checkpoint, _write(tmp_path / "data.jsonl", records), options, str(tmp_path / "out"),
                        len(records))
    model = model.to(DEVICE)
    assert_triton_runs(model.embed.weight)
    if kind in ("dpo", "kto"):
        task.reference_logps = -10 * torch.rand(len(task.examples), 2, generator=torch.Generator().manual_seed(0))
    index = list(range(len(records)))[::-1]
    counts, batch = task.counts(index, 1, DEVICE), task.make_batch(index)  # prompts once, the head's rows only
    assert len(batch.rows.group_ends) == len(records)
    longest = max(b - a for a, b in zip((0, *batch.rows.group_ends), batch.rows.group_ends, strict=False))
    chunks = []
    loop = kernels.logprobs._flce_loop
    monkeypatch.setattr(kernels.logprobs, "_flce_loop", lambda *a, **k: chunks.append(k["chunks"]) or loop(*a, **k))
    runs = {}
    for name, limit in (("in the forward", longest), ("per token", longest - 1)):
        monkeypatch.setattr(kernels.logprobs, "flce_chunk_tokens", lambda *_, n=limit: n)
        model.zero_grad(set_to_none=True)
        stats = task.forward_backward(model, batch, counts, 1, DEVICE)
        runs[name] = stats, {n: p.grad.clone() for n, p in model.named_parameters()}
    assert len(chunks) == 1 and len(chunks[0]) >= 2, chunks  # the first run's chunks, the second took the other head
    (fused, fused_grads), (per_token, per_token_grads) = runs["in the forward"], runs["per token"]
    assert rel_err(fused, per_token) <= 1e-5, (fused, per_token)
    for n, g in per_token_grads.items():
        assert rel_err(fused_grads[n], g) <= 1e-5, (n, rel_err(fused_grads[n], g))


@pytest.mark.parametrize("case", ["dpo-sigmoid", "orpo", "orpo-prompt-twice"])
def test_a_captured_step_in_slots_takes_whole_pairs_a_chunk_and_the_eager_steps_numbers(tmp_path, case, monkeypatch):
    """--cuda-graph's inputs with each pair in a slot of its own (:attr:`PreferenceTask.graph_slot`, or with each
    prompt once the head rows' :attr:`SharedRoom.head_slot`: pairs of near equal length): the step's loss head takes
    a pair a chunk at the slots' fixed ends, and the loss, metric sums and gradients are the eager step's, on the
    device under test (the Triton kernels; on the CPU the interpreter)."""
    options, kind, _ = CASES[case]
    records = [{**r, "rejected": r["chosen"][::-1]} for r in PAIRS]  # each pair's two completions equally long
    checkpoint = _tiny_checkpoint(tmp_path, "llama3", heads=2)
    task, model = _ours(checkpoint, _write(tmp_path / "data.jsonl", records), options, str(tmp_path / "out"), 3,
                        graph=True)
    model = model.to(DEVICE)
    assert_triton_runs(model.embed.weight)
    if kind == "dpo":
        task.reference_logps = -10 * torch.rand(len(task.examples), 2, generator=torch.Generator().manual_seed(0))
    if task.shares_prompts:
        rows = [head_row_count(e, task.head) for e in task.examples]
        assert task.graph_shared_room.head_slot == 0  # short pairs: rounding each to 16 rows adds more than 1/32
        slot = -(-max(rows) // 16) * 16
        task.graph_shared_room = dataclasses.replace(task.graph_shared_room, head_slot=slot, head=3 * slot)
    else:
        lengths = [e.tokens for e in task.examples]
        assert task.graph_slot == 0  # these short pairs: rounding each to 16 tokens adds more than 1/32 of the row
        task.graph_slot = slot = -(-max(lengths) // 16) * 16  # (the benchmark's 2,050-token pairs take 2,064: 0.7%)
        assert task.graph_room[0] == 3 * task.graph_slot
    index = [2, 0, 1]
    counts, batch = task.counts(index, 1, DEVICE), task.make_batch(index)
    monkeypatch.setattr(kernels.logprobs, "flce_chunk_tokens", lambda *_: slot)  # a pair a chunk
    chunks = []
    loop = kernels.logprobs._flce_loop
    monkeypatch.setattr(kernels.logprobs, "_flce_loop", lambda *a, **k: chunks.append(k["chunks"]) or loop(*a, **k))
    eager = task.forward_backward(model, batch, counts, 1, DEVICE)
    eager_grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    inputs = [t.to(DEVICE) for t in task.graph_inputs(batch, counts)]
    loss, stats = task.graph_loss(model, *inputs)
    loss.backward()
    assert chunks[-1] == [(0, slot), (slot, 2 * slot), (2 * slot, 3 * slot)], chunks
    assert rel_err(stats, eager) <= 1e-5, (stats, eager)
    for n, p in model.named_parameters():
        assert rel_err(p.grad, eager_grads[n]) <= 1e-5, n


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need CUDA")
@pytest.mark.parametrize("objective, reference, layout, prompt_pass", [
    ("dpo", "precompute", "packed", "twice"), ("dpo", "model", "packed", "twice"), ("orpo", "none", "packed", "twice"),
    ("kto", "precompute", "packed", "once"), ("dpo", "precompute", "slots", "twice"),
    ("orpo", "none", "slots", "twice"), ("dpo", "precompute", "packed", "once"), ("dpo", "model", "packed", "once"),
    ("orpo", "none", "packed", "once"), ("dpo", "precompute", "slots", "once"), ("orpo", "none", "slots", "once")])
def test_a_cuda_graph_preference_run_takes_the_eager_steps(tmp_path, objective, reference, layout, prompt_pass):
    """--cuda-graph with a preference objective (bf16, one GPU): the eager run's losses and metrics within bf16
    rounding (FlashAttention's backward accumulates with atomics), though every row is padded to the longest.
    ``slots``: pairs of one length (256-token sequences), each pair in a slot of its own (with each prompt once, a
    slot of head rows), and chunks that hold one slot, so the captured loss head takes a pair a chunk, its gradient
    in the forward. KTO keeps every position under the graph whatever ``--prompt-pass`` says."""
    checkpoint = _tiny_checkpoint(tmp_path, "llama3")
    long_pairs = [{"prompt": p["prompt"], "chosen": " it is" * 150, "rejected": " no it" * 150} for p in PAIRS]
    records = long_pairs if layout == "slots" else UNPAIRED if objective == "kto" else PAIRS
    data = _write(tmp_path / "data.jsonl", records * 2)
    chunk = "512" if prompt_pass == "twice" else "1024"
    env = {**ENV, "LIGERMODELS_FLCE_CHUNK": chunk} if layout == "slots" else ENV
    runs = {}
    for name, extra in (("eager", []), ("graph", ["--cuda-graph"])):
        out = tmp_path / name
        ref = [] if reference == "none" else ["--reference", reference]
        res = subprocess.run([sys.executable, "-m", "ligermodels.train", "--model", checkpoint, "--data", data,
                              "--out", str(out), "--objective", objective, *ref, "--batch-size", "2", "--steps", "5",
                              "--save-every", "0", "--dtype", "bf16", "--device", "cuda", "--lr", "1e-3",
                              "--prompt-pass", prompt_pass, *extra],
                             cwd=ROOT, env=env, capture_output=True, text=True, timeout=TIMEOUT)
        assert res.returncode == 0, res.stderr[-3000:]
        if extra:
            once = prompt_pass == "once" and objective != "kto"
            if layout == "slots" or not once:  # packed head rows take slots too where those cost <= 1/32 more
                assert ("an example a slot of" in res.stdout) == (layout == "slots"), res.stdout[-2000:]
            assert ("in attention" in res.stdout) == once, res.stdout[-2000:]
        runs[name] = _metrics(out)
    for a, b in zip(runs["eager"], runs["graph"], strict=True):
        for key in ("loss", "grad_norm", "rewards/chosen", "logps/chosen"):
            if a[key] is None:  # KTO: a step without a desirable example has no chosen metrics
                assert b[key] is None, (key, a, b)
                continue
            assert abs(a[key] - b[key]) <= 2e-2 * max(abs(a[key]), 1e-2), (key, a, b)


def test_reference_logps_are_transformers_float64_log_softmax_of_each_sequence(tmp_path, reference_kernels):
    checkpoint = _tiny_checkpoint(tmp_path, "llama3")
    data = _write(tmp_path / "data.jsonl", PAIRS)
    task, ours = _ours(checkpoint, data, {"objective": "dpo"}, str(tmp_path / "out"), 2)
    ref = task.compute_reference_logps(ours, 0, 1, CPU)
    hf = transformers.AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float64)
    for i, example in enumerate(task.examples):
        for k, seq in enumerate(example.sequences):
            ids = torch.tensor([seq.ids])
            with torch.no_grad():
                logp = hf(input_ids=ids).logits.log_softmax(-1)[0, :-1].gather(-1, ids[0, 1:, None])[:, 0]
            expected = logp[max(seq.prompt_len, 1) - 1:].sum()
            assert abs(ref[i, k].item() - expected.item()) <= 1e-5 * abs(expected.item()), (i, k)


def _train(args: list[str]) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ligermodels.train", *args, "--dtype", "fp32", "--device", "cpu"],
                          cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=TIMEOUT)


def _metrics(out) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("objective", ["orpo", "simpo", "kto"])  # dpo: the runs below
def test_the_trainer_runs_each_objective_and_logs_trl_metric_names(tmp_path, objective):
    checkpoint = _tiny_checkpoint(tmp_path, "llama3")
    data = _write(tmp_path / "data.jsonl", (UNPAIRED if objective == "kto" else PAIRS) * 3)
    out = tmp_path / "out"
    res = _train(["--model", checkpoint, "--data", data, "--out", str(out), "--objective", objective,
                  "--batch-size", "2", "--steps", "3", "--lr", "1e-2", "--save-every", "0"])
    assert res.returncode == 0, res.stderr[-3000:]
    metrics = _metrics(out)
    assert len(metrics) == 3
    names = ("rewards/chosen", "rewards/rejected", "logps/chosen", "logps/rejected")
    if objective == "kto":  # a batch without desirable (or undesirable) examples has no such mean, as in TRL
        assert all(any(m[name] is not None for m in metrics) for name in names)
        assert all(m["kl"] is not None for m in metrics)
    else:
        assert all(m[name] is not None for m in metrics for name in (*names, "rewards/margins", "rewards/accuracies"))
    assert (out / "reference_logps.safetensors").exists() == (objective in ("dpo", "kto"))
    assert (out / "final" / "model.safetensors").exists()


def test_dpo_with_each_prompt_once_takes_the_steps_of_each_prompt_twice(tmp_path):
    """The trainer end to end (fp32, CPU): --prompt-pass once, the default, and twice give the same reference
    log-probs, losses and metrics over three steps that move the weights."""
    checkpoint = _tiny_checkpoint(tmp_path, "llama3")
    data = _write(tmp_path / "data.jsonl", PAIRS * 2)
    runs = {}
    for mode in ("once", "twice"):
        out = tmp_path / mode
        res = _train(["--model", checkpoint, "--data", data, "--out", str(out), "--objective", "dpo", "--batch-size",
                      "2", "--steps", "3", "--lr", "1e-2", "--save-every", "0", "--prompt-pass", mode])
        assert res.returncode == 0, res.stderr[-3000:]
        assert ("each pair's prompt once" in res.stdout) == (mode == "once")
        runs[mode] = _metrics(out), safetensors.torch.load_file(str(out / "reference_logps.safetensors"))[
            "reference_logps"]
    (once, ref_once), (twice, ref_twice) = runs["once"], runs["twice"]
    assert rel_err(ref_once, ref_twice) <= 1e-6
    assert abs(once[-1]["rewards/margins"]) > 1e-3  # the steps moved the policy away from the reference
    for a, b in zip(once, twice, strict=True):
        for key in ("loss", "rewards/margins", "logps/chosen", "logps/rejected", "grad_norm"):
            assert abs(a[key] - b[key]) <= 1e-5 * max(1.0, abs(b[key])), (a["step"], key, a[key], b[key])


@pytest.mark.parametrize("device,bound", [
    ("cpu", 1e-5),  # gloo
    pytest.param("cuda", 1e-4, marks=pytest.mark.skipif(torch.cuda.device_count() < 2,
                                                         reason="needs two CUDA devices (NCCL)")),
])
def test_two_ranks_with_a_sharded_reference_copy_take_the_steps_of_one_rank(tmp_path, device, bound):
    """--reference model under FSDP2 (two ranks; gloo on the CPU, NCCL on two GPUs): the frozen copy is sharded as
    the policy is and gathered for its forward; one rank with --grad-accum 2 over the same global batches takes the
    same steps (fp32; NCCL's reduce-scatter sums in another order than one GPU's accumulation: 10x the bound)."""
    from tests.test_train import _train as _launch

    checkpoint = _tiny_checkpoint(tmp_path, "llama3")
    data = _write(tmp_path / "data.jsonl", PAIRS * 2)
    common = ["--model", checkpoint, "--data", data, "--objective", "dpo", "--reference", "model", "--batch-size",
              "1", "--steps", "2", "--save-every", "0", "--lr", "1e-2", "--dtype", "fp32", "--device", device]
    runs = {}
    for name, nproc, accum in (("one", 1, "2"), ("two", 2, "1")):
        res = _launch([*common, "--out", str(tmp_path / name), "--grad-accum", accum], nproc=nproc)
        assert res.returncode == 0, res.stderr[-3000:]
        runs[name] = _metrics(tmp_path / name)
    for a, b in zip(runs["one"], runs["two"], strict=True):
        for key in ("loss", "rewards/margins", "logps/chosen"):
            assert abs(a[key] - b[key]) <= bound * max(1.0, abs(a[key])), (key, a, b)
    assert runs["one"][-1]["rewards/margins"] != 0.0  # the policy moved away from the reference


def test_dpo_resume_repeats_the_uninterrupted_run(tmp_path):
    """The reference log-probs are computed once, before step 1, and read back on resume: steps 3-4 of a run
    resumed at step 2 equal the uninterrupted run's, and so do the final weights."""
    checkpoint = _tiny_checkpoint(tmp_path, "llama3")
    data = _write(tmp_path / "data.jsonl", PAIRS * 3)
    common = ["--model", checkpoint, "--data", data, "--objective", "dpo", "--batch-size", "2", "--lr", "1e-2",
              "--lr-schedule", "constant", "--warmup-steps", "0"]
    whole, parts = tmp_path / "whole", tmp_path / "parts"
    assert _train([*common, "--out", str(whole), "--steps", "4", "--save-every", "0"]).returncode == 0
    assert _train([*common, "--out", str(parts), "--steps", "2", "--save-every", "2"]).returncode == 0
    res = _train([*common, "--out", str(parts), "--steps", "4", "--save-every", "2", "--resume"])
    assert res.returncode == 0, res.stderr[-3000:]
    a, b = _metrics(whole), _metrics(parts)
    assert [m["loss"] for m in a] == [m["loss"] for m in b]
    assert [m["rewards/margins"] for m in a] == [m["rewards/margins"] for m in b]
    x = CausalLM.from_hf(str(whole / "final"), dtype=torch.float32).state_dict()
    y = CausalLM.from_hf(str(parts / "final"), dtype=torch.float32).state_dict()
    assert all(torch.equal(x[k], y[k]) for k in x)

    state = json.loads((parts / "checkpoints" / "step_00000004" / "train_state.json").read_text())
    n = len(PAIRS * 3)
    assert load_reference_logps(str(parts), state, n).shape == (n, 2)  # the file a resume reads, checked by data
    with pytest.raises(TrainError, match="was computed for other data"):
        load_reference_logps(str(parts), {**state, "data_sha256": "0" * 64}, n)
    (parts / "reference_logps.safetensors").unlink()
    with pytest.raises(TrainError, match="reference_logps.safetensors is missing"):
        load_reference_logps(str(parts), state, n)


def test_reference_model_and_lora_base_give_the_precomputed_runs_steps(tmp_path):
    """--reference model (a frozen copy run every step) takes the same steps as --reference precompute; with LoRA
    the reference is the base with the adapters off (first step: rewards 0, as the adapters start as a no-op)."""
    checkpoint = _tiny_checkpoint(tmp_path, "llama3")
    data = _write(tmp_path / "data.jsonl", PAIRS * 3)
    common = ["--model", checkpoint, "--data", data, "--objective", "dpo", "--batch-size", "2", "--lr", "1e-2",
              "--steps", "3", "--save-every", "0"]
    runs = {}
    for name, extra in (("pre", []), ("model", ["--reference", "model"]),
                        ("lora", ["--lora-rank", "4", "--lora-alpha", "8"]),
                        ("lora-model", ["--lora-rank", "4", "--lora-alpha", "8", "--reference", "model"])):
        res = _train([*common, "--out", str(tmp_path / name), *extra])
        assert res.returncode == 0, res.stderr[-3000:]
        runs[name] = _metrics(tmp_path / name)
    for a, b in ((runs["pre"], runs["model"]), (runs["lora"], runs["lora-model"])):
        for ma, mb in zip(a, b, strict=True):
            assert abs(ma["loss"] - mb["loss"]) <= 1e-5 * ma["loss"]
            assert abs(ma["rewards/margins"] - mb["rewards/margins"]) <= 1e-5 + 1e-4 * abs(ma["rewards/margins"])
    assert runs["lora"][0]["rewards/chosen"] == 0.0 and runs["lora"][-1]["rewards/margins"] != 0.0
    assert not (tmp_path / "lora-model" / "reference_logps.safetensors").exists()


@pytest.mark.parametrize("reference", ["precompute", "model"])
def test_first_bf16_dpo_step_has_the_reference_equal_to_the_policy(tmp_path, reference):
    """In bf16 the reference log-probs are computed by the step's own bf16 forward (not by the fp32 weights before
    they become masters): on this tiny model every first-step reward is exactly 0 and the loss is log 2. On a GPU
    this runs the Triton kernels."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    checkpoint = _tiny_checkpoint(tmp_path, "llama3")
    data = _write(tmp_path / "data.jsonl", PAIRS * 2)
    out = tmp_path / "out"
    res = subprocess.run([sys.executable, "-m", "ligermodels.train", "--model", checkpoint, "--data", data, "--out",
                          str(out), "--objective", "dpo", "--reference", reference, "--batch-size", "2", "--steps",
                          "1", "--save-every", "0", "--dtype", "bf16", "--device", device],
                         cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=TIMEOUT)
    assert res.returncode == 0, res.stderr[-3000:]
    first = _metrics(out)[0]
    assert first["rewards/chosen"] == 0.0 and first["rewards/rejected"] == 0.0, first
    assert abs(first["loss"] - 0.6931471805599453) <= 1e-6, first


@pytest.mark.parametrize("flags, message", [
    (["--objective", "orpo", "--label-smoothing", "0.1"], "--label-smoothing applies to"),
    (["--objective", "dpo", "--attention", "causal"], "needs --attention documents"),
    (["--objective", "dpo", "--beta", "0"], "--beta must be positive"),
    (["--objective", "kto", "--desirable-weight", "-1"], "--desirable-weight must be non-negative"),
    (["--objective", "simpo", "--simpo-gamma", "-1"], "--simpo-gamma must be non-negative"),
    (["--objective", "rlhf"], "invalid choice"),
])
def test_bad_preference_flags_are_refused_by_name(capsys, flags, message):
    with pytest.raises(SystemExit):
        parse_args(["--model", "m", "--data", "d.jsonl", "--out", "o", *flags])
    assert message in capsys.readouterr().err
