"""What a training run is asked to do: :class:`TrainConfig`, from Python or from the command line.

``TrainConfig`` is a frozen dataclass; its fields are the CLI's flags (``--seq-len`` is ``seq_len``), and their
help texts are the flags' help. :func:`parse_args` reads the command line, then the ``--config`` JSON file
(flags on the command line win), into one. Construction fills the defaults that need no input (the demo's
or a run's, below, and the device and dtype) and checks every value, raising :class:`TrainError` naming the
flag. Two values need the inputs and are resolved once, by :meth:`TrainConfig.resolved`, before training
starts: the default ``seq_len`` (from the model's ``max_position_embeddings``) and the default
``warmup_steps`` (the checkpoint's when resuming). Nothing changes a config after that.

The demo (no ``model`` and no ``data``) trains the tiny Llama of :mod:`ligermodels.train.demo` on the corpus and
tokenizer it writes to ``OUT/demo/``.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import math
import os
import types
import typing
from dataclasses import dataclass, field

import torch

from kernels.fp8 import fp8_supported
from kernels.nf4 import nf4_supported
from ligermodels.lora import LoRAError, normalize_targets


class TrainError(RuntimeError):
    """A problem with the run's flags, inputs or output directory, found before training starts."""


def _flag(default, help: str, choices: tuple[str, ...] | None = None):
    """A TrainConfig field: its default, the flag's help, and its choices for a string."""
    return field(default=default, metadata={"help": help, "choices": choices})


#: Defaults of the demo (no --model and no --data) and of a run on your data, for the fields left None.
DEMO_DEFAULTS = dict(out="runs/demo", seq_len=128, batch_size=16, steps=600, lr=3e-3, warmup_steps=20,
                     save_every=200, log_every=50, dtype="fp32")
RUN_DEFAULTS = dict(batch_size=1, steps=1000, lr=2e-5, warmup_steps=50, save_every=500, log_every=10)
#: --ac: activation checkpointing modes, from most memory to least (ligermodels.train.parallelize).
AC_MODES = ("none", "selective", "lean", "full")
#: Reporters --report-to takes, by the package each needs.
REPORTERS = {"tensorboard": "tensorboard", "wandb": "wandb"}


@dataclass(frozen=True)
class TrainConfig:
    """A training run. ``None`` means the default: see :data:`DEMO_DEFAULTS` and :data:`RUN_DEFAULTS`, and each
    field's help (``python -m ligermodels.train --help``)."""

    model: str | None = _flag(None, "HF checkpoint: local directory or hub repo id (config.json, safetensors, "
                                    "tokenizer.json)")
    from_scratch: bool = _flag(False, "random init from --model's config.json instead of loading its weights")
    data: str | None = _flag(None, "JSON-lines file of {\"text\"}, {\"prompt\", \"completion\"} or {\"messages\"} "
                                   "records")
    out: str | None = _flag(None, "output directory (checkpoints, metrics.jsonl, final/)")
    chat_loss: str = _flag("assistant", "conversations ({\"messages\"} lines): the loss on the assistant turns, or on "
                                        "every token", ("assistant", "all"))
    objective: str = _flag("sft", "what the run optimises: sft (next-token cross-entropy), or a preference objective "
                                  "as TRL computes it: dpo, orpo, simpo ({\"prompt\", \"chosen\", \"rejected\"} "
                                  "lines), kto ({\"prompt\", \"completion\", \"label\"} lines)",
                           ("sft", "dpo", "orpo", "simpo", "kto"))
    beta: float = _flag(0.1, "dpo, kto, simpo: the inverse temperature beta; orpo: the odds-ratio term's weight "
                             "lambda (TRL's beta)")
    dpo_loss: str = _flag("sigmoid", "dpo: TRL's loss_type (ipo: the log-ratios per completion token; robust: "
                                     "--label-smoothing is the probability that a preference is flipped)",
                          ("sigmoid", "hinge", "ipo", "robust"))
    label_smoothing: float = _flag(0.0, "dpo with --dpo-loss robust, and simpo: the label smoothing epsilon")
    simpo_gamma: float = _flag(0.5, "simpo: the target reward margin gamma")
    cpo_alpha: float = _flag(0.0, "simpo: weight of the chosen completions' NLL added to the loss (TRL's cpo_alpha; "
                                  "SimPO itself has none, TRL's CPOConfig defaults to 1.0)")
    desirable_weight: float = _flag(1.0, "kto: weight of the desirable examples' losses")
    undesirable_weight: float = _flag(1.0, "kto: weight of the undesirable examples' losses")
    reference: str = _flag("precompute", "dpo, kto: the reference log-probs: precompute = one pass of the initial "
                                         "model over the data before training, kept in OUT/reference_logps."
                                         "safetensors and reused on resume; model = a frozen copy run every step "
                                         "(bf16 on cuda, no gradients, sharded as the policy). With LoRA the "
                                         "reference is the base with the adapters off, never a copy",
                           ("precompute", "model"))
    prompt_pass: str = _flag("once", "dpo, orpo, simpo: run a pair's prompt (its chosen and rejected sequences' "
                                      "common prefix) through the model once, attention still seeing each "
                                      "sequence whole, and only the positions a loss reads through the head: the "
                                      "same log-probs as twice (as TRL runs it), less work; under --cuda-graph "
                                      "padded to fixed sizes", ("once", "twice"))
    seq_len: int | None = _flag(None, "tokens per packed row, at most the model's max_position_embeddings "
                                      "(default for a run: min(2048, that))")
    batch_size: int | None = _flag(None, "rows per rank per micro-batch (preference objectives: examples, each "
                                         "packed into one row without padding)")
    grad_accum: int = _flag(1, "micro-batches per optimiser step")
    steps: int | None = _flag(None, "optimiser steps in total")
    lr: float | None = _flag(None, "peak learning rate")
    lr_schedule: str = _flag("cosine", "decay after warmup (to lr * min-lr-ratio)", ("cosine", "linear", "constant"))
    min_lr_ratio: float = _flag(0.1, "final lr / peak lr for cosine and linear")
    warmup_steps: int | None = _flag(None, "linear warmup steps (default: the run's, at most --steps; a resumed "
                                           "run keeps its checkpoint's)")
    weight_decay: float = _flag(0.1, "AdamW weight decay on matrices (not on norms and biases)")
    max_grad_norm: float = _flag(1.0, "clip the global gradient norm to this (0: no clipping)")
    seed: int = _flag(0, "seed of the data order and of a from-scratch init")
    save_every: int | None = _flag(None, "checkpoint every N steps and at the end (0: never)")
    keep_checkpoints: int = _flag(3, "keep the newest N checkpoints (0: all)")
    resume: bool = _flag(False, "continue from the newest checkpoint in --out")
    overwrite: bool = _flag(False, "delete a previous run's checkpoints/metrics in --out")
    ac: str = _flag("none", "activation checkpointing per layer: full recomputes the layer; selective keeps "
                            "matmul/attention outputs; lean keeps them but the gate/up projection's (less memory, "
                            "more flops)", AC_MODES)
    loss_strategy: str = _flag("auto", "loss head (kernels.fused_linear_cross_entropy): tokens = fastest; vocab = "
                                       "one more GEMM, no fp32 (vocab, hidden) weight-gradient buffer (less memory "
                                       "for large vocabularies); auto (default) = vocab where that buffer would take "
                                       "1/32 of the device's memory and the head is trained, else tokens",
                               ("auto", "tokens", "vocab"))
    lora_rank: int = _flag(0, "LoRA: train rank-R adapters on the frozen base (0: full fine-tuning); OUT/final is "
                              "then the adapter in PEFT's format")
    lora_alpha: float = _flag(16.0, "LoRA scale numerator: the adapters' output is scaled by alpha / rank")
    lora_dropout: float = _flag(0.0, "LoRA: dropout probability on the adapters' input")
    lora_targets: str = _flag("q,k,v,o,gate,up,down", "LoRA: comma-separated projections among q,k,v,o,gate,up,"
                                                      "down (PEFT's q_proj ... accepted), and experts (every "
                                                      "expert's weights of a mixture-of-experts model)")
    merge: bool = _flag(False, "LoRA: also write OUT/merged, the base with the adapters folded in, as a plain HF "
                               "checkpoint")
    fp8: str = _flag("none", "run the decoder layers' projections in FP8 (kernels.fp8): rowwise = forward, input- and "
                             "weight-gradient GEMMs on e4m3 operands with one power-of-two scale per row along "
                             "each GEMM's reduction dim; rowwise-e5m2 = output gradients in e5m2; rowwise-gw-bf16 = "
                             "weight gradients in bf16. With LoRA the frozen base's GEMMs run in FP8, the "
                             "adapters' in bf16. Needs compute capability 8.9+ (Ada, Hopper) on CUDA",
                     ("none", "rowwise", "rowwise-e5m2", "rowwise-gw-bf16"))
    quantize: str = _flag("none", "LoRA on a 4-bit base (QLoRA): nf4 stores the frozen decoder projections in NF4 "
                                  "with double-quantised block maxima (bitsandbytes' format; kernels.nf4), quantised "
                                  "on the device while loading; the adapters, embeddings, norms and head as without. "
                                  "On several ranks FSDP2 shards the 4-bit base too",
                          ("none", "nf4"))
    attention: str = _flag("documents", "documents: a token attends within its own document of the packed row; "
                                        "causal: across the whole row (as transformers' SDPA path without position "
                                        "ids)", ("documents", "causal"))
    dtype: str | None = _flag(None, "compute dtype (master weights are fp32); default bf16 on cuda (the demo: "
                                    "fp32)", ("bf16", "fp32"))
    device: str | None = _flag(None, "default cuda when present (NCCL), else cpu (gloo)", ("cuda", "cpu"))
    log_every: int | None = _flag(None, "print a progress line every N steps (metrics.jsonl gets every step)")
    report_to: str = _flag("", "also log each step's metrics to these, comma-separated: tensorboard (OUT/tensorboard), "
                               "wandb (Weights & Biases; its project from WANDB_PROJECT, default ligermodels); "
                               "metrics.jsonl is always written")
    profile: bool = _flag(False, "profile two steps after the first five with torch.profiler: OUT/profile.txt and "
                                 "OUT/profile.json (rank 0)")
    profile_stacks: str = _flag("auto", "--profile: record Python stacks (they name the host waits and the launch "
                                        "sites of the GPU's idle gaps, but slow the host, so that a host-bound step "
                                        "reads slower than it runs); auto: on one rank only",
                                ("auto", "on", "off"))
    cuda_graph: bool = _flag(False, "capture the training step (forward, backward, clipping, AdamW) once as a CUDA "
                                    "graph and replay it, so the GPU never waits for the host: one CUDA rank, "
                                    "--grad-accum 1, bf16; masked attention (documents, windows) through "
                                    "kernels.document_attention or FlashAttention-2's variable-length kernel, not "
                                    "FlexAttention; no soft-capping. A preference objective pads every micro-batch to "
                                    "the longest that distinct examples of the data make")
    graph_documents: int = _flag(16, "--cuda-graph: room for this many documents per row in the captured step; a "
                                     "batch with more runs eagerly. Room costs at head dims FlashAttention-2 takes "
                                     "(not 64 or 128): it launches blocks for every empty sequence of the padding")
    compile: bool = _flag(False, "torch.compile each decoder layer's forward (inside its activation checkpoint, "
                                 "outside FSDP's hooks)")
    reshard_after_forward: str = _flag("default", "FSDP2 (several ranks): free each layer's gathered weights after "
                                                  "its forward: default = every layer but the last (its backward "
                                                  "starts at once), always = every layer, never = keep them gathered "
                                                  "until backward (one all-gather per layer per step, the full bf16 "
                                                  "weights held through the forward)", ("default", "always", "never"))
    prefetch: int = _flag(0, "FSDP2 (several ranks): all-gather the next N layers ahead, in forward and backward "
                             "(0: FSDP2's own implicit prefetching)")
    shard_embedding: str = _flag("auto", "several ranks: gather = FSDP2 gathers the whole embedding table each step "
                                         "and reduce-scatters its gradient; vocab (SFT, an untied embedding) = each "
                                         "rank keeps its block of rows and looks up every rank's tokens in it "
                                         "(token ids and (tokens, hidden) rows are exchanged, not the table); auto = "
                                         "vocab where it measured faster (SFT, untied, ranks x --batch-size x "
                                         "--seq-len at most 0.3 of the vocabulary), else gather",
                                 ("auto", "gather", "vocab"))
    reduce_dtype: str = _flag("fp32", "FSDP2 (several ranks): the dtype gradients are reduce-scattered in: fp32 = "
                                      "each rank's gradient cast up and summed in fp32; bf16 = half the bytes "
                                      "through the collective and its copy-in, each partial sum rounded to bf16",
                              ("fp32", "bf16"))

    # ------------------------------------------------------------------------------ checks and defaults
    def __post_init__(self) -> None:
        set_ = lambda name, value: object.__setattr__(self, name, value)  # noqa: E731 (frozen: construction only)
        for f in dataclasses.fields(self):  # the types and choices the flags have
            value, kind = getattr(self, f.name), _kind(f)
            if value is None:
                continue
            if kind is float and isinstance(value, int) and not isinstance(value, bool):
                set_(f.name, value := float(value))
            if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
                raise TrainError(f"--{_dash(f.name)} must be {kind.__name__}, got {value!r}")
            if f.metadata["choices"] and value not in f.metadata["choices"]:
                raise TrainError(f"--{_dash(f.name)}: invalid choice {value!r} (choose from "
                                 f"{', '.join(map(repr, f.metadata['choices']))})")
        if (self.model is None) != (self.data is None):
            raise TrainError("give both --model and --data, or neither for the built-in demo")
        for name, value in (DEMO_DEFAULTS if self.demo else RUN_DEFAULTS).items():
            if getattr(self, name) is None and name != "warmup_steps":  # warmup: see resolved()
                set_(name, value)
        if self.out is None:
            raise TrainError("--out is required")
        if self.device is None:
            set_("device", "cuda" if torch.cuda.is_available() else "cpu")
        if self.dtype is None:
            set_("dtype", "bf16" if self.device == "cuda" else "fp32")
        self._check()
        try:
            set_("lora_targets", ",".join(normalize_targets(self.lora_targets.split(","))))
        except LoRAError as e:
            raise TrainError(f"--lora-targets: {e}") from None

    def _check(self) -> None:
        if self.device == "cuda" and not torch.cuda.is_available():
            raise TrainError("--device cuda, but no CUDA device is visible")
        lowest = dict(batch_size=1, grad_accum=1, steps=1, log_every=1, seq_len=2, warmup_steps=0, weight_decay=0,
                      max_grad_norm=0, save_every=0, keep_checkpoints=0, prefetch=0)  # seq_len 1: nothing to predict
        for name, low in lowest.items():
            value = getattr(self, name)
            if value is not None and not value >= low:  # `not >=` also refuses NaN
                raise TrainError(f"--{_dash(name)} must be at least {low}, got {value}")
        if not 0 < self.lr < math.inf:
            raise TrainError(f"--lr must be positive and finite, got {self.lr}")
        if not self.weight_decay < math.inf:
            raise TrainError(f"--weight-decay must be finite, got {self.weight_decay}")
        if not 0 <= self.seed < 2**32:
            raise TrainError(f"--seed must be in [0, 2**32), got {self.seed}")
        if not 0 <= self.min_lr_ratio <= 1:
            raise TrainError(f"--min-lr-ratio must be between 0 and 1, got {self.min_lr_ratio}")
        if self.warmup_steps is not None and self.warmup_steps > self.steps:
            raise TrainError(f"--warmup-steps {self.warmup_steps} exceeds --steps {self.steps}: the lr would never "
                             "reach --lr")
        if self.resume and self.overwrite:
            raise TrainError("--resume and --overwrite exclude each other")
        if self.lora_rank < 0:
            raise TrainError(f"--lora-rank must be at least 0 (0: no LoRA), got {self.lora_rank}")
        if not 0 <= self.lora_dropout < 1:
            raise TrainError(f"--lora-dropout must be in [0, 1), got {self.lora_dropout}")
        if not math.isfinite(self.lora_alpha):
            raise TrainError(f"--lora-alpha must be finite, got {self.lora_alpha}")
        if self.cuda_graph and self.grad_accum != 1:
            raise TrainError("--cuda-graph captures one micro-batch a step: it needs --grad-accum 1")
        if self.cuda_graph and self.compile:
            raise TrainError("--cuda-graph and --compile exclude each other (the graph already removes the host's "
                             "launches)")
        if self.cuda_graph and self.device == "cpu":
            raise TrainError("--cuda-graph replays a CUDA graph: it needs --device cuda")
        if self.graph_documents < 1:
            raise TrainError(f"--graph-documents must be at least 1, got {self.graph_documents}")
        if self.fp8 != "none" and self.compile:
            raise TrainError("--fp8 with --compile: the FP8 kernels do not compile under torch.compile's Inductor "
                             "yet; drop --compile (the FP8 step runs eagerly)")
        if self.fp8 != "none" and self.device == "cuda" and (why := fp8_supported(torch.device("cuda"))):
            raise TrainError(f"--fp8: {why}")
        if self.quantize != "none":
            if not self.lora_rank:
                raise TrainError(f"--quantize {self.quantize} freezes the base in 4 bits: it trains LoRA adapters on "
                                 "it and needs --lora-rank")
            for flag, on in (("--fp8", self.fp8 != "none"), ("--compile", self.compile)):
                if on:
                    raise TrainError(f"--quantize {self.quantize} with {flag}: not supported (the 4-bit base runs "
                                     "its GEMMs in the compute dtype, eagerly or in a CUDA graph)")
            if self.device == "cuda" and (why := nf4_supported(torch.device("cuda"))):
                raise TrainError(f"--quantize {self.quantize}: {why}")
        if self.merge and not self.lora_rank:
            raise TrainError("--merge folds LoRA adapters into the base: it needs --lora-rank")
        if self.lora_rank and self.random_init and not self.merge:
            raise TrainError("LoRA on a randomly initialised base (the demo, --from-scratch) needs --merge: OUT/final "
                             "holds only the adapter, and the random base is saved nowhere else")
        if self.objective != "sft" and self.attention != "documents":
            raise TrainError(f"--objective {self.objective} packs whole sequences into a row: it needs "
                             "--attention documents, so no sequence attends to another")
        if not 0 < self.beta < math.inf:
            raise TrainError(f"--beta must be positive and finite, got {self.beta}")
        if self.label_smoothing and not (self.objective == "simpo" or (self.objective, self.dpo_loss) == (
                "dpo", "robust")):
            raise TrainError("--label-smoothing applies to --objective simpo and to --objective dpo with --dpo-loss "
                             "robust only (the losses of TRL's that read label_smoothing)")
        if not 0 <= self.label_smoothing < 0.5:
            raise TrainError(f"--label-smoothing must be in [0, 0.5), got {self.label_smoothing}")
        for name in ("simpo_gamma", "cpo_alpha", "desirable_weight", "undesirable_weight"):
            if not (0 <= getattr(self, name) < math.inf):
                raise TrainError(f"--{_dash(name)} must be non-negative and finite, got {getattr(self, name)}")
        unknown = [r for r in self.reporters if r not in REPORTERS]
        if unknown:
            raise TrainError(f"--report-to: unknown {unknown} (choose from {', '.join(REPORTERS)})")

    # ------------------------------------------------------------------------------ derived
    @property
    def demo(self) -> bool:
        """The built-in demo: no --model and no --data."""
        return self.model is None and self.data is None

    @property
    def random_init(self) -> bool:
        """Whether the weights start random (the demo, --from-scratch) rather than from --model's."""
        return self.from_scratch or self.demo

    @property
    def model_source(self) -> str:
        """--model, or for the demo the model directory it writes (OUT/demo/model)."""
        return os.path.join(self.out, "demo", "model") if self.demo else self.model

    @property
    def data_file(self) -> str:
        """--data, or for the demo the corpus it writes (OUT/demo/data.jsonl)."""
        return os.path.join(self.out, "demo", "data.jsonl") if self.demo else self.data

    @property
    def reporters(self) -> list[str]:
        """The --report-to names."""
        return [r.strip() for r in self.report_to.split(",") if r.strip()]

    def seq_len_for(self, max_position_embeddings: int) -> int:
        """``--seq-len``, or its default min(2048, the model's ``max_position_embeddings``); refused above that."""
        seq_len = self.seq_len if self.seq_len is not None else min(2048, max_position_embeddings)
        if seq_len > max_position_embeddings:
            raise TrainError(f"--seq-len {seq_len} exceeds the model's max_position_embeddings "
                             f"({max_position_embeddings})")
        return seq_len

    def resolved(self, max_position_embeddings: int, checkpoint: dict | None = None) -> TrainConfig:
        """This config with the two values that need the inputs filled in, once, before training starts:
        ``seq_len`` (default min(2048, the model's ``max_position_embeddings``), refused above it) and
        ``warmup_steps`` (default: the resumed ``checkpoint``'s train_state, else the run's default, at most
        ``steps``)."""
        seq_len = self.seq_len_for(max_position_embeddings)
        warmup = self.warmup_steps
        if warmup is None and checkpoint is not None and "warmup_steps" in checkpoint:
            warmup = checkpoint["warmup_steps"]  # the run's own (its default fitted its --steps)
        elif warmup is None:
            warmup = min((DEMO_DEFAULTS if self.demo else RUN_DEFAULTS)["warmup_steps"], self.steps)
        return dataclasses.replace(self, seq_len=seq_len, warmup_steps=warmup)


def _dash(name: str) -> str:
    return name.replace("_", "-")


@functools.cache
def _hints() -> dict[str, object]:
    return typing.get_type_hints(TrainConfig)


def _kind(f: dataclasses.Field) -> type:
    """The value type of a TrainConfig field (its annotation without ``| None``)."""
    hint = _hints()[f.name]
    if isinstance(hint, types.UnionType):
        hint = next(t for t in typing.get_args(hint) if t is not type(None))
    return hint


# ---------------------------------------------------------------------------------------- command line
def build_parser() -> argparse.ArgumentParser:
    """The CLI: one flag per TrainConfig field (``--seq-len`` for ``seq_len``), plus ``--config``."""
    p = argparse.ArgumentParser(
        prog="python -m ligermodels.train", description="Train or fine-tune a decoder with FSDP2, on one process "
        "or many.", epilog="Defaults differ for the demo (no --model/--data) and a run on your data: demo "
        f"{DEMO_DEFAULTS}, run {RUN_DEFAULTS}. --config FILE.json holds any flag ({{\"lr\": 1e-4, \"seq-len\": 512}}); "
        "flags on the command line win.")
    p.add_argument("--config", help="JSON file of flag values (keys as the flags, with - or _)")
    for f in dataclasses.fields(TrainConfig):
        kind, meta = _kind(f), f.metadata
        if kind is bool:
            p.add_argument(f"--{_dash(f.name)}", action="store_true", default=None, help=meta["help"])
        else:
            p.add_argument(f"--{_dash(f.name)}", type=kind, choices=meta["choices"], help=meta["help"])
    return p


def parse_args(argv: list[str] | None = None) -> TrainConfig:
    """The TrainConfig of a command line: flags, then ``--config`` JSON values, then the defaults, in that
    priority. A bad value ends the process with the parser's usage and one ``error:`` line naming it."""
    p = build_parser()
    args = p.parse_args(argv)
    given = {f.name: getattr(args, f.name) for f in dataclasses.fields(TrainConfig)}
    if args.config:
        try:
            with open(args.config) as f:
                values = json.load(f)
        except (OSError, json.JSONDecodeError) as e:
            p.error(f"--config {args.config}: {e}")
        if not isinstance(values, dict):
            p.error(f"--config {args.config}: expected a JSON object of flag values")
        actions = {action.dest: action for action in p._actions}
        for key, value in values.items():
            name = key.replace("-", "_")
            if name not in given:
                p.error(f"--config {args.config}: unknown key {key!r}")
            if given[name] is None:
                given[name] = _config_value(actions[name], value, f"--config {args.config}: {key!r}", p)
    try:
        return TrainConfig(**{k: v for k, v in given.items() if v is not None})
    except TrainError as e:
        p.error(str(e))


def _config_value(action: argparse.Action, value, where: str, p: argparse.ArgumentParser):
    """A ``--config`` value converted as argparse converts the flag's text, so that it meets the same
    type and choices as on the command line (``"fp16"`` is refused for ``dtype``, ``"32"`` becomes 32;
    ``null`` means not given, and a whole float such as 1000.0 is taken for an int flag)."""
    if value is None:
        return None
    if action.type is int and isinstance(value, float) and value.is_integer():
        value = int(value)
    if action.nargs == 0:  # a store_true flag
        if not isinstance(value, bool):
            p.error(f"{where} must be true or false, got {value!r}")
        return value
    if isinstance(value, bool) or not isinstance(value, (str, int, float)):
        p.error(f"{where} must be a string or a number, got {value!r}")
    try:
        value = action.type(str(value)) if action.type else str(value)
    except ValueError:
        p.error(f"{where}: invalid {action.type.__name__} value {value!r}")
    if action.choices is not None and value not in action.choices:
        p.error(f"{where}: invalid choice {value!r} (choose from {', '.join(map(repr, action.choices))})")
    return value
