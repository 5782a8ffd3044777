"""A few lines that must run whole: SIGINT and SIGTERM held back until they end
(`signals_deferred`), as when a run folder's lock is taken and recorded (core.runlock)."""

from __future__ import annotations

import contextlib
import os
import signal
import threading
from typing import Iterator


def interrupted_at_start(signum, frame) -> None:
    """SIGINT while the `tinygpt` command starts (`tinygpt.__main__`), before it has made anything:
    one line and exit 130, with no traceback from whatever import it came in."""
    os.write(2, b"interrupted\n")
    os._exit(130)


@contextlib.contextmanager
def signals_deferred() -> Iterator[None]:
    """SIGINT and SIGTERM that arrive inside the block are delivered, to the handlers they would
    have reached, when it ends: a few lines that must run whole (take a lock and record it) are
    never cut in half by a KeyboardInterrupt. Python runs signal handlers in the main thread only,
    so elsewhere there is nothing to defer."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    arrived: list[int] = []
    # all restored, however it ends; a handler set outside Python (getsignal: None) is left alone
    kept = {s: h for s in (signal.SIGINT, signal.SIGTERM) if (h := signal.getsignal(s)) is not None}
    try:
        for s in kept:
            signal.signal(s, lambda signum, frame: arrived.append(signum))
        yield
    finally:
        for s, handler in kept.items():
            signal.signal(s, handler)
        for s in dict.fromkeys(arrived):
            signal.raise_signal(s)
