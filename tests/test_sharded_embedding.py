"""``--shard-embedding vocab``'s lookup (ligermodels.train.sharded_embedding) on 3 CPU ranks (gloo): each rank
holds a block of an odd vocabulary's rows (13, 13 and 11 of 37) and its own tokens, padding ids and ids of every
block among them. Its output must be the rows of its own tokens, exactly, in the compute dtype; the gradient each
rank keeps must be its block of the float64 reference (every rank's output gradients added into the rows of their
tokens, divided by the number of ranks as FSDP2's reduce-scatter does, the padding row left at zero)."""

import os
import socket
import sys

import pytest
import torch
import torch.multiprocessing as mp

WORLD, VOCAB, HIDDEN, PAD = 3, 37, 12, 5


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, port: int, dtype_name: str, padding: bool) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from ligermodels.train.sharded_embedding import VocabShardedEmbedding
    from tests.utils import rel_err

    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[dtype_name]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD)
    try:
        g = torch.Generator().manual_seed(0)  # the same draws on every rank
        table = torch.randn(VOCAB, HIDDEN, generator=g)
        ids = torch.randint(0, VOCAB, (WORLD, 2, 7), generator=g)
        ids[:, 0, :3] = PAD
        ids[:, 1, :3] = torch.tensor([0, 20, VOCAB - 1])  # the first, the middle and the last block
        grads = torch.randn(WORLD, 2, 7, HIDDEN, generator=g).to(dtype)

        embedding = torch.nn.Embedding(VOCAB, HIDDEN, padding_idx=PAD if padding else None)
        with torch.no_grad():
            embedding.weight.copy_(table)
        sharded = VocabShardedEmbedding(embedding, init_device_mesh("cpu", (WORLD,)), dtype)
        assert sharded.weight.to_local().shape[0] == (13, 13, 11)[rank] and sharded.start == 13 * rank
        out = sharded(ids[rank])
        assert out.dtype == dtype and torch.equal(out, table[ids[rank]].to(dtype))
        out.backward(grads[rank])

        reference = torch.zeros(VOCAB, HIDDEN, dtype=torch.float64)
        reference.index_add_(0, ids.flatten(), grads.double().flatten(0, 2))
        if padding:
            reference[PAD] = 0
        reference /= WORLD
        grad = sharded.weight.grad
        assert grad.placements == sharded.weight.placements and grad.to_local().dtype == torch.float32
        assert rel_err(grad.full_tensor(), reference) <= 1e-6
        assert (grad.full_tensor()[PAD] == 0).all().item() == padding
        dist.barrier()
    finally:
        dist.destroy_process_group()


def _run_and_exit(rank: int, port: int, dtype_name: str, padding: bool) -> None:
    """As tests/test_cross_entropy_fsdp.py: leave without interpreter teardown once every check passed."""
    _worker(rank, port, dtype_name, padding)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


@pytest.mark.skipif(not torch.distributed.is_available(), reason="torch.distributed is not available")
@pytest.mark.parametrize("dtype_name, padding", [("fp32", True), ("bf16", False)],
                         ids=["fp32-padding-idx", "bf16-no-padding"])
def test_each_rank_looks_up_its_tokens_in_the_blocks_and_keeps_its_blocks_gradient(dtype_name, padding):
    mp.spawn(_run_and_exit, args=(_free_port(), dtype_name, padding), nprocs=WORLD, join=True)


def test_a_tied_embedding_and_a_preference_objective_are_refused_by_name(tmp_path):
    """The output head of a tied model is the embedding's table, which every rank needs whole; a preference
    micro-batch is a row as long as its pairs, so the ranks' rows differ in length."""
    from torch.distributed.device_mesh import init_device_mesh

    from ligermodels import CausalLM, DecoderConfig
    from ligermodels.train.config import TrainConfig, TrainError
    from ligermodels.train.parallelize import embedding_sharding, shard_rest

    with torch.device("meta"):
        model = CausalLM(DecoderConfig(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=16, num_layers=1,
                                       num_heads=2, num_kv_heads=2, tie_embeddings=True))
    config = TrainConfig(out=str(tmp_path / "out"), shard_embedding="vocab")
    torch.distributed.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        with pytest.raises(TrainError, match="--shard-embedding vocab needs an untied output head"):
            shard_rest(model, config, init_device_mesh("cpu", (1,)))
    finally:
        torch.distributed.destroy_process_group()
    untied = DecoderConfig(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=16, num_layers=1, num_heads=2,
                           num_kv_heads=2)
    with pytest.raises(TrainError, match="--shard-embedding vocab trains SFT rows only .--objective dpo"):
        embedding_sharding(TrainConfig(out=str(tmp_path / "out"), shard_embedding="vocab", objective="dpo"),
                           untied, 2)
    assert embedding_sharding(config, untied, 2) == "vocab"  # SFT, untied: taken


def test_auto_shards_by_vocabulary_only_where_it_measured_faster():
    """--shard-embedding auto: vocab for SFT on several ranks with an untied embedding while ranks x tokens a
    micro-batch stay within VOCAB_SHARDING_MAX_SHARE of the vocabulary (Llama-3's 128256 rows: 2 and 4 ranks of 8192
    tokens, the measured points), else gather; an explicit choice is kept as given."""
    from ligermodels import DecoderConfig
    from ligermodels.train.config import TrainConfig
    from ligermodels.train.parallelize import VOCAB_SHARDING_MAX_SHARE, embedding_sharding

    llama3 = DecoderConfig(vocab_size=128256, hidden_size=64, intermediate_size=16, num_layers=1, num_heads=2,
                           num_kv_heads=2)
    tied = DecoderConfig(vocab_size=128256, hidden_size=64, intermediate_size=16, num_layers=1, num_heads=2,
                         num_kv_heads=2, tie_embeddings=True)
    run = lambda **k: TrainConfig(**{"out": "o", "seq_len": 8192, "batch_size": 1, **k})  # noqa: E731
    assert [embedding_sharding(run(), llama3, n) for n in (1, 2, 4, 8)] == ["gather", "vocab", "vocab", "gather"]
    assert embedding_sharding(run(batch_size=2), llama3, 4) == "gather"  # 65536 tokens: past the share
    edge = int(VOCAB_SHARDING_MAX_SHARE * 128256) // 2
    assert embedding_sharding(TrainConfig(out="o", seq_len=edge, batch_size=1), llama3, 2) == "vocab"
    assert embedding_sharding(TrainConfig(out="o", seq_len=edge + 1, batch_size=1), llama3, 2) == "gather"
    assert embedding_sharding(run(), tied, 2) == "gather"
    assert embedding_sharding(run(objective="dpo"), llama3, 2) == "gather"
    assert embedding_sharding(run(shard_embedding="gather"), llama3, 2) == "gather"
    assert embedding_sharding(run(shard_embedding="vocab"), llama3, 8) == "vocab"
