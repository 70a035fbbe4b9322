"""Quickstart: load a checkpoint and its tokenizer, continue a prompt, print the text.

    python examples/quickstart.py --model meta-llama/Llama-3.2-1B --prompt "The capital of France is"
    python examples/quickstart.py --model /path/to/checkpoint --max-new-tokens 64 --temperature 0.7 --top-p 0.9
    python examples/quickstart.py        # offline: a tiny random Llama (and tokenizer) built in a temp dir

Without ``--model`` the weights are random, so the "text" is random bytes: that run only shows the
pipeline (checkpoint -> ``AutoLigerModel.from_hf`` + ``load_tokenizer`` -> ``generate``) end to end.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run from a checkout

from ligermodels import AutoLigerModel, DecoderConfig, LigerLlama, load_tokenizer  # noqa: E402

BOS, EOS = "<|begin_of_text|>", "<|end_of_text|>"


def byte_tokenizer():
    """A byte-level tokenizer (256 byte tokens, no merges) that prepends BOS, like Llama 3's."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors

    vocab = {ch: i for i, ch in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    vocab.update({BOS: len(vocab), EOS: len(vocab) + 1})
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([BOS, EOS])
    tok.post_processor = processors.TemplateProcessing(single=f"{BOS} $A", special_tokens=[(BOS, vocab[BOS])])
    return tok


def build_tiny_checkpoint(directory: str, seed: int = 0) -> str:
    """Write a tiny random Llama checkpoint (HF layout: config.json, safetensors, tokenizer.json) to ``directory``."""
    tok = byte_tokenizer()
    config = DecoderConfig(vocab_size=tok.get_vocab_size(), hidden_size=64, intermediate_size=128, num_layers=2,
                           num_heads=4, num_kv_heads=2, max_position_embeddings=512, tie_embeddings=True,
                           model_type="llama")
    torch.manual_seed(seed)
    LigerLlama(config).init_weights(std=0.1).save_hf(directory)  # replaces the directory: tokenizer after
    tok.save(os.path.join(directory, "tokenizer.json"))
    with open(os.path.join(directory, "generation_config.json"), "w") as f:
        json.dump({"bos_token_id": tok.token_to_id(BOS), "eos_token_id": tok.token_to_id(EOS)}, f)
    return directory


def eos_ids(model) -> int | list[int] | None:
    """EOS id(s) from the checkpoint's generation_config.json, else its config.json."""
    path = os.path.join(getattr(model, "source_dir", ""), "generation_config.json")
    if os.path.isfile(path):
        with open(path) as f:
            eos = json.load(f).get("eos_token_id")
        if eos is not None:
            return eos
    return model.config.hf_config.get("eos_token_id")


def run(model_path: str, prompt: str, max_new_tokens: int, temperature: float, top_k: int | None,
        top_p: float | None, device: str, dtype: str | None, seed: int) -> str:
    """Load ``model_path`` and its tokenizer, generate, return the continuation's text."""
    model = AutoLigerModel.from_hf(model_path, dtype=dtype or ("bf16" if device.startswith("cuda") else "fp32"),
                                   device=device)
    tok = load_tokenizer(model_path)
    ids = torch.tensor([tok.encode(prompt).ids], device=device)
    gen = torch.Generator(device=device).manual_seed(seed)
    out = model.generate(ids, max_new_tokens, temperature=temperature, top_k=top_k, top_p=top_p,
                         eos_token_id=eos_ids(model), generator=gen)
    return tok.decode(out[0, ids.shape[1]:].tolist(), skip_special_tokens=True)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="hub repo id or checkpoint directory (default: tiny random Llama)")
    ap.add_argument("--prompt", default="Once upon a time")
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    ap.add_argument("--top-k", type=int, default=None)
    ap.add_argument("--top-p", type=float, default=None)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default=None, help="bf16 / fp16 / fp32 (default: bf16 on CUDA, fp32 on CPU)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    opts = dict(prompt=args.prompt, max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                top_k=args.top_k, top_p=args.top_p, device=args.device, dtype=args.dtype, seed=args.seed)
    if args.model is None:
        with tempfile.TemporaryDirectory() as tmp:
            print(f"(no --model: a tiny random Llama in {tmp}; the continuation is random bytes)")
            text = run(build_tiny_checkpoint(os.path.join(tmp, "tiny-llama")), **opts)
    else:
        text = run(args.model, **opts)
    print(args.prompt + text)


if __name__ == "__main__":
    main()
