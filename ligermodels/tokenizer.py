"""Tokenizer loading: the ``tokenizers`` tokenizer stored beside a checkpoint's weights.

    tok = load_tokenizer("meta-llama/Llama-3.2-1B")   # or a local checkpoint directory
    ids = tok.encode("Hello").ids
"""

from __future__ import annotations

import os

from tokenizers import Tokenizer

from checkpoints_tools.hub import CheckpointError, resolve


def load_tokenizer(repo_or_dir: str, revision: str | None = None) -> Tokenizer:
    """The ``tokenizer.json`` of a checkpoint, as a :class:`tokenizers.Tokenizer`.

    ``repo_or_dir`` is resolved exactly as :meth:`CausalLM.from_hf` resolves it (a local directory, or a
    hub repo id fetched into the HF cache through :func:`checkpoints_tools.hub.resolve`), so the weights
    and the tokenizer come from the same place. Raises ``CheckpointError`` naming the directory when it
    holds no ``tokenizer.json`` (slow-only tokenizers such as a lone ``tokenizer.model`` are not read),
    and naming the file when it cannot be read.
    """
    directory = resolve(repo_or_dir, revision)
    path = os.path.join(directory, "tokenizer.json")
    if not os.path.isfile(path):
        extra = (" (it has a sentencepiece tokenizer.model: convert it to tokenizer.json with transformers' "
                 "AutoTokenizer(...).save_pretrained)" if os.path.isfile(os.path.join(directory, "tokenizer.model"))
                 else "")
        raise CheckpointError(f"{directory} has no tokenizer.json{extra}")
    try:
        tokenizer = Tokenizer.from_file(path)
    except Exception as e:  # the tokenizers library raises a bare Exception on a corrupt file
        raise CheckpointError(f"{path}: not a readable tokenizer.json ({e})") from None
    tokenizer.no_padding()  # padding or truncation saved in tokenizer.json would pad or cut every text;
    tokenizer.no_truncation()  # transformers turns both off per call too
    return tokenizer


__all__ = ["load_tokenizer"]
