"""Compose a custom decoder from the ligermodels blocks, train it a few steps, save it in HF format.

The model: a Qwen2-style body (q/k/v bias, grouped-query attention) with a GeGLU MLP instead of
SwiGLU and a sliding window on its top layer: one DecoderConfig, no new model code. It learns to
count (start, start+1, ... mod vocab), is saved as an HF checkpoint that transformers loads as
Qwen2 with hidden_act=gelu_pytorch_tanh, and is checked against transformers.

    python examples/custom_model.py [--steps 40] [--out runs/custom_model]
"""

from __future__ import annotations

import argparse

import torch

from ligermodels import CausalLM, DecoderConfig, RopeConfig


def make_config() -> DecoderConfig:
    head_dim = 16
    return DecoderConfig(
        vocab_size=64, hidden_size=64, intermediate_size=160, num_layers=3, num_heads=4, num_kv_heads=2,
        head_dim=head_dim, activation="gelu_tanh", qkv_bias=True,
        sliding_window=24, layer_windows=(None, None, 24),
        rope=RopeConfig(theta=10000.0, head_dim=head_dim, max_position_embeddings=256),
        max_position_embeddings=256, tie_embeddings=True, model_type="qwen2",
    )


def batch(step: int, vocab: int, b: int = 8, s: int = 48) -> torch.Tensor:
    """Counting sequences (start, start+1, ... mod vocab) from random starts: a pattern learnt in a few steps."""
    g = torch.Generator().manual_seed(step)
    start = torch.randint(0, vocab, (b, 1), generator=g)
    return (start + torch.arange(s)) % vocab


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--out", default="runs/custom_model")
    args = ap.parse_args()
    torch.manual_seed(0)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = CausalLM(make_config()).init_weights().to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    for step in range(args.steps):
        ids = batch(step, model.config.vocab_size).to(device)
        loss = model.loss(ids, labels=ids)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if step % 5 == 0 or step == args.steps - 1:
            print(f"step {step:3d}  loss {loss.item():.3f}")
    model.eval().save_hf(args.out)
    print(f"saved an HF checkpoint to {args.out}")
    try:
        import transformers
    except ImportError:
        return
    hf = transformers.AutoModelForCausalLM.from_pretrained(args.out).to(device).eval()
    ids = batch(10_000, model.config.vocab_size).to(device)
    with torch.no_grad():
        ours, theirs = model(ids).double(), hf(input_ids=ids).logits.double()
    print(f"transformers {type(hf).__name__} reproduces it: logits rel. error "
          f"{((ours - theirs).norm() / theirs.norm()).item():.2e}")


if __name__ == "__main__":
    main()
