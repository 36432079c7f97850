"""Parse a generated assistant turn (Hermes / Qwen2.5 format) into an OpenAI assistant message.

A tool call is a block ``<tool_call>\\n{"name": "<tool>", "arguments": {...}}\\n</tool_call>``; a turn
may hold several. The text outside the blocks is the message content. Anything that looks like
a call but is not a valid one raises :class:`ToolCallParseError`, which the agent loop turns into
the status "agent validation failed".
"""
from __future__ import annotations

import json
import re
from typing import Any, Sequence

from rollout_sglang.tokenizer import IM_END, TOOL_CALL_END, TOOL_CALL_START

VALID_CALL_EXAMPLE = '<tool_call>\n{"name": "<tool name>", "arguments": {"<arg>": <value>, ...}}\n</tool_call>'

_TAG_RE = re.compile(re.escape(TOOL_CALL_START) + "|" + re.escape(TOOL_CALL_END))


class ToolCallParseError(ValueError):
    """A malformed tool call in generated text; the message quotes the text and shows a valid call."""


def _shorten(text: str, limit: int = 200) -> str:
    """``text`` cut to at most ``limit`` characters (middle elided), for error messages."""
    if len(text) <= limit:
        return text
    half = (limit - 5) // 2
    return text[:half] + " ... " + text[-half:]


def _fail(problem: str, snippet: str) -> ToolCallParseError:
    """A ToolCallParseError naming ``problem``, quoting ``snippet`` and showing a valid call."""
    return ToolCallParseError(f"{problem}: {_shorten(snippet)!r}; a valid tool call looks like {VALID_CALL_EXAMPLE}")


def _tool_names(tools: Sequence[dict] | None) -> set[str] | None:
    """Function names of OpenAI tool schemas (``{"type": "function", "function": {"name": ...}}``)."""
    if tools is None:
        return None
    names = set()
    for t in tools:
        fn = t.get("function", t) if isinstance(t, dict) else {}
        if isinstance(fn, dict) and isinstance(fn.get("name"), str):
            names.add(fn["name"])
    return names


def _parse_block(body: str, names: set[str] | None) -> tuple[str, dict]:
    """Validate one block's JSON body; returns (name, arguments object)."""
    raw = body.strip()
    if not raw:
        raise _fail("empty <tool_call> block", f"{TOOL_CALL_START}{body}{TOOL_CALL_END}")
    try:
        obj = json.loads(raw)
    except json.JSONDecodeError as e:
        raise _fail(f"tool call is not valid JSON ({e.msg} at char {e.pos})", raw) from None
    if not isinstance(obj, dict):
        raise _fail(f"tool call must be a JSON object, got {type(obj).__name__}", raw)
    name = obj.get("name")
    if not isinstance(name, str) or not name:
        raise _fail("tool call has no \"name\" string", raw)
    args = obj.get("arguments", {})
    if not isinstance(args, dict):
        raise _fail(f"tool call \"arguments\" must be a JSON object, got {type(args).__name__}", raw)
    if names is not None and name not in names:
        known = ", ".join(sorted(names)) or "(none)"
        raise _fail(f"unknown tool {name!r} (available: {known})", raw)
    return name, args


def parse_assistant_text(
    text: str, tools: Sequence[dict] | None = None, call_id_start: int = 0
) -> dict[str, Any]:
    """Turn generated assistant text into an OpenAI assistant message.

    text: the turn's text (a trailing ``<|im_end|>`` is ignored).
    tools: the episode's OpenAI tool schemas; when given, calling any other name is an error.
    call_id_start: ids are ``call_<n>`` counting from here (pass a running count per episode so
        ids stay unique across turns).
    Returns ``{"role": "assistant", "content": str, "tool_calls": [...]}`` with each call as
    ``{"id", "type": "function", "function": {"name", "arguments": JSON string}}``; content is the
    text outside the blocks, stripped (segments joined by a newline); ``tool_calls`` is empty for
    plain text. Raises ToolCallParseError for bad JSON, a missing name, non-object arguments, an
    unclosed or unopened tag, or an unknown tool.
    """
    if text.endswith(IM_END):
        text = text[: -len(IM_END)]
    names = _tool_names(tools)
    content_parts: list[str] = []
    calls: list[dict[str, Any]] = []
    pos = 0
    open_at: int | None = None
    for m in _TAG_RE.finditer(text):
        if m.group() == TOOL_CALL_START:
            if open_at is not None:
                raise _fail("<tool_call> opened again before the previous one was closed", text[open_at:])
            content_parts.append(text[pos : m.start()])
            open_at = m.start()
            pos = m.end()
        else:
            if open_at is None:
                raise _fail("</tool_call> without a matching <tool_call>", text[max(0, m.start() - 150) : m.end()])
            name, args = _parse_block(text[pos : m.start()], names)
            calls.append(
                {
                    "id": f"call_{call_id_start + len(calls)}",
                    "type": "function",
                    "function": {"name": name, "arguments": json.dumps(args, ensure_ascii=False)},
                }
            )
            open_at = None
            pos = m.end()
    if open_at is not None:
        raise _fail("unclosed <tool_call> (no </tool_call>)", text[open_at:])
    content_parts.append(text[pos:])
    content = "\n".join(p.strip() for p in content_parts if p.strip())
    return {"role": "assistant", "content": content, "tool_calls": calls}
