"""Built-in tasks and their registry.

``build_task("lookup", seed=1)`` builds a registered task from plain params (``LookupTask(LookupOptions(seed=1))``
is the same); :data:`TASKS` maps each name to its class, whose ``Options`` declares and checks its params. The three
small function-call tasks of the CPU demo, from easy to harder: ``lookup`` (read a hidden table), ``calc`` (use a
calculator tool), ``guess`` (bisection); and the heavier ``os_shell`` (bash in a bubblewrap or Docker sandbox),
``db`` (SQL on a MariaDB database of its own per session) and ``terminal`` (terminal-agent tasks with their own
image and a verifier in the container: Harbor / Terminal-Bench task directories, manifests, the demo's families).
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from env_controller.options import build_options
from env_controller.tasks.base import Task, TaskSession, ToolTask, ToolTaskSession
from env_controller.tasks.calc import CalcTask
from env_controller.tasks.db import DBTask
from env_controller.tasks.guess import GuessTask
from env_controller.tasks.lookup import LookupTask
from env_controller.tasks.options import TaskOptions
from env_controller.tasks.os_shell import OsShellTask
from env_controller.tasks.terminal import TerminalTask

TASKS: dict[str, type[Task]] = {
    LookupTask.name: LookupTask,
    CalcTask.name: CalcTask,
    GuessTask.name: GuessTask,
    OsShellTask.name: OsShellTask,
    DBTask.name: DBTask,
    TerminalTask.name: TerminalTask,
}


def task_options(name: str, params: Mapping[str, Any], key: str | None = None) -> TaskOptions:
    """The options of the registered task ``name`` made from plain ``params`` (YAML, ``--param``), errors placed
    under ``key`` (default: the task's name). ValueError naming an unknown task (and listing the registered ones);
    :class:`~env_controller.options.FieldError` naming an unknown, mistyped or bad param, its value and the fix."""
    cls = TASKS.get(name)
    if cls is None or not issubclass(cls, ToolTask):
        raise ValueError(f"unknown task {name!r}; registered tasks: {', '.join(sorted(TASKS))}")
    return build_options(cls.Options, params, name if key is None else key)


def build_task(name: str, **params: Any) -> Task:
    """Build the registered task ``name`` from plain ``params`` (see :func:`task_options`)."""
    options = task_options(name, params)  # first: it names an unknown task
    return TASKS[name](options)  # type: ignore[call-arg]


__all__ = ["TASKS", "Task", "TaskOptions", "TaskSession", "ToolTask", "ToolTaskSession", "build_task", "task_options"]
