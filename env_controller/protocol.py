"""Records of the function-call environment protocol (AgentBench-FC / AgentRL task workers).

Every reply a task gives, in-process or over HTTP, is a :class:`TaskReply`: the OpenAI-style
messages that are new since the last reply, the tools (OpenAI function schemas, sent on
start), a status, whether the episode is finished, and the reward.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import Any


class SampleStatus(str, Enum):
    """Status strings exactly as AgentRL task workers send them on the wire."""

    RUNNING = "running"
    COMPLETED = "completed"
    AGENT_CONTEXT_LIMIT = "agent context limit"
    AGENT_VALIDATION_FAILED = "agent validation failed"
    AGENT_INVALID_ACTION = "agent invalid action"
    TASK_LIMIT_REACHED = "task limit reached"
    TASK_ERROR = "task error"
    CANCELLED = "cancelled"


@dataclass
class TaskReply:
    """One flat reply of ``start_sample`` or ``interact``.

    messages: OpenAI-style chat messages new since the previous reply (``system``/``user`` on
        start, ``tool`` messages with ``tool_call_id`` and ``content`` after an action).
    tools: OpenAI function schemas (``{"type": "function", "function": {...}}``); on start only.
    status: a :class:`SampleStatus`.
    finish: True once the episode is over; ``reward`` is final then.
    reward: scalar reward of the episode (0.0 until finished).
    metrics: task-specific numbers (e.g. ``success``), reported per task by the trainer.
    """

    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] = field(default_factory=list)
    status: SampleStatus = SampleStatus.RUNNING
    finish: bool = False
    reward: float = 0.0
    metrics: dict[str, float] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        """The wire form (status as its string)."""
        return {
            "messages": self.messages,
            "tools": self.tools,
            "status": self.status.value,
            "finish": self.finish,
            "reward": self.reward,
            "metrics": self.metrics,
        }

    @classmethod
    def from_json(cls, body: dict[str, Any]) -> "TaskReply":
        """Parse the wire form; raises ValueError naming the bad field."""
        try:
            status = SampleStatus(body.get("status", "running"))
        except ValueError:
            raise ValueError(
                f"unknown status {body.get('status')!r}; expected one of "
                f"{[s.value for s in SampleStatus]}"
            ) from None
        messages = body.get("messages", [])
        if not isinstance(messages, list):
            raise ValueError(f"'messages' must be a list of message objects, got {type(messages).__name__}")
        return cls(
            messages=messages,
            tools=list(body.get("tools") or []),
            status=status,
            finish=bool(body.get("finish", False)),
            reward=float(body.get("reward", 0.0) or 0.0),
            metrics=dict(body.get("metrics") or body.get("metric") or {}),
        )
