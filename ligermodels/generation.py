"""Autoregressive generation with a static (pre-allocated) KV cache: greedy, temperature, top-k, top-p.

    out = model.generate(input_ids, max_new_tokens=32)                        # greedy, (B, S + 32)
    out = model.generate(ids, 32, attention_mask=mask, eos_token_id=[2, 7])   # left-padded batch, per-row EOS
    out = model.generate(ids, 32, temperature=0.8, top_p=0.9, generator=torch.Generator().manual_seed(0))

How it works
------------
* **Cache.** :class:`KVCache` allocates, once per call, a zero-filled (B, S + new, Hkv, D) key and value
  buffer per layer. Slot ``j`` of a row holds the token in column ``j`` of the output (padding included),
  so all rows write the same slot at each step; new k/v are written in place with ``index_copy_``.
* **Prefill.** The prompt runs through the model's own forward (``CausalLM.hidden_states``), so it uses
  the training attention path (SDPA / FlexAttention), with the padding mask given as document ids
  (pads = 0, tokens = 1: a token never sees a pad; a pad sees only pads, so no row is fully masked).
  Its k/v land in slots 0..S-1.
* **Decode.** One token per step: it writes slot ``S + t`` and attends over the whole buffer with a
  boolean mask: slot is not padding, slot <= the query's slot, and ``query slot - slot < window`` for
  sliding-window layers (HF's convention: the window counts the query itself). Slots are columns and a
  row's tokens are contiguous after its left padding, so slot distances are position distances. The
  attention is :func:`kernels.decode_attention`: the grouped query heads of one kv head are one tile, so
  k/v are never repeated, and the buffer's length is split over programs (a batch of one still fills the
  GPU); soft-capped layers (Gemma 2) take a dense computation instead. Every tensor of a step has a static
  shape and the slot is a device tensor, so the step can be compiled and CUDA-graphed (``compile=True``).
* **Positions** follow transformers: ``position_ids = cumsum(attention_mask) - 1`` (pads at 0), and each
  new token's position is the previous one + 1.
* **RoPE.** cos/sin come from the model's ``RotaryEmbedding`` with each call's position ids, so the
  length-dependent types (dynamic NTK, longrope) pick their frequencies from ``max(position_ids) + 1``
  of that call -- the prefill's, then each decode step's -- exactly as HF's rotary forward does; keys
  already in the cache keep the rotation they were written with (HF's caches store rotated keys too).
  Phi-3 with longrope is the one exception, mirrored from HF's ``Phi3ForCausalLM``: when the sequence
  first grows past ``original_max_position_embeddings`` (HF: ``input_ids.shape[1] >= om + 1`` with at
  most ``om`` cached tokens) HF drops its cache and recomputes the whole sequence, so every key is
  rotated with the long factors from then on; :func:`generate` re-runs the prefill over the sequence
  so far at that step, into the same buffers.
* **Stopping.** A row that emitted an EOS id emits ``pad_token_id`` afterwards (default: the first EOS
  id, as HF); generation stops early once every row is done, returning (B, S + steps) as HF does.
"""

from __future__ import annotations

import numbers
from collections.abc import Sequence

import torch
import torch.nn.functional as F

from kernels import decode_attention
from kernels.decode_attention import decode_attention_reference
from ligermodels.attention import AttentionMask, causal_attention, softcap_attention
from ligermodels.config import DecoderConfig
from ligermodels.model import CausalLM


def _mark_static(t: torch.Tensor) -> None:
    """Tell torch.compile that ``t`` keeps its address (CUDA graphs may then write it in place)."""
    try:
        torch._dynamo.mark_static_address(t)
    except Exception:  # pragma: no cover - older torch / no dynamo: only an optimisation hint
        pass


class KVCache:
    """Static key/value buffers for generation, allocated once and written in place.

    Attributes:
        k, v: per layer, (B, max_len, Hkv, D) in the model dtype, zero-initialised (masked slots must
            hold finite values: a masked key still multiplies its value by a zero weight).
        key_valid: (B, max_len) bool, False on padding slots.
    """

    def __init__(self, config: DecoderConfig, batch: int, max_len: int, dtype: torch.dtype,
                 device: torch.device | str):
        shape = (batch, max_len, config.num_kv_heads, config.head_dim)
        self.batch, self.max_len, self.dtype, self.device = batch, max_len, dtype, torch.device(device)
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(config.num_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(config.num_layers)]
        self.key_valid = torch.ones(batch, max_len, dtype=torch.bool, device=device)
        self.slots = torch.arange(max_len, device=device)  # slot indices; views of it index the writes
        for t in (*self.k, *self.v, self.key_valid, self.slots):
            _mark_static(t)

    def matches(self, batch: int, max_len: int, dtype: torch.dtype, device: torch.device) -> bool:
        """Whether this cache can be reused for a call of this batch, length, dtype and device."""
        return (self.batch, self.max_len, self.dtype, self.device) == (batch, max_len, dtype, torch.device(device))

    def reset(self, attention_mask: torch.Tensor | None = None) -> None:
        """Clear the buffers (in place) and mark the padding slots of a (B, S) 0/1 ``attention_mask``."""
        for t in (*self.k, *self.v):
            t.zero_()
        self.key_valid.fill_(True)
        if attention_mask is not None:
            self.key_valid[:, :attention_mask.shape[1]].copy_(attention_mask.bool())

    def step(self, start: int, length: int = 1, prefill: bool = False) -> KVCacheStep:
        """The cache seen by one forward over ``length`` tokens in slots ``start .. start + length - 1``.

        ``prefill`` (only with ``start == 0``): the tokens attend among themselves through the model's
        attention path and their k/v are stored; otherwise they attend over the buffers.
        """
        if prefill and start != 0:
            raise ValueError("a prefill step writes the sequence from slot 0")
        if start + length > self.max_len:
            raise ValueError(f"slots {start}..{start + length - 1} exceed the cache length {self.max_len}")
        return KVCacheStep(self, self.slots[start:start + length], prefill)


class KVCacheStep:
    """One forward's view of a :class:`KVCache`: the slots it writes and its masks (shared by all layers).

    ``step[i]`` is layer i's :class:`LayerKVCache`, which ``Attention`` calls.
    """

    def __init__(self, cache: KVCache, slots: torch.Tensor, prefill: bool):
        self.cache, self.slots, self.prefill = cache, slots, prefill
        self.masks: dict[int | None, torch.Tensor] = {}

    def __getitem__(self, layer: int) -> LayerKVCache:
        return LayerKVCache(self, layer)

    def allowed(self, window: int | None) -> torch.Tensor:
        """(B, 1, s, max_len) bool: query slot q may read key slot k (not padding, k <= q, q - k < window)."""
        if window not in self.masks:
            c = self.cache
            q, k = self.slots[:, None], c.slots[None, :]
            ok = k <= q
            if window is not None:
                ok = ok & (q - k < window)
            self.masks[window] = ok[None, None] & c.key_valid[:, None, None, :]
        return self.masks[window]


class LayerKVCache:
    """Layer ``layer`` of a :class:`KVCacheStep`: stores the new k/v, then attends."""

    def __init__(self, step: KVCacheStep, layer: int):
        self.step, self.layer = step, layer

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: AttentionMask | None,
               window: int | None, scale: float | None, softcap: float | None = None) -> torch.Tensor:
        """q (B, s, Hq, D), new k/v (B, s, Hkv, D) -> attention output (B, s, Hq, D) (``softcap``: logit
        soft-capping, as :func:`causal_attention`).

        ``mask`` is the forward's :class:`AttentionMask`, used by prefill steps only.
        """
        st = self.step
        kc, vc = st.cache.k[self.layer], st.cache.v[self.layer]
        kc.index_copy_(1, st.slots, k)
        vc.index_copy_(1, st.slots, v)
        if st.prefill:
            return causal_attention(q, k, v, mask, window, scale, softcap=softcap)
        return cached_attention(q, kc, vc, st.allowed(window), scale, softcap)


def cached_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, allowed: torch.Tensor,
                     scale: float | None = None, softcap: float | None = None) -> torch.Tensor:
    """Grouped-query attention of new queries over cache buffers.

    Args:
        q: (B, s, Hq, D) contiguous; k, v: (B, L, Hkv, D) (last dim unit-stride).
        allowed: (B, 1, s, L) bool, True where a query may read a key; every row needs one True.
        scale: softmax scale (default D ** -0.5).
        softcap: attention logit soft-capping (Gemma 2), computed densely by :func:`softcap_attention`.
    Returns:
        (B, s, Hq, D). One query a row without gradients (a decode step) runs :func:`kernels.decode_attention`;
        otherwise the G = Hq / Hkv query heads sharing a kv head become the query axis of one SDPA call per
        kv head, so k/v are read once and never repeated.
    """
    b, s, hq, d = q.shape
    if softcap is not None:
        o = softcap_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), allowed, scale, softcap)
        return o.transpose(1, 2)
    hkv, length = k.shape[2], k.shape[1]
    g = hq // hkv
    if s == 1:  # a decode step: the split kernel; with gradients its reference, the same layout in one SDPA call
        attend = decode_attention_reference if torch.is_grad_enabled() else decode_attention
        return attend(q.view(b, hq, d), k, v, allowed.reshape(b, length), scale).view(b, 1, hq, d)
    qg = q.view(b, s, hkv, g, d).permute(0, 2, 3, 1, 4).reshape(b, hkv, g * s, d)
    m = allowed[:, :, None].expand(b, 1, g, s, length).reshape(b, 1, g * s, length)
    o = F.scaled_dot_product_attention(qg, k.transpose(1, 2), v.transpose(1, 2), attn_mask=m, scale=scale)
    return o.view(b, hkv, g, s, d).permute(0, 3, 1, 2, 4).reshape(b, s, hq, d)


# ------------------------------------------------------------------------------------ sampling
def _scalar(value):
    """A 0-dim tensor as its Python number (transformers takes them too); anything else unchanged."""
    return value.item() if isinstance(value, torch.Tensor) and value.dim() == 0 else value


def _check_sampling(temperature: float | None, top_k: int | None, top_p: float | None) -> None:
    """Raise ValueError, naming the argument, for values :func:`sample_next` has no meaning for
    (0-dim tensors already converted by :func:`_scalar`)."""
    for name, value, kind in (("temperature", temperature, numbers.Real), ("top_k", top_k, numbers.Integral),
                              ("top_p", top_p, numbers.Real)):
        if value is not None and (not isinstance(value, kind) or isinstance(value, bool)):
            raise ValueError(f"{name} must be {'an int' if kind is numbers.Integral else 'a number'} or None, "
                             f"got {value!r}")
    if temperature is not None and not temperature >= 0:  # `not >=` also refuses NaN
        raise ValueError(f"temperature must be >= 0 (0 or None: greedy), got {temperature}")
    if top_k is not None and not top_k >= 0:
        raise ValueError(f"top_k must be >= 0 (0 or None: off), got {top_k}")
    if top_p is not None and not 0 <= top_p <= 1:
        raise ValueError(f"top_p must be in [0, 1] (1 or None: off; 0 keeps the top token, as in HF), got {top_p}")


def sample_next(logits: torch.Tensor, temperature: float = 0.0, top_k: int | None = None,
                top_p: float | None = None, generator: torch.Generator | None = None) -> torch.Tensor:
    """Next token ids (B,) from logits (B, V).

    ``temperature`` 0 (or None) is greedy (argmax). Otherwise, in HF's order: divide by ``temperature``,
    keep the ``top_k`` largest logits, keep the smallest set of most likely tokens whose probability
    reaches ``top_p`` (the most likely token always stays; computed as transformers'
    ``TopPLogitsWarper`` does, so ties and rounding keep the same set), then draw from the softmax with ``generator``
    (which must live on the logits' device). A negative ``temperature``, ``top_p`` outside [0, 1] or a
    negative ``top_k`` (0 or None: off) raises ValueError rather than sampling something else.
    """
    temperature, top_k, top_p = _scalar(temperature), _scalar(top_k), _scalar(top_p)
    _check_sampling(temperature, top_k, top_p)
    if not temperature:
        return logits.argmax(dim=-1)
    logits = filtered_logits(logits.float() / temperature, top_k, top_p)
    return torch.multinomial(logits.softmax(dim=-1), 1, generator=generator).squeeze(-1)


def filtered_logits(logits: torch.Tensor, top_k: int | None, top_p: float | None) -> torch.Tensor:
    """``logits`` (B, V) with -inf where top_k, then top_p, drop a token (transformers' warpers' rules)."""
    if top_k is not None and 0 < top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p is not None and top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=False)  # ascending, as transformers
        drop = sorted_logits.softmax(dim=-1).cumsum(dim=-1) <= 1 - top_p  # the tail holding at most 1 - top_p
        drop[..., -1] = False  # the most likely token always stays (top_p = 0 included)
        logits = logits.masked_fill(drop.scatter(-1, order, drop), float("-inf"))
    return logits


# ----------------------------------------------------------------------------------- forwards
def _last_logits(model: CausalLM, h: torch.Tensor) -> torch.Tensor:
    """fp32 logits (B, V) of the last position only."""
    return model.logits(h[:, -1]).float()


def prefill(model: CausalLM, cache: KVCache, input_ids: torch.Tensor, position_ids: torch.Tensor,
            attention_mask: torch.Tensor | None = None) -> torch.Tensor:
    """Run ``input_ids`` (B, S) from slot 0, storing their k/v; fp32 logits (B, V) of the last column.

    ``attention_mask`` (B, S) 0/1 keeps padding out of attention (None: no padding).
    """
    docs = None if attention_mask is None else attention_mask.to(torch.int32)
    h = model.hidden_states(input_ids, position_ids, docs, cache=cache.step(0, input_ids.shape[1], prefill=True))
    return _last_logits(model, h)


def decode_step(model: CausalLM, cache: KVCache, tokens: torch.Tensor, position_ids: torch.Tensor,
                slot: torch.Tensor) -> torch.Tensor:
    """One token per row: tokens (B, 1) at positions (B, 1), written to cache slot ``slot`` ((1,) long
    tensor); fp32 logits (B, V). All shapes are static, so this is what ``compile=True`` compiles."""
    step = KVCacheStep(cache, slot, prefill=False)
    return _last_logits(model, model.hidden_states(tokens, position_ids, None, cache=step))


_compiled_decode_step = None


def _compiled_step():
    global _compiled_decode_step
    if _compiled_decode_step is None:
        _compiled_decode_step = torch.compile(decode_step, mode="reduce-overhead", dynamic=False)
    return _compiled_decode_step


def _rebuild_slot(config: DecoderConfig) -> int | None:
    """The slot at which HF's Phi-3 drops its cache and recomputes the sequence (longrope only), or None."""
    if config.model_type == "phi3" and config.rope.rope_type == "longrope":
        return config.rope.original_max
    return None


def _ids(eos: int | Sequence[int] | torch.Tensor | None) -> list[int] | None:
    if eos is None:
        return None
    if isinstance(eos, torch.Tensor):
        eos = eos.flatten().tolist()
    ids = [int(eos)] if isinstance(eos, numbers.Integral) else [int(e) for e in eos]
    return ids or None


@torch.no_grad()
def generate(model: CausalLM, input_ids: torch.Tensor, max_new_tokens: int, temperature: float = 0.0,
             top_k: int | None = None, top_p: float | None = None,
             eos_token_id: int | Sequence[int] | None = None, attention_mask: torch.Tensor | None = None,
             pad_token_id: int | None = None, generator: torch.Generator | None = None,
             compile: bool = False) -> torch.Tensor:
    """Continue ``input_ids`` with up to ``max_new_tokens`` tokens; returns (B, S + n) ids, n <= max_new_tokens.

    Args:
        model: a :class:`CausalLM` (any family), on any device; it is run under ``torch.no_grad``.
        input_ids: (B, S) prompt ids, left-padded when the prompts differ in length (a right-padded
            ``attention_mask`` is refused: the continuation would follow the padding).
        max_new_tokens: how many tokens to add at most (an int >= 0; 0 returns the prompt).
        temperature: 0 = greedy (argmax, equal to transformers' ``do_sample=False``); > 0 samples.
        top_k, top_p: sampling filters (see :func:`sample_next`); ignored when greedy.
        eos_token_id: an id or a list of ids; a row that emits one is finished and emits
            ``pad_token_id`` afterwards; the call returns early once every row is finished.
        attention_mask: (B, S) 1 for tokens, 0 for (left) padding; None = no padding.
        pad_token_id: filler after EOS (default: the first EOS id, as transformers).
        generator: torch.Generator on the model's device, for reproducible sampling.
        compile: compile the one-token decode step with ``torch.compile(mode="reduce-overhead")`` (CUDA
            graphs on GPU; on CPU it needs the reference kernels, i.e. not ``TRITON_INTERPRET=1``). The
            cache is then kept on the model (``model._generation_cache``; delete it to free the memory)
            and reused by calls of the same batch size and total length, so the compiled step and its
            graphs are reused too; a new shape compiles again.
    Returns:
        (B, S + n) ids in ``input_ids``' dtype: the prompt, then the generated tokens.
    """
    if input_ids.dim() != 2:
        raise ValueError(f"input_ids must be (batch, seq), got shape {tuple(input_ids.shape)}")
    b, s = input_ids.shape
    device = input_ids.device
    max_new_tokens = _scalar(max_new_tokens)
    if not isinstance(max_new_tokens, numbers.Integral) or isinstance(max_new_tokens, bool) or max_new_tokens < 0:
        raise ValueError(f"max_new_tokens must be an int >= 0, got {max_new_tokens!r}")
    temperature, top_k, top_p = _scalar(temperature), _scalar(top_k), _scalar(top_p)  # once, not per token
    _check_sampling(temperature, top_k, top_p)  # before the prefill, even when greedy
    eos = _ids(eos_token_id)
    mask = None
    if attention_mask is not None:
        attention_mask = attention_mask.to(device=device, dtype=torch.bool)
        if attention_mask.shape != input_ids.shape:
            raise ValueError(f"attention_mask {tuple(attention_mask.shape)} != input_ids {tuple(input_ids.shape)}")
        if not bool((attention_mask[:, 1:] >= attention_mask[:, :-1]).all()):
            raise ValueError("attention_mask must be left-padded: in every row all 0s (padding) come before the "
                             "1s (tokens)")
        if not bool(attention_mask.all()):
            mask = attention_mask
    if max_new_tokens == 0:
        return input_ids.clone()
    pad = pad_token_id if pad_token_id is not None else (eos[0] if eos else 0)
    eos_t = torch.tensor(eos, device=device) if eos else None
    total = s + max_new_tokens
    positions = torch.arange(s, device=device).expand(b, s)
    if mask is not None:
        positions = (mask.long().cumsum(-1) - 1).masked_fill(~mask, 0)

    dtype = model.head_weight.dtype
    cache = getattr(model, "_generation_cache", None) if compile else None
    if cache is None or not cache.matches(b, total, dtype, device):
        cache = KVCache(model.config, b, total, dtype, device)
        if compile:
            model._generation_cache = cache
    else:
        cache.reset()
    if mask is not None:
        cache.key_valid[:, :s].copy_(mask)
    step = _compiled_step() if compile else decode_step

    out = torch.full((b, total), pad, dtype=input_ids.dtype, device=device)
    out[:, :s] = input_ids
    finished = torch.zeros(b, dtype=torch.bool, device=device)
    # (B, 1) position of the first new token: the row's token count (HF: last position + 1; 0 for a row
    # that is all padding)
    next_pos = torch.full((b, 1), s, device=device) if mask is None else mask.sum(-1, keepdim=True)
    rebuild = _rebuild_slot(model.config)

    logits = prefill(model, cache, input_ids, positions, mask)
    n = 0
    for t in range(max_new_tokens):
        tok = sample_next(logits, temperature, top_k, top_p, generator)
        if eos_t is not None:
            tok = torch.where(finished, torch.full_like(tok, pad), tok)
            finished |= torch.isin(tok, eos_t)
        out[:, s + t] = tok
        n = t + 1
        if n == max_new_tokens or (eos_t is not None and bool(finished.all())):
            break
        col = s + t  # the new token's column = its cache slot
        if col == rebuild:  # Phi-3 longrope: recompute the whole sequence, as HF does at this length
            gen_pos = next_pos + torch.arange(t + 1, device=device)
            full_mask = None if mask is None else F.pad(mask, (0, t + 1), value=True)
            logits = prefill(model, cache, out[:, :col + 1], torch.cat([positions, gen_pos], dim=1), full_mask)
            continue
        if compile and device.type == "cuda":
            torch.compiler.cudagraph_mark_step_begin()
        logits = step(model, cache, tok[:, None], next_pos + t, cache.slots[col:col + 1])
    return out[:, :s + n]


__all__ = ["KVCache", "KVCacheStep", "LayerKVCache", "cached_attention", "sample_next", "prefill",
           "decode_step", "generate"]
