"""A plain tool-calling agent written only against the ``openai`` package, trained through the gateway.

``examples/configs/tiny_cpu_gateway.yaml`` names it as ``rollout.agent_fn``: the trainer calls
:func:`run_agent` once per sample with a client pointed at a fresh gateway session. The loop is the
usual one: ask for a completion with the tools, hand the reply to whatever executes the tools, append
the results, ask again. Here the tools run in the task's environment, which the gateway reaches at
``/env`` under the same base URL; an agent whose tools run in its own code would call them itself and
return its reward instead of None.
"""
from __future__ import annotations

from typing import Any

import openai


async def run_agent(client: openai.AsyncOpenAI, sample: dict[str, Any]) -> float | None:
    """Play one episode; returns None: the task's environment scores it when it ends it.

    sample: ``task``, ``index``, ``model``, ``messages`` (the episode's opening messages) and ``tools``
    (OpenAI function schemas), among others.
    """
    messages: list[Any] = list(sample["messages"])
    tools = sample["tools"] or openai.omit
    while True:
        try:
            completion = await client.chat.completions.create(model=sample["model"], messages=messages, tools=tools)
        except openai.BadRequestError as e:
            if e.code in ("context_length_exceeded", "turn_limit_reached"):
                return None  # the gateway ended the episode at its limit
            raise
        reply = completion.choices[0].message
        messages.append(reply)
        # a reply without tool calls is the agent's final word: the environment ends the episode on it
        step = await client.post("/env", body={"messages": [reply.model_dump(exclude_none=True)]}, cast_to=object)
        if step["finish"]:
            return None
        messages.extend(step["messages"])
