"""Checks of a task's constructor parameters, and the error that names the bad one.

Every built-in task checks its own parameters when it is built and raises
:class:`TaskParamError`, so that a caller (the trainer's config, the worker's command line) can
say which parameter is wrong in its own terms, e.g. ``tasks[1].params.num_keys=99 must be ...``.
"""
from __future__ import annotations

import math
from typing import Any


class TaskParamError(ValueError):
    """A bad constructor parameter of a task.

    ``param`` names it, ``value`` is what was given and ``rule`` says what is accepted; the
    message reads ``<task>: <param>=<value> <rule>`` unless ``message`` words it otherwise.
    """

    def __init__(self, task: str, param: str, value: Any, rule: str, message: str | None = None) -> None:
        super().__init__(message or f"{task}: {param}={value!r} {rule}")
        self.task, self.param, self.value, self.rule = task, param, value, rule


def int_param(task: str, param: str, value: Any, low: int | None = None, high: int | None = None) -> int:
    """``value`` when it is an integer (not a bool) in ``low..high`` (either bound may be left out)."""
    if low == 1 and high is None:
        rule = "must be a positive integer"
    elif low is not None and high is not None:
        rule = f"must be an integer in {low}..{high}"
    elif low is not None:
        rule = f"must be an integer >= {low}"
    else:
        rule = "must be an integer"
    ok = (isinstance(value, int) and not isinstance(value, bool) and (low is None or value >= low)
          and (high is None or value <= high))
    if not ok:
        raise TaskParamError(task, param, value, rule)
    return value


def seconds_param(task: str, param: str, value: Any) -> float:
    """``value`` as a float when it is a finite number of seconds > 0."""
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value > 0
    if not ok:
        raise TaskParamError(task, param, value, "must be a positive (finite) number of seconds")
    return float(value)


def str_param(task: str, param: str, value: Any, *, empty: bool = False, optional: bool = False) -> Any:
    """``value`` when it is a string (non-empty unless ``empty``), or None when ``optional``."""
    if value is None and optional:
        return None
    if not isinstance(value, str) or (not empty and not value):
        kind = "a string" if empty else "a non-empty string"
        raise TaskParamError(task, param, value, f"must be {kind}" + (" or null" if optional else ""))
    return value


def bool_param(task: str, param: str, value: Any) -> bool:
    """``value`` when it is true or false."""
    if not isinstance(value, bool):
        raise TaskParamError(task, param, value, "must be true or false")
    return value
