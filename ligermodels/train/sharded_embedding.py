"""``--shard-embedding vocab``: the input embedding split by vocabulary rows over the data-parallel ranks,
looked up where the rows live instead of gathered whole.

Under FSDP2 the embedding (V, H) sits in the root unit: every step starts by all-gathering the whole table
(1.05 GB in bf16 at Llama-3's 128256 x 4096) before any computation can hide it, and ends by reduce-scattering
its fp32 gradient (2.1 GB) after the last computation. A lookup needs only the rows of the batch's tokens,
so here each rank keeps its own contiguous block of rows (FSDP2's ``Shard(0)`` blocks, a DTensor the optimiser,
clipping and checkpoints treat as any FSDP2 shard) and:

- forward: all-gathers every rank's token ids (N x tokens int64), looks up the ids that fall in its block
  (zeros elsewhere: N x tokens x H) and reduce-scatters the sum, so each rank receives the rows of its own
  tokens. Exactly one rank holds each row, so the sum adds zeros only and is exact in any dtype.
- backward: all-gathers the output's gradient (N x tokens x H) and adds each of its rows into the rank's own
  block, in fp32, which is that block's gradient already reduced over the ranks: no (V, H) collective. It is
  divided by N, the mean FSDP2's reduce-scatter takes of every other gradient.

At 8192 tokens a rank and H = 4096 the collectives move N x 64 MB in bf16 each way, against 1.05 GB gathered
and 2.1 GB reduced. An untied embedding only: a tied one is the output head's weight as well, which every rank
needs whole.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.autograd.profiler import record_function
from torch.distributed.tensor import Shard, distribute_tensor


class _VocabShardedLookup(torch.autograd.Function):
    """rows (tokens..., H) of this rank's ``ids`` from ``block`` (rows [start, start + len(block)) of the
    table), the other rows coming from the ranks that hold them; see the module docstring."""

    @staticmethod
    def forward(ctx, ids: torch.Tensor, block: torch.Tensor, start: int, dtype: torch.dtype, padding_idx: int | None,
                group) -> torch.Tensor:
        with record_function("ligermodels::vocab_embedding_forward"):  # names its collectives in --profile
            return _VocabShardedLookup._forward(ctx, ids, block, start, dtype, padding_idx, group)

    @staticmethod
    def _forward(ctx, ids: torch.Tensor, block: torch.Tensor, start: int, dtype: torch.dtype, padding_idx: int | None,
                 group) -> torch.Tensor:
        world = dist.get_world_size(group)
        every = ids.new_empty((world * ids.shape[0], *ids.shape[1:]))  # rank r's ids: rows r*B .. (r+1)*B - 1
        dist.all_gather_into_tensor(every, ids.contiguous(), group=group)
        # Masks, not boolean indexing: no device-to-host sync (the host keeps queueing the layers' work)
        mine = (every >= start) & (every < start + block.shape[0])
        index = (every - start).clamp_(0, max(block.shape[0] - 1, 0))
        if block.shape[0]:  # cast the looked-up rows, not the block; zero the other blocks' rows in place
            rows = block[index].to(dtype).masked_fill_(~mine.unsqueeze(-1), 0)
        else:  # a rank past the last row (more ranks than blocks of ceil(V / N) rows)
            rows = block.new_zeros((*every.shape, block.shape[1]), dtype=dtype)
        out = rows.new_empty((*ids.shape, block.shape[1]))
        dist.reduce_scatter_tensor(out, rows, group=group)
        if padding_idx is not None:  # as nn.Embedding: the padding row gets no gradient
            mine &= every != padding_idx
        ctx.save_for_backward(index, mine)
        ctx.block_shape, ctx.block_dtype, ctx.group = block.shape, block.dtype, group
        return out

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        if not ctx.needs_input_grad[1]:
            return None, None, None, None, None, None
        with record_function("ligermodels::vocab_embedding_backward"):
            return None, _VocabShardedLookup._block_grad(ctx, grad_out), None, None, None, None

    @staticmethod
    def _block_grad(ctx, grad_out: torch.Tensor) -> torch.Tensor:
        """The block's gradient (its rows' sum over every rank's tokens, / N) from this rank's ``grad_out``."""
        index, mine = ctx.saved_tensors
        world = dist.get_world_size(ctx.group)
        every = grad_out.new_empty((world * grad_out.shape[0], *grad_out.shape[1:]))
        dist.all_gather_into_tensor(every, grad_out.contiguous(), group=ctx.group)
        grad = torch.zeros(ctx.block_shape, dtype=torch.float32, device=grad_out.device)
        if ctx.block_shape[0]:  # the rows of other blocks add exact zeros
            # / N: the mean over the ranks, as FSDP2's reduce-scatter gives every other gradient; on the exchanged
            # rows (N x tokens) rather than the block (V / N rows, four times as many at Llama-3 on 2 ranks)
            rows = every.to(torch.float32).masked_fill_(~mine.unsqueeze(-1), 0).div_(world)
            grad.index_add_(0, index.flatten(), rows.flatten(0, -2))
        return grad.to(ctx.block_dtype)


class VocabShardedEmbedding(nn.Module):
    """An embedding whose ``weight`` (V, H) is a DTensor sharded by rows (``Shard(0)``) over ``mesh``; the
    lookup is :class:`_VocabShardedLookup`, its output in ``dtype`` (the compute dtype, as FSDP2's gathered
    bf16 table gives it). ``padding_idx`` is kept for what reads it; as with ``nn.Embedding`` in training, the
    padding row's gradient is zero (the loss ignores those positions)."""

    def __init__(self, embedding: nn.Embedding, mesh, dtype: torch.dtype | None):
        super().__init__()
        self.num_embeddings, self.embedding_dim = embedding.num_embeddings, embedding.embedding_dim
        self.padding_idx = embedding.padding_idx
        weight = embedding.weight
        self.weight = nn.Parameter(distribute_tensor(weight.detach(), mesh, [Shard(0)], src_data_rank=None),
                                   requires_grad=weight.requires_grad)
        self.group, self.dtype = mesh.get_group(), dtype
        # Shard(0)'s blocks: ceil(V / N) rows each, the last ones shorter or empty
        self.start = min(mesh.get_local_rank() * -(-self.num_embeddings // mesh.size()), self.num_embeddings)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        block = self.weight.to_local()
        return _VocabShardedLookup.apply(ids, block, self.start, self.dtype or block.dtype, self.padding_idx,
                                         self.group)
