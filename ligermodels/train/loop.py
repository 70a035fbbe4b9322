"""The training run, in the order it goes: checks -> inputs -> model, sharded -> optimiser and schedule ->
resume -> the step loop -> HF export.

Global batch. A step consumes ``G = batch_size * world_size * grad_accum`` packed rows
(:mod:`ligermodels.train.data`): rows ``R .. R + G - 1`` where ``R`` counts the rows consumed so far,
micro-batch ``m`` of rank ``r`` taking rows ``R + (m * world_size + r) * batch_size`` onward. So the global
batch is the same rows however it is split, and its loss is the same (:mod:`ligermodels.train.objectives`):
one rank with ``grad_accum=2`` and two ranks with ``grad_accum=1`` take the same steps.

The host reads a step's numbers (loss, gradient norm: a sync) only once the next step is queued behind it,
so the GPU never waits for the host between steps; a step due for a checkpoint, and the last, are read at
once (a non-finite one never reaches a checkpoint or ``final/``).
"""

from __future__ import annotations

import dataclasses
import math
import os
import time
from functools import partial

import torch
import torch.distributed as dist

from checkpoints_tools import CheckpointError
from ligermodels.cli import environment_error, print_error
from ligermodels.families import UnsupportedConfigError
from ligermodels.model import CausalLM
from ligermodels.train import demo
from ligermodels.train.checkpointing import (
    check_resume,
    export_hf,
    latest_checkpoint,
    load_checkpoint,
    load_reference_logps,
    prepare_out_dir,
    remove_previous_run,
    resume_inputs,
    save_checkpoint,
    save_reference_logps,
    train_state_record,
)
from ligermodels.train.config import TrainConfig, TrainError, parse_args
from ligermodels.train.cuda_graph import GraphedStep, check_cuda_graph
from ligermodels.train.data import DataError, PackedRows, load_inputs
from ligermodels.train.metrics import (
    MetricsLog,
    StepClock,
    check_reporters,
    flops_per_token,
    peak_flops,
    peak_memory_gb,
)
from ligermodels.train.objectives import PreferenceTask, SFTTask
from ligermodels.train.parallelize import (
    build_model,
    build_optimizer,
    embedding_sharding,
    loss_strategy,
    lr_factor,
    setup_distributed,
)
from ligermodels.train.preference import WITH_REFERENCE
from ligermodels.train.profiling import StepProfiler


def main(argv: list[str] | None = None) -> None:
    """The command line: every error a user can cause ends in one ``error:`` line and exit status 2."""
    config = parse_args(argv)
    rank = int(os.environ.get("RANK", 0))
    try:
        train(config)
    except (TrainError, DataError, CheckpointError, UnsupportedConfigError) as e:
        if rank == 0:  # every rank checks the inputs alike and stops with the same message
            print_error(str(e))
        raise SystemExit(2) from None
    except (ImportError, OSError, torch.OutOfMemoryError) as e:  # this rank's environment: named by this rank
        print_error(environment_error(e), rank)
        raise SystemExit(2) from None


def train(config: TrainConfig) -> str:
    """Run ``config`` and return the path of its ``OUT/final``.

    Under torchrun, joins its process group (NCCL on cuda, gloo on cpu); in a plain process, makes a group of
    one. A group already initialised by the caller is used as it is and left alone; one made here is torn down
    at the end. Bad input raises before training starts: TrainError, DataError, CheckpointError or
    UnsupportedConfigError, each naming the thing at fault.
    """
    made_group = not dist.is_initialized()
    rank, world, device = setup_distributed(config.device)
    try:
        if config.demo and config.objective != "sft":  # two stages, each a run in this group: see demo.py
            final = demo.preference_demo(config, train, rank)
        else:
            final = _run(config, rank, world, device)
        dist.barrier()  # no rank tears the group down while another still works (rank 0 exports, completes)
        return final
    finally:
        if made_group:
            dist.destroy_process_group()


def _run(config: TrainConfig, rank: int, world: int, device: torch.device) -> str:
    say = print if rank == 0 else (lambda *a, **k: None)
    t_start = time.perf_counter()
    # -- output directory, then the demo's generated inputs (written by rank 0 once all ranks checked)
    check_reporters(config)
    prepare_out_dir(config, rank)
    if config.demo:
        if rank == 0:
            demo.write_demo(os.path.join(config.out, "demo"), seed=config.seed)
        dist.barrier()

    # -- inputs: every rank reads and checks them the same way, so a bad input stops every rank
    inputs = load_inputs(config)
    found = latest_checkpoint(config.out) if config.resume else None
    resume_path, resume_state = found or (None, None)
    config = config.resolved(inputs.config.max_position_embeddings, resume_state)  # once; nothing changes it later
    # the embedding's sharding, resolved (and a vocab sharding it cannot take refused) before any work
    config = dataclasses.replace(config, shard_embedding=embedding_sharding(config, inputs.config, world))
    global_rows = config.batch_size * world * config.grad_accum
    fingerprint = resume_inputs(inputs, global_rows)
    if resume_state is not None:
        check_resume(resume_state, config, fingerprint, resume_path)
    if config.objective == "sft":
        task = SFTTask(config, PackedRows(inputs.documents, config.seq_len, config.seed))
    else:
        task = PreferenceTask(config, inputs.examples, loss_strategy(config, inputs.config, device), inputs.config)

    # -- model, optimiser, schedule
    check_cuda_graph(config, inputs.config, world, device)
    model = build_model(inputs, config, rank, world, device)
    dist.barrier()  # every rank has its inputs and weights: only now may --overwrite delete the old run
    if rank == 0 and config.overwrite:
        remove_previous_run(config)
    if config.objective in WITH_REFERENCE and config.reference == "model":  # LoRA: the base, adapters off
        task.reference_model = None if config.lora_rank else build_model(inputs, config, rank, world, device, True)
    optimizer = build_optimizer(model, config, world)  # one bf16 rank: the weights are bf16 from here on
    if config.objective in WITH_REFERENCE and config.reference == "precompute":  # the initial policy's, once
        if resume_state is not None:  # (after the cast above: step 1 has the reference equal to the policy)
            task.reference_logps = load_reference_logps(config.out, fingerprint, len(inputs.examples))
        else:
            task.reference_logps = task.compute_reference_logps(model, rank, world, device)
            if rank == 0:
                save_reference_logps(config.out, task.reference_logps, fingerprint)
    schedule = partial(lr_factor, schedule=config.lr_schedule, warmup=config.warmup_steps, steps=config.steps,
                       min_ratio=config.min_lr_ratio)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda i: schedule(i))
    torch.manual_seed(config.seed + rank)  # dropout, if the model has any: differs per rank, restored on resume
    step, rows_consumed = 0, 0
    if resume_state is not None:
        load_checkpoint(resume_path, model, optimizer, rank, device)
        scheduler.load_state_dict(resume_state["scheduler"])
        step, rows_consumed = resume_state["step"], resume_state["rows_consumed"]
        say(f"resumed from {resume_path} (step {step})")
    metrics = MetricsLog(config, rank, step if resume_state is not None else None)

    c = inputs.config
    flops, peak = flops_per_token(c, config.seq_len), peak_flops(device, config.dtype)
    say(f"{c.model_type}: {c.num_params() / 1e6:.2f}M parameters, {c.num_layers} layers, hidden {c.hidden_size} | "
        f"{task.describe(global_rows)} | {world} rank(s) on {device.type}, {config.dtype}"
        f"{', embedding sharded by vocabulary' if world > 1 and config.shard_embedding == 'vocab' else ''} | "
        f"steps {step + 1}..{config.steps} | "
        f"loss head: {loss_strategy(config, c, device)} | ready after {time.perf_counter() - t_start:.1f} s")

    # -- the loop
    max_norm = config.max_grad_norm if config.max_grad_norm > 0 else float("inf")
    profiler = StepProfiler(config.profile, config.steps, memory_trace=world == 1 and config.ac == "none",
                            stacks=config.profile_stacks == "on" or (config.profile_stacks == "auto" and world == 1))
    # The loop's only CPU tensor work is cutting rows (gathers of a few thousand ids). With intra-op
    # parallelism, OpenMP workers woke and spun for each: 39 ms of a 190 ms step went to them on an H100
    # host (16 cores), taken from the thread that launches the kernels. One thread does it in 0.2 ms.
    threads = torch.get_num_threads()
    if device.type == "cuda":
        torch.set_num_threads(1)
    graphed = GraphedStep(model, optimizer, task, device) if config.cuda_graph else None
    warned_eager = False
    pending: list[tuple[int, torch.Tensor, float, object, dict]] = []  # (step, stats, lr, end mark, counts)
    clock = StepClock(device)

    def read_step() -> None:
        """Wait for the oldest pending step, record its metrics, stop on a non-finite loss or norm."""
        done, stats, lr, end, counts = pending.pop(0)
        dt = clock.seconds(end)  # the sync: waits for this step's end, not for the step queued behind it
        loss_v, *sums, tokens_v, norm_v = stats.tolist()  # on the host by now
        profiler.after(done, os.path.join(config.out, "profile.txt"), rank)
        metrics.log({"step": done, "loss": loss_v, "lr": lr, "grad_norm": norm_v, "tokens": int(tokens_v),
                     "tokens_per_s": counts["tokens"] / dt,
                     "mfu": None if peak is None else flops * counts["tokens"] / dt / (peak * world),
                     "peak_mem_gb": peak_memory_gb(device), **task.metrics(sums, counts)})
        if not (math.isfinite(loss_v) and math.isfinite(norm_v)):
            raise TrainError(f"step {done}: the loss is {loss_v} and the gradient norm {norm_v}; stopping before "
                             "non-finite weights reach a checkpoint or final/ (lower --lr, or check the data)")

    try:
        while step < config.steps:
            profiler.before(step + 1, device)
            micro, counts = task.batches(rows_consumed, rank, world, device)
            lr = scheduler.get_last_lr()[0]
            replay = graphed.inputs(micro[0], counts) if graphed is not None else None
            if replay is not None:  # --cuda-graph: the whole step, replayed
                loss_sum, grad_norm = graphed(replay, max_norm)
            else:
                if graphed is not None and not warned_eager:
                    say(f"step {step + 1}: {task.graph_misfit}: run eagerly (warned once)")
                    warned_eager = True
                loss_sum = 0
                for batch in micro:
                    loss_sum = loss_sum + task.forward_backward(model, batch, counts, world, device)
                    if config.grad_accum > 1:
                        optimizer.accumulate_grads_()  # low-precision gradients summed in fp32
                grad_norm = optimizer.clip_grad_norm_(max_norm)  # the next step() scales the gradients
                optimizer.step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            dist.all_reduce(loss_sum)
            step, rows_consumed = step + 1, rows_consumed + global_rows
            if pending:
                read_step()  # the previous step, now that this one is queued
            # the step's numbers go to pinned host memory in the stream's order: reading them waits for this step's
            # end event only (a plain .tolist() would queue behind the next step and drain the GPU at every read)
            stats = torch.cat([loss_sum, counts["n_tokens"].float()[None], grad_norm.float()[None]])
            stats = stats.to("cpu", non_blocking=True)
            pending.append((step, stats, lr, clock.mark(), counts))
            due = config.save_every > 0 and (step % config.save_every == 0 or step == config.steps)
            if due or step == config.steps or profiler.wants(step):
                read_step()
            if due:
                state = train_state_record(config, step, rows_consumed, scheduler, world, fingerprint)
                save_checkpoint(config.out, step, model, optimizer, state, rank, device, config.keep_checkpoints)
            if not pending:  # read at once (and maybe a checkpoint or the profile after): the device is idle
                clock.restart()
    finally:
        torch.set_num_threads(threads)
        metrics.close()

    # -- export, and the demo's completions
    t_export = time.perf_counter()
    final = export_hf(model, inputs, config, rank)
    say(f"wrote {final} in {time.perf_counter() - t_export:.1f} s")
    if config.demo and rank == 0:  # with LoRA the demo's random base lives in OUT/merged only (it needs --merge)
        plain = CausalLM.from_hf(os.path.join(config.out, "merged") if config.lora_rank else final,
                                 dtype=torch.float32)
        demo.print_completions(plain, inputs.tokenizer, inputs.bos, inputs.eos)
    return final
