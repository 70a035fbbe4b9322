"""How a model is laid out for training: processes, activation checkpointing, FSDP2, the optimiser and its
schedule, and the loss head.

As torchtitan's ``parallelize``, everything here is applied to the model from outside: the decoder code knows
nothing of sharding or checkpointing.

One rank has nothing to shard or reduce: the model stays a plain module, and :func:`build_optimizer` moves its
fp32 weights into the optimiser as masters and casts the parameters to bf16 once (the numbers are those of
FSDP2's cast, without its per-layer casts, copies and hooks). Several ranks: FSDP2 keeps the fp32 shards and
computes in bf16 (each layer's weights cast as they are gathered, gradients reduced in fp32).
"""

from __future__ import annotations

import math
import os
from functools import partial

import torch
import torch.distributed as dist
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard, register_fsdp_forward_method
from torch.distributed.tensor import DTensor, distribute_tensor
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

from checkpoints_tools import CheckpointError
from kernels import AdamW
from kernels.nf4 import NF4Tensor, from_storage, to_storage
from ligermodels.blocks import MLP, RMSNorm
from ligermodels.config import DecoderConfig
from ligermodels.families import UnsupportedConfigError
from ligermodels.hf_io import load_hf, quantize_model
from ligermodels.lora import add_lora, lora_modules
from ligermodels.model import CausalLM
from ligermodels.train.config import AC_MODES, TrainConfig, TrainError
from ligermodels.train.data import Inputs
from ligermodels.train.sharded_embedding import VocabShardedEmbedding


# ------------------------------------------------------------------------------------------ processes
def setup_distributed(device_type: str) -> tuple[int, int, torch.device]:
    """(rank, world size, this rank's device) in the process group: torchrun's (NCCL on cuda, gloo on cpu), or
    one of a single process; a group that already exists is joined as it is."""
    if device_type == "cuda":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    backend = "nccl" if device_type == "cuda" else "gloo"
    if dist.is_initialized():
        pass
    elif "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        dist.init_process_group(backend)
    else:  # plain `python -m ligermodels.train`: a group of one, no network
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    return dist.get_rank(), dist.get_world_size(), device


# ------------------------------------------------------------------------------------------ model
#: The GEMMs a decoder layer runs in forward: bf16 (``mm``, ``addmm``, ``bmm``), FP8 (``_scaled_mm``, ``--fp8``) and the
#: experts' grouped GEMMs (``_grouped_mm``, :mod:`kernels.moe`).
GEMM_OPS = {getattr(torch.ops.aten, name).default for name in (
    "mm", "addmm", "bmm", "_scaled_mm", "_grouped_mm", "_scaled_grouped_mm") if hasattr(torch.ops.aten, name)}
#: Ops that change a GEMM's output in place, its (..., N) output their first argument: the rotary embedding on the
#: q/k/v projection (with the q/k head norms for Qwen3), a LoRA projection's second GEMM onto its first (the base
#: GEMM onto the adapters' term, :func:`kernels.low_rank.low_rank_linear`) and an FP8 GEMM's bias. Kept, they are
#: not run again on the kept output when a layer is recomputed; so each is kept exactly when the GEMM before it is.
IN_PLACE_OPS = {torch.ops.ligermodels.rope_qkv_.default, torch.ops.ligermodels.qk_norm_rope_qkv_.default,
                torch.ops.ligermodels.gemm_accumulate_.default, torch.ops.ligermodels.add_bias_.default}
#: Ops whose outputs selective activation checkpointing keeps (the expensive ones); the rest is recomputed.
SAVED_OPS = GEMM_OPS | {getattr(torch.ops.aten, name).default for name in (
    "_scaled_dot_product_flash_attention", "_scaled_dot_product_efficient_attention",
    "_scaled_dot_product_cudnn_attention", "_scaled_dot_product_flash_attention_for_cpu",
    "_flash_attention_forward")  # the last: packed documents and windows (ligermodels.attention)
    if hasattr(torch.ops.aten, name)}
if hasattr(torch.ops, "higher_order") and hasattr(torch.ops.higher_order, "flex_attention"):
    SAVED_OPS.add(torch.ops.higher_order.flex_attention)
SAVED_OPS |= IN_PLACE_OPS  # the kept GEMM output already holds their change: "keeping" them = not running them again
SAVED_OPS.add(torch.ops.ligermodels.doc_attention_fwd.default)  # our attention (documents, windows, soft-capping)


def selective_policy(ctx, op, *args, **kwargs) -> CheckpointPolicy:
    """Selective activation checkpointing: keep the outputs of :data:`SAVED_OPS`, recompute the rest."""
    return CheckpointPolicy.MUST_SAVE if op in SAVED_OPS else CheckpointPolicy.PREFER_RECOMPUTE


def output_width(op, args) -> int | None:
    """The last dim of the output a :data:`GEMM_OPS` op writes (its second matrix operand's; ``addmm``'s third
    argument) or an :data:`IN_PLACE_OPS` op changes (its first argument's); None for other ops."""
    if op in IN_PLACE_OPS:
        return args[0].shape[-1]
    if op in GEMM_OPS:
        return args[2 if op == torch.ops.aten.addmm.default else 1].shape[-1]
    return None


def lean_policy(widths: frozenset[int], ctx, op, *args, **kwargs) -> CheckpointPolicy:
    """Lean activation checkpointing: :func:`selective_policy`, except that GEMMs whose outputs are ``widths``
    wide (the packed gate/up projections, 2 * intermediate size: the widest output a layer keeps), and the ops
    that change those outputs in place, are recomputed."""
    if output_width(op, args) in widths:
        return CheckpointPolicy.PREFER_RECOMPUTE
    return selective_policy(ctx, op, *args, **kwargs)


def gate_up_widths(config: DecoderConfig) -> frozenset[int]:
    """The output widths of a model's packed gate/up projections: the dense MLP's and the experts'."""
    return frozenset(2 * n for n in (config.intermediate_size, config.moe_intermediate_size) if n)


def apply_activation_checkpointing(model: CausalLM, mode: str) -> None:
    """Wrap each decoder layer (``mode``, one of :data:`AC_MODES`): "full" recomputes it in backward; "selective"
    recomputes all but the GEMMs and attention (:func:`selective_policy`); "lean" recomputes the gate/up
    projection too (:func:`lean_policy`). What a layer keeps, a token, at Llama-3.1-8B's shape in bf16: its input
    (8 KiB) with "full"; with "selective" also the q/k/v (12 KiB), attention (8 KiB), o (8 KiB), gate/up (56 KiB)
    and down (8 KiB) projections' outputs, 100 KiB; "lean" keeps 44 KiB, for 18% more GEMM flops a step (the
    gate/up GEMM, 2 x 4096 x 28672 flops a token, runs again in backward).

    The wrapped layers' norms and MLP then keep their outputs for backward (``RMSNorm.keep_output``,
    ``MLP.keep_activation``) instead of writing them again there: inside a checkpoint nothing saved
    outlives the layer's own backward, so recomputing them a second time would cost time for a saving
    of at most two (B, S, H) tensors during one layer's backward.

    Each layer's input is the residual stream summed before the layer (``CausalLM.sum_residual``), so a
    checkpoint keeps one (B, S, H) tensor a layer instead of the previous layer's output and the stream: at
    Llama-3.1-8B, 256 KB a token over the 32 layers. The cost is an add before each layer and one more in
    backward where the two gradients of the sum meet (the fused norm added them in its own pass).
    """
    for i in range(len(model.layers)):
        checkpoint_layer(model, i, mode)


def checkpoint_layer(model: CausalLM, i: int, mode: str) -> None:
    """:func:`apply_activation_checkpointing` for layer ``i`` alone (the model's ``sum_residual`` set)."""
    if mode == "none":
        return
    if mode not in AC_MODES:
        raise ValueError(f"activation checkpointing: mode must be one of {', '.join(AC_MODES)}, got {mode!r}")
    model.sum_residual = True
    policy = {"selective": selective_policy, "lean": partial(lean_policy, gate_up_widths(model.config))}.get(mode)
    # A kept output may be changed in place after it is kept, by an op that is itself kept (the rotary embedding on
    # the q/k/v projection, a LoRA projection's base GEMM onto its adapters' term): recomputation then returns
    # the changed tensor from both and runs neither, which torch's check on kept tensors would refuse.
    kwargs = {} if policy is None else {"context_fn": partial(create_selective_checkpoint_contexts, policy,
                                                              allow_cache_entry_mutation=True)}
    layer = model.layers[i]
    for m in layer.modules():
        if isinstance(m, RMSNorm):
            m.keep_output = True
        elif isinstance(m, MLP):
            m.keep_activation = True
    model.layers[i] = checkpoint_wrapper(layer, **kwargs)


def lora_options(config: TrainConfig) -> dict:
    """``add_lora``'s arguments from the --lora-* flags."""
    return dict(r=config.lora_rank, alpha=config.lora_alpha, dropout=config.lora_dropout,
                targets=config.lora_targets.split(","))


def build_model(inputs: Inputs, config: TrainConfig, rank: int, world: int, device: torch.device,
                frozen: bool = False) -> CausalLM:
    """The model with fp32 weights: FSDP2-sharded over the ranks when there are several.

    Rank 0 alone reads the checkpoint on the host (or draws the from-scratch init from ``--seed``, on
    :func:`init_device`); every rank builds the model on the meta device, shards it, allocates its shards
    and receives them from rank 0, one tensor at a time (:func:`load_full_state`). So the start is the same
    for any number of ranks, and host memory holds at most one full copy, not one per rank.

    Several ranks: FSDP2 (:func:`shard`); one rank: a plain module (see the module docstring). With LoRA on
    one rank the frozen base is allocated in bf16 from the start (it has no master).

    ``frozen``: a preference objective's reference model: the same initial weights, no adapters, no gradients,
    no activation checkpointing, in the compute dtype (no fp32 master), sharded as the policy is, in eval mode.
    """
    if config.quantize != "none" and not frozen:
        return build_quantized_model(inputs, config, world, device)
    full_state, error = {}, None
    if rank == 0:
        try:
            if inputs.weights_dir is not None:
                host = load_hf(inputs.weights_dir, dtype=torch.float32, device="cpu")
            else:
                torch.manual_seed(config.seed)
                with torch.device(init_device(inputs.config, device)):
                    host = inputs.cls(inputs.config).init_weights()
            if config.lora_rank and not frozen:  # the adapters' init (A random, B zero) drawn here, once, from --seed
                torch.manual_seed(config.seed)
                add_lora(host, **lora_options(config))
            full_state = host.state_dict()
            del host
        except (CheckpointError, UnsupportedConfigError) as e:
            error = str(e)
    errors = [error]
    dist.broadcast_object_list(errors, src=0)  # a bad checkpoint stops every rank, not rank 0 alone
    if errors[0]:
        raise TrainError(errors[0])

    with torch.device("meta"):
        model = inputs.cls(inputs.config)
        if config.lora_rank and not frozen:
            add_lora(model, **lora_options(config))
    if frozen:
        model.requires_grad_(False)
    else:
        apply_activation_checkpointing(model, config.ac)
        if config.fp8 != "none":
            model.use_fp8(config.fp8)
    if config.dtype == "bf16" and (frozen or (world == 1 and config.lora_rank)):
        # A frozen base (LoRA's on one rank, or the reference copy) computes in bf16 and has no master: allocated
        # in bf16 at once, so the device never holds its fp32 copy (30 GB at 7.6B parameters); adapters stay fp32.
        for p in model.parameters():
            if not p.requires_grad:
                p.data = p.data.to(torch.bfloat16)
    if config.compile and not frozen:  # each layer's forward (its checkpoint included); FSDP's hooks outside, eager
        # The first layer stores the attention mask it builds in the AttentionMask all layers share. Inside a
        # checkpoint dynamo would break the graph there (eager recomputation replays the store); the recompute
        # finds the mask stored either way, so the store need not be replayed.
        if hasattr(torch._dynamo.config, "skip_fwd_side_effects_in_bwd_under_checkpoint"):
            torch._dynamo.config.skip_fwd_side_effects_in_bwd_under_checkpoint = True
        for layer in model.layers:
            layer.forward = torch.compile(layer.forward)
    if world > 1:
        shard(model, config, world, device)
    model.to_empty(device=device)
    load_full_state(model, full_state, rank, world, device)
    model.init_buffers()
    return model.eval() if frozen else model.train()


def build_quantized_model(inputs: Inputs, config: TrainConfig, world: int, device: torch.device,
                          sharded: bool | None = None) -> CausalLM:
    """QLoRA: every rank reads the checkpoint straight onto its ``device`` in the compute dtype, its decoder
    projections quantised there one weight at a time (``from_hf(..., quantize=...)``; the same bits on every rank),
    or draws the init from ``--seed`` and quantises it; the adapters are drawn on the host from ``--seed`` (the same
    as a bf16 LoRA run's) and kept fp32 on ``device``.

    ``sharded`` (default: several ranks): each layer is checkpointed and sharded by FSDP2 as soon as its weights are
    read (:func:`shard_layer`, its NF4 bytes as a bf16 tensor: :func:`nf4_to_storage`), before the next layer is
    read, so a rank holds the 4-bit base's shards plus one layer whole, not the whole 4-bit base (about 35 GB at
    70B parameters); the rest is sharded at the end (:func:`shard_rest`). A drawn init is quantised whole first."""
    dtype = torch.bfloat16 if config.dtype == "bf16" else torch.float32
    sharded = world > 1 if sharded is None else sharded
    mesh = init_device_mesh(device.type, (world,)) if sharded else None

    def each_layer(model: CausalLM, i: int) -> None:  # adapters (drawn in layer order), checkpoint, shard
        add_lora(model.layers[i], device="cpu", **lora_options(config))
        for m in lora_modules(model.layers[i]).values():
            m.lora_A, m.lora_B = (torch.nn.Parameter(p.detach().to(device)) for p in (m.lora_A, m.lora_B))
        checkpoint_layer(model, i, config.ac)
        if sharded:
            shard_layer(model, i, config, mesh)

    try:
        torch.manual_seed(config.seed)  # the adapters' draws, layer after layer: add_lora's order on the whole model
        if inputs.weights_dir is not None:
            model = load_hf(inputs.weights_dir, dtype=dtype, device=device, quantize=config.quantize,
                            each_layer=each_layer)
        else:
            with torch.device(init_device(inputs.config, device)):
                model = inputs.cls(inputs.config).init_weights()
            model = quantize_model(model.to(device=device, dtype=dtype), config.quantize)
            torch.manual_seed(config.seed)
            for i in range(len(model.layers)):
                each_layer(model, i)
    except (CheckpointError, UnsupportedConfigError, ValueError) as e:
        raise TrainError(str(e)) from None
    adapters = {p for m in lora_modules(model).values() for p in (m.lora_A, m.lora_B)}
    for p in model.parameters():  # each layer's were frozen by add_lora; the embedding, final norm and head here
        p.requires_grad_(p in adapters)
    if sharded:
        shard_rest(model, config, mesh)
    model.init_buffers()
    return model.train()


def init_device(config: DecoderConfig, device: torch.device) -> torch.device:
    """Where rank 0 draws a from-scratch init: the GPU when the fp32 model takes at most half its free memory
    (2.5B parameters: seconds there against about half a minute on the host), else the host. The numbers
    differ between the two (each has its own generator), but not with the number of ranks."""
    if device.type == "cuda" and 4 * config.num_params() <= torch.cuda.mem_get_info(device)[0] // 2:
        return device
    return torch.device("cpu")


@torch.no_grad()
def load_full_state(model: torch.nn.Module, full_state: dict[str, torch.Tensor], rank: int, world: int,
                    device: torch.device) -> None:
    """Rank 0's full state dict (host or device tensors) into every rank's model (FSDP2 shards or whole
    tensors), one tensor at a time: each is cast to the parameter's dtype on ``device``, broadcast from rank 0
    and copied into the local shard. So the device holds one full tensor beyond the model at any moment;
    ``set_model_state_dict(..., broadcast_from_rank0=True)`` kept every received full tensor until the end,
    a whole fp32 copy of the model (30 GB at 7.6B parameters, the peak of a LoRA run on one H100).

    ``full_state``'s keys must be those of ``model.state_dict()`` (rank 0 checks; other ranks pass {})."""
    targets = model.state_dict(keep_vars=True)
    error = None
    if rank == 0 and set(full_state) != set(targets):
        missing, extra = sorted(set(targets) - set(full_state)), sorted(set(full_state) - set(targets))
        error = f"the initial weights do not fit the model: missing {missing[:5]}, unexpected {extra[:5]}"
    errors = [error]
    if world > 1:
        dist.broadcast_object_list(errors, src=0)  # every rank stops, none waits in a broadcast
    if errors[0]:
        raise TrainError(errors[0])
    for name, target in targets.items():
        if rank == 0:
            full = full_state[name].to(device=device, dtype=target.dtype)
        else:
            full = torch.empty(target.shape, dtype=target.dtype, device=device)
        if world > 1:
            dist.broadcast(full, src=0)
        if isinstance(target, DTensor):
            full = distribute_tensor(full, target.device_mesh, target.placements, src_data_rank=None)
        target.copy_(full)
        del full


def shard(model: CausalLM, config: TrainConfig, world: int, device: torch.device) -> None:
    """FSDP2 over ``world`` ranks: one unit per decoder layer (:func:`shard_layer`), one for an untied output head,
    the root holding the embedding (with a tied head) and the final norm (:func:`shard_rest`).

    bf16 compute with fp32 gradient reduction (``--reduce-dtype``); the cos/sin tables stay fp32 (layer inputs
    are not cast).
    The head is a unit of its own so that its gradient (a (V, H) fp32 reduce-scatter, 2.1 GB at Llama-3's
    128k vocabulary) is reduced under the layers' backward; in the root it waited for the end of backward.
    ``--reshard-after-forward`` picks which layers free their gathered weights after forward (by default
    all but the last, whose backward starts at once; the head never); ``--prefetch N`` makes each unit
    all-gather the next N (in forward order, and in backward in reverse) as soon as its own gather is
    issued, instead of FSDP2's implicit prefetching (one unit ahead in backward; in forward, a unit's
    gather is issued when the host reaches it).
    """
    mesh = init_device_mesh(device.type, (world,))
    for i in range(len(model.layers)):
        shard_layer(model, i, config, mesh)
    shard_rest(model, config, mesh)


def _mixed_precision(config: TrainConfig) -> MixedPrecisionPolicy:
    return MixedPrecisionPolicy(param_dtype=torch.bfloat16 if config.dtype == "bf16" else None,
                                reduce_dtype={"fp32": torch.float32, "bf16": torch.bfloat16}[config.reduce_dtype],
                                cast_forward_inputs=False)


def shard_layer(model: CausalLM, i: int, config: TrainConfig, mesh) -> None:
    """Decoder layer ``i`` as an FSDP2 unit of its own; its NF4 weights first kept as bf16 bytes
    (:func:`nf4_to_storage`), read back as NF4 views by a pre-hook once FSDP2 has gathered them."""
    layer = model.layers[i]
    quantized = nf4_to_storage(layer)
    reshard = {"default": i < len(model.layers) - 1, "always": True, "never": False}[config.reshard_after_forward]
    fully_shard(layer, mesh=mesh, mp_policy=_mixed_precision(config), reshard_after_forward=reshard)
    if quantized:  # after FSDP2's own hook (registered first) has gathered the layer's weights
        layer.register_forward_pre_hook(lambda _module, _args, mine=list(quantized): _nf4_views(mine))


def shard_rest(model: CausalLM, config: TrainConfig, mesh) -> None:
    """After :func:`shard_layer` on every layer: the untied head as a unit, the root, and ``--prefetch``."""
    mp = _mixed_precision(config)
    units = list(model.layers)
    if model.head is not None:
        fully_shard(model.head, mesh=mesh, mp_policy=mp, reshard_after_forward=False)
        for method in ("loss", "logprobs", "logprob_loss"):  # the loss head calls these, not forward()
            register_fsdp_forward_method(model.head, method)
        units.append(model.head)
    ignored = set()
    if embedding_sharding(config, model.config, mesh.size()) == "vocab":  # the rows stay out of FSDP2's root
        model.embed = VocabShardedEmbedding(model.embed, mesh, mp.param_dtype)
        ignored.add(model.embed.weight)
    fully_shard(model, mesh=mesh, mp_policy=mp, ignored_params=ignored or None)
    for method in ("loss", "token_logprobs", "logprob_loss"):  # called instead of forward()
        register_fsdp_forward_method(model, method)
    if config.prefetch:
        n = config.prefetch
        for i, unit in enumerate(units):
            unit.set_modules_to_forward_prefetch(units[i + 1:i + 1 + n])
            unit.set_modules_to_backward_prefetch(units[max(0, i - n):i][::-1])


#: ``--shard-embedding auto`` looks tokens up where their rows live when the ranks' tokens of a micro-batch are at
#: most this share of the vocabulary. Measured at 8 layers of Llama-3.1-8B's shape on H200s, 8192 tokens a rank,
#: 128256 rows (benchmarks/results/scale-NVIDIA_H200-2026-11-28-x4l8-vocab.json): +3.1% per GPU at a share of
#: 0.128 (2 ranks), +1.2% at 0.255 (4 ranks). The rows exchanged grow with ranks x tokens, the gathered table does
#: not, so the gain shrinks as the share grows; 0.3 takes both measured points and goes no further.
VOCAB_SHARDING_MAX_SHARE = 0.3


def embedding_sharding(config: TrainConfig, model: DecoderConfig, world: int) -> str:
    """``--shard-embedding`` as a run of ``world`` ranks takes it, "gather" or "vocab". ``vocab`` needs an untied
    head (a tied one is the embedding's whole table) and rows of one shape on every rank (SFT's packed rows; a
    preference micro-batch is one row as long as its pairs), since the ranks exchange their token ids and rows in
    tensors of one size: asked for elsewhere, it is refused (TrainError). ``auto``: vocab for SFT on several ranks
    with an untied embedding when ``world x --batch-size x --seq-len`` is at most :data:`VOCAB_SHARDING_MAX_SHARE`
    of the vocabulary, else gather."""
    if config.shard_embedding == "vocab":
        if model.tie_embeddings:
            raise TrainError("--shard-embedding vocab needs an untied output head: this model ties it to the "
                             "embedding (tie_word_embeddings), whose whole table the head needs on every rank")
        if config.objective != "sft":
            raise TrainError(f"--shard-embedding vocab trains SFT rows only (--objective {config.objective} packs "
                             "each rank's pairs into a row of its own length)")
        return "vocab"
    tokens = world * config.batch_size * config.seq_len
    takes = (config.shard_embedding == "auto" and world > 1 and config.objective == "sft"
             and not model.tie_embeddings)
    return "vocab" if takes and tokens <= VOCAB_SHARDING_MAX_SHARE * model.vocab_size else "gather"


def nf4_to_storage(model: torch.nn.Module) -> set[torch.nn.Module]:
    """Each projection holding an NF4 weight (``weight``, a :class:`kernels.nf4.NF4Tensor` Parameter) keeps it instead
    as ``weight_nf4``, one flat bf16 Parameter of its bytes (:func:`kernels.nf4.to_storage`), which FSDP2 shards and
    gathers like any frozen weight, and its layout as ``nf4_layout``; ``weight`` becomes the NF4 view of that
    storage, which :func:`_nf4_views` builds again each time the layer's weights are gathered. Returns those
    modules."""
    quantized = set()
    for module in model.modules():
        weight = module._parameters.get("weight")
        if isinstance(weight, NF4Tensor):
            storage, module.nf4_layout = to_storage(weight)
            del module.weight
            module.weight_nf4 = torch.nn.Parameter(storage, requires_grad=False)
            quantized.add(module)
    _nf4_views(quantized)
    return quantized


def _nf4_views(modules) -> None:
    for module in modules:
        module.weight = from_storage(module.weight_nf4, module.nf4_layout)


def nf4_state(state: dict[str, torch.Tensor], model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """A full state dict of a model sharded by :func:`shard` with its NF4 storage (``*.weight_nf4``) read back as
    NF4 ``*.weight`` tensors (what :func:`ligermodels.lora.merge_lora_state` dequantises)."""
    out = {}
    for name, tensor in state.items():
        if name.endswith(".weight_nf4"):
            owner = name[:-len(".weight_nf4")]
            out[f"{owner}.weight"] = from_storage(tensor, model.get_submodule(owner).nf4_layout)
        else:
            out[name] = tensor
    return out


# ------------------------------------------------------------------------------------------ optimiser
def decay_groups(params: list[torch.nn.Parameter], weight_decay: float) -> list[dict]:
    """Two param groups: the matrices with ``weight_decay``, the vectors (norms, biases) without."""
    return [{"params": [p for p in params if p.ndim >= 2], "weight_decay": weight_decay},
            {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0}]


def build_optimizer(model: CausalLM, config: TrainConfig, world: int) -> AdamW:
    """AdamW with weight decay on matrices only: ``kernels.AdamW`` (the Triton update on each rank's shards;
    torch's AdamW on the CPU). Its state dict is torch's AdamW's.

    One rank computing in bf16 (see :func:`build_model`): the fp32 parameters become the optimiser's
    masters and the parameters bf16 (``AdamW.init_master_weights_``); each step updates the masters
    and writes the bf16 weights the next forward uses. With LoRA only the adapters are trained (fp32,
    no master needed); the frozen base is bf16 from :func:`build_model` on.
    """
    trained = [p for p in model.parameters() if p.requires_grad]  # with LoRA: the adapters only
    optimizer = AdamW(decay_groups(trained, config.weight_decay), lr=config.lr, betas=(0.9, 0.95), eps=1e-8)
    if world == 1 and config.dtype == "bf16" and not config.lora_rank:  # (LoRA: the base is bf16 already)
        optimizer.init_master_weights_(torch.bfloat16)
    return optimizer


#: ``--loss-strategy auto`` takes "vocab" where the "tokens" strategy's fp32 (V, H) weight-gradient buffer would
#: take at least this share of the device's memory, else "tokens". The buffer lives through the loss head's forward,
#: where every layer's activations are alive (dW is then held in bf16 until backward); "vocab" costs one more head
#: GEMM instead. Measured on an H100 (benchmarks/results/experiments/train-NVIDIA_H100_80GB_HBM3-2026-11-26-strat.json),
#: before the split accumulator of kernels.cross_entropy (FLCE_SPLIT_MIN_CHUNK): Gemma-2-2B b4,
#: whose buffer is 2.2 GiB (256000 x 2304), ran 288.5 ms a step with "vocab" and 277.3 with "tokens" (3.9% faster)
#: for 1.8 GB more at the peak (47.8 -> 49.6 GB). At 1/32 an 80 GB GPU keeps "tokens" up to a 2.5 GiB buffer
#: (Gemma's 256k vocabulary at hidden 2048-2304, Llama-3-8B's 128k x 4096: 1.96 GiB), a 24 GB one up to 0.7 GiB.
AUTO_VOCAB_SHARE = 1 / 32


def device_memory_bytes(device: torch.device) -> int:
    """The device's memory in bytes: a GPU's total, or the host's physical memory for the CPU (where the OS
    does not say, 2**40: the loss head then takes "tokens", the faster)."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, ValueError, OSError):  # no sysconf (Windows), or no such name
        return 2**40


def auto_loss_strategy(vocab_size: int, hidden_size: int, device: torch.device) -> str:
    """``--loss-strategy auto`` for a trained (vocab_size, hidden_size) head on ``device``: "vocab" where the
    "tokens" strategy's fp32 weight-gradient buffer takes :data:`AUTO_VOCAB_SHARE` of the device's memory."""
    buffer = 4 * vocab_size * hidden_size
    return "vocab" if buffer >= AUTO_VOCAB_SHARE * device_memory_bytes(device) else "tokens"


def loss_strategy(config: TrainConfig, model: DecoderConfig, device: torch.device) -> str:
    """The loss head's strategy for ``--loss-strategy`` (``auto``: :func:`auto_loss_strategy`) on ``model``;
    LoRA freezes the head, which then has no weight-gradient buffer and takes "tokens"."""
    if config.loss_strategy != "auto":
        return config.loss_strategy
    return "tokens" if config.lora_rank else auto_loss_strategy(model.vocab_size, model.hidden_size, device)


def lr_factor(i: int, schedule: str, warmup: int, steps: int, min_ratio: float) -> float:
    """Multiplier of the peak lr at update ``i`` (0-based): linear warmup, then cosine/linear/constant."""
    if i < warmup:
        return (i + 1) / warmup
    if schedule == "constant":
        return 1.0
    progress = (i - warmup) / max(1, steps - warmup)
    if schedule == "linear":
        return 1.0 - (1.0 - min_ratio) * progress
    return min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


