"""Tool tasks whose tool calls block (sandbox commands, SQL): the shared rules of
:mod:`env_controller.tasks.base`, with the blocking work on a thread pool.

:class:`BlockingToolTaskSession` runs :meth:`~env_controller.tasks.base.ToolTaskSession.step`
and its own :meth:`~BlockingToolTaskSession.release` on the task's executor, so an asyncio
worker keeps serving other sessions while a command runs. :class:`BlockingToolTask` opens
sessions on the same executor and closes the sessions its demonstrations open.
"""
from __future__ import annotations

import asyncio
import logging
import threading
from abc import abstractmethod
from concurrent.futures import ThreadPoolExecutor
from typing import Any, ClassVar

from env_controller.protocol import TaskReply
from env_controller.tasks.base import Expert, Message, ToolSchema, ToolTask, ToolTaskSession
from env_controller.tasks.options import BlockingTaskOptions

logger = logging.getLogger(__name__)


class BlockingToolTaskSession(ToolTaskSession):
    """A :class:`ToolTaskSession` whose ``call_tool`` may block; see the module docstring."""

    def __init__(self, tools: list[ToolSchema], max_turns: int, executor: ThreadPoolExecutor) -> None:
        """``executor``: where :meth:`step` and :meth:`release` run."""
        super().__init__(tools, max_turns)
        self._executor = executor
        self._release_lock = threading.Lock()
        self._released = False

    async def interact(self, assistant_message: Message) -> TaskReply:
        """:meth:`step` on the executor."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._executor, self.step, assistant_message)

    async def close(self) -> None:
        """:meth:`release_once` on the executor; safe to call more than once."""
        self.closed = True
        loop = asyncio.get_running_loop()
        await loop.run_in_executor(self._executor, self.release_once)

    def release_once(self) -> None:
        """Call :meth:`release` the first time only (blocking)."""
        with self._release_lock:
            if self._released:
                return
            self._released = True
        self.closed = True
        self.release()

    @abstractmethod
    def release(self) -> None:
        """Free the session's external resources (blocking; called once)."""


class BlockingToolTask(ToolTask):
    """A :class:`ToolTask` whose sessions are :class:`BlockingToolTaskSession` s, their tool calls run on a thread
    pool of ``max_workers`` (:class:`~env_controller.tasks.options.BlockingTaskOptions`)."""

    Options: ClassVar[type[BlockingTaskOptions]] = BlockingTaskOptions
    options: BlockingTaskOptions

    def __init__(self, options: BlockingTaskOptions | None = None) -> None:
        """See :class:`ToolTask`."""
        super().__init__(options)
        self.max_workers = self.options.max_workers
        self._executor: ThreadPoolExecutor | None = None
        self._executor_lock = threading.Lock()

    @property
    def executor(self) -> ThreadPoolExecutor:
        """The thread pool of blocking calls (created on first use)."""
        with self._executor_lock:
            if self._executor is None:
                self._executor = ThreadPoolExecutor(self.max_workers, thread_name_prefix=f"agentrl-{self.name}")
            return self._executor

    @abstractmethod
    def new_session(self, index: int) -> tuple[BlockingToolTaskSession, list[Message]]:
        """A fresh session on a valid ``index`` and its first messages (blocking)."""

    async def start(self, index: int) -> tuple[BlockingToolTaskSession, TaskReply]:
        """See :meth:`Task.start`; the session is opened on the executor."""
        self.check_index(index)
        loop = asyncio.get_running_loop()
        session, messages = await loop.run_in_executor(self.executor, self.new_session, index)
        return session, TaskReply(messages=messages, tools=self.tools())

    def play(self, index: int, player: Expert) -> tuple[list[Message], TaskReply, Any]:
        """Play ``player`` (a scripted expert or careless player) through a session of ``index`` (blocking; the
        session is released); returns the conversation, the final reply and the session. RuntimeError when the
        player does not finish within ``max_turns``."""
        self.check_index(index)
        session, messages = self.new_session(index)
        try:
            conversation, reply = self.replay(session, messages, player, index, "scripted player")
            return conversation, reply, session
        finally:
            session.release_once()

    def demonstration(self, index: int) -> tuple[list[Message], list[ToolSchema]]:
        """See :meth:`Task.demonstration` (blocking; the session it opens is released)."""
        conversation, reply, _ = self.play(index, self.expert(index))
        if reply.reward < 1.0:
            raise RuntimeError(f"{self.name}: the scripted expert failed on index {index}: {reply}")
        return conversation, self.tools()

    def close(self) -> None:
        """Stop the executor (running calls finish first); subclasses also release their servers."""
        with self._executor_lock:
            executor, self._executor = self._executor, None
        if executor is not None:
            executor.shutdown(wait=True, cancel_futures=True)
