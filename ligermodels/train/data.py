"""Training data: JSON lines -> tokenized documents -> packed rows of a fixed length.

Input format, one JSON object per line (blank lines are skipped, other keys are ignored):

* ``{"text": "..."}``: a document with a loss on every token;
* ``{"prompt": "...", "completion": "..."}``: a loss on the completion only;
* ``{"messages": [{"role": "...", "content": "..."}, ...]}``: a conversation, rendered with the checkpoint's chat
  template as transformers renders it (:mod:`ligermodels.train.chat`), its tokens exactly those of
  ``apply_chat_template``; the loss on the assistant turns (``--chat-loss assistant``) or on every token
  (``--chat-loss all``). The template adds whatever BOS or end-of-turn tokens it adds; nothing else is added.

Tokens: each document is ``[BOS] + encode(text) + [EOS]``, or ``[BOS] + encode(prompt) +
encode(completion) + [EOS]`` (prompt and completion are encoded separately, so no token straddles
the boundary). BOS and EOS are the tokens transformers' ``AutoTokenizer`` reports for the
checkpoint: ``tokenizer_config.json``'s ``bos_token`` / ``eos_token`` when that file is a current
one (it has ``added_tokens_decoder``), else ``special_tokens_map.json``'s, else
``tokenizer_config.json``'s (an entry that is null means none: Qwen2 has no BOS); only without
either file, ``config.json``'s ``bos_token_id`` / ``eos_token_id``. BOS is added only where the
tokenizer's own post-processor starts a text with it (``tokenizer.json`` decides, as in
transformers 5, which ignores ``add_bos_token`` when ``tokenizer.json`` exists; tokenizer classes
that rebuild their post-processor from their own settings, such as GPTNeoX's, are not followed);
EOS is appended
whenever there is one. A token named in a tokenizer file that the tokenizer does not know is an
error naming it and the file. Apart from that BOS check the tokenizer's post-processor is not used
(``add_special_tokens=False``), so the rule above is the whole story.

Packing: every epoch visits the documents in an order drawn from ``seed`` and the epoch number,
and concatenates them into one stream; the stream of epoch 0, then epoch 1, ... is cut into rows
of ``seq_len`` tokens, so no token is padding. A document cut by a row boundary continues at the
start of the next row as a new document. In each row:

* ``position_ids`` restart at 0 at every document start (and at the row start), so that the model's
  ``document_ids_from_positions`` recovers the documents and attention never crosses one;
* ``labels`` are the tokens, except -100 on each document's first token (the model predicts
  ``labels[t + 1]`` at ``t``: a document's first token must not be predicted from the previous
  document) and on BOS and prompt tokens.

Row ``k`` of the stream depends only on the documents, ``seq_len``, ``seed`` and ``k``: the data
position of a run is one integer (rows consumed), and a resumed run reads the same rows.
The tokenized documents live in host memory (sized for fine-tuning sets, not pre-training corpora).

:func:`load_inputs` reads what a run trains on (the model's config, its tokenizer, the data) and checks them
against each other before any weight is read.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from tokenizers import Tokenizer

from checkpoints_tools import read_config, read_json_object, resolve, safetensors_files
from ligermodels.config import DecoderConfig
from ligermodels.families import config_from_hf, family_of
from ligermodels.model import CausalLM
from ligermodels.tokenizer import load_tokenizer
from ligermodels.train.chat import SPECIAL_TOKEN_NAMES, ChatTemplate, ChatTemplateError, check_messages
from ligermodels.train.config import TrainConfig, TrainError

IGNORE_INDEX = -100


class DataError(ValueError):
    """The data file is missing or malformed; the message names the file and line."""


@dataclass
class Example:
    """One line of the data file: ``prompt`` is "" for plain text (loss on all of ``text``); a conversation has
    ``messages`` (and empty ``prompt`` and ``text``). ``where`` names the file and line, for errors found later."""

    prompt: str
    text: str
    messages: list[dict] | None = None
    where: str = ""


def json_lines(path: str) -> Iterator[tuple[int, str, object]]:
    """(line number, line, parsed value) of each non-blank line of a JSON-lines file; a :class:`DataError` names
    a missing file, and a line that is not UTF-8 or not JSON."""
    if not os.path.isfile(path):
        raise DataError(f"data file {path!r} does not exist")
    with open(path, "rb") as f:  # bytes: a decoding error can then name its line
        for lineno, raw in enumerate(f, start=1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise DataError(f"{path} line {lineno}: not valid UTF-8 (byte {e.start}: {e.reason})") from None
            if not line.strip():
                continue
            try:
                value = json.loads(line)
            except json.JSONDecodeError as e:
                raise DataError(f"{path} line {lineno}: not valid JSON ({e.msg})") from None
            try:  # a JSON escape such as "\ud800" makes a lone surrogate, which no tokenizer takes
                json.dumps(value, ensure_ascii=False).encode("utf-8")
            except UnicodeEncodeError as e:
                surrogate = e.object[e.start]
                raise DataError(f"{path} line {lineno}: not valid Unicode (lone surrogate {surrogate!r})") from None
            yield lineno, line, value


def read_jsonl(path: str) -> list[Example]:
    """Parse and validate a JSON-lines file; a :class:`DataError` names the first bad line."""
    examples = []
    for lineno, line, rec in json_lines(path):
        rec = rec if isinstance(rec, dict) else {}
        where = f"{path} line {lineno}"
        if isinstance(rec.get("text"), str):
            example = Example("", rec["text"], where=where)
        elif isinstance(rec.get("prompt"), str) and isinstance(rec.get("completion"), str):
            example = Example(rec["prompt"], rec["completion"], where=where)
        elif "messages" in rec:
            problem = check_messages(rec["messages"])
            if problem:
                raise DataError(f"{where}: {problem}")
            example = Example("", "", rec["messages"], where)
        else:
            raise DataError(f'{where}: expected {{"text": str}}, {{"prompt": str, "completion": str}} or '
                            f'{{"messages": [...]}}, got {line.strip()[:80]!r}')
        examples.append(example)
    if not examples:
        raise DataError(f"data file {path!r} holds no examples")
    return examples


def _json_file(directory: str | None, name: str) -> dict:
    """``directory/name`` as a dict; {} when absent; unreadable JSON is a DataError naming the file."""
    path = os.path.join(directory or "", name)
    if not directory or not os.path.isfile(path):
        return {}
    return read_json_object(path, DataError, name)


def _token_files(directory: str | None) -> list[tuple[str, dict]]:
    """(path, contents) of the tokenizer files that name special tokens, in the order that decides (as in
    transformers): special_tokens_map.json, then tokenizer_config.json; a current tokenizer_config.json (it has
    ``added_tokens_decoder``) alone."""
    tok_cfg = _json_file(directory, "tokenizer_config.json")
    files = [(os.path.join(directory, n), cfg) for n, cfg in (
        ("special_tokens_map.json", _json_file(directory, "special_tokens_map.json")),
        ("tokenizer_config.json", tok_cfg)) if directory and os.path.isfile(os.path.join(directory, n))]
    if "added_tokens_decoder" in tok_cfg:
        files = [(os.path.join(directory, "tokenizer_config.json"), tok_cfg)]
    return files


def _named_token(files: list[tuple[str, dict]], key: str) -> tuple[str | None, str] | None:
    """(the token named ``key``, the file naming it) from the first of ``files`` with the key (a string, or
    transformers' {"content": ...}; null: none), or None when no file names it."""
    for path, cfg in files:
        if key in cfg:
            token = cfg[key]
            token = token.get("content") if isinstance(token, dict) else token
            return (token if isinstance(token, str) else None), path
    return None


def special_token_names(directory: str | None) -> dict[str, str]:
    """The special tokens by name (``bos_token``, ``eos_token``, ...: :data:`SPECIAL_TOKEN_NAMES`) as the
    tokenizer files name them, for a chat template (transformers passes its ``special_tokens_map``)."""
    files = _token_files(directory)
    named = {key: _named_token(files, key) for key in SPECIAL_TOKEN_NAMES}
    return {key: found[0] for key, found in named.items() if found is not None and found[0] is not None}


def special_tokens(tokenizer, directory: str | None) -> dict[str, tuple[str, int] | None]:
    """{"bos": (text, id), "eos": (text, id)} as transformers' ``bos_token`` / ``eos_token`` name them in the tokenizer
    files (None where they name none, a null entry included: Qwen2 has no BOS), whether or not the tokenizer's
    post-processor adds them; a named token the tokenizer lacks is a DataError naming it and the file."""
    files, out = _token_files(directory), {}
    for kind in ("bos", "eos"):
        key = f"{kind}_token"
        named = _named_token(files, key)
        token_id = None if named is None or named[0] is None else tokenizer.token_to_id(named[0])
        if named is not None and named[0] is not None and token_id is None:
            raise DataError(f"{named[1]}: {key} {named[0]!r} is not a token of the tokenizer (tokenizer.json)")
        out[kind] = None if token_id is None else (named[0], token_id)
    return out


def special_token_ids(tokenizer, directory: str | None) -> tuple[int | None, int | None]:
    """(BOS id, EOS id) to add to every document, by the rule in the module docstring."""
    if _token_files(directory):  # the tokenizer files decide
        found = [None if t is None else t[1] for t in special_tokens(tokenizer, directory).values()]
    else:  # read only without tokenizer files
        model_cfg, found = _json_file(directory, "config.json"), []
        for kind in ("bos", "eos"):
            value = model_cfg.get(f"{kind}_token_id")
            value = value[0] if isinstance(value, list) and value else value
            found.append(value if isinstance(value, int) and not isinstance(value, bool) else None)
    bos, eos = found
    if bos is not None and tokenizer.encode("", add_special_tokens=True).ids[:1] != [bos]:
        bos = None  # the tokenizer's post-processor does not start a text with BOS: neither does training
    return bos, eos


@dataclass
class Document:
    """Token ids of one example and which carry a loss: all but the first ``no_loss`` (BOS + prompt), or where
    ``mask`` is true (a conversation's assistant turns)."""

    ids: list[int]
    no_loss: int
    mask: list[bool] | None = None

    def trains(self) -> bool:
        """Whether a token after the first carries a loss (the first has no label: it starts the document)."""
        return any(self.mask[1:]) if self.mask is not None else len(self.ids) > max(self.no_loss, 1)


def tokenize(examples: list[Example], tokenizer, bos: int | None, eos: int | None,
             chat: ChatTemplate | None = None, chat_loss: str = "assistant") -> list[Document]:
    """Tokenize examples into documents (batched: the Rust tokenizer works in parallel). Conversations need the
    checkpoint's ``chat`` template; ``chat_loss`` "assistant" or "all" (see the module docstring)."""
    plain = [e for e in examples if e.messages is None]
    prompts = tokenizer.encode_batch([e.prompt for e in plain], add_special_tokens=False)
    texts = tokenizer.encode_batch([e.text for e in plain], add_special_tokens=False)
    head, tail = ([bos] if bos is not None else []), ([eos] if eos is not None else [])
    documents = iter([Document(head + p.ids + t.ids + tail, len(head) + len(p.ids))
                      for p, t in zip(prompts, texts, strict=True)])
    chats = iter(_chat_documents([e for e in examples if e.messages is not None], tokenizer, chat, chat_loss))
    return [next(chats) if e.messages is not None else next(documents) for e in examples]


def _chat_documents(examples: list[Example], tokenizer, chat: ChatTemplate | None, chat_loss: str) -> list[Document]:
    """The conversations' documents: the rendered text's tokens, a loss on those that overlap an assistant span."""
    if examples and chat is None:
        raise DataError(f"{examples[0].where}: a conversation (\"messages\"), but the checkpoint has no chat template "
                        "(chat_template.jinja, or chat_template in tokenizer_config.json)")
    texts, all_spans = [], []
    for e in examples:
        try:
            text, spans = chat.loss_spans(e.messages) if chat_loss == "assistant" else (chat.render(e.messages), None)
        except ChatTemplateError as err:
            raise DataError(f"{e.where}: {err}") from None
        texts.append(text)
        all_spans.append(spans)
    out = []
    for spans, enc in zip(all_spans, tokenizer.encode_batch(texts, add_special_tokens=False), strict=True):
        if spans is None:
            out.append(Document(enc.ids, 0, [True] * len(enc.ids)))
            continue
        mask, k = [], 0  # spans and token offsets are both in order: one pass
        for start, end in enc.offsets:
            while k < len(spans) and start >= spans[k][1]:
                k += 1
            mask.append(k < len(spans) and end > spans[k][0])
        out.append(Document(enc.ids, 0, mask))
    return out


def chat_template(model_dir: str) -> ChatTemplate:
    """The checkpoint's chat template (for data given as messages); a DataError says what is wrong with it."""
    try:
        return ChatTemplate.from_checkpoint(model_dir, special_token_names(model_dir))
    except ChatTemplateError as e:
        raise DataError(str(e)) from None


def epoch_order(n: int, seed: int, epoch: int) -> torch.Tensor:
    """The order (a permutation of ``n``) in which epoch ``epoch`` visits the documents (or preference examples)."""
    return torch.randperm(n, generator=torch.Generator().manual_seed(seed * 1_000_003 + epoch))


class PackedRows:
    """The endless, deterministic sequence of packed rows over ``documents`` (see the module docstring).

    ``rows(start, count)`` -> ``(input_ids, labels, position_ids)``, each (count, seq_len) int64 on
    the host, for rows ``start .. start + count - 1``.
    """

    def __init__(self, documents: list[Document], seq_len: int, seed: int):
        if not documents:
            raise DataError("no documents to pack")
        self.seq_len, self.seed = seq_len, seed
        lengths = torch.tensor([len(d.ids) for d in documents])
        self.tokens = torch.tensor([t for d in documents for t in d.ids], dtype=torch.int64)
        has_loss = torch.ones(len(self.tokens), dtype=torch.bool)
        starts = torch.zeros(len(self.tokens), dtype=torch.bool)
        self.offsets = torch.cumsum(lengths, 0) - lengths  # start of each document in self.tokens
        for off, d in zip(self.offsets.tolist(), documents, strict=True):
            if d.mask is None:
                has_loss[off:off + d.no_loss] = False
            else:
                has_loss[off:off + len(d.ids)] = torch.tensor(d.mask, dtype=torch.bool)
            if d.ids:
                starts[off] = True
        self.has_loss, self.starts, self.lengths = has_loss, starts, lengths
        self.epoch_len = len(self.tokens)
        if self.epoch_len == 0:
            raise DataError("the documents hold no tokens")
        self._cache: dict[int, torch.Tensor] = {}

    def _epoch_index(self, epoch: int) -> torch.Tensor:
        """Indices into self.tokens giving epoch ``epoch``'s stream (documents in a seeded order)."""
        if epoch not in self._cache:
            order = epoch_order(len(self.lengths), self.seed, epoch)
            lengths = self.lengths[order]
            # position j of the stream = offsets[doc] + (j - start of doc in the stream)
            stream_start = torch.cumsum(lengths, 0) - lengths
            shift = torch.repeat_interleave(self.offsets[order] - stream_start, lengths)
            self._cache = {e: v for e, v in self._cache.items() if e >= epoch - 1}  # keep a small window
            self._cache[epoch] = torch.arange(self.epoch_len) + shift
        return self._cache[epoch]

    def rows(self, start: int, count: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        s = self.seq_len
        pos = torch.arange(start * s, (start + count) * s)  # positions in the endless stream
        epoch, within = pos // self.epoch_len, pos % self.epoch_len
        index = torch.empty_like(pos)
        for e in torch.unique(epoch).tolist():
            sel = epoch == e
            index[sel] = self._epoch_index(e)[within[sel]]
        tokens = self.tokens[index].view(count, s)
        starts = self.starts[index].view(count, s).clone()
        starts[:, 0] = True  # every row starts a (possibly continued) document
        labels = torch.where(self.has_loss[index].view(count, s) & ~starts, tokens, IGNORE_INDEX)
        col = torch.arange(s).expand(count, s)
        last_start = torch.cummax(torch.where(starts, col, 0), dim=1).values
        return tokens, labels, col - last_start


def count_loss_tokens(labels: torch.Tensor) -> int:
    """Tokens that carry a loss in a (B, S) label batch (the model predicts labels[:, 1:])."""
    return int((labels[:, 1:] != IGNORE_INDEX).sum())


@dataclass
class Inputs:
    """What a run trains on: the model's config and class, where its weights and tokenizer are, the data."""

    config: DecoderConfig
    cls: type[CausalLM]
    weights_dir: str | None  # HF checkpoint to load; None: random init
    tokenizer_dir: str
    tokenizer: Tokenizer
    bos: int | None
    eos: int | None
    documents: list[Document]
    #: preference objectives: the examples (:mod:`ligermodels.train.preference`); ``documents`` is then empty
    examples: list | None = None


def _check_vocab(ids: list[int], model_config: DecoderConfig) -> None:
    top = max(ids, default=-1)
    if top >= model_config.vocab_size:
        raise TrainError(f"the tokenizer produced id {top}, outside the model's vocab_size {model_config.vocab_size}")


def load_inputs(config: TrainConfig) -> Inputs:
    """Read the model's config, its tokenizer and the data, and check them against each other; no weights are
    read (a hub repo's config is checked before anything else downloads)."""
    model_dir = resolve(config.model_source, check=lambda d: config_from_hf(read_config(d)))
    model_config = config_from_hf(read_config(model_dir))
    if not config.random_init:
        safetensors_files(model_dir)  # fail here, on every rank, rather than on rank 0 alone later
    tokenizer = load_tokenizer(model_dir)
    bos, eos = special_token_ids(tokenizer, model_dir)
    cls = family_of(model_config.model_type).cls
    if config.objective != "sft":
        from ligermodels.train.preference import load_examples

        seq_len = config.seq_len_for(model_config.max_position_embeddings)  # the longest sequence
        examples = load_examples(config, seq_len, tokenizer, special_tokens(tokenizer, model_dir), model_dir)
        _check_vocab([i for e in examples for s in e.sequences for i in s.ids], model_config)
        return Inputs(model_config, cls, None if config.random_init else model_dir, model_dir, tokenizer, bos, eos,
                      [], examples)
    examples = read_jsonl(config.data_file)
    chat = chat_template(model_dir) if any(e.messages is not None for e in examples) else None
    documents = tokenize(examples, tokenizer, bos, eos, chat, config.chat_loss)
    if not any(d.trains() for d in documents):
        raise DataError(f"{config.data_file}: no token carries a loss (every completion is empty and no EOS is added)")
    _check_vocab([i for d in documents for i in d.ids], model_config)
    return Inputs(model_config, cls, None if config.random_init else model_dir, model_dir, tokenizer, bos, eos,
                  documents)
