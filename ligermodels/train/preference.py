"""Preference data: JSON lines -> tokenized sequences as TRL tokenizes them -> packed micro-batches of whole pairs.

Formats, one JSON object per line (TRL's standard preference formats):

* ``dpo``, ``orpo``, ``simpo``: ``{"prompt": ..., "chosen": ..., "rejected": ...}``, each a string, or each a list of
  messages (the prompt's turns; the chosen and rejected assistant turns), rendered with the checkpoint's chat template;
* ``kto``: ``{"prompt": ..., "completion": ..., "label": true|false}`` (``label``: the completion is desirable).

Tokens, as TRL 1.16 makes them, so that the losses and gradients are TRL's on the same data:

* DPO and KTO (``DPOTrainer`` / ``KTOTrainer``): a string prompt is encoded with the tokenizer's special tokens (its
  post-processor's BOS), and so is prompt + completion, the completion ending with the EOS token's text (added when
  absent); a conversation renders the prompt with the generation prompt and prompt + completion without, encoded
  without special tokens. The completion starts where the two encodings first differ (for DPO, the earlier of the
  chosen and the rejected one). A sequence longer than ``--seq-len`` keeps its first ``--seq-len`` tokens (TRL's
  ``keep_start``); a prompt of ``--seq-len`` tokens or more is an error (TRL drops the example).
* ORPO and SimPO (``ORPOTrainer`` / ``CPOTrainer``): conversations are first rendered to strings (the prompt up to
  where the rendered prompt and the rendered conversations stop agreeing). Prompt and prompt + answer are encoded
  without special tokens; the answer starts after the prompt's tokens (one earlier when the last prompt token merged
  with the answer's first); BOS (the tokenizer's ``bos_token``, when it has one) is put in front when the prompt
  does not start with it, EOS appended to an answer not ending with it. A sequence longer than ``--seq-len`` loses the
  end of its answer (TRL truncates the answer to ``max_length`` minus the prompt); a prompt that leaves no answer
  token is an error.

Batches: a step takes ``batch_size * world * grad_accum`` examples of an endless stream (every epoch in an order drawn
from ``seed`` and the epoch number); micro-batch ``m`` of rank ``r`` takes examples ``start + (m * world + r) *
batch_size`` onward. A micro-batch is one packed row without padding: each example's sequences side by side (chosen,
rejected, the next pair's chosen, ...; KTO: its completions, and a second row of the KL sequences), position ids
restarting at each sequence, so attention stays within a sequence as it does for SFT documents. An example's tokens
are contiguous, so the loss head takes whole examples a chunk (:func:`kernels.logprobs.fused_linear_logprob_loss`).
Two savings keep every log-prob as it is (``--prompt-pass once``, the default; under ``--cuda-graph`` padded to fixed
sizes, :meth:`PackedSequences.padded_shared`): a pair's
rejected sequence takes its common prefix with the chosen one (the prompt) from it, so the prompt runs through the
model's per-token work once while attention still sees both sequences whole
(:class:`ligermodels.attention.SharedPrefixes`); and only the positions whose log-prob a loss reads go through the
head (no prompt positions, but ORPO's chosen NLL's).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from ligermodels.attention import Documents, SharedPrefixes, document_ids_from_positions, to_device
from ligermodels.train.chat import ChatTemplate, ChatTemplateError, check_messages
from ligermodels.train.data import IGNORE_INDEX, DataError, chat_template, epoch_order, json_lines

PAIRED = ("dpo", "orpo", "simpo")
OBJECTIVES = ("sft", *PAIRED, "kto")
#: objectives that compare the policy with a reference model
WITH_REFERENCE = ("dpo", "kto")


@dataclass
class Sequence:
    """One tokenized prompt + completion: ``ids[:prompt_len]`` is the prompt."""

    ids: list[int]
    prompt_len: int

    @property
    def completion_len(self) -> int:
        return len(self.ids) - self.prompt_len

    @property
    def predicted_len(self) -> int:
        """Completion tokens with a log-prob: all but a first token of the sequence (nothing predicts it)."""
        return len(self.ids) - max(self.prompt_len, 1)


@dataclass
class PreferenceExample:
    """One line: (chosen, rejected) for the paired objectives; KTO: (completion,), its ``label`` and its ``kl``
    sequence (the prompt with the completion of the example before it in its batch: TRL's KL estimate)."""

    sequences: tuple[Sequence, ...]
    where: str
    label: bool | None = None
    kl: Sequence | None = None

    @property
    def tokens(self) -> int:
        """Its sequences' tokens, each whole (what packing it takes with each prompt twice)."""
        return sum(len(s.ids) for s in self.sequences)


@dataclass
class Record:
    prompt: str | list
    completions: tuple  # (chosen, rejected) or (completion,)
    where: str
    label: bool | None = None


def _is_text_or_messages(value) -> bool:
    return isinstance(value, str) or (isinstance(value, list) and check_messages(value) is None)


def read_preference_jsonl(path: str, objective: str) -> list[Record]:
    """Parse and check a preference file: a :class:`DataError` names the first bad line."""
    keys = ("chosen", "rejected") if objective in PAIRED else ("completion",)
    want = ('{"prompt", "chosen", "rejected"}' if objective in PAIRED else '{"prompt", "completion", "label"}')
    records = []
    for lineno, _, rec in json_lines(path):
        where = f"{path} line {lineno}"
        if not isinstance(rec, dict):
            raise DataError(f"{where}: expected a JSON object {want} for --objective {objective}")
        for key in ("prompt", *keys):
            if key not in rec:
                raise DataError(f"{where}: no \"{key}\" (--objective {objective} reads {want} lines)")
            if not _is_text_or_messages(rec[key]):
                problem = check_messages(rec[key]) if isinstance(rec[key], list) else "not a string"
                raise DataError(f"{where}: \"{key}\" must be a string or a list of messages ({problem})")
        values = [rec[k] for k in ("prompt", *keys)]
        if len({isinstance(v, str) for v in values}) > 1:
            raise DataError(f"{where}: mixes strings and message lists: give every field as text, or every "
                            "field as messages")
        for k in keys:
            if not rec[k] or (isinstance(rec[k], str) and not rec[k].strip()):
                raise DataError(f"{where}: \"{k}\" is empty: a completion needs at least one token")
        label = rec.get("label")
        if objective == "kto" and not isinstance(label, bool):
            raise DataError(f"{where}: \"label\" must be true or false (whether the completion is desirable), "
                            f"got {label!r}")
        records.append(Record(rec["prompt"], tuple(rec[k] for k in keys), where, label))
    if not records:
        raise DataError(f"data file {path!r} holds no examples")
    return records


def _common_prefix(a, b) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


class PreferenceTokenizer:
    """Encodes records as TRL does (module docstring). ``bos``/``eos`` are the tokenizer's BOS and EOS tokens as
    transformers names them (text and id), whether or not its post-processor adds them."""

    def __init__(self, tokenizer, chat: ChatTemplate | None, bos: tuple[str, int] | None,
                 eos: tuple[str, int] | None, seq_len: int):
        self.tokenizer, self.chat, self.bos, self.eos, self.seq_len = tokenizer, chat, bos, eos, seq_len

    def _encode(self, text: str, special: bool) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=special).ids

    def _render(self, record: Record, messages: list, add_generation_prompt: bool = False) -> str:
        if self.chat is None:
            raise DataError(f"{record.where}: messages, but the checkpoint has no chat template (chat_template.jinja, "
                            "or chat_template in tokenizer_config.json)")
        try:
            return self.chat.render(messages, add_generation_prompt=add_generation_prompt)
        except ChatTemplateError as e:
            raise DataError(f"{record.where}: {e}") from None

    def prefix_style(self, record: Record) -> tuple[Sequence, ...]:
        """DPO / KTO: see the module docstring."""
        if isinstance(record.prompt, list):
            prompt_ids = self._encode(self._render(record, record.prompt, add_generation_prompt=True), False)
            fulls = [self._encode(self._render(record, record.prompt + c), False) for c in record.completions]
        else:
            eos = self.eos[0] if self.eos is not None else ""
            prompt_ids = self._encode(record.prompt, True)
            fulls = [self._encode(record.prompt + (c if c.endswith(eos) else c + eos), True)
                     for c in record.completions]
        prompt_len = min(_common_prefix(prompt_ids, f) for f in fulls)
        if prompt_len >= self.seq_len:
            raise DataError(f"{record.where}: the prompt is {prompt_len} tokens, --seq-len is {self.seq_len}: TRL's "
                            "keep_start truncation would leave no completion token (TRL drops such examples); raise "
                            "--seq-len or shorten the prompt")
        for f in fulls:
            if len(f) <= prompt_len:
                raise DataError(f"{record.where}: a completion adds no token after the prompt")
        return tuple(Sequence(f, prompt_len) for f in fulls)  # cut to --seq-len by tokenize_preferences

    def _as_strings(self, record: Record) -> tuple[str, list[str]]:
        """ORPO / SimPO conversations as TRL's ``maybe_apply_chat_template`` renders them."""
        if not isinstance(record.prompt, list):
            return record.prompt, list(record.completions)
        last = record.prompt[-1].get("role") if record.prompt else None
        if last not in ("user", "tool"):
            raise DataError(f"{record.where}: the prompt's last message is {last!r}: a prompt ends with a user (or "
                            "tool) turn here, as TRL renders it with the generation prompt")
        prompt = self._render(record, record.prompt, add_generation_prompt=True)
        fulls = [self._render(record, record.prompt + c) for c in record.completions]
        n = min(_common_prefix(prompt, f) for f in fulls)
        return prompt[:n], [f[n:] for f in fulls]

    def answer_style(self, record: Record) -> tuple[Sequence, ...]:
        """ORPO / SimPO: see the module docstring."""
        prompt, answers = self._as_strings(record)
        prompt_ids = self._encode(prompt, False)
        sequences = []
        for answer in answers:
            full = self._encode(prompt + answer, False)
            start = len(prompt_ids) - (prompt_ids != full[:len(prompt_ids)])
            p, a = full[:start], full[start:]
            if self.bos is not None and (not p or p[0] != self.bos[1]):
                p = [self.bos[1]] + p
            if self.eos is not None and (not a or a[-1] != self.eos[1]):
                a = a + [self.eos[1]]
            sequences.append((p, a))
        (pc, _), (pr, _) = sequences[0], sequences[-1]
        if abs(len(pc) - len(pr)) > 1 or sum(x != y for x, y in zip(pc, pr, strict=False)) > 1:
            raise DataError(f"{record.where}: the prompt's tokens differ between chosen and rejected beyond a merge of "
                            "its last token")
        out = []
        for p, a in sequences:
            if len(p) >= self.seq_len:
                raise DataError(f"{record.where}: the prompt is {len(p)} tokens, --seq-len is {self.seq_len}: TRL "
                                "truncates the answer to --seq-len minus the prompt, which leaves none; raise "
                                "--seq-len or shorten the prompt")
            out.append(Sequence(p + a[:self.seq_len - len(p)], len(p)))
        return tuple(out)


def tokenize_preferences(records: list[Record], objective: str, tok: PreferenceTokenizer,
                         batch_size: int) -> list[PreferenceExample]:
    """The examples of ``records``; KTO's KL sequences pair each prompt with the completion of the example before it
    within consecutive groups of ``batch_size`` lines (TRL rotates completions by one within each batch of its
    dataset, in file order, before shuffling)."""
    style = tok.answer_style if objective in ("orpo", "simpo") else tok.prefix_style
    examples = [PreferenceExample(style(r), r.where, r.label) for r in records]
    if objective == "kto":
        for g in range(0, len(examples), batch_size):
            group = examples[g:g + batch_size]
            for i, e in enumerate(group):
                (own,), (other,) = e.sequences, group[i - 1].sequences
                e.kl = Sequence(own.ids[:own.prompt_len] + other.ids[other.prompt_len:], own.prompt_len)
    if style == tok.prefix_style:  # keep_start, once the KL sequences took the whole completions
        for e in examples:
            e.sequences = tuple(Sequence(s.ids[:tok.seq_len], s.prompt_len) for s in e.sequences)
            if e.kl is not None:
                e.kl = Sequence(e.kl.ids[:tok.seq_len], e.kl.prompt_len)
    return examples


def _shared_prefix_gather(sequences: list[Sequence], group: int, starts: list[int]) -> torch.Tensor | None:
    """(Ta,) int64: for each position of the row of whole sequences, the position of its first occurrence, where
    each example's later sequences take their common prefix with its first sequence from it; None when no prefix
    is shared."""
    gather = torch.arange(sum(len(s.ids) for s in sequences))
    shared = False
    for g in range(0, len(sequences), group):
        head = sequences[g]
        for j in range(g + 1, g + group):
            n = _common_prefix(head.ids, sequences[j].ids)
            gather[starts[j]:starts[j] + n] = gather[starts[g]:starts[g] + n]
            shared |= n > 0
    return gather if shared else None


#: Which positions of a packed row go through the log-prob head (:meth:`PackedSequences.pack`): every one
#: (``--prompt-pass twice``, and KTO under a CUDA graph), those predicting a completion token (DPO, SimPO, KTO read
#: nothing else), or those and every predicting position of each example's first sequence (ORPO: the chosen
#: sequence's NLL, prompt included).
HEAD_ROWS = ("all", "completion", "first")


def head_row_count(example: PreferenceExample, head: str) -> int:
    """How many head rows :meth:`PackedSequences.pack` gives ``example``'s sequences with ``head``."""
    seqs = example.sequences
    if head == "all":
        return example.tokens
    first = len(seqs[0].ids) - 1 - seqs[0].predicted_len if head == "first" else 0  # its prompt's predictions
    return first + sum(s.predicted_len for s in seqs)


def shared_prefix_count(example: PreferenceExample) -> int:
    """How many tokens of ``example``'s later sequences ``pack(..., share_prefixes=True)`` takes from its first."""
    first = example.sequences[0].ids
    return sum(_common_prefix(first, s.ids) for s in example.sequences[1:])


def largest_sum(counts: list[int], batch: int) -> int:
    """The ``batch`` largest ``counts`` together: what any ``batch`` distinct examples need at most."""
    return sum(sorted(counts, reverse=True)[:batch])


def packed_room(counts: list[int], batch: int, extra: int = 0) -> int:
    """Room for any ``batch`` distinct examples packed end to end: :func:`largest_sum` plus ``extra``, rounded up
    to 64."""
    return -(-(largest_sum(counts, batch) + extra) // 64) * 64


def example_slot(counts: list[int], batch: int) -> int:
    """The slot each example gets in a fixed-size row (the largest count, rounded up to 16), so that the examples end
    at the same offsets in every micro-batch; 0 when ``batch`` slots would be more than 1/32 larger than the ``batch``
    largest counts together (examples of very different lengths, which then pack)."""
    slot = -(-max(counts) // 16) * 16
    return slot if slot * batch <= largest_sum(counts, batch) * (1 + 1 / 32) else 0


@dataclass(frozen=True)
class SharedRoom:
    """The fixed sizes of a captured step's row whose pairs share their prompts (:meth:`PackedSequences.padded_shared`):
    ``tokens`` of the model's row, ``attention`` positions of the row of whole sequences, ``repeats`` (positions
    taken from an earlier sequence), and ``head`` rows, ``head_slot`` of them an example when not 0 (then every
    example ends at the same head row in every micro-batch, and the loss head takes whole examples a chunk)."""

    tokens: int
    attention: int
    repeats: int
    head: int
    head_slot: int = 0

    @classmethod
    def of(cls, examples: list[PreferenceExample], batch: int, head: str) -> SharedRoom:
        """Sizes that hold any ``batch`` distinct examples: the attention row the ``batch`` longest examples' tokens
        plus at least one (rounded up to 64), the model's row that less the ``batch`` smallest shared prefixes (so
        that its filler is never shorter than the attention row's: :meth:`PackedSequences.padded_shared`), the
        repeats the ``batch`` largest; head rows in slots of the longest example's (rounded up to 16) when that
        makes them at most 1/32 more than the ``batch`` largest counts, else those counts rounded up to 64."""
        shared = [shared_prefix_count(e) for e in examples]
        rows = [head_row_count(e, head) for e in examples]
        attention = packed_room([e.tokens for e in examples], batch, extra=1)
        slot = example_slot(rows, batch)
        return cls(attention - sum(sorted(shared)[:batch]), attention, largest_sum(shared, batch),
                   slot * batch or packed_room(rows, batch), slot)


@dataclass
class PackedSequences:
    """Sequences packed into one row. The model's tokens (1, T): ``input_ids``, ``position_ids``; ``documents``
    the sequences' bounds (found on the host for the attention kernel), or, when the sequences of an example share
    a prefix stored once (``share_prefixes``), :class:`ligermodels.attention.SharedPrefixes` (attention then sees
    every sequence whole). The head's rows (N,): ``head_rows`` the model's rows whose next token gets a log-prob
    (a row may repeat: a shared prompt's last token predicts both completions' first), ``targets`` that token
    (-100: none), ``segment`` its sequence, ``completion`` whether it is a completion token. ``completion_lens`` and
    ``predicted_lens`` (n,) fp32 (:class:`Sequence`), and ``group_ends``: host offsets among the head's rows where
    each example ends (None in a CUDA graph's replay, whose shapes cannot follow the examples)."""

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    head_rows: torch.Tensor
    targets: torch.Tensor
    segment: torch.Tensor
    completion: torch.Tensor
    completion_lens: torch.Tensor
    predicted_lens: torch.Tensor
    documents: Documents | SharedPrefixes
    group_ends: tuple[int, ...] | None = None

    @classmethod
    def pack(cls, sequences: list[Sequence], group: int = 1, share_prefixes: bool = False,
             head: str = "all") -> PackedSequences:
        """``sequences`` in one row, every ``group`` consecutive ones an example (:attr:`group_ends`). With
        ``share_prefixes``, each later sequence of an example takes its common prefix with the example's first
        (the prompt, and any completion tokens both begin with) from the first instead of repeating it. ``head``
        (:data:`HEAD_ROWS`): which positions go through the log-prob head."""
        if head not in HEAD_ROWS:
            raise ValueError(f"head must be one of {HEAD_ROWS}, got {head!r}")
        # the row with every sequence whole: what attention sees, and what the per-position facts describe
        ids = torch.tensor([t for s in sequences for t in s.ids], dtype=torch.int64)
        lengths = torch.tensor([len(s.ids) for s in sequences])
        cum = torch.cumsum(lengths, 0)
        ends, starts = cum[group - 1::group], cum - lengths
        seg = torch.repeat_interleave(torch.arange(len(sequences)), lengths)
        pos = torch.arange(len(ids)) - torch.repeat_interleave(starts, lengths)
        first = pos == 0
        prompt = torch.repeat_interleave(torch.tensor([s.prompt_len for s in sequences]), lengths)
        # position t predicts t + 1: shift the per-token facts one to the left
        targets = torch.full_like(ids, IGNORE_INDEX)
        targets[:-1] = torch.where(first[1:], IGNORE_INDEX, ids[1:])
        completion = torch.zeros(len(ids), dtype=torch.bool)
        completion[:-1] = (pos >= prompt)[1:] & ~first[1:]
        segment = torch.zeros(len(ids), dtype=torch.int64)
        segment[:-1] = seg[1:]
        if head == "all":
            keep = torch.arange(len(ids))
        else:
            wanted = completion
            if head == "first":
                wanted = wanted | ((targets != IGNORE_INDEX) & (segment % group == 0))
            keep = wanted.nonzero().flatten()
        group_ends = tuple(torch.searchsorted(keep, ends.contiguous()).tolist())  # head rows before each end
        documents = Documents.from_positions(pos[None])
        gather = _shared_prefix_gather(sequences, group, starts.tolist()) if share_prefixes else None
        if gather is None:
            model_ids, model_pos, head_rows = ids, pos, keep
        else:
            own = gather == torch.arange(len(ids))  # a token's first occurrence: a row of the model
            row = torch.cumsum(own, 0) - 1  # the model's row of each first occurrence
            scatter, repeats = own.nonzero().flatten(), (~own).nonzero().flatten()
            gather = row[gather]
            model_ids, model_pos, head_rows = ids[scatter], pos[scatter], gather[keep]
            documents = SharedPrefixes(documents, gather, scatter, repeats, gather[repeats])
        return cls(model_ids[None], model_pos[None], head_rows, targets[keep], segment[keep], completion[keep],
                   torch.tensor([float(s.completion_len) for s in sequences]),
                   torch.tensor([float(s.predicted_len) for s in sequences]), documents, group_ends)

    #: The tensor fields, in the order :meth:`flat` lists them
    TENSORS = ("input_ids", "position_ids", "head_rows", "targets", "segment", "completion", "completion_lens",
               "predicted_lens")

    @property
    def count(self) -> int:
        """n, the number of sequences."""
        return self.completion_lens.numel()

    def to(self, device: torch.device) -> PackedSequences:
        """Every tensor on ``device``, each copied once, without a host sync."""
        moved = {name: to_device(getattr(self, name), device) for name in self.TENSORS}
        return dataclasses.replace(self, **moved, documents=self.documents.to(device))

    # -- the fixed shapes of a CUDA graph (--cuda-graph)
    def padded(self, length: int, seq_len: int, slot: int | None = None) -> PackedSequences:
        """The same sequences in a row of ``length`` tokens: the rest is filled with documents of at most ``seq_len``
        tokens (token 0, no labels, no completion), so attention stays within each and none of their log-probs
        reaches a sum; the bounds have room for ``n + ceil(length / seq_len)`` sequences (the unused ones empty) and
        ``seq_len`` as the longest. So every micro-batch of a run has the same shapes, and the sequences' log-probs
        are those of the unpadded row. With ``slot``, each example is padded to ``slot`` tokens instead (``length``
        must be ``slot`` times the examples): then the examples end at the same offsets in every micro-batch
        (:attr:`group_ends`), so a captured step's loss head can take whole examples a chunk. Only a row packed
        with every position through the head and no shared prefix (``pack(..., head="all")``) pads."""
        t = self.input_ids.shape[1]
        if isinstance(self.documents, SharedPrefixes) or self.targets.numel() != t:
            raise ValueError("only a row packed with head='all' and no shared prefixes pads to fixed shapes")
        if slot is None:
            pieces = [(0, t, length - t)]
            ends = self.group_ends if self.group_ends is None or t == length else (*self.group_ends, length)
        else:
            starts = (0, *self.group_ends[:-1])
            pieces = [(a, b, slot - (b - a)) for a, b in zip(starts, self.group_ends, strict=True)]
            ends = slot_ends(slot, len(pieces))
            if slot * len(pieces) != length:
                raise ValueError(f"{len(pieces)} examples in slots of {slot} tokens do not make a row of {length}")
        if t > length or any(pad < 0 for _, _, pad in pieces):
            raise ValueError(f"a row of {t} tokens does not fit {length}" + (f" (slots of {slot})" if slot else ""))

        def grow(x: torch.Tensor, value) -> torch.Tensor:  # each piece, then its padding
            return torch.cat([part for a, b, pad in pieces
                              for part in (x[..., a:b], x.new_full((*x.shape[:-1], pad), value))], dim=-1)

        positions = torch.cat([part for a, b, pad in pieces
                               for part in (self.position_ids[:, a:b], (torch.arange(pad) % seq_len)[None])], dim=1)
        # room for the padding's documents, the same for every micro-batch: at most ceil(slot / seq_len) a slot
        room = self.count + (len(pieces) * -(-slot // seq_len) if slot else -(-length // seq_len))
        documents = Documents.from_positions(positions).padded(room, seq_len)
        return dataclasses.replace(self, input_ids=grow(self.input_ids, 0), position_ids=positions,
                                   head_rows=torch.arange(length), targets=grow(self.targets, IGNORE_INDEX),
                                   segment=grow(self.segment, 0),
                                   completion=grow(self.completion, False), documents=documents, group_ends=ends)

    def padded_shared(self, room: SharedRoom, seq_len: int) -> PackedSequences | None:
        """The same sequences, their prefixes shared (or none shared: a row packed without), in the fixed sizes of
        ``room``; None when they do not fit it (an example repeated across an epoch boundary).

        The filler, which no sum reads and whose gradients are zero: model tokens (token 0, positions restarting
        every ``seq_len``) after the row's, the first of them one-to-one with the attention row's filler positions
        (documents of their own), the rest taking their outputs from the first filler position; repeats of that
        position into the first filler token (adding its zero gradient); head rows reading the first filler token
        with no target, in each example's slot or at the end. The log-probs, losses and gradients are those of
        the unpadded row."""
        shared, t = self.documents, self.input_ids.shape[1]
        if not isinstance(shared, SharedPrefixes):  # no pair of this micro-batch shares a token
            every = torch.arange(t)
            shared = SharedPrefixes(shared, every, every, every[:0], every[:0])
        ta, r, n = shared.length, shared.repeats.numel(), self.targets.numel()
        fill, fill_attention = room.tokens - t, room.attention - ta
        if room.head_slot:
            starts = (0, *self.group_ends[:-1])
            pieces = [(a, b, room.head_slot - (b - a)) for a, b in zip(starts, self.group_ends, strict=True)]
            ends = slot_ends(room.head_slot, len(pieces))
        else:
            pieces, ends = [(0, n, room.head - n)], None
        if (fill_attention < 1 or fill < fill_attention or r > room.repeats
                or sum(b - a + pad for a, b, pad in pieces) != room.head or min(pad for *_, pad in pieces) < 0):
            return None
        k = torch.arange(fill)
        input_ids = torch.cat([self.input_ids, self.input_ids.new_zeros(1, fill)], dim=1)
        position_ids = torch.cat([self.position_ids, (k % seq_len)[None]], dim=1)
        gather = torch.cat([shared.gather, t + k[:fill_attention]])
        documents = Documents.from_positions(position_ids[:, gather]).padded(
            self.count + -(-room.attention // seq_len), seq_len)
        scatter = torch.cat([shared.scatter, ta + torch.where(k < fill_attention, k, 0)])
        extra = room.repeats - r
        shared = SharedPrefixes(documents, gather, scatter, torch.cat([shared.repeats, torch.full((extra,), ta)]),
                                torch.cat([shared.repeat_rows, torch.full((extra,), t)]))

        def grow(x: torch.Tensor, value) -> torch.Tensor:  # each piece, then its padding
            return torch.cat([part for a, b, pad in pieces for part in (x[a:b], x.new_full((pad,), value))])

        return dataclasses.replace(self, input_ids=input_ids, position_ids=position_ids,
                                   head_rows=grow(self.head_rows, t), targets=grow(self.targets, IGNORE_INDEX),
                                   segment=grow(self.segment, 0), completion=grow(self.completion, False),
                                   documents=shared, group_ends=ends)

    def flat(self) -> list[torch.Tensor]:
        """The tensors a captured step reads (:attr:`TENSORS`, then the bounds, then a shared prefix's moves):
        :meth:`from_flat` rebuilds it."""
        d = self.documents
        moves = [d.documents.cu_seqlens, d.gather, d.scatter, d.repeats, d.repeat_rows] if isinstance(
            d, SharedPrefixes) else [d.cu_seqlens]
        return [getattr(self, name) for name in self.TENSORS] + moves

    @classmethod
    def flat_count(cls, shared: bool) -> int:
        """How many tensors :meth:`flat` lists, for a row with shared prefixes or without."""
        return len(cls.TENSORS) + (5 if shared else 1)

    @classmethod
    def from_flat(cls, tensors: list[torch.Tensor], max_len: int) -> PackedSequences:
        """The row of :meth:`flat`'s tensors (on the device, inside a capture: no host sync), its documents' ids found
        from the positions of the row attention sees."""
        kw = dict(zip(cls.TENSORS, tensors, strict=False))
        cu_seqlens, *moves = tensors[len(cls.TENSORS):]
        pos = kw["position_ids"]
        if not moves:
            return cls(**kw, documents=Documents(document_ids_from_positions(pos), cu_seqlens, max_len))
        attention = Documents(document_ids_from_positions(pos[:, moves[0]]), cu_seqlens, max_len)
        return cls(**kw, documents=SharedPrefixes(attention, *moves))


def slot_ends(slot: int, examples: int) -> tuple[int, ...]:
    """Where the examples of a row padded into slots of ``slot`` tokens end (:meth:`PackedSequences.padded`)."""
    return tuple(slot * (i + 1) for i in range(examples))


@dataclass
class PreferenceBatch:
    """One micro-batch: ``rows`` (paired: each pair's chosen then rejected sequence, segments 2i and 2i + 1; KTO: the
    completions), ``kl`` (KTO),
    ``index`` the examples' indices (for their stored reference log-probs), ``labels`` (KTO, bool (P,))."""

    rows: PackedSequences
    index: torch.Tensor
    kl: PackedSequences | None = None
    labels: torch.Tensor | None = None

    @property
    def size(self) -> int:
        """P, the examples (pairs) of the micro-batch."""
        return self.rows.count if self.kl is not None else self.rows.count // 2

    def to(self, device: torch.device) -> PreferenceBatch:
        """The batch's tensors on ``device`` (``index`` stays on the host: it indexes host tensors)."""
        return dataclasses.replace(self, rows=self.rows.to(device), kl=None if self.kl is None else self.kl.to(device),
                                   labels=None if self.labels is None else to_device(self.labels, device))


def make_batch(examples: list[PreferenceExample], index: list[int], share_prefixes: bool = False,
               head: str = "all") -> PreferenceBatch:
    """The micro-batch of ``examples[i]`` for ``i`` in ``index``, packed (:meth:`PackedSequences.pack`: a pair's
    rejected sequence sharing its prefix with the chosen one when ``share_prefixes``; ``head`` which positions the
    log-prob head takes, KTO's KL row its completions when not "all")."""
    chosen = [examples[i] for i in index]
    n_seq = len(chosen[0].sequences)
    rows = PackedSequences.pack([s for e in chosen for s in e.sequences], n_seq, share_prefixes, head)
    if chosen[0].label is None:
        return PreferenceBatch(rows, torch.tensor(index))
    kl = PackedSequences.pack([e.kl for e in chosen], head="all" if head == "all" else "completion")
    return PreferenceBatch(rows, torch.tensor(index), kl, torch.tensor([e.label for e in chosen]))


class ExampleStream:
    """The endless, seeded order of the examples (module docstring): ``indices(start, count)``."""

    def __init__(self, n: int, seed: int):
        self.n, self.seed = n, seed
        self._orders: dict[int, torch.Tensor] = {}

    def indices(self, start: int, count: int) -> list[int]:
        out = []
        for k in range(start, start + count):
            epoch = k // self.n
            if epoch not in self._orders:
                self._orders = {e: o for e, o in self._orders.items() if e >= epoch - 1}  # keep a small window
                self._orders[epoch] = epoch_order(self.n, self.seed, epoch)
            out.append(int(self._orders[epoch][k % self.n]))
        return out


def load_examples(config, seq_len: int, tokenizer, special: dict, model_dir: str) -> list[PreferenceExample]:
    """``config.data_file``'s examples for ``config.objective``, tokenized with the checkpoint's tokenizer, its
    ``special`` tokens (``ligermodels.train.data.special_tokens``) and its chat template (for conversations), each
    sequence at most ``seq_len`` tokens."""
    records = read_preference_jsonl(config.data_file, config.objective)
    chat = chat_template(model_dir) if any(isinstance(r.prompt, list) for r in records) else None
    tok = PreferenceTokenizer(tokenizer, chat, special["bos"], special["eos"], seq_len)
    return tokenize_preferences(records, config.objective, tok, config.batch_size)
