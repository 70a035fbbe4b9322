"""Command line: ``python -m ligermodels.verify DIR_OR_REPO [--dtype fp32] [--device DEV] [--revision R] [--tol T]``.

Loads the checkpoint with ligermodels and, when transformers is installed, with transformers too
(eager attention, :mod:`checkpoints_tools.verify`), runs both on the same random tokens and prints the
relative error of the logits. Exits 1 (with a FAIL line on stderr) when that error exceeds ``--tol``
(default by dtype, :data:`checkpoints_tools.verify.DEFAULT_TOL`), 2 (with an ``error:`` line) when the check
could not run (no such checkpoint, an unsupported or unreadable one, a bad argument), 0 otherwise (also when
transformers is missing and only the load was checked).
"""

from __future__ import annotations

import argparse
import importlib.util
import sys

import torch

from checkpoints_tools import CheckpointError, to_dtype
from checkpoints_tools.safetensors_io import DTYPES
from checkpoints_tools.verify import DEFAULT_TOL, REFERENCE_ATTENTION, reference_logits, relative_error
from ligermodels.cli import environment_error, print_error
from ligermodels.families import UnsupportedConfigError
from ligermodels.hf_io import load_hf


def verify(repo_or_dir: str, dtype: str = "fp32", device: str = "cpu", seq: int = 32, batch: int = 2,
           revision: str | None = None) -> float | None:
    """Relative error ||ours - transformers|| / ||transformers|| of the logits on random tokens (B, S) =
    (``batch``, ``seq``), or None without transformers."""
    dt = to_dtype(dtype)
    ours = load_hf(repo_or_dir, dtype=dt, device=device, revision=revision)  # a repo's config is checked first
    directory = ours.source_dir
    print(f"ligermodels: loaded {type(ours).__name__} ({sum(p.numel() for p in ours.parameters()) / 1e6:.1f}M "
          f"parameters, {dt}) from {directory}")
    ids = torch.randint(0, ours.config.vocab_size, (batch, seq), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        logits = ours(ids.to(device)).double().cpu()
    if importlib.util.find_spec("transformers") is None:
        print("transformers is not installed: only the ligermodels load was checked")
        return None
    ref, version = reference_logits(directory, ids, dt, device)
    err = relative_error(logits, ref)
    print(f"logits relative error vs transformers {version} ({REFERENCE_ATTENTION} attention): {err:.3e}")
    return err


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m ligermodels.verify", description=__doc__.split("\n\n")[1])
    ap.add_argument("model", help="checkpoint directory or hub repo id")
    ap.add_argument("--dtype", default="fp32", choices=sorted(DTYPES))
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--revision", default=None)
    ap.add_argument("--tol", type=float, default=None,
                    help="largest relative logit error that passes (exit 1 above it); default by dtype: "
                         + ", ".join(f"{str(k).removeprefix('torch.')} {t:g}" for k, t in DEFAULT_TOL.items()))
    args = ap.parse_args(argv)
    tol = args.tol if args.tol is not None else DEFAULT_TOL[to_dtype(args.dtype)]
    try:
        device = torch.device(args.device)
    except RuntimeError:
        device = None
    if device is None or device.type not in ("cpu", "cuda"):
        print_error(f"--device {args.device!r}: use cpu or cuda (cuda:N)")
        return 2
    if device.type == "cuda" and not (torch.cuda.is_available() and (device.index or 0) < torch.cuda.device_count()):
        print_error(f"--device {args.device!r}, but no such CUDA device is visible")
        return 2
    try:
        err = verify(args.model, args.dtype, args.device, revision=args.revision)
    except (CheckpointError, UnsupportedConfigError, ValueError) as e:
        print_error(str(e))
        return 2
    except (ImportError, OSError, torch.OutOfMemoryError) as e:
        print_error(environment_error(e))
        return 2
    if err is None:
        return 0
    if not err <= tol:  # NaN fails too
        print(f"FAIL: the relative error {err:.3e} exceeds the tolerance {tol:g}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
