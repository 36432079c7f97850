"""Driving a task through the in-process client: an assistant message with one tool call, and an
episode replayed from a list of assistant messages."""
from __future__ import annotations

import json
from typing import Any

from env_controller.local import LocalEnvClient
from env_controller.protocol import TaskReply
from env_controller.tasks.base import make_tool_call


def call(name: str, args: Any, call_id: str = "c0") -> dict[str, Any]:
    """An assistant message with one tool call; ``args`` dict (JSON-encoded) or a raw string."""
    message = make_tool_call(call_id, name, {})
    message["function"]["arguments"] = args if isinstance(args, str) else json.dumps(args)
    return {"role": "assistant", "content": "", "tool_calls": [message]}


async def replay(c: LocalEnvClient, name: str, index: int,
                 assistant: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], TaskReply]:
    """Start sample ``index`` of task ``name`` and send the assistant messages in order; return the
    whole conversation and the last reply."""
    sid, reply = await c.start_sample(name, index)
    conversation = list(reply.messages)
    for message in assistant:
        assert not reply.finish
        conversation.append(message)
        reply = await c.interact(sid, [message])
        conversation.extend(reply.messages)
    return conversation, reply
