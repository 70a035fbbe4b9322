"""What a training step's loss is. Supervised fine-tuning: the next-token cross-entropy of the packed rows'
labelled tokens, summed and divided by the number of labelled tokens in the whole global batch.

Every micro-batch calls ``model.loss(..., num_items=N)`` with ``N`` that global count (counted on the host per
micro-batch, summed, all-reduced), and its loss is multiplied by ``world_size`` before backward to undo FSDP's
average over ranks: the gradient is exactly ``d(sum of token losses) / N`` however the global batch is split
over ranks and accumulation steps.
"""

from __future__ import annotations

import torch

from ligermodels.attention import Documents, to_device
from ligermodels.model import CausalLM
from ligermodels.train.config import TrainConfig
from ligermodels.train.parallelize import loss_strategy


def sft_loss(model: CausalLM, config: TrainConfig, input_ids: torch.Tensor, labels: torch.Tensor,
             positions: torch.Tensor, num_items: torch.Tensor, documents: Documents | None) -> torch.Tensor:
    """The loss of one micro-batch (B, S) already on the device (eager, and inside ``--cuda-graph``'s capture):
    the summed token losses over ``num_items``, with the loss head :func:`loss_strategy` picks."""
    return model.loss(input_ids, labels, num_items=num_items, position_ids=positions, document_ids=documents,
                      strategy=loss_strategy(config, model.config, input_ids.device))


def forward_backward(model: CausalLM, input_ids: torch.Tensor, labels: torch.Tensor, positions: torch.Tensor,
                     num_items: torch.Tensor, config: TrainConfig, world: int, device: torch.device
                     ) -> torch.Tensor:
    """One micro-batch of host rows (B, S): moved to ``device``, its :func:`sft_loss` and backward; returns the
    loss, detached."""
    # the documents' bounds are found here, on the host, so attention needs no device-to-host copy
    documents = Documents.from_positions(positions).to(device) if config.attention == "documents" else None
    input_ids, labels, positions = (to_device(t, device) for t in (input_ids, labels, positions))
    loss = sft_loss(model, config, input_ids, labels, positions, num_items, documents)
    (loss * world).backward()  # FSDP divides the summed gradients by world: this undoes it
    return loss.detach()
