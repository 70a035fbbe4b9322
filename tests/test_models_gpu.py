"""Every family in bf16 on the GPU: no further from transformers-fp32 than transformers-bf16 is (x1.5).

For each case of :mod:`tests.test_models` (the same tiny random ``save_pretrained`` checkpoints,
made a little wider so that bf16 errors average over more elements), three models run on the same
random tokens, longer than every sliding window of the cases:

* ``ref``: transformers in fp32 (the reference), ``attn_implementation="sdpa"``, fp32 matmuls
  without TF32;
* ``hf``: transformers in bf16 (weights cast from the same fp32 checkpoint), sdpa;
* ``ours``: ``CausalLM.from_hf(dir, dtype=torch.bfloat16, device="cuda")``.

Compared, as ``||out - ref|| / ||ref||`` in fp64 (``tests.utils.rel_err``), each over several
batches taken together: the logits, the per-token next-token losses and the gradient of every
parameter (ours mapped to HF names through the key map, as in test_models) over GRAD_BATCHES batches;
the mean loss (``model.loss(ids, labels)`` against HF's ``labels=`` loss) as the vector of the mean
losses of LOSS_BATCHES batches. Each must satisfy ``err(ours) <= 1.5 * err(hf) + 1e-6``.

Why several batches: one batch's mean loss is a single number whose bf16 error has either sign, and
transformers-bf16 lands close to the reference on some batches by luck (the ratio of two such errors
is heavy-tailed: on one batch it exceeds 1.5 about a third of the time even when both have the same
typical error). Over 64 batches the comparison is of typical errors. Likewise a 16-element bias
gradient (one KV head of 16) holds too few elements for one batch to measure its typical error.
"""

from __future__ import annotations

import re

import pytest
import torch
import torch.nn.functional as F
import transformers

from ligermodels import CausalLM
from ligermodels.hf_io import hf_tensors
from tests.test_models import CASES, _batch, hub_layout, make_hf_checkpoint
from tests.utils import rel_err

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="bf16 numerics on the GPU: needs CUDA")

RATIO = 1.5  # ours may be at most this many times further from fp32 than transformers-bf16 is
FLOOR = 1e-6  # absolute slack, so that two (near) exact results do not fail on 0 <= 1.5 * 0
IGNORE = -100

#: Wider than the CPU cases: 16 heads keep head_dim 16 (the longrope factors' length) where the case
#: does not set head_dim itself; GQA ratios, biases, tying, rope and sliding windows are the case's own.
WIDER = dict(vocab_size=512, hidden_size=256, intermediate_size=512, num_attention_heads=16)
BATCH, SEQ = 4, 64  # SEQ = the cases' max_position_embeddings; far longer than their windows (5)
GRAD_BATCHES = 4  # batches with backward: logits, per-token losses and gradients are compared over all of them
LOSS_BATCHES = 64  # batches whose mean loss is compared (the first GRAD_BATCHES ones and forward-only ones)


def gpu_case(case: str) -> tuple[str, dict]:
    """(HF config class name, kwargs) of a test_models case, widened by WIDER."""
    cls_name, kwargs = CASES[case]
    return cls_name, {**kwargs, **WIDER}


def _load_hf(directory: str, dtype: torch.dtype, device: str):
    """transformers' model from the checkpoint in ``dtype``: sdpa attention, or eager where sdpa is refused or
    would compute other math: attention-logit soft-capping (Gemma 2), which some transformers 5 releases' sdpa
    path drops without a word (5.17 did: every output of the soft-capped case then differed from ours)."""
    config = transformers.AutoConfig.from_pretrained(directory)
    if getattr(config, "attn_logit_softcapping", None) is None:
        try:
            return transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=dtype,
                                                                     attn_implementation="sdpa").to(device).eval()
        except (ValueError, ImportError):
            pass
    model = transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=dtype, attn_implementation="eager")
    return model.to(device).eval()


def _token_losses(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """fp32 per-token losses of (B, S, V) logits: position t predicts labels[:, t + 1] (as HF's loss does)."""
    return F.cross_entropy(logits[:, :-1].float().flatten(0, 1), labels[:, 1:].flatten(), ignore_index=IGNORE,
                           reduction="none")


def _run_hf(model, ids: torch.Tensor, labels: torch.Tensor, backward: bool = True) -> dict:
    model.zero_grad(set_to_none=True)
    with torch.set_grad_enabled(backward):
        out = model(input_ids=ids, labels=labels)
    if not backward:
        return {"loss": out.loss.float()}
    out.loss.backward()
    logits = out.logits.detach()
    return {"logits": logits, "token_loss": _token_losses(logits, labels), "loss": out.loss.detach().float(),
            "grads": hub_layout({name: p.grad.clone() for name, p in model.named_parameters()},
                                model.config.model_type)}


def _run_ours(model: CausalLM, ids: torch.Tensor, labels: torch.Tensor, backward: bool = True) -> dict:
    model.zero_grad(set_to_none=True)
    if not backward:
        with torch.no_grad():
            return {"loss": model.loss(ids, labels).float()}
    b, s = ids.shape
    with torch.no_grad():
        logits = model(ids)
        token_loss = model.loss(ids, labels, reduction="none").view(b, s)[:, :-1].flatten()
    loss = model.loss(ids, labels)
    loss.backward()
    grads = {name: g.clone() for name, g in hf_tensors({n: p.grad for n, p in model.named_parameters()},
                                                        model.config)}
    return {"logits": logits, "token_loss": token_loss, "loss": loss.detach().float(), "grads": grads}


def _stack(runs: list[dict], key: str) -> torch.Tensor:
    return torch.stack([r[key].flatten() for r in runs])


def compare_bf16_with_transformers(case: str, directory: str, device: str = "cuda", batch: int = BATCH,
                                   seq: int = SEQ, grad_batches: int = GRAD_BATCHES,
                                   loss_batches: int = LOSS_BATCHES) -> dict[str, tuple[float, float]]:
    """{what: (error of ours-bf16, error of transformers-bf16)}, both against transformers-fp32.

    ``what`` is "logits", "token_loss", "loss" or "grad <HF parameter name>"; each error is the
    relative error of all ``grad_batches`` batches together (``loss_batches`` for "loss": the vector
    of the batches' mean losses). Writes the checkpoint into ``directory``.
    """
    cls_name, kwargs = gpu_case(case)
    make_hf_checkpoint((cls_name, kwargs), directory)
    models = {"ref": _load_hf(directory, torch.float32, device), "hf": _load_hf(directory, torch.bfloat16, device),
              "ours": CausalLM.from_hf(directory, dtype=torch.bfloat16, device=device)}
    assert all(p.dtype == torch.bfloat16 and p.device.type == torch.device(device).type
               for p in models["ours"].parameters())
    runs: dict[str, list[dict]] = {name: [] for name in models}
    for k in range(max(grad_batches, loss_batches)):
        ids, labels = _batch(kwargs["vocab_size"], batch=batch, seq=seq, seed=1 + k)
        ids, labels = ids.to(device), labels.to(device)
        for name, model in models.items():
            run = _run_ours if name == "ours" else _run_hf
            runs[name].append(run(model, ids, labels, backward=k < grad_batches))

    ref, hf, ours = runs["ref"], runs["hf"], runs["ours"]
    errs = {}
    for what in ("logits", "token_loss"):
        r, h, o = (_stack(x[:grad_batches], what) for x in (ref, hf, ours))
        assert o.shape == r.shape, (what, o.shape, r.shape)
        errs[what] = (rel_err(o, r), rel_err(h, r))
    r, h, o = (_stack(x[:loss_batches], "loss") for x in (ref, hf, ours))
    errs["loss"] = (rel_err(o, r), rel_err(h, r))
    names = set(ref[0]["grads"])
    assert set(ours[0]["grads"]) == names == set(hf[0]["grads"])
    # A mixture-of-experts layer's experts count as one tensor per projection: which tokens' top-k picks bf16
    # rounding flips (in either implementation) moves gradient between experts, so one expert's error is noise
    groups: dict[str, list[str]] = {}
    for name in sorted(names):
        groups.setdefault(re.sub(r"experts\.\d+\.", "experts.*.", name), []).append(name)
    for group, members in groups.items():
        r, h, o = (torch.stack([torch.cat([x["grads"][n].flatten() for n in members]) for x in runs_[:grad_batches]])
                   for runs_ in (ref, hf, ours))
        assert o.shape == r.shape, group
        errs[f"grad {group}"] = (rel_err(o, r), rel_err(h, r))
    return errs


@pytest.fixture
def fp32_matmuls_exact():
    """fp32 matmuls in full precision (no TF32) for the reference, restored afterwards."""
    before = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("highest")
    yield
    torch.set_float32_matmul_precision(before)


@pytest.mark.parametrize("case", list(CASES))
def test_bf16_no_worse_than_transformers_bf16(case, tmp_path, fp32_matmuls_exact):
    windows = [w for w in (CASES[case][1].get("sliding_window"),) if w]
    assert all(w < SEQ for w in windows)
    errs = compare_bf16_with_transformers(case, str(tmp_path), device="cuda")
    table = "\n".join(f"  {what:55s} ours {o:.3e}  hf-bf16 {h:.3e}  ratio {o / max(h, 1e-30):.2f}"
                      for what, (o, h) in errs.items())
    print(f"{case}: error against transformers-fp32, ours-bf16 vs transformers-bf16 (pytest -s shows this)\n{table}")
    bad = [what for what, (o, h) in errs.items() if not o <= RATIO * h + FLOOR]
    assert not bad, f"{case}: error against transformers-fp32 above {RATIO} x transformers-bf16's for {bad}\n{table}"
