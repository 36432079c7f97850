"""The settings every built-in task has: each task's options class derives from these.

A task is built from one options object (``CalcTask(CalcOptions(high=99))``); :func:`env_controller.tasks.build_task`
builds it from plain params (YAML ``params:``, ``agentrl worker --param``), refusing an unknown or bad one with
an error that names the key, the value and the fix. ``KEY`` is the task's name, so that messages read
``calc.low=-1 must be an integer >= 0``; the trainer places them under ``tasks[i].params``.
"""
from __future__ import annotations

from dataclasses import dataclass

from env_controller.options import Options


@dataclass
class TaskOptions(Options):
    """The sample set and the episode's length, common to every tool task."""

    #: which sample set: each sample is a pure function of ``(seed, index)``
    seed: int = 0
    #: samples in the set (indices ``0 .. num_samples - 1``)
    num_samples: int = 512
    #: tool calls allowed per episode
    max_turns: int = 4

    def check(self) -> None:
        """See :class:`Options`."""
        super().check()
        self.require_int("seed")
        self.check_samples()
        self.require_positive_int("max_turns")

    def check_samples(self) -> None:
        """``num_samples`` is a positive integer (a task with a set of its own may allow None: all of it)."""
        self.require_positive_int("num_samples")


@dataclass
class BlockingTaskOptions(TaskOptions):
    """A task whose tool calls block (a shell, a database): they run on a thread pool of the task's."""

    #: threads running blocking tool calls of all sessions of the task at once (at least the sessions expected to
    #: run commands concurrently)
    max_workers: int = 64

    def check(self) -> None:
        """See :class:`Options`."""
        super().check()
        self.require_positive_int("max_workers")
