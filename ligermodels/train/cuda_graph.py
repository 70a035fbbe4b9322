"""A whole training step (forward, backward, optimiser update) captured once as a CUDA graph, then replayed:
:class:`CUDAGraphStep` for any single-GPU loop with fixed shapes, and :class:`GraphedStep`, the trainer's
``--cuda-graph`` step built on it.

Why: at small batches a step of a 1-2B model is host bound. Python, autograd and the launchers issue
a few thousand kernels per step, and the GPU waits for them: Qwen2-1.5B at batch 4 x 2048 on an H100
left the GPU idle 26 ms of a 178 ms step (benchmarks/results/profiles). A replay issues the whole
step with one call, so the GPU never waits for the host.

What a step may do (the usual CUDA-graph rules, checked where they can be):

* fixed shapes, dtypes and devices: every call passes tensors like the example ones; they are
  copied into static buffers the graph reads;
* no host synchronisation and no data-dependent Python branches (ligermodels' kernels and loss
  have none; ``.item()``, ``.tolist()`` or ``print(tensor)`` inside the step fail at capture);
* the optimiser is ``torch.optim.Adam`` or ``AdamW`` (``kernels.AdamW`` included) built with
  ``capturable=True`` (its step count and bias corrections then live on the GPU). A learning rate
  that changes between steps must be a CUDA tensor (``lr=torch.tensor(3e-4, device="cuda")``;
  ``LRScheduler`` then updates it in place); a Python float is baked into the graph at capture.

Gradients are overwritten by every replay, not accumulated: the captured backward starts from
``.grad = None``. Warm-up runs the step a few times on a side stream (it builds the optimiser's state,
cuBLAS workspaces and Triton kernels, none of which may be created inside a capture) with a learning
rate of 0 (the parameters do not move), then puts the optimiser's state back as it was (state that
warm-up created starts at zero, as Adam's does), so the first replay is the next real update: the
parameters and the optimiser end up exactly as after the same number of eager steps, for a fresh
optimiser or one resumed from a checkpoint. A float lr changed after the capture is refused at the next
call rather than ignored.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from kernels import AdamW
from kernels.moe import grouped_gemm_device
from ligermodels.attention import flash_varlen_takes, to_device, triton_documents_takes
from ligermodels.config import DecoderConfig
from ligermodels.model import CausalLM
from ligermodels.train.config import TrainConfig, TrainError


def _set_lrs(optimizer: torch.optim.Optimizer, lrs: list) -> None:
    for group, lr in zip(optimizer.param_groups, lrs, strict=True):
        if isinstance(group["lr"], torch.Tensor):
            group["lr"].fill_(lr)
        else:
            group["lr"] = lr


def warm_up(optimizer: torch.optim.Optimizer, step: Callable[[], object], steps: int) -> None:
    """Run ``step()`` (forward, backward, ``optimizer.step()``) ``steps`` times at learning rate 0, leaving the
    parameters and the optimiser as they were: Adam's update is scaled by the lr (weight decay too), so
    the parameters do not move; the optimiser state that existed is put back (kept on the host meanwhile)
    and state created here starts at zero, as Adam's does. Both are restored even if a step raises."""
    lrs = [lr.clone() if isinstance(lr, torch.Tensor) else lr for lr in (g["lr"] for g in optimizer.param_groups)]
    saved = {p: {k: v.detach().to("cpu", copy=True) for k, v in st.items() if isinstance(v, torch.Tensor)}
             for p, st in optimizer.state.items()}
    try:
        _set_lrs(optimizer, [0.0] * len(lrs))
        for _ in range(steps):
            optimizer.zero_grad(set_to_none=True)
            step()
    finally:
        _set_lrs(optimizer, lrs)
        for p, state in optimizer.state.items():
            for key, value in state.items():
                if isinstance(value, torch.Tensor):
                    old = saved.get(p, {}).get(key)
                    if old is None:
                        value.zero_()
                    else:
                        value.copy_(old)


class CUDAGraphStep:
    """``step(*inputs) -> loss``: one optimiser step of ``loss_fn(*inputs)``, replayed from a CUDA graph.

    Args:
        loss_fn: ``(*inputs) -> scalar loss`` (e.g. ``model.loss``); called only during warm-up and capture.
        optimizer: ``torch.optim.Adam`` / ``AdamW`` over the parameters, with ``capturable=True``.
        example_inputs: CUDA tensors with the shapes, dtypes and device of every later call's inputs.
        warmup: eager warm-up steps (learning rate 0) before the capture.
        after_backward: called between the backward and ``optimizer.step()`` (e.g. gradient clipping,
            ``kernels.AdamW.clip_grad_norm_``); what it returns is kept as ``self.after_backward_out``,
            overwritten by every call like the loss.
    Returns (on call):
        the loss of this step, a 0-dim tensor that the next call overwrites (``.clone()`` it to keep it).
    """

    def __init__(self, loss_fn: Callable[..., torch.Tensor], optimizer: torch.optim.Optimizer,
                 *example_inputs: torch.Tensor, warmup: int = 3,
                 after_backward: Callable[[], object] | None = None):
        if not isinstance(optimizer, (torch.optim.Adam, torch.optim.AdamW)):
            raise TypeError(f"CUDAGraphStep supports torch.optim.Adam and AdamW, got {type(optimizer).__name__}")
        if not all(group["capturable"] for group in optimizer.param_groups):
            raise ValueError("CUDAGraphStep needs the optimiser built with capturable=True")
        for i, x in enumerate(example_inputs):
            if not isinstance(x, torch.Tensor) or x.device.type != "cuda":
                raise ValueError(f"CUDAGraphStep: input {i} must be a CUDA tensor, got "
                                 f"{x.device if isinstance(x, torch.Tensor) else type(x).__name__}")
        if warmup < 1:
            raise ValueError("CUDAGraphStep needs at least one warm-up step (it builds the optimiser state)")
        self.optimizer = optimizer
        self.inputs = [x.detach().clone() for x in example_inputs]
        self.graph = torch.cuda.CUDAGraph()

        self.after_backward_out = None

        def step() -> torch.Tensor:
            loss = loss_fn(*self.inputs)
            loss.backward()
            if after_backward is not None:
                self.after_backward_out = after_backward()
            optimizer.step()
            return loss.detach()

        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            warm_up(optimizer, step, warmup)
        torch.cuda.current_stream().wait_stream(side)
        optimizer.zero_grad(set_to_none=True)
        self.float_lrs = [g["lr"] for g in optimizer.param_groups]  # baked into the graph when floats
        with torch.cuda.graph(self.graph):
            self.loss = step()

    def __call__(self, *inputs: torch.Tensor) -> torch.Tensor:
        if len(inputs) != len(self.inputs):
            raise ValueError(f"CUDAGraphStep was captured with {len(self.inputs)} inputs, got {len(inputs)}")
        for i, (static, x) in enumerate(zip(self.inputs, inputs, strict=True)):
            if x.shape != static.shape or x.dtype != static.dtype:
                raise ValueError(f"CUDAGraphStep input {i}: captured as {tuple(static.shape)} {static.dtype}, "
                                 f"got {tuple(x.shape)} {x.dtype}")
            static.copy_(x, non_blocking=True)
        for i, (group, captured) in enumerate(zip(self.optimizer.param_groups, self.float_lrs, strict=True)):
            if not isinstance(captured, torch.Tensor) and group["lr"] != captured:
                raise ValueError(f"CUDAGraphStep: param group {i}'s lr changed from {captured} to {group['lr']}, "
                                 "but a float lr is baked into the graph; give the optimiser a CUDA tensor lr")
        self.graph.replay()
        return self.loss


# ------------------------------------------------------------------------------------------ the trainer's step
def check_cuda_graph(config: TrainConfig, model: DecoderConfig, world: int, device: torch.device) -> None:
    """TrainError naming what ``--cuda-graph`` cannot capture: several ranks, fp32, mixture-of-experts layers off
    sm90, or masked attention (documents, a window shorter than ``--seq-len``, soft-capping) that would run through
    FlexAttention or the dense fallback. The graph takes the masked attention this package's Triton kernel runs
    (:func:`kernels.document_attention`, at the head dims of ``ligermodels.attention.triton_documents_takes``) and
    FlashAttention-2's variable-length kernel (other head dims); soft-capped attention (Gemma 2) is refused: its
    capture has not been checked against the eager step on a GPU."""
    if not config.cuda_graph:
        return
    if world > 1:
        raise TrainError(f"--cuda-graph runs on one rank (the step's collectives are not captured); this run has "
                         f"{world}")
    if config.dtype != "bf16":
        raise TrainError("--cuda-graph needs --dtype bf16 (the attention kernels it captures run in bf16 only)")
    if model.num_experts and not (grouped_gemm_device(device) and model.hidden_size % 8 == 0
                                  and model.moe_intermediate_size % 8 == 0):
        raise TrainError(f"--cuda-graph captures {model.model_type}'s mixture-of-experts layers only on an sm90+ GPU "
                         "with hidden and expert sizes multiples of 8 (elsewhere the experts' GEMMs read the "
                         "per-expert token counts on the host); leave out --cuda-graph")
    kind = (torch.bfloat16, model.head_dim, model.attention_dropout)
    windowed = any(w is not None and w < config.seq_len for w in model.layer_windows)
    if model.attn_softcap is not None:
        raise TrainError(f"--cuda-graph does not capture {model.model_type}'s soft-capped attention; leave out "
                         "--cuda-graph")
    if config.attention == "documents" or windowed:
        what = "attention within documents" if config.attention == "documents" else "windowed attention"
        captured = triton_documents_takes(device, *kind) or flash_varlen_takes(device, *kind)
    else:
        return  # plain causal attention: SDPA
    if not captured:
        dropout = f", attention dropout {model.attention_dropout}" if model.attention_dropout else ""
        raise TrainError(f"--cuda-graph: {model.model_type}'s {what} (head_dim {model.head_dim}{dropout}) runs through "
                         "FlexAttention or the dense fallback, which the graph does not capture; leave out "
                         "--cuda-graph")


class GraphedStep:
    """``--cuda-graph``: the training step (forward, backward, clipping, AdamW) captured once as a CUDA graph
    (:class:`CUDAGraphStep`) and replayed, so the GPU never waits for the host. Eagerly,
    a Qwen2-1.5B step (batch 4 x 2048, H100) left the GPU idle 39 ms of 193 (benchmarks/results/profiles).

    The capture fixes the shapes; the task (:class:`~ligermodels.train.objectives.SFTTask` or
    :class:`~ligermodels.train.objectives.PreferenceTask`) makes every micro-batch alike in its ``graph_inputs``: SFT
    pads the documents' bounds to ``--graph-documents`` sequences per row (a batch with more runs eagerly:
    :meth:`inputs` gives None); a preference objective pads each packed row to the longest that distinct examples of the
    data make, with documents that no sum reads (with each pair's prompt once, the model's row, the attention row, the
    repeats and the head rows each to its own size: ``ligermodels.train.preference.SharedRoom``; a longer micro-batch,
    an example repeated across an epoch boundary, runs eagerly). Its ``graph_loss`` is the eager step's loss from the
    captured buffers, with the step's stats (loss and metric sums) beside it. Each param group's learning rate lives in
    a device tensor that every call fills from the schedule's float. The first call captures (three warm-up steps at
    learning rate 0 first, which leave the weights and the optimiser as they were), then replays: every step is the
    eager step's arithmetic."""

    def __init__(self, model: CausalLM, optimizer: AdamW, task, device: torch.device):
        self.model, self.optimizer, self.task, self.device = model, optimizer, task, device
        self.lrs = [torch.tensor(float(g["lr"]), device=device) for g in optimizer.param_groups]
        self.graph: CUDAGraphStep | None = None
        self.stats: torch.Tensor | None = None

    def loss(self, *inputs: torch.Tensor) -> torch.Tensor:
        """The step's loss from the captured buffers; its stats kept in :attr:`stats` (the capture's last)."""
        loss, self.stats = self.task.graph_loss(self.model, *inputs)
        return loss

    def inputs(self, micro, counts: dict) -> list[torch.Tensor] | None:
        """A micro-batch as the graph's inputs (pinned host tensors, device counts), or None when it does not fit
        the captured shapes."""
        return self.task.graph_inputs(micro, counts)

    def __call__(self, inputs: list[torch.Tensor], max_norm: float) -> tuple[torch.Tensor, torch.Tensor]:
        """One step on ``inputs`` (:meth:`inputs`): (stats: the loss and the task's metric sums, gradient norm
        before clipping), device tensors that the next call overwrites."""
        groups = self.optimizer.param_groups
        for lr, group in zip(self.lrs, groups, strict=True):
            lr.fill_(group["lr"])
        if self.graph is None:
            floats = [g["lr"] for g in groups]
            for lr, group in zip(self.lrs, groups, strict=True):  # captured as tensors: the schedule fills them
                group["lr"], group["capturable"] = lr, True
            try:
                self.graph = CUDAGraphStep(self.loss, self.optimizer, *(to_device(t, self.device) for t in inputs),
                                           after_backward=lambda: self.optimizer.clip_grad_norm_(max_norm))
            finally:
                for f, group in zip(floats, groups, strict=True):
                    group["lr"] = f
        self.graph(*inputs)
        return self.stats, self.graph.after_backward_out
