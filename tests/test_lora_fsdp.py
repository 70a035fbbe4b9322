"""LoRA under FSDP2 as the trainer builds its model, on 2 CPU ranks (gloo).

Rank 0 draws the adapters on a host model; every rank builds the model on the meta device, adds the
same adapters, wraps the layers in activation checkpointing, shards them (``fully_shard``), and receives
rank 0's state (``set_model_state_dict(..., broadcast_from_rank0=True)``). Each rank takes half of the
batch; the gathered adapter gradients must equal one process computing the whole batch, the frozen
base must get none, and the export (``get_model_state_dict`` + ``export_lora`` on rank 0) must equal the
host model's adapters. Triton kernels run through the interpreter in each child.
"""

import os
import socket
import sys

import pytest
import torch
import torch.multiprocessing as mp

WORLD = 2


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, port: int, interpret: bool, out_dir: str, base_dtype: str) -> None:
    if interpret:
        os.environ["TRITON_INTERPRET"] = "1"  # before kernels is imported in this process
    import copy

    import torch.distributed as dist
    from safetensors.torch import load_file
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, set_model_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard, register_fsdp_forward_method

    from ligermodels import CausalLM, DecoderConfig
    from ligermodels.lora import add_lora, export_lora, lora_modules, trainable_parameters
    from ligermodels.train.parallelize import apply_activation_checkpointing
    from tests.utils import rel_err

    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp32_compute_bf16": torch.float32}[base_dtype]
    compute = torch.bfloat16 if base_dtype == "fp32_compute_bf16" else None  # the trainer's --dtype bf16
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD)
    try:
        cfg = DecoderConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_layers=2, num_heads=4,
                            num_kv_heads=2)
        lora = dict(r=2, alpha=4, dropout=0.0, targets=["q", "k", "v", "o", "gate", "up", "down"])
        torch.manual_seed(0)
        host = CausalLM(cfg).init_weights(0.1).to(dtype)
        add_lora(host, **lora)
        with torch.no_grad():
            for m in lora_modules(host).values():
                m.lora_B.normal_(0, 0.2)
        ids = torch.randint(0, 64, (2 * WORLD, 9), generator=torch.Generator().manual_seed(1))
        n_items = ids[:, 1:].numel()
        # the reference: one process, the whole batch, every parameter in the compute dtype (FSDP's
        # param_dtype casts the adapters too)
        ref_model = copy.deepcopy(host).to(compute) if compute is not None else host
        ref_loss = ref_model.loss(ids, ids)
        ref_loss.backward()
        ref = {n: p.grad for n, p in ref_model.named_parameters() if p.requires_grad}

        with torch.device("meta"):
            model = CausalLM(cfg).to(dtype)
        add_lora(model, **lora)  # before the wrapping and sharding
        apply_activation_checkpointing(model, "full")
        mesh = init_device_mesh("cpu", (WORLD,))
        # bf16 base: FSDP2 shards the bf16 base and the fp32 adapters of one layer together as they are
        mp_policy = MixedPrecisionPolicy(param_dtype=compute, reduce_dtype=torch.float32, cast_forward_inputs=False)
        for layer in model.layers:
            fully_shard(layer, mesh=mesh, mp_policy=mp_policy)
        fully_shard(model, mesh=mesh, mp_policy=mp_policy)
        register_fsdp_forward_method(model, "loss")
        model.to_empty(device="cpu")
        set_model_state_dict(model, host.state_dict() if rank == 0 else {},
                             options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))
        model.init_buffers()
        model.train()
        mine = ids[rank * 2:(rank + 1) * 2]
        loss = model.loss(mine, mine, num_items=n_items)
        (loss * WORLD).backward()  # FSDP averages over ranks; the global mean wants the sum
        total = loss.detach().clone()
        dist.all_reduce(total)
        bound = 1e-5 if base_dtype == "fp32" else 2e-2  # bf16 compute: against the fp32 / other-split reference
        assert rel_err(total, ref_loss) <= bound, (total, ref_loss)
        params = {n.replace("_checkpoint_wrapped_module.", ""): p for n, p in model.named_parameters()}
        names = {n for n, p in params.items() if p.requires_grad}
        assert names == set(ref), (names, set(ref))
        for n, p in params.items():
            assert p.dtype == (torch.float32 if "lora_" in n else dtype), n
            if p.requires_grad:
                g = p.grad.full_tensor()
                assert rel_err(g, ref[n]) <= bound, (n, rel_err(g, ref[n]))
            else:
                assert p.grad is None, n
        assert len(trainable_parameters(model)) == 16  # 2 layers x 4 projections x (A, B)
        state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        if rank == 0:
            export_lora(model, state, os.path.join(out_dir, "final"))
            export_lora(host, host.state_dict(), os.path.join(out_dir, "host"))
            a = load_file(os.path.join(out_dir, "final", "adapter_model.safetensors"))
            b = load_file(os.path.join(out_dir, "host", "adapter_model.safetensors"))
            assert set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in a)
        dist.barrier()
    finally:
        dist.destroy_process_group()


def _run_and_exit(rank: int, port: int, interpret: bool, out_dir: str, base_dtype: str) -> None:
    """As tests/test_cross_entropy_fsdp.py: leave without interpreter teardown once every check passed."""
    _worker(rank, port, interpret, out_dir, base_dtype)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


@pytest.mark.skipif(not torch.distributed.is_available(), reason="torch.distributed is not available")
@pytest.mark.parametrize("base_dtype", ["fp32", "bf16", "fp32_compute_bf16"])
def test_fsdp2_lora_gradients_match_one_process_and_export(base_dtype, tmp_path):
    mp.spawn(_run_and_exit, args=(_free_port(), not torch.cuda.is_available(), str(tmp_path), base_dtype),
             nprocs=WORLD, join=True)
