"""A pool of sandboxes over any :class:`~env_controller.sandbox.base.SandboxBackend`: a cap on how many live at once,
some started ahead of demand, and none left behind.

::

    pool = SandboxPool(backend, PoolOptions(max_containers=100, warm_containers="2:16"))
    box = pool.acquire(labels={"agentrl.index": "7"})   # a warm sandbox, or a new one; waits at the max
    ...
    pool.release(box, reusable=True)                      # wiped and kept (reuse=True), else removed
    pool.close()                                          # removes every sandbox of the pool

Every sandbox of the pool is in one state: *starting*, *idle* (warm, ready for the next session), *leased* (a
session holds it), *resetting* (being wiped for reuse) or *removing*; all of them count against ``max_containers``.
:meth:`SandboxPool.acquire` takes an idle sandbox, else starts one (a *cold* start), else, at ``max_containers``,
waits until one frees and raises :class:`PoolExhaustedError` after ``acquire_timeout_s``. At most ``max_starting``
sandboxes start at once (cold starts first), so a burst of sessions queues instead of crowding the engine.

A background thread keeps ``warm_target`` sandboxes idle: the number of acquisitions over the last ``warm_window_s``
seconds, clamped to the ``warm_containers`` bounds (and to the room under ``max_containers``); it starts what is
missing. The target rises at once and falls slowly: it is the most demand seen over the last ``shrink_after_s`` (by
default 5 x ``warm_window_s``), as an autoscaler's scale-down stabilization window does. Idle sandboxes above the
target are removed once they have waited ``shrink_after_s`` unused (beyond ``warm_max``, at once): with reuse, a
burst's sandboxes (an RL step's episodes every minute or two) come back wiped after the pool refilled itself during
the burst, and serve the next burst instead of being removed and started again. Every ``sweep_interval_s`` it also
asks the backend to remove what it made and no sandbox holds any more (a removal the engine failed), when the
backend can (``sweep(min_age_s)``). The sandboxes of owners that died (a worker killed with ``kill -9``) are the
backend's to remove when it starts, not the pool's: every worker of a host sweeping them at once would ask the
engine to remove each one several times over.

:meth:`SandboxPool.release` removes the sandbox, unless the pool allows reuse (``reuse_containers``) and the caller
says it may be reused: then it is wiped (:meth:`~env_controller.sandbox.base.Sandbox.wipe`: processes killed, files
deleted, a fresh shell) and goes back to the idle ones; a wipe that fails removes it. A warm sandbox was started
before its session was known, so it carries the pool's ``labels`` only; a cold one carries those given to
:meth:`~SandboxPool.acquire` as well.
"""
from __future__ import annotations

import logging
import math
import threading
import time
from collections import deque
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Protocol, runtime_checkable

from env_controller.sandbox.base import Sandbox, SandboxBackend, SandboxError, SandboxLimits
from env_controller.sandbox.options import PoolOptions

logger = logging.getLogger(__name__)

#: what the backend made this recently may still be starting: a sweep leaves it alone
SWEEP_MIN_AGE_S = 120.0
#: acquisition times kept per kind (warm / cold) for the latency percentiles of :meth:`SandboxPool.stats`
LATENCY_SAMPLES = 4096


class PoolBudget:
    """A cap on the sandboxes of several pools together (e.g. one pool per image, one budget per worker).

    Every sandbox a pool counts as live holds one unit. A session that cannot take a unit waits as the
    budget's (:meth:`want` until :meth:`unwant`); pools with idle sandboxes give one up for each waiting
    session on their next refill tick (warm sandboxes of an image nobody asks for make room for one that
    is asked for), and never start warm ones while sessions wait.
    """

    def __init__(self, max_live: int) -> None:
        """``max_live``: sandboxes of all its pools live at once (ValueError when not a positive integer)."""
        if isinstance(max_live, bool) or not isinstance(max_live, int) or max_live < 1:
            raise ValueError(f"PoolBudget: max_live={max_live!r} must be a positive integer")
        self.max_live = max_live
        self._lock = threading.Lock()
        self._used = 0
        self._wanted = 0  # sessions waiting for a unit
        self._claimed = 0  # idle sandboxes being given up for them (at most one per waiting session)
        self._peak = 0

    def take(self, n: int = 1, urgent: bool = False) -> int:
        """Take up to ``n`` units; how many were granted. Not ``urgent`` (a warm start): none while sessions
        wait, so a unit freed for a waiting session goes to a session."""
        with self._lock:
            if not urgent and self._wanted:
                return 0
            granted = max(0, min(n, self.max_live - self._used))
            self._used += granted
            self._peak = max(self._peak, self._used)
            return granted

    def want(self) -> None:
        """A session starts waiting for a unit (once per session, however often it retries :meth:`take`):
        a pool with an idle sandbox gives one up for it."""
        with self._lock:
            self._wanted += 1

    def unwant(self) -> None:
        """A session of :meth:`want` stops waiting (it got a unit, timed out, or its pool closed)."""
        with self._lock:
            self._wanted = max(0, self._wanted - 1)
            self._claimed = min(self._claimed, self._wanted)

    def give(self, n: int = 1) -> None:
        """Return ``n`` units (a sandbox removed, a start that failed)."""
        with self._lock:
            self._used = max(0, self._used - n)

    def claim_pressure(self) -> bool:
        """Whether some waiting session has no idle sandbox given up for it yet (and this caller will give up
        one for it). One per session: a count of its retries instead gave up every idle sandbox of the other
        pools for a single session (the test of an image's session under a cap filled by another's)."""
        with self._lock:
            if self._claimed >= self._wanted:
                return False
            self._claimed += 1
            return True

    @property
    def short(self) -> bool:
        """Whether sessions are waiting for units, or none is left (pools start no warm sandboxes then)."""
        with self._lock:
            return self._wanted > 0 or self._used >= self.max_live

    def stats(self) -> dict[str, int]:
        """``max``, ``used`` (units held: live sandboxes of all pools), ``peak``, ``waiting`` (sessions waiting
        for a unit) and ``pressure`` (those of them no idle sandbox is being given up for yet)."""
        with self._lock:
            return {"max": self.max_live, "used": self._used, "peak": self._peak, "waiting": self._wanted,
                    "pressure": self._wanted - self._claimed}


class PoolExhaustedError(SandboxError):
    """No sandbox freed within the acquire timeout: the pool is at its maximum."""


@runtime_checkable
class PooledTask(Protocol):
    """A task whose sessions take sandboxes from a :class:`SandboxPool` (the worker server asks for it)."""

    #: the most sandboxes the task may hold live at once, None when unbounded
    max_containers: int | None

    def sandbox_pool(self) -> "SandboxPool":
        """The task's pool, started (and the backend's leaked sandboxes reaped) on the first call; blocking."""


def _percentiles(values: deque[float]) -> dict[str, float | int | None]:
    """``n``, ``p50`` and ``p99`` (nearest rank, seconds) of ``values``."""
    ordered = sorted(values)
    if not ordered:
        return {"n": 0, "p50": None, "p99": None}

    def rank(q: float) -> float:
        return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))]

    return {"n": len(ordered), "p50": round(rank(0.5), 4), "p99": round(rank(0.99), 4)}


class SandboxPool:
    """Sandboxes of one backend and one set of limits (see the module docstring).

    options: the cap, warm target, reuse and pace (:class:`~env_controller.sandbox.options.PoolOptions`).
    limits / labels: given to every ``backend.create``. limit_hint: how the error of a timed-out acquire names the
    setting to raise. budget: a :class:`PoolBudget` shared with other pools (a cap on them all together), or None.
    """

    def __init__(self, backend: SandboxBackend, options: PoolOptions | None = None, *,
                 limits: SandboxLimits | None = None, labels: Mapping[str, str] | None = None,
                 limit_hint: str = "the pool's max_containers", budget: PoolBudget | None = None) -> None:
        """Start the refill thread."""
        options = options if options is not None else PoolOptions()
        self.options = options
        self.backend = backend
        self.max_size = options.max_containers
        self.warm_min, self.warm_max = options.warm_bounds
        self.window_s = float(options.warm_window_s)
        self.shrink_after_s = float(5 * options.warm_window_s if options.shrink_after_s is None
                                    else options.shrink_after_s)
        self.reuse = options.reuse_containers
        self.limits = limits
        self.labels = dict(labels or {})
        self.acquire_timeout_s = float(options.acquire_timeout_s)
        self.max_starting = options.max_starting
        self.sweep_interval_s = float(options.sweep_interval_s)
        self.refill_interval_s = float(options.refill_interval_s)
        self.limit_hint = limit_hint
        self.budget = budget
        max_size, warm_min, max_starting = self.max_size, self.warm_min, self.max_starting
        self._cap = math.inf if max_size is None else max_size
        self._cond = threading.Condition()
        self._idle: deque[Sandbox] = deque()  # oldest idle first: acquire takes from the left
        self._idle_since: dict[str, float] = {}  # sandbox id -> when it became idle (monotonic)
        self._leased: dict[str, Sandbox] = {}
        self._starting = 0  # cold and warm starts in flight
        self._starting_warm = 0
        self._cold_queued = 0  # cold starts waiting for, or holding, a start slot
        self._resetting = 0
        self._removing = 0
        self._waiting = 0
        self._demand: deque[float] = deque()
        self._peaks: deque[tuple[float, int]] = deque()  # (time, demand), demand falling: the window's maximum first
        self._target = warm_min
        self._closed = False
        self._retry_at = 0.0  # after a failed warm start, no new one before this
        self._failures_in_row = 0
        self._latency = {"warm": deque(maxlen=LATENCY_SAMPLES), "cold": deque(maxlen=LATENCY_SAMPLES)}
        self._start_latency: deque[float] = deque(maxlen=LATENCY_SAMPLES)  # backend.create alone
        self._counts = dict.fromkeys(("created", "removed", "create_failures", "acquired", "served_warm",
                                      "served_cold", "reused", "wipe_failures", "waited", "timeouts", "swept"), 0)
        self._peak = 0
        # start slots: the engine starts containers at a fixed rate, more at once only queue inside it
        self._start_slots = threading.Semaphore(max_starting)
        self._warm_starter = ThreadPoolExecutor(max_starting, thread_name_prefix="agentrl-pool-start")
        self._remover = ThreadPoolExecutor(max_starting, thread_name_prefix="agentrl-pool-remove")
        self._thread = threading.Thread(target=self._refill_loop, name="agentrl-pool-refill", daemon=True)
        self._thread.start()

    # -- counts ----------------------------------------------------------------------------------

    def _live(self) -> int:
        """Sandboxes in every state (call with the lock held)."""
        return len(self._idle) + len(self._leased) + self._starting + self._resetting + self._removing

    def _changed(self) -> None:
        """Note the peak and wake waiters and the refill thread (call with the lock held)."""
        self._peak = max(self._peak, self._live())
        self._cond.notify_all()

    def stats(self) -> dict[str, Any]:
        """The pool's state and counters since it started (for ``/api/worker_status`` and metrics).

        ``live`` = ``leased`` + ``idle`` + ``starting`` + ``resetting`` + ``removing`` (at most ``max``);
        ``acquire_s``: seconds to get a sandbox, warm (served idle) and cold (started for the caller),
        over the last acquisitions; ``start_s``: seconds the backend took to start one (warm or cold).
        """
        with self._cond:
            return {
                "backend": self.backend.name, "max": self.max_size, "warm_min": self.warm_min,
                "warm_max": self.warm_max, "warm_target": self._target, "reuse": self.reuse,
                "live": self._live(), "peak_live": self._peak, "leased": len(self._leased), "idle": len(self._idle),
                "starting": self._starting, "resetting": self._resetting, "removing": self._removing,
                "waiting": self._waiting, **self._counts,
                "acquire_s": {kind: _percentiles(v) for kind, v in self._latency.items()},
                "start_s": _percentiles(self._start_latency),
            }

    # -- acquire / release -----------------------------------------------------------------------

    def acquire(self, labels: Mapping[str, str] | None = None, timeout_s: float | None = None) -> Sandbox:
        """A sandbox for one session: an idle one, else a new one (``labels`` added to the pool's).

        At the maximum, waits up to ``timeout_s`` (default ``acquire_timeout_s``) for one to free and then
        raises :class:`PoolExhaustedError` naming the setting to raise; SandboxError when a start fails,
        RuntimeError once the pool is closed.
        """
        t0 = time.monotonic()
        deadline = t0 + (self.acquire_timeout_s if timeout_s is None else float(timeout_s))
        box: Sandbox | None = None
        with self._cond:
            self._demand.append(t0)
            self._counts["acquired"] += 1
            waited = False
            wanting = False  # this session waits as the budget's (its cap, not the pool's own, is reached)
            try:
                while True:
                    if self._closed:
                        raise RuntimeError("the sandbox pool is closed")
                    while self._idle and box is None:
                        candidate = self._idle.popleft()
                        self._idle_since.pop(candidate.id, None)
                        if not candidate.closed:  # one closed while idle just frees its slot
                            box = candidate
                        else:
                            self._give(1)
                    if box is not None:
                        self._leased[box.id] = box
                        break
                    if self._live() < self._cap and (self.budget is None or self.budget.take(1, urgent=True)):
                        self._starting += 1
                        self._cold_queued += 1
                        break
                    if self.budget is not None and not wanting and self._live() < self._cap:
                        wanting = True
                        self.budget.want()
                    left = deadline - time.monotonic()
                    if left <= 0:
                        self._counts["timeouts"] += 1
                        raise PoolExhaustedError(self._exhausted_message(time.monotonic() - t0))
                    if not waited:
                        waited = True
                        self._counts["waited"] += 1
                    self._waiting += 1
                    try:
                        # another pool's removal frees a unit of the budget without waking this pool
                        self._cond.wait(left if self.budget is None else min(left, 0.2))
                    finally:
                        self._waiting -= 1
            finally:
                if wanting and self.budget is not None:
                    self.budget.unwant()
            self._changed()
        kind = "warm" if box is not None else "cold"
        if box is None:
            box = self._start_cold(labels)
        with self._cond:
            self._counts["served_" + kind] += 1
            self._latency[kind].append(time.monotonic() - t0)
        return box

    def _exhausted_message(self, waited_s: float) -> str:
        mine = (f"{len(self._leased)} held by sessions, {self._starting} starting, {self._resetting} being wiped, "
                f"{self._removing} being removed")
        if self.budget is not None and self._live() < self._cap:
            # the cap that was hit is the budget's, shared with other pools (e.g. other images): this pool's
            # counts alone would not add up to it, so say how many the others hold
            budget = self.budget.stats()
            where = (f"all {budget['max']} allowed by {self.limit_hint} are live over all pools "
                     f"({budget['used']} units used; this pool: {mine}, {len(self._idle)} idle)")
        else:
            where = f"all {self.max_size} allowed by {self.limit_hint} are live ({mine})"
        return (f"no sandbox became free within {waited_s:.0f} s: {where}; raise {self.limit_hint}, or "
                "send fewer sessions at once (a worker's --concurrency at most its --max-containers)")

    def _start_cold(self, labels: Mapping[str, str] | None) -> Sandbox:
        """Start a sandbox for the caller of :meth:`acquire` (its slot is already counted in ``starting``)."""
        try:
            with self._start_slots:
                t0 = time.monotonic()
                box = self.backend.create(self.limits, {**self.labels, **(labels or {})})
        except BaseException:
            with self._cond:
                self._starting -= 1
                self._cold_queued -= 1
                self._counts["create_failures"] += 1
                self._give(1)
                self._changed()
            raise
        with self._cond:
            self._start_latency.append(time.monotonic() - t0)
            self._starting -= 1
            self._cold_queued -= 1
            self._counts["created"] += 1
            closed = self._closed
            if not closed:
                self._leased[box.id] = box
            self._changed()
        if closed:
            self._close_box(box)
            with self._cond:
                self._give(1)
            raise RuntimeError("the sandbox pool is closed")
        return box

    def _give(self, n: int) -> None:
        """Return ``n`` units to the budget, if any (call with the lock held)."""
        if self.budget is not None and n:
            self.budget.give(n)

    def release(self, box: Sandbox, reusable: bool = False) -> None:
        """Give back a sandbox from :meth:`acquire` (blocking): wiped and kept idle when the pool allows
        reuse and ``reusable``, else removed. Safe to call more than once."""
        with self._cond:
            if self._leased.pop(box.id, None) is None:
                return
            keep = self.reuse and reusable and not self._closed and not box.closed
            if keep:
                self._resetting += 1
            else:
                self._removing += 1
        if keep:
            try:
                box.wipe()
                wiped = True
            except Exception as exc:  # noqa: BLE001 - a sandbox that cannot be wiped is removed, never reused
                logger.warning("sandbox %s: not reused, the wipe failed: %s", box.id, exc)
                wiped = False
            with self._cond:
                self._resetting -= 1
                if wiped and not self._closed:
                    self._idle.append(box)
                    self._idle_since[box.id] = time.monotonic()
                    self._counts["reused"] += 1
                    self._changed()
                    return
                if not wiped:
                    self._counts["wipe_failures"] += 1
                self._removing += 1
        self._remove(box)

    def _remove(self, box: Sandbox) -> None:
        """Close ``box``, whose slot is counted in ``removing``."""
        try:
            self._close_box(box)
        finally:
            with self._cond:
                self._removing -= 1
                self._counts["removed"] += 1
                self._give(1)
                self._changed()

    @staticmethod
    def _close_box(box: Sandbox) -> None:
        try:
            box.close()
        except Exception:  # noqa: BLE001 - the backend logged it; the slot is free either way
            logger.exception("closing sandbox %s failed", box.id)

    # -- the refill thread -----------------------------------------------------------------------

    def _plan(self, now: float) -> tuple[list[Sandbox], int]:
        """Under the lock: the idle sandboxes to remove and the number of warm starts to begin."""
        while self._demand and self._demand[0] < now - self.window_s:
            self._demand.popleft()
        demand, peaks = len(self._demand), self._peaks
        while peaks and peaks[-1][1] <= demand:
            peaks.pop()
        peaks.append((now, demand))
        while peaks[0][0] < now - self.shrink_after_s:
            peaks.popleft()
        room = self._cap - len(self._leased) - self._resetting - self._removing - self._starting + self._starting_warm
        target = int(min(max(peaks[0][1], self.warm_min), self.warm_max, max(0, room)))
        self._target = target
        # idle sandboxes above the target go beyond warm_max at once, and otherwise once they have waited
        # shrink_after_s unused (oldest first): a burst's sandboxes, wiped and back after the pool refilled
        # itself during the burst, serve the next burst instead of being removed and started again
        drop: list[Sandbox] = []
        excess, over_max = len(self._idle) - target, len(self._idle) - self.warm_max
        while excess > 0 and (over_max > 0 or now - self._idle_since.get(self._idle[0].id, now)
                              >= self.shrink_after_s):
            drop.append(self._idle.popleft())
            excess, over_max = excess - 1, over_max - 1
        # a session of another pool of the budget waits: an idle sandbox here makes room for it
        while self.budget is not None and self._idle and self.budget.claim_pressure():
            drop.append(self._idle.pop())
        for box in drop:
            self._idle_since.pop(box.id, None)
        self._removing += len(drop)
        need = target - len(self._idle) - self._starting_warm
        # sessions waiting, or cold starts queued for a slot, come first (this pool's, or the budget's)
        if (need <= 0 or self._waiting or self._cold_queued or now < self._retry_at
                or (self.budget is not None and self.budget.short)):
            return drop, 0
        n = int(min(need, self._cap - self._live(), self.max_starting - self._starting_warm))
        if n > 0 and self.budget is not None:
            n = self.budget.take(n)
        if n > 0:
            self._starting += n
            self._starting_warm += n
            self._changed()
        return drop, max(0, n)

    def _refill_loop(self) -> None:
        next_sweep = time.monotonic() + self.sweep_interval_s
        while True:
            with self._cond:
                if self._closed:
                    return
                now = time.monotonic()
                drop, n = self._plan(now)
            for box in drop:
                self._remover.submit(self._remove, box)
            for _ in range(n):
                self._warm_starter.submit(self._start_warm)
            if self.sweep_interval_s and time.monotonic() >= next_sweep:
                next_sweep = time.monotonic() + self.sweep_interval_s
                self._sweep()
            with self._cond:
                if self._closed:
                    return
                self._cond.wait(self.refill_interval_s)

    def _start_warm(self) -> None:
        """Start one idle sandbox (its slot is already counted in ``starting``)."""
        box: Sandbox | None = None
        t0 = 0.0
        try:
            with self._start_slots:
                if not self._closed:
                    t0 = time.monotonic()
                    box = self.backend.create(self.limits, self.labels)
        except Exception as exc:  # noqa: BLE001 - a failed warm start is retried with backoff, never raised
            with self._cond:
                self._counts["create_failures"] += 1
                self._failures_in_row += 1
                delay = min(30.0, 0.5 * 2 ** self._failures_in_row)
                self._retry_at = time.monotonic() + delay
            logger.warning("starting a warm sandbox failed (retrying in %.0f s): %s", delay, exc)
        with self._cond:
            self._starting -= 1
            self._starting_warm -= 1
            if box is not None:
                self._start_latency.append(time.monotonic() - t0)
                self._counts["created"] += 1
                self._failures_in_row = 0
                if not self._closed:
                    self._idle.append(box)
                    self._idle_since[box.id] = time.monotonic()
                    box = None
            else:
                self._give(1)
            self._changed()
        if box is not None:  # the pool closed while it started
            self._close_box(box)
            with self._cond:
                self._give(1)

    def _sweep(self) -> None:
        sweep = getattr(self.backend, "sweep", None)
        if not callable(sweep):
            return
        try:
            swept = sweep(min_age_s=SWEEP_MIN_AGE_S)
        except Exception:  # noqa: BLE001 - a sweep is best effort; the next one (or close) tries again
            logger.exception("sweeping the backend's orphans failed")
            return
        if swept:
            with self._cond:
                self._counts["swept"] += len(swept)

    # -- closing ---------------------------------------------------------------------------------

    def close(self) -> None:
        """Stop the refill thread and remove every sandbox of the pool, idle and leased; safe to call twice."""
        with self._cond:
            if self._closed:
                return
            self._closed = True
            boxes = list(self._idle) + list(self._leased.values())
            self._idle.clear()
            self._idle_since.clear()
            self._leased.clear()
            self._removing += len(boxes)
            self._cond.notify_all()
        self._thread.join()
        self._warm_starter.shutdown(wait=True)  # a start in flight removes its sandbox itself
        for box in boxes:
            self._remover.submit(self._remove, box)
        self._remover.shutdown(wait=True)

    def __enter__(self) -> "SandboxPool":
        """Use as a context manager: closed on exit."""
        return self

    def __exit__(self, *exc: Any) -> None:
        """Close the pool."""
        self.close()
