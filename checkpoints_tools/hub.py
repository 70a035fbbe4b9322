"""Resolve a local directory or a Hugging Face hub repo id to a local directory of safetensors.

Only ``model*.safetensors``, ``*.json`` and tokenizer files are ever fetched (pickled ``.bin``
weights are not downloaded and not read, nor other layouts such as Mistral's
``consolidated.safetensors``). The standard HF cache and ``HF_HUB_OFFLINE`` are honoured because
the download goes through ``huggingface_hub``. With a ``check``, a repo's ``config.json`` is fetched
and checked first, so an unsupported or unexpected model is refused before its weights download.
"""

from __future__ import annotations

import glob
import os
from collections.abc import Callable

ALLOW_PATTERNS = ["model*.safetensors", "*.json", "tokenizer.model", "*.tiktoken", "*.txt", "*.jinja"]


class CheckpointError(RuntimeError):
    """A checkpoint cannot be found, resolved or read; the message names the thing at fault."""


def _offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "0").upper() in ("1", "TRUE", "YES", "ON")


def resolve(repo_or_dir: str, revision: str | None = None, check: Callable[[str], None] | None = None) -> str:
    """Absolute local directory holding the checkpoint ``repo_or_dir`` (a directory, or a hub repo id).

    ``revision`` (a branch, tag or commit) applies to hub repo ids only; given with a local directory
    it is an error rather than silently ignored. ``check(directory)``, when given, runs on the
    directory holding a hub repo's ``config.json`` before the rest of the repo is downloaded, and
    raises to refuse it; a local directory is returned as is (the caller reads its config anyway).
    """
    path = os.path.expanduser(str(repo_or_dir))
    if os.path.isdir(path):
        if revision is not None:
            raise CheckpointError(f"revision={revision!r} was given for the local directory {repo_or_dir!r}; "
                                  "revisions apply to hub repo ids only")
        return os.path.abspath(path)
    if os.path.exists(path):
        raise CheckpointError(f"{repo_or_dir!r} is a file; give the checkpoint's directory or a hub repo id")
    if path.startswith((".", "/", "~")) or path.count("/") > 1:
        raise CheckpointError(f"checkpoint directory {repo_or_dir!r} does not exist")
    try:
        import huggingface_hub as hub
        from huggingface_hub.errors import (
            EntryNotFoundError,
            GatedRepoError,
            HFValidationError,
            LocalEntryNotFoundError,
            RepositoryNotFoundError,
            RevisionNotFoundError,
        )
    except ImportError as e:  # pragma: no cover - huggingface_hub is a dependency
        raise CheckpointError(f"cannot resolve hub repo id {repo_or_dir!r}: huggingface_hub is missing") from e
    repo = repr(repo_or_dir) + (f" at revision {revision!r}" if revision is not None else "")
    nor = f" (nor is there a local directory {repo_or_dir!r})"  # a mistyped relative path lands here too
    try:
        if check is not None:
            check(os.path.dirname(hub.hf_hub_download(repo_id=path, filename="config.json", revision=revision)))
        return os.path.abspath(hub.snapshot_download(repo_id=path, revision=revision, allow_patterns=ALLOW_PATTERNS))
    except HFValidationError as e:
        raise CheckpointError(f"{repo_or_dir!r} is neither an existing directory nor a valid hub repo id") from e
    except (RepositoryNotFoundError, GatedRepoError) as e:
        raise CheckpointError(f"hub repo {repo_or_dir!r} was not found or is not accessible{nor}: {e}") from e
    except RevisionNotFoundError as e:
        raise CheckpointError(f"hub repo {repo_or_dir!r} has no revision {revision!r}") from e
    except LocalEntryNotFoundError as e:
        where = "the local HF cache" + (" (which may hold other revisions of it)" if revision is not None else "")
        state = (f"this machine is offline (HF_HUB_OFFLINE is set) and it is not in {where}" if _offline()
                 else f"the hub could not be reached and it is not in {where}")
        raise CheckpointError(f"cannot resolve hub repo {repo}{nor}: {state}") from e
    except EntryNotFoundError as e:  # after its subclass LocalEntryNotFoundError
        raise CheckpointError(f"hub repo {repo} has no config.json") from e
    except OSError as e:
        raise CheckpointError(f"cannot resolve hub repo {repo}{nor}: the hub could not be reached ({e})") from e


def safetensors_files(directory: str) -> list[str]:
    """The checkpoint's ``model*.safetensors`` files (the names transformers reads; other layouts such as
    ``consolidated.safetensors`` are not HF checkpoints); refuses pickled-only checkpoints without reading them."""
    files = sorted(glob.glob(os.path.join(directory, "model*.safetensors")))
    if files:
        return files
    pickled = [os.path.basename(p) for ext in ("*.bin", "*.pt", "*.pth", "*.ckpt")
               for p in glob.glob(os.path.join(directory, ext))]
    others = sorted(os.path.basename(p) for p in glob.glob(os.path.join(directory, "*.safetensors")))
    unread = f"; {', '.join(others[:3])} is not a model*.safetensors name, which transformers does not read either" \
        if others else ""
    if pickled:
        raise CheckpointError(f"{directory} holds no model*.safetensors weights, only pickled ones "
                              f"({', '.join(sorted(pickled)[:3])}): ligermodels never unpickles checkpoints, "
                              f"convert them to safetensors first{unread}")
    raise CheckpointError(f"{directory} holds no model*.safetensors weights{unread}")
