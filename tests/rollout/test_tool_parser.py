"""Hermes / Qwen2.5 tool-call parsing: valid calls, plain text, and every malformed kind."""
from __future__ import annotations

import json

import pytest

from rollout_sglang.tool_parser import ToolCallParseError, parse_assistant_text

TOOLS = [
    {"type": "function", "function": {"name": "search", "parameters": {"type": "object", "properties": {}}}},
    {"type": "function", "function": {"name": "submit", "parameters": {"type": "object", "properties": {}}}},
]


def test_single_call_with_content() -> None:
    text = 'Let me look.\n<tool_call>\n{"name": "search", "arguments": {"q": "héllo", "k": 3}}\n</tool_call>'
    msg = parse_assistant_text(text, TOOLS)
    assert msg["role"] == "assistant"
    assert msg["content"] == "Let me look."
    assert len(msg["tool_calls"]) == 1
    call = msg["tool_calls"][0]
    assert call["id"] == "call_0" and call["type"] == "function"
    assert call["function"]["name"] == "search"
    assert isinstance(call["function"]["arguments"], str)
    assert json.loads(call["function"]["arguments"]) == {"q": "héllo", "k": 3}


def test_several_calls_ids_and_trailing_im_end() -> None:
    text = (
        '<tool_call>\n{"name": "search", "arguments": {"q": "a"}}\n</tool_call>\n'
        '<tool_call>\n{"name": "submit", "arguments": {}}\n</tool_call><|im_end|>'
    )
    msg = parse_assistant_text(text, TOOLS, call_id_start=5)
    assert msg["content"] == ""
    assert [c["function"]["name"] for c in msg["tool_calls"]] == ["search", "submit"]
    assert [c["id"] for c in msg["tool_calls"]] == ["call_5", "call_6"]
    assert json.loads(msg["tool_calls"][1]["function"]["arguments"]) == {}


def test_missing_arguments_means_empty_object_and_no_tool_list_accepts_any_name() -> None:
    msg = parse_assistant_text('<tool_call>{"name": "anything"}</tool_call>')
    assert msg["tool_calls"][0]["function"] == {"name": "anything", "arguments": "{}"}


def test_plain_text_is_a_valid_message() -> None:
    msg = parse_assistant_text("  The answer is 42.  ", TOOLS)
    assert msg == {"role": "assistant", "content": "The answer is 42.", "tool_calls": []}


@pytest.mark.parametrize(
    "text, problem, quoted",
    [
        ('<tool_call>\n{"name": "search", "arguments": {"q": }\n</tool_call>', "not valid JSON", '{"name": "search"'),
        ('<tool_call>\n{"arguments": {"q": "x"}}\n</tool_call>', 'no "name"', '{"arguments"'),
        ('<tool_call>\n{"name": 3, "arguments": {}}\n</tool_call>', 'no "name"', '{"name": 3'),
        ('<tool_call>\n{"name": "search", "arguments": "{\\"q\\": 1}"}\n</tool_call>',
         '"arguments" must be a JSON object, got str', '"arguments"'),
        ('<tool_call>\n["search"]\n</tool_call>', "must be a JSON object, got list", '["search"]'),
        ('<tool_call>\n{"name": "search", "arguments": {"q": "x"}}', "unclosed <tool_call>", '{"name": "search"'),
        ('oops</tool_call>', "</tool_call> without a matching <tool_call>", "oops</tool_call>"),
        ('<tool_call>{"name": "a"}<tool_call>{"name": "b"}</tool_call>', "opened again", '{"name": "a"}'),
        ('<tool_call>\n{"name": "rm_rf", "arguments": {}}\n</tool_call>',
         "unknown tool 'rm_rf' (available: search, submit)", '"rm_rf"'),
        ("<tool_call>\n \n</tool_call>", "empty <tool_call> block", "<tool_call>"),
    ],
)
def test_malformed_calls_raise_with_quote_and_example(text: str, problem: str, quoted: str) -> None:
    with pytest.raises(ToolCallParseError) as info:
        parse_assistant_text(text, TOOLS)
    msg = str(info.value)
    assert problem in msg
    assert quoted in msg
    assert "a valid tool call looks like <tool_call>" in msg
    assert isinstance(info.value, ValueError)


def test_long_offending_text_is_shortened() -> None:
    text = "<tool_call>{" + "x" * 5000
    with pytest.raises(ToolCallParseError) as info:
        parse_assistant_text(text)
    assert len(str(info.value)) < 500
    assert " ... " in str(info.value)


def test_parameters_is_read_as_arguments() -> None:
    """SGLang's Hermes / Qwen2.5 detectors read a "parameters" key as the arguments; so do we (never as no
    arguments, which the parser once did)."""
    msg = parse_assistant_text('<tool_call>\n{"name": "search", "parameters": {"q": "x", "k": 2}}\n</tool_call>',
                               TOOLS)
    assert json.loads(msg["tool_calls"][0]["function"]["arguments"]) == {"q": "x", "k": 2}
    msg = parse_assistant_text('<tool_call>\n{"parameters": {}, "name": "search"}\n</tool_call>', TOOLS)
    assert msg["tool_calls"][0]["function"]["arguments"] == "{}"


@pytest.mark.parametrize(
    "body, problem",
    [
        ('{"name": "search", "args": {"q": "x"}}', "key(s) 'args' besides \"name\" and \"arguments\""),
        ('{"name": "search", "input": {"q": "x"}}', "key(s) 'input' besides"),
        ('{"name": "search", "arguments": {"q": "x"}, "k": 2}', "key(s) 'k' besides"),
        ('{"function": {"name": "search", "arguments": {"q": "x"}}}', "key(s) 'function' besides"),
        ('{"name": "search", "function": {"arguments": {"q": "x"}}, "id": "c1"}', "key(s) 'function', 'id' besides"),
        ('{"name": "search", "arguments": {}, "parameters": {"q": "x"}}',
         'both "arguments" and "parameters" (write the arguments once, as "arguments")'),
        ('{"name": "search", "parameters": "{\\"q\\": 1}"}', '"parameters" must be a JSON object, got str'),
        ('{"name": "search", "parameters": null}', '"parameters" must be a JSON object, got NoneType'),
    ],
)
def test_arguments_under_another_key_are_refused_not_dropped(body: str, problem: str) -> None:
    with pytest.raises(ToolCallParseError) as info:
        parse_assistant_text(f"<tool_call>\n{body}\n</tool_call>", TOOLS)
    assert problem in str(info.value)
    assert body[:20] in str(info.value)
