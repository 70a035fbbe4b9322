"""A run's files: the output directory's checks, resume rules, checkpoints, and the final HF export.

Checkpoints (``--save-every``): ``OUT/checkpoints/step_XXXXXXXX/`` holds the model and optimiser
(``torch.distributed.checkpoint``, sharded: each rank writes its shards, and a run may resume on
another number of ranks), ``train_state.json`` (step, rows consumed, LR schedule, the data
settings) and ``rng_rankNNNNN.pt`` (each rank's RNG). It is written as ``step_XXXXXXXX.tmp`` and
renamed when every rank's files are on disk, so ``--resume`` (which takes the newest
``step_XXXXXXXX``) never sees a half-written one (leftover ``*.tmp`` are deleted at start). A
resumed run repeats the uninterrupted run's steps exactly (it must repeat the flags of
:data:`RESUME_FLAGS`); ``--keep-checkpoints`` prunes old ones.
``OUT/final/`` is an HF checkpoint (config.json, safetensors, tokenizer files), written to a temporary
directory and renamed into place; with LoRA it is the adapter in PEFT's format, and ``--merge`` writes
``OUT/merged`` too.
"""

from __future__ import annotations

import dataclasses
import glob
import hashlib
import json
import os
import re
import shutil
from array import array

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from safetensors import safe_open
from safetensors.torch import save_file
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_optimizer_state_dict,
    set_state_dict,
)

from kernels import AdamW
from ligermodels.hf_io import save_hf_state
from ligermodels.lora import export_lora
from ligermodels.model import CausalLM
from ligermodels.train.config import TrainConfig, TrainError
from ligermodels.train.data import Inputs
from ligermodels.train.parallelize import nf4_state


def complete_checkpoints(out: str) -> list[tuple[int, str]]:
    """(step, path) of the finished checkpoints in ``out``, oldest first (``*.tmp`` are never finished)."""
    root = os.path.join(out, "checkpoints")
    found = []
    for name in os.listdir(root) if os.path.isdir(root) else []:
        m = re.fullmatch(r"step_(\d+)", name)
        if m and os.path.isfile(os.path.join(root, name, "train_state.json")):
            found.append((int(m[1]), os.path.join(root, name)))
    return sorted(found)


def prepare_out_dir(config: TrainConfig, rank: int) -> None:
    """:func:`check_out_dir` on every rank; then rank 0 deletes what a crash left half-written, which is never
    read: checkpoints (``step_*.tmp``) and exports (``.final.tmp-*``, ``.merged.tmp-*`` and the ``.old-*``
    directories of a replaced one)."""
    check_out_dir(config)
    dist.barrier()
    if rank == 0:
        stale = [*glob.glob(os.path.join(config.out, "checkpoints", "step_*.tmp")),
                 *(p for export in ("final", "merged") for kind in ("tmp", "old")
                   for p in glob.glob(os.path.join(config.out, f".{export}.{kind}-*")))]
        for path in stale:
            shutil.rmtree(path, ignore_errors=True)


def remove_previous_run(config: TrainConfig) -> None:
    """--overwrite: delete the previous run's checkpoints and exports (rank 0, once every rank has its inputs
    and weights, so a bad input leaves the previous run in place)."""
    for what in ("checkpoints", "final", "merged"):
        shutil.rmtree(os.path.join(config.out, what), ignore_errors=True)
    if os.path.isfile(path := os.path.join(config.out, REFERENCE_FILE)):
        os.remove(path)


def check_out_dir(config: TrainConfig) -> None:
    """Refuse to write into a directory holding another run, unless told to --resume or --overwrite it,
    and an --out that is not a directory or cannot be created or written."""
    if os.path.exists(config.out) and not os.path.isdir(config.out):
        raise TrainError(f"--out {config.out} exists and is not a directory")
    existing = config.out
    while not os.path.exists(existing):  # the nearest existing ancestor: where the run's directories are made
        existing = os.path.dirname(os.path.abspath(existing))
    if not os.access(existing, os.W_OK | os.X_OK):
        raise TrainError(f"--out {config.out}: {existing} is not writable")
    used = [what for what in ("checkpoints", "final", "metrics.jsonl")
            if os.path.exists(os.path.join(config.out, what))]
    if used and not (config.resume or config.overwrite):
        raise TrainError(f"--out {config.out} already holds a run ({', '.join(used)}): pass --resume to continue it, "
                         "--overwrite to replace it, or choose another --out")
    if config.resume and used and not complete_checkpoints(config.out):  # starting over would overwrite that run
        raise TrainError(f"--resume: {config.out} holds a run ({', '.join(used)}) but no complete checkpoint in "
                         f"{os.path.join(config.out, 'checkpoints')}; pass --overwrite to start it again")


#: Flags a checkpoint records and a resumed run must repeat: they fix the data order and the lr of every
#: step, and the restored optimiser and scheduler states carry the old lr (--steps: see check_resume).
RESUME_FLAGS = ("seq_len", "seed", "lr", "lr_schedule", "warmup_steps", "min_lr_ratio", "steps", "weight_decay",
                "lora_rank", "lora_alpha", "lora_dropout", "lora_targets", "objective", "beta", "dpo_loss",
                "label_smoothing", "simpo_gamma", "cpo_alpha", "desirable_weight", "undesirable_weight", "reference")
#: What else a resumed run must keep (recorded in train_state.json, checked by value, so a run or data
#: file that moved still resumes): the tokenized data set (--data through --model's tokenizer, in file
#: order), the model's architecture, and the rows per step (batch size x ranks x grad-accum); with the
#: seed and --seq-len they fix the rows every later step reads.
RESUME_INPUTS = {"data_sha256": "the tokenized --data (SHA-256)", "model_sha256": "--model's config (SHA-256)",
                 "data_documents": "documents in --data", "data_tokens": "tokens in --data (with --model's tokenizer)",
                 "global_rows": "--batch-size x ranks x --grad-accum"}  # the counts: what older checkpoints hold


#: DecoderConfig fields added after checkpoints were first written: left out of the config hash while at their
#: defaults, so the runs of models without them resume as before.
_LATER_FIELDS = ("qk_norm", "post_norms", "attn_softcap", "final_softcap", "rope_interleaved", "local_rope",
                 "num_experts", "experts_per_token", "moe_intermediate_size", "norm_topk_prob", "dense_layers",
                 "output_router_logits", "router_aux_loss_coef")


def resume_inputs(inputs: Inputs, global_rows: int) -> dict:
    """The RESUME_INPUTS values of this run: hashes of the tokenized documents and of the model config."""
    data = hashlib.sha256()
    for example in inputs.examples or []:  # a preference objective's sequences, prompt lengths and labels
        for seq in (*example.sequences, *([example.kl] if example.kl is not None else [])):
            data.update(array("q", [len(seq.ids), seq.prompt_len, *seq.ids]).tobytes())
        data.update(repr(example.label).encode())
    for doc in inputs.documents:
        data.update(array("q", [len(doc.ids), doc.no_loss, *doc.ids]).tobytes())
        if doc.mask is not None:  # a conversation: which tokens carry the loss
            data.update(bytes(doc.mask))
    c = inputs.config
    config = {f.name: getattr(c, f.name) for f in dataclasses.fields(c)
              if f.name != "hf_config" and not (f.name in _LATER_FIELDS and getattr(c, f.name) == f.default)}
    return {"data_sha256": data.hexdigest(), "model_sha256": hashlib.sha256(repr(config).encode()).hexdigest(),
            "data_documents": len(inputs.documents or inputs.examples),
            "data_tokens": sum(len(d.ids) for d in inputs.documents) + sum(
                len(s.ids) for e in inputs.examples or [] for s in e.sequences),
            "global_rows": global_rows}


def _place(path: str) -> str:
    """A path as recorded in train_state.json (for the reader; resume checks values, not paths): absolute
    when it exists here, a hub repo id as given."""
    return os.path.abspath(path) if os.path.exists(path) else path


def check_resume(train_state: dict, config: TrainConfig, inputs: dict, path: str) -> None:
    """Refuse to resume ``path`` with flags other than those it was written with (see RESUME_FLAGS).

    --steps may change under the constant schedule only: cosine and linear decay over --steps.
    Checkpoints written before a flag was recorded do not hold it, and are not checked for it. Also
    refused: a checkpoint past --steps, and other data or another global batch (``inputs``: this run's
    :data:`RESUME_INPUTS` values, from :func:`resume_inputs`). ``config`` is resolved
    (:meth:`TrainConfig.resolved`: a default warmup is the checkpoint's).
    """
    if train_state.get("step", 0) > config.steps:
        raise TrainError(f"{path} is at step {train_state['step']}, past --steps {config.steps}")
    for key, what in RESUME_INPUTS.items():
        if train_state.get(key) is not None and inputs.get(key) is not None and train_state[key] != inputs[key]:
            raise TrainError(f"{path} was written for {what} = {train_state[key]}; this run has {inputs[key]}: "
                             "resume with the same model, data and global batch (another changes what every "
                             "later step trains on)")
    for key in RESUME_FLAGS:
        if key == "steps" and config.lr_schedule == "constant":
            continue
        if key in train_state and train_state[key] != getattr(config, key):
            raise TrainError(f"{path} was written with --{key.replace('_', '-')} {train_state[key]}; "
                             f"resume with the same value (got {getattr(config, key)})")


def latest_checkpoint(out: str) -> tuple[str, dict] | None:
    """(path, train_state) of the newest complete checkpoint in ``out``, or None."""
    found = complete_checkpoints(out)
    if not found:
        return None
    path = found[-1][1]
    with open(os.path.join(path, "train_state.json")) as f:
        return path, json.load(f)


def train_state_record(config: TrainConfig, step: int, rows_consumed: int,
                       scheduler: torch.optim.lr_scheduler.LRScheduler, world: int, inputs: dict) -> dict:
    """What ``train_state.json`` records: the data position and schedule, the flags and inputs a resume must
    repeat (:data:`RESUME_FLAGS`, :data:`RESUME_INPUTS`), and where the model and data came from."""
    return {"step": step, "rows_consumed": rows_consumed, "scheduler": scheduler.state_dict(),
            **{key: getattr(config, key) for key in RESUME_FLAGS}, "world_size": world, **inputs,
            "model": _place(config.model_source), "data": _place(config.data_file)}


# ------------------------------------------------------------------------------------------ reference log-probs
#: A preference run's reference log-probs (``--reference precompute``), in OUT: (examples, 2) fp32
REFERENCE_FILE = "reference_logps.safetensors"


def save_reference_logps(out: str, logps: torch.Tensor, inputs: dict) -> None:
    """Write the reference log-probs with the data hash they belong to, atomically (rank 0)."""
    os.makedirs(out, exist_ok=True)
    path = os.path.join(out, REFERENCE_FILE)
    save_file({"reference_logps": logps.contiguous()}, path + ".tmp", metadata={"data_sha256": inputs["data_sha256"]})
    os.replace(path + ".tmp", path)


def load_reference_logps(out: str, inputs: dict, examples: int) -> torch.Tensor:
    """The reference log-probs a resumed run stored before its first step; refused when missing or written for
    other data (the policy has moved since: they cannot be recomputed from it)."""
    path = os.path.join(out, REFERENCE_FILE)
    if not os.path.isfile(path):
        raise TrainError(f"--resume: {path} is missing: the reference log-probs were computed by the model before "
                         "its first step and cannot be recomputed now; start again with --overwrite")
    with safe_open(path, "pt") as f:
        if (f.metadata() or {}).get("data_sha256") != inputs["data_sha256"]:
            raise TrainError(f"--resume: {path} was computed for other data")
        logps = f.get_tensor("reference_logps")
    if logps.shape != (examples, 2):
        raise TrainError(f"--resume: {path} holds {tuple(logps.shape)} log-probs for {examples} examples")
    return logps


# ------------------------------------------------------------------------------------------ checkpoints
def rng_state(device: torch.device) -> dict:
    return {"cpu": torch.get_rng_state(), "cuda": torch.cuda.get_rng_state(device) if device.type == "cuda" else None}


def save_checkpoint(out: str, step: int, model: CausalLM, optimizer: torch.optim.Optimizer, train_state: dict,
                    rank: int, device: torch.device, keep: int) -> None:
    """Write ``OUT/checkpoints/step_N`` through ``step_N.tmp`` and a rename (see the module docstring)."""
    root = os.path.join(out, "checkpoints")
    final = os.path.join(root, f"step_{step:08d}")
    tmp = final + ".tmp"
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(tmp)
    dist.barrier()
    try:
        dcp.save(checkpoint_state(model, optimizer), checkpoint_id=tmp)
    except CheckpointException as e:  # a BaseException: would escape the CLI's handlers with a traceback
        raise TrainError(f"writing the checkpoint {tmp} failed ({failures(e)}); check the disk's free space "
                         "and permissions, then --resume from the previous checkpoint") from None
    torch.save(rng_state(device), os.path.join(tmp, f"rng_rank{rank:05d}.pt"))
    dist.barrier()  # every rank's files are on disk
    if rank == 0:
        with open(os.path.join(tmp, "train_state.json"), "w") as f:
            json.dump(train_state, f, indent=1)
            f.flush()
            os.fsync(f.fileno())
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)  # the commit: step_N exists only once it is complete
        fd = os.open(root, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        if keep > 0:  # renamed first: a checkpoint deleted part-way is a .tmp, never a step_N that looks complete
            for _, old in complete_checkpoints(out)[:-keep]:
                os.replace(old, old + ".tmp")
                shutil.rmtree(old + ".tmp", ignore_errors=True)
    dist.barrier()


def checkpoint_state(model: CausalLM, optimizer: AdamW) -> dict:
    """``{"model": weights, "optim": optimiser state}`` by parameter name, as torch.distributed.checkpoint
    saves and loads them. The weights are fp32 whatever the compute dtype: with master weights (one
    rank, bf16) the masters stand in for the bf16 parameters (and leave the optimiser's entries), so a
    checkpoint is the same on any number of ranks and resumes on any other."""
    model_sd, optim_sd = get_state_dict(model, optimizer)
    if has_frozen_base(model):  # LoRA: the frozen base is --model's, not saved
        model_sd = {k: v for k, v in model_sd.items() if k.endswith((".lora_A", ".lora_B"))}
    if optimizer.master_weights:  # fp32 weights joined on the host (no device memory), low bits left out
        masters = {p.data_ptr(): w for p, w in optimizer.master_params(device="cpu").items() if w is not p}
        model_sd = {name: masters.get(t.data_ptr(), t) for name, t in model_sd.items()}
        optim_sd["state"] = {name: {k: v for k, v in entry.items() if k != "master_lo"}  # (the live dicts: copies)
                             for name, entry in optim_sd["state"].items()}
    return {"model": model_sd, "optim": optim_sd}


def has_frozen_base(model: CausalLM) -> bool:
    """Whether some weights are frozen (LoRA): checkpoints then hold only the trained ones."""
    return any(not p.requires_grad for p in model.parameters())


def failures(e: CheckpointException) -> str:
    """Each failing rank's exception in one line (the exception's own text holds whole tracebacks)."""
    return "; ".join(f"rank {rank}: {type(exc).__name__}: {exc}" for rank, (exc, _) in sorted(e.failures.items()))


def load_checkpoint(path: str, model: CausalLM, optimizer: torch.optim.Optimizer, rank: int,
                    device: torch.device) -> None:
    """Load model, optimiser and this rank's RNG from a checkpoint directory (any number of ranks)."""
    optimizer.init_state_()  # the moments must exist to be loaded into
    state = checkpoint_state(model, optimizer)
    try:
        dcp.load(state, checkpoint_id=path)
    except CheckpointException as e:
        raise TrainError(f"the checkpoint {path} cannot be read ({failures(e)}): it is damaged; delete it to "
                         "--resume from the previous one, or start again with --overwrite") from None
    if optimizer.master_weights:  # the fp32 weights (loaded on the host) become the bf16 weights and low bits
        set_optimizer_state_dict(model, optimizer, state["optim"])
        params = {p.data_ptr(): p for p in model.parameters()}  # the state dict's tensors share their storage
        optimizer.load_masters_({params[t.data_ptr()]: state["model"][name]
                                 for name, t in get_model_state_dict(model).items() if t.data_ptr() in params})
    else:
        set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"],
                       options=StateDictOptions(strict=not has_frozen_base(model)))  # LoRA: adapters only
    rng_path = os.path.join(path, f"rng_rank{rank:05d}.pt")
    if os.path.isfile(rng_path):  # absent when resuming on more ranks than wrote it
        rng = torch.load(rng_path, weights_only=True)
        torch.set_rng_state(rng["cpu"])
        if device.type == "cuda" and rng["cuda"] is not None:
            torch.cuda.set_rng_state(rng["cuda"], device)


def export_hf(model: CausalLM, inputs: Inputs, config: TrainConfig, rank: int) -> str:
    """Gather the full weights to rank 0's host and write ``OUT/final`` as an HF checkpoint (in --dtype);
    with LoRA, ``OUT/final`` is the adapter (PEFT's format) and ``--merge`` writes ``OUT/merged``. Without
    ``--merge`` only the trained adapters are gathered: the frozen base (61 GB at Qwen3-30B-A3B) is not copied to
    the host."""
    out = os.path.join(config.out, "final")
    adapters_only = bool(config.lora_rank) and not config.merge
    state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True,
                                                                 ignore_frozen_params=adapters_only))
    if rank == 0:
        state = nf4_state(state, model)  # a sharded 4-bit base: its gathered bytes read back as NF4 weights
        dtype = torch.bfloat16 if config.dtype == "bf16" else torch.float32
        if config.lora_rank:  # the adapter in PEFT's format; --merge: also the merged model, in --dtype
            export_lora(model, state, out, tokenizer_from=inputs.tokenizer_dir)
            if config.merge:
                export_lora(model, state, os.path.join(config.out, "merged"), merge=True,
                            tokenizer_from=inputs.tokenizer_dir, dtype=dtype)
        else:
            save_hf_state({k: v.to(dtype) for k, v in state.items()}, inputs.config, out,
                          copy_from=inputs.tokenizer_dir)
    dist.barrier()
    return out
