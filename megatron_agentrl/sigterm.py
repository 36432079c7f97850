"""SIGTERM turned into an exception for the span of a call, so that the call's cleanup runs.

A scheduler's preemption or time limit, ``timeout`` and ``kill`` send SIGTERM; Python's default ends
the process at once, skipping ``finally`` blocks: env sessions left open, containers and partial
outputs left behind. Within :func:`sigterm_raises` the signal raises instead.
"""
from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Callable, Iterator


@contextlib.contextmanager
def sigterm_raises(make: Callable[[int], BaseException]) -> Iterator[None]:
    """Within the block, SIGTERM raises ``make(signum)`` in the main thread; the previous handler is
    restored after. In another thread (a Ray actor's, where only the main thread may set handlers)
    nothing changes."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum: int, frame: object) -> None:
        raise make(signum)

    previous = signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous if previous is not None else signal.SIG_DFL)
