"""``calc`` (medium): one addition or multiplication done with a calculator tool, then answered."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from env_controller.tasks.base import Expert, Message, ToolResult, ToolTask, ToolTaskSession, function_schema
from env_controller.tasks.options import TaskOptions

_OPS = {"add": ("plus", lambda a, b: a + b), "multiply": ("times", lambda a, b: a * b)}


class CalcSession(ToolTaskSession):
    """One ``calc`` episode."""

    def __init__(self, result: int, max_turns: int) -> None:
        """``result``: the exact value of the question."""
        super().__init__(CalcTask.TOOLS, max_turns)
        self.result = result

    def call_tool(self, name: str, arguments: dict[str, Any]) -> ToolResult:
        """``add``/``multiply`` return the exact result; ``answer`` ends the episode."""
        if name in _OPS:
            return ToolResult(str(_OPS[name][1](arguments["a"], arguments["b"])))
        ok = arguments["value"] == self.result
        return ToolResult("correct" if ok else "wrong", finish=True, success=ok)


@dataclass
class CalcOptions(TaskOptions):
    """The calc task's params."""

    KEY = "calc"

    #: the smallest operand
    low: int = 2
    #: the largest operand (above ``low``)
    high: int = 49

    def check(self) -> None:
        """See :class:`TaskOptions`."""
        super().check()
        self.require_int("low", low=0)
        self.require_int("high")
        self.require(self.low < self.high, "high", f"must be above low={self.low!r}")


class CalcTask(ToolTask):
    """Medium: "What is A plus B?" or "What is A times B?" with A, B in ``[low, high]``.

    Tools: ``add(a: integer, b: integer)`` and ``multiply(a: integer, b: integer)`` return the
    exact result as text; ``answer(value: integer)`` ends the episode.
    Expert: the matching operation on (A, B), then ``answer(result)`` (2 turns). Careless player: gives
    up at once (``answer(0)``).
    Reward: 1 when the answered integer equals the exact result (whether or not a tool was used),
    else 0; 0 on the turn limit (default 4 tool calls) or a message without tool calls.
    """

    name = "calc"
    Options = CalcOptions
    options: CalcOptions
    TOOLS = [
        function_schema("add", "Return a + b.", {"a": "integer", "b": "integer"}),
        function_schema("multiply", "Return a * b.", {"a": "integer", "b": "integer"}),
        function_schema("answer", "Give the final answer.", {"value": "integer"}),
    ]

    def sample(self, index: int) -> tuple[str, int, int]:
        """The operation (``add`` | ``multiply``) and operands of sample ``index``."""
        rng = self.rng(index)
        op = rng.choice(sorted(_OPS))
        low, high = self.options.low, self.options.high
        return op, rng.randint(low, high), rng.randint(low, high)

    def new_session(self, index: int) -> tuple[ToolTaskSession, list[Message]]:
        """See :meth:`ToolTask.new_session`."""
        op, a, b = self.sample(index)
        word, fn = _OPS[op]
        prompt = f"What is {a} {word} {b}? Use a tool, then answer."
        return CalcSession(fn(a, b), self.max_turns), [{"role": "user", "content": prompt}]

    def expert(self, index: int) -> Expert:
        """``op(a, b)`` then ``answer(<the integer returned>)``."""
        op, a, b = self.sample(index)
        result = yield op, {"a": a, "b": b}
        yield "answer", {"value": int(result)}

    def careless(self, index: int) -> Expert:
        """Gives up at once: ``answer(0)`` without a tool."""
        yield "answer", {"value": 0}
