"""The controller's session table.

An open :class:`Session` lives on one worker until it finishes, is cancelled, its worker dies, or
it sits idle too long. Ended sessions are remembered (a bounded number, oldest forgotten first) so
that a late request gets a useful answer: when the controller ended a session on its own (dead
worker, idle GC, failed worker call) while the trainer was not waiting on it, the final ``task
error`` reply is kept and handed out on the trainer's next ``interact``; otherwise a request on
an ended session gets a 4xx error that says how it ended.
"""
from __future__ import annotations

import asyncio
import itertools
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

from env_controller.controller.registry import Index, Worker
from env_controller.protocol import SampleStatus, TaskReply


@dataclass(eq=False)
class Session:
    """One open episode: its task sample, its worker, and the worker call in flight (if any)."""

    id: int
    task: str
    index: Index
    worker: Worker
    started_at: float = field(default_factory=time.time)
    last_active: float = field(default_factory=time.monotonic)
    busy: bool = False
    turns: int = 0
    call: asyncio.Future[Any] | None = None
    abort: tuple[SampleStatus, str] | None = None

    def dump(self, now: float) -> dict[str, Any]:
        """The JSON form of ``/api/list_sessions``."""
        return {
            "name": self.task,
            "index": self.index,
            "worker_id": self.worker.id,
            "start": self.started_at,
            "idle_s": round(now - self.last_active, 3),
            "busy": self.busy,
            "turns": self.turns,
        }


@dataclass
class Ended:
    """How a session ended; ``final`` is a reply the trainer has not received yet (or None)."""

    task: str
    status: str
    reason: str
    final: dict[str, Any] | None = None


def final_reply(status: SampleStatus, reason: str) -> dict[str, Any]:
    """A finished flat reply with no messages, carrying ``reason`` in ``error``."""
    return {**TaskReply(messages=[], status=status, finish=True).to_json(), "error": reason}


class SessionTable:
    """Open sessions by id, and a bounded memory of ended ones."""

    def __init__(self, first_id: int | None = None, remember: int = 100_000) -> None:
        """Ids count up from ``first_id`` (default: the current time in ms, so that a restarted
        controller does not reuse the ids its workers may still hold); ``remember``: ended sessions kept."""
        if first_id is None:
            first_id = int(time.time() * 1000)
        self._ids = itertools.count(first_id)
        self.open: dict[int, Session] = {}
        self.ended: OrderedDict[int, Ended] = OrderedDict()
        self.remember = remember

    def new_id(self) -> int:
        """A fresh session id."""
        return next(self._ids)

    def add(self, session: Session) -> None:
        """Open ``session`` (and count it on its worker)."""
        self.open[session.id] = session
        session.worker.sessions.add(session.id)

    def remove(self, session: Session, status: str, reason: str, final: dict[str, Any] | None = None) -> bool:
        """Close ``session``: free its worker slot and remember how it ended; False when already closed."""
        if self.open.get(session.id) is not session:
            return False
        del self.open[session.id]
        session.worker.sessions.discard(session.id)
        self.ended[session.id] = Ended(session.task, status, reason, final)
        while len(self.ended) > self.remember:
            self.ended.popitem(last=False)
        return True

    def take_final(self, session_id: int) -> dict[str, Any] | None:
        """The undelivered final reply of an ended session (handed out once), or None."""
        ended = self.ended.get(session_id)
        if ended is None or ended.final is None:
            return None
        final, ended.final = ended.final, None
        return final

    def why_unknown(self, session_id: int) -> str:
        """The 404 message for a session id that is not open."""
        ended = self.ended.get(session_id)
        if ended is None:
            return (
                f"unknown session {session_id}: never started on this controller, or ended long ago; "
                f"open sessions: {len(self.open)}"
            )
        detail = f": {ended.reason}" if ended.reason and ended.reason != ended.status else ""
        return (f"session {session_id} ({ended.task}) already ended with status {ended.status!r}{detail}; "
                "start a new sample")

    def dump(self) -> dict[str, Any]:
        """``/api/list_sessions``: open sessions by id."""
        now = time.monotonic()
        return {str(sid): s.dump(now) for sid, s in self.open.items()}
