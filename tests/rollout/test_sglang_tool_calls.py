"""Our Hermes / Qwen2.5 / Qwen3 tool-call parser against SGLang 0.5.23's own detectors (``Qwen25Detector``,
``HermesDetector``), run from its wheel (``rollout_sglang.testing.sglang_detectors``).

Where we accept a call, SGLang reads the same name and arguments. Where we refuse, SGLang either drops the call too
(bad JSON, an unknown tool) or would have lost or guessed at the arguments: a key besides "name" / "arguments" /
"parameters" (SGLang reads none of them: the call gets ``{}``), or "arguments" and "parameters" both (SGLang takes
"parameters" when it is non-empty, else "arguments"; its streaming path refuses the pair).
"""
from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rollout_sglang.testing.sglang_detectors import load_detectors, sglang_calls
from rollout_sglang.tool_parser import ToolCallParseError, parse_assistant_text, parse_qwen3_assistant_text

NAMES = ["search", "submit"]
TOOLS = [{"type": "function", "function": {"name": n, "parameters": {"type": "object", "properties": {}}}}
         for n in NAMES]


@pytest.fixture(scope="module")
def detectors(wheel):
    pytest.importorskip("pydantic")
    return load_detectors(wheel)


def block(body: str) -> str:
    return f"<tool_call>\n{body}\n</tool_call>"


def ours(text: str) -> list[tuple[str, Any]] | str:
    """Our calls as (name, arguments), or the refusal's message."""
    try:
        msg = parse_assistant_text(text, TOOLS)
    except ToolCallParseError as e:
        return str(e)
    return [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in msg["tool_calls"]]


def theirs(detectors, text: str) -> list[list[tuple[str, Any]]]:
    return [sglang_calls(d(), text, NAMES) for d in (detectors.Qwen25Detector, detectors.HermesDetector)]


AGREED = [
    block('{"name": "search", "arguments": {"q": "héllo", "k": [1, 2.5, null, true]}}'),
    "Let me look.\n" + block('{"name": "search", "arguments": {"q": "a"}}') + "\n"
    + block('{"name": "submit", "arguments": {}}'),
    block('{"name": "search"}'),  # no arguments: none
    block('{"name": "search", "parameters": {"q": "x"}}'),  # read as the arguments, by both
    block('{"parameters": {"q": {"deep": ["x"]}}, "name": "search"}'),
    block('{"name": "search", "parameters": {}}'),
    block('{"name": "search", "arguments": {"parameters": {"q": 1}, "args": 2}}'),  # inside the arguments: data
    "plain text, no call",
]


@pytest.mark.parametrize("text", AGREED)
def test_accepted_calls_read_as_sglang_reads_them(detectors, text: str) -> None:
    got = ours(text)
    assert not isinstance(got, str), got
    for sglang in theirs(detectors, text):
        assert got == sglang
    # Qwen3: the same calls after a think block (SGLang's reasoning parser strips it before the detector)
    msg = parse_qwen3_assistant_text("<think>\nr\n</think>\n\n" + text, TOOLS)
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in msg["tool_calls"]] == got


@pytest.mark.parametrize(
    "body, sglang_args, problem",
    [
        # SGLang reads none of these keys: the model's arguments become {}
        ('{"name": "search", "args": {"q": "x"}}', {}, "'args' besides"),
        ('{"name": "search", "input": {"q": "x"}}', {}, "'input' besides"),
        ('{"name": "search", "params": {"q": "x"}}', {}, "'params' besides"),
        ('{"name": "search", "function": {"arguments": {"q": "x"}}}', {}, "'function' besides"),
        ('{"name": "search", "arguments": {"q": "x"}, "k": 2}', {"q": "x"}, "'k' besides"),  # k lost
        # both keys: SGLang takes "parameters" when non-empty, else "arguments"; one of them is lost
        ('{"name": "search", "arguments": {"q": "x"}, "parameters": {"k": 2}}', {"k": 2}, "both"),
        ('{"name": "search", "arguments": {"q": "x"}, "parameters": {}}', {"q": "x"}, "both"),
    ],
)
def test_refused_where_sglang_would_drop_or_guess_arguments(detectors, body: str, sglang_args: dict,
                                                           problem: str) -> None:
    text = block(body)
    got = ours(text)
    assert isinstance(got, str) and problem in got
    for sglang in theirs(detectors, text):
        assert sglang == [("search", sglang_args)]  # what SGLang would pass on: not all the model wrote


def test_a_nested_call_sglang_drops_is_refused(detectors) -> None:
    text = block('{"function": {"name": "search", "arguments": {"q": "x"}}}')
    assert "'function' besides" in ours(text)
    assert theirs(detectors, text) == [[], []]  # no top-level name: SGLang skips the call


_value = st.recursive(st.one_of(st.none(), st.booleans(), st.integers(-1000, 1000), st.text(max_size=5)),
                      lambda inner: st.one_of(st.lists(inner, max_size=3),
                                              st.dictionaries(st.text(max_size=4), inner, max_size=3)),
                      max_leaves=8)
_args = st.dictionaries(st.text(max_size=4), _value, max_size=3)
_obj = st.builds(lambda name, extra: {"name": name, **extra}, st.sampled_from(NAMES + ["other"]),
                 st.dictionaries(st.sampled_from(["arguments", "parameters", "args", "input", "function"]),
                                 st.one_of(_args, _value), max_size=2))


@settings(max_examples=150, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.too_slow])
# no lone surrogates in the text: we refuse them (invalid Unicode, test_tool_parser_properties.py), SGLang does not
@given(objs=st.lists(_obj, min_size=1, max_size=3),
       content=st.text(st.characters(blacklist_characters="<", blacklist_categories=("Cs",)), max_size=10))
def test_every_call_we_accept_sglang_reads_the_same(detectors, objs: list[dict], content: str) -> None:
    text = content + "".join("\n" + block(json.dumps(o, ensure_ascii=False)) for o in objs)
    got = ours(text)
    if isinstance(got, str):  # refused: a key nothing reads, both keys, non-object arguments or an unknown tool
        keys = {k for o in objs for k in o}
        assert (keys - {"name", "arguments", "parameters"} or any({"arguments", "parameters"} <= set(o) for o in objs)
                or any(not isinstance(o.get("arguments", o.get("parameters", {})), dict) for o in objs)
                or any(o["name"] == "other" for o in objs)), (text, got)
        return
    for sglang in theirs(detectors, text):
        assert got == sglang, text
