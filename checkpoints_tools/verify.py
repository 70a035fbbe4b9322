"""The reference side of ``python -m ligermodels.verify``: what transformers computes for a checkpoint.

transformers reads the same safetensors files (``use_safetensors=True``), never runs remote code, and
runs its eager attention: the plain statement of each model's attention math. Its other paths can
compute something else; for example its SDPA path for Gemma 2 (transformers 5.17) leaves out the
attention-logit soft-capping that the model's config asks for.
"""

from __future__ import annotations

import torch

from checkpoints_tools.hub import CheckpointError

#: transformers' attention implementation the reference runs (see the module docstring).
REFERENCE_ATTENTION = "eager"

#: Default tolerance on the logits' relative error, by dtype: about 10x the relative logit error of a correct
#: load of tiny random models in that dtype (fp32 ~3e-7, fp16 ~1e-3, bf16 ~7e-3: both sides round differently),
#: yet below what a wrong config field gives (e.g. rms_norm_eps 1e-6 instead of 1e-5 gives ~1e-3 in fp32).
DEFAULT_TOL = {torch.float32: 1e-4, torch.float16: 5e-3, torch.bfloat16: 3e-2}


def reference_logits(directory: str, input_ids: torch.Tensor, dtype: torch.dtype,
                     device: str | torch.device) -> tuple[torch.Tensor, str]:
    """(logits (B, S, V) in float64 on the host, the transformers version) of the checkpoint in ``directory``
    on ``input_ids`` (B, S), computed by transformers in ``dtype`` on ``device`` with eager attention.
    ImportError when transformers is not installed; CheckpointError when it cannot load the checkpoint."""
    import transformers

    try:
        model = transformers.AutoModelForCausalLM.from_pretrained(
            directory, dtype=dtype, use_safetensors=True, trust_remote_code=False,
            attn_implementation=REFERENCE_ATTENTION).to(device).eval()
    except (OSError, ValueError, RuntimeError, NotImplementedError) as e:
        raise CheckpointError(f"transformers cannot load {directory}: {e}") from e
    with torch.no_grad():
        logits = model(input_ids=input_ids.to(device)).logits
    return logits.double().cpu(), transformers.__version__


def relative_error(ours: torch.Tensor, ref: torch.Tensor) -> float:
    """||ours - ref|| / ||ref|| in float64 (NaN when ``ours`` holds a NaN)."""
    ours, ref = ours.double().cpu(), ref.double().cpu()
    return ((ours - ref).norm() / ref.norm()).item()
