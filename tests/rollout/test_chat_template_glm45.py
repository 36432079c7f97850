"""GLM-4.5 chat format: exact text against GLM-4.5's jinja template, incremental token pieces, the GLM-4.5
tool-call parser, template selection, and the agent loop on GLM-4.5 turns."""
from __future__ import annotations

import json

import pytest

from megatron_agentrl.convert import resolve_chat_template
from rollout_sglang.chat_template import (
    CHAT_TEMPLATES,
    Glm45ChatTemplate,
    build_chat_template,
)
from rollout_sglang.tokenizer import GLM45_SPECIAL_TOKENS
from rollout_sglang.tool_parser import ToolCallParseError, parse_glm45_assistant_text
from tests.rollout.chat_formats import GLM45_SCRIPT as SCRIPT
from tests.rollout.chat_formats import GLM45_THINKING as THINKING
from tests.rollout.chat_formats import TOOLS, USERLESS, check_jinja_render, glm45_engine, render_cases
from tests.rollout.chat_formats import glm45_call as _call
from tests.rollout.chat_formats import glm45_messages as _jinja_messages
from tests.rollout.chat_formats import render_glm45 as _jinja_render
from tests.rollout.support import (
    ADD_TOOLS,
    CONVERSATION,
    REASONING_CONVERSATION,
    TRIP_TOOLS,
    check_chat_template_option,
    check_turns_as_generated,
    mask_spans,
    parse_error,
    play_calc,
    tool_call,
)


# ------------------------------------------------------------------------------------------ the text
@pytest.mark.parametrize("add_generation_prompt", [False, True])
@pytest.mark.parametrize(
    "messages, tools",
    render_cases(TOOLS, late_system=True) + [
        (THINKING, TOOLS),  # reasoning after the last user turn, as a field and inside the content
        (REASONING_CONVERSATION, TRIP_TOOLS),  # reasoning before the last user turn too; every JSON type, non-ASCII
        (REASONING_CONVERSATION[:5], TRIP_TOOLS),  # ends on a user turn: no reasoning shows
        (USERLESS, TRIP_TOOLS),  # no user turn: every reasoning shows
    ],
)
def test_render_text_matches_glm45_jinja(glm45_template: Glm45ChatTemplate, messages, tools,
                                         add_generation_prompt) -> None:
    # and arguments given as objects (HF style) render the same
    check_jinja_render(glm45_template, _jinja_render, _jinja_messages, messages, tools, add_generation_prompt)


def test_format_details_as_written_in_the_facts(glm45_template: Glm45ChatTemplate) -> None:
    """The layout spelled out by hand, independently of the jinja text above."""
    tool = {"type": "function", "function": {"name": "add", "description": "Somme (加法).", "parameters": {}}}
    msgs = [{"role": "user", "content": "Hi"},
            {"role": "assistant", "reasoning_content": " think ", "content": " Sure. ",
             "tool_calls": [tool_call("c0", "add", {"a": 1, "b": "x y", "c": [1.5, None]})]},
            {"role": "tool", "content": "3"}, {"role": "tool", "content": "4"}]
    expected = (
        "[gMASK]<sop><|system|>\n# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
        "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n"
        + json.dumps(tool, ensure_ascii=False) + "\n</tools>\n\nFor each function call, output the function name "
        "and arguments within the following XML format:\n<tool_call>{function-name}\n<arg_key>{arg-key-1}</arg_key>"
        "\n<arg_value>{arg-value-1}</arg_value>\n<arg_key>{arg-key-2}</arg_key>\n<arg_value>{arg-value-2}"
        "</arg_value>\n...\n</tool_call>"
        "<|user|>\nHi<|assistant|>\n<think>think</think>\nSure.\n<tool_call>add\n<arg_key>a</arg_key>\n"
        "<arg_value>1</arg_value>\n<arg_key>b</arg_key>\n<arg_value>x y</arg_value>\n<arg_key>c</arg_key>\n"
        "<arg_value>[1.5, null]</arg_value>\n</tool_call>"
        "<|observation|>\n<tool_response>\n3\n</tool_response>\n<tool_response>\n4\n</tool_response><|assistant|>"
    )
    assert "加法" in expected
    assert glm45_template.render_text(msgs, [tool], add_generation_prompt=True) == expected
    assert _jinja_render(msgs, [tool], True) == expected
    assert glm45_template.render_text([{"role": "user", "content": "Hi"}]) == "[gMASK]<sop><|user|>\nHi"
    assert glm45_template.render_assistant({"role": "assistant", "content": "Hi"}) == "\n<think></think>\nHi"
    tok = glm45_template.tokenizer
    stops = ("<|user|>", "<|observation|>", "<|endoftext|>")
    assert glm45_template.stop_token_ids == [tok.convert_tokens_to_ids(t) for t in stops]
    for t in GLM45_SPECIAL_TOKENS:  # each tag a single id
        assert len(tok.encode(t, add_special_tokens=False)) == 1
    with pytest.raises(ValueError, match="tool call 'add' has arguments .*must be a JSON object"):
        glm45_template.render_assistant({"role": "assistant", "tool_calls": [
            {"function": {"name": "add", "arguments": "[1, 2]"}}]})


# ------------------------------------------------------------------------------------------ the tokens
def _pieces(template: Glm45ChatTemplate, msgs: list[dict], tools: list[dict] | None) -> list[int]:
    """prompt + (assistant turn + its stop token + env reply)*, checking each prompt against the render."""
    a_idx = [i for i, m in enumerate(msgs) if m["role"] == "assistant"]
    ids = template.encode_prompt(msgs[: a_idx[0]], tools)
    assert template.decode(ids) == template.render_text(msgs[: a_idx[0]], tools, add_generation_prompt=True)
    for k, i in enumerate(a_idx):
        following = msgs[i + 1 : a_idx[k + 1]] if k + 1 < len(a_idx) else []
        turn = template.encode_assistant(msgs[i], template.turn_end_id(following))
        assert template.decode(turn[:-1]) == template.render_assistant(msgs[i])
        assert turn[-1] in template.stop_token_ids
        ids += turn
        if k + 1 < len(a_idx):
            ids += template.encode_env_reply(following, ended_with=turn[-1])
    return ids


@pytest.mark.parametrize("msgs, tools", [(CONVERSATION, TOOLS), (THINKING, TOOLS), (USERLESS, TRIP_TOOLS),
                                         (CONVERSATION[1:7], None)])
def test_incremental_pieces_decode_to_full_render(glm45_template: Glm45ChatTemplate, glm45_tokenizer, msgs,
                                                  tools) -> None:
    ids = _pieces(glm45_template, msgs, tools)
    full = glm45_template.render_text(msgs, tools)
    assert full == _jinja_render(msgs, tools, False)
    a_idx = [i for i, m in enumerate(msgs) if m["role"] == "assistant"]
    # the last turn ends as the model ends an answer (messages after it are not part of the layout)
    expected = glm45_template.render_text(msgs[: a_idx[-1] + 1], tools) + "<|user|>"
    assert glm45_template.decode(ids) == expected
    # pieces split at chat tokens: identical to tokenizing the whole text at once
    assert ids == glm45_tokenizer.encode(expected, add_special_tokens=False)

    conv_ids, mask = glm45_template.encode_conversation(msgs, tools)
    assert conv_ids == ids and len(mask) == len(conv_ids)
    ends = ["<|observation|>" if msgs[i + 1]["role"] == "tool" else "<|user|>" for i in a_idx[:-1]] + ["<|user|>"]
    assert [glm45_template.decode(conv_ids[s:e]) for s, e in mask_spans(mask)] == [
        glm45_template.render_assistant(msgs[i]) + end for i, end in zip(a_idx, ends)]


def test_reasoning_before_the_last_user_turn_stays_in_the_trajectory(glm45_template: Glm45ChatTemplate) -> None:
    """A trajectory is never re-rendered: the reasoning the model wrote before a later user turn stays in it,
    where the official template, rendering the whole conversation, leaves an empty think block."""
    msgs, tools = REASONING_CONVERSATION, TRIP_TOOLS
    ids = _pieces(glm45_template, msgs, tools)
    full = glm45_template.render_text(msgs, tools)
    first = "The user wants Tokyo → Osaka, at most one change."
    assert first not in full
    assert glm45_template.decode(ids) == full.replace("<think></think>", f"<think>{first}</think>", 1) + "<|user|>"
    conv_ids, mask = glm45_template.encode_conversation(msgs, tools)
    assert conv_ids == ids
    assert glm45_template.decode(conv_ids[slice(*mask_spans(mask)[0])]).startswith(f"\n<think>{first}</think>")


def test_env_reply_piece_shapes(glm45_template: Glm45ChatTemplate) -> None:
    t = glm45_template
    obs, user = t.role_ids["observation"], t.role_ids["user"]
    tools_then_user = [{"role": "tool", "content": "a"}, {"role": "tool", "content": "b"},
                       {"role": "user", "content": "c"}]
    piece = "\n<tool_response>\na\n</tool_response>\n<tool_response>\nb\n</tool_response><|user|>\nc<|assistant|>"
    assert t.decode(t.encode_env_reply(tools_then_user)) == piece
    assert t.decode(t.encode_env_reply(tools_then_user, ended_with=obs)) == piece
    for ended in (None, user, t.eos_token_id):  # cut by length, or another stop token: the role token is kept
        assert t.decode(t.encode_env_reply(tools_then_user, ended_with=ended)) == "<|observation|>" + piece
    assert t.decode(t.encode_env_reply([])) == "<|assistant|>"
    assert t.decode(t.encode_env_reply([{"role": "system", "content": "s"}], ended_with=None)) == (
        "<|system|>\ns<|assistant|>")
    # an assistant message of the env's own keeps its reasoning unless a user message follows it here
    own = {"role": "assistant", "content": "x", "reasoning_content": "r"}
    assert t.decode(t.encode_env_reply([{"role": "user", "content": "u"}, own], ended_with=user)) == (
        "\nu<|assistant|>\n<think>r</think>\nx<|assistant|>")
    assert t.decode(t.encode_env_reply([own, {"role": "user", "content": "u"}], ended_with=None)) == (
        "<|assistant|>\n<think></think>\nx<|user|>\nu<|assistant|>")


# ----------------------------------------------------------------------------------- the parser
def test_parse_reasoning_content_calls_and_stop_tokens() -> None:
    text = ("\n<think> Look it up. </think>\nI will look.\n" + _call("search", ("q", "héllo 42"))
            + "\n" + _call("submit") + "<|observation|>")
    msg = parse_glm45_assistant_text(text, TOOLS, call_id_start=4)
    assert msg["content"] == "I will look." and msg["reasoning_content"] == "Look it up."
    assert [c["id"] for c in msg["tool_calls"]] == ["call_4", "call_5"]
    assert [c["function"]["name"] for c in msg["tool_calls"]] == ["search", "submit"]
    assert json.loads(msg["tool_calls"][0]["function"]["arguments"]) == {"q": "héllo 42"}
    assert msg["tool_calls"][1]["function"]["arguments"] == "{}"
    assert parse_glm45_assistant_text("\n<think></think>\nThe answer is 42.  <|user|>", TOOLS) == {
        "role": "assistant", "content": "The answer is 42.", "tool_calls": [], "reasoning_content": ""}
    # no think block at all: all content; a turn cut by length keeps its text
    assert parse_glm45_assistant_text("plain")["content"] == "plain"
    assert parse_glm45_assistant_text("\n<think>x</think>\ncut mid-sent")["content"] == "cut mid-sent"
    # reasoning is opaque: a call drafted while thinking is not a call
    assert parse_glm45_assistant_text("<think>maybe <tool_call>x</think>\nno.")["tool_calls"] == []


def test_parse_reads_values_by_the_declared_type() -> None:
    text = _call("search_trains", ("from", "42"), ("to", " 大阪 "), ("max_changes", "1"),
                 ("filters", '{"fast": true}'), ("date", "null"), ("extra", "[1, 2]"), ("note", '"quoted"'),
                 ("free", "not json"))
    args = json.loads(parse_glm45_assistant_text(text, TRIP_TOOLS)["tool_calls"][0]["function"]["arguments"])
    assert args == {"from": "42", "to": " 大阪 ", "max_changes": 1, "filters": {"fast": True}, "date": None,
                    "extra": [1, 2], "note": '"quoted"', "free": "not json"}
    assert list(args) == ["from", "to", "max_changes", "filters", "date", "extra", "note", "free"]  # order kept
    # without a tool list: JSON when the text is JSON of a non-string, else the text; any name
    args = json.loads(parse_glm45_assistant_text(_call("anything", ("n", "1.5"), ("s", "1.5 km")))["tool_calls"][0]
                      ["function"]["arguments"])
    assert args == {"n": 1.5, "s": "1.5 km"}
    # an untyped value beyond the strict limits is kept as text; a typed one is refused
    deep = "[" * 100 + "]" * 100
    args = json.loads(parse_glm45_assistant_text(_call("x", ("v", deep)))["tool_calls"][0]["function"]["arguments"])
    assert args == {"v": deep}
    with pytest.raises(ToolCallParseError, match="argument 'filters' of tool call 'search_trains': value refused: "
                                                 "nested deeper than 64 levels"):
        parse_glm45_assistant_text(_call("search_trains", ("filters", deep)), TRIP_TOOLS)


def test_parse_round_trips_render(glm45_template: Glm45ChatTemplate) -> None:
    for messages, tools in ((THINKING, TOOLS), (REASONING_CONVERSATION, TRIP_TOOLS)):
        for m in messages:
            if m["role"] != "assistant":
                continue
            text = glm45_template.render_assistant(m)
            msg = glm45_template.parse_assistant(text, tools)
            assert glm45_template.render_assistant(msg) == text
            assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in msg["tool_calls"]] == [
                (c["function"]["name"], json.loads(c["function"]["arguments"])) for c in m.get("tool_calls") or []]


VALID = "a valid call looks like"


@pytest.mark.parametrize(
    "text, problem, quoted",
    [
        (_call("delete_all"), "unknown tool 'delete_all' (available: search, submit)", "<tool_call>delete_all"),
        ("<tool_call>search\n<arg_key>q</arg_key>\n<arg_value>x</arg_value>", "unclosed <tool_call> (no </tool_call>)",
         "<arg_value>x</arg_value>"),
        ("\n<think>still thinking", "unclosed <think> (no </think>)", "still thinking"),
        ("<tool_call>search\n<arg_key>q</arg_key>\n<arg_value>x</arg_value>\n<arg_key>q</arg_key>",
         "duplicate argument 'q' in tool call 'search'", "<arg_key>q</arg_key>"),
        ("<tool_call>search\n<arg_key>q</arg_key>\n</tool_call>",
         "argument 'q' of tool call 'search' has no <arg_value> (got </tool_call>)", "<arg_key>q</arg_key>"),
        ("<tool_call>search\n<arg_value>x</arg_value>\n</tool_call>",
         "<arg_value> out of place in a tool call (expected <arg_key> or </tool_call> after the function name",
         "<arg_value>"),
        ("<tool_call>search\n<arg_key>q</arg_key> and <arg_value>x</arg_value>\n</tool_call>",
         "text between </arg_key> and <arg_value> of argument 'q'", " and "),
        ("<tool_call>search\n<arg_key>q</arg_key>\n<arg_value>x</arg_value> then\n</tool_call>",
         "text between the tags of tool call 'search'", " then"),
        (_call("search", ("q", "x")) + "\nI called it.", "text after the last tool call", "I called it."),
        (_call("search", ("q", "x")) + "\nand\n" + _call("submit"), "text between tool calls", "and"),
        ("<tool_call>search\n<tool_call>submit\n</tool_call>",
         "<tool_call> out of place in a tool call (expected <arg_key> or </tool_call> after the function name; "
         "tags do not nest)", "<tool_call>search"),
        ("<tool_call>search\n<arg_key>q<arg_key>", "<arg_key> out of place in a tool call (expected </arg_key>",
         "<arg_key>q<arg_key>"),
        ("<tool_call>search\n<arg_key>q</arg_key>\n<arg_value>a<think>", "<think> out of place in a tool call "
         "(expected </arg_value>", "a<think>"),
        ("<tool_call>\n<arg_key>q</arg_key>", "tool call has no function name after <tool_call>", "<tool_call>"),
        ("<tool_call>Sure, here\n</tool_call>", "'Sure, here' after <tool_call> is not a function name", "Sure"),
        ("<tool_call>search\n<arg_key> </arg_key>", "empty <arg_key> in tool call 'search'", "<arg_key> </arg_key>"),
        ("Answer: </tool_call>", "</tool_call> out of place (outside a <tool_call> block)", "Answer: </tool_call>"),
        ("\n<think>a</think>\nok <think>b</think>", "<think> out of place (the reasoning comes first, once",
         "ok <think>"),
        (_call("search", ("q", "\ud800")), "invalid Unicode in a tool call argument: lone surrogate U+D800", "q"),
        ("\nok \udc00", "invalid Unicode in the message content: lone surrogate U+DC00", "ok"),
    ],
)
def test_parse_errors_name_the_problem(text: str, problem: str, quoted: str) -> None:
    msg = parse_error(parse_glm45_assistant_text, text, TOOLS)
    assert problem in msg and quoted in msg
    assert "a GLM-4.5 tool call is the function name after <tool_call>" in msg
    assert "<arg_key><arg></arg_key>" in msg  # shows a valid call


def test_parse_error_for_a_typed_value_that_is_not_json() -> None:
    with pytest.raises(ToolCallParseError, match="argument 'max_changes' of tool call 'search_trains' is declared "
                                                 "integer but its value is not JSON"):
        parse_glm45_assistant_text(_call("search_trains", ("max_changes", "one")), TRIP_TOOLS)


# -------------------------------------------------------------------------------- selection
def test_template_selection(glm45_tokenizer) -> None:
    assert "glm45" in CHAT_TEMPLATES
    assert resolve_chat_template("auto", "glm4_moe") == "glm45"
    assert resolve_chat_template("auto", "glm4") == "glm4"
    assert resolve_chat_template("auto", "qwen3_moe") == "qwen3" and resolve_chat_template("auto", None) == "qwen2"
    assert resolve_chat_template("glm45", "qwen2") == "glm45"
    with pytest.raises(ValueError, match="'glm4.5' is not one of auto, qwen2, glm4, glm45"):
        resolve_chat_template("glm4.5")
    auto = resolve_chat_template("auto", "glm4_moe")
    assert isinstance(build_chat_template(auto, glm45_tokenizer), Glm45ChatTemplate)
    assert isinstance(build_chat_template("glm45", glm45_tokenizer), Glm45ChatTemplate)


def test_config_takes_glm45_and_auto_for_glm4_moe(tmp_path) -> None:
    from megatron_agentrl.config import CHAT_TEMPLATE_CHOICES
    from megatron_agentrl.convert import default_chat_template

    assert CHAT_TEMPLATE_CHOICES == ("auto", *CHAT_TEMPLATES)
    assert default_chat_template("glm4_moe") == "glm45"  # what auto picks: the family's declared format
    check_chat_template_option(tmp_path, "glm4_moe", ("auto", "glm45"), "glm4.5",
                               "model.chat_template='glm4.5' is not one of auto, qwen2, glm4, glm45")


# ------------------------------------------------------------------------- the agent loop
def test_agent_loop_runs_glm45_turns(glm45_template: Glm45ChatTemplate) -> None:
    template = glm45_template
    traj, sent, h = play_calc(glm45_engine(template), template)
    assert sent[0]["reasoning_content"] == "Add them."
    assert json.loads(sent[0]["tool_calls"][0]["function"]["arguments"]) == {"a": 40, "b": 2}  # integers, by schema
    assert sent[2]["content"] == "The answer is 42."
    # the trajectory: prompt, each generated turn as generated, each env reply without the <|observation|> the model
    # already wrote; with no user turn after the first, that is exactly the template's render (+ the final stop)
    assert template.decode(traj.token_ids) == template.render_text(h, ADD_TOOLS) + "<|user|>"
    assert template.decode(traj.token_ids) == _jinja_render(h, ADD_TOOLS, False) + "<|user|>"
    check_turns_as_generated(traj, template, SCRIPT)
    # the SFT layout of the same episode is the same tokens, with the same mask
    ids, mask = template.encode_conversation(h, ADD_TOOLS)
    assert ids == traj.token_ids and mask == traj.loss_mask
