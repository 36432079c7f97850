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

    def to_json(self, metrics_key: str = "metrics") -> dict[str, Any]:
        """The wire form (status as its string); AgentRL task workers call the metrics ``metric``."""
        return {
            "messages": self.messages,
            "tools": self.tools,
            "status": self.status.value,
            "finish": self.finish,
            "reward": self.reward,
            metrics_key: self.metrics,
        }

    @classmethod
    def from_json(cls, body: Any) -> "TaskReply":
        """Parse a reply in any of its wire forms; raises ValueError naming the bad field.

        Accepts the flat form and AgentRL's interact reply ``{"session_id", "env_out": {...}}``,
        with ``metrics`` or ``metric``. A status other than ``running`` implies ``finish``.
        """
        if isinstance(body, dict) and isinstance(body.get("env_out"), dict):
            body = body["env_out"]
        if not isinstance(body, dict):
            raise ValueError(f"reply is not a JSON object but {type(body).__name__}")
        messages = body.get("messages")
        if messages is None:
            messages = []
        if not isinstance(messages, list):
            raise ValueError(f"reply 'messages' is {type(messages).__name__}, not a list")
        tools = body.get("tools") or []
        if not isinstance(tools, list):
            raise ValueError(f"reply 'tools' is {type(tools).__name__}, not a list")
        raw_status = body.get("status", "running")
        status = _STATUSES.get(raw_status) if isinstance(raw_status, str) else None
        if status is None:
            raise ValueError(f"reply status {raw_status!r} is not one of {sorted(_STATUSES)}")
        try:
            reward = float(body.get("reward") or 0.0)
        except (TypeError, ValueError):
            raise ValueError(f"reply reward {body.get('reward')!r} is not a number") from None
        metrics = body.get("metrics")
        if metrics is None:
            metrics = body.get("metric")
        return cls(
            messages=messages,
            tools=tools,
            status=status,
            finish=bool(body.get("finish", False)) or status is not SampleStatus.RUNNING,
            reward=reward,
            metrics=metrics if isinstance(metrics, dict) else {},
        )


_STATUSES = {s.value: s for s in SampleStatus}
