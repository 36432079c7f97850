"""Parse a generated assistant turn into an OpenAI assistant message, in four formats.

Hermes / Qwen2.5 (:func:`parse_assistant_text`): a tool call is a block
``<tool_call>\\n{"name": "<tool>", "arguments": {...}}\\n</tool_call>``; a turn may hold several.
The text outside the blocks is the message content. ``"parameters"`` is read as ``"arguments"``, as SGLang reads
it; both at once, or any other key in the call object, is refused: the arguments are never dropped.

Qwen3 (:func:`parse_qwen3_assistant_text`): Hermes calls after a ``<think>...</think>`` block that opens
the turn, returned as ``reasoning_content``.

GLM-4-0414 (:func:`parse_glm4_assistant_text`): after ``<|assistant|>`` the model writes either
content, which starts with a newline, or a call: the function name on its own line, then the
arguments as one JSON object (``search\\n{"q": "x"}``); several messages in one turn are joined by
``<|assistant|>`` (content first, then one call each), and a turn with calls ends with
``<|observation|>``.

GLM-4.5 (:func:`parse_glm45_assistant_text`): the turn starts with its reasoning,
``\\n<think>...</think>``, then the content, then one block per call:
``<tool_call>name\\n<arg_key>k</arg_key>\\n<arg_value>v</arg_value>\\n...</tool_call>``, each argument
value as text (a string) or JSON (any other value).

Anything that looks like a call but is not a valid one raises :class:`ToolCallParseError`, which
the agent loop turns into the status "agent validation failed". Model output is untrusted, so the
JSON of a call is read strictly (:func:`_strict_json`): at most :data:`MAX_JSON_DEPTH` levels of
nesting, numbers of at most :data:`MAX_NUMBER_DIGITS` digits, no NaN or Infinity, no lone surrogates;
whatever the text, the parsers raise nothing but ToolCallParseError.
"""
from __future__ import annotations

import json
import math
import re
from collections.abc import Callable
from typing import Any, Sequence

from env_controller.http.json_io import json_too_deep
from rollout_sglang.tokenizer import (
    ARG_KEY_END,
    ARG_KEY_START,
    ARG_VALUE_END,
    ARG_VALUE_START,
    ENDOFTEXT,
    GLM_ASSISTANT,
    GLM_OBSERVATION,
    GLM_USER,
    IM_END,
    THINK_END,
    THINK_START,
    TOOL_CALL_END,
    TOOL_CALL_START,
)

VALID_CALL_EXAMPLE = '<tool_call>\n{"name": "<tool name>", "arguments": {"<arg>": <value>, ...}}\n</tool_call>'

_TAG_RE = re.compile(re.escape(TOOL_CALL_START) + "|" + re.escape(TOOL_CALL_END))

#: Deepest nesting of arrays and objects in one call's JSON (the Hermes wrapper object counts as one level).
#: Far above any real tool schema, far below the interpreter's recursion limit that json.loads would hit.
MAX_JSON_DEPTH = 64
#: Most digits in one JSON number. Below 640, the smallest limit ``sys.set_int_max_str_digits`` accepts, so
#: ``int()`` never refuses a number we let through, and no value exceeds what a JSON peer can represent usefully.
MAX_NUMBER_DIGITS = 100

_SURROGATE_RE = re.compile("[\ud800-\udfff]")


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


class _Refused(Exception):
    """JSON that a strict reading refuses (raised from json.loads hooks; becomes a ToolCallParseError)."""


def _number(literal: str) -> None:
    """Raise _Refused for a number literal with more than MAX_NUMBER_DIGITS digits."""
    digits = sum(c.isdigit() for c in literal)
    if digits > MAX_NUMBER_DIGITS:
        raise _Refused(f"a number with {digits} digits (at most {MAX_NUMBER_DIGITS})")


def _parse_int(literal: str) -> int:
    _number(literal)
    return int(literal)


def _parse_float(literal: str) -> float:
    _number(literal)
    value = float(literal)
    if not math.isfinite(value):
        raise _Refused(f"the number {literal} overflows to infinity (numbers must be finite)")
    return value


def _parse_constant(name: str) -> float:
    raise _Refused(f"{name} is not a JSON number (numbers must be finite)")


def _lone_surrogate(value: str, where: str) -> str | None:
    """The problem when ``value`` holds a lone surrogate (not encodable as UTF-8: no request could carry it)."""
    m = _SURROGATE_RE.search(value)
    return None if m is None else f"invalid Unicode in {where}: lone surrogate U+{ord(m.group()):04X}"


def _strict_json(raw: str) -> Any:
    """``json.loads(raw)`` refusing deep nesting, long numbers, NaN / Infinity and lone surrogates.

    Raises json.JSONDecodeError for bad syntax and _Refused (with the problem) for the rest.
    """
    # the bracket count outside strings, before json.loads can recurse (the HTTP edge's check)
    if json_too_deep(raw.encode("utf-8", "surrogatepass"), MAX_JSON_DEPTH):
        raise _Refused(f"nested deeper than {MAX_JSON_DEPTH} levels of arrays and objects")
    obj = json.loads(raw, parse_int=_parse_int, parse_float=_parse_float, parse_constant=_parse_constant)
    # a lone surrogate (escaped or raw) survives json.loads inside keys or values; the serialized form shows it
    problem = _lone_surrogate(json.dumps(obj, ensure_ascii=False), "a string")
    if problem:
        raise _Refused(problem)
    return obj


def _json_object(raw: str, fail: Callable[[str, str], ToolCallParseError], invalid: str, refused: str,
                 subject: str) -> dict:
    """``raw`` read by :func:`_strict_json` as a JSON object; else ``fail(problem, raw)``, the problem being
    ``invalid`` (bad syntax), ``refused`` (what the strict reading refuses) or ``subject`` not being an object."""
    try:
        obj = _strict_json(raw)
    except json.JSONDecodeError as e:
        raise fail(f"{invalid} ({e.msg} at char {e.pos})", raw) from None
    except _Refused as e:
        raise fail(f"{refused}: {e}", raw) from None
    if not isinstance(obj, dict):
        raise fail(f"{subject} must be a JSON object, got {type(obj).__name__}", raw)
    return obj


def _dumps(args: dict) -> str:
    """The arguments as the OpenAI JSON string; strict, since _strict_json already refused what it would reject."""
    return json.dumps(args, ensure_ascii=False, allow_nan=False)


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


#: The keys a Hermes call object may have. ``parameters`` is read as ``arguments`` (SGLang's Hermes / Qwen2.5
#: detectors do the same, ``act.get("parameters") or act.get("arguments", {})``); any other key is refused, where
#: SGLang would drop it silently: a model that writes its arguments under a key of its own (``args``, ``input``, a
#: nested ``function``) would otherwise call the tool with none.
_CALL_KEYS = frozenset(["name", "arguments", "parameters"])


def _parse_block(body: str, names: set[str] | None) -> tuple[str, dict]:
    """Validate one block's JSON body; returns (name, arguments object).

    The object has a ``name`` string and the arguments as one object under ``arguments`` or, as SGLang also reads
    it, ``parameters`` (absent: no arguments); both at once, or any other key, is refused (never dropped)."""
    raw = body.strip()
    if not raw:
        raise _fail("empty <tool_call> block", f"{TOOL_CALL_START}{body}{TOOL_CALL_END}")
    obj = _json_object(raw, _fail, "tool call is not valid JSON", "tool call JSON refused", "tool call")
    extra = sorted(k for k in obj if k not in _CALL_KEYS)
    if extra:
        keys = ", ".join(repr(k) for k in extra)
        raise _fail(f"tool call has key(s) {keys} besides \"name\" and \"arguments\" (a call is one object with "
                    "the tool's name and its arguments as one \"arguments\" object; nothing else is read, so "
                    "nothing else may be written)", raw)
    name = obj.get("name")
    if not isinstance(name, str) or not name:
        raise _fail("tool call has no \"name\" string", raw)
    if "arguments" in obj and "parameters" in obj:
        raise _fail("tool call has both \"arguments\" and \"parameters\" (write the arguments once, as "
                    "\"arguments\")", raw)
    key = "parameters" if "parameters" in obj else "arguments"
    args = obj.get(key, {})
    if not isinstance(args, dict):
        raise _fail(f"tool call \"{key}\" must be a JSON object, got {type(args).__name__}", raw)
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
    plain text. Raises ToolCallParseError for bad JSON, a missing name, non-object arguments, a call
    object with a key besides ``name`` and ``arguments`` (``parameters`` is read as ``arguments``), an
    unclosed or unopened tag, an unknown tool, JSON beyond the limits in the module doc, or a lone
    surrogate anywhere in the message; never any other exception.
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
                    "function": {"name": name, "arguments": _dumps(args)},
                }
            )
            open_at = None
            pos = m.end()
    if open_at is not None:
        raise _fail("unclosed <tool_call> (no </tool_call>)", text[open_at:])
    content_parts.append(text[pos:])
    content = "\n".join(p.strip() for p in content_parts if p.strip())
    problem = _lone_surrogate(content, "the message content")
    if problem:
        raise _fail(problem, content)
    return {"role": "assistant", "content": content, "tool_calls": calls}


# --------------------------------------------------------------------------------------- GLM-4
VALID_GLM4_CALL_EXAMPLE = '<tool name>\n{"<arg>": <value>, ...}'
#: A GLM-4 function name: what OpenAI tool names allow, plus dots and colons (no spaces).
_GLM4_NAME_RE = re.compile(r"[\w.:\-]+")


def _strip_glm_stop(text: str) -> str:
    """``text`` without one trailing GLM stop token (``<|observation|>``, ``<|user|>``, ``<|endoftext|>``)."""
    for stop in (GLM_OBSERVATION, GLM_USER, ENDOFTEXT):
        if text.endswith(stop):
            return text[: -len(stop)]
    return text


def _fail_glm4(problem: str, snippet: str) -> ToolCallParseError:
    """A ToolCallParseError naming ``problem``, quoting ``snippet`` and showing a valid GLM-4 call."""
    return ToolCallParseError(
        f"{problem}: {_shorten(snippet)!r}; a GLM-4 tool call is the function name on its own line, then the "
        f"arguments as one JSON object: {VALID_GLM4_CALL_EXAMPLE!r}"
    )


def _parse_glm4_call(segment: str, names: set[str] | None) -> tuple[str, dict]:
    """One call segment ``name\\n{json}`` (the name line may end with spaces) -> (name, arguments)."""
    head, _, body = segment.partition("\n")
    name = head.strip()
    if not name:
        raise _fail_glm4("tool call has an empty function name line", segment)
    if not _GLM4_NAME_RE.fullmatch(name):
        raise _fail_glm4(f"text after <|assistant|> is neither content (which starts with a newline) nor a "
                         f"function name line ({name[:40]!r} is not a function name)", segment)
    if names is not None and name not in names:
        known = ", ".join(sorted(names)) or "(none)"
        raise _fail_glm4(f"unknown tool {name!r} (available: {known})", segment)
    raw = body.strip()
    if not raw:
        return name, {}
    subject = f"arguments of tool call {name!r}"
    return name, _json_object(raw, _fail_glm4, f"{subject} are not valid JSON", f"{subject} refused", subject)


def parse_glm4_assistant_text(
    text: str, tools: Sequence[dict] | None = None, call_id_start: int = 0
) -> dict[str, Any]:
    """Turn a generated GLM-4-0414 assistant turn into an OpenAI assistant message.

    text: what the model wrote after the ``<|assistant|>`` generation prompt (a trailing stop
        token, ``<|observation|>``, ``<|user|>`` or ``<|endoftext|>``, is ignored). It is split at
        ``<|assistant|>``; a segment starting with a newline is content, any other non-blank
        segment is one call ``name\\n{arguments}``.
    tools, call_id_start, the result: as :func:`parse_assistant_text` (content segments are
        stripped and joined by a newline; ``tool_calls`` empty for plain text).
    Raises ToolCallParseError (quoting the bad text) for a name line that is not a function name,
    an unknown tool, arguments that are not JSON or not an object, JSON beyond the limits in the
    module doc, or a lone surrogate anywhere in the message; never any other exception.
    """
    text = _strip_glm_stop(text)
    names = _tool_names(tools)
    content_parts: list[str] = []
    calls: list[dict[str, Any]] = []
    for segment in text.split(GLM_ASSISTANT):
        if not segment.strip():
            continue
        if segment.startswith("\n"):
            content_parts.append(segment.strip())
            continue
        name, args = _parse_glm4_call(segment, names)
        calls.append(
            {
                "id": f"call_{call_id_start + len(calls)}",
                "type": "function",
                "function": {"name": name, "arguments": _dumps(args)},
            }
        )
    content = "\n".join(content_parts)
    problem = _lone_surrogate(content, "the message content")
    if problem:
        raise _fail_glm4(problem, content)
    return {"role": "assistant", "content": content, "tool_calls": calls}


# ------------------------------------------------------------------------------------- GLM-4.5
VALID_GLM45_CALL_EXAMPLE = (
    "<tool_call><tool name>\n<arg_key><arg></arg_key>\n<arg_value><value></arg_value>\n</tool_call>"
)
_GLM45_TAG_RE = re.compile("|".join(re.escape(t) for t in (
    THINK_START, THINK_END, TOOL_CALL_START, TOOL_CALL_END, ARG_KEY_START, ARG_KEY_END, ARG_VALUE_START,
    ARG_VALUE_END)))


def _fail_glm45(problem: str, snippet: str) -> ToolCallParseError:
    """A ToolCallParseError naming ``problem``, quoting ``snippet`` and showing a valid GLM-4.5 call."""
    return ToolCallParseError(
        f"{problem}: {_shorten(snippet)!r}; a GLM-4.5 tool call is the function name after <tool_call>, then one "
        f"<arg_key>/<arg_value> pair per argument (a string as is, any other value as JSON): "
        f"{VALID_GLM45_CALL_EXAMPLE!r}"
    )


def _tool_params(tools: Sequence[dict] | None) -> dict[str, dict]:
    """Per function name, the ``properties`` of its parameter schema (empty when it declares none)."""
    out: dict[str, dict] = {}
    for t in tools or ():
        fn = t.get("function", t) if isinstance(t, dict) else {}
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            continue
        params = fn.get("parameters")
        props = params.get("properties") if isinstance(params, dict) else None
        out[fn["name"]] = props if isinstance(props, dict) else {}
    return out


def _declared_types(props: dict, key: str) -> frozenset[str] | None:
    """The JSON types the schema declares for parameter ``key`` (None when it declares none)."""
    schema = props.get(key)
    declared = schema.get("type") if isinstance(schema, dict) else None
    if isinstance(declared, str):
        return frozenset([declared])
    if isinstance(declared, list) and declared and all(isinstance(x, str) for x in declared):
        return frozenset(declared)
    return None


def _glm45_value(raw: str, types: frozenset[str] | None, name: str, key: str) -> Any:
    """An argument value's text as its value: the text itself for a ``string`` parameter, JSON for a parameter
    of another declared type (ToolCallParseError when it is not strict JSON), and for an undeclared one JSON
    when the text is strict JSON of a non-string, else the text (the template writes strings unquoted)."""
    if types == frozenset(["string"]):
        return raw
    text_ok = types is None or "string" in types
    try:
        value = _strict_json(raw)
    except json.JSONDecodeError as e:
        if text_ok:
            return raw
        raise _fail_glm45(f"argument {key!r} of tool call {name!r} is declared {'/'.join(sorted(types or ()))} "
                          f"but its value is not JSON ({e.msg} at char {e.pos})", raw) from None
    except _Refused as e:
        if text_ok:
            return raw
        raise _fail_glm45(f"argument {key!r} of tool call {name!r}: value refused: {e}", raw) from None
    return raw if text_ok and isinstance(value, str) else value


def _glm45_name(head: str, names: set[str] | None, block: str) -> str:
    """The function name written after ``<tool_call>`` (surrounding whitespace dropped), validated."""
    name = head.strip()
    if not name:
        raise _fail_glm45("tool call has no function name after <tool_call>", block)
    if not _GLM4_NAME_RE.fullmatch(name):
        raise _fail_glm45(f"{name[:40]!r} after <tool_call> is not a function name (a name, then a newline, "
                          "then the arguments)", block)
    if names is not None and name not in names:
        known = ", ".join(sorted(names)) or "(none)"
        raise _fail_glm45(f"unknown tool {name!r} (available: {known})", block)
    return name


def _leading_think(text: str, fail: Callable[[str, str], ToolCallParseError]) -> tuple[str, str]:
    """``(reasoning, rest)``: the ``<think>...</think>`` block that may open ``text`` (after whitespace), stripped,
    and the text after it; ("", text) when ``text`` does not open with one; ``fail``'s error when the block is
    never closed (a turn cut by length while thinking)."""
    lead = text.lstrip()
    if not lead.startswith(THINK_START):
        return "", text
    end = lead.find(THINK_END)
    if end < 0:
        raise fail("unclosed <think> (no </think>): the reasoning must end before the content and tool calls", lead)
    return lead[len(THINK_START) : end].strip(), lead[end + len(THINK_END) :]


def split_glm45_reasoning(text: str) -> tuple[str, str]:
    """``(reasoning, rest)``: the ``<think>...</think>`` block that may open the turn (after whitespace),
    stripped, and the text after it; ("", text) when the turn does not open with one. ToolCallParseError when
    the block is never closed."""
    return _leading_think(text, _fail_glm45)


def parse_glm45_assistant_text(
    text: str, tools: Sequence[dict] | None = None, call_id_start: int = 0
) -> dict[str, Any]:
    """Turn a generated GLM-4.5 assistant turn into an OpenAI assistant message.

    text: what the model wrote after the ``<|assistant|>`` generation prompt (a trailing stop token,
        ``<|observation|>``, ``<|user|>`` or ``<|endoftext|>``, is ignored): ``\\n<think>reasoning</think>``
        (optional), the content, then the calls
        ``<tool_call>name\\n<arg_key>k</arg_key>\\n<arg_value>v</arg_value>\\n</tool_call>``.
    tools: the episode's OpenAI tool schemas; when given, calling any other name is an error, and a
        parameter's declared ``type`` decides how its value is read: a ``string`` keeps the text as is,
        another type is parsed as JSON (with the strict limits of the module doc); a parameter whose type is
        not declared is JSON when its text is strict JSON of a non-string, else the text.
    call_id_start: as :func:`parse_assistant_text`.
    Returns ``{"role": "assistant", "content", "tool_calls", "reasoning_content"}``: content and reasoning
    stripped, the calls as in :func:`parse_assistant_text` (arguments a JSON string, keys in written order).
    Raises ToolCallParseError naming the problem for an unclosed ``<think>``, ``<tool_call>``, ``<arg_key>`` or
    ``<arg_value>``, a tag out of place (nested, or outside a call), text between the tags of a call or after a
    call, a missing or unknown function name, a key without a value (or a value without a key), a duplicate or
    empty key, a value of a declared non-string type that is not strict JSON, or a lone surrogate anywhere;
    never any other exception.
    """
    reasoning, body = split_glm45_reasoning(_strip_glm_stop(text))
    content, calls = _read_glm45_calls(body, _tool_names(tools), _tool_params(tools), call_id_start)
    _refuse_glm45_lone_surrogates(content, reasoning, calls)
    return {"role": "assistant", "content": content, "tool_calls": calls, "reasoning_content": reasoning}


def _read_glm45_calls(
    body: str, names: set[str] | None, params: dict[str, dict], call_id_start: int
) -> tuple[str, list[dict[str, Any]]]:
    """The stripped content and the tool calls of a GLM-4.5 turn's ``body`` (after the reasoning): a state machine
    over its tags (:func:`parse_glm45_assistant_text` lists what it refuses)."""
    content = ""
    calls: list[dict[str, Any]] = []
    state, pos, block_at, name, key = "out", 0, 0, "", ""
    args: dict[str, Any] = {}
    for m in _GLM45_TAG_RE.finditer(body):
        tag, gap = m.group(), body[pos : m.start()]
        pos = m.end()
        block = body[block_at : m.end()]
        if state == "out":
            if tag != TOOL_CALL_START:
                where = ("the reasoning comes first, once, as <think>...</think>" if tag in (THINK_START, THINK_END)
                         else "outside a <tool_call> block")
                raise _fail_glm45(f"{tag} out of place ({where})", body[max(0, m.start() - 150) : m.end()])
            if calls and gap.strip():
                raise _fail_glm45("text between tool calls (the content comes before the first call)", gap)
            if not calls:
                content = gap
            state, block_at, args = "name", m.start(), {}
        elif state in ("name", "args") and tag in (ARG_KEY_START, TOOL_CALL_END):
            if state == "name":
                name = _glm45_name(gap, names, block)
            elif gap.strip():
                raise _fail_glm45(f"text between the tags of tool call {name!r}", block)
            if tag == TOOL_CALL_END:
                calls.append({"id": f"call_{call_id_start + len(calls)}", "type": "function",
                              "function": {"name": name, "arguments": _dumps(args)}})
                state = "out"
            else:
                state = "key"
        elif state == "key" and tag == ARG_KEY_END:
            key = gap
            if not key.strip():
                raise _fail_glm45(f"empty <arg_key> in tool call {name!r}", block)
            if key in args:
                raise _fail_glm45(f"duplicate argument {key!r} in tool call {name!r}", block)
            state = "after_key"
        elif state == "after_key" and tag == ARG_VALUE_START:
            if gap.strip():
                raise _fail_glm45(f"text between </arg_key> and <arg_value> of argument {key!r}", block)
            state = "value"
        elif state == "value" and tag == ARG_VALUE_END:
            args[key] = _glm45_value(gap, _declared_types(params.get(name, {}), key), name, key)
            state = "args"
        elif state == "after_key":
            raise _fail_glm45(f"argument {key!r} of tool call {name!r} has no <arg_value> (got {tag})", block)
        else:
            expected = {"name": "<arg_key> or </tool_call> after the function name",
                        "args": "<arg_key> or </tool_call>", "key": "</arg_key>", "value": "</arg_value>"}[state]
            raise _fail_glm45(f"{tag} out of place in a tool call (expected {expected}; tags do not nest)", block)
    tail = body[pos:]
    if state != "out":
        raise _fail_glm45("unclosed <tool_call> (no </tool_call>)", body[block_at:])
    if calls and tail.strip():
        raise _fail_glm45("text after the last tool call (the content comes before the calls)", tail)
    if not calls:
        content = tail
    return content.strip(), calls


def _refuse_glm45_lone_surrogates(content: str, reasoning: str, calls: list[dict[str, Any]]) -> None:
    """ToolCallParseError for a lone surrogate in the content, the reasoning or a call's arguments."""
    for what, value in (("the message content", content), ("the reasoning", reasoning)):
        problem = _lone_surrogate(value, what)
        if problem:
            raise _fail_glm45(problem, value)
    for call in calls:
        problem = _lone_surrogate(call["function"]["arguments"], "a tool call argument")
        if problem:
            raise _fail_glm45(problem, call["function"]["arguments"])


# ------------------------------------------------------------------------------------------ Qwen3
def split_qwen3_reasoning(text: str) -> tuple[str, str]:
    """``(reasoning, rest)`` of a Qwen3 turn: the ``<think>...</think>`` block that may open it (after whitespace),
    stripped, and the text after it; ("", text) when the turn does not open with one. ToolCallParseError when
    the block is never closed (a turn cut by length while thinking)."""
    return _leading_think(text, _fail)


def parse_qwen3_assistant_text(
    text: str, tools: Sequence[dict] | None = None, call_id_start: int = 0
) -> dict[str, Any]:
    """Turn a generated Qwen3 assistant turn into an OpenAI assistant message with ``reasoning_content``.

    text: what the model wrote after ``<|im_start|>assistant\\n`` (a trailing ``<|im_end|>`` is ignored):
        ``<think>\\n{reasoning}\\n</think>\\n\\n`` (optional), then content and Hermes calls as
        :func:`parse_assistant_text` reads them. The reasoning is opaque: a call drafted inside it is no call.
    tools, call_id_start: as :func:`parse_assistant_text`.
    Returns :func:`parse_assistant_text`'s message plus ``reasoning_content`` (stripped; "" when there is no
    think block). Raises ToolCallParseError for an unclosed ``<think>``, a lone surrogate in the reasoning, and
    everything :func:`parse_assistant_text` refuses; never any other exception.
    """
    if text.endswith(IM_END):
        text = text[: -len(IM_END)]
    reasoning, body = split_qwen3_reasoning(text)
    message = parse_assistant_text(body, tools, call_id_start=call_id_start)
    problem = _lone_surrogate(reasoning, "the reasoning")
    if problem:
        raise _fail(problem, reasoning)
    message["reasoning_content"] = reasoning
    return message
