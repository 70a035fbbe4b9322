"""``python -m ligermodels.train``: see :mod:`ligermodels.train` and ``--help``."""

import os
import sys

from ligermodels.train.loop import main


def exit_ranks_now() -> None:
    """End a process of a multi-rank run that finished (its files written and closed, the process group
    destroyed) without the interpreter's teardown.

    With several gloo ranks a rank was now and then killed by SIGABRT ("terminate called without an active
    exception") after ``main`` had returned, so a run that had written everything was reported failed (1 run
    in 22 of a 2-core stress loop, and in the test suite now and then; another 40-run loop did not show it).
    The likely cause is the process group's C++ threads meeting the interpreter's finalization, a race
    pytorch/pytorch#179291 describes; it is not proven. Nothing is left to do once ``main`` returns, so the
    process exits here with status 0 after flushing its output.
    """
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        exit_ranks_now()
