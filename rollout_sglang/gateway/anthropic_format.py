"""The Anthropic Messages surface of the gateway (``POST /sessions/<id>/v1/messages``): a thin wire format over the
internal turn model (:mod:`~rollout_sglang.gateway.turn`).

:func:`parse_messages_request` checks a body field by field into a
:class:`~rollout_sglang.gateway.turn.TurnRequest`; anything the gateway cannot honour is refused with a 400 in
Anthropic's error shape naming the field. Content blocks map onto chat messages: ``text`` blocks are the text,
an assistant's ``tool_use`` blocks its tool calls (``input`` as JSON arguments) and its ``thinking`` block its
``reasoning_content``; a user message's ``tool_result`` blocks are tool messages (in order, before the text of
the same message); ``system`` is a system message first. ``tools`` (``name``, ``description``, ``input_schema``)
are the chat format's function tools; ``tool_choice`` ``auto`` / ``any`` / ``tool`` / ``none`` map onto auto /
required / the named tool / none.

``thinking``: a policy whose chat format reasons (Qwen3, GLM-4.5) answers its ``<think>`` block as a ``thinking``
block whether or not the request asks (its ``budget_tokens`` is not enforced beyond ``max_tokens``);
``{"type": "disabled"}`` forces the format's empty think block (Qwen3) or is refused (GLM-4.5), and
``{"type": "enabled"}`` is refused for a format that does not reason.

A turn answers :func:`message_body`; :func:`message_events` are the streaming events of the same message.
"""
from __future__ import annotations

import json
import re
import secrets
from typing import Any

from rollout_sglang.gateway import request_fields
from rollout_sglang.gateway.turn import Completion, ToolShape, TurnRequest, bad, function_tools

SUPPORTED_FIELDS = frozenset({
    "model", "max_tokens", "messages", "system", "tools", "tool_choice", "temperature", "top_p", "top_k",
    "stop_sequences", "stream", "thinking",
})
IGNORED_FIELDS = frozenset({"metadata", "service_tier"})
#: the oldest ``anthropic-version`` accepted (the header is a date; later ones, as newer SDKs send, are too: the
#: Messages fields served here are the same in every version since)
OLDEST_VERSION = "2023-01-01"
_VERSION = re.compile(r"\d{4}-\d{2}-\d{2}")
#: Most stop sequences in one request.
MAX_STOP = 16


def check_version(header: str | None) -> None:
    """ApiError 400 unless the ``anthropic-version`` header names a version this surface speaks."""
    if header is None:
        raise bad("anthropic-version", "header is required (the Messages API version, e.g. 2023-06-01); the "
                                       "anthropic SDK sends it")
    if not _VERSION.fullmatch(header.strip()) or header.strip() < OLDEST_VERSION:
        raise bad("anthropic-version", f"header {header!r:.40} is not supported; send a version date from "
                                       f"{OLDEST_VERSION} on, e.g. 2023-06-01")


def _blocks(content: Any, where: str) -> list[dict[str, Any]]:
    if isinstance(content, str):
        return [{"type": "text", "text": content}]
    if not isinstance(content, list):
        raise bad(where, f"must be a string or a list of content blocks, got {type(content).__name__}")
    for j, b in enumerate(content):
        if not isinstance(b, dict) or not isinstance(b.get("type"), str):
            raise bad(f"{where}[{j}]", "must be a content block object with a type")
    return content


def _text_of(content: Any, where: str) -> str:
    out = []
    for j, b in enumerate(_blocks(content, where)):
        if b["type"] != "text" or not isinstance(b.get("text"), str):
            raise bad(f"{where}[{j}]", f"only text blocks are supported here, got {b['type']!r:.60}")
        out.append(b["text"])
    return "".join(out)


def to_messages(messages: Any) -> list[dict[str, Any]]:
    """The request's ``messages`` as chat messages (see the module doc)."""
    if not isinstance(messages, list) or not messages:
        raise bad("messages", "must be a non-empty list of message objects")
    out: list[dict[str, Any]] = []
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise bad(where, f"must be an object, got {type(m).__name__}")
        role = m.get("role")
        if role not in ("user", "assistant"):
            raise bad(f"{where}.role", f"must be user or assistant, got {role!r:.60}")
        blocks = _blocks(m.get("content"), f"{where}.content")
        if role == "user":
            texts = []
            for j, b in enumerate(blocks):
                w = f"{where}.content[{j}]"
                if b["type"] == "text" and isinstance(b.get("text"), str):
                    texts.append(b["text"])
                elif b["type"] == "tool_result":
                    tid = b.get("tool_use_id")
                    if not isinstance(tid, str) or not tid:
                        raise bad(f"{w}.tool_use_id", "must be the id of the tool_use block this result answers")
                    c = b.get("content")
                    text = "" if c is None else _text_of(c, f"{w}.content")
                    out.append({"role": "tool", "tool_call_id": tid, "content": text})
                else:
                    raise bad(w, f"{b['type']!r:.60} blocks are not supported in user messages (text, tool_result)",
                              code="unsupported_parameter")
            if texts or not any(b["type"] == "tool_result" for b in blocks):
                out.append({"role": "user", "content": "".join(texts)})
            continue
        msg: dict[str, Any] = {"role": "assistant", "content": ""}
        texts, calls = [], []
        for j, b in enumerate(blocks):
            w = f"{where}.content[{j}]"
            if b["type"] == "text" and isinstance(b.get("text"), str):
                texts.append(b["text"])
            elif b["type"] == "thinking" and isinstance(b.get("thinking"), str):
                msg["reasoning_content"] = b["thinking"]
            elif b["type"] == "tool_use":
                name, cid, args = b.get("name"), b.get("id"), b.get("input", {})
                if not isinstance(name, str) or not name:
                    raise bad(f"{w}.name", "must be the called tool's name")
                if not isinstance(cid, str) or not cid:
                    raise bad(f"{w}.id", "must be the call's id (a string)")
                if not isinstance(args, dict):
                    raise bad(f"{w}.input", f"must be an object, got {type(args).__name__}")
                calls.append({"id": cid, "type": "function",
                              "function": {"name": name, "arguments": json.dumps(args, ensure_ascii=False)}})
            else:
                raise bad(w, f"{b['type']!r:.60} blocks are not supported in assistant messages (text, thinking, "
                             "tool_use)", code="unsupported_parameter")
        msg["content"] = "".join(texts)
        if calls:
            msg["tool_calls"] = calls
        out.append(msg)
    return out


#: Messages tools: ``{"name", "description", "input_schema"}`` (``type`` absent or "custom")
TOOL_SHAPE = ToolShape(kinds=(None, "custom"), other_kind="(a server or client tool of Anthropic's) is not supported: "
                       "define the tool with name, description and input_schema", under="", schema="input_schema",
                       schema_required=True, kind_code="unsupported_parameter")


def _tool_choice(value: Any, tools: list[dict[str, Any]]) -> tuple[str, str | None]:
    if value is None:
        return ("auto" if tools else "none"), None
    if not isinstance(value, dict) or value.get("type") not in ("auto", "any", "tool", "none"):
        raise bad("tool_choice", "must be {\"type\": \"auto\" | \"any\" | \"tool\" | \"none\"}")
    if value.get("disable_parallel_tool_use"):
        raise bad("tool_choice.disable_parallel_tool_use", "true is not supported: sampling cannot be held to one "
                                                           "call, and the trajectory keeps every call the model wrote",
                  code="unsupported_parameter")
    kind = value["type"]
    if kind in ("any", "tool") and not tools:
        raise bad("tool_choice", f"is {kind!r} but the request lists no tools")
    if kind == "tool":
        names = [t["function"]["name"] for t in tools]
        if value.get("name") not in names:
            raise bad("tool_choice.name", f"{value.get('name')!r:.60} is not one of the request's tools "
                                          f"({', '.join(names)})")
        return "function", value["name"]
    return {"auto": "auto", "any": "required", "none": "none"}[kind], None


def parse_messages_request(body: dict[str, Any], reasons: bool) -> TurnRequest:
    """Validate a Messages body (``reasons``: the policy's chat format has a think block); ApiError 400 naming the
    first field it cannot honour."""
    request_fields.refuse_unknown(body, SUPPORTED_FIELDS | IGNORED_FIELDS, "model, max_tokens, messages, system, "
                                  "tools, tool_choice, temperature, top_p, stop_sequences, stream, thinking")
    model = request_fields.model(body)
    max_tokens = body.get("max_tokens")
    if not (request_fields.is_int(max_tokens) and max_tokens >= 1):
        raise bad("max_tokens", f"is required: a positive integer, got {max_tokens!r:.60}")
    msgs = to_messages(body.get("messages"))
    system = body.get("system")
    if system is not None:
        text = system if isinstance(system, str) else _text_of(system, "system")
        msgs = [{"role": "system", "content": text}] + msgs
    tools = function_tools(body.get("tools"), TOOL_SHAPE)
    choice, forced = _tool_choice(body.get("tool_choice"), tools)
    temperature, top_p = request_fields.sampling(body, max_temperature=1)
    top_k = body.get("top_k")
    if top_k is not None and not (request_fields.is_int(top_k) and top_k >= 1):
        raise bad("top_k", f"must be a positive integer, got {top_k!r:.60}")
    stops = body.get("stop_sequences") or []
    if not isinstance(stops, list) or len(stops) > MAX_STOP or not all(isinstance(s, str) and s for s in stops):
        raise bad("stop_sequences", f"must be a list of at most {MAX_STOP} non-empty strings, got {stops!r:.80}")
    stream = request_fields.flag(body, "stream")
    thinking = body.get("thinking")
    no_think = False
    if thinking is not None:
        kind = thinking.get("type") if isinstance(thinking, dict) else None
        if kind not in ("enabled", "disabled"):
            raise bad("thinking", f"must be {{\"type\": \"enabled\", \"budget_tokens\": N}} or {{\"type\": "
                                  f"\"disabled\"}}, got {thinking!r:.80}")
        if kind == "enabled" and not reasons:
            raise bad("thinking", "is enabled but the policy's chat format does not reason (no think block): leave "
                                  "thinking out", code="unsupported_value")
        no_think = kind == "disabled"
    return TurnRequest(model=model, messages=msgs, tools=tools, tool_choice=choice, forced_tool=forced,
                       temperature=temperature, top_p=top_p, top_k=top_k, max_tokens=max_tokens,
                       stop=list(stops), stream=bool(stream), no_think=no_think)


# ------------------------------------------------------------------------------------------ responses
def new_id(prefix: str = "msg") -> str:
    """A fresh id (``msg_...``)."""
    return f"{prefix}_{secrets.token_hex(12)}"


def content_blocks(c: Completion) -> list[dict[str, Any]]:
    """The turn as content blocks: thinking, text, tool_use."""
    m = c.message
    out: list[dict[str, Any]] = []
    if m.get("reasoning_content"):
        out.append({"type": "thinking", "thinking": m["reasoning_content"], "signature": ""})
    calls = m.get("tool_calls") or []
    if m.get("content") or not calls:
        out.append({"type": "text", "text": m.get("content") or ""})
    for call in calls:
        try:
            args = json.loads(call["function"]["arguments"])
        except ValueError:
            args = None
        out.append({"type": "tool_use", "id": call["id"], "name": call["function"]["name"],
                    "input": args if isinstance(args, dict) else {"arguments": call["function"]["arguments"]}})
    return out


def stop_reason(c: Completion) -> str:
    """Anthropic's ``stop_reason`` of a turn."""
    if c.finish_reason == "tool_calls":
        return "tool_use"
    if c.finish_reason == "length":
        return "max_tokens"
    return "stop_sequence" if c.stop_sequence is not None else "end_turn"


def usage_body(c: Completion) -> dict[str, Any]:
    return {"input_tokens": c.prompt_tokens, "output_tokens": c.completion_tokens,
            "cache_creation_input_tokens": 0, "cache_read_input_tokens": 0}


def message_body(mid: str, model: str, c: Completion) -> dict[str, Any]:
    """A ``message`` object."""
    return {"id": mid, "type": "message", "role": "assistant", "model": model, "content": content_blocks(c),
            "stop_reason": stop_reason(c), "stop_sequence": c.stop_sequence, "usage": usage_body(c)}


def start_event(mid: str, model: str) -> dict[str, Any]:
    """``message_start`` (sent once the request is accepted; the usage comes with ``message_delta``)."""
    return {"type": "message_start", "message": {
        "id": mid, "type": "message", "role": "assistant", "model": model, "content": [], "stop_reason": None,
        "stop_sequence": None, "usage": {"input_tokens": 0, "output_tokens": 0}}}


def message_events(c: Completion) -> list[dict[str, Any]]:
    """The events after ``message_start``: per block its start, one delta and its stop; ``message_delta`` (stop
    reason and usage) and ``message_stop``."""
    out: list[dict[str, Any]] = []
    for i, b in enumerate(content_blocks(c)):
        if b["type"] == "thinking":
            out.append({"type": "content_block_start", "index": i,
                        "content_block": {"type": "thinking", "thinking": "", "signature": ""}})
            out.append({"type": "content_block_delta", "index": i,
                        "delta": {"type": "thinking_delta", "thinking": b["thinking"]}})
            out.append({"type": "content_block_delta", "index": i, "delta": {"type": "signature_delta",
                                                                             "signature": ""}})
        elif b["type"] == "text":
            out.append({"type": "content_block_start", "index": i, "content_block": {"type": "text", "text": ""}})
            out.append({"type": "content_block_delta", "index": i, "delta": {"type": "text_delta", "text": b["text"]}})
        else:
            out.append({"type": "content_block_start", "index": i,
                        "content_block": {"type": "tool_use", "id": b["id"], "name": b["name"], "input": {}}})
            out.append({"type": "content_block_delta", "index": i, "delta": {
                "type": "input_json_delta", "partial_json": json.dumps(b["input"], ensure_ascii=False)}})
        out.append({"type": "content_block_stop", "index": i})
    out.append({"type": "message_delta", "delta": {"stop_reason": stop_reason(c), "stop_sequence": c.stop_sequence},
                "usage": usage_body(c)})
    out.append({"type": "message_stop"})
    return out
