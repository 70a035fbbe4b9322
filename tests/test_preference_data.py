"""Preference data (``--objective dpo|kto|orpo|simpo``): the sequences ``load_inputs`` makes are TRL 1.16's, token
for token, with the same prompt/completion boundary and the same truncation; bad lines are refused by file and
line before training; packed rows describe each position's next token.

TRL's tokens come from its own trainers (``DPOTrainer``, ``KTOTrainer``, ``ORPOTrainer``, ``CPOTrainer`` with
``loss_type="simpo"``), built on a tiny Llama saved beside the tokenizer, read from their ``train_dataset`` and, for
DPO and KTO (which truncate in the collator), passed through their ``data_collator``.

Tokenizers: the character-level ones of ``tests/test_chat.py`` in three template styles (Llama 3: BOS by the
template; Qwen2: no BOS; Gemma: BOS by the template, no system role), and a BPE one whose post-processor adds BOS
and whose merges join the last prompt character with the first completion character ("=" + "5"), the case where
the tokenized prompt is not a prefix of the tokenized prompt + completion.
"""

from __future__ import annotations

import json
import os
import re
import shutil

import pytest
import torch
from tokenizers import Tokenizer, decoders, models, processors

from ligermodels.train.config import TrainConfig
from ligermodels.train.data import DataError, load_inputs
from ligermodels.train.demo import ALPHABET
from ligermodels.train.preference import (
    PackedSequences,
    PreferenceExample,
    Sequence,
    SharedRoom,
    head_row_count,
    make_batch,
    shared_prefix_count,
)
from tests.test_chat import _checkpoint_dir

transformers = pytest.importorskip("transformers")
trl = pytest.importorskip("trl")
datasets = pytest.importorskip("datasets")
#: TRL 1.16's configs pass transformers 5 a deprecated argument name
pytestmark = pytest.mark.filterwarnings("ignore:`gradient_checkpointing` is deprecated:FutureWarning")

OBJECTIVES = ("dpo", "kto", "orpo", "simpo")
STYLES = ("llama3", "qwen2", "gemma", "bpe_bos")
EOS = {"llama3": "<|eot_id|>", "qwen2": "<|im_end|>", "gemma": "<eos>", "bpe_bos": "</s>"}
#: --seq-len per kind of data: each record's prompt fits, the long completion does not
SEQ_LEN = {"text": 40, "messages": 160}
KTO_BATCH = 3  # 8 KTO lines (Gemma's conversations: 6): groups of 3, 3 and 2 for the KL completions
LONG = "abcdefghij " * 30  # 330 characters: longer than either --seq-len

#: BPE style: BOS from the post-processor, a template in the style of Zephyr's, merges across the boundary
BPE_TEMPLATE = ("{{ bos_token }}{% for m in messages %}"
                "{{ '<|' + m['role'] + '|>\\n' + m['content'] + eos_token + '\\n' }}{% endfor %}"
                "{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% endif %}")
BPE_MERGES = [("=", "5"), ("i", "s"), ("\n", "1")]


def _user(text):
    return {"role": "user", "content": text}


def _assistant(text):
    return {"role": "assistant", "content": text}


def _text_pairs(eos: str) -> list[dict]:
    return [
        {"prompt": "what is 2+3?", "chosen": " it is 5.", "rejected": " six"},
        {"prompt": "2+3=", "chosen": "5", "rejected": "6"},  # BPE: "=5" is one token, "=" "6" two
        {"prompt": "Q: name a fruit\nA:", "chosen": " a plum." + eos, "rejected": " a rock"},  # EOS already there
        {"prompt": "say a lot", "chosen": LONG, "rejected": "no"},  # truncated to --seq-len
    ]


def _message_pairs(style: str) -> list[dict]:
    pairs = [
        {"prompt": [_user("what is 2+3?")], "chosen": [_assistant("it is 5.")], "rejected": [_assistant("six")]},
        {"prompt": [_user("hi"), _assistant("hello!"), _user("count to 3")], "chosen": [_assistant("1, 2, 3")],
         "rejected": [_assistant("3, 2, 1")]},
        {"prompt": [{"role": "system", "content": "You answer briefly."}, _user("name a fruit")],
         "chosen": [_assistant("a plum.")], "rejected": [_assistant("a rock")]},
        {"prompt": [_user("say a lot")], "chosen": [_assistant(LONG)], "rejected": [_assistant("no")]},
    ]
    return [p for p in pairs if not (style == "gemma" and p["prompt"][0]["role"] == "system")]


def _records(objective: str, style: str, kind: str) -> list[dict]:
    pairs = _text_pairs(EOS[style]) if kind == "text" else _message_pairs(style)
    if objective != "kto":
        return pairs
    return [{"prompt": p["prompt"], "completion": p[key], "label": key == "chosen"}
            for p in pairs for key in ("chosen", "rejected")]


def _bpe_checkpoint(directory) -> str:
    """A BPE tokenizer over single characters plus :data:`BPE_MERGES` (no pre-tokenizer: merges cross any
    boundary), its post-processor starting every text with ``<s>``."""
    chars = ALPHABET + "ABCDEFGHIJKLMNOPQRSTUVWXYZ\n:<|>"
    specials = ["<pad>", "<unk>", "<s>", "</s>"]
    vocab = {t: i for i, t in enumerate([*specials, *chars, *("".join(m) for m in BPE_MERGES)])}
    tok = Tokenizer(models.BPE(vocab, BPE_MERGES, unk_token="<unk>"))
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens(specials)
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", pair="<s> $A <s> $B",
                                                       special_tokens=[("<s>", vocab["<s>"])])
    directory.mkdir(parents=True, exist_ok=True)
    tok.save(str(directory / "tokenizer.json"))
    cfg = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "</s>",
           "pad_token": "<pad>", "unk_token": "<unk>", "chat_template": BPE_TEMPLATE}
    (directory / "tokenizer_config.json").write_text(json.dumps(cfg))
    return str(directory)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """``checkpoint(style)``: a directory with the style's tokenizer and a tiny Llama (weights in safetensors)."""
    root, made = tmp_path_factory.mktemp("preference_checkpoints"), {}
    environ = dict(os.environ)

    def get(style: str) -> str:
        if style not in made:
            d = _bpe_checkpoint(root / style) if style == "bpe_bos" else _checkpoint_dir(root, style)
            cfg = transformers.LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                           num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
            torch.manual_seed(0)
            transformers.AutoModelForCausalLM.from_config(cfg).save_pretrained(d)
            made[style] = d
        return made[style]

    yield get
    os.environ.clear()  # TRL's and transformers' imports set variables (TORCHINDUCTOR_CACHE_DIR) for the process
    os.environ.update(environ)


def _ours(directory: str, records: list, objective: str, seq_len: int, batch_size: int,
          tmp_path) -> list[PreferenceExample]:
    data = tmp_path / f"{objective}.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in records))
    config = TrainConfig(model=directory, data=str(data), out=str(tmp_path / "out"), objective=objective,
                         seq_len=seq_len, batch_size=batch_size, device="cpu")
    return load_inputs(config).examples


def _trl_trainer(directory: str, records: list, objective: str, seq_len: int, batch_size: int, tmp_path):
    tok = transformers.AutoTokenizer.from_pretrained(directory)
    common = dict(output_dir=str(tmp_path / "trl"), report_to=[], use_cpu=True, max_length=seq_len,
                  per_device_train_batch_size=batch_size)
    if objective == "dpo":
        trainer_cls, args = trl.DPOTrainer, trl.DPOConfig(**common)
    elif objective == "kto":
        trainer_cls, args = trl.KTOTrainer, trl.KTOConfig(**common)
    elif objective == "orpo":
        from trl.experimental.orpo import ORPOConfig, ORPOTrainer

        trainer_cls, args = ORPOTrainer, ORPOConfig(**common)
    else:
        from trl.experimental.cpo import CPOConfig, CPOTrainer

        trainer_cls, args = CPOTrainer, CPOConfig(loss_type="simpo", cpo_alpha=0.0, **common)
    return trainer_cls(model=directory, args=args, train_dataset=datasets.Dataset.from_list(records),
                       processing_class=tok)


def _rows(batch: dict, prefix: str = "") -> list[tuple[list[int], int]]:
    """(ids, prompt length) of each row of a TRL DPO/KTO collator batch, without its padding."""
    out = []
    for ids, attention, completion in zip(batch[f"{prefix}input_ids"], batch[f"{prefix}attention_mask"],
                                          batch[f"{prefix}completion_mask"], strict=True):
        n = int(attention.sum())
        out.append((ids[:n].tolist(), n - int(completion[:n].sum())))
    return out


def _trl_sequences(trainer, objective: str) -> list[list[tuple[list[int], int]]]:
    """Per example, TRL's (ids, prompt length) of each sequence: chosen, rejected (paired); the completion, then
    the KL sequence (KTO). DPO and KTO truncate in the collator: its rows, unpadded."""
    rows = [dict(r) for r in trainer.train_dataset]
    if objective in ("dpo", "kto"):
        batch = trainer.data_collator(rows)
        main = _rows(batch)
        if objective == "kto":
            return [[s, kl] for s, kl in zip(main, _rows(batch, "KL_"), strict=True)]
        return [[main[i], main[len(rows) + i]] for i in range(len(rows))]

    def sequence(row, side):
        labels = row[f"{side}_labels"]
        return row[f"{side}_input_ids"], next(i for i, t in enumerate(labels) if t != -100)

    return [[sequence(r, "chosen"), sequence(r, "rejected")] for r in rows]


def _our_sequences(examples: list[PreferenceExample]) -> list[list[tuple[list[int], int]]]:
    return [[(s.ids, s.prompt_len) for s in (*e.sequences, *([e.kl] if e.kl is not None else []))]
            for e in examples]


@pytest.mark.parametrize("objective", OBJECTIVES)
@pytest.mark.parametrize("kind", ["text", "messages"])
@pytest.mark.parametrize("style", STYLES)
def test_sequences_are_trls(checkpoint, tmp_path, style, kind, objective):
    """load_inputs' sequences (ids and prompt length; KTO's KL sequences too) are those TRL's trainer makes of the
    same lines with max_length = --seq-len, the long completion cut the same way."""
    directory, records, seq_len = checkpoint(style), _records(objective, style, kind), SEQ_LEN[kind]
    batch_size = KTO_BATCH if objective == "kto" else 2
    ours = _ours(directory, records, objective, seq_len, batch_size, tmp_path)
    trainer = _trl_trainer(directory, records, objective, seq_len, batch_size, tmp_path)
    theirs = _trl_sequences(trainer, objective)
    assert len(ours) == len(theirs) == len(records)  # TRL dropped no example, nor did we
    for k, (a, b) in enumerate(zip(_our_sequences(ours), theirs, strict=True)):
        assert a == b, f"example {k} ({records[k]}): ours {a}, TRL {b}"
    if objective == "kto":
        assert [e.label for e in ours] == [r["label"] for r in records]
    # the long completion is cut at --seq-len, on both sides
    long = [k for k, r in enumerate(records) if LONG in json.dumps(r)]
    assert long and all(len(_our_sequences(ours)[k][0][0]) == seq_len for k in long)
    assert all(len(s.ids) <= seq_len and 0 < s.prompt_len < len(s.ids) for e in ours for s in e.sequences)


def test_the_bpe_tokenizer_exercises_merges_and_the_post_processors_bos(checkpoint):
    """What makes the BPE style worth comparing: "=5" merges across the prompt's end, and the tokenizer (as
    transformers loads it) starts a text with BOS."""
    tok = transformers.AutoTokenizer.from_pretrained(checkpoint("bpe_bos"))
    prompt, full = tok("2+3=")["input_ids"], tok("2+3=5</s>")["input_ids"]
    assert prompt[0] == full[0] == tok.bos_token_id
    assert full[:len(prompt)] != prompt and full[:len(prompt) - 1] == prompt[:-1]


def test_the_merged_prompt_token_starts_the_completion(checkpoint, tmp_path):
    """DPO: the completion starts where prompt and prompt + completion diverge (for both, the earlier: the
    rejected side keeps "=" in neither prompt); ORPO: each side's prompt is its own, one token shorter where the
    last prompt token merged."""
    directory, record = checkpoint("bpe_bos"), [{"prompt": "2+3=", "chosen": "5", "rejected": "6"}]
    tok = transformers.AutoTokenizer.from_pretrained(directory)
    bos, eos = tok.bos_token_id, tok.eos_token_id
    ids = tok.convert_tokens_to_ids
    (chosen, rejected), = _our_sequences(_ours(directory, record, "dpo", 16, 1, tmp_path))
    assert chosen == ([bos, *ids(["2", "+", "3", "=5"]), eos], 4)
    assert rejected == ([bos, *ids(["2", "+", "3", "=", "6"]), eos], 4)
    (chosen, rejected), = _our_sequences(_ours(directory, record, "orpo", 16, 1, tmp_path))
    assert chosen == ([bos, *ids(["2", "+", "3", "=5"]), eos], 4)
    assert rejected == ([bos, *ids(["2", "+", "3", "=", "6"]), eos], 5)
    # a conversation: the generation prompt's "\n" merges with the answer's "1" ("\n1"), not with its "3"
    record = [{"prompt": [_user("count to 3")], "chosen": [_assistant("1, 2, 3")], "rejected": [_assistant("3")]}]
    for objective, chosen_shift in (("dpo", 0), ("orpo", 1)):
        (chosen, rejected), = _our_sequences(_ours(directory, record, objective, 64, 1, tmp_path))
        assert chosen[1] == rejected[1] - chosen_shift and ids("\n1") in chosen[0]


# ------------------------------------------------------------------------------------------------ bad input

GOOD = {"dpo": {"prompt": "hi", "chosen": "hello", "rejected": "go"},
        "kto": {"prompt": "hi", "completion": "hello", "label": True}}
GOOD["orpo"] = GOOD["simpo"] = GOOD["dpo"]


def _load(directory: str, tmp_path, objective: str, bad: str, seq_len: int = 64):
    """load_inputs on a file whose line 1 is good, line 2 blank and line 3 ``bad``; returns the file's path."""
    data = tmp_path / "prefs.jsonl"
    data.write_text(json.dumps(GOOD[objective]) + "\n\n" + bad + "\n")
    config = TrainConfig(model=directory, data=str(data), out=str(tmp_path / "out"), objective=objective,
                         seq_len=seq_len, batch_size=2, device="cpu")
    return str(data), config


def _refused(directory, tmp_path, objective, bad, message, seq_len=64):
    data, config = _load(directory, tmp_path, objective, bad, seq_len)
    with pytest.raises(DataError, match=re.escape(f"{data} line 3: ") + message):
        load_inputs(config)


@pytest.mark.parametrize("objective, bad, message", [
    ("dpo", '{"prompt": "hi", "rejected": "no"}', 'no "chosen" \\(--objective dpo reads'),
    ("simpo", '{"prompt": "hi", "chosen": "yes"}', 'no "rejected"'),
    ("kto", '{"prompt": "hi", "label": true}', 'no "completion"'),
    ("dpo", '{"prompt": "hi", "chosen": "", "rejected": "no"}', '"chosen" is empty'),
    ("orpo", '{"prompt": "hi", "chosen": "yes", "rejected": "   "}', '"rejected" is empty'),
    ("kto", '{"prompt": "hi", "completion": "", "label": false}', '"completion" is empty'),
    ("dpo", '{"prompt": "hi", "chosen": [], "rejected": []}', '"chosen" must be a string or a list of messages'),
    ("kto", '{"prompt": "hi", "completion": "yes"}', '"label" must be true or false .*got None'),
    ("kto", '{"prompt": "hi", "completion": "yes", "label": "true"}', '"label" must be true or false'),
    ("kto", '{"prompt": "hi", "completion": "yes", "label": 1}', '"label" must be true or false .*got 1'),
    ("dpo", json.dumps({"prompt": "hi", "chosen": [_assistant("a")], "rejected": [_assistant("b")]}),
     "mixes strings and message lists"),
    ("kto", json.dumps({"prompt": [_user("hi")], "completion": "yes", "label": True}),
     "mixes strings and message lists"),
    ("dpo", '{"prompt": "hi", "chosen": "yes", ', "not valid JSON"),
    ("orpo", '["hi", "yes", "no"]', "expected a JSON object"),
])
def test_bad_lines_are_named_by_file_and_line(checkpoint, tmp_path, objective, bad, message):
    _refused(checkpoint("qwen2"), tmp_path, objective, bad, message)


@pytest.mark.parametrize("objective", OBJECTIVES)
@pytest.mark.parametrize("prompt, error", [
    ([{"role": "system", "content": "be brief"}, _user("hi")], "cannot render this conversation: System role not "
                                                               "supported"),
    ([_user("hi"), _user("again")], "cannot render this conversation: Conversation roles must alternate"),
])
def test_a_template_that_refuses_the_conversation_is_named(checkpoint, tmp_path, objective, prompt, error):
    """Gemma's template raises (raise_exception) on a system turn and on turns that do not alternate."""
    line = ({"prompt": prompt, "completion": [_assistant("yes")], "label": True} if objective == "kto" else
            {"prompt": prompt, "chosen": [_assistant("yes")], "rejected": [_assistant("no")]})
    _refused(checkpoint("gemma"), tmp_path, objective, json.dumps(line), f".*{error}")


@pytest.mark.parametrize("objective", ["orpo", "simpo"])
def test_an_answer_style_prompt_must_end_with_a_user_turn(checkpoint, tmp_path, objective):
    """TRL's maybe_apply_chat_template would continue the assistant's message instead of starting an answer."""
    line = {"prompt": [_user("hi"), _assistant("hel")], "chosen": [_assistant("lo")], "rejected": [_assistant("p")]}
    _refused(checkpoint("qwen2"), tmp_path, objective, json.dumps(line), "the prompt's last message is 'assistant'")


def test_conversations_need_a_chat_template(checkpoint, tmp_path):
    directory = str(tmp_path / "no_template")
    shutil.copytree(checkpoint("qwen2"), directory)
    cfg_path = os.path.join(directory, "tokenizer_config.json")
    with open(cfg_path) as f:
        cfg = json.load(f)
    del cfg["chat_template"]
    with open(cfg_path, "w") as f:
        json.dump(cfg, f)
    line = {"prompt": [_user("hi")], "chosen": [_assistant("a")], "rejected": [_assistant("b")]}
    _refused(directory, tmp_path, "dpo", json.dumps(line), "messages, but the checkpoint has no chat template")


@pytest.mark.parametrize("objective, style, prompt_tokens, rule", [
    ("dpo", "qwen2", 8, "TRL's keep_start truncation would leave no completion token"),
    ("kto", "qwen2", 8, "TRL's keep_start truncation would leave no completion token"),
    ("dpo", "bpe_bos", 9, "TRL's keep_start truncation"),  # the post-processor's BOS counts
    ("orpo", "llama3", 9, "TRL truncates the answer to --seq-len minus the prompt"),  # the BOS TRL adds counts
    ("simpo", "qwen2", 8, "TRL truncates the answer to --seq-len minus the prompt"),
])
def test_a_prompt_of_seq_len_tokens_is_refused_one_less_is_trained(checkpoint, tmp_path, objective, style,
                                                                  prompt_tokens, rule):
    """A prompt of --seq-len tokens or more is an error naming the truncation rule; one token shorter trains (one
    completion token). TRL drops the DPO/KTO example at the same length (its keep_start filter) and keeps it one
    shorter."""
    directory = checkpoint(style)
    line = dict(GOOD[objective], prompt="abcdefgh")
    _refused(directory, tmp_path, objective, json.dumps(line),
             f"the prompt is {prompt_tokens} tokens, --seq-len is {prompt_tokens}: {rule}", seq_len=prompt_tokens)
    data, config = _load(directory, tmp_path, objective, json.dumps(line), seq_len=prompt_tokens + 1)
    examples = load_inputs(config).examples
    assert [(len(s.ids), s.prompt_len) for s in examples[1].sequences] == [(prompt_tokens + 1, prompt_tokens)] * len(
        examples[1].sequences)
    if objective in ("dpo", "kto"):
        records = [GOOD[objective], line]
        for seq_len, kept in ((prompt_tokens, 1), (prompt_tokens + 1, 2)):
            trainer = _trl_trainer(directory, records, objective, seq_len, 2, tmp_path)
            assert len(trainer.train_dataset) == kept


# ------------------------------------------------------------------------------------------------ packing

def test_packed_sequences_describe_the_next_token_at_each_position():
    sequences = [Sequence([10, 11, 12, 13], 2), Sequence([20, 21, 22], 1), Sequence([30, 31], 0)]
    p = PackedSequences.pack(sequences)
    assert p.input_ids.tolist() == [[10, 11, 12, 13, 20, 21, 22, 30, 31]]
    assert p.position_ids.tolist() == [[0, 1, 2, 3, 0, 1, 2, 0, 1]]  # restart at each sequence
    # position t predicts token t + 1 (nothing predicts a sequence's first token)
    assert p.targets.tolist() == [11, 12, 13, -100, 21, 22, -100, 31, -100] and p.head_rows.tolist() == list(range(9))
    assert p.documents.cu_seqlens.tolist() == [0, 4, 7, 9] and p.count == 3
    # position t predicts token t + 1: whether that is a completion token (a sequence's first never is), and whose
    assert p.completion.tolist() == [False, True, True, False, True, True, False, True, False]
    assert p.segment[:-1].tolist() == [0, 0, 0, 1, 1, 1, 2, 2]
    assert p.completion_lens.tolist() == [2.0, 2.0, 2.0]
    assert p.predicted_lens.tolist() == [2.0, 2.0, 1.0]  # prompt 0: the first completion token has no predictor
    assert p.completion_lens.dtype == p.predicted_lens.dtype == torch.float32
    # the targets the completion positions pick are the completion tokens after each sequence's first, in order
    assert p.targets[p.completion].tolist() == [12, 13, 21, 22, 31]
    counts = torch.bincount(p.segment[p.completion], minlength=len(sequences))
    assert counts.tolist() == [int(n) for n in p.predicted_lens]


def test_a_padded_row_adds_documents_of_at_most_seq_len_that_no_sum_reads():
    """--cuda-graph's fixed shapes: the row grows to the given length with documents of at most ``seq_len`` tokens
    (positions restarting, no labels, no completion), and the bounds get room for n + ceil(length / seq_len)
    sequences, the unused ones empty, with ``seq_len`` as the longest; the sequences' own tensors are unchanged."""
    p = PackedSequences.pack([Sequence([10, 11, 12, 13], 2), Sequence([20, 21, 22], 1)])
    q = p.padded(14, 4)
    assert q.input_ids.tolist() == [[10, 11, 12, 13, 20, 21, 22, 0, 0, 0, 0, 0, 0, 0]]
    assert q.position_ids.tolist() == [[0, 1, 2, 3, 0, 1, 2, 0, 1, 2, 3, 0, 1, 2]]
    assert q.targets[7:].tolist() == [-100] * 7 and q.targets[:7].tolist() == p.targets.tolist()
    assert q.head_rows.tolist() == list(range(14))
    assert q.completion[7:].sum() == 0 and q.completion[:7].tolist() == p.completion.tolist()
    assert q.segment[7:].tolist() == [0] * 7 and q.completion_lens is p.completion_lens and q.count == 2
    assert q.documents.cu_seqlens.tolist() == [0, 4, 7, 11, 14, 14, 14]  # room for 2 + ceil(14 / 4) sequences
    assert q.documents.max_len == 4
    rebuilt = PackedSequences.from_flat(q.flat(), 4)
    assert rebuilt.documents.ids.tolist() == q.documents.ids.tolist()
    assert torch.equal(rebuilt.input_ids, q.input_ids) and torch.equal(rebuilt.predicted_lens, q.predicted_lens)
    assert p.padded(7, 4).documents.cu_seqlens.tolist() == [0, 4, 7, 7, 7]
    with pytest.raises(ValueError, match="does not fit"):
        p.padded(6, 4)


def test_a_row_in_slots_pads_each_example_and_fixes_where_the_examples_end():
    """--cuda-graph with slots: each example (here two, of 5 and 3 tokens) padded to its slot of 6 tokens, so the
    examples end at 6 and 12 in every micro-batch; room in the bounds for ceil(6 / 4) padding documents a slot."""
    a = PreferenceExample((Sequence([1, 2, 3], 1), Sequence([1, 4], 1)), "a")
    b = PreferenceExample((Sequence([5, 6], 1), Sequence([5], 1)), "b")
    p = make_batch([a, b], [0, 1]).rows
    assert p.group_ends == (5, 8)
    q = p.padded(12, 4, slot=6)
    assert q.input_ids.tolist() == [[1, 2, 3, 1, 4, 0, 5, 6, 5, 0, 0, 0]]
    assert q.position_ids.tolist() == [[0, 1, 2, 0, 1, 0, 0, 1, 0, 0, 1, 2]]
    assert q.group_ends == (6, 12)
    keep = torch.tensor([1, 1, 1, 1, 1, 0, 1, 1, 1, 0, 0, 0], dtype=torch.bool)
    assert q.targets[keep].tolist() == p.targets.tolist() and (q.targets[~keep] == -100).all()
    assert q.completion[keep].tolist() == p.completion.tolist() and not q.completion[~keep].any()
    assert q.segment[keep].tolist() == p.segment.tolist()
    assert q.documents.cu_seqlens.tolist() == [0, 3, 5, 6, 8, 9, 12, 12, 12]  # 4 sequences + 2 x 2 room
    with pytest.raises(ValueError, match="do not make a row"):
        p.padded(11, 4, slot=6)
    with pytest.raises(ValueError, match="slots of 4"):
        p.padded(8, 4, slot=4)


def test_the_graph_gives_each_example_a_slot_when_that_costs_little_padding():
    """Slots (each example padded to the longest, rounded up to 16) when they make the captured row at most 1/32
    longer than the 4 longest examples packed: pairs of one length, as the preference benchmark's; not for pairs of
    very different lengths, whose captured rows stay packed."""
    from types import SimpleNamespace

    from ligermodels.train.objectives import PreferenceTask

    def task(lengths):
        examples = [PreferenceExample((Sequence([1] * (n // 2), 1), Sequence([1] * (n - n // 2), 1)), "x")
                    for n in lengths]
        config = SimpleNamespace(objective="dpo", seed=0, batch_size=4, prompt_pass="twice", cuda_graph=True)
        return PreferenceTask(config, examples, "tokens")

    even = task([2050] * 10)
    assert even.graph_slot == 2064 and even.graph_room == (4 * 2064, 0)
    uneven = task([2050, 1000, 500, 800, 1200])
    assert uneven.graph_slot == 0 and uneven.graph_room == (-(-(2050 + 1200 + 1000 + 800) // 64) * 64, 0)


def test_the_graph_with_prompts_once_sizes_each_row_for_any_distinct_examples():
    """:meth:`SharedRoom.of`: the attention row holds the 4 longest pairs whole and one filler position (rounded up
    to 64), the model's row that less the 4 smallest shared prompts, the repeats the 4 largest; head rows in slots
    for pairs of one length (the benchmark's), else packed; and ORPO's head counts the chosen prompt."""
    def pair(prompt: int, chosen: int, rejected: int) -> PreferenceExample:
        p = list(range(1, prompt + 1))
        return PreferenceExample((Sequence(p + [7] * chosen, prompt), Sequence(p + [8] * rejected, prompt)), "x")

    even = [pair(256, 770, 768)] * 10
    room = SharedRoom.of(even, 4, "completion")
    assert room.attention == -(-(4 * 2050 + 1) // 64) * 64 and room.tokens == room.attention - 4 * 256
    assert room.repeats == 4 * 256 and room.head_slot == -(-(770 + 768) // 16) * 16 and room.head == 4 * 1552
    assert head_row_count(even[0], "first") == 1538 + 255 and shared_prefix_count(even[0]) == 256  # token 0: none
    for head in ("all", "completion", "first"):
        for e in (even[0], pair(1, 3, 2)):
            assert head_row_count(e, head) == PackedSequences.pack(list(e.sequences), 2, True, head).head_rows.numel()
    uneven = [pair(10, 5, 5), pair(300, 900, 10), pair(40, 60, 600), pair(5, 5, 5), pair(100, 100, 100)]
    room = SharedRoom.of(uneven, 4, "completion")
    assert room.head_slot == 0 and room.head == -(-(910 + 660 + 200 + 10) // 64) * 64
    assert room.tokens == room.attention - (5 + 10 + 40 + 100) and room.repeats == 300 + 100 + 40 + 10
    for index in ([1, 2, 4, 0], [3, 0, 2, 1]):  # any four distinct examples fit
        rows = make_batch(uneven, index, share_prefixes=True, head="completion").rows
        assert rows.padded_shared(room, 2048) is not None


def test_a_batch_packs_each_pair_side_by_side_and_kto_its_kl_row():
    """Pairs whole and in order (chosen, rejected: segments 2i, 2i + 1), each pair a group of the loss head."""
    a = PreferenceExample((Sequence([1, 2, 3], 1), Sequence([1, 4], 1)), "a")
    b = PreferenceExample((Sequence([5, 6], 1), Sequence([5, 7, 8], 1)), "b")
    batch = make_batch([a, b], [1, 0])
    assert batch.rows.input_ids.tolist() == [[5, 6, 5, 7, 8, 1, 2, 3, 1, 4]]
    assert batch.rows.position_ids.tolist() == [[0, 1, 0, 1, 2, 0, 1, 2, 0, 1]]
    assert batch.rows.group_ends == (5, 10)
    assert batch.rows.segment[batch.rows.completion].tolist() == [0, 1, 1, 2, 2, 3]
    assert batch.rows.completion_lens.tolist() == [1.0, 2.0, 2.0, 1.0]
    assert batch.index.tolist() == [1, 0] and batch.kl is None and batch.labels is None
    k1 = PreferenceExample((Sequence([1, 2], 1),), "k1", label=True, kl=Sequence([1, 9, 9], 1))
    k2 = PreferenceExample((Sequence([3, 9, 9], 1),), "k2", label=False, kl=Sequence([3, 2], 1))
    batch = make_batch([k1, k2], [0, 1])
    assert batch.rows.input_ids.tolist() == [[1, 2, 3, 9, 9]] and batch.rows.group_ends == (2, 5)
    assert batch.kl.input_ids.tolist() == [[1, 9, 9, 3, 2]]
    assert batch.kl.segment[batch.kl.completion].tolist() == [0, 0, 1]
    assert batch.labels.tolist() == [True, False]
