"""The conversations the chat-template tests render, and a jinja2 chat template rendered as Hugging
Face renders it, and an engine that plays a scripted episode; shared by the chat-template tests."""
from __future__ import annotations

import asyncio
import json
from typing import Any

from jinja2.sandbox import ImmutableSandboxedEnvironment


def tool_call(cid: str, name: str, args: dict) -> dict:
    """An OpenAI tool call with JSON-string arguments."""
    return {"id": cid, "type": "function", "function": {"name": name, "arguments": json.dumps(args)}}


# system, user, calls with content / several calls / no content, tool results (one JSON), a late
# user turn and a final plain answer; non-ASCII text throughout
CONVERSATION = [
    {"role": "system", "content": "You are a careful research agent."},
    {"role": "user", "content": "Who wrote Le Petit Prince? Answer with the name."},
    {"role": "assistant", "content": "I will search for it.",
     "tool_calls": [tool_call("call_0", "search", {"q": "Le Petit Prince auteur"})]},
    {"role": "tool", "tool_call_id": "call_0", "content": "Antoine de Saint-Exupéry (1943)."},
    {"role": "assistant", "content": "",
     "tool_calls": [tool_call("call_1", "search", {"q": "Saint-Exupéry"}),
                    tool_call("call_2", "search", {"q": "1943 novella"})]},
    {"role": "tool", "tool_call_id": "call_1", "content": "French writer and aviator."},
    {"role": "tool", "tool_call_id": "call_2", "content": "{\"title\": \"The Little Prince\"}"},
    {"role": "user", "content": "Please submit now."},
    {"role": "assistant", "content": None,
     "tool_calls": [tool_call("call_3", "submit", {"answer": "Antoine de Saint-Exupéry"})]},
    {"role": "tool", "tool_call_id": "call_3", "content": "ok"},
    {"role": "assistant", "content": "Done: Antoine de Saint-Exupéry."},
]


def hf_tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None,
              sort_keys: bool = False) -> str:
    """The ``tojson`` filter as Hugging Face's chat-template environment defines it (non-ASCII kept)."""
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def render_jinja(template: str, messages: list[dict], tools: list[dict] | None, add_generation_prompt: bool) -> str:
    """Render the jinja chat ``template`` with jinja2 configured as Hugging Face does; ``messages``
    must already be in the shape the template expects."""
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.filters["tojson"] = hf_tojson
    return env.from_string(template).render(messages=messages, tools=tools,
                                            add_generation_prompt=add_generation_prompt)


def mask_spans(mask: list[int]) -> list[tuple[int, int]]:
    """``(start, end)`` of each run of 1s in a loss mask, end exclusive."""
    spans: list[tuple[int, int]] = []
    start = None
    for j, m in enumerate(mask + [0]):
        if m and start is None:
            start = j
        if not m and start is not None:
            spans.append((start, j))
            start = None
    return spans


# For formats that render reasoning (GLM-4.5): reasoning before the last user turn (as ``reasoning_content``)
# and after it (as a ``<think>`` block opening the content, and as ``reasoning_content``), arguments of every
# JSON type (a string that looks like a number too), non-ASCII names and values, several calls in one turn,
# consecutive tool messages, a turn with calls and no content.
TRIP_TOOLS = [
    {"type": "function", "function": {
        "name": "search_trains", "description": "Trains between two stations (駅).",
        "parameters": {"type": "object", "properties": {
            "from": {"type": "string"}, "to": {"type": "string"}, "max_changes": {"type": "integer"},
            "filters": {"type": "object"}, "date": {"type": ["string", "null"]}}}}},
    {"type": "function", "function": {
        "name": "book", "description": "Book a seat.",
        "parameters": {"type": "object", "properties": {
            "train": {"type": "string"}, "price": {"type": "number"}, "window": {"type": "boolean"},
            "seat": {"type": "string"}}}}},
]
REASONING_CONVERSATION = [
    {"role": "system", "content": "You plan train trips. Réponds brièvement."},
    {"role": "user", "content": "東京から大阪へ、乗り換えは1回まで。"},
    {"role": "assistant", "reasoning_content": "\nThe user wants Tokyo → Osaka, at most one change.\n",
     "content": "Let me look.",
     "tool_calls": [tool_call("call_0", "search_trains", {
         "from": "東京", "to": "大阪", "max_changes": 1,
         "filters": {"fast": True, "classes": ["green", "ordinary"], "note": "é"}, "date": None})]},
    {"role": "tool", "tool_call_id": "call_0", "content": "Nozomi 1 (10:03), Hikari 5 (10:33)"},
    {"role": "user", "content": "Book the Nozomi, a window seat."},
    {"role": "assistant", "content": "<think>\nNozomi 1 it is; book it twice to compare.\n</think>\n\n",
     "tool_calls": [tool_call("call_1", "book", {"train": "Nozomi 1", "price": 14720.5, "window": True,
                                                 "seat": "42"}),
                    tool_call("call_2", "book", {"train": "Hikari 5", "window": False})]},
    {"role": "tool", "tool_call_id": "call_1", "content": "booked: car 7, seat 42"},
    {"role": "tool", "tool_call_id": "call_2", "content": "{\"error\": \"sold out\"}"},
    {"role": "assistant", "reasoning_content": "One booking worked.",
     "content": "  Booked: Nozomi 1, car 7, seat 42 (窓側).  "},
]


class ScriptEngine:
    """Emits ``script[k]`` (plus the token ``end_id`` when given) on its k-th call, one episode; log-prob
    -(k + 1) per token. Each prompt must end with ``prompt_end`` (the format's generation prompt) and each
    turn with one of the sampling's stop tokens."""

    def __init__(self, template: Any, script: list[str], prompt_end: str, end_id: int | None = None) -> None:
        self.template, self.script, self.prompt_end, self.end_id = template, script, prompt_end, end_id
        self.calls = 0

    async def generate(self, prompts: list[list[int]], params: Any) -> list[Any]:
        """One scripted turn for each prompt."""
        from rollout_sglang.engines.protocol import GenerationOutput

        turn, self.calls = self.calls, self.calls + 1
        outs = []
        for p in prompts:
            assert self.template.decode(p).endswith(self.prompt_end)
            ids = self.template.tokenizer.encode(self.script[turn], add_special_tokens=False)
            if self.end_id is not None:
                ids.append(self.end_id)
            assert ids[-1] in params.stop_token_ids
            outs.append(GenerationOutput(ids, [-(turn + 1.0)] * len(ids), "stop", 3))
        await asyncio.sleep(0)
        return outs
