"""Tool-call parsers on hostile model output: only ToolCallParseError escapes, and what they accept re-serializes.

Property tests (hypothesis, derandomized and bounded) feed the parsers arbitrary text and arbitrary JSON text
inside the call wrappers (GLM-4.5: as argument values, typed and untyped), and render random GLM-4.5 turns back
from what the parser read of them; plain tests pin each refusal (deep nesting, long numbers, NaN / Infinity, lone
surrogates) and its message; agent-loop tests show one bad episode cannot take its batch down.
"""
from __future__ import annotations

import json
import logging
import re
from typing import Any, Callable

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from env_controller.protocol import SampleStatus
from rollout_sglang.chat_template import ChatTemplate, Glm45ChatTemplate
from rollout_sglang.tokenizer import (
    ARG_KEY_END,
    ARG_KEY_START,
    ARG_VALUE_END,
    ARG_VALUE_START,
    GLM_ASSISTANT,
    GLM_OBSERVATION,
    GLM_USER,
    IM_END,
    THINK_END,
    THINK_START,
    TOOL_CALL_END,
    TOOL_CALL_START,
)
from rollout_sglang.tool_parser import (
    MAX_JSON_DEPTH,
    MAX_NUMBER_DIGITS,
    ToolCallParseError,
    parse_assistant_text,
    parse_glm4_assistant_text,
    parse_glm45_assistant_text,
)
from rollout_sglang.trajectory import INTERNAL_ERROR
from tests.rollout.support import SCRIPTS, FakeEngine, FakeEnv, _check_alignment, run

PARSERS: list[Callable[..., dict[str, Any]]] = [parse_assistant_text, parse_glm4_assistant_text,
                                                parse_glm45_assistant_text]
# derandomize: the same examples on every run (reproducible in CI); no database: nothing written to the checkout
BOUNDED = settings(max_examples=150, deadline=None, derandomize=True, database=None,
                   suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])

# The exact inputs that escaped as RecursionError / ValueError before the parsers read JSON strictly.
DEEP_992 = '<tool_call>{"name":"x","arguments":{"a":' + "[" * 992 + "]" * 992 + "}}</tool_call>"
BIG_INT_4301 = '<tool_call>{"name":"x","arguments":{"a":' + "1" * 4301 + "}}</tool_call>"
GLM_DEEP_992 = 'x\n{"a":' + "[" * 992 + "]" * 992 + "}"
GLM_BIG_INT_4301 = 'x\n{"a":' + "1" * 4301 + "}"


def hermes(args: str) -> str:
    return f'{TOOL_CALL_START}{{"name": "x", "arguments": {args}}}{TOOL_CALL_END}'


def glm4(args: str) -> str:
    return f"x\n{args}"


WRAPS = [(parse_assistant_text, hermes), (parse_glm4_assistant_text, glm4)]


def parse_or_refuse(parser: Callable[..., dict[str, Any]], text: str) -> dict[str, Any] | None:
    """The parsed message, or None when refused; any exception but ToolCallParseError fails the test."""
    try:
        msg = parser(text)
    except ToolCallParseError as e:
        assert type(e) is ToolCallParseError
        str(e).encode("utf-8")  # the message itself must be storable and sendable
        return None
    assert_sendable(msg)
    return msg


def assert_sendable(msg: dict[str, Any]) -> None:
    """What a parser returns goes into a strict JSON request body: it must serialize without error."""
    json.dumps(msg, allow_nan=False, ensure_ascii=False).encode("utf-8")
    for call in msg["tool_calls"]:
        args = json.loads(call["function"]["arguments"])
        assert isinstance(args, dict)
        json.dumps(args, allow_nan=False, ensure_ascii=False).encode("utf-8")


# ------------------------------------------------------------------------------------------ strategies
# Every code point, lone surrogates included (hypothesis leaves category Cs out unless asked).
any_char = st.one_of(st.characters(), st.characters(categories=["Cs"]))
any_text = st.text(any_char, max_size=40)

FRAGMENTS = [TOOL_CALL_START, TOOL_CALL_END, IM_END, GLM_ASSISTANT, GLM_OBSERVATION, "\n", "x", " ", "{", "}", "[",
             "]", '"', "\\", ":", ",", '"name"', '"arguments"', '"x"', "NaN", "Infinity", "-", "1e400", "9" * 50,
             "\\ud800", "\\udc00", "\ud800", "\\u00e9", "{}", "[]", "null"]
# Text built from the pieces that matter to the parsers, mixed with arbitrary characters.
model_text = st.lists(st.one_of(st.sampled_from(FRAGMENTS), any_text), max_size=30).map("".join)


def _string_literal(s: str, ascii_only: bool) -> str:
    # ensure_ascii writes lone surrogates as \\udXXX escapes, without it they stay raw: both reach the parser
    return json.dumps(s, ensure_ascii=ascii_only)


json_string = st.builds(_string_literal, any_text, st.booleans())
json_number = st.one_of(
    st.integers().map(str),
    st.floats(allow_nan=True, allow_infinity=True).map(json.dumps),  # NaN, Infinity, -Infinity included
    st.integers(1, 5000).map(lambda n: "1" * n),
    st.tuples(st.integers(1, 300), st.integers(1, 300), st.integers(-500, 500)).map(
        lambda t: f"-{'7' * t[0]}.{'3' * t[1]}e{t[2]}"),
)
json_leaf = st.one_of(st.sampled_from(["null", "true", "false", "NaN", "Infinity", "-Infinity"]), json_number,
                      json_string)
# Arbitrary JSON text: every JSON value, plus the non-standard constants Python's json reads.
json_text = st.recursive(
    json_leaf,
    lambda inner: st.one_of(
        st.lists(inner, max_size=4).map(lambda xs: "[" + ",".join(xs) + "]"),
        st.lists(st.tuples(json_string, inner), max_size=4).map(
            lambda kv: "{" + ",".join(f"{k}:{v}" for k, v in kv) + "}"),
    ),
    max_leaves=30,
)
json_object_text = st.lists(st.tuples(json_string, json_text), max_size=5).map(
    lambda kv: "{" + ",".join(f"{k}:{v}" for k, v in kv) + "}")

# Text without chat tags: in a real tokenizer "<|assistant|>" or "</tool_call>" are control tokens that end a
# message or a call, never text inside a value (hypothesis draws the repo's string constants, tags included).
tagless_text = st.text(st.characters(blacklist_characters="<", blacklist_categories=["Cs"]), max_size=20)
# JSON that must always be accepted: finite numbers of few digits, valid Unicode, shallow.
safe_value = st.recursive(
    st.one_of(st.none(), st.booleans(), st.integers(-(10**30), 10**30), st.floats(allow_nan=False,
              allow_infinity=False), tagless_text),
    lambda inner: st.one_of(st.lists(inner, max_size=4), st.dictionaries(tagless_text, inner, max_size=4)),
    max_leaves=20,
)
safe_args = st.dictionaries(tagless_text, safe_value, max_size=5)


GLM45_FRAGMENTS = [THINK_START, THINK_END, TOOL_CALL_START, TOOL_CALL_END, ARG_KEY_START, ARG_KEY_END,
                   ARG_VALUE_START, ARG_VALUE_END, GLM_OBSERVATION, GLM_USER, "\n", "x", "n", "s", " ", "{", "}", "[",
                   "]", '"', "1", "NaN", "1e400", "9" * 120, "\ud800", "\ud800", "null", "true"]
glm45_text = st.lists(st.one_of(st.sampled_from(GLM45_FRAGMENTS), any_text), max_size=40).map("".join)
# a tool with a string, a number, an object and an untyped parameter: every way a value is read
GLM45_TOOLS = [{"type": "function", "function": {"name": "x", "parameters": {"type": "object", "properties": {
    "s": {"type": "string"}, "n": {"type": "number"}, "o": {"type": "object"}, "u": {}}}}}]


def glm45_call(pairs: list[tuple[str, str]]) -> str:
    return TOOL_CALL_START + "x" + "".join(f"\n{ARG_KEY_START}{k}{ARG_KEY_END}\n{ARG_VALUE_START}{v}{ARG_VALUE_END}"
                                           for k, v in pairs) + "\n" + TOOL_CALL_END


# ------------------------------------------------------------------------------------------ properties
@BOUNDED
@given(text=model_text)
def test_arbitrary_text_only_raises_tool_call_parse_error(text: str) -> None:
    for parser in PARSERS:
        parse_or_refuse(parser, text)


@BOUNDED
@given(args=json_object_text, content=any_text)
def test_arbitrary_json_in_the_wrappers(args: str, content: str) -> None:
    for parser, wrap in WRAPS:
        parse_or_refuse(parser, wrap(args))
    parse_or_refuse(parse_assistant_text, content + TOOL_CALL_START + args + TOOL_CALL_END)
    parse_or_refuse(parse_glm4_assistant_text, "\n" + content + GLM_ASSISTANT + glm4(args) + GLM_OBSERVATION)


@BOUNDED
@given(text=glm45_text, typed=st.booleans())
def test_arbitrary_glm45_text_only_raises_tool_call_parse_error(text: str, typed: bool) -> None:
    try:
        msg = parse_glm45_assistant_text(text, GLM45_TOOLS if typed else None)
    except ToolCallParseError as e:
        assert type(e) is ToolCallParseError
        str(e).encode("utf-8")
        return
    assert_sendable(msg)


@BOUNDED
@given(value=json_text, key=st.sampled_from(["s", "n", "o", "u"]), reasoning=any_text)
def test_arbitrary_json_as_a_glm45_argument_value(value: str, key: str, reasoning: str) -> None:
    text = f"\n{THINK_START}{reasoning}{THINK_END}\n" + glm45_call([(key, value)]) + GLM_OBSERVATION
    msg = parse_or_refuse(lambda t: parse_glm45_assistant_text(t, GLM45_TOOLS), text)
    clean = "<" not in value + reasoning and not any(0xD800 <= ord(c) <= 0xDFFF for c in value + reasoning)
    if key in ("s", "u") and clean:
        assert msg is not None, text  # a string or untyped value is never refused: at worst it is the text
    if msg is not None and key == "s":
        assert json.loads(msg["tool_calls"][0]["function"]["arguments"]) == {"s": value}


# a GLM-4.5 turn as render_assistant writes it: text without tags, string values for the string parameter,
# JSON values of any other type for the others
_plain = tagless_text
_non_string = safe_value.filter(lambda v: not isinstance(v, str))
glm45_args = st.fixed_dictionaries({}, optional={"s": _plain, "n": st.one_of(st.integers(-10**20, 10**20), st.floats(
    allow_nan=False, allow_infinity=False)), "o": st.dictionaries(st.text(max_size=5), safe_value, max_size=3),
    "u": _non_string})
glm45_message = st.builds(
    lambda reasoning, content, calls: {"role": "assistant", "reasoning_content": reasoning, "content": content,
                                       "tool_calls": [{"function": {"name": "x", "arguments": a}} for a in calls]},
    _plain.map(str.strip), _plain.map(str.strip), st.lists(glm45_args, max_size=3))


@settings(BOUNDED, max_examples=100)
@given(message=glm45_message)
def test_glm45_turns_round_trip(glm45_template: Glm45ChatTemplate, message: dict) -> None:
    text = glm45_template.render_assistant(message)
    for tools in (GLM45_TOOLS, None):
        msg = parse_glm45_assistant_text(text + GLM_OBSERVATION, tools)
        assert glm45_template.render_assistant(msg) == text
        assert msg["content"] == message["content"] and msg["reasoning_content"] == message["reasoning_content"]
        if tools:  # read by the schema: the same values
            assert [json.loads(c["function"]["arguments"]) for c in msg["tool_calls"]] == [
                c["function"]["arguments"] for c in message["tool_calls"]]


@settings(BOUNDED, max_examples=80)  # the slowest to generate; fewer examples keep the file at a few seconds
@given(args=safe_args, ascii_only=st.booleans())
def test_valid_json_is_accepted_unchanged(args: dict, ascii_only: bool) -> None:
    raw = json.dumps(args, ensure_ascii=ascii_only)
    for parser, wrap in WRAPS:
        msg = parse_or_refuse(parser, wrap(raw))
        assert msg is not None, raw
        assert json.loads(msg["tool_calls"][0]["function"]["arguments"]) == args


# Keys a model may write in a Hermes call object besides "name": the two the parsers read as the arguments, and
# ones a model may invent for them (or around them) that nothing reads.
READ_KEYS = ("arguments", "parameters")
INVENTED_KEYS = ("args", "input", "params", "kwargs", "argument", "tool_input", "function", "parameter", "id", "type",
                 "Arguments", "arguments ")
call_value = st.one_of(safe_args, safe_value, st.fixed_dictionaries(
    {"name": st.just("x")}, optional={"arguments": safe_args, "parameters": safe_args}))  # a nested call too
call_object = st.dictionaries(st.sampled_from(READ_KEYS + INVENTED_KEYS), call_value, max_size=3).map(
    lambda extra: {"name": "x", **extra})


def _empty(value: Any) -> bool:
    return value in ({}, [], "", None)


@BOUNDED
@given(obj=call_object, ascii_only=st.booleans(), order=st.booleans())
def test_no_call_loses_its_arguments(obj: dict, ascii_only: bool, order: bool) -> None:
    """Whatever keys a model writes, a call it accepts carries exactly what it read: the object under
    "arguments" or "parameters" (SGLang's reading), never an emptied one while argument-like content was
    written elsewhere in the object."""
    items = list(obj.items()) if order else list(reversed(obj.items()))
    raw = "{" + ",".join(f"{json.dumps(k)}: {json.dumps(v, ensure_ascii=ascii_only)}" for k, v in items) + "}"
    msg = parse_or_refuse(parse_assistant_text, f"{TOOL_CALL_START}\n{raw}\n{TOOL_CALL_END}")
    extra = set(obj) - {"name", *READ_KEYS}
    read = [k for k in READ_KEYS if k in obj]
    if msg is None:  # refused only for a key nothing reads, both keys at once, or non-object arguments
        assert extra or len(read) == 2 or not isinstance(obj[read[0]], dict), raw
        return
    assert not extra and len(read) <= 1, raw
    args = json.loads(msg["tool_calls"][0]["function"]["arguments"])
    assert args == (obj[read[0]] if read else {}), raw
    if args == {}:
        assert all(_empty(v) for k, v in obj.items() if k != "name"), raw


@BOUNDED
@given(depth=st.integers(1, 3000), opener=st.sampled_from(["[", '{"k":']))
def test_nesting_is_bounded(depth: int, opener: str) -> None:
    closer = "]" if opener == "[" else "}"
    value = opener * depth + "0" * (opener != "[") + closer * depth
    for parser, wrap in WRAPS:
        text = wrap('{"a": ' + value + "}")
        wrapper_levels = 2 if parser is parse_assistant_text else 1
        msg = parse_or_refuse(parser, text)
        assert (msg is not None) == (depth + wrapper_levels <= MAX_JSON_DEPTH)


@BOUNDED
@given(digits=st.integers(1, 6000), form=st.sampled_from(["{}", "-{}", "{}.5", "0.{}", "1e{}", "{}E-2"]))
def test_number_size_is_bounded(digits: int, form: str) -> None:
    literal = form.format("3" * digits)
    total = sum(c.isdigit() for c in literal)
    for parser, wrap in WRAPS:
        msg = parse_or_refuse(parser, wrap('{"n": ' + literal + "}"))
        if total > MAX_NUMBER_DIGITS:
            assert msg is None
        elif form != "1e{}" or digits < 3:  # 1e333... overflows to infinity: refused too
            assert msg is not None


@BOUNDED
@given(cp=st.integers(0xD800, 0xDFFF), escaped=st.booleans(), in_key=st.booleans(), pad=st.text(max_size=5))
def test_lone_surrogates_are_refused(cp: int, escaped: bool, in_key: bool, pad: str) -> None:
    body = json.dumps(pad)[1:-1]
    quoted = '"' + body + (f"\\u{cp:04x}" if escaped else chr(cp)) + body + '"'
    args = "{" + (f"{quoted}: 1" if in_key else f'"k": {quoted}') + "}"
    for parser, wrap in WRAPS:
        with pytest.raises(ToolCallParseError, match=f"lone surrogate U\\+{cp:04X}"):
            parser(wrap(args))


# ------------------------------------------------------------------------------------------ exact failures
@pytest.mark.parametrize("parser, text, problem", [
    (parse_assistant_text, DEEP_992, f"nested deeper than {MAX_JSON_DEPTH} levels"),
    (parse_glm4_assistant_text, GLM_DEEP_992, f"nested deeper than {MAX_JSON_DEPTH} levels"),
    (parse_assistant_text, BIG_INT_4301, f"a number with 4301 digits (at most {MAX_NUMBER_DIGITS})"),
    (parse_glm4_assistant_text, GLM_BIG_INT_4301, f"a number with 4301 digits (at most {MAX_NUMBER_DIGITS})"),
])
def test_former_crashes_are_tool_call_parse_errors(parser: Callable[..., Any], text: str, problem: str) -> None:
    with pytest.raises(ValueError) as info:  # ToolCallParseError is a ValueError: check the exact class
        parser(text)
    assert type(info.value) is ToolCallParseError
    assert problem in str(info.value)
    assert len(str(info.value)) < 600  # the offending text is quoted shortened


def test_hermes_messages_name_the_problem_and_show_a_valid_call() -> None:
    with pytest.raises(ToolCallParseError) as info:
        parse_assistant_text(DEEP_992)
    msg = str(info.value)
    assert msg.startswith(f"tool call JSON refused: nested deeper than {MAX_JSON_DEPTH} levels of arrays and objects")
    assert "a valid tool call looks like <tool_call>" in msg
    with pytest.raises(ToolCallParseError, match="arguments of tool call 'x' refused: a number with 4301 digits"):
        parse_glm4_assistant_text(GLM_BIG_INT_4301)


@pytest.mark.parametrize("value, problem", [
    ("NaN", "NaN is not a JSON number (numbers must be finite)"),
    ("Infinity", "Infinity is not a JSON number (numbers must be finite)"),
    ("-Infinity", "-Infinity is not a JSON number (numbers must be finite)"),
    ("[1, NaN]", "NaN is not a JSON number"),
    ("1e400", "the number 1e400 overflows to infinity (numbers must be finite)"),
    ("-1.5E+999", "the number -1.5E+999 overflows to infinity"),
    ('"\\ud800"', "invalid Unicode in a string: lone surrogate U+D800"),
    ('"ok \\udfff"', "invalid Unicode in a string: lone surrogate U+DFFF"),
    ('"\\ude00\\ud83d"', "lone surrogate U+DE00"),  # a pair in the wrong order is two lone halves
    ('"\ud800"', "invalid Unicode in a string: lone surrogate U+D800"),  # raw, not escaped
    ("9" * (MAX_NUMBER_DIGITS + 1), f"a number with {MAX_NUMBER_DIGITS + 1} digits"),
])
def test_values_that_would_break_a_strict_request_are_refused(value: str, problem: str) -> None:
    for parser, wrap in WRAPS:
        with pytest.raises(ToolCallParseError, match=re.escape(problem)):
            parser(wrap('{"a": ' + value + "}"))


def test_lone_surrogate_in_a_key_or_the_name_or_the_content_is_refused() -> None:
    for parser, wrap in WRAPS:
        with pytest.raises(ToolCallParseError, match="lone surrogate U\\+D800"):
            parser(wrap('{"\\ud800": 1}'))
    with pytest.raises(ToolCallParseError, match="lone surrogate U\\+DBFF"):
        parse_assistant_text('<tool_call>{"name": "x\\udbff"}</tool_call>')
    with pytest.raises(ToolCallParseError, match="invalid Unicode in the message content: lone surrogate U\\+D800"):
        parse_assistant_text("thinking \ud800 " + hermes("{}"))
    with pytest.raises(ToolCallParseError, match="invalid Unicode in the message content"):
        parse_glm4_assistant_text("\nthinking \udc00")


def test_limits_are_inclusive_and_nothing_valid_is_refused() -> None:
    at_limit = "[" * (MAX_JSON_DEPTH - 2) + "]" * (MAX_JSON_DEPTH - 2)  # + the call object and the arguments
    assert parse_assistant_text(hermes('{"a": ' + at_limit + "}"))["tool_calls"]
    with pytest.raises(ToolCallParseError, match="nested deeper"):
        parse_assistant_text(hermes('{"a": [' + at_limit + "]}"))
    # brackets inside strings (escaped quotes and backslashes too) are text, not nesting
    args = {"a": "[" * 500 + '\\"{' * 300, "b\\": "}" * 10}
    msg = parse_assistant_text(hermes(json.dumps(args)))
    assert json.loads(msg["tool_calls"][0]["function"]["arguments"]) == args
    n = int("8" * MAX_NUMBER_DIGITS)
    for parser, wrap in WRAPS:
        msg = parser(wrap(f'{{"n": {n}, "f": -1.5e308, "tiny": 1e-400, "pair": "😀", "esc": "\\\\ud800"}}'))
        out = json.loads(msg["tool_calls"][0]["function"]["arguments"])
        assert out == {"n": n, "f": -1.5e308, "tiny": 0.0, "pair": "😀", "esc": "\\ud800"}  # an escaped backslash
    msg = parse_assistant_text(hermes('{"pair": "\\ud83d\\ude00"}'))  # an escaped surrogate pair is one character
    assert json.loads(msg["tool_calls"][0]["function"]["arguments"]) == {"pair": "😀"}


# ------------------------------------------------------------------------------------------ agent loop
def test_deep_output_fails_its_episode_only(template: ChatTemplate, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(SCRIPTS, "deep", [DEEP_992])
    engine, env = FakeEngine(template), FakeEnv()
    trajs = run(engine, env, template, [("calc", 0, 0), ("deep", 0, 0), ("calc", 1, 0)],
                max_new_tokens=8192, max_total_tokens=16384)
    calc0, deep, calc1 = trajs
    assert deep.status == SampleStatus.AGENT_VALIDATION_FAILED.value and not deep.infra_failed
    assert deep.reward == 0.0 and deep.metrics["validation_error"] == 1.0
    assert f"nested deeper than {MAX_JSON_DEPTH} levels" in deep.error
    assert template.decode(deep.token_ids[slice(*deep.turn_spans[0])]) == DEEP_992 + IM_END  # the turn is kept
    assert env.cancelled == ["deep-0-2"] and env.received["deep-0-2"] == []
    for t in (calc0, calc1):
        assert t.status == "completed" and t.reward == 1.0 and t.error == ""
    for t in trajs:
        _check_alignment(t)


def test_unexpected_parser_exception_is_contained(
    template: ChatTemplate, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Defence in depth: a parser bug (here a RecursionError) ends that episode as an internal error (an
    infrastructure failure, never trained), logged once; the batch goes on."""
    monkeypatch.setitem(SCRIPTS, "deep", [DEEP_992])
    real = template.parse_assistant

    def buggy(text: str, *args: Any, **kwargs: Any) -> dict[str, Any]:
        if text.startswith("<tool_call>{\"name\":\"x\""):
            raise RecursionError("maximum recursion depth exceeded while decoding a JSON array")
        return real(text, *args, **kwargs)

    monkeypatch.setattr(template, "parse_assistant", buggy)
    engine, env = FakeEngine(template), FakeEnv()
    with caplog.at_level(logging.ERROR, logger="rollout_sglang.agent_loop"):
        trajs = run(engine, env, template, [("deep", 0, 7), ("calc", 0, 7), ("two", 1, 7)],
                    max_new_tokens=8192, max_total_tokens=16384)
    deep = trajs[0]
    assert deep.status == INTERNAL_ERROR and deep.infra_failed and deep.reward == 0.0
    assert deep.error.startswith("the tool-call parser failed: RecursionError(")
    assert env.cancelled == ["deep-0-1"]
    assert [t.status for t in trajs[1:]] == ["completed", "completed"]
    (record,) = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert "deep-0-1 (deep #0) turn 1" in record.getMessage() and "RecursionError" in record.getMessage()
    assert record.exc_info is not None and record.exc_info[0] is RecursionError
    assert engine.batch_sizes == [3, 2]
