"""``lookup`` (easy): read one value out of a small hidden table, then answer it."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from env_controller.tasks.base import Expert, Message, ToolResult, ToolTask, ToolTaskSession, function_schema
from env_controller.tasks.options import TaskOptions

KEYS: tuple[str, ...] = (
    "ant", "bear", "cat", "crow", "deer", "dog", "duck", "eel", "fox", "frog", "goat", "hawk",
    "lion", "mole", "moth", "mouse", "owl", "pig", "rat", "seal", "swan", "toad", "wolf", "yak",
)
VALUES: tuple[str, ...] = (
    "red", "blue", "green", "black", "white", "pink", "gray", "gold", "brown", "orange", "purple", "silver",
)


def _normalize(text: str) -> str:
    return text.strip().strip(".\"'").strip().lower()


class LookupSession(ToolTaskSession):
    """One ``lookup`` episode over a hidden table."""

    def __init__(self, table: dict[str, str], key: str, max_turns: int) -> None:
        """``table``: the hidden key -> value table; ``key``: the key the user asks about."""
        super().__init__(LookupTask.TOOLS, max_turns)
        self.table = table
        self.key = key

    def call_tool(self, name: str, arguments: dict[str, Any]) -> ToolResult:
        """``lookup`` returns the value (or an error for a missing key); ``answer`` ends the episode."""
        if name == "lookup":
            key = _normalize(arguments["key"])
            if key in self.table:
                return ToolResult(self.table[key])
            return ToolResult(f"error: no key {arguments['key']!r} in the table")
        ok = _normalize(arguments["value"]) == self.table[self.key]
        return ToolResult("correct" if ok else "wrong", finish=True, success=ok)


@dataclass
class LookupOptions(TaskOptions):
    """The lookup task's params."""

    KEY = "lookup"

    #: entries of each sample's hidden table
    num_keys: int = 6

    def check(self) -> None:
        """See :class:`TaskOptions`."""
        super().check()
        self.require_int("num_keys", low=1, high=len(KEYS))


class LookupTask(ToolTask):
    """Easy: the user asks for the value of one key of a hidden table of ``num_keys`` entries.

    Tools: ``lookup(key: string)`` returns the key's value (a color word), or ``error: ...`` for a
    key not in the table (keys compare case-insensitively, surrounding quotes ignored);
    ``answer(value: string)`` ends the episode.
    Expert: ``lookup(key)``, then ``answer(value)`` (2 turns). Careless player: gives up at once
    (``answer`` with an empty value).
    Reward: 1 when the answered value equals the key's value (case-insensitive, surrounding
    whitespace, quotes and a final period ignored), else 0; 0 on the turn limit (default 4 tool
    calls) or a message without tool calls.
    """

    name = "lookup"
    Options = LookupOptions
    options: LookupOptions
    TOOLS = [
        function_schema("lookup", "Get the value of a key.", {"key": "string"}),
        function_schema("answer", "Give the final answer.", {"value": "string"}),
    ]

    def sample(self, index: int) -> tuple[dict[str, str], str]:
        """The hidden table and the asked key of sample ``index``."""
        rng = self.rng(index)
        keys = rng.sample(KEYS, self.options.num_keys)
        table = {k: rng.choice(VALUES) for k in keys}
        return table, rng.choice(keys)

    def new_session(self, index: int) -> tuple[ToolTaskSession, list[Message]]:
        """See :meth:`ToolTask.new_session`."""
        table, key = self.sample(index)
        prompt = f"Look up key \"{key}\" and answer its value."
        return LookupSession(table, key, self.max_turns), [{"role": "user", "content": prompt}]

    def expert(self, index: int) -> Expert:
        """``lookup(key)`` then ``answer(<the value returned>)``."""
        _, key = self.sample(index)
        value = yield "lookup", {"key": key}
        yield "answer", {"value": value}

    def careless(self, index: int) -> Expert:
        """Gives up at once: ``answer`` with an empty value, without looking the key up."""
        yield "answer", {"value": ""}
