"""Chat data (``{"messages": [...]}`` lines): rendered with the checkpoint's chat template into the token ids
transformers' ``apply_chat_template`` gives, with the loss on the assistant turns.

Each template is written in the style of a family's own (Qwen2's ChatML with a default system prompt, Qwen3's
thinking blocks, Llama 3's headers with the BOS token, Gemma's alternating turns that refuse a system role) into a
tiny character-level tokenizer whose control tokens are added tokens, beside a transformers tokenizer config.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from tokenizers import Regex, pre_tokenizers

from ligermodels.train.chat import ChatTemplate
from ligermodels.train.data import (
    DataError,
    PackedRows,
    count_loss_tokens,
    read_jsonl,
    special_token_ids,
    special_token_names,
    tokenize,
)
from ligermodels.train.demo import ALPHABET, build_tokenizer
from tests.test_train import ENV, ROOT, TIMEOUT

transformers = pytest.importorskip("transformers")

QWEN2 = (
    "{%- if messages[0]['role'] == 'system' %}{{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}"
    "{%- else %}{{- '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}{%- endif %}"
    "{%- for message in messages %}{%- if not (message.role == 'system' and loop.first) %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}")
#: Qwen2's, with the assistant's text and end of turn marked as TRL's training templates mark them.
QWEN2_MARKED = QWEN2.replace(
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}",
    "{%- if message.role == 'assistant' %}{{- '<|im_start|>assistant\\n' }}{% generation %}"
    "{{- message.content + '<|im_end|>' }}{% endgeneration %}{{- '\\n' }}{%- else %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}{%- endif %}")
QWEN3 = (
    "{%- set ns = namespace(last_query_index=messages|length - 1) %}"
    "{%- for message in messages[::-1] %}{%- set index = (messages|length - 1) - loop.index0 %}"
    "{%- if message.role == 'user' and ns.last_query_index == messages|length - 1 %}"
    "{%- set ns.last_query_index = index %}{%- endif %}{%- endfor %}"
    "{%- for message in messages %}{%- if message.role == 'assistant' %}"
    "{%- set reasoning = message.reasoning_content if message.reasoning_content is defined and "
    "message.reasoning_content is not none else '' %}"
    "{%- if loop.index0 > ns.last_query_index %}"
    "{{- '<|im_start|>assistant\\n<think>\\n' + reasoning.strip('\\n') + '\\n</think>\\n\\n' + message.content }}"
    "{%- else %}{{- '<|im_start|>assistant\\n' + message.content }}{%- endif %}{{- '<|im_end|>\\n' }}"
    "{%- else %}{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}{%- endif %}"
    "{%- endfor %}{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}")
LLAMA3 = (
    "{{- bos_token }}{%- set date = strftime_now('%d %b %Y') %}"
    "{%- if messages[0]['role'] == 'system' %}{%- set system = messages[0]['content'] | trim %}"
    "{%- set messages = messages[1:] %}{%- else %}{%- set system = '' %}{%- endif %}"
    "{{- '<|start_header_id|>system<|end_header_id|>\\n\\n' + 'today date: ' + date + '\\n\\n' + system + "
    "'<|eot_id|>' }}"
    "{%- for message in messages %}{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' + "
    "message['content'] | trim + '<|eot_id|>' }}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif %}")
GEMMA = (
    "{{ bos_token }}{% if messages[0]['role'] == 'system' %}{{ raise_exception('System role not supported') }}"
    "{% endif %}"
    "{% for message in messages %}{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
    "{% if (message['role'] == 'assistant') %}{% set role = 'model' %}{% else %}{% set role = message['role'] %}"
    "{% endif %}{{ '<start_of_turn>' + role + '\\n' + message['content'] | trim + '<end_of_turn>\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{'<start_of_turn>model\\n'}}{% endif %}")

#: per style: (template, control tokens, bos, eos, the end of an assistant turn as the loss covers it)
STYLES = {
    "qwen2": (QWEN2, ["<|im_start|>", "<|im_end|>"], None, "<|im_end|>", "<|im_end|>\n"),
    "qwen2_marked": (QWEN2_MARKED, ["<|im_start|>", "<|im_end|>"], None, "<|im_end|>", "<|im_end|>"),
    "qwen3": (QWEN3, ["<|im_start|>", "<|im_end|>", "<think>", "</think>"], None, "<|im_end|>", "<|im_end|>\n"),
    "llama3": (LLAMA3, ["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"],
               "<|begin_of_text|>", "<|eot_id|>", "<|eot_id|>"),
    "gemma": (GEMMA, ["<bos>", "<eos>", "<start_of_turn>", "<end_of_turn>"], "<bos>", "<eos>", "<end_of_turn>\n"),
}
CHATS = [
    [{"role": "user", "content": "what is 2+3?"}, {"role": "assistant", "content": "it is 5."}],
    [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello!"},
     {"role": "user", "content": "count to 3"}, {"role": "assistant", "content": "1, 2, 3"}],
    [{"role": "system", "content": "You answer briefly."}, {"role": "user", "content": "name a fruit"},
     {"role": "assistant", "content": "a plum."}],
]


def _checkpoint_dir(tmp_path, style: str, chat_template: str | None = None) -> str:
    """A tokenizer directory: the demo's characters (with upper case, newlines and colons) plus the style's
    control tokens as added tokens, and a tokenizer_config.json with the template and special tokens."""
    template, controls, bos, eos, _ = STYLES[style]
    tok = build_tokenizer(alphabet=ALPHABET + "ABCDEFGHIJKLMNOPQRSTUVWXYZ\n:", add_bos=False)
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("[\\s\\S]"), behavior="isolated")  # newlines are characters too
    tok.add_special_tokens(controls)
    d = tmp_path / style
    d.mkdir(parents=True, exist_ok=True)
    tok.save(str(d / "tokenizer.json"))
    cfg = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": eos, "pad_token": "<pad>",
           "unk_token": "<unk>", "bos_token": bos, "chat_template": chat_template or template}
    (d / "tokenizer_config.json").write_text(json.dumps(cfg))
    return str(d)


def _ours(directory: str, messages: list[dict], chat_loss: str = "assistant"):
    from ligermodels import load_tokenizer
    from ligermodels.train.data import Example

    tok = load_tokenizer(directory)
    doc = tokenize([Example("", "", messages, "chat")], tok, *special_token_ids(tok, directory),
                   ChatTemplate.from_checkpoint(directory, special_token_names(directory)), chat_loss)[0]
    return tok, doc


def _theirs(directory: str, messages: list[dict]) -> list[int]:
    out = transformers.AutoTokenizer.from_pretrained(directory).apply_chat_template(messages, tokenize=True)
    return list(out["input_ids"] if hasattr(out, "keys") else out)


@pytest.mark.parametrize("style", sorted(STYLES))
@pytest.mark.parametrize("chat", range(len(CHATS)))
def test_conversations_tokenize_as_transformers_apply_chat_template(tmp_path, style, chat):
    messages = CHATS[chat]
    if style == "gemma" and messages[0]["role"] == "system":
        pytest.skip("Gemma's template refuses a system turn (see the error test)")
    d = _checkpoint_dir(tmp_path, style)
    _, doc = _ours(d, messages, chat_loss="all")
    assert doc.ids == _theirs(d, messages)
    assert doc.mask == [True] * len(doc.ids)


@pytest.mark.parametrize("style", ["qwen2", "qwen3", "llama3", "gemma"])
def test_the_loss_covers_each_assistant_turn_as_the_template_adds_it(tmp_path, style):
    """Unmarked templates: the tokens each assistant turn adds after the generation prompt (its content and the
    template's end of turn) carry the loss; nothing else does."""
    messages = CHATS[0] if style == "qwen3" else CHATS[1]  # Qwen3 rewrites earlier turns: one turn only
    d = _checkpoint_dir(tmp_path, style)
    tok, doc = _ours(d, messages)
    assert doc.ids == _theirs(d, messages)
    end = STYLES[style][4]
    pieces, current = [], []
    for i, m in zip(doc.ids, doc.mask, strict=True):
        if m:
            current.append(i)
        elif current:
            pieces.append(current)
            current = []
    pieces += [current] if current else []
    texts = [tok.decode(p, skip_special_tokens=False) for p in pieces]
    think = "<think>\n\n</think>\n\n" if style == "qwen3" else ""
    expected = [think + m["content"] + end for m in messages if m["role"] == "assistant"]
    assert [t.replace(" ", "") for t in texts] == [e.replace(" ", "") for e in expected], texts


def test_generation_marks_in_the_template_give_transformers_assistant_mask(tmp_path):
    d = _checkpoint_dir(tmp_path, "qwen2_marked")
    hf = transformers.AutoTokenizer.from_pretrained(d)
    for messages in CHATS:
        _, doc = _ours(d, messages)
        theirs = hf.apply_chat_template(messages, tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
        assert doc.ids == list(theirs["input_ids"])
        assert [int(m) for m in doc.mask] == list(theirs["assistant_masks"])


def test_packed_conversations_label_only_the_assistant_tokens(tmp_path):
    d = _checkpoint_dir(tmp_path, "qwen2")
    tok, doc = _ours(d, CHATS[1])
    ids, labels, _ = PackedRows([doc], seq_len=len(doc.ids), seed=0).rows(0, 1)
    assert ids[0].tolist() == doc.ids
    expected = [t if m and k > 0 else -100 for k, (t, m) in enumerate(zip(doc.ids, doc.mask, strict=True))]
    assert labels[0].tolist() == expected


def test_a_template_that_rewrites_earlier_turns_is_refused_for_assistant_loss(tmp_path):
    """Qwen3's template drops the thinking block of earlier turns: no prefix of the whole is a turn's render."""
    d = _checkpoint_dir(tmp_path, "qwen3")
    with pytest.raises(Exception, match="rewrites earlier turns.*--chat-loss all"):
        _ours(d, CHATS[1])
    _, doc = _ours(d, CHATS[1], chat_loss="all")
    assert doc.ids == _theirs(d, CHATS[1])


@pytest.mark.parametrize("line, message", [
    ('{"messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]}',
     "line 2: .*cannot render this conversation: System role not supported"),
    ('{"messages": []}', 'line 2: "messages" must be a non-empty list'),
    ('{"messages": [{"content": "no role"}]}', 'line 2: message 0 must be an object with a string "role"'),
    ('{"messages": [{"role": "user", "content": 3}]}', 'line 2: message 0: "content" must be a string'),
])
def test_bad_conversations_are_named_by_file_and_line(tmp_path, line, message):
    d = _checkpoint_dir(tmp_path, "gemma")
    data = tmp_path / "chat.jsonl"
    data.write_text(json.dumps({"messages": CHATS[0]}) + "\n" + line + "\n")
    with pytest.raises(DataError, match=f"{data} {message}"):
        from ligermodels import load_tokenizer

        tok = load_tokenizer(d)
        chat = ChatTemplate.from_checkpoint(d, special_token_names(d))
        tokenize(read_jsonl(str(data)), tok, *special_token_ids(tok, d), chat)


def test_conversations_without_a_chat_template_and_a_broken_template_are_named(tmp_path):
    from ligermodels import load_tokenizer

    d = _checkpoint_dir(tmp_path, "qwen2")
    cfg = json.loads((tmp_path / "qwen2" / "tokenizer_config.json").read_text())
    del cfg["chat_template"]
    (tmp_path / "qwen2" / "tokenizer_config.json").write_text(json.dumps(cfg))
    data = tmp_path / "chat.jsonl"
    data.write_text(json.dumps({"text": "plain"}) + "\n" + json.dumps({"messages": CHATS[0]}) + "\n")
    tok = load_tokenizer(d)
    assert ChatTemplate.from_checkpoint(d, special_token_names(d)) is None
    with pytest.raises(DataError, match=f"{data} line 2: a conversation .* has no chat template"):
        tokenize(read_jsonl(str(data)), tok, *special_token_ids(tok, d), None)
    (tmp_path / "qwen2" / "chat_template.jinja").write_text("{% for m in messages %}{{ m.content }")
    with pytest.raises(Exception, match="chat_template.jinja: not a valid Jinja template"):
        ChatTemplate.from_checkpoint(d, special_token_names(d))


def test_the_trainer_trains_on_conversations(tmp_path):
    """``python -m ligermodels.train`` on {"messages"} lines: a tiny Llama with a Qwen2-style template; each step
    counts as labelled the assistant tokens of its packed rows, no other."""
    from ligermodels import load_tokenizer
    d = _checkpoint_dir(tmp_path, "qwen2")
    cfg = transformers.LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(cfg).save_pretrained(d)
    data = tmp_path / "chat.jsonl"
    data.write_text("".join(json.dumps({"messages": CHATS[k % 3]}) + "\n" for k in range(30)))
    out = tmp_path / "out"
    res = subprocess.run([sys.executable, "-m", "ligermodels.train", "--model", d, "--data", str(data), "--out",
                          str(out), "--seq-len", "64", "--batch-size", "2", "--steps", "3", "--warmup-steps", "1",
                          "--lr", "1e-2", "--dtype", "fp32", "--device", "cpu", "--save-every", "0"],
                         cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=TIMEOUT)
    assert res.returncode == 0, res.stderr[-3000:]
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    tok = load_tokenizer(d)
    counts = {}
    for loss in ("assistant", "all"):
        docs = tokenize(read_jsonl(str(data)), tok, *special_token_ids(tok, d),
                        ChatTemplate.from_checkpoint(d, special_token_names(d)), loss)
        rows = PackedRows(docs, seq_len=64, seed=0)
        counts[loss] = [count_loss_tokens(rows.rows(2 * k, 2)[1]) for k in range(3)]
    assert [m["tokens"] for m in metrics] == counts["assistant"]
    assert all(0 < a < b for a, b in zip(counts["assistant"], counts["all"], strict=True))
