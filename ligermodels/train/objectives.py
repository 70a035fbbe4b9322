"""What a training step's loss is. Supervised fine-tuning: the next-token cross-entropy of the packed rows'
labelled tokens, summed and divided by the number of labelled tokens in the whole global batch.

Every micro-batch calls ``model.loss(..., num_items=N)`` with ``N`` that global count (counted on the host per
micro-batch, summed, all-reduced), and its loss is multiplied by ``world_size`` before backward to undo FSDP's
average over ranks: the gradient is exactly ``d(sum of token losses) / N`` however the global batch is split
over ranks and accumulation steps.

Preference objectives (``--objective dpo|orpo|simpo|kto``, :class:`PreferenceTask`): TRL 1.16's losses and metrics
(:func:`dpo_terms`, :func:`orpo_terms`, :func:`simpo_terms`, :func:`kto_terms`) of per-sequence log-probs from the
chunked fused-linear head (:mod:`kernels.logprobs`), each step's mean taken over the whole global batch the same way.
The loop asks a task (:class:`SFTTask` or :class:`PreferenceTask`) for a step's micro-batches and counts, runs its
``forward_backward`` on each, and logs its ``metrics``.
"""

from __future__ import annotations

import dataclasses
import functools

import torch
import torch.distributed as dist
import torch.nn.functional as F

from kernels.logprobs import sequence_sums
from ligermodels.attention import Documents, document_ids_from_positions, to_device
from ligermodels.config import DecoderConfig
from ligermodels.lora import adapters_disabled
from ligermodels.model import CausalLM
from ligermodels.train.config import TrainConfig
from ligermodels.train.data import count_loss_tokens
from ligermodels.train.parallelize import loss_strategy
from ligermodels.train.preference import (
    WITH_REFERENCE,
    ExampleStream,
    PackedSequences,
    PreferenceBatch,
    SharedRoom,
    example_slot,
    make_batch,
    packed_room,
    slot_ends,
)


def sft_loss(model: CausalLM, config: TrainConfig, input_ids: torch.Tensor, labels: torch.Tensor,
             positions: torch.Tensor, num_items: torch.Tensor, documents: Documents | None, world: int = 1
             ) -> torch.Tensor:
    """The loss of one micro-batch (B, S) already on the device (eager, and inside ``--cuda-graph``'s capture):
    the summed token losses over ``num_items``, with the loss head :func:`loss_strategy` picks. A mixture-of-experts
    model's load-balancing term (when its config asks for it) counts 1 / (micro-batches x ranks) of its weight, so
    a step's is the mean over its micro-batches."""
    return model.loss(input_ids, labels, num_items=num_items, position_ids=positions, document_ids=documents,
                      strategy=loss_strategy(config, model.config, input_ids.device),
                      router_aux_scale=1.0 / (config.grad_accum * world))


def forward_backward(model: CausalLM, input_ids: torch.Tensor, labels: torch.Tensor, positions: torch.Tensor,
                     num_items: torch.Tensor, config: TrainConfig, world: int, device: torch.device
                     ) -> torch.Tensor:
    """One micro-batch of host rows (B, S): moved to ``device``, its :func:`sft_loss` and backward; returns the
    loss, detached."""
    # the documents' bounds are found here, on the host, so attention needs no device-to-host copy
    documents = Documents.from_positions(positions).to(device) if config.attention == "documents" else None
    input_ids, labels, positions = (to_device(t, device) for t in (input_ids, labels, positions))
    loss = sft_loss(model, config, input_ids, labels, positions, num_items, documents, world)
    (loss * world).backward()  # FSDP divides the summed gradients by world: this undoes it
    return loss.detach()


def pinned(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """Host tensors in pinned memory, which a CUDA graph's input copies read without waiting (a machine without
    CUDA, the tests', keeps them as they are)."""
    return [t.pin_memory() for t in tensors] if torch.cuda.is_available() else tensors


# ------------------------------------------------------------------------------------------ preferences
def log1mexp(x: torch.Tensor) -> torch.Tensor:
    """log(1 - exp(x)) for x < 0, stable on both sides of -ln 2."""
    return torch.where(x < -0.6931471805599453, torch.log1p(-torch.exp(x)), torch.log(-torch.expm1(x)))


def dpo_terms(config: TrainConfig, chosen: torch.Tensor, rejected: torch.Tensor, ref_chosen: torch.Tensor,
              ref_rejected: torch.Tensor, chosen_len: torch.Tensor, rejected_len: torch.Tensor
              ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """DPO per pair (P,) from summed completion log-probs (P,) of the policy and the reference, as TRL's
    ``DPOTrainer``: ``--dpo-loss`` sigmoid, hinge, ipo (each log-ratio over its completion's tokens, TRL's IPO) or
    robust (``--label-smoothing`` the flip probability). Returns (losses, per-pair metrics)."""
    beta, eps = config.beta, config.label_smoothing
    chosen_ratio, rejected_ratio = chosen - ref_chosen, rejected - ref_rejected
    delta = chosen_ratio - rejected_ratio
    if config.dpo_loss == "sigmoid":
        losses = -F.logsigmoid(beta * delta)
    elif config.dpo_loss == "hinge":
        losses = torch.relu(1 - beta * delta)
    elif config.dpo_loss == "ipo":
        ipo = chosen_ratio / chosen_len.clamp(min=1) - rejected_ratio / rejected_len.clamp(min=1)
        losses = (ipo - 1 / (2 * beta)) ** 2
    else:  # robust
        losses = (-(1 - eps) * F.logsigmoid(beta * delta) + eps * F.logsigmoid(-beta * delta)) / (1 - 2 * eps)
    return losses, _reward_metrics(beta * chosen_ratio.detach(), beta * rejected_ratio.detach(), chosen, rejected)


def _reward_metrics(chosen_reward: torch.Tensor, rejected_reward: torch.Tensor, chosen: torch.Tensor,
                    rejected: torch.Tensor) -> dict[str, torch.Tensor]:
    return {"rewards/chosen": chosen_reward, "rewards/rejected": rejected_reward,
            "rewards/accuracies": (chosen_reward > rejected_reward).float(),
            "rewards/margins": chosen_reward - rejected_reward,
            "logps/chosen": chosen.detach(), "logps/rejected": rejected.detach()}


def orpo_terms(config: TrainConfig, chosen_avg: torch.Tensor, rejected_avg: torch.Tensor
               ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """ORPO's odds-ratio term per pair (P,), to be subtracted from the chosen NLL, from the completions' mean
    token log-probs, as TRL's ``ORPOTrainer`` (``--beta`` its weight lambda)."""
    log_odds = (chosen_avg - rejected_avg) - (log1mexp(chosen_avg) - log1mexp(rejected_avg))
    ratio = F.logsigmoid(log_odds)
    metrics = _reward_metrics(config.beta * chosen_avg.detach(), config.beta * rejected_avg.detach(), chosen_avg,
                              rejected_avg)
    return -config.beta * ratio, {**metrics, "log_odds_ratio": ratio.detach(), "log_odds_chosen": log_odds.detach()}


def simpo_terms(config: TrainConfig, chosen_avg: torch.Tensor, rejected_avg: torch.Tensor
                ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """SimPO per pair (P,) from the completions' mean token log-probs, as TRL's ``CPOTrainer`` with
    ``loss_type="simpo"``: margin ``--simpo-gamma``, ``--label-smoothing``."""
    beta, eps = config.beta, config.label_smoothing
    logits = chosen_avg - rejected_avg - config.simpo_gamma / beta
    losses = -F.logsigmoid(beta * logits) * (1 - eps) - F.logsigmoid(-beta * logits) * eps
    return losses, _reward_metrics(beta * chosen_avg.detach(), beta * rejected_avg.detach(), chosen_avg, rejected_avg)


def kto_terms(config: TrainConfig, logps: torch.Tensor, ref_logps: torch.Tensor, desirable: torch.Tensor,
              kl: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """KTO per example (P,) as TRL's ``KTOTrainer``: summed completion log-probs of the policy and the reference,
    ``desirable`` (P,) bool, ``kl`` the batch's detached KL estimate (clamped at 0); weighted by
    ``--desirable-weight`` / ``--undesirable-weight``. Metrics are per example, zero where they do not apply."""
    ratio = logps - ref_logps
    chosen = 1 - torch.sigmoid(config.beta * (ratio - kl))
    rejected = 1 - torch.sigmoid(config.beta * (kl - ratio))
    losses = torch.where(desirable, config.desirable_weight * chosen, config.undesirable_weight * rejected)
    reward, d = config.beta * ratio.detach(), desirable.float()
    return losses, {"rewards/chosen": reward * d, "logps/chosen": logps.detach() * d,
                    "rewards/rejected": reward * (1 - d), "logps/rejected": logps.detach() * (1 - d)}


#: The metrics each objective adds to metrics.jsonl (TRL's names), and what each step's sum is divided by.
_PAIR_METRICS = ("rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins", "logps/chosen",
                 "logps/rejected")
PREFERENCE_METRICS = {
    "dpo": dict.fromkeys(_PAIR_METRICS, "pairs"),
    "orpo": {**dict.fromkeys((*_PAIR_METRICS, "log_odds_ratio", "log_odds_chosen"), "pairs"), "nll_loss": None},
    "simpo": {**dict.fromkeys(_PAIR_METRICS, "pairs"), "nll_loss": None},
    "kto": {"rewards/chosen": "desirable", "logps/chosen": "desirable", "rewards/rejected": "undesirable",
            "logps/rejected": "undesirable", "kl": "micro_batches"},
}


class SFTTask:
    """Supervised fine-tuning's steps: packed rows (:class:`ligermodels.train.data.PackedRows`), the token-mean
    cross-entropy (:func:`sft_loss`). ``consumed`` counts rows."""

    def __init__(self, config: TrainConfig, rows):
        self.config, self.rows = config, rows

    def describe(self, global_rows: int) -> str:
        return (f"{len(self.rows.lengths)} documents, {self.rows.epoch_len} tokens per epoch, global batch "
                f"{global_rows} x {self.config.seq_len} tokens")

    def batches(self, consumed: int, rank: int, world: int, device: torch.device) -> tuple[list, dict]:
        """This rank's micro-batches of the step starting at ``consumed``, and the step's global counts."""
        c = self.config
        micro = [self.rows.rows(consumed + (m * world + rank) * c.batch_size, c.batch_size)
                 for m in range(c.grad_accum)]
        n_tokens = to_device(torch.tensor(sum(count_loss_tokens(labels) for _, labels, _ in micro)), device)
        dist.all_reduce(n_tokens)  # tokens with a label in the whole global batch
        return micro, {"num_items": n_tokens.clamp(min=1), "n_tokens": n_tokens,
                       "tokens": c.batch_size * world * c.grad_accum * c.seq_len}

    def forward_backward(self, model: CausalLM, micro, norms: dict, world: int, device: torch.device
                         ) -> torch.Tensor:
        """(loss,) of one micro-batch, after its backward."""
        return forward_backward(model, *micro, norms["num_items"], self.config, world, device)[None]

    # -- --cuda-graph: the documents' bounds padded to the same shape
    @property
    def graph_misfit(self) -> str:
        """Why a micro-batch runs eagerly under --cuda-graph (printed once)."""
        return f"more documents than --graph-documents {self.config.graph_documents} per row leave room for"

    def graph_inputs(self, micro: tuple[torch.Tensor, ...], counts: dict) -> list[torch.Tensor] | None:
        """A micro-batch of host rows as a captured step's inputs (ids, labels, positions, the device token count,
        then the documents' bounds padded to ``batch x --graph-documents`` sequences with the row length as the
        longest: :meth:`Documents.padded`), pinned; None when its documents do not fit that room."""
        c = self.config
        input_ids, labels, positions = micro
        inputs = [input_ids, labels, positions]
        if c.attention == "documents":
            documents = Documents.from_positions(positions).padded(c.batch_size * c.graph_documents, c.seq_len)
            if documents is None:
                return None
            inputs.append(documents.cu_seqlens)
        inputs = pinned(inputs)
        return inputs[:3] + [counts["num_items"]] + inputs[3:]

    def graph_loss(self, model: CausalLM, input_ids: torch.Tensor, labels: torch.Tensor, positions: torch.Tensor,
                   num_items: torch.Tensor, cu_seqlens: torch.Tensor | None = None
                   ) -> tuple[torch.Tensor, torch.Tensor]:
        """(loss, (loss,)) of :meth:`graph_inputs` on the device: the eager step's :func:`sft_loss`."""
        documents = None if cu_seqlens is None else Documents(document_ids_from_positions(positions), cu_seqlens,
                                                              self.config.seq_len)
        loss = sft_loss(model, self.config, input_ids, labels, positions, num_items, documents)
        return loss, loss.detach()[None]

    def metrics(self, sums: list[float], norms: dict) -> dict:
        return {}


def wants_router_aux(config: TrainConfig, model_config: DecoderConfig) -> bool:
    """Whether a preference objective adds the policy's load-balancing loss (:meth:`PreferenceTask.router_aux`)."""
    m = model_config
    return bool(m.num_experts and m.router_aux_loss_coef and (config.objective in WITH_REFERENCE
                                                               or m.output_router_logits))


class PreferenceTask:
    """A preference objective's steps (``--objective`` dpo, orpo, simpo, kto): micro-batches of whole examples
    (:mod:`ligermodels.train.preference`), the policy's sequence log-probs from the chunked fused-linear head
    (:func:`kernels.logprobs.fused_linear_logprobs`), the reference's from :attr:`reference_logps` (computed once
    before training: :meth:`compute_reference_logps`) or from :attr:`reference_model` (a frozen copy) or, with
    LoRA, from the policy with its adapters off. ``consumed`` counts examples.

    The loss of a step is its examples' mean over the whole global batch (and ORPO's / SimPO's chosen NLL the mean
    over the global batch's tokens), so any split over ranks and micro-batches takes the same step; with one
    micro-batch it is TRL's loss of that batch."""

    def __init__(self, config: TrainConfig, examples: list, strategy: str,
                 model_config: DecoderConfig | None = None):
        self.config, self.examples, self.strategy = config, examples, strategy
        #: --prompt-pass once applies: not when a load-balancing loss counts (it weighs each token of the policy's
        #: forward, a prompt once per sequence in TRL's), nor to KTO under --cuda-graph (whose rows keep every position)
        self.prompt_once = (config.prompt_pass == "once" and not (config.cuda_graph and config.objective == "kto")
                            and not (model_config is not None and wants_router_aux(config, model_config)))
        self.stream = ExampleStream(len(examples), config.seed)
        self.names = PREFERENCE_METRICS[config.objective]
        self.reference_logps: torch.Tensor | None = None  # (examples, 2) fp32 on the host
        self.reference_model: CausalLM | None = None

    def describe(self, global_rows: int) -> str:
        tokens = sum(e.tokens for e in self.examples)
        once = ", each pair's prompt once (--prompt-pass once)" if self.shares_prompts else ""
        graph = ""
        if self.config.cuda_graph:
            slot = self.graph_example_slot
            slots = f", an example a slot of {slot}" if slot else ""
            if self.shares_prompts:
                room = self.graph_shared_room
                graph = (f", each micro-batch padded to {room.tokens} tokens ({room.attention} in attention, "
                         f"{room.head} head rows{slots}) (--cuda-graph)")
            else:
                graph = (f", each micro-batch padded to {' + '.join(str(n) for n in self.graph_room if n)} "
                         f"tokens{slots} (--cuda-graph)")
        return (f"{self.config.objective}: {len(self.examples)} examples, {tokens} tokens, global batch {global_rows} "
                f"examples (sequences of at most {self.config.seq_len} tokens){once}{graph}")

    # -- data
    def batches(self, consumed: int, rank: int, world: int, device: torch.device) -> tuple[list, dict]:
        c = self.config
        every = self.stream.indices(consumed, c.batch_size * world * c.grad_accum)
        micro = [self.make_batch(every[(m * world + rank) * c.batch_size:][:c.batch_size])
                 for m in range(c.grad_accum)]
        return micro, self.counts(every, world * c.grad_accum, device)

    def make_batch(self, index: list[int]) -> PreferenceBatch:
        """The micro-batch of these examples (:func:`ligermodels.train.preference.make_batch`): with ``--prompt-pass
        once`` each pair's prompt once and only the head rows a loss reads."""
        return make_batch(self.examples, index, share_prefixes=self.prompt_once, head=self.head)

    @property
    def shares_prompts(self) -> bool:
        """Whether each pair's rows store its prompt once (a paired objective under --prompt-pass once); under
        --cuda-graph, padded to :attr:`graph_shared_room`, else to :attr:`graph_room`."""
        return self.prompt_once and self.config.objective != "kto"

    @property
    def head(self) -> str:
        """The positions the log-prob head takes (:data:`ligermodels.train.preference.HEAD_ROWS`)."""
        return "all" if not self.prompt_once else "first" if self.config.objective == "orpo" else "completion"

    def counts(self, index: list[int], micro_batches: int, device: torch.device) -> dict:
        """What a step's sums are divided by, from all of its examples (``index``, over every rank)."""
        step = [self.examples[i] for i in index]
        first = [e.sequences[0] for e in step]
        orpo = self.config.objective == "orpo"  # ORPO's NLL covers the prompt too; SimPO's the completion
        counts = {"pairs": len(step), "examples": len(step), "micro_batches": micro_batches,
                  "desirable": sum(bool(e.label) for e in step), "undesirable": sum(e.label is False for e in step),
                  "tokens": sum(e.tokens for e in step),
                  "nll_tokens": sum((len(s.ids) - 1) if orpo else s.predicted_len for s in first)}
        counts["n_tokens"] = to_device(torch.tensor(float(counts["tokens"])), device)  # metrics.jsonl's "tokens"
        return counts

    # -- log-probs
    def sequence_logps(self, model: CausalLM, rows: PackedSequences) -> tuple[torch.Tensor, torch.Tensor]:
        """(the head rows' log-probs (N,), each sequence's summed completion log-probs (n,)) of one packed row already
        on the model's device."""
        tok = model.token_logprobs(rows.input_ids, rows.targets, rows.position_ids, rows.documents,
                                   strategy=self.strategy, head_rows=rows.head_rows)
        return tok, sequence_sums(tok, rows.segment, rows.count, rows.completion)

    @torch.no_grad()
    def reference_forward(self, model: CausalLM, batch: PreferenceBatch) -> torch.Tensor:
        """(P, 2) reference log-probs of a micro-batch on the device: (chosen, rejected), KTO (completion, KL
        completion)."""
        reference = self.reference_model if self.reference_model is not None else model
        with adapters_disabled(reference):  # LoRA: the base; a plain model has no adapters to disable
            first = self.sequence_logps(reference, batch.rows)[1]
            second = None if batch.kl is None else self.sequence_logps(reference, batch.kl)[1]
        return torch.stack([first[0::2], first[1::2]] if second is None else [first, second], dim=1)

    def compute_reference_logps(self, model: CausalLM, rank: int, world: int, device: torch.device) -> torch.Tensor:
        """Every example's reference log-probs (examples, 2), fp32 on the host: one pass in file order, micro-batches
        of ``--batch-size`` spread over the ranks (each rank runs as many forwards, so FSDP's collectives match)."""
        n, b = len(self.examples), self.config.batch_size
        batches = [list(range(start, min(start + b, n))) for start in range(0, n, b)]
        out = torch.zeros(n, 2, device=device)
        was_training = model.training
        model.eval()
        for j in range(rank, -(-len(batches) // world) * world, world):
            index = batches[min(j, len(batches) - 1)]  # a rank past the end repeats the last batch, keeps nothing
            logps = self.reference_forward(model, self.make_batch(index).to(device))
            if j < len(batches):
                out[index] = logps
        model.train(was_training)
        if world > 1:
            dist.all_reduce(out)
        return out.cpu()

    def router_aux(self, model: CausalLM) -> torch.Tensor | None:
        """A mixture-of-experts policy's load-balancing loss of its last forward, where TRL 1.16 adds it: DPO and KTO
        whenever the model has experts and ``router_aux_loss_coef`` is not 0, ORPO and SimPO (TRL's CPO trainer)
        only when the config also sets ``output_router_logits``; else None."""
        return model.router_aux_loss() if wants_router_aux(self.config, model.config) else None

    # -- the step
    def forward_backward(self, model: CausalLM, batch: PreferenceBatch, norms: dict, world: int,
                         device: torch.device) -> torch.Tensor:
        """[loss, each metric's sum] of one micro-batch (loss already divided by the global counts), after its
        backward."""
        ref = (to_device(self.reference_logps[batch.index], device) if self.reference_logps is not None else None)
        loss, stats = self.loss(model, batch.to(device), ref, norms, world)  # every tensor copied once, no sync
        (loss * world).backward()  # FSDP divides the summed gradients by world: this undoes it
        return stats

    def loss(self, model: CausalLM, batch: PreferenceBatch, ref: torch.Tensor | None, norms: dict, world: int
             ) -> tuple[torch.Tensor, torch.Tensor]:
        """(loss, [loss, each metric's sum]) of one micro-batch on the device, the loss divided by the global counts
        (``norms``); ``ref`` the stored reference log-probs (P, 2), or None to run the reference here. The policy's
        head takes the loss's gradient in its forward, a chunk of whole examples at a time (:meth:`objective` is a
        sum of per-example terms; :meth:`CausalLM.logprob_loss`)."""
        c, rows = self.config, batch.rows
        if ref is None and c.objective in WITH_REFERENCE:  # ORPO and SimPO have no reference
            ref = self.reference_forward(model, batch)
        kl = self.kl_estimate(model, batch, ref, world) if c.objective == "kto" else None
        objective = functools.partial(self.objective, batch=batch, ref=ref, kl=kl, norms=norms)
        ends = rows.group_ends if rows.group_ends is not None else (rows.targets.numel(),)
        loss, tok = model.logprob_loss(rows.input_ids, rows.targets, lambda t: objective(t)[0], ends,
                                       rows.position_ids, rows.documents, strategy=self.strategy,
                                       head_rows=rows.head_rows)
        metrics = objective(tok)[1]
        aux = self.router_aux(model)  # of the policy's forward, the last one
        if aux is not None:  # each micro-batch's counted 1 / (micro-batches x ranks): a step weighs their mean
            loss = loss + model.config.router_aux_loss_coef * aux / (c.grad_accum * world)
        sums = [metrics[name].sum() for name in self.names]
        return loss, torch.stack([loss.detach(), *sums])

    @torch.no_grad()
    def kl_estimate(self, model: CausalLM, batch: PreferenceBatch, ref: torch.Tensor, world: int) -> torch.Tensor:
        """KTO's KL term: the mean over the global micro-batch of the policy's minus the reference's log-probs of the
        KL sequences, clamped at 0, without gradient (TRL's)."""
        kl = (self.sequence_logps(model, batch.kl)[1] - ref[:, 1]).mean()
        if world > 1:
            dist.all_reduce(kl)
            kl = kl / world
        return kl.clamp(min=0)

    def objective(self, tok: torch.Tensor, batch: PreferenceBatch, ref: torch.Tensor | None, kl: torch.Tensor | None,
                  norms: dict) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """(the micro-batch's loss, per-example metrics) from the policy's head-row log-probs ``tok`` (N,): a sum
        of one term per example (pair), each reading that example's tokens only."""
        c, rows = self.config, batch.rows
        logps = sequence_sums(tok, rows.segment, rows.count, rows.completion)
        if c.objective == "kto":
            losses, metrics = kto_terms(c, logps, ref[:, 0], batch.labels, kl)
            return losses.sum() / norms["examples"], {**metrics, "kl": kl}
        if c.objective == "dpo":
            lens = rows.completion_lens
            losses, metrics = dpo_terms(c, logps[0::2], logps[1::2], ref[:, 0], ref[:, 1], lens[0::2], lens[1::2])
            return losses.sum() / norms["pairs"], metrics
        # orpo, simpo: mean token log-probs, and the NLL of the chosen sequences
        avg = logps / rows.predicted_lens.clamp(min=1)
        losses, metrics = (orpo_terms if c.objective == "orpo" else simpo_terms)(c, avg[0::2], avg[1::2])
        chosen = rows.segment % 2 == 0
        if c.objective == "simpo":
            chosen = chosen & rows.completion
        nll = -(tok * chosen).sum() / norms["nll_tokens"]
        if c.objective == "simpo" and not c.cpo_alpha:
            nll = torch.zeros_like(nll)  # as TRL: no NLL term, and nll_loss logged as 0
        metrics["nll_loss"] = nll.detach()
        return losses.sum() / norms["pairs"] + (nll if c.objective == "orpo" else c.cpo_alpha * nll), metrics

    # -- --cuda-graph: every micro-batch padded to the same shapes
    #: why a micro-batch runs eagerly under --cuda-graph (printed once)
    graph_misfit = "an example repeated across an epoch boundary makes a row longer than the captured one"

    @functools.cached_property
    def graph_shared_room(self) -> SharedRoom:
        """The fixed sizes of a captured step's row with each pair's prompt once (:meth:`SharedRoom.of`)."""
        return SharedRoom.of(self.examples, self.config.batch_size, self.head)

    @functools.cached_property
    def graph_slot(self) -> int:
        """Tokens each example takes in a captured step's row when it gets a slot of its own (the longest example,
        rounded up to 16), so that the examples end at fixed offsets and the loss head takes whole examples a chunk;
        0 when slots would make the row more than 1/32 longer than packing the ``--batch-size`` longest examples
        (examples of very different lengths), whose rows then take the per-token head."""
        return example_slot([e.tokens for e in self.examples], self.config.batch_size)

    @property
    def graph_example_slot(self) -> int:
        """What each example's slot holds in a captured step (head rows with each pair's prompt once, else tokens);
        0 when the examples pack."""
        return self.graph_shared_room.head_slot if self.shares_prompts else self.graph_slot

    @functools.cached_property
    def graph_room(self) -> tuple[int, int]:
        """Row lengths that hold a micro-batch (rows, KTO's KL rows; else 0): ``--batch-size`` slots
        (:attr:`graph_slot`), or the ``--batch-size`` longest examples' tokens rounded up to 64. A packed micro-batch
        that straddles an epoch boundary may hold one example twice and need more: it runs eagerly."""
        b = self.config.batch_size
        rows = self.graph_slot * b or packed_room([e.tokens for e in self.examples], b)
        return rows, (packed_room([len(e.kl.ids) for e in self.examples], b) if self.examples[0].kl is not None else 0)

    def graph_inputs(self, batch: PreferenceBatch, counts: dict) -> list[torch.Tensor] | None:
        """A micro-batch as a captured step's host inputs (pinned): its rows padded to :meth:`graph_room` (each example
        to its slot, when :attr:`graph_slot`; and KTO's KL rows and labels), the stored reference log-probs, the
        step's chosen-NLL token count; None when it is longer than that room."""
        seq_len = self.config.seq_len
        if self.shares_prompts:
            padded = batch.rows.padded_shared(self.graph_shared_room, seq_len)
            if padded is None:
                return None
            tensors = padded.flat()
        else:
            (rows, kl), slot = self.graph_room, self.graph_slot or None
            if (not slot and batch.rows.input_ids.shape[1] > rows) or (
                    batch.kl is not None and batch.kl.input_ids.shape[1] > kl):
                return None
            tensors = batch.rows.padded(rows, seq_len, slot).flat()
        if batch.kl is not None:
            tensors += [*batch.kl.padded(self.graph_room[1], seq_len).flat(), batch.labels]
        if self.reference_logps is not None:
            tensors.append(self.reference_logps[batch.index])
        tensors.append(torch.tensor(float(counts["nll_tokens"])))
        return pinned(tensors)

    def graph_loss(self, model: CausalLM, *tensors: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """:meth:`loss` of :meth:`graph_inputs` on the device (one rank, one micro-batch a step)."""
        c, n = self.config, PackedSequences.flat_count(self.shares_prompts)
        rows, rest = PackedSequences.from_flat(list(tensors[:n]), c.seq_len), tensors[n:]
        if self.graph_example_slot:  # the examples' ends, fixed by their slots
            rows = dataclasses.replace(rows, group_ends=slot_ends(self.graph_example_slot, c.batch_size))
        kl = labels = None
        if c.objective == "kto":
            kl, labels, rest = PackedSequences.from_flat(list(rest[:n]), c.seq_len), rest[n], rest[n + 1:]
        ref = rest[0] if self.reference_logps is not None else None
        norms = {"pairs": c.batch_size, "examples": c.batch_size, "nll_tokens": rest[-1]}
        return self.loss(model, PreferenceBatch(rows, None, kl, labels), ref, norms, 1)

    def metrics(self, sums: list[float], norms: dict) -> dict:
        """The step's TRL-named metrics from the summed stats (after the loss)."""
        out = {}
        for (name, key), value in zip(self.names.items(), sums, strict=True):
            count = 1 if key is None else norms[key]
            out[name] = value / count if count else None
        if self.config.objective == "kto" and None not in (out["rewards/chosen"], out["rewards/rejected"]):
            out["rewards/margins"] = out["rewards/chosen"] - out["rewards/rejected"]
        return out
