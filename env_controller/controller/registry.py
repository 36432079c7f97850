"""The controller's worker registry, fed by heartbeats.

A task worker registers (and stays registered) by POSTing ``{name, address, concurrency,
indices}`` to ``/api/receive_heartbeat`` every few seconds; ``(name, address)`` identifies it.
Each worker is in one of three states:

* ``alive``: heard from within ``suspect_after_s``; gets new sessions.
* ``suspect``: silent for more than ``suspect_after_s``, or a call to it failed to connect; gets
  no new sessions, keeps its open ones; a heartbeat makes it alive again.
* ``dead``: silent for more than ``dead_after_s`` (the heartbeat timeout); the controller ends its
  sessions with ``task error``. Time the controller itself spent stalled (its event loop behind,
  e.g. on a starved CPU) does not count as silence: heartbeats may have waited unread. A
  heartbeat revives it (as a fresh worker: its old sessions are gone); a dead worker is forgotten
  after ``forget_after_s``.

New sessions go to the least-loaded alive worker of the task (lowest open/concurrency, then
fewest open sessions, then the one picked least recently). All methods are synchronous and take
the current monotonic time from ``clock``, so the logic is testable without waiting.
"""
from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

logger = logging.getLogger(__name__)

Index = int | str


class WorkerState(str, Enum):
    """Health of a worker, as ``/api/list_workers`` reports it."""

    ALIVE = "alive"
    SUSPECT = "suspect"
    DEAD = "dead"


class RegistryError(ValueError):
    """A heartbeat the registry cannot accept (the message says why)."""


class NoWorkerError(LookupError):
    """No alive worker of the task has a free slot (the message says what there is)."""


@dataclass(eq=False)
class Worker:
    """One registered task worker.

    ``sessions`` holds the ids of the controller's open sessions on it (its load);
    ``cancelling`` the ids whose cancel call to the worker is still under way.
    """

    id: int
    name: str
    address: str
    concurrency: int
    registered_at: float
    last_heartbeat: float
    state: WorkerState = WorkerState.ALIVE
    reason: str = ""
    state_since: float = 0.0
    last_pick: int = 0
    heartbeats: int = 0
    stall_at_beat: float = 0.0
    sessions: set[int] = field(default_factory=set)
    cancelling: set[int] = field(default_factory=set)
    #: headers of the controller's calls to it (the token it registered with: kept out of repr and dumps)
    call_headers: dict[str, str] = field(default_factory=lambda: {"Content-Type": "application/json"}, repr=False)

    def set_token(self, token: str | None) -> None:
        """Send ``token`` (as a bearer token) on the controller's calls to this worker; None sends none."""
        if token:
            self.call_headers["Authorization"] = f"Bearer {token}"
        else:
            self.call_headers.pop("Authorization", None)

    @property
    def load(self) -> int:
        """Open sessions the controller placed on this worker."""
        return len(self.sessions)

    def describe(self) -> str:
        """``worker 3 (lookup @ http://127.0.0.1:5021/api)``."""
        return f"worker {self.id} ({self.name} @ {self.address})"

    def dump(self, now: float) -> dict[str, Any]:
        """The JSON form of ``/api/list_workers``."""
        return {
            "id": self.id,
            "name": self.name,
            "address": self.address,
            "concurrency": self.concurrency,
            "current": self.load,
            "state": self.state.value,
            "reason": self.reason,
            "last_heartbeat_s_ago": round(now - self.last_heartbeat, 3),
            "heartbeats": self.heartbeats,
            "registered_at": self.registered_at,
        }


@dataclass
class TaskEntry:
    """A task name, its sample indices (as its workers report them) and its workers by id."""

    name: str
    indices: list[Index]
    index_set: set[Index]
    workers: dict[int, Worker] = field(default_factory=dict)

    def has_index(self, index: Any) -> bool:
        """Whether ``index`` (int or str; never a bool) is one of the task's indices."""
        if isinstance(index, bool) or not isinstance(index, (int, str)):
            return False
        return index in self.index_set


def _indices_differ(a: list[Index], b: list[Index]) -> str:
    if len(a) != len(b):
        return f"{len(b)} indices instead of {len(a)}"
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y or type(x) is not type(y):
            return f"index #{i} is {y!r:.100} instead of {x!r:.100}"
    return ""


class WorkerRegistry:
    """Workers by task, their states, and the choice of a worker for a new session."""

    def __init__(
        self,
        suspect_after_s: float,
        dead_after_s: float,
        forget_after_s: float = 300.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """Timeouts in seconds since the last heartbeat: suspect, dead; forget a dead worker after
        ``forget_after_s``."""
        if not 0 < suspect_after_s < dead_after_s:
            raise ValueError(
                f"need 0 < suspect_after_s ({suspect_after_s}) < dead_after_s (heartbeat timeout, {dead_after_s})"
            )
        self.suspect_after_s = float(suspect_after_s)
        self.dead_after_s = float(dead_after_s)
        self.forget_after_s = float(forget_after_s)
        self.clock = clock
        self.tasks: dict[str, TaskEntry] = {}
        self.workers: dict[int, Worker] = {}
        self._by_address: dict[tuple[str, str], Worker] = {}
        self._ids = itertools.count(1)
        self._picks = itertools.count(1)
        #: seconds the controller itself was stalled (event loop behind); see :meth:`add_stall`
        self.stall = 0.0

    # -- heartbeats ------------------------------------------------------------------------------

    def heartbeat(self, name: str, address: str, concurrency: int, indices: list[Index]) -> tuple[Worker, str]:
        """Record a heartbeat; returns the worker and what happened: ``new``, ``revived``, ``recovered`` or ``beat``.

        Raises :class:`RegistryError` when the task is already served by live workers that report
        other indices (a worker of another version of the task).
        """
        now = self.clock()
        address = address.rstrip("/")
        entry = self.tasks.get(name)
        if entry is None:
            entry = self.tasks[name] = TaskEntry(name, list(indices), set(indices))
        elif entry.indices != indices:
            live = [w for w in entry.workers.values() if w.state is not WorkerState.DEAD and w.address != address]
            if live:
                raise RegistryError(
                    f"task {name!r} is already served by {len(live)} live worker(s) with other indices: "
                    f"{address} reports {_indices_differ(entry.indices, indices)}; run the same task "
                    f"version on every worker of {name!r}, or give this one another task name"
                )
            logger.info("task %s: indices replaced by those of %s (%d indices)", name, address, len(indices))
            entry.indices = list(indices)
            entry.index_set = set(indices)
        worker = self._by_address.get((name, address))
        event = "beat"
        if worker is None:
            worker = Worker(
                id=next(self._ids), name=name, address=address, concurrency=concurrency,
                registered_at=time.time(), last_heartbeat=now, state_since=now,
            )
            self.workers[worker.id] = worker
            self._by_address[(name, address)] = worker
            entry.workers[worker.id] = worker
            event = "new"
            logger.info("registered %s, concurrency %d, %d indices", worker.describe(), concurrency, len(indices))
        elif worker.state is WorkerState.DEAD:
            event = "revived"
            logger.warning(
                "%s is back after being declared dead (%s); its old sessions stay ended",
                worker.describe(),
                worker.reason,
            )
        elif worker.state is WorkerState.SUSPECT:
            event = "recovered"
            logger.info("%s is alive again (was suspect: %s)", worker.describe(), worker.reason)
        if worker.state is not WorkerState.ALIVE:
            self._set_state(worker, WorkerState.ALIVE, "", now)
        worker.last_heartbeat = now
        worker.stall_at_beat = self.stall
        worker.concurrency = concurrency
        worker.heartbeats += 1
        return worker, event

    # -- states ----------------------------------------------------------------------------------

    def _set_state(self, worker: Worker, state: WorkerState, reason: str, now: float) -> None:
        worker.state = state
        worker.reason = reason
        worker.state_since = now

    def mark_suspect(self, worker: Worker, reason: str) -> None:
        """An alive worker failed a call: no new sessions until its next heartbeat."""
        if worker.state is WorkerState.ALIVE:
            logger.warning("%s is suspect: %s", worker.describe(), reason)
            self._set_state(worker, WorkerState.SUSPECT, reason, self.clock())

    def mark_dead(self, worker: Worker, reason: str) -> None:
        """Declare ``worker`` dead now (its sessions are to be ended by the caller)."""
        if worker.state is not WorkerState.DEAD:
            logger.error("%s is dead: %s", worker.describe(), reason)
            self._set_state(worker, WorkerState.DEAD, reason, self.clock())

    def add_stall(self, seconds: float) -> None:
        """The controller's event loop ran ``seconds`` late: heartbeats may wait unread that long,
        so that time does not count as a worker's silence."""
        if seconds > 0:
            self.stall += seconds

    def silence(self, worker: Worker, now: float | None = None) -> float:
        """Seconds since ``worker``'s last heartbeat, less the controller's own stalls since then."""
        now = self.clock() if now is None else now
        return now - worker.last_heartbeat - (self.stall - worker.stall_at_beat)

    def sweep(self) -> list[Worker]:
        """Apply the heartbeat timeouts; returns the workers that became dead in this sweep.

        Also forgets workers dead for longer than ``forget_after_s`` (and tasks left without workers).
        """
        now = self.clock()
        died: list[Worker] = []
        for worker in list(self.workers.values()):
            silent = self.silence(worker, now)
            if worker.state is WorkerState.DEAD:
                if now - worker.state_since > self.forget_after_s and not worker.sessions:
                    self._forget(worker)
                continue
            if silent > self.dead_after_s:
                self.mark_dead(worker, f"no heartbeat for {silent:.1f} s (heartbeat timeout {self.dead_after_s:g} s)")
                died.append(worker)
            elif silent > self.suspect_after_s and worker.state is WorkerState.ALIVE:
                self.mark_suspect(worker, f"no heartbeat for {silent:.1f} s (suspect after {self.suspect_after_s:g} s)")
        return died

    def _forget(self, worker: Worker) -> None:
        logger.info("forgetting %s (dead since %.0f s)", worker.describe(), self.clock() - worker.state_since)
        self.workers.pop(worker.id, None)
        self._by_address.pop((worker.name, worker.address), None)
        entry = self.tasks.get(worker.name)
        if entry is not None:
            entry.workers.pop(worker.id, None)
            if not entry.workers:
                del self.tasks[worker.name]

    # -- scheduling ------------------------------------------------------------------------------

    def pick(self, name: str, exclude: set[int] | frozenset[int] = frozenset()) -> Worker:
        """The least-loaded alive worker of task ``name`` with a free slot (not in ``exclude``).

        Raises KeyError for an unknown task, :class:`NoWorkerError` (saying what there is) when
        none can take a session.
        """
        entry = self.tasks[name]
        best: Worker | None = None
        best_key: tuple[float, int, int] | None = None
        for worker in entry.workers.values():
            if worker.state is not WorkerState.ALIVE or worker.id in exclude:
                continue
            load = worker.load
            if load >= worker.concurrency:
                continue
            key = (load / worker.concurrency, load, worker.last_pick)
            if best_key is None or key < best_key:
                best, best_key = worker, key
        if best is None:
            raise NoWorkerError(self._why_none(entry, exclude))
        best.last_pick = next(self._picks)
        return best

    def _why_none(self, entry: TaskEntry, exclude: set[int] | frozenset[int]) -> str:
        counts = {s: 0 for s in WorkerState}
        full = 0
        for w in entry.workers.values():
            counts[w.state] += 1
            if w.state is WorkerState.ALIVE and w.load >= w.concurrency:
                full += 1
        parts = [f"{n} {s.value}" for s, n in counts.items() if n]
        tried = f", {len(exclude)} failed this request" if exclude else ""
        if not entry.workers:
            return f"task {entry.name!r} has no workers; start one (agentrl worker --task {entry.name} ...)"
        return (
            f"no alive worker of task {entry.name!r} has a free slot ({', '.join(parts)}; {full} alive at "
            f"capacity{tried}); retry later or add workers"
        )

    # -- views -----------------------------------------------------------------------------------

    def dump(self) -> dict[str, Any]:
        """``/api/list_workers``: per task, its index count and its workers by id."""
        now = self.clock()
        return {
            name: {
                "indices": len(entry.indices),
                "workers": {str(w.id): w.dump(now) for w in entry.workers.values()},
            }
            for name, entry in self.tasks.items()
        }

    def counts(self) -> dict[tuple[str, str], int]:
        """Number of workers per ``(task, state)`` (for metrics)."""
        out: dict[tuple[str, str], int] = {}
        for w in self.workers.values():
            key = (w.name, w.state.value)
            out[key] = out.get(key, 0) + 1
        return out
