"""``guess`` (harder): find a hidden number by bisection on higher/lower feedback."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from env_controller.tasks.base import Expert, Message, ToolResult, ToolTask, ToolTaskSession, function_schema
from env_controller.tasks.options import TaskOptions


class GuessSession(ToolTaskSession):
    """One ``guess`` episode."""

    def __init__(self, target: int, max_value: int, max_turns: int) -> None:
        """``target``: the hidden number in ``1..max_value``."""
        super().__init__(GuessTask.TOOLS, max_turns)
        self.target = target
        self.max_value = max_value

    def call_tool(self, name: str, arguments: dict[str, Any]) -> ToolResult:
        """Reply ``higher`` / ``lower`` / ``correct`` (the last ends the episode)."""
        n = arguments["n"]
        if not 1 <= n <= self.max_value:
            return ToolResult(f"error: n must be from 1 to {self.max_value}")
        if n == self.target:
            return ToolResult("correct", finish=True, success=True)
        return ToolResult("higher" if self.target > n else "lower")


@dataclass
class GuessOptions(TaskOptions):
    """The guess task's params."""

    KEY = "guess"

    #: the hidden number lies in ``1..max_value``
    max_value: int = 15

    def check(self) -> None:
        """See :class:`TaskOptions`."""
        super().check()
        self.require_int("max_value", low=2)
        needed = self.max_value.bit_length()
        self.require(self.max_turns >= needed, "max_turns", f"is too few to always find a number in "
                     f"1..{self.max_value} (bisection needs {needed}); raise max_turns or lower max_value")


class GuessTask(ToolTask):
    """Harder: find a hidden number in ``1..max_value`` with at most ``max_turns`` guesses.

    Tool: ``guess(n: integer)`` replies ``higher`` (the number is larger than n), ``lower``, or
    ``correct``, which ends the episode; a guess outside ``1..max_value`` gets an error message
    (and costs its turn).
    Expert: bisection from the middle, ``n = (lo + hi) // 2`` (at most 4 guesses for 1..15).
    Careless player: guesses 1 every time, whatever the replies (right 1 time in ``max_value``).
    Reward: 1 when the number is guessed within ``max_turns`` guesses (default 4), else 0
    (status ``task limit reached``); 0 on a message without tool calls.
    Defaults need a perfect bisection on the deepest numbers; raise ``max_turns`` to make it easier.
    """

    name = "guess"
    Options = GuessOptions
    options: GuessOptions
    TOOLS = [
        function_schema("guess", "Guess the number.", {"n": "integer"}),
    ]

    def target(self, index: int) -> int:
        """The hidden number of sample ``index``."""
        return self.rng(index).randint(1, self.options.max_value)

    def new_session(self, index: int) -> tuple[ToolTaskSession, list[Message]]:
        """See :meth:`ToolTask.new_session`."""
        max_value = self.options.max_value
        prompt = (f"Find my secret number from 1 to {max_value}. The reply to a guess is "
                  f"higher, lower or correct. You have {self.max_turns} guesses.")
        return GuessSession(self.target(index), max_value, self.max_turns), [{"role": "user", "content": prompt}]

    def expert(self, index: int) -> Expert:
        """Bisection: guess the middle of the remaining range, narrow it on each reply."""
        lo, hi = 1, self.options.max_value
        while True:
            mid = (lo + hi) // 2
            feedback = yield "guess", {"n": mid}
            if feedback == "higher":
                lo = mid + 1
            elif feedback == "lower":
                hi = mid - 1

    def careless(self, index: int) -> Expert:
        """Ignores the replies: guesses 1 every time."""
        while True:
            yield "guess", {"n": 1}
