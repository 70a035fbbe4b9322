"""Train or fine-tune a decoder with FSDP2, on one process or many.

    python -m ligermodels.train                      # the demo: a small Llama from scratch, CPU or GPU
    torchrun --nproc-per-node 8 -m ligermodels.train --model Qwen/Qwen2.5-0.5B --data train.jsonl \\
        --out runs/qwen --seq-len 4096 --batch-size 2 --grad-accum 4 --steps 2000 --lr 2e-5

or from Python, with the same options and checks:

    from ligermodels.train import TrainConfig, train
    train(TrainConfig(model="Qwen/Qwen2.5-0.5B", data="train.jsonl", out="runs/qwen", seq_len=4096))

The package, in the order a run uses it: ``config`` (TrainConfig, the command line), ``data`` (JSON lines
-> packed rows), ``parallelize`` (activation checkpointing, FSDP2, optimiser, loss head), ``objectives``
(the micro-batch loss), ``checkpointing`` (resume rules, checkpoints, the HF export), ``metrics``,
``profiling`` (``--profile``), ``cuda_graph`` (``--cuda-graph``), ``demo``; ``loop`` runs them.
"""

from ligermodels.train.config import TrainConfig, TrainError, parse_args
from ligermodels.train.loop import main, train

__all__ = ["TrainConfig", "TrainError", "parse_args", "train", "main"]
