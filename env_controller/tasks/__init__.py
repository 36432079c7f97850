"""Built-in tasks and their registry.

``build_task("lookup", seed=1)`` builds a registered task; :data:`TASKS` maps each name to its
class. The three small function-call tasks of the CPU demo, from easy to harder:
``lookup`` (read a hidden table), ``calc`` (use a calculator tool), ``guess`` (bisection);
and the heavier ``os_shell`` (bash in a bubblewrap or Docker sandbox), ``db`` (SQL on a
MariaDB database of its own per session) and ``terminal`` (terminal-agent tasks with their own image and a
verifier in the container: Harbor / Terminal-Bench task directories, manifests, the demo's families).
"""
from __future__ import annotations

import inspect
from typing import Any

from env_controller.tasks.base import Task, TaskSession, ToolTask, ToolTaskSession
from env_controller.tasks.calc import CalcTask
from env_controller.tasks.db import DBTask
from env_controller.tasks.guess import GuessTask
from env_controller.tasks.lookup import LookupTask
from env_controller.tasks.os_shell import OsShellTask
from env_controller.tasks.params import TaskParamError
from env_controller.tasks.terminal import TerminalTask

TASKS: dict[str, type[Task]] = {
    LookupTask.name: LookupTask,
    CalcTask.name: CalcTask,
    GuessTask.name: GuessTask,
    OsShellTask.name: OsShellTask,
    DBTask.name: DBTask,
    TerminalTask.name: TerminalTask,
}


def build_task(name: str, **params: Any) -> Task:
    """Build the registered task ``name`` with constructor ``params``.

    Raises ValueError naming an unknown task (and listing the registered ones), and
    :class:`TaskParamError` (a ValueError) naming an unknown parameter (and listing the accepted
    ones) or a bad parameter value.
    """
    cls = TASKS.get(name)
    if cls is None:
        raise ValueError(f"unknown task {name!r}; registered tasks: {', '.join(sorted(TASKS))}")
    accepted = [p for p in inspect.signature(cls.__init__).parameters if p != "self"]
    unknown = sorted(set(params) - set(accepted))
    if unknown:
        raise TaskParamError(name, unknown[0], params[unknown[0]], f"is not a parameter of task {name!r}; accepted: "
                             f"{', '.join(accepted)}", message=f"task {name!r} has no parameter "
                             f"{', '.join(map(repr, unknown))}; accepted: {', '.join(accepted)}")
    return cls(**params)


__all__ = ["TASKS", "Task", "TaskParamError", "TaskSession", "ToolTask", "ToolTaskSession", "build_task"]
