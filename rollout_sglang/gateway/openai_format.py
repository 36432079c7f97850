"""The OpenAI Chat Completions surface of the gateway: request validation, response bodies, stream chunks.

:func:`parse_chat_request` checks a request body field by field and returns a :class:`ChatRequest`;
anything it cannot honour is refused with :class:`ApiError` (HTTP 400) naming the field, so an agent
never gets a silently different behaviour. Errors travel in OpenAI's shape (``{"error": {"message",
"type", "param", "code"}}``), which the ``openai`` client turns into its typed exceptions.

Messages are normalized for the chat templates (content as text, ``developer`` as ``system``) and get a
comparison key (:func:`message_key`) that holds exactly what a template renders: the role, the text,
and each tool call's name and arguments (compared as JSON values). An assistant's ``reasoning_content``
(GLM-4.5) is kept for rendering but left out of the key: a turn the gateway sampled is in the session as
its tokens, reasoning included, whether or not the agent sends the reasoning back.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from rollout_sglang.gateway import request_fields
from rollout_sglang.gateway.turn import ToolShape, TurnRequest, bad, function_tools, openai_tool_choice

#: The Chat Completions request is the internal turn request as it is.
ChatRequest = TurnRequest

#: Request fields the gateway honours.
SUPPORTED_FIELDS = frozenset({
    "model", "messages", "tools", "tool_choice", "temperature", "top_p", "max_tokens", "max_completion_tokens",
    "stop", "seed", "n", "stream", "stream_options", "logprobs", "top_logprobs", "parallel_tool_calls",
})
#: Fields that change nothing about sampling (bookkeeping of the caller): accepted and ignored.
IGNORED_FIELDS = frozenset({"user", "metadata", "store", "service_tier", "prompt_cache_key", "safety_identifier"})
#: Fields accepted only at the value that means "off" (frameworks send them by default).
NEUTRAL_VALUES: dict[str, tuple[Any, ...]] = {
    "frequency_penalty": (0, 0.0, None), "presence_penalty": (0, 0.0, None), "logit_bias": (None,),
}
#: Most stop strings in one request (OpenAI's limit).
MAX_STOP = 4
ROLES = ("system", "user", "assistant", "tool")


def _text(content: Any, where: str) -> str:
    """A message content as text: a string, null (""), or a list of ``{"type": "text", "text"}`` parts."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for j, p in enumerate(content):
            if not isinstance(p, dict) or p.get("type") != "text" or not isinstance(p.get("text"), str):
                kind = p.get("type") if isinstance(p, dict) else type(p).__name__
                raise bad(f"{where}[{j}]", f"only text parts ({{\"type\": \"text\", \"text\": ...}}) are supported, "
                                           f"got {kind!r:.60}")
            parts.append(p["text"])
        return "".join(parts)
    raise bad(where, f"must be a string, null or a list of text parts, got {type(content).__name__}")


def _tool_calls(calls: Any, where: str) -> list[dict[str, Any]]:
    if calls is None:
        return []
    if not isinstance(calls, list):
        raise bad(where, f"must be a list, got {type(calls).__name__}")
    out = []
    for j, c in enumerate(calls):
        w = f"{where}[{j}]"
        if not isinstance(c, dict):
            raise bad(w, f"must be an object, got {type(c).__name__}")
        if c.get("type", "function") != "function":
            raise bad(f"{w}.type", f"must be 'function', got {c.get('type')!r:.60}")
        fn = c.get("function")
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
            raise bad(f"{w}.function", "must be an object with a non-empty 'name' and 'arguments'")
        args = fn.get("arguments", "{}")
        if isinstance(args, dict):
            args = json.dumps(args, ensure_ascii=False)
        elif not isinstance(args, str):
            raise bad(f"{w}.function.arguments", f"must be a JSON string, got {type(args).__name__}")
        cid = c.get("id")
        if cid is not None and not isinstance(cid, str):
            raise bad(f"{w}.id", f"must be a string, got {type(cid).__name__}")
        out.append({"id": cid or f"call_{j}", "type": "function", "function": {"name": fn["name"], "arguments": args}})
    return out


def normalize_message(m: Any, i: int) -> dict[str, Any]:
    """One request message in the form the chat templates take; ApiError naming ``messages[i]...``."""
    where = f"messages[{i}]"
    if not isinstance(m, dict):
        raise bad(where, f"must be an object, got {type(m).__name__}")
    role = m.get("role")
    if role == "developer":  # OpenAI's newer name for system instructions
        role = "system"
    if role not in ROLES:
        raise bad(f"{where}.role", f"must be one of system, developer, user, assistant, tool; got {role!r:.60}")
    out: dict[str, Any] = {"role": role, "content": _text(m.get("content"), f"{where}.content")}
    name = m.get("name")
    if name is not None:
        if not isinstance(name, str):
            raise bad(f"{where}.name", f"must be a string, got {type(name).__name__}")
        out["name"] = name
    if role == "assistant":
        calls = _tool_calls(m.get("tool_calls"), f"{where}.tool_calls")
        if calls:
            out["tool_calls"] = calls
        reasoning = m.get("reasoning_content")
        if reasoning is not None:  # Qwen3 and GLM-4.5 render it (not part of the message key: the tokens hold it)
            if not isinstance(reasoning, str):
                raise bad(f"{where}.reasoning_content", f"must be a string, got {type(reasoning).__name__}")
            out["reasoning_content"] = reasoning
    elif m.get("tool_calls"):
        raise bad(f"{where}.tool_calls", f"only assistant messages carry tool calls, this one is {role!r}")
    if role == "tool":
        tid = m.get("tool_call_id")
        if not isinstance(tid, str):
            raise bad(f"{where}.tool_call_id", "a tool message needs the string id of the call it answers")
        out["tool_call_id"] = tid
    return out


#: Chat Completions tools: ``{"type": "function", "function": {"name", "description", "parameters"}}``
TOOL_SHAPE = ToolShape(kinds=("function",), other_kind="is not a tool type of Chat Completions: 'function' only",
                       under="function", schema="parameters", schema_required=False)


def parse_chat_request(body: dict[str, Any]) -> ChatRequest:
    """Validate a Chat Completions body; ApiError 400 naming the first field it cannot honour."""
    request_fields.refuse_unknown(body, SUPPORTED_FIELDS | IGNORED_FIELDS | NEUTRAL_VALUES.keys(),
                                  "model, messages, tools, tool_choice, temperature, top_p, max_tokens, stop, seed, "
                                  "n=1, stream, logprobs")
    for k, allowed in NEUTRAL_VALUES.items():
        v = body.get(k)
        if v not in allowed and not (k == "logit_bias" and v == {}):
            raise bad(k, f"is not supported (only its neutral value); got {v!r:.60}", code="unsupported_parameter")
    model = request_fields.model(body)
    messages = body.get("messages")
    if not isinstance(messages, list):
        raise bad("messages", f"must be a list of message objects, got {type(messages).__name__}")
    if not messages:
        raise bad("messages", "is empty; give at least one message")
    msgs = [normalize_message(m, i) for i, m in enumerate(messages)]
    tools = function_tools(body.get("tools"), TOOL_SHAPE)
    choice, forced = openai_tool_choice(body.get("tool_choice"), tools, "function")
    n = body.get("n")
    if n is not None and n != 1:
        raise bad("n", f"must be 1 (one completion per request: each one is a turn of the trajectory); got {n!r:.60}",
                  code="unsupported_parameter")
    temperature, top_p = request_fields.sampling(body, max_temperature=2)
    max_tokens = None
    for k in ("max_tokens", "max_completion_tokens"):
        v = body.get(k)
        if v is None:
            continue
        if not request_fields.is_int(v) or v < 1:
            raise bad(k, f"must be a positive integer, got {v!r:.60}")
        if max_tokens is not None and v != max_tokens:
            raise bad(k, f"is {v} but max_tokens is {max_tokens}; give one of them")
        max_tokens = v
    stop = body.get("stop")
    stops = [stop] if isinstance(stop, str) else stop if stop is not None else []
    if not isinstance(stops, list) or len(stops) > MAX_STOP or not all(isinstance(s, str) and s for s in stops):
        raise bad("stop", f"must be a non-empty string or a list of at most {MAX_STOP} of them, got {stop!r:.80}")
    seed = body.get("seed")
    if seed is not None and not (request_fields.is_int(seed) and 0 <= seed < 2 ** 63):
        raise bad("seed", f"must be a non-negative integer, got {seed!r:.60}")
    stream = request_fields.flag(body, "stream")
    opts = body.get("stream_options")
    include_usage = False
    if opts is not None:
        if not stream:
            raise bad("stream_options", "is only allowed with stream: true")
        if not isinstance(opts, dict) or set(opts) - {"include_usage", "include_obfuscation"}:
            raise bad("stream_options", f"must be {{\"include_usage\": bool}}, got {opts!r:.80}")
        include_usage = bool(opts.get("include_usage"))
    logprobs = request_fields.flag(body, "logprobs")
    top = body.get("top_logprobs")
    if top not in (None, 0):
        raise bad("top_logprobs", "is not supported: the engines report the log-prob of the sampled token only "
                                  "(use logprobs: true)", code="unsupported_parameter")
    request_fields.refuse_serial_tool_calls(body)
    return ChatRequest(model=model, messages=msgs, tools=tools, tool_choice=choice, forced_tool=forced,
                       temperature=temperature, top_p=top_p, max_tokens=max_tokens, stop=list(stops),
                       seed=seed, stream=bool(stream), include_usage=include_usage, logprobs=bool(logprobs))


# ------------------------------------------------------------------------------------------ responses
def logprobs_body(tokens: list[tuple[str, bytes]], logprobs: list[float]) -> dict[str, Any]:
    """``choices[0].logprobs``: one entry per sampled token: its text, log-prob and bytes (``tokens``:
    ``(text, bytes)`` pairs; a token that ends mid-character has its partial bytes here)."""
    return {"content": [{"token": t, "logprob": lp, "bytes": list(b), "top_logprobs": []}
                        for (t, b), lp in zip(tokens, logprobs)], "refusal": None}


def usage_body(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    """``usage``: tokens of the prompt the engine saw and of the sampled turn."""
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def completion_body(cid: str, created: int, model: str, message: dict[str, Any], finish_reason: str,
                    usage: dict[str, int], fingerprint: str, logprobs: dict[str, Any] | None) -> dict[str, Any]:
    """A ``chat.completion`` object with one choice."""
    return {"id": cid, "object": "chat.completion", "created": created, "model": model,
            "system_fingerprint": fingerprint,
            "choices": [{"index": 0, "message": message, "finish_reason": finish_reason, "logprobs": logprobs}],
            "usage": usage}


@dataclass(frozen=True)
class ChunkHead:
    """What every chunk of one streamed completion repeats: its ``id``, ``created`` time, ``model`` and
    ``fingerprint`` (the system fingerprint; None in the opening chunk, sent before a weight version sampled)."""

    id: str
    created: int
    model: str
    fingerprint: str | None


def chunk_body(head: ChunkHead, delta: dict[str, Any] | None, finish_reason: str | None = None,
               logprobs: dict[str, Any] | None = None, usage: dict[str, int] | None = None) -> dict[str, Any]:
    """A ``chat.completion.chunk``: one choice with ``delta`` (none when ``delta`` is None: the usage chunk)."""
    body: dict[str, Any] = {"id": head.id, "object": "chat.completion.chunk", "created": head.created,
                            "model": head.model, "system_fingerprint": head.fingerprint, "choices": []}
    if delta is not None:
        body["choices"] = [{"index": 0, "delta": delta, "finish_reason": finish_reason, "logprobs": logprobs}]
    if usage is not None:
        body["usage"] = usage
    return body


def stream_chunks(head: ChunkHead, message: dict[str, Any], finish_reason: str, usage: dict[str, int],
                  logprobs: dict[str, Any] | None, include_usage: bool) -> list[dict[str, Any]]:
    """The chunks after the first (role) chunk: the reasoning (when the turn has some), the content with the
    log-probs, one chunk per tool call (id, name and whole arguments), the finish reason, and the usage when
    asked."""
    out = []
    if message.get("reasoning_content"):
        out.append(chunk_body(head, {"reasoning_content": message["reasoning_content"]}))
    if message.get("content") or logprobs:
        out.append(chunk_body(head, {"content": message.get("content") or ""}, logprobs=logprobs))
    for i, call in enumerate(message.get("tool_calls") or []):
        out.append(chunk_body(head, {"tool_calls": [{
            "index": i, "id": call["id"], "type": "function",
            "function": {"name": call["function"]["name"], "arguments": call["function"]["arguments"]}}]}))
    out.append(chunk_body(head, {}, finish_reason=finish_reason))
    if include_usage:
        out.append(chunk_body(head, None, usage=usage))
    return out


def sse(body: dict[str, Any]) -> bytes:
    """One server-sent event carrying ``body`` as JSON."""
    try:
        data = json.dumps(body, ensure_ascii=False, separators=(",", ":")).encode()
    except UnicodeEncodeError:  # a lone surrogate has no UTF-8 form: keep the escapes
        data = json.dumps(body, separators=(",", ":")).encode()
    return b"data: " + data + b"\n\n"


SSE_DONE = b"data: [DONE]\n\n"


def models_body(model: str, created: int) -> dict[str, Any]:
    """``GET /models``: the one policy the gateway serves."""
    return {"object": "list", "data": [{"id": model, "object": "model", "created": created, "owned_by": "agentrl"}]}
