"""In-process environment client: the trainer-facing env protocol over built-in tasks, no HTTP.

The agent loop talks to :class:`LocalEnvClient` exactly as it would talk to the controller::

    client = LocalEnvClient({"lookup": build_task("lookup")})
    session_id, reply = await client.start_sample("lookup", 0)        # user message + tools
    reply = await client.interact(session_id, [assistant_message])     # tool messages
    ...                                                                # until reply.finish
    await client.cancel(session_id)                                    # idempotent

A malformed assistant message raises :class:`MalformedMessageError` (a ValueError) and leaves the
session as it was; an unknown session id raises :class:`UnknownSessionError` (a KeyError). A task
that raises or runs past ``timeout_s`` ends its episode with status ``task error``. Finished,
failed and cancelled sessions are removed.
"""
from __future__ import annotations

import asyncio
import copy
import itertools
import logging
from dataclasses import dataclass, field
from typing import Any

from env_controller.protocol import (
    MalformedMessageError,  # noqa: F401 - LocalEnvClient.interact raises it
    SampleStatus,
    TaskReply,
    validate_assistant_messages,
)
from env_controller.tasks.base import Task, TaskSession

logger = logging.getLogger(__name__)


class UnknownSessionError(KeyError):
    """A session id that is not (or no longer) open; the message says why."""

    def __str__(self) -> str:
        """The plain message (KeyError would show its repr)."""
        return str(self.args[0]) if self.args else "unknown session"


@dataclass
class _Open:
    task: str
    index: int
    session: TaskSession
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)


class LocalEnvClient:
    """The env protocol (start_sample / interact / cancel / list_sessions) over in-process tasks."""

    def __init__(self, tasks: dict[str, Task], timeout_s: float = 30) -> None:
        """``tasks``: name -> built task; ``timeout_s``: limit on each task call (start, interact, close)."""
        if not isinstance(tasks, dict) or not tasks:
            raise ValueError(
                "LocalEnvClient needs a non-empty dict of task name -> Task (see env_controller.tasks.build_task)"
            )
        if not timeout_s > 0:
            raise ValueError(f"timeout_s={timeout_s!r} must be > 0")
        self.tasks = dict(tasks)
        self.timeout_s = float(timeout_s)
        self._sessions: dict[str, _Open] = {}
        self._counter = itertools.count()
        self._indices: dict[str, set[int]] = {}

    def indices(self, task: str) -> list[int]:
        """The sample indices of ``task``; ValueError naming an unknown task."""
        return self._task(task).indices()

    def _task(self, task: str) -> Task:
        if task not in self.tasks:
            raise ValueError(f"unknown task {task!r}; this client serves: {', '.join(sorted(self.tasks))}")
        return self.tasks[task]

    async def start_sample(self, task: str, index: int) -> tuple[str, TaskReply]:
        """Open an episode of ``task`` on sample ``index``; returns ``(session_id, first reply)``.

        Raises ValueError naming an unknown task or index. A task that fails or times out gives a
        finished ``task error`` reply (its session is not kept).
        """
        task_obj = self._task(task)
        valid = self._indices.get(task)
        if valid is None:
            valid = self._indices[task] = set(task_obj.indices())
        if isinstance(index, bool) or not isinstance(index, int) or index not in valid:
            raise ValueError(f"task {task!r} has no sample index {index!r}; it has {len(valid)} indices")
        session_id = f"{task}-{index}-{next(self._counter)}"
        try:
            session, reply = await asyncio.wait_for(task_obj.start(index), self.timeout_s)
        except Exception as exc:  # noqa: BLE001 - a task's failure ends its sample, not the trainer
            return session_id, self._task_error(f"start of {task!r} index {index}", exc)
        if reply.finish:
            await self._close(session, session_id)
        else:
            self._sessions[session_id] = _Open(task, index, session)
        return session_id, reply

    async def interact(self, session_id: str, messages: list[dict[str, Any]]) -> TaskReply:
        """Send ``[assistant message]`` to an open session and return the task's reply.

        Raises :class:`UnknownSessionError` for an id that is not open (finished sessions are
        removed) and :class:`MalformedMessageError` for a malformed body (the session stays open).
        """
        entry = self._entry(session_id)
        message = validate_assistant_messages(messages)
        async with entry.lock:
            if self._sessions.get(session_id) is not entry:
                return TaskReply(messages=[], status=SampleStatus.CANCELLED, finish=True)
            try:
                reply = await asyncio.wait_for(entry.session.interact(copy.deepcopy(message)), self.timeout_s)
            except Exception as exc:  # noqa: BLE001 - a task's failure ends its sample, not the trainer
                reply = self._task_error(f"interact of session {session_id!r}", exc)
            if reply.finish and self._sessions.get(session_id) is entry:
                del self._sessions[session_id]
                await self._close(entry.session, session_id)
            return reply

    async def cancel(self, session_id: str) -> None:
        """Close and forget a session; a no-op for an unknown or already finished one."""
        entry = self._sessions.pop(session_id, None)
        if entry is not None:
            await self._close(entry.session, session_id)

    def list_sessions(self) -> list[str]:
        """Ids of the open sessions, oldest first."""
        return list(self._sessions)

    async def aclose(self) -> None:
        """Cancel every open session."""
        for session_id in list(self._sessions):
            await self.cancel(session_id)

    def _entry(self, session_id: str) -> _Open:
        entry = self._sessions.get(session_id)
        if entry is None:
            raise UnknownSessionError(
                f"unknown session {session_id!r}: it was never started, or it finished or was cancelled "
                f"(finished sessions are removed); open sessions: {len(self._sessions)}"
            )
        return entry

    async def _close(self, session: TaskSession, session_id: str) -> None:
        try:
            await asyncio.wait_for(session.close(), self.timeout_s)
        except Exception:  # noqa: BLE001 - closing is best effort
            logger.exception("closing session %s failed", session_id)

    def _task_error(self, what: str, exc: BaseException) -> TaskReply:
        if isinstance(exc, (asyncio.TimeoutError, TimeoutError)):
            logger.error("%s timed out after %.1f s", what, self.timeout_s)
        else:
            logger.error("%s failed: %s", what, exc, exc_info=exc)
        return TaskReply(messages=[], status=SampleStatus.TASK_ERROR, finish=True, metrics={"success": 0.0})
