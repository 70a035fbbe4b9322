"""Resolve a local directory or a Hugging Face hub repo id to a local directory of safetensors.

Only ``*.safetensors``, ``*.json`` and tokenizer files are ever fetched (pickled ``.bin`` weights
are not downloaded and not read). The standard HF cache and ``HF_HUB_OFFLINE`` are honoured
because the download goes through ``huggingface_hub.snapshot_download``.
"""

from __future__ import annotations

import glob
import os

ALLOW_PATTERNS = ["*.safetensors", "*.json", "tokenizer.model", "*.tiktoken", "*.txt"]


class CheckpointError(RuntimeError):
    """A checkpoint cannot be found, resolved or read; the message names the thing at fault."""


def _offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "0").upper() in ("1", "TRUE", "YES", "ON")


def resolve(repo_or_dir: str, revision: str | None = None) -> str:
    """Local directory holding the checkpoint ``repo_or_dir`` (a directory, or a hub repo id)."""
    path = os.path.expanduser(str(repo_or_dir))
    if os.path.isdir(path):
        return path
    if os.path.exists(path):
        raise CheckpointError(f"{repo_or_dir!r} is a file; give the checkpoint's directory or a hub repo id")
    if path.startswith((".", "/", "~")) or path.count("/") > 1:
        raise CheckpointError(f"checkpoint directory {repo_or_dir!r} does not exist")
    try:
        from huggingface_hub import snapshot_download
        from huggingface_hub.errors import (
            GatedRepoError,
            HFValidationError,
            LocalEntryNotFoundError,
            RepositoryNotFoundError,
            RevisionNotFoundError,
        )
    except ImportError as e:  # pragma: no cover - huggingface_hub is a dependency
        raise CheckpointError(f"cannot resolve hub repo id {repo_or_dir!r}: huggingface_hub is missing") from e
    try:
        return snapshot_download(repo_id=path, revision=revision, allow_patterns=ALLOW_PATTERNS)
    except HFValidationError as e:
        raise CheckpointError(f"{repo_or_dir!r} is neither an existing directory nor a valid hub repo id") from e
    except (RepositoryNotFoundError, GatedRepoError) as e:
        raise CheckpointError(f"hub repo {repo_or_dir!r} was not found or is not accessible: {e}") from e
    except RevisionNotFoundError as e:
        raise CheckpointError(f"hub repo {repo_or_dir!r} has no revision {revision!r}") from e
    except LocalEntryNotFoundError as e:
        state = ("this machine is offline (HF_HUB_OFFLINE is set)" if _offline()
                 else "the hub could not be reached and it is not in the local HF cache")
        raise CheckpointError(f"cannot resolve hub repo {repo_or_dir!r}: {state}") from e
    except OSError as e:
        raise CheckpointError(f"cannot resolve hub repo {repo_or_dir!r}: the hub could not be reached ({e})") from e


def safetensors_files(directory: str) -> list[str]:
    """The checkpoint's safetensors files; refuses pickled-only checkpoints without reading them."""
    files = sorted(glob.glob(os.path.join(directory, "*.safetensors")))
    if files:
        return files
    pickled = [os.path.basename(p) for ext in ("*.bin", "*.pt", "*.pth", "*.ckpt")
               for p in glob.glob(os.path.join(directory, ext))]
    if pickled:
        raise CheckpointError(f"{directory} holds only pickled weights ({', '.join(sorted(pickled)[:3])}); "
                              "ligermodels never unpickles checkpoints: convert them to safetensors first")
    raise CheckpointError(f"{directory} holds no *.safetensors weights")
