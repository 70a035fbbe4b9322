"""What a run reports: one JSON line per optimiser step in ``OUT/metrics.jsonl``, a progress line, and the
``--report-to`` reporters (TensorBoard, Weights & Biases).

A metrics line: ``step`` (from 1), ``loss`` (the global batch's mean), ``lr`` (used by this step),
``grad_norm`` (before clipping), ``tokens`` (tokens with a label in the global batch), ``tokens_per_s``
(all input tokens of the global batch, over all ranks, per second of the step: on CUDA between events the
stream records at the end of consecutive steps, see :class:`StepClock`), ``mfu`` and ``peak_mem_gb`` (see
:func:`flops_per_token`, :func:`peak_memory_gb`). A non-finite value is written as null (strict JSON). A
resumed run's file keeps the lines up to its checkpoint and continues them.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import sys
import time

import torch

from ligermodels.config import DecoderConfig
from ligermodels.dependencies import importable
from ligermodels.train.config import REPORTERS, TrainConfig, TrainError

#: Dense bf16 peak FLOP/s per GPU, by a substring of the device name.
PEAK_BF16_FLOPS = {"H100": 989e12, "H200": 989e12, "A100": 312e12}


def flops_per_token(config: DecoderConfig, seq_len: int) -> float:
    """Training FLOPs per token: ``6 * N + 12 * L * (Hq * D) * S`` (PaLM, appendix B).

    ``N`` counts the parameters that multiply every token: all but the input embedding, with the
    output head counted once even when tied (its matmul runs). The second term is attention's two
    matmuls over a full ``S``-long context, as is customary (causal and document masks do less).
    """
    n = config.num_params(include_embedding=False, active=True) + config.vocab_size * config.hidden_size
    return 6 * n + 12 * config.num_layers * config.q_size * seq_len


def peak_flops(device: torch.device, dtype: str) -> float | None:
    """Peak dense FLOP/s of one device for this dtype, or None when unknown (then mfu is null)."""
    if device.type != "cuda" or dtype != "bf16":
        return None
    name = torch.cuda.get_device_name(device)
    return next((v for k, v in PEAK_BF16_FLOPS.items() if k in name), None)


def peak_memory_gb(device: torch.device) -> float:
    """Peak memory of this rank: allocated CUDA memory, or on the CPU the process's peak resident set."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 1e9
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6  # KiB on Linux


class StepClock:
    """Each step's time, between the moments the device finished consecutive steps.

    The loop reads a step's numbers only once the next step is queued, so the host's clock at a read says
    when the host got there, not when the device finished: timing reads against each other was right in
    the steady state but not for a step read at once (the last, a checkpoint's, the last profiled), which
    then measured only the tail of its own work (the last step of a host-bound run showed millions of
    tokens/s). On CUDA a step ends with an event on the stream and the time is the events' difference (GPU
    idle between them included, so it is still the loop's throughput); on the CPU, where a step has run when
    the call returns, a host clock read then. :meth:`restart` after a wait the next step should not pay
    for (a checkpoint written, the profile processed): the device is idle, so its next step starts now.
    """

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.last = self.mark()

    def mark(self) -> torch.cuda.Event | float:
        """The end of the work queued so far."""
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def seconds(self, mark: torch.cuda.Event | float) -> float:
        """Seconds from the previous step's mark to ``mark`` (waits for it), which becomes the previous."""
        if self.cuda:
            mark.synchronize()
            dt = self.last.elapsed_time(mark) / 1e3
        else:
            dt = mark - self.last
        self.last = mark
        return dt

    def restart(self) -> None:
        self.last = self.mark()


class Progress:
    """Rank 0's progress: a ``\\r`` status line on a terminal (kept every ``every`` steps), plain lines otherwise."""

    def __init__(self, total: int, every: int):
        self.total, self.every, self.tty = total, max(1, every), sys.stdout.isatty()

    def update(self, m: dict) -> None:
        line = (f"step {m['step']:>{len(str(self.total))}}/{self.total} | loss {m['loss']:.4f} | lr {m['lr']:.2e} "
                f"| grad norm {m['grad_norm']:.3f} | {m['tokens_per_s']:,.0f} tok/s")
        if m["mfu"] is not None:
            line += f" | mfu {100 * m['mfu']:.1f}%"
        keep = m["step"] % self.every == 0 or m["step"] == self.total or m["step"] == 1
        if self.tty:
            sys.stdout.write("\r" + line + "\x1b[K" + ("\n" if keep else ""))  # ESC[K: clear the rest
        elif keep:
            sys.stdout.write(line + "\n")
        sys.stdout.flush()


def metrics_up_to(path: str, step: int) -> list[str]:
    """The lines of a metrics.jsonl up to ``step``, read until the first line that does not parse (a line
    cut short by a crash or a full disk: everything after it is past the checkpoint being resumed)."""
    kept = []
    with open(path, encoding="utf-8", errors="replace") as f:
        for line in f:
            if not line.strip():
                continue
            try:
                line_step = json.loads(line)["step"]
            except (json.JSONDecodeError, KeyError, TypeError):
                break
            if line_step > step:
                break
            kept.append(line if line.endswith("\n") else line + "\n")
    return kept


def check_reporters(config: TrainConfig) -> None:
    """TrainError naming a ``--report-to`` reporter whose package is not installed (before any work starts)."""
    for name in config.reporters:
        package = REPORTERS[name]
        if not importable(package):
            raise TrainError(f"--report-to {name} needs the {package} package: pip install {package}")


class TensorBoard:
    """``--report-to tensorboard``: each metric as a scalar ``train/<name>`` in ``OUT/tensorboard``. A resumed run
    purges the events past its checkpoint, as metrics.jsonl drops those lines."""

    def __init__(self, config: TrainConfig, resumed_step: int | None):
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(os.path.join(config.out, "tensorboard"), flush_secs=10,
                                    purge_step=None if resumed_step is None else resumed_step + 1)

    def log(self, m: dict) -> None:
        for key, value in m.items():
            if key != "step" and value is not None:
                self.writer.add_scalar(f"train/{key}", value, m["step"])

    def close(self) -> None:
        self.writer.close()


class WandB:
    """``--report-to wandb``: a Weights & Biases run (project from ``WANDB_PROJECT``, default ``ligermodels``;
    named after OUT, files under OUT/wandb) logging each metric as ``train/<name>``, with the run's config."""

    def __init__(self, config: TrainConfig, resumed_step: int | None):
        import wandb

        self.run = wandb.init(project=os.environ.get("WANDB_PROJECT", "ligermodels"), dir=config.out,
                              name=os.path.basename(os.path.abspath(config.out)), config=dataclasses.asdict(config))

    def log(self, m: dict) -> None:
        self.run.log({f"train/{k}": v for k, v in m.items() if k != "step" and v is not None}, step=m["step"])

    def close(self) -> None:
        self.run.finish()


class MetricsLog:
    """Rank 0's record of every step (other ranks record nothing): a line of ``OUT/metrics.jsonl``, the progress
    line, and the reporters of ``--report-to``. A resumed run (``resumed_step``) keeps the file's lines up to its
    checkpoint (:func:`metrics_up_to`)."""

    def __init__(self, config: TrainConfig, rank: int, resumed_step: int | None):
        self.path = os.path.join(config.out, "metrics.jsonl")
        self.active = rank == 0
        self.progress = Progress(config.steps, config.log_every)
        self.reporters: list[TensorBoard | WandB] = []
        if not self.active:
            return
        old = metrics_up_to(self.path, resumed_step) if resumed_step is not None and os.path.isfile(self.path) else []
        os.makedirs(config.out, exist_ok=True)
        with open(self.path + ".tmp", "w") as f:  # then renamed: a kill here never leaves the file cut short
            f.writelines(old)
        os.replace(self.path + ".tmp", self.path)
        kinds = {"tensorboard": TensorBoard, "wandb": WandB}
        self.reporters = [kinds[name](config, resumed_step) for name in config.reporters]

    def log(self, m: dict) -> None:
        """Record one step's metrics ``m`` (the keys of the module docstring)."""
        if not self.active:
            return
        strict = {k: None if isinstance(v, float) and not math.isfinite(v) else v for k, v in m.items()}
        with open(self.path, "a") as f:
            f.write(json.dumps(strict, allow_nan=False) + "\n")
        self.progress.update(m)
        for reporter in self.reporters:
            reporter.log(strict)

    def close(self) -> None:
        for reporter in self.reporters:
            reporter.close()
