"""The console of long phases: plain lines without a terminal (at most ``lines`` per phase, the last
one with the final figures), nothing on ranks other than 0, and on a terminal a live bar with log
records printed above it."""
from __future__ import annotations

import io
import logging
import sys

from megatron_agentrl.pipeline.progress import Progress

LOGGER = "megatron_agentrl.pipeline.progress"


def _lines(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == LOGGER]


def test_plain_lines_are_few_and_the_last_has_the_final_figures(caplog):
    caplog.set_level(logging.INFO, logger=LOGGER)
    progress = Progress(console=_console(terminal=False))
    assert not progress.live
    with progress.phase("SFT warm-up", 900) as phase:
        for step in range(1, 901):
            phase.update(step, {"nll/token": f"{1000 / step:.3f}"})
    lines = _lines(caplog)
    assert 5 <= len(lines) <= 10
    assert lines[0].startswith("SFT warm-up: 100/900 steps | nll/token 10.000 | ")
    assert lines[-1].startswith("SFT warm-up: 900/900 steps in ") and lines[-1].endswith("| nll/token 1.111")

    caplog.clear()
    with progress.phase("evaluation", 6, unit="turns", lines=1) as phase:
        for turn in range(1, 4):
            phase.update(turn, {"episodes running": "3"})
        phase.update(figures={"success": "calc 50%"}, done="144 episodes")
    assert len(_lines(caplog)) == 1 and _lines(caplog)[0].startswith("evaluation: 144 episodes in ")
    assert _lines(caplog)[0].endswith("| success calc 50%")


def test_disabled_progress_prints_nothing(caplog):
    caplog.set_level(logging.INFO, logger=LOGGER)
    progress = Progress(enabled=False)
    with progress.phase("SFT warm-up", 20) as phase:
        for step in range(1, 21):
            phase.update(step, {"nll/token": "1.0"})
    with progress.phase("HF export") as phase:
        phase.update(figures={"saved to": "/tmp/x"})
    assert _lines(caplog) == []


def test_no_last_line_when_the_phase_fails(caplog):
    caplog.set_level(logging.INFO, logger=LOGGER)
    progress = Progress(console=_console(terminal=False))
    try:
        with progress.phase("checkpoint step 3"):
            raise OSError("disk full")
    except OSError:
        pass
    assert _lines(caplog) == []


def test_live_bar_prints_log_records_above_it_and_ends_with_one_line(caplog):
    caplog.set_level(logging.INFO, logger=LOGGER)
    console = _console(terminal=True)
    progress = Progress(console=console)
    assert progress.live
    handler = logging.StreamHandler(sys.__stdout__)  # as the CLI's logging setup writes to the real stdout
    handler.setLevel(logging.WARNING)
    root = logging.getLogger()
    root.addHandler(handler)
    try:
        with progress.phase("SFT warm-up", 10) as phase:
            assert handler.stream is not sys.__stdout__  # records go through the bar's console meanwhile
            for step in range(1, 11):
                phase.update(step, {"nll/token": "0.5"})
            logging.getLogger("somewhere").warning("a record in the middle")
        assert handler.stream is sys.__stdout__
    finally:
        root.removeHandler(handler)
    shown = console.file.getvalue()
    assert "a record in the middle" in shown and "SFT warm-up" in shown and "nll/token 0.5" in shown
    lines = _lines(caplog)
    assert len(lines) == 1 and lines[0].startswith("SFT warm-up: 10/10 steps in ")


def _console(terminal: bool):
    from rich.console import Console

    return Console(file=io.StringIO(), force_terminal=terminal, width=120)
