"""Every family in bf16 on the GPU: no further from transformers-fp32 than transformers-bf16 is (x1.5).

For each case of :mod:`tests.test_models` (the same tiny random ``save_pretrained`` checkpoints,
made a little wider so that bf16 errors average over more elements), three models run on the same
random tokens, longer than every sliding window of the cases:

* ``ref``: transformers in fp32 (the reference), ``attn_implementation="sdpa"``, fp32 matmuls
  without TF32;
* ``hf``: transformers in bf16 (weights cast from the same fp32 checkpoint), sdpa;
* ``ours``: ``CausalLM.from_hf(dir, dtype=torch.bfloat16, device="cuda")``.

Compared, as ``||out - ref|| / ||ref||`` in fp64 (``tests.utils.rel_err``): the logits, the per-token
next-token losses, the mean loss (``model.loss(ids, labels)`` against HF's ``labels=`` loss) and the
gradient of every parameter (ours mapped to HF names through the key map, as in test_models). Each
must satisfy ``err(ours) <= 1.5 * err(hf) + 1e-6``.

The mean loss is one number, whose rounding error is a sum of many per-token errors of either sign:
transformers-bf16 can land close to the reference by luck, so for it ``err(hf)`` is taken as the
larger of HF's realised error and the error that HF's per-token errors make in a mean of that many
tokens when they cancel no more than chance would: RMS(per-token error) / sqrt(tokens), relative.
"""

from __future__ import annotations


import pytest
import torch
import torch.nn.functional as F
import transformers

from checkpoints_tools import hf_tensors
from ligermodels import CausalLM
from tests.test_models import CASES, _batch, make_hf_checkpoint
from tests.utils import rel_err

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="bf16 numerics on the GPU: needs CUDA")

RATIO = 1.5  # ours may be at most this many times further from fp32 than transformers-bf16 is
FLOOR = 1e-6  # absolute slack, so that two (near) exact results do not fail on 0 <= 1.5 * 0
IGNORE = -100

#: Wider than the CPU cases: 16 heads keep head_dim 16 (the longrope factors' length) where the case
#: does not set head_dim itself; GQA ratios, biases, tying, rope and sliding windows are the case's own.
WIDER = dict(vocab_size=512, hidden_size=256, intermediate_size=512, num_attention_heads=16)
BATCH, SEQ = 4, 64  # SEQ = the cases' max_position_embeddings; far longer than their windows (5)


def gpu_case(case: str) -> tuple[str, dict]:
    """(HF config class name, kwargs) of a test_models case, widened by WIDER."""
    cls_name, kwargs = CASES[case]
    return cls_name, {**kwargs, **WIDER}


def _load_hf(directory: str, dtype: torch.dtype, device: str):
    """transformers' model from the checkpoint in ``dtype``: sdpa attention, or eager where sdpa is refused."""
    try:
        model = transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=dtype, attn_implementation="sdpa")
    except (ValueError, ImportError):
        model = transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=dtype, attn_implementation="eager")
    return model.to(device).eval()


def _token_losses(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """fp32 per-token losses of (B, S, V) logits: position t predicts labels[:, t + 1] (as HF's loss does)."""
    return F.cross_entropy(logits[:, :-1].float().flatten(0, 1), labels[:, 1:].flatten(), ignore_index=IGNORE,
                           reduction="none")


def _run_hf(model, ids: torch.Tensor, labels: torch.Tensor) -> dict:
    out = model(input_ids=ids, labels=labels)
    out.loss.backward()
    logits = out.logits.detach()
    return {"logits": logits, "token_loss": _token_losses(logits, labels), "loss": out.loss.detach().float(),
            "grads": {name: p.grad for name, p in model.named_parameters()}}


def _run_ours(model: CausalLM, ids: torch.Tensor, labels: torch.Tensor) -> dict:
    b, s = ids.shape
    with torch.no_grad():
        logits = model(ids)
        token_loss = model.loss(ids, labels, reduction="none").view(b, s)[:, :-1].flatten()
    loss = model.loss(ids, labels)
    loss.backward()
    grads = dict(hf_tensors({name: p.grad for name, p in model.named_parameters()}, model.config))
    return {"logits": logits, "token_loss": token_loss, "loss": loss.detach().float(), "grads": grads}


def compare_bf16_with_transformers(case: str, directory: str, device: str = "cuda", batch: int = BATCH,
                                   seq: int = SEQ) -> dict[str, tuple[float, float]]:
    """{what: (err of ours-bf16, err of transformers-bf16)}, both against transformers-fp32.

    ``what`` is "logits", "token_loss", "loss" or "grad <HF parameter name>". For "loss" the second
    value is already the chance-adjusted HF error of the module docstring. Writes the checkpoint into
    ``directory``.
    """
    cls_name, kwargs = gpu_case(case)
    make_hf_checkpoint((cls_name, kwargs), directory)
    ids, labels = _batch(kwargs["vocab_size"], batch=batch, seq=seq)
    ids, labels = ids.to(device), labels.to(device)

    ref = _run_hf(_load_hf(directory, torch.float32, device), ids, labels)
    hf = _run_hf(_load_hf(directory, torch.bfloat16, device), ids, labels)
    ours_model = CausalLM.from_hf(directory, dtype=torch.bfloat16, device=device)
    assert all(p.dtype == torch.bfloat16 and p.device.type == torch.device(device).type
               for p in ours_model.parameters())
    ours = _run_ours(ours_model, ids, labels)

    errs = {}
    for what in ("logits", "token_loss"):
        assert ours[what].shape == ref[what].shape, (what, ours[what].shape, ref[what].shape)
        errs[what] = (rel_err(ours[what], ref[what]), rel_err(hf[what], ref[what]))

    keep = labels[:, 1:].flatten() != IGNORE
    hf_tok_err = (hf["token_loss"] - ref["token_loss"])[keep].double()
    chance = hf_tok_err.norm().item() / keep.sum().item() / abs(ref["loss"].item())  # RMS / sqrt(n), relative
    errs["loss"] = (rel_err(ours["loss"], ref["loss"]), max(rel_err(hf["loss"], ref["loss"]), chance))

    assert set(ours["grads"]) == set(ref["grads"]) == set(hf["grads"])
    for name, g in ref["grads"].items():
        assert ours["grads"][name].shape == g.shape, name
        errs[f"grad {name}"] = (rel_err(ours["grads"][name], g), rel_err(hf["grads"][name], g))
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
    bad = [what for what, (o, h) in errs.items() if not o <= RATIO * h + FLOOR]
    assert not bad, f"{case}: error against transformers-fp32 above {RATIO} x transformers-bf16's for {bad}\n{table}"
