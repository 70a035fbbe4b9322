"""The built-in demo: a corpus, a tokenizer and a tiny Llama config, all made here, with no download, and the
greedy completions and addition score it prints at the end.

The corpus mixes two things a small model visibly learns within a few hundred steps:

* additions ``"23+19="`` -> ``"42"`` as prompt/completion pairs (loss on the answer only);
* templated sentences such as ``"alice has 3 red apples."`` as plain text.

The tokenizer is character level (one token per character, plus ``<pad> <unk> <s> </s>``), built
with ``tokenizers`` and saved as ``tokenizer.json`` + ``tokenizer_config.json`` so that both
``tokenizers`` and transformers' ``AutoTokenizer`` load it. Everything is deterministic for a seed.

With a preference objective (``--objective dpo``, ``orpo``, ``simpo``, ``kto``) the demo has two stages
(:func:`preference_demo`): the plain demo's SFT run into ``OUT/sft``, then the preference objective on pairs made
from the corpus's additions (the right answer chosen, a wrong one rejected: the SFT model's own where it errs),
starting from the SFT model (for DPO and KTO also the reference), into ``OUT``.
"""

from __future__ import annotations

import dataclasses
import json
import os
import random
from collections.abc import Callable

import torch
import torch.distributed as dist
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors

from ligermodels.model import CausalLM
from ligermodels.train.checkpointing import check_out_dir
from ligermodels.train.config import TrainConfig
from ligermodels.train.preference import WITH_REFERENCE

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


# ---------------------------------------------------------------------------------------- the preference stage
#: The preference stage's own settings, fixed: a short fp32 run (seconds on two CPU cores).
PREFERENCE_DEMO = dict(steps=90, batch_size=32, lr=3e-5, warmup_steps=5, lr_schedule="constant", save_every=30,
                       log_every=10, dtype="fp32")
#: Distinct additions of the corpus that the preference examples are made of.
PREFERENCE_PROMPTS = 512
#: What the preference stage takes of the command line: the objective's options, and where and how it runs (every
#: other flag describes the SFT stage, as it does the plain demo).
PREFERENCE_FLAGS = ("objective", "beta", "dpo_loss", "label_smoothing", "simpo_gamma", "cpo_alpha",
                    "desirable_weight", "undesirable_weight", "reference", "seed", "device", "resume", "overwrite",
                    "report_to")
#: The metrics whose first and last steps the demo compares (KTO logs no accuracy).
REWARD_METRICS = ("rewards/accuracies", "rewards/margins")


def wrong_answer(right: str, rng: random.Random) -> str:
    """A deterministic corruption of a right answer: off by 1, 2 or 10, never negative and never right."""
    offset = rng.choice((-10, -2, -1, 1, 2, 10))
    value = int(right) + offset
    return str(value if value >= 0 else int(right) - offset)


def preference_records(corpus_file: str, model: CausalLM, tokenizer: Tokenizer, objective: str, seed: int,
                       n: int = PREFERENCE_PROMPTS) -> tuple[list[dict], int]:
    """Preference lines for ``objective`` from the first ``n`` distinct additions of ``corpus_file``: the prompt
    ``"a+b="``, the right answer chosen, rejected the ``model``'s greedy answer where it is wrong (and not empty),
    else :func:`wrong_answer` (seeded). Paired objectives: ``{"prompt", "chosen", "rejected"}``; KTO: the right
    and the wrong completion as two lines ``{"prompt", "completion", "label"}``. Also how many rejected answers are
    the model's own."""
    with open(corpus_file) as f:
        additions = {r["prompt"]: r["completion"] for r in map(json.loads, f) if "prompt" in r}  # first seen first
    rng, bos, eos = random.Random(seed), tokenizer.token_to_id("<s>"), tokenizer.token_to_id("</s>")
    records, own = [], 0
    for prompt, right in list(additions.items())[:n]:
        answer = greedy_complete(model, tokenizer, prompt, bos, eos, max_new_tokens=4)
        wrong = answer if answer.strip() and answer != right else wrong_answer(right, rng)
        own += wrong == answer
        if objective == "kto":
            records += [{"prompt": prompt, "completion": right, "label": True},
                        {"prompt": prompt, "completion": wrong, "label": False}]
        else:
            records.append({"prompt": prompt, "chosen": right, "rejected": wrong})
    return records, own


def reward_summary(metrics_file: str, k: int = 5) -> str:
    """One line: the means of :data:`REWARD_METRICS` over the first ``k`` and the last ``k`` steps of a run."""
    with open(metrics_file) as f:
        steps = [json.loads(line) for line in f]
    parts = []
    for name in REWARD_METRICS:
        values = [m[name] for m in steps if m.get(name) is not None]
        if values:
            n = min(k, len(values))
            parts.append(f"{name} {sum(values[:n]) / n:.3f} -> {sum(values[-n:]) / n:.3f}")
    return f"preference stage, mean of the first {k} steps -> of the last {k}: {', '.join(parts)}"


def preference_demo(config: TrainConfig, train: Callable[[TrainConfig], str], rank: int) -> str:
    """The demo with a preference objective: the plain demo's SFT run (``config`` with ``OUT/sft``), then
    ``OUT/demo/pairs.jsonl`` from its corpus and model (:func:`preference_records`), then the objective on them
    from the SFT model, the reference, into ``OUT`` (:data:`PREFERENCE_DEMO`); prints the final model's completions
    and the reward accuracy of the first and the last steps. ``train`` runs a stage (in the caller's process
    group); returns ``OUT/final``."""
    sft_out, pairs = os.path.join(config.out, "sft"), os.path.join(config.out, "demo", "pairs.jsonl")
    sft = dataclasses.replace(config, out=sft_out, objective="sft", label_smoothing=0.0)
    stage = TrainConfig(model=os.path.join(sft_out, "merged" if config.lora_rank else "final"), data=pairs,
                        out=config.out, **PREFERENCE_DEMO, **{k: getattr(config, k) for k in PREFERENCE_FLAGS})
    check_out_dir(stage)  # a run already in OUT stops the demo now, not after the SFT stage
    train(sft)
    if rank == 0:
        model = CausalLM.from_hf(stage.model, dtype=torch.float32)
        tokenizer = Tokenizer.from_file(os.path.join(stage.model, "tokenizer.json"))
        records, own = preference_records(sft.data_file, model, tokenizer, config.objective, config.seed)
        os.makedirs(os.path.dirname(pairs), exist_ok=True)
        with open(pairs, "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in records)
        reference = ", also the reference" if config.objective in WITH_REFERENCE else ""
        print(f"preference stage: {len(records)} {config.objective} examples in {pairs} (the wrong answer is the "
              f"SFT model's own for {own} of {len(records) // (2 if config.objective == 'kto' else 1)} prompts, a "
              f"corrupted right one for the others); from {stage.model}{reference}")
    dist.barrier()
    final = train(stage)
    if rank == 0:
        model, tokenizer = CausalLM.from_hf(final, dtype=torch.float32), Tokenizer.from_file(
            os.path.join(final, "tokenizer.json"))
        print_completions(model, tokenizer, tokenizer.token_to_id("<s>"), tokenizer.token_to_id("</s>"))
        print(reward_summary(os.path.join(config.out, "metrics.jsonl")))
    return final
