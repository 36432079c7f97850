"""The console of a training run's long phases (warm-up, evaluation, checkpoint saving, HF export).

On a terminal a phase shows one live progress bar (rich) with the figures that matter, removed when
the phase ends; when stdout is not a terminal (CI, a log file) it prints a plain log line every
tenth of the phase instead. Either way the phase ends with one log line: what was done, in how long,
and its last figures. Only rank 0 shows anything (the others pass ``enabled=False``).

Log records written while a bar is live go through the bar's console, above the bar, so they do
not tear it.
"""
from __future__ import annotations

import logging
import math
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

logger = logging.getLogger(__name__)


def _fmt_duration(seconds: float) -> str:
    """``42.1s``, ``3m05s`` or ``1h02m``."""
    if seconds < 60:
        return f"{seconds:.1f}s"
    m, s = divmod(int(seconds), 60)
    return f"{m}m{s:02d}s" if m < 60 else f"{m // 60}h{m % 60:02d}m"


class Phase:
    """One long phase: ``update`` it as work completes (see :meth:`Progress.phase`)."""

    def __init__(self, title: str, total: int | None, unit: str, lines: int, bar: Any = None) -> None:
        self.title, self.total, self.unit = title, total, unit
        self.completed = 0
        self.figures: dict[str, str] = {}
        self.done: str | None = None
        self.t0 = time.perf_counter()
        self._bar = bar  # (rich Progress, task id) on a terminal, None for plain lines
        # plain lines: one every ``every`` units (``lines - 1`` before the phase's last line)
        self._every = math.ceil(total / (lines - 1)) if total and lines > 1 else None

    def update(self, completed: int | None = None, figures: dict[str, str] | None = None,
               done: str | None = None) -> None:
        """Set the units done (``completed``), the figures shown next to them (name -> formatted value),
        and what the last line calls the work done (``done``, e.g. "144 episodes"; default
        "<completed>/<total> <unit>")."""
        if figures is not None:
            self.figures = dict(figures)
        if done is not None:
            self.done = done
        if completed is not None:
            self.completed = int(completed)
        if self._bar is not None:
            progress, task = self._bar
            figures = "  ".join(f"{k} {v}" for k, v in self.figures.items())
            progress.update(task, completed=self.completed, figures=figures)
        elif self._every and completed is not None and self.completed % self._every == 0 \
                and self.completed < (self.total or 0):
            logger.info("%s: %d/%d %s%s | %s", self.title, self.completed, self.total, self.unit,
                        self._figures_text(), _fmt_duration(time.perf_counter() - self.t0))

    def _figures_text(self) -> str:
        """The figures as `` | name value`` pairs (for log lines)."""
        return "".join(f" | {k} {v}" for k, v in self.figures.items())

    def summary(self) -> str:
        """The phase's last line: what was done, in how long, its last figures."""
        done = self.done or (f"{self.completed}/{self.total} {self.unit}" if self.total else "done")
        return (f"{self.title}: {done} in {_fmt_duration(time.perf_counter() - self.t0)}"
                f"{self._figures_text()}")


class Progress:
    """Rank 0's console for long phases (see the module doc).

    enabled: show anything at all (False on ranks other than 0). console: the rich Console the bars
    go to (default: one on stdout); bars are live when it is a terminal, plain log lines otherwise.
    """

    def __init__(self, enabled: bool = True, console: Any = None) -> None:
        self.enabled = enabled
        if enabled and console is None:
            from rich.console import Console

            console = Console()
        self.console = console
        self.live = enabled and console.is_terminal

    @contextmanager
    def phase(self, title: str, total: int | None = None, unit: str = "steps", lines: int = 10) -> Iterator[Phase]:
        """A phase of ``total`` units (None: of unknown length, a spinner); yields its :class:`Phase`.

        lines: without a terminal, the most log lines the phase prints, its last line included
        (1: only the last line). The last line is logged when the phase ends without an error.
        """
        if not self.enabled:
            yield Phase(title, total, unit, lines=1)
            return
        if not self.live:
            phase = Phase(title, total, unit, lines)
            yield phase
            logger.info(phase.summary())
            return
        from rich.progress import (
            BarColumn,
            MofNCompleteColumn,
            SpinnerColumn,
            TextColumn,
            TimeElapsedColumn,
            TimeRemainingColumn,
        )
        from rich.progress import Progress as RichProgress

        # narrow enough for an 80-column terminal: the figures matter more than a long bar
        columns = [SpinnerColumn(), TextColumn("{task.description}")]
        if total:
            columns += [BarColumn(bar_width=12), MofNCompleteColumn(), TimeRemainingColumn()]
        else:
            columns += [TimeElapsedColumn()]
        columns += [TextColumn("{task.fields[figures]}")]
        with RichProgress(*columns, console=self.console, transient=True) as progress, _logs_above_the_bar():
            phase = Phase(title, total, unit, lines, bar=(progress, progress.add_task(title, total=total, figures="")))
            yield phase
        logger.info(phase.summary())


@contextmanager
def _logs_above_the_bar() -> Iterator[None]:
    """Point the root logger's handlers that write to the real stdout / stderr at the live console's
    proxies (rich swapped ``sys.stdout`` / ``sys.stderr`` for them), so records print above the bar."""
    proxies = {id(sys.__stdout__): sys.stdout, id(sys.__stderr__): sys.stderr}
    swapped = []
    for h in logging.getLogger().handlers:
        if isinstance(h, logging.StreamHandler) and id(h.stream) in proxies and h.stream is not proxies[id(h.stream)]:
            swapped.append((h, h.setStream(proxies[id(h.stream)])))
    try:
        yield
    finally:
        for h, stream in swapped:
            h.setStream(stream)
