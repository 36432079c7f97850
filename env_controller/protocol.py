"""Records of the function-call environment protocol (AgentBench-FC / AgentRL task workers).

Every reply a task gives, in-process or over HTTP, is a :class:`TaskReply`: the OpenAI-style
messages that are new since the last reply, the tools (OpenAI function schemas, sent on
start), a status, whether the episode is finished, and the reward. Every action the agent sends
is one assistant message, checked by :func:`validate_assistant_messages`.
"""
from __future__ import annotations

import json
import math
from collections.abc import Callable
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
    error: why a finished session ended abnormally (the worker's or the controller's text, e.g. "worker
        ... declared dead"), "" otherwise; on the wire only when set.
    """

    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] = field(default_factory=list)
    status: SampleStatus = SampleStatus.RUNNING
    finish: bool = False
    reward: float = 0.0
    metrics: dict[str, float] = field(default_factory=dict)
    error: str = ""

    def to_json(self, metrics_key: str = "metrics") -> dict[str, Any]:
        """The wire form (status as its string); AgentRL task workers call the metrics ``metric``."""
        body = {
            "messages": self.messages,
            "tools": self.tools,
            "status": self.status.value,
            "finish": self.finish,
            "reward": self.reward,
            metrics_key: self.metrics,
        }
        if self.error:
            body["error"] = self.error
        return body

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
        messages = _list_field(body, "messages", lambda kind: ValueError(f"reply 'messages' is {kind}, not a list"))
        tools = body.get("tools") or []
        if not isinstance(tools, list):
            raise ValueError(f"reply 'tools' is {type(tools).__name__}, not a list")
        raw_status = body.get("status", "running")
        status = _STATUSES.get(raw_status) if isinstance(raw_status, str) else None
        if status is None:
            raise ValueError(f"reply status {raw_status!r} is not one of {sorted(_STATUSES)}")
        try:
            reward = float(body.get("reward") or 0.0)
        except (TypeError, ValueError, OverflowError):
            raise ValueError(f"reply reward {body.get('reward')!r:.100} is not a number") from None
        if not math.isfinite(reward):
            raise ValueError(f"reply reward {reward!r} is not a finite number")
        metrics = body.get("metrics")
        if metrics is None:
            metrics = body.get("metric")
        error = body.get("error")
        return cls(
            messages=messages,
            tools=tools,
            status=status,
            finish=bool(body.get("finish", False)) or status is not SampleStatus.RUNNING,
            reward=reward,
            metrics=metrics if isinstance(metrics, dict) else {},
            error=error[:MAX_ERROR_CHARS] if isinstance(error, str) else "",
        )


_STATUSES = {s.value: s for s in SampleStatus}


def _list_field(body: dict[str, Any], key: str, error: Callable[[str], Exception]) -> list[Any]:
    """``body[key]``, a list (absent or null: empty); else ``error(the value's type name)`` is raised."""
    value = body.get(key)
    if value is None:
        return []
    if not isinstance(value, list):
        raise error(type(value).__name__)
    return value
#: the most characters of a reply's ``error`` text kept (it reaches logs and every trajectory)
MAX_ERROR_CHARS = 2000


class MalformedMessageError(ValueError):
    """An interact body that is not ``[assistant message]`` of the OpenAI shape."""


def validate_assistant_messages(messages: Any) -> dict[str, Any]:
    """Check an interact body and return its assistant message, normalized.

    ``messages`` must be a list holding one ``{"role": "assistant", "content": str | None,
    "tool_calls": [...] | None}``; each tool call must be ``{"id": str (optional), "type":
    "function" (optional), "function": {"name": str, "arguments": str | dict}}``. The returned
    copy has ``content`` as a string, ``tool_calls`` as a list, every call with an ``id`` and
    ``type``, and dict ``arguments`` serialized to JSON. Invalid JSON inside ``arguments`` is not
    a shape error: the task answers it with an explanatory tool message.
    Raises :class:`MalformedMessageError` naming the bad field.
    """
    if not isinstance(messages, list) or len(messages) != 1:
        got = f"a list of {len(messages)}" if isinstance(messages, list) else type(messages).__name__
        raise MalformedMessageError(f"'messages' must be a list holding exactly one assistant message, got {got}")
    message = messages[0]
    if not isinstance(message, dict):
        raise MalformedMessageError(f"messages[0] must be an object, got {type(message).__name__}")
    if message.get("role") != "assistant":
        raise MalformedMessageError(f"messages[0].role must be 'assistant', got {message.get('role')!r:.100}")
    content = message.get("content")
    if content is not None and not isinstance(content, str):
        raise MalformedMessageError(f"messages[0].content must be a string or null, got {type(content).__name__}")
    calls = _list_field(message, "tool_calls", lambda kind: MalformedMessageError(
        f"messages[0].tool_calls must be a list or null, got {kind}"))
    out_calls: list[dict[str, Any]] = []
    for i, call in enumerate(calls):
        where = f"messages[0].tool_calls[{i}]"
        if not isinstance(call, dict):
            raise MalformedMessageError(f"{where} must be an object, got {type(call).__name__}")
        call_id = call.get("id")
        if call_id is None:
            call_id = f"call_{i}"
        elif not isinstance(call_id, str) or not call_id:
            raise MalformedMessageError(f"{where}.id must be a non-empty string, got {call_id!r:.100}")
        if call.get("type", "function") != "function":
            raise MalformedMessageError(f"{where}.type must be 'function', got {call.get('type')!r:.100}")
        fn = call.get("function")
        if not isinstance(fn, dict):
            raise MalformedMessageError(
                f"{where}.function must be an object with 'name' and 'arguments', got {fn!r:.100}"
            )
        name = fn.get("name")
        if not isinstance(name, str) or not name:
            raise MalformedMessageError(f"{where}.function.name must be a non-empty string, got {name!r:.100}")
        arguments = fn.get("arguments", "{}")
        if isinstance(arguments, dict):
            arguments = json.dumps(arguments, ensure_ascii=False)  # escaping non-ASCII text would inflate it
        elif arguments is None:
            arguments = "{}"
        elif not isinstance(arguments, str):
            raise MalformedMessageError(
                f"{where}.function.arguments must be a JSON string, got {type(arguments).__name__}"
            )
        out_calls.append({"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}})
    return {"role": "assistant", "content": content or "", "tool_calls": out_calls}
