"""The gateway's one internal turn model, which the three wire formats (Chat Completions, Responses, Anthropic
Messages) parse into and render from.

A request of any API becomes a :class:`TurnRequest`: the conversation as chat-template messages (``role``,
``content`` text, ``tool_calls`` with JSON-string arguments, ``tool_call_id``, ``reasoning_content``), the tools as
OpenAI function schemas, the tool choice and the sampling settings. :meth:`Gateway.complete
<rollout_sglang.gateway.gateway.Gateway.complete>` samples it as one turn of the session's token-exact trajectory
and answers a :class:`Completion`: the assistant message in the same internal form, the finish reason, the sampled
tokens with their log-probs and version. So the trajectory of an episode is the same whichever API its agent
speaks, and what a turn records (e.g. an engine's routed experts, later) is recorded in one place.

Errors are :class:`ApiError` (status, message, the offending ``param``, a ``code``, headers such as
``Retry-After``); each wire format renders them in its API's own error shape.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from env_controller.http.service import HttpError


class ApiError(HttpError):
    """An error reply: ``status``, ``message``, the offending ``param``, a ``code`` and extra ``headers``.

    :meth:`body` is OpenAI's shape (``{"error": {"message", "type", "param", "code"}}``);
    :meth:`anthropic_body` Anthropic's (``{"type": "error", "error": {"type", "message"}}``).
    """

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(status, message, headers)
        self.param = param
        self.code = code

    @property
    def kind(self) -> str:
        """OpenAI's error ``type`` for the status."""
        if self.status in (401, 403):
            return "authentication_error"
        if self.status == 404:
            return "not_found_error"
        if self.status == 429:
            return "rate_limit_error"
        return "invalid_request_error" if self.status < 500 else "server_error"

    @property
    def anthropic_kind(self) -> str:
        """Anthropic's error ``type`` for the status."""
        return {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error",
                503: "overloaded_error", 529: "overloaded_error"}.get(
            self.status, "invalid_request_error" if self.status < 500 else "api_error")

    def body(self) -> dict[str, Any]:
        """``{"error": {"message", "type", "param", "code"}}`` (OpenAI: Chat Completions and Responses)."""
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}

    def anthropic_body(self) -> dict[str, Any]:
        """``{"type": "error", "error": {"type", "message"}}`` (Anthropic Messages)."""
        return {"type": "error", "error": {"type": self.anthropic_kind, "message": self.message}}


def bad(param: str, rule: str, code: str | None = None) -> ApiError:
    """A 400 naming ``param`` (dotted, with indices: ``messages[2].content``) and what it must be."""
    return ApiError(400, f"{param}: {rule}", param=param, code=code)


@dataclass(frozen=True)
class ToolShape:
    """Where one wire format keeps a function tool's parts (:func:`function_tools`)."""

    #: the accepted values of a tool's ``type`` (None: absent)
    kinds: tuple[str | None, ...]
    #: said of another ``type``, after its value
    other_kind: str
    #: the object under which name, description and schema sit (Chat Completions: ``function``), or ""
    under: str
    #: the key of the argument schema (``parameters``; Anthropic: ``input_schema``)
    schema: str
    #: whether the schema must be given (else an empty object schema)
    schema_required: bool
    #: the error code of a refused ``type`` (None: a plain 400)
    kind_code: str | None = None


def function_tools(value: Any, shape: ToolShape) -> list[dict[str, Any]]:
    """A request's ``tools`` in ``shape``, checked, as chat-template tools (``{"type": "function", "function":
    {"name", "description"?, "parameters", ...}}``); ApiError 400 naming the first bad field."""
    if value is None:
        return []
    if not isinstance(value, list):
        raise bad("tools", f"must be a list of tool objects, got {type(value).__name__}")
    out, names = [], set()
    for i, t in enumerate(value):
        w = f"tools[{i}]"
        if not isinstance(t, dict):
            raise bad(w, f"must be an object, got {type(t).__name__}")
        if t.get("type") not in shape.kinds:
            raise bad(f"{w}.type", f"{t.get('type')!r:.60} {shape.other_kind}", code=shape.kind_code)
        fn = t
        if shape.under:
            w = f"{w}.{shape.under}"
            fn = t.get(shape.under)
            if not isinstance(fn, dict):
                raise bad(w, f"must be an object with a 'name', got {type(fn).__name__}")
        name, schema = fn.get("name"), fn.get(shape.schema)
        if not isinstance(name, str) or not name:
            raise bad(f"{w}.name", "must be a non-empty string")
        if name in names:
            raise bad(f"{w}.name", f"{name!r} is listed twice")
        names.add(name)
        if (schema is not None or shape.schema_required) and not isinstance(schema, dict):
            raise bad(f"{w}.{shape.schema}", f"must be a JSON Schema object, got {type(schema).__name__}")
        if shape.under:  # already the chat form: kept whole (e.g. "strict")
            out.append(t)
            continue
        tool: dict[str, Any] = {"name": name}
        if fn.get("description"):
            tool["description"] = fn["description"]
        tool["parameters"] = schema if schema is not None else {"type": "object", "properties": {}}
        out.append({"type": "function", "function": tool})
    return out


def openai_tool_choice(value: Any, tools: list[dict[str, Any]], under: str) -> tuple[str, str | None]:
    """``(choice, forced tool name)`` of an OpenAI ``tool_choice`` (default "auto", "none" without tools): a string
    auto / none / required, or a named function, its name under ``under`` ("function" in Chat Completions, "" in
    Responses); ApiError 400 naming what is wrong."""
    where = f"{under}." if under else ""
    named = f'{{"type": "function", "{under}": {{"name": ...}}}}' if under else '{"type": "function", "name": ...}'
    if value is None:
        return ("auto" if tools else "none"), None
    names = [t["function"]["name"] for t in tools]
    if isinstance(value, str):
        if value not in ("auto", "none", "required"):
            raise bad("tool_choice", f"must be auto, none, required or {named}; got {value!r:.60}")
        if value == "required" and not tools:
            raise bad("tool_choice", "is 'required' but the request lists no tools")
        return value, None
    holder = value.get(under) if under and isinstance(value, dict) else value
    if not isinstance(value, dict) or value.get("type") != "function" or not isinstance(holder, dict) \
            or not isinstance(holder.get("name"), str):
        raise bad("tool_choice", f"must be auto, none, required or {named} (other tool kinds are not served)",
                  code="unsupported_parameter")
    if holder["name"] not in names:
        raise bad(f"tool_choice.{where}name", f"{holder['name']!r:.60} is not one of the request's tools "
                                              f"({', '.join(names) or 'none'})")
    return "function", holder["name"]


def retry_after_headers(seconds: float) -> dict[str, str]:
    """``Retry-After`` (whole seconds, at least 1) and ``retry-after-ms`` (which the openai and anthropic SDKs read
    first) for a 429."""
    ms = max(1, int(round(seconds * 1000)))
    return {"Retry-After": str(max(1, -(-ms // 1000))), "retry-after-ms": str(ms)}


@dataclass
class TurnRequest:
    """A validated request of any of the gateway's APIs, as one turn to sample.

    messages: chat-template messages (``role``, ``content`` text, ``tool_calls`` with JSON-string arguments,
    ``tool_call_id``, ``name``, ``reasoning_content``); tools: OpenAI function schemas (empty: none); tool_choice:
    "auto" | "none" | "required" | "function" (then ``forced_tool`` names it); max_tokens: the client's cap on
    generated tokens (None: the gateway's); stop: stop strings; include_usage: the last stream chunk carries
    ``usage`` (Chat Completions); logprobs: return the sampled tokens' log-probs; no_think: the turn must not
    reason (an empty think block is forced in formats that have one).
    """

    model: str
    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] = field(default_factory=list)
    tool_choice: str = "auto"
    forced_tool: str | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    max_tokens: int | None = None
    stop: list[str] = field(default_factory=list)
    seed: int | None = None
    stream: bool = False
    include_usage: bool = False
    logprobs: bool = False
    no_think: bool = False


@dataclass
class Completion:
    """One sampled turn as the wire formats answer it: ``message`` (the internal assistant message: ``content``,
    ``reasoning_content``, ``tool_calls``), ``finish_reason`` ("stop", "tool_calls" or "length"), the stop string
    that cut it (``stop_sequence``, None when none did), token counts, the sampled ``token_ids`` with their
    ``logprobs`` and the ``version`` that sampled them; ``engine_s``: seconds in the engine call."""

    message: dict[str, Any]
    finish_reason: str
    prompt_tokens: int
    completion_tokens: int
    token_ids: list[int]
    logprobs: list[float]
    version: int
    engine_s: float
    stop_sequence: str | None = None


def _args_key(args: str) -> str:
    """Tool-call arguments as a canonical string: equal JSON values give equal keys (key order ignored)."""
    try:
        return json.dumps(json.loads(args), sort_keys=True, ensure_ascii=False)
    except ValueError:
        return args


def message_key(m: dict[str, Any]) -> tuple:
    """What a chat template renders of a normalized message: role, text, tool calls (name, JSON arguments)."""
    calls = tuple((c["function"]["name"], _args_key(c["function"]["arguments"])) for c in m.get("tool_calls") or ())
    return (m["role"], m.get("content") or "", calls)


def tools_key(tools: list[dict[str, Any]]) -> str:
    """The tool list as the templates render it (key order kept: it changes the rendered prompt)."""
    return json.dumps(tools, ensure_ascii=False)


def sse_event(body: dict[str, Any]) -> bytes:
    """One server-sent event named by the body's ``type`` (``event: <type>``; the Responses and Messages streams)."""
    try:
        data = json.dumps(body, ensure_ascii=False, separators=(",", ":")).encode()
    except UnicodeEncodeError:  # a lone surrogate has no UTF-8 form: keep the escapes
        data = json.dumps(body, separators=(",", ":")).encode()
    return b"event: " + body["type"].encode() + b"\ndata: " + data + b"\n\n"
