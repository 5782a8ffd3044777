"""`python -m tinygpt` and the `tinygpt` command. Ctrl-C while the command starts (its imports, its
parser: nothing is made yet) is "interrupted" and exit 130 at once, not a traceback from inside an
import; `cli.main` hands SIGINT back to Python once the command line is parsed, so from there an
interruption unwinds and removes what the command had begun."""

import os
import signal
import sys

from tinygpt.core.signals import (
    interrupted_at_start,  # the package's and core's __init__: docstrings
)


def run() -> int:
    signal.signal(signal.SIGINT, interrupted_at_start)
    from tinygpt.cli import main

    code = main()
    if code == 130:  # interrupted, and said so: exit with that status, as it is, with nothing more
        # (twice in some 30 tries under load the interpreter still ended by SIGINT, status -2, after
        # "interrupted"; what was left to do is done: the command unwound and cleaned up)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(130)
    return code


if __name__ == "__main__":
    raise SystemExit(run())
