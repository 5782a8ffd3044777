"""How a run stops: after the current step on a signal (`StopOnSignal`), and with every callback
closed however it ends (`closing`), without hiding the error that ended it."""

from __future__ import annotations

import contextlib
import signal
import threading
import warnings
from typing import Any, Iterable, Iterator

from tinygpt.core.callback import Callback


class StopOnSignal(Callback):
    """Ctrl-C or SIGTERM (Colab's stop button, a preempted VM) ends training after the current step,
    with a checkpoint, instead of killing it mid-write."""

    def __init__(self) -> None:
        self.received: str | None = None
        self._old: dict = {}

    def on_start(self, trainer: Any, resumed_from: int | None) -> None:
        if threading.current_thread() is not threading.main_thread():
            return  # only the main thread may install handlers

        def handler(signum, frame):
            self.received = signal.Signals(signum).name

        for s in (signal.SIGINT, signal.SIGTERM):
            self._old[s] = signal.signal(s, handler)

    def close(self) -> None:
        for s, h in self._old.items():
            signal.signal(s, h)
        self._old = {}


@contextlib.contextmanager
def closing(callbacks: Iterable[Callback]) -> Iterator[None]:
    """Close every callback when the block ends, each even when one before it fails. When the block
    raised, a callback's failing close is only a warning: it must not hide the error that ended the
    run (a TensorBoard writer whose folder was deleted would otherwise replace the one-line
    reason)."""
    try:
        yield
    except BaseException:
        for cb in callbacks:
            try:
                cb.close()
            except Exception as e:  # noqa: BLE001 - the first error is the one to tell
                warnings.warn(
                    f"{type(cb).__name__} could not close: {type(e).__name__}: {e}", stacklevel=3
                )
        raise
    first: Exception | None = None
    for cb in callbacks:
        try:
            cb.close()
        except Exception as e:  # noqa: BLE001 - close the rest, then raise the first
            first = first or e
    if first is not None:
        raise first
