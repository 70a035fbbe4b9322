"""What the command lines print for an error the user can cause: one ``error:`` line, no traceback.

Each command line catches its own input errors (bad data, an unsupported checkpoint, ...), whose
messages already name the thing at fault. :func:`environment_error` covers what any of them can
meet at run time: a package missing where the code needs it, the device out of memory, and the
file system refusing a read or write. Anything else is a bug and keeps its traceback.
"""

from __future__ import annotations

import sys

import torch

from ligermodels.dependencies import RUNTIME_DEPENDENCIES, missing_dependency_message


def environment_error(e: BaseException) -> str | None:
    """The ``error:`` message for ``e`` when it comes from the environment, else None."""
    if isinstance(e, ImportError):
        name = (e.name or "").split(".")[0]
        if not name:
            return f"{e}: install the missing package (pip install ...) and run again"
        return missing_dependency_message([RUNTIME_DEPENDENCIES.get(name, (name, ""))[0]])
    if isinstance(e, torch.OutOfMemoryError):
        return ("out of GPU memory: lower --batch-size (and raise --grad-accum to keep the global batch) or "
                "--seq-len, or pass --ac selective, --ac lean or --ac full, or --loss-strategy vocab (a loss head "
                "without an fp32 vocabulary x hidden gradient buffer)")
    if isinstance(e, OSError):
        return f"{e}: check that the path exists and is readable, writable, and that its disk has room"
    return None


def print_error(message: str, rank: int | None = None) -> None:
    """``error: message`` on stderr (``error: rank R: message`` for a rank other than 0)."""
    where = f"rank {rank}: " if rank else ""
    print(f"error: {where}{message}", file=sys.stderr, flush=True)
