"""CausalLM: embedding, decoder layers, final norm and output head, with a chunked loss head.

Read top to bottom: ``hidden_states`` is the whole decoder; ``forward`` adds the output head and
returns logits; ``loss`` returns the next-token loss through ``fused_linear_cross_entropy``, so the
(B*S, vocab) logits never exist.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from kernels import fused_linear_cross_entropy, fused_linear_logprob_loss, fused_linear_logprobs, load_balancing_loss
from kernels.fp8 import fp8_recipe
from ligermodels.attention import AttentionMask, Documents, SharedPrefixes, document_ids_from_positions
from ligermodels.blocks import DecoderLayer, MoE, RMSNorm, RotaryEmbedding, init_linear_
from ligermodels.config import DecoderConfig

if TYPE_CHECKING:
    from ligermodels.generation import KVCacheStep


class OutputHead(nn.Linear):
    """The untied output projection, weight (V, H), with the chunked loss as a method of its own.

    So FSDP2 can make the head a unit of its own (``register_fsdp_forward_method(head, "loss")``): its
    gradient's reduce-scatter then starts as soon as backward has passed the head, under the layers'
    backward, instead of waiting with the embedding's for the end of backward.
    """

    def __init__(self, hidden_size: int, vocab_size: int):
        super().__init__(hidden_size, vocab_size, bias=False)

    def loss(self, h: torch.Tensor, target: torch.Tensor, **options) -> torch.Tensor:
        """:func:`kernels.fused_linear_cross_entropy` of hidden states (N, H) against targets (N,)."""
        return fused_linear_cross_entropy(h, self.weight, target, **options)

    def logprobs(self, h: torch.Tensor, target: torch.Tensor, **options) -> torch.Tensor:
        """:func:`kernels.logprobs.fused_linear_logprobs` of hidden states (N, H) for targets (N,)."""
        return fused_linear_logprobs(h, self.weight, target, **options)

    def logprob_loss(self, h: torch.Tensor, target: torch.Tensor, loss_fn, group_ends, **options):
        """:func:`kernels.logprobs.fused_linear_logprob_loss` of hidden states (N, H) for targets (N,)."""
        return fused_linear_logprob_loss(h, self.weight, target, loss_fn, group_ends, **options)


class CausalLM(nn.Module):
    """A decoder-only language model described by a :class:`DecoderConfig`.

    Parameters (native names): ``embed.weight`` (V, H); ``layers.{i}.attn_norm.weight``,
    ``layers.{i}.attn.qkv.{weight,bias}`` ((Hq+2*Hkv)*D, H), ``layers.{i}.attn.o.weight`` (H, Hq*D),
    ``layers.{i}.mlp_norm.weight``, ``layers.{i}.mlp.gate_up.weight`` (2*I, H),
    ``layers.{i}.mlp.down.weight`` (H, I); ``norm.weight`` (H,); ``head.weight`` (V, H) unless tied.
    With ``qk_norm``: ``layers.{i}.attn.q_norm.weight``, ``layers.{i}.attn.k_norm.weight`` (D,); with
    ``post_norms``: ``layers.{i}.post_attn_norm.weight``, ``layers.{i}.post_mlp_norm.weight`` (H,). A
    mixture-of-experts layer has ``layers.{i}.mlp.router.weight`` (E, H), ``layers.{i}.mlp.experts_gate_up``
    (E, 2*I, H) and ``layers.{i}.mlp.experts_down`` (E, H, I) instead of the dense MLP's weights.
    """

    def __init__(self, config: DecoderConfig):
        super().__init__()
        self.config = c = config
        self.embed = nn.Embedding(c.vocab_size, c.hidden_size, padding_idx=c.pad_token_id)
        self.rotary = RotaryEmbedding(c.rope)
        #: the rotary tables of the layers with a window, when they differ (Gemma 3's local base frequency)
        self.rotary_local = None if c.local_rope is None else RotaryEmbedding(c.local_rope)
        self.layers = nn.ModuleList(DecoderLayer(c, i) for i in range(c.num_layers))
        self.norm = RMSNorm(c.hidden_size, c.norm_eps, c.norm_offset, c.norm_casting)
        self.head = None if c.tie_embeddings else OutputHead(c.hidden_size, c.vocab_size)
        #: Add the residual stream into each layer's input before the layer (which then starts the stream from that
        #: sum, as the first layer does from the embedding) instead of inside its first norm. The same numbers
        #: forward; set under activation checkpointing, whose saved inputs are then one (B, S, H) tensor a layer,
        #: not two (``ligermodels.train.parallelize.apply_activation_checkpointing``).
        self.sum_residual = False

    # ------------------------------------------------------------------------------ parameters
    @property
    def head_weight(self) -> torch.Tensor:
        """The output projection (V, H): the embedding's weight when tied."""
        return self.embed.weight if self.head is None else self.head.weight

    def init_weights(self, std: float = 0.02) -> CausalLM:
        """Random init for training from scratch: normal(0, std) matrices, zero biases, identity norms."""
        init_linear_(self, std)
        return self

    def init_buffers(self) -> None:
        """Recompute non-persistent buffers (rotary frequencies) after materialising from meta."""
        self.rotary.reset_parameters()
        if self.rotary_local is not None:
            self.rotary_local.reset_parameters()

    def use_fp8(self, mode: str | None = "rowwise") -> CausalLM:
        """Run the decoder layers' dense projections (q/k/v, o, gate/up, down) in FP8 (:mod:`kernels.fp8`):
        ``mode`` a key of :data:`kernels.fp8.FP8_MODES` ("rowwise": the three GEMMs of each projection on e4m3
        operands with power-of-two scales along their reduction dims; "rowwise-e5m2": output gradients in e5m2;
        "rowwise-gw-bf16": weight gradients in bf16), or None (back to bf16).
        The weights stay as they are (FP8 copies are made on each call); embeddings, norms, attention, the loss
        head and mixture-of-experts layers' experts and router stay in the compute dtype. Under LoRA adapters the
        frozen base's GEMMs run in FP8 and the adapters' in the compute dtype; call it after ``add_lora`` or
        before (the adapted projections keep the mode). Returns the model."""
        fp8_recipe(mode, "use_fp8", "mode")
        for layer in self.layers:
            linears = [layer.attn.qkv, layer.attn.o] + ([] if isinstance(layer.mlp, MoE) else
                                                         [layer.mlp.gate_up, layer.mlp.down])
            for m in linears:
                m.fp8 = mode
        return self

    # --------------------------------------------------------------------------------- forward
    def hidden_states(self, input_ids: torch.Tensor, position_ids: torch.Tensor | None = None,
                      document_ids: torch.Tensor | Documents | SharedPrefixes | None = None,
                      cache: KVCacheStep | None = None
                      ) -> torch.Tensor:
        """Final-norm hidden states (B, S, H) for token ids (B, S).

        Args:
            position_ids: (B, S) or (S,) positions; default 0..S-1. Packed sequences pass positions
                that restart at 0 for each document.
            document_ids: (B, S) ids; tokens attend only within their own document. Derive them from
                restarting positions with :func:`document_ids_from_positions`, or pass
                ``Documents.from_positions(position_ids)`` built on the host: on CUDA the packed-document
                kernel needs the documents' bounds on the host, which plain ids cost one device-to-host
                copy per forward to get. :class:`ligermodels.attention.SharedPrefixes` (one row): sequences
                whose common prefixes are stored once in ``input_ids``; attention sees each sequence whole.
            cache: generation only: one step of a :class:`ligermodels.generation.KVCache` (its
                ``step(...)``); the layers write their k/v into it and attend over it.
        """
        b, s = input_ids.shape
        if position_ids is None:
            position_ids = torch.arange(s, device=input_ids.device)
        x = self.embed(input_ids)
        if self.config.embed_scale is not None:  # HF Gemma rounds the scale to the compute dtype first
            x = x * torch.tensor(self.config.embed_scale, dtype=x.dtype)
        cos, sin = self.rotary(position_ids)
        local = (cos, sin) if self.rotary_local is None else self.rotary_local(position_ids)
        mask = AttentionMask(s, document_ids)
        residual = None
        for i, layer in enumerate(self.layers):
            c, sn = local if self.config.layer_windows[i] is not None else (cos, sin)
            if self.sum_residual and residual is not None:  # bf16(x + residual), as the fused norm rounds it
                x, residual = x + residual, None
            x, residual = layer(x, residual, c, sn, mask, None if cache is None else cache[i])
        return self.norm(x, residual)[0]

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """Output logits (..., V) of final hidden states (..., H): the head, then ``final_softcap`` if set."""
        z = F.linear(h, self.embed.weight) if self.head is None else self.head(h)
        cap = self.config.final_softcap
        return z if cap is None else torch.tanh(z / cap) * cap

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor | None = None,
                document_ids: torch.Tensor | Documents | None = None) -> torch.Tensor:
        """Logits (B, S, V) in the parameter dtype (soft-capped when the config says so)."""
        return self.logits(self.hidden_states(input_ids, position_ids, document_ids))

    def loss(self, input_ids: torch.Tensor, labels: torch.Tensor, num_items: int | torch.Tensor | None = None,
             position_ids: torch.Tensor | None = None, document_ids: torch.Tensor | Documents | None = None,
             ignore_index: int = -100, router_aux_scale: float = 1.0, **loss_options) -> torch.Tensor:
        """Mean next-token cross-entropy with HF's convention, without materialising logits.

        ``labels`` (B, S) are aligned with ``input_ids`` and shifted here: position t predicts
        ``labels[:, t + 1]``; ``ignore_index`` marks tokens without loss. The mean is over the
        non-ignored tokens, or over ``num_items`` when given (gradient accumulation / data
        parallelism). ``loss_options`` (label_smoothing, lse_square_scale, softcap, reduction, strategy) go
        to :func:`kernels.fused_linear_cross_entropy`; ``strategy="vocab"`` trades one more GEMM of the
        head for no fp32 (V, H) weight-gradient buffer. ``softcap`` defaults to the config's ``final_softcap``.
        A mixture-of-experts config with ``output_router_logits`` adds ``router_aux_loss_coef`` times the
        load-balancing loss of this forward (:meth:`router_aux_loss`), times ``router_aux_scale`` (the trainer's
        share of one micro-batch in a step, so a step weighs the mean of its micro-batches' losses), to the
        reduced loss only: with ``reduction="none"`` the per-token losses are the cross-entropy alone.
        """
        h, target = self._head_inputs(input_ids, labels, position_ids, document_ids, ignore_index)
        if self.config.final_softcap is not None:
            loss_options.setdefault("softcap", self.config.final_softcap)
        loss_options.update(ignore_index=ignore_index, num_items=num_items)
        if self.head is None:
            loss = fused_linear_cross_entropy(h, self.embed.weight, target, **loss_options)
        else:
            loss = self.head.loss(h, target, **loss_options)  # its own method: FSDP2 gathers it when it is a unit
        if self.config.output_router_logits and self.config.num_experts and loss_options.get("reduction") != "none":
            loss = loss + router_aux_scale * self.config.router_aux_loss_coef * self.router_aux_loss()
        return loss

    def _head_inputs(self, input_ids: torch.Tensor, labels: torch.Tensor, position_ids, document_ids,
                     ignore_index: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(final hidden states (B * S, H), next-token targets (B * S,)): ``labels`` shifted left, ``ignore_index``
        at each row's last position."""
        h = self.hidden_states(input_ids, position_ids, document_ids)
        target = F.pad(labels[:, 1:], (0, 1), value=ignore_index)
        return h.reshape(-1, h.shape[-1]), target.reshape(-1)

    def router_aux_loss(self) -> torch.Tensor:
        """The load-balancing loss (:func:`kernels.load_balancing_loss`) of the last forward's router logits over
        every sparse layer, unweighted (transformers' ``aux_loss``); :meth:`loss` adds ``router_aux_loss_coef``
        times it when the config's ``output_router_logits`` is set."""
        logits = [layer.mlp.router_logits for layer in self.layers if isinstance(layer.mlp, MoE)]
        if not logits or any(t is None for t in logits):
            raise RuntimeError("router_aux_loss: no forward of a mixture-of-experts model has run")
        return load_balancing_loss(logits, self.config.num_experts, self.config.experts_per_token)

    def token_logprobs(self, input_ids: torch.Tensor, labels: torch.Tensor, position_ids: torch.Tensor | None = None,
                       document_ids: torch.Tensor | Documents | SharedPrefixes | None = None, ignore_index: int = -100,
                       strategy: str = "tokens", head_rows: torch.Tensor | None = None) -> torch.Tensor:
        """fp32 log-probabilities (B * S,) of the next tokens, without materialising logits: entry ``b * S + t`` is
        log p(``labels[b, t + 1]`` | tokens ``..t``), 0 where that label is ``ignore_index`` and at ``t = S - 1``.
        ``labels`` (B, S) are aligned with ``input_ids`` as in :meth:`loss`; the head is
        :func:`kernels.logprobs.fused_linear_logprobs` (soft-capped when the config says so).

        With ``head_rows`` (N,) int64, only those rows of the flattened (B * S) hidden states go through the head
        (a row may repeat: a shared prompt's last token predicts each completion's first), and ``labels`` (N,) are
        the tokens they predict, unshifted; the result is (N,)."""
        return self._logprob_head("logprobs", fused_linear_logprobs, input_ids, labels, position_ids, document_ids,
                                  ignore_index, strategy, head_rows)

    def logprob_loss(self, input_ids: torch.Tensor, labels: torch.Tensor, loss_fn, group_ends,
                     position_ids: torch.Tensor | None = None,
                     document_ids: torch.Tensor | Documents | SharedPrefixes | None = None, ignore_index: int = -100,
                     strategy: str = "tokens", head_rows: torch.Tensor | None = None
                     ) -> tuple[torch.Tensor, torch.Tensor]:
        """(``loss_fn(logp)``, ``logp`` detached) for the per-token log-probs (B * S,) of :meth:`token_logprobs`,
        where ``loss_fn`` is a sum of terms over groups of tokens ending at the flat offsets ``group_ends`` (host
        ints), each term depending on its own group only (a preference pair): the head then takes its gradient
        in the forward (:func:`kernels.logprobs.fused_linear_logprob_loss`, 3 GEMMs of the head instead of 4).
        ``head_rows``: as :meth:`token_logprobs` (then ``group_ends`` count head rows)."""
        return self._logprob_head("logprob_loss", fused_linear_logprob_loss, input_ids, labels, position_ids,
                                  document_ids, ignore_index, strategy, head_rows, loss_fn, group_ends)

    def _logprob_head(self, method: str, op, input_ids, labels, position_ids, document_ids, ignore_index: int,
                      strategy: str, head_rows: torch.Tensor | None, *extra):
        """The final hidden states and targets through a log-prob head: ``op(h, weight, target, *extra, ...)`` on
        the tied embedding, or the untied head's own ``method`` (which FSDP2 gathers as a unit of its own)."""
        if head_rows is None:
            h, target = self._head_inputs(input_ids, labels, position_ids, document_ids, ignore_index)
        else:
            h = self.hidden_states(input_ids, position_ids, document_ids)
            h, target = h.reshape(-1, h.shape[-1]).index_select(0, head_rows), labels.reshape(-1)
        options = dict(ignore_index=ignore_index, softcap=self.config.final_softcap, strategy=strategy)
        if self.head is None:
            return op(h, self.embed.weight, target, *extra, **options)
        return getattr(self.head, method)(h, target, *extra, **options)

    # ------------------------------------------------------------------------- generation
    @torch.no_grad()
    def generate(self, input_ids: torch.Tensor, max_new_tokens: int, temperature: float = 0.0,
                 top_k: int | None = None, top_p: float | None = None, eos_token_id: int | list[int] | None = None,
                 attention_mask: torch.Tensor | None = None, pad_token_id: int | None = None,
                 generator: torch.Generator | None = None, compile: bool = False) -> torch.Tensor:
        """Token ids (B, S + new) continuing ``input_ids`` (B, S), with a static KV cache.

        Greedy when ``temperature`` is 0, else sampling with ``top_k`` / ``top_p``; left padding through
        ``attention_mask`` (B, S); rows stop at ``eos_token_id``. See :func:`ligermodels.generation.generate`.
        """
        from ligermodels.generation import generate

        return generate(self, input_ids, max_new_tokens, temperature=temperature, top_k=top_k, top_p=top_p,
                        eos_token_id=eos_token_id, attention_mask=attention_mask, pad_token_id=pad_token_id,
                        generator=generator, compile=compile)

    # ------------------------------------------------------------------------ checkpoints
    @classmethod
    def from_hf(cls, repo_or_dir: str, dtype: torch.dtype | str | None = None, device: str | torch.device | None = None,
                revision: str | None = None, quantize: str | None = None) -> CausalLM:
        """Load a Hugging Face checkpoint (safetensors only); ``quantize="nf4"`` stores the decoder layers'
        projections in 4 bits (QLoRA). See :func:`ligermodels.hf_io.load_hf`."""
        from ligermodels.hf_io import load_hf  # (hf_io imports this module)

        return load_hf(repo_or_dir, dtype=dtype, device=device, revision=revision, expect=cls, quantize=quantize)

    def save_hf(self, out_dir: str, max_shard_bytes: int = 5 << 30) -> None:
        """Write config.json and sharded safetensors that transformers loads. See :func:`ligermodels.hf_io.save_hf`."""
        from ligermodels.hf_io import save_hf

        save_hf(self, out_dir, max_shard_bytes=max_shard_bytes)


__all__ = ["CausalLM", "document_ids_from_positions"]
