"""Coroutines that wait for a change another thread makes, without polling.

The local engine decodes in a worker thread; the calls that cannot run yet (another call's loop with other sampling
settings runs, or the engine is paused for a weight update) wait on their own event loops. Polling each one every few
milliseconds costs the event loop (and, under the GIL, the decoding thread) a wake-up per waiting call per tick;
a :class:`Wakeup` wakes them once, when the state they wait on changed.
"""
from __future__ import annotations

import asyncio
import threading
import time
from typing import Callable, TypeVar

T = TypeVar("T")


def _wake(fut: asyncio.Future) -> None:
    if not fut.done():
        fut.set_result(None)


class Wakeup:
    """A broadcast wake-up for coroutines on any event loop, sent from any thread.

    A waiter arms (:meth:`arm`) before it checks its condition, so a :meth:`notify` that lands between the check
    and the wait is not lost, then waits (:meth:`wait`); :meth:`until` does both in a loop. The side that changes the
    state calls :meth:`notify` after the change.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._armed: dict[asyncio.Future, asyncio.AbstractEventLoop] = {}

    def arm(self) -> asyncio.Future:
        """A future of the running loop that the next :meth:`notify` completes."""
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        with self._lock:
            self._armed[fut] = loop
        return fut

    def disarm(self, fut: asyncio.Future) -> None:
        """Forget an armed future (its waiter does not wait after all)."""
        with self._lock:
            self._armed.pop(fut, None)

    async def wait(self, fut: asyncio.Future, timeout_s: float) -> bool:
        """Wait for the :meth:`notify` after ``fut`` was armed, at most ``timeout_s`` seconds; whether it came. The
        caller checks its condition again either way."""
        try:
            done, _ = await asyncio.wait({fut}, timeout=max(0.0, timeout_s))
            return bool(done)
        finally:
            self.disarm(fut)

    async def until(self, attempt: Callable[[], T | None], timeout_s: float | None = None,
                    recheck_s: float = 1.0) -> T:
        """Call ``attempt`` until it returns something other than None, and return that; between two attempts wait
        for a :meth:`notify` (armed before each attempt, so a change made between the attempt and the wait is not
        lost), at most ``recheck_s`` seconds (a re-check that only guards against a notify the caller forgot).
        TimeoutError after ``timeout_s`` (None: no limit)."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while True:
            armed = self.arm()
            got = attempt()
            left = recheck_s if deadline is None else min(recheck_s, deadline - time.monotonic())
            if got is not None or left <= 0:
                self.disarm(armed)
                if got is not None:
                    return got
                raise TimeoutError(f"not ready within {timeout_s:g}s")
            await self.wait(armed, left)

    def notify(self) -> None:
        """Wake every armed waiter (thread-safe)."""
        with self._lock:
            armed, self._armed = self._armed, {}
        for fut, loop in armed.items():
            try:
                loop.call_soon_threadsafe(_wake, fut)
            except RuntimeError:  # its loop closed: nobody waits on it any more
                pass

    def armed(self) -> int:
        """Waiters armed now."""
        with self._lock:
            return len(self._armed)
