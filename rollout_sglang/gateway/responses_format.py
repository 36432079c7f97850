"""The OpenAI Responses surface of the gateway (``POST /sessions/<id>/v1/responses``): a thin wire format over the
internal turn model (:mod:`~rollout_sglang.gateway.turn`).

:func:`parse_responses_request` checks a body field by field into a :class:`ResponsesRequest` (the
:class:`~rollout_sglang.gateway.turn.TurnRequest` without the history a ``previous_response_id`` names, which the
server resolves in the session); anything the gateway cannot honour is refused with a 400 naming the field.
Input items map onto chat messages: ``message`` items (``input_text`` / ``output_text`` parts) by role,
``function_call`` items onto the tool calls of the assistant message they follow (or a new one),
``function_call_output`` onto tool messages, ``reasoning`` items onto the ``reasoning_content`` of the assistant
message that follows them; ``instructions`` is a system message first.

A turn answers :func:`response_body`: a ``reasoning`` item (formats that reason), a ``message`` item with the text,
one ``function_call`` item per call; ``status`` "incomplete" (``max_output_tokens``) when the turn was cut at the
token limit. :func:`response_events` are the streaming events of the same response.
"""
from __future__ import annotations

import secrets
from dataclasses import dataclass, field
from typing import Any

from rollout_sglang.gateway import request_fields
from rollout_sglang.gateway.turn import Completion, ToolShape, TurnRequest, bad, function_tools, openai_tool_choice

SUPPORTED_FIELDS = frozenset({
    "model", "input", "instructions", "tools", "tool_choice", "temperature", "top_p", "max_output_tokens", "stream",
    "stream_options", "previous_response_id", "parallel_tool_calls", "reasoning", "include", "text", "truncation",
    "store", "top_logprobs", "background", "max_tool_calls",
})
#: bookkeeping of the caller: accepted and ignored
IGNORED_FIELDS = frozenset({"user", "metadata", "service_tier", "prompt_cache_key", "prompt_cache_retention",
                            "safety_identifier"})
#: ``include`` values honoured (the reasoning's encrypted content: there is none, the items carry the text)
INCLUDES = frozenset({"message.output_text.logprobs", "reasoning.encrypted_content"})
ROLES = {"user": "user", "system": "system", "developer": "system", "assistant": "assistant"}


@dataclass
class ResponsesRequest:
    """A validated Responses request: ``turn`` (messages without the ``previous_response_id`` history and without
    the instructions), ``instructions`` (None: none), ``previous_response_id``, and what the response echoes."""

    turn: TurnRequest
    instructions: str | None = None
    previous_response_id: str | None = None
    tools: list[dict[str, Any]] = field(default_factory=list)
    tool_choice: Any = "auto"
    store: bool = True
    echo: dict[str, Any] = field(default_factory=dict)


def _parts_text(content: Any, where: str, kinds: tuple[str, ...]) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise bad(where, f"must be a string or a list of content parts, got {type(content).__name__}")
    out = []
    for j, p in enumerate(content):
        kind = p.get("type") if isinstance(p, dict) else type(p).__name__
        if not isinstance(p, dict) or kind not in kinds or not isinstance(p.get("text"), str):
            raise bad(f"{where}[{j}]", f"only text parts ({', '.join(kinds)}) are supported, got {kind!r:.60}")
        out.append(p["text"])
    return "".join(out)


def input_messages(value: Any) -> list[dict[str, Any]]:
    """The ``input`` (a string or a list of items) as chat messages (see the module doc)."""
    if isinstance(value, str):
        return [{"role": "user", "content": value}]
    if not isinstance(value, list):
        raise bad("input", f"must be a string or a list of input items, got {type(value).__name__}")
    msgs: list[dict[str, Any]] = []
    cur: dict[str, Any] | None = None  # the assistant message being assembled from output items
    for i, item in enumerate(value):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise bad(where, f"must be an object, got {type(item).__name__}")
        kind = item.get("type", "message" if "role" in item else None)
        if kind == "message":
            role = ROLES.get(item.get("role"))  # type: ignore[arg-type]
            if role is None:
                raise bad(f"{where}.role", f"must be user, system, developer or assistant; got "
                                           f"{item.get('role')!r:.60}")
            kinds = ("output_text", "input_text", "text") if role == "assistant" else ("input_text", "text",
                                                                                       "output_text")
            text = _parts_text(item.get("content"), f"{where}.content", kinds)
            if role == "assistant":
                if cur is not None and not cur["content"] and not cur.get("tool_calls"):
                    cur["content"] = text
                else:
                    cur = {"role": "assistant", "content": text}
                    msgs.append(cur)
            else:
                cur = None
                msgs.append({"role": role, "content": text})
        elif kind == "function_call":
            name, args, call_id = item.get("name"), item.get("arguments", "{}"), item.get("call_id")
            if not isinstance(name, str) or not name:
                raise bad(f"{where}.name", "must be the called tool's name")
            if not isinstance(args, str):
                raise bad(f"{where}.arguments", f"must be a JSON string, got {type(args).__name__}")
            if not isinstance(call_id, str) or not call_id:
                raise bad(f"{where}.call_id", "must be the call's id (a string)")
            if cur is None:
                cur = {"role": "assistant", "content": ""}
                msgs.append(cur)
            cur.setdefault("tool_calls", []).append(
                {"id": call_id, "type": "function", "function": {"name": name, "arguments": args}})
        elif kind == "function_call_output":
            call_id = item.get("call_id")
            if not isinstance(call_id, str) or not call_id:
                raise bad(f"{where}.call_id", "must be the id of the call this output answers")
            out = item.get("output")
            text = out if isinstance(out, str) else _parts_text(out, f"{where}.output", ("input_text", "text"))
            cur = None
            msgs.append({"role": "tool", "tool_call_id": call_id, "content": text})
        elif kind == "reasoning":
            parts = item.get("content") or item.get("summary") or []
            text = _parts_text(parts, f"{where}.content", ("reasoning_text", "summary_text"))
            if cur is not None and (cur["content"] or cur.get("tool_calls")):
                cur = None
            if cur is None:
                cur = {"role": "assistant", "content": ""}
                msgs.append(cur)
            if text:
                cur["reasoning_content"] = text
        elif kind == "item_reference":
            raise bad(f"{where}.type", "item_reference is not supported: send the items themselves, or chain with "
                                       "previous_response_id", code="unsupported_parameter")
        else:
            raise bad(f"{where}.type", f"{kind!r:.60} items are not supported (message, function_call, "
                                       "function_call_output, reasoning)", code="unsupported_parameter")
    return msgs


#: Responses tools: ``{"type": "function", "name", "description", "parameters"}``
TOOL_SHAPE = ToolShape(kinds=("function",), other_kind="tools are not supported: this gateway serves function tools "
                       "only (the agent runs its tools itself)", under="", schema="parameters",
                       schema_required=False, kind_code="unsupported_parameter")


def parse_responses_request(body: dict[str, Any]) -> ResponsesRequest:
    """Validate a Responses body; ApiError 400 naming the first field it cannot honour."""
    request_fields.refuse_unknown(body, SUPPORTED_FIELDS | IGNORED_FIELDS, "model, input, instructions, tools, "
                                  "tool_choice, temperature, top_p, max_output_tokens, stream, "
                                  "previous_response_id, include")
    model = request_fields.model(body)
    if "input" not in body:
        raise bad("input", "is required: a string or a list of input items")
    msgs = input_messages(body.get("input"))
    instructions = body.get("instructions")
    if instructions is not None and not isinstance(instructions, str):
        raise bad("instructions", f"must be a string, got {type(instructions).__name__}")
    prev = body.get("previous_response_id")
    if prev is not None and (not isinstance(prev, str) or not prev):
        raise bad("previous_response_id", f"must be the id of an earlier response, got {prev!r:.60}")
    if not msgs and prev is None:
        raise bad("input", "is empty; give at least one input item")
    tools = function_tools(body.get("tools"), TOOL_SHAPE)
    choice, forced = openai_tool_choice(body.get("tool_choice"), tools, "")
    temperature, top_p = request_fields.sampling(body, max_temperature=2)
    max_tokens = body.get("max_output_tokens")
    if max_tokens is not None and not (request_fields.is_int(max_tokens) and max_tokens >= 1):
        raise bad("max_output_tokens", f"must be a positive integer, got {max_tokens!r:.60}")
    stream = request_fields.flag(body, "stream")
    opts = body.get("stream_options")
    if opts is not None and (not stream or not isinstance(opts, dict) or set(opts) - {"include_obfuscation"}):
        raise bad("stream_options", "is only {\"include_obfuscation\": bool}, with stream: true")
    include = body.get("include") or []
    if not isinstance(include, list) or not all(isinstance(x, str) for x in include):
        raise bad("include", f"must be a list of strings, got {include!r:.80}")
    other = sorted(set(include) - INCLUDES)
    if other:
        raise bad("include", f"{other[0]!r:.60} is not supported (only {', '.join(sorted(INCLUDES))})",
                  code="unsupported_parameter")
    request_fields.refuse_serial_tool_calls(body)
    if body.get("top_logprobs") not in (None, 0):
        raise bad("top_logprobs", "is not supported: the engines report the log-prob of the sampled token only "
                                  "(include message.output_text.logprobs)", code="unsupported_parameter")
    if body.get("background"):
        raise bad("background", "true is not supported: every response is answered in its request",
                  code="unsupported_parameter")
    if body.get("max_tool_calls") is not None:
        raise bad("max_tool_calls", "is not supported: sampling cannot be held to a number of calls, and the "
                                    "trajectory keeps every call the model wrote", code="unsupported_parameter")
    if body.get("truncation") not in (None, "disabled"):
        raise bad("truncation", f"{body['truncation']!r:.40} is not supported: a trajectory keeps the conversation "
                                "as sent (only 'disabled'); a conversation over the context limit ends the episode",
                  code="unsupported_parameter")
    text = body.get("text")
    fmt = text.get("format") if isinstance(text, dict) else None
    if text is not None and (not isinstance(text, dict) or (fmt is not None and (not isinstance(fmt, dict)
                                                                                 or fmt.get("type") != "text"))):
        raise bad("text.format", "only {\"type\": \"text\"} is supported: structured output would constrain "
                                 "sampling, which the trainer does not score", code="unsupported_parameter")
    reasoning = body.get("reasoning")
    if reasoning is not None and not isinstance(reasoning, dict):
        raise bad("reasoning", f"must be an object ({{\"effort\", \"summary\"}}), got {type(reasoning).__name__}")
    store = request_fields.flag(body, "store")
    turn = TurnRequest(model=model, messages=msgs, tools=tools, tool_choice=choice, forced_tool=forced,
                       temperature=temperature, top_p=top_p, max_tokens=max_tokens, stream=bool(stream),
                       logprobs="message.output_text.logprobs" in include)
    echo = {"instructions": instructions, "max_output_tokens": max_tokens, "temperature": body.get("temperature"),
            "top_p": body.get("top_p"), "metadata": body.get("metadata") or {}, "previous_response_id": prev,
            "reasoning": reasoning or {"effort": None, "summary": None}, "text": {"format": {"type": "text"}},
            "tools": body.get("tools") or [], "tool_choice": body.get("tool_choice") or "auto",
            "parallel_tool_calls": True, "truncation": "disabled", "store": store is not False,
            "user": body.get("user")}
    return ResponsesRequest(turn, instructions, prev, tools, body.get("tool_choice") or "auto", store is not False,
                            echo)


# ------------------------------------------------------------------------------------------ responses
def new_id(prefix: str) -> str:
    """A fresh object id (``resp_...``, ``msg_...``, ``fc_...``, ``rs_...``)."""
    return f"{prefix}_{secrets.token_hex(12)}"


def output_items(c: Completion, logprobs: list[dict[str, Any]] | None) -> list[dict[str, Any]]:
    """The output items of a turn: reasoning, the message (text), the function calls."""
    m = c.message
    status = "incomplete" if c.finish_reason == "length" else "completed"
    items: list[dict[str, Any]] = []
    if m.get("reasoning_content"):
        items.append({"id": new_id("rs"), "type": "reasoning", "summary": [], "status": status,
                      "content": [{"type": "reasoning_text", "text": m["reasoning_content"]}]})
    calls = m.get("tool_calls") or []
    if m.get("content") or not calls:
        part: dict[str, Any] = {"type": "output_text", "text": m.get("content") or "", "annotations": []}
        if logprobs is not None:
            part["logprobs"] = logprobs
        items.append({"id": new_id("msg"), "type": "message", "role": "assistant", "status": status,
                      "content": [part]})
    for call in calls:
        items.append({"id": new_id("fc"), "type": "function_call", "call_id": call["id"],
                      "name": call["function"]["name"], "arguments": call["function"]["arguments"],
                      "status": "completed"})
    return items


def usage_body(c: Completion) -> dict[str, Any]:
    """``usage`` of a response."""
    return {"input_tokens": c.prompt_tokens, "input_tokens_details": {"cached_tokens": 0},
            "output_tokens": c.completion_tokens, "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": c.prompt_tokens + c.completion_tokens}


def response_body(rid: str, created: int, model: str, echo: dict[str, Any], output: list[dict[str, Any]],
                  c: Completion | None, status: str | None = None) -> dict[str, Any]:
    """A ``response`` object (``c`` None: the in-progress shell a stream opens with)."""
    if status is None:
        status = "incomplete" if c is not None and c.finish_reason == "length" else "completed"
    return {"id": rid, "object": "response", "created_at": created, "status": status, "model": model,
            "output": output, "error": None,
            "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
            "usage": usage_body(c) if c is not None else None, "background": False, **echo}


def assistant_message(c: Completion) -> dict[str, Any]:
    """The turn's reply as a chat message, as the session stores it for ``previous_response_id``."""
    m = dict(c.message)
    m["content"] = m.get("content") or ""
    return m


def response_events(rid: str, created: int, model: str, echo: dict[str, Any], c: Completion,
                    logprobs: list[dict[str, Any]] | None, seq: int) -> list[dict[str, Any]]:
    """The streaming events after ``response.created`` and ``response.in_progress`` (numbered from ``seq``): per
    output item its ``added`` event, its text or arguments as one delta and the ``done`` events, then
    ``response.completed`` (or ``response.incomplete``) with the whole response."""
    items = output_items(c, logprobs)
    events: list[dict[str, Any]] = []

    def ev(kind: str, **kw: Any) -> None:
        events.append({"type": kind, "sequence_number": seq + len(events), **kw})

    for i, item in enumerate(items):
        shell = dict(item, status="in_progress")
        if item["type"] == "message":
            shell["content"] = []
        elif item["type"] == "function_call":
            shell["arguments"] = ""
        elif item["type"] == "reasoning":
            shell["content"] = []
        ev("response.output_item.added", output_index=i, item=shell)
        if item["type"] == "message":
            part = item["content"][0]
            ev("response.content_part.added", item_id=item["id"], output_index=i, content_index=0,
               part={"type": "output_text", "text": "", "annotations": []})
            ev("response.output_text.delta", item_id=item["id"], output_index=i, content_index=0, delta=part["text"],
               logprobs=[{k: x[k] for k in ("token", "logprob", "top_logprobs")} for x in logprobs or []])
            ev("response.output_text.done", item_id=item["id"], output_index=i, content_index=0, text=part["text"],
               logprobs=[])
            ev("response.content_part.done", item_id=item["id"], output_index=i, content_index=0, part=part)
        elif item["type"] == "reasoning":
            text = item["content"][0]["text"]
            ev("response.content_part.added", item_id=item["id"], output_index=i, content_index=0,
               part={"type": "reasoning_text", "text": ""})
            ev("response.reasoning_text.delta", item_id=item["id"], output_index=i, content_index=0, delta=text)
            ev("response.reasoning_text.done", item_id=item["id"], output_index=i, content_index=0, text=text)
            ev("response.content_part.done", item_id=item["id"], output_index=i, content_index=0,
               part={"type": "reasoning_text", "text": text})
        else:
            ev("response.function_call_arguments.delta", item_id=item["id"], output_index=i,
               delta=item["arguments"])
            ev("response.function_call_arguments.done", item_id=item["id"], output_index=i,
               arguments=item["arguments"], name=item["name"])
        ev("response.output_item.done", output_index=i, item=item)
    body = response_body(rid, created, model, echo, items, c)
    ev("response.completed" if body["status"] == "completed" else "response.incomplete", response=body)
    return events


def opening_events(rid: str, created: int, model: str, echo: dict[str, Any]) -> list[dict[str, Any]]:
    """``response.created`` and ``response.in_progress`` (sequence numbers 0, 1)."""
    shell = response_body(rid, created, model, echo, [], None, status="in_progress")
    return [{"type": "response.created", "sequence_number": 0, "response": shell},
            {"type": "response.in_progress", "sequence_number": 1, "response": shell}]


def error_event(e: Any, seq: int) -> dict[str, Any]:
    """The ``error`` event of a stream that fails after it opened."""
    return {"type": "error", "sequence_number": seq, "code": e.code, "message": e.message, "param": e.param}
