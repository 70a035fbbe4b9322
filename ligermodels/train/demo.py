"""The built-in demo: a corpus, a tokenizer and a tiny Llama config, all made here, with no download, and the
greedy completions and addition score it prints at the end.

The corpus mixes two things a small model visibly learns within a few hundred steps:

* additions ``"23+19="`` -> ``"42"`` as prompt/completion pairs (loss on the answer only);
* templated sentences such as ``"alice has 3 red apples."`` as plain text.

The tokenizer is character level (one token per character, plus ``<pad> <unk> <s> </s>``), built
with ``tokenizers`` and saved as ``tokenizer.json`` + ``tokenizer_config.json`` so that both
``tokenizers`` and transformers' ``AutoTokenizer`` load it. Everything is deterministic for a seed.
"""

from __future__ import annotations

import json
import os
import random

import torch
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors

from ligermodels.model import CausalLM

SPECIALS = ("<pad>", "<unk>", "<s>", "</s>")
ALPHABET = " 0123456789abcdefghijklmnopqrstuvwxyz.,+=?!'-"

NAMES = ("alice", "bob", "carol", "dave", "erin", "frank")
COLOURS = ("red", "green", "yellow", "blue")
FRUITS = ("apple", "pear", "plum", "lemon")
PLACES = ("park", "market", "river", "garden")
TEMPLATES = (
    "{name} has {n} {colour} {fruit}s.",
    "{name} went to the {place} with {other}.",
    "the {fruit} is {colour}.",
    "{name} likes {colour} {fruit}s and {other} likes {colour2} {fruit2}s.",
)

#: Prompts whose greedy completions the demo prints at the end.
SAMPLE_PROMPTS = ("12+7=", "23+19=", "8+35=", "alice has", "the lemon is", "bob went to the")

#: The demo model: a small Llama (about 0.8M parameters) that trains in minutes on a laptop CPU.
DEMO_HF_CONFIG = {
    "model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": 128, "intermediate_size": 384,
    "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 4, "max_position_embeddings": 256,
    "rms_norm_eps": 1e-5, "hidden_act": "silu", "tie_word_embeddings": True, "attention_bias": False,
    "mlp_bias": False, "rope_theta": 10000.0, "bos_token_id": 2, "eos_token_id": 3, "pad_token_id": 0,
}


def corpus(n: int = 20000, seed: int = 0, max_operand: int = 49) -> list[dict]:
    """``n`` JSON-lines records: half additions (prompt/completion), half templated sentences (text)."""
    rng = random.Random(seed)
    records = []
    for i in range(n):
        if i % 2 == 0:
            a, b = rng.randint(0, max_operand), rng.randint(0, max_operand)
            records.append({"prompt": f"{a}+{b}=", "completion": str(a + b)})
        else:
            name, other = rng.sample(NAMES, 2)
            (colour, colour2), (fruit, fruit2) = rng.sample(COLOURS, 2), rng.sample(FRUITS, 2)
            text = rng.choice(TEMPLATES).format(name=name, other=other, n=rng.randint(2, 9), colour=colour,
                                                colour2=colour2, fruit=fruit, fruit2=fruit2,
                                                place=rng.choice(PLACES))
            records.append({"text": text})
    return records


def addition_tests(n: int = 100, seed: int = 12345, max_operand: int = 49) -> list[tuple[str, str]]:
    """``n`` (prompt, answer) additions drawn apart from the corpus's stream, to score the trained demo model."""
    rng = random.Random(seed)
    pairs = [(rng.randint(0, max_operand), rng.randint(0, max_operand)) for _ in range(n)]
    return [(f"{a}+{b}=", str(a + b)) for a, b in pairs]


def build_tokenizer(alphabet: str = ALPHABET, add_bos: bool = True) -> Tokenizer:
    """A character-level tokenizer: ids 0-3 are ``<pad> <unk> <s> </s>``, then one id per character.
    With ``add_bos`` its post-processor puts ``<s>`` before every encoded text (as Llama's does), which is
    what makes the trainer add BOS to each document."""
    vocab = {tok: i for i, tok in enumerate((*SPECIALS, *alphabet))}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")  # every character is a word
    tok.decoder = decoders.Fuse()  # join characters back without spaces
    tok.add_special_tokens(list(SPECIALS))
    if add_bos:
        tok.post_processor = processors.TemplateProcessing(single="<s> $A", pair="<s> $A <s> $B",
                                                           special_tokens=[("<s>", vocab["<s>"])])
    return tok


def save_tokenizer(tokenizer: Tokenizer, directory: str) -> None:
    """Write ``tokenizer.json`` and a ``tokenizer_config.json`` naming BOS/EOS/PAD/UNK."""
    os.makedirs(directory, exist_ok=True)
    tokenizer.save(os.path.join(directory, "tokenizer.json"))
    cfg = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "</s>",
           "pad_token": "<pad>", "unk_token": "<unk>", "model_max_length": DEMO_HF_CONFIG["max_position_embeddings"]}
    with open(os.path.join(directory, "tokenizer_config.json"), "w") as f:
        json.dump(cfg, f, indent=2)


def demo_hf_config(tokenizer: Tokenizer) -> dict:
    """The demo model's HF config.json dict, sized to the tokenizer."""
    return {**DEMO_HF_CONFIG, "vocab_size": tokenizer.get_vocab_size()}


def write_demo(directory: str, n: int = 20000, seed: int = 0) -> tuple[str, str]:
    """Write ``directory/model`` (config.json + tokenizer) and ``directory/data.jsonl``; return both paths.

    Lets a reader look at what the demo trains on, or rerun it through the ordinary flags:
    ``--model DIR/model --from-scratch --data DIR/data.jsonl``.
    """
    model_dir, data = os.path.join(directory, "model"), os.path.join(directory, "data.jsonl")
    tok = build_tokenizer()
    save_tokenizer(tok, model_dir)
    with open(os.path.join(model_dir, "config.json"), "w") as f:
        json.dump(demo_hf_config(tok), f, indent=2)
    with open(data, "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in corpus(n, seed))
    return model_dir, data


def greedy_complete(model: CausalLM, tokenizer: Tokenizer, prompt: str, bos: int | None, eos: int | None,
                    max_new_tokens: int = 24) -> str:
    """The greedy continuation of ``prompt`` (BOS added as in training), up to EOS, as text."""
    ids = ([bos] if bos is not None else []) + tokenizer.encode(prompt, add_special_tokens=False).ids
    prompt_ids = torch.tensor([ids], device=model.head_weight.device)
    out = model.generate(prompt_ids, max_new_tokens, eos_token_id=eos)[0, len(ids):].tolist()
    return tokenizer.decode(out[:out.index(eos)] if eos in out else out)


def print_completions(model: CausalLM, tokenizer: Tokenizer, bos: int | None, eos: int | None) -> None:
    """The demo's last lines: greedy completions of :data:`SAMPLE_PROMPTS`, then the score on 100 additions."""
    print("greedy completions from the exported checkpoint:")
    for prompt in SAMPLE_PROMPTS:
        print(f"  {prompt!r} -> {greedy_complete(model, tokenizer, prompt, bos, eos)!r}")
    tests = addition_tests(100)
    right = sum(greedy_complete(model, tokenizer, prompt, bos, eos, max_new_tokens=4) == answer
                for prompt, answer in tests)
    print(f"additions answered right: {right}/{len(tests)}")
