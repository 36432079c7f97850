"""Driving a task through the in-process client: an assistant message with one tool call, an
episode replayed from a list of assistant messages, and an OS-shell session taking hostile commands."""
from __future__ import annotations

import json
from typing import Any

from env_controller.clients.local import LocalEnvClient
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


async def attempts_then_solve(c: LocalEnvClient, index: int, attempts: list[tuple[str, list[str]]]) -> TaskReply:
    """On os_shell sample ``index`` (a question), run each ``(script, expected)`` of ``attempts`` as a
    ``bash_action``: the reply must hold every expected text and leave the episode running. Then solve
    the sample with its solution: the answer must be right (the sandbox survived). Returns the last reply."""
    task = c.tasks["os_shell"]
    sid, _ = await c.start_sample("os_shell", index)
    for script, expected in attempts:
        reply = await c.interact(sid, [call("bash_action", {"script": script})])
        content = reply.messages[0]["content"]
        assert all(e in content for e in expected), (script, content)
        if not any("memory" in e.lower() for e in expected):  # a process the memory limit killed is reported
            assert "Killed" not in content, (script, content)  # but no job notice of bash's own
        assert reply.status.value == "running" and not reply.finish, (script, reply)
        assert len(content) < 4500, script  # max_output_chars=4000 plus the messages
    reply = await c.interact(sid, [call("bash_action", {"script": task.sample(index).solution})])
    reply = await c.interact(sid, [call("answer_action", {"answer": reply.messages[0]["content"]})])
    assert reply.finish and reply.reward == 1.0, reply
    assert reply.metrics["commands"] == len(attempts) + 1
    return reply
