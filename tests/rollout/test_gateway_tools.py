"""Function tools and tool_choice as each gateway API writes them: one reading (gateway/turn.py), the API's own
field names in every refusal."""
from __future__ import annotations

import pytest

from rollout_sglang.gateway import anthropic_format, openai_format, responses_format
from rollout_sglang.gateway.turn import ApiError, function_tools, openai_tool_choice

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}}
CHAT = {"type": "function", "function": {"name": "add", "description": "adds", "parameters": SCHEMA}, "strict": True}
RESPONSES = {"type": "function", "name": "add", "description": "adds", "parameters": SCHEMA}
MESSAGES = {"name": "add", "description": "adds", "input_schema": SCHEMA}


def _refusal(fn, *args) -> ApiError:
    with pytest.raises(ApiError) as e:
        fn(*args)
    assert e.value.status == 400
    return e.value


def test_each_api_gives_the_same_chat_template_tools():
    chat = function_tools([CHAT], openai_format.TOOL_SHAPE)
    assert chat == [CHAT]  # Chat Completions tools are the template's form already: kept whole
    want = [{"type": "function", "function": {"name": "add", "description": "adds", "parameters": SCHEMA}}]
    assert function_tools([RESPONSES], responses_format.TOOL_SHAPE) == want
    assert function_tools([MESSAGES], anthropic_format.TOOL_SHAPE) == want
    assert function_tools([{**MESSAGES, "type": "custom"}], anthropic_format.TOOL_SHAPE) == want
    bare = function_tools([{"type": "function", "name": "now"}], responses_format.TOOL_SHAPE)
    assert bare[0]["function"]["parameters"] == {"type": "object", "properties": {}}


@pytest.mark.parametrize("shape, tool, param, code", [
    (openai_format.TOOL_SHAPE, {"type": "retrieval"}, "tools[1].type", None),
    (openai_format.TOOL_SHAPE, {"type": "function", "function": "add"}, "tools[1].function", None),
    (openai_format.TOOL_SHAPE, CHAT, "tools[1].function.name", None),
    (openai_format.TOOL_SHAPE, {"type": "function", "function": {"name": "b", "parameters": "a, b"}},
     "tools[1].function.parameters", None),
    (responses_format.TOOL_SHAPE, {"type": "web_search"}, "tools[1].type", "unsupported_parameter"),
    (responses_format.TOOL_SHAPE, RESPONSES, "tools[1].name", None),
    (responses_format.TOOL_SHAPE, {"type": "function", "name": ""}, "tools[1].name", None),
    (anthropic_format.TOOL_SHAPE, {"type": "bash_20250124", "name": "bash"}, "tools[1].type", "unsupported_parameter"),
    (anthropic_format.TOOL_SHAPE, {"name": "b"}, "tools[1].input_schema", None),
    (anthropic_format.TOOL_SHAPE, MESSAGES, "tools[1].name", None),
])
def test_a_bad_tool_is_refused_naming_its_field(shape, tool, param, code):
    first = {openai_format.TOOL_SHAPE: CHAT, responses_format.TOOL_SHAPE: RESPONSES}.get(shape, MESSAGES)
    e = _refusal(function_tools, [first, tool], shape)
    assert e.param == param and e.message.startswith(f"{param}: ") and e.code == code
    assert _refusal(function_tools, {"add": first}, shape).param == "tools"
    assert _refusal(function_tools, [first, 3], shape).param == "tools[1]"


@pytest.mark.parametrize("under, named", [("function", {"type": "function", "function": {"name": "add"}}),
                                          ("", {"type": "function", "name": "add"})])
def test_openai_tool_choice_in_both_apis(under, named):
    tools = function_tools([CHAT], openai_format.TOOL_SHAPE)
    assert openai_tool_choice(None, tools, under) == ("auto", None)
    assert openai_tool_choice(None, [], under) == ("none", None)
    assert openai_tool_choice("required", tools, under) == ("required", None)
    assert openai_tool_choice(named, tools, under) == ("function", "add")
    assert _refusal(openai_tool_choice, "required", [], under).param == "tool_choice"
    assert _refusal(openai_tool_choice, "sometimes", tools, under).param == "tool_choice"
    e = _refusal(openai_tool_choice, {"type": "file_search"}, tools, under)
    assert e.param == "tool_choice" and e.code == "unsupported_parameter"
    other = {"type": "function", "function": {"name": "mul"}} if under else {"type": "function", "name": "mul"}
    e = _refusal(openai_tool_choice, other, tools, under)
    assert e.param == f"tool_choice.{under + '.' if under else ''}name" and "'mul'" in e.message and "add" in e.message
