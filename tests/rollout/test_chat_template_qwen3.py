"""Qwen3 chat format: exact text against Qwen3's jinja template, incremental token pieces, the parser with its
think block, template selection, the agent loop on Qwen3 turns, and the gateway (reasoning, forced calls)."""
from __future__ import annotations

import asyncio
import json

import pytest

from megatron_agentrl.convert import resolve_chat_template
from rollout_sglang.agent_loop import run_group_lockstep
from rollout_sglang.chat_template import (
    CHAT_TEMPLATES,
    ChatTemplate,
    Qwen3ChatTemplate,
    build_chat_template,
)
from rollout_sglang.engines.protocol import SamplingParams
from rollout_sglang.tokenizer import QWEN3_TEXT_TOKENS, train_bpe_tokenizer
from rollout_sglang.tool_parser import parse_qwen3_assistant_text
from tests.rollout.chat_formats import (
    AGENTIC,
    BARE,
    MULTI_STEP,
    TOOLS,
    USERLESS,
    qwen3_engine,
    render_cases,
)
from tests.rollout.chat_formats import QWEN3_SCRIPT as SCRIPT
from tests.rollout.chat_formats import QWEN3_THINKING as THINKING
from tests.rollout.chat_formats import qwen3_messages as _hf_messages
from tests.rollout.chat_formats import render_qwen3 as _jinja_render
from tests.rollout.chat_formats import train_qwen3_tokenizer as _train
from tests.rollout.support import (
    ADD_TOOLS,
    REASONING_CONVERSATION,
    TRIP_TOOLS,
    Script,
    check_chat_template_option,
    check_turns_as_generated,
    client,
    episode,
    make_gateway,
    mask_spans,
    open_session,
    parse_error,
    play_calc,
    play_episode,
    serving,
    tool_call,
)


@pytest.fixture(scope="module")
def text_think_template(tmp_path_factory: pytest.TempPathFactory) -> Qwen3ChatTemplate:
    """The Qwen3 format on a Qwen2.5-style stand-in, where <think> and </think> are plain text."""
    texts = [_jinja_render(AGENTIC, TOOLS, False), _jinja_render(REASONING_CONVERSATION, TRIP_TOOLS, True)]
    return Qwen3ChatTemplate(_train(texts, tmp_path_factory.mktemp("qwen3text"), text_tokens=()))


# ------------------------------------------------------------------------------------------ the text
@pytest.mark.parametrize("add_generation_prompt", [False, True])
@pytest.mark.parametrize(
    "messages, tools",
    # without a system message the system turn starts with "# Tools"; without tools too there is none
    render_cases(TOOLS, late_system=True) + [
        (THINKING, TOOLS),  # reasoning after the last user turn, as a field and inside the content
        (AGENTIC, TOOLS),  # one query, every turn reasoning
        (MULTI_STEP, TOOLS),  # a user turn of <tool_response> blocks is no query
        (REASONING_CONVERSATION, TRIP_TOOLS),  # reasoning before the last user turn too; every JSON type, non-ASCII
        (REASONING_CONVERSATION[:5], TRIP_TOOLS),  # ends on a user turn: no reasoning shows
        (USERLESS, TRIP_TOOLS),  # no user turn: no reasoning shows
        (BARE, None),  # no reasoning: no block on an earlier turn, an empty one on the last
    ],
)
def test_render_text_matches_qwen3_jinja(qwen3_template: Qwen3ChatTemplate, messages, tools,
                                         add_generation_prompt) -> None:
    expected = _jinja_render(messages, tools, add_generation_prompt)
    assert qwen3_template.render_text(messages, tools, add_generation_prompt) == expected
    # arguments given as objects (HF style) are written as JSON, as the template's tojson writes them
    hf = _hf_messages(messages)
    assert qwen3_template.render_text(hf, tools, add_generation_prompt) == _jinja_render(hf, tools,
                                                                                          add_generation_prompt)
    if add_generation_prompt:  # the prompt piece of any history is the template's render with the generation prompt
        assert qwen3_template.decode(qwen3_template.encode_prompt(messages, tools)) == expected


def test_format_details_as_written_in_the_facts(qwen3_template: Qwen3ChatTemplate) -> None:
    """The layout spelled out by hand, independently of the jinja text above."""
    t = qwen3_template
    assert t.render_text([{"role": "user", "content": "Hi"}], add_generation_prompt=True) == (
        "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")  # no default system message
    tool = {"type": "function", "function": {"name": "add"}}
    assert t.render_text([{"role": "user", "content": "Hi"}], [tool]).startswith(
        '<|im_start|>system\n# Tools\n\nYou may call one or more functions to assist with the user query.\n\n'
        'You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n'
        '{"type": "function", "function": {"name": "add"}}\n</tools>\n\n')
    msg = {"role": "assistant", "reasoning_content": "\n 思考 \n", "content": "\nSure.",
           "tool_calls": [tool_call("c0", "add", {"a": "é"}), {"function": {"name": "add", "arguments": {"b": [1]}}}]}
    assert t.render_assistant(msg) == (
        '<think>\n 思考 \n</think>\n\nSure.\n<tool_call>\n{"name": "add", "arguments": {"a": "\\u00e9"}}\n'
        '</tool_call>\n<tool_call>\n{"name": "add", "arguments": {"b": [1]}}\n</tool_call>')
    assert t.render_assistant({"role": "assistant", "content": "Hi"}) == "<think>\n\n</think>\n\nHi"
    assert t.render_assistant({"role": "assistant", "tool_calls": [tool_call("c", "add", {})]}) == (
        '<think>\n\n</think>\n\n<tool_call>\n{"name": "add", "arguments": {}}\n</tool_call>')
    tok = t.tokenizer
    assert t.stop_token_ids == [tok.convert_tokens_to_ids("<|im_end|>"), tok.convert_tokens_to_ids("<|endoftext|>")]
    for tag in QWEN3_TEXT_TOKENS:  # single ids that decode as text, even when special tokens are skipped
        (i,) = tok.encode(tag, add_special_tokens=False)
        assert tok.decode([i], skip_special_tokens=True) == tag


# ------------------------------------------------------------------------------------------ the tokens
def _pieces(template: Qwen3ChatTemplate, msgs: list[dict], tools: list[dict] | None) -> list[int]:
    """prompt + (assistant turn + <|im_end|> + env reply)*, checking each prompt against the render."""
    a_idx = [i for i, m in enumerate(msgs) if m["role"] == "assistant"]
    ids = template.encode_prompt(msgs[: a_idx[0]], tools)
    assert template.decode(ids) == template.render_text(msgs[: a_idx[0]], tools, add_generation_prompt=True)
    for k, i in enumerate(a_idx):
        turn = template.encode_assistant(msgs[i])
        assert template.decode(turn[:-1]) == template.render_assistant(msgs[i]) and turn[-1] == template.im_end_id
        ids += turn
        if k + 1 < len(a_idx):
            ids += template.encode_env_reply(msgs[i + 1 : a_idx[k + 1]])
    return ids


@pytest.mark.parametrize("which", ["added", "text"])
@pytest.mark.parametrize("msgs, tools", [(AGENTIC, TOOLS), (MULTI_STEP, TOOLS), (BARE[:2], None)])
def test_incremental_pieces_equal_the_render_where_the_template_keeps_reasoning(
        request, which, msgs, tools) -> None:
    """Every turn after the last query with reasoning (or the last one without): the trajectory's pieces are the
    template's text, token for token, whether <think> is an added token or text."""
    template = request.getfixturevalue("qwen3_template" if which == "added" else "text_think_template")
    ids = _pieces(template, msgs, tools)
    a_idx = [i for i, m in enumerate(msgs) if m["role"] == "assistant"]
    full = template.render_text(msgs[: a_idx[-1] + 1], tools)
    assert full == _jinja_render(msgs[: a_idx[-1] + 1], tools, False)
    assert template.decode(ids) + "\n" == full
    # pieces split at chat tokens: identical to tokenizing the whole text at once
    assert ids == template.tokenizer.encode(full[:-1], add_special_tokens=False)
    conv_ids, mask = template.encode_conversation(msgs, tools)
    assert conv_ids == ids and len(mask) == len(ids)
    assert [template.decode(conv_ids[s:e]) for s, e in mask_spans(mask)] == [
        template.render_assistant(msgs[i]) + "<|im_end|>" for i in a_idx]


def test_trajectory_keeps_what_a_rerender_drops(qwen3_template: Qwen3ChatTemplate) -> None:
    """A trajectory is never re-rendered: reasoning written before a later user turn stays in it, and so does the
    (empty) think block of every turn the template shows without one."""
    t = qwen3_template
    msgs, tools = REASONING_CONVERSATION, TRIP_TOOLS
    ids = _pieces(t, msgs, tools)
    full = t.render_text(msgs, tools)
    first = "The user wants Tokyo → Osaka, at most one change."
    assert first not in full
    early = "<|im_start|>assistant\nLet me look."
    assert t.decode(ids) + "\n" == full.replace(early, f"<|im_start|>assistant\n<think>\n{first}\n</think>\n\n"
                                                       "Let me look.", 1)
    ids = _pieces(t, BARE, None)
    assert t.decode(ids) + "\n" == t.render_text(BARE).replace(
        "<|im_start|>assistant\nLet me look.", "<|im_start|>assistant\n<think>\n\n</think>\n\nLet me look.")
    conv_ids, mask = t.encode_conversation(msgs, tools)
    assert t.decode(conv_ids[slice(*mask_spans(mask)[0])]).startswith(f"<think>\n{first}\n</think>\n\nLet me look.")


def test_env_reply_piece_shapes(qwen3_template: Qwen3ChatTemplate) -> None:
    t = qwen3_template
    assert t.decode(t.encode_env_reply([])) == "\n<|im_start|>assistant\n"
    assert t.decode(t.encode_env_reply([], ended_with=None)) == "<|im_end|>\n<|im_start|>assistant\n"
    piece = t.encode_env_reply([{"role": "tool", "content": "a"}, {"role": "tool", "content": "b"},
                                {"role": "user", "content": "c"}])
    assert t.decode(piece) == ("\n<|im_start|>user\n<tool_response>\na\n</tool_response>\n<tool_response>\nb\n"
                               "</tool_response><|im_end|>\n<|im_start|>user\nc<|im_end|>\n<|im_start|>assistant\n")
    # an assistant message of the env's own shows its reasoning unless a user query follows it here
    own = {"role": "assistant", "content": "x", "reasoning_content": "r"}
    assert t.decode(t.encode_env_reply([{"role": "user", "content": "u"}, own])) == (
        "\n<|im_start|>user\nu<|im_end|>\n<|im_start|>assistant\n<think>\nr\n</think>\n\nx<|im_end|>\n"
        "<|im_start|>assistant\n")
    assert t.decode(t.encode_env_reply([own, {"role": "user", "content": "u"}])) == (
        "\n<|im_start|>assistant\nx<|im_end|>\n<|im_start|>user\nu<|im_end|>\n<|im_start|>assistant\n")


# ----------------------------------------------------------------------------------- the parser
CALL = '<tool_call>\n{"name": "search", "arguments": {"q": "héllo"}}\n</tool_call>'


def test_parse_with_and_without_a_think_block(qwen3_template: Qwen3ChatTemplate) -> None:
    msg = qwen3_template.parse_assistant(f"<think>\nLook it up.\n</think>\n\nI will look.\n{CALL}<|im_end|>", TOOLS,
                                         call_id_start=4)
    assert msg["reasoning_content"] == "Look it up." and msg["content"] == "I will look."
    (c,) = msg["tool_calls"]
    assert c["id"] == "call_4" and json.loads(c["function"]["arguments"]) == {"q": "héllo"}
    assert parse_qwen3_assistant_text("The answer is 42.") == {
        "role": "assistant", "content": "The answer is 42.", "tool_calls": [], "reasoning_content": ""}
    assert parse_qwen3_assistant_text("<think>\n\n</think>\n\n" + CALL, TOOLS)["reasoning_content"] == ""
    # the reasoning is opaque: a call drafted while thinking is no call
    assert parse_qwen3_assistant_text(f"<think>maybe {CALL}</think>\n\nNo.", TOOLS)["tool_calls"] == []
    # round trip: what Qwen3 writes renders back to itself
    for text in (f"<think>\nr\n</think>\n\nI will look.\n{CALL}", f"<think>\n\n</think>\n\n{CALL}\n{CALL}",
                 "<think>\nr\n</think>\n\nDone."):
        assert qwen3_template.render_assistant(qwen3_template.parse_assistant(text, TOOLS)) == text


@pytest.mark.parametrize(
    "text, problem",
    [
        ("<think>\nstill thinking", "unclosed <think> (no </think>)"),
        ('<think>\nr\n</think>\n\n<tool_call>\n{"name": "search", "arguments": {"q": 1,}}\n</tool_call>',
         "tool call is not valid JSON"),
        ('<think>\nr\n</think>\n\n<tool_call>\n{"name": "delete_all", "arguments": {}}\n</tool_call>',
         "unknown tool 'delete_all' (available: search, submit)"),
        ("<think>\nr\n</think>\n\n<tool_call>\n{}", "unclosed <tool_call>"),
        ("<think>\n\udc00\n</think>\n\nok", "invalid Unicode in the reasoning: lone surrogate U+DC00"),
    ],
)
def test_parse_errors_are_tool_call_parse_errors(text: str, problem: str) -> None:
    msg = parse_error(parse_qwen3_assistant_text, text, TOOLS)
    assert problem in msg and "a valid tool call looks like" in msg


# -------------------------------------------------------------------------------- selection
def test_template_selection(qwen3_tokenizer, tmp_path) -> None:
    assert "qwen3" in CHAT_TEMPLATES
    assert resolve_chat_template("auto", "qwen3") == resolve_chat_template("auto", "qwen3_moe") == "qwen3"
    assert resolve_chat_template("auto", "qwen2") == resolve_chat_template("auto", None) == "qwen2"
    assert resolve_chat_template("qwen3", "llama") == "qwen3"
    with pytest.raises(ValueError, match="'qwen-3' is not one of auto, qwen2, glm4, glm45, qwen3"):
        resolve_chat_template("qwen-3")
    for model_type in ("qwen3", "qwen3_moe"):
        auto = resolve_chat_template("auto", model_type)
        assert isinstance(build_chat_template(auto, qwen3_tokenizer), Qwen3ChatTemplate)
    # Qwen2.5's format stays Qwen2.5's; the repo's Qwen2.5-style tiny tokenizers (tags as text) take either
    qwen25_tok = train_bpe_tokenizer(["hello world"] * 3, vocab_size=300, out_dir=tmp_path)
    assert type(build_chat_template(resolve_chat_template("auto", "qwen2"), qwen25_tok)) is ChatTemplate
    t = build_chat_template(resolve_chat_template("auto", "qwen3_moe"), qwen25_tok)
    assert isinstance(t, Qwen3ChatTemplate) and t.name == "qwen3"
    assert t.parse_assistant("<think>\nr\n</think>\n\nhello")["reasoning_content"] == "r"


def test_config_takes_qwen3_and_auto_for_qwen3_models(tmp_path) -> None:
    from megatron_agentrl.config import CHAT_TEMPLATE_CHOICES
    from megatron_agentrl.convert import default_chat_template

    assert CHAT_TEMPLATE_CHOICES == ("auto", *CHAT_TEMPLATES)
    assert default_chat_template("qwen3") == default_chat_template("qwen3_moe") == "qwen3"  # what auto picks
    check_chat_template_option(tmp_path, "qwen3_moe", ("auto", "qwen3"), "qwen-3",
                               "model.chat_template='qwen-3' is not one of auto, qwen2, glm4, glm45, "
                               "qwen3 \\(auto: the default format of the model's family")


# ------------------------------------------------------------------------- the agent loop
def test_agent_loop_runs_qwen3_turns(qwen3_template: Qwen3ChatTemplate) -> None:
    template = qwen3_template
    traj, sent, h = play_calc(qwen3_engine(template), template)
    assert sent[0]["reasoning_content"] == "Add them."
    assert sent[2]["content"] == "The answer is 42." and sent[2]["reasoning_content"] == "Both sums are in."
    # one query, every turn reasoning: the trajectory is the template's render of the episode, token for token
    assert template.decode(traj.token_ids) + "\n" == template.render_text(h, ADD_TOOLS) == _jinja_render(
        h, ADD_TOOLS, False)
    check_turns_as_generated(traj, template, [text + "<|im_end|>" for text in SCRIPT])
    # the SFT layout of the same episode is the same tokens, with the same mask
    ids, mask = template.encode_conversation(h, ADD_TOOLS)
    assert ids == traj.token_ids and mask == traj.loss_mask


# ------------------------------------------------------------------------------- the gateway
@pytest.mark.parametrize("stream", [False, True])
def test_gateway_episode_equals_the_agent_loop(qwen3_template: Qwen3ChatTemplate, stream) -> None:
    """The calc episode through the openai client: the reasoning comes back as reasoning_content (not in the
    content), and the gateway's trajectory is the agent loop's, token for token."""
    from tests.rollout.support import FakeEnv

    template = qwen3_template
    gw = make_gateway(template, qwen3_engine(template), env=FakeEnv())

    comps, step, (traj,) = asyncio.run(play_episode(gw, "qwen3", 3, stream))
    assert step["finish"] and traj.status == "completed" and traj.reward == 1.0
    assert [c.choices[0].finish_reason for c in comps] == ["tool_calls", "tool_calls", "stop"]
    assert [c.choices[0].message.content or "" for c in comps] == ["Let me add.", "", "The answer is 42."]
    reasoning = [(c.choices[0].message.model_extra or {}).get("reasoning_content") for c in comps]
    assert reasoning == ["Add them.", "Check twice.", "Both sums are in."]
    (ref,) = asyncio.run(run_group_lockstep(qwen3_engine(template), FakeEnv(), template, [("calc", 0, 0)],
                                            SamplingParams(max_new_tokens=256), episode(5, 4096)))
    assert traj.token_ids == ref.token_ids and traj.loss_mask == ref.loss_mask
    assert traj.behavior_logprobs == ref.behavior_logprobs and traj.turn_spans == ref.turn_spans


@pytest.mark.parametrize("choice", ["named", "required"])
def test_gateway_tool_choice_forces_an_empty_think_block_and_the_call(qwen3_template: Qwen3ChatTemplate,
                                                                     choice) -> None:
    template = qwen3_template
    rest = '{"a": 1, "b": 2}}\n</tool_call>'
    engine = Script(template, [rest if choice == "named" else '{"name": "add", "arguments": ' + rest])
    gw = make_gateway(template, engine)
    tool_choice = {"type": "function", "function": {"name": "add"}} if choice == "named" else "required"
    first = [{"role": "user", "content": "add 1 and 2"}]

    async def main():
        async with serving(gw) as srv:
            info = await open_session(srv)
            async with client(info) as c:
                comp = await c.chat.completions.create(model="qwen3", messages=first, tools=ADD_TOOLS,
                                                       tool_choice=tool_choice)
            return comp, gw.sessions[info["session_id"]].to_trajectories()[0]

    comp, t = asyncio.run(main())
    (tc,) = comp.choices[0].message.tool_calls
    assert comp.choices[0].finish_reason == "tool_calls" and json.loads(tc.function.arguments) == {"a": 1, "b": 2}
    assert not (comp.choices[0].message.model_extra or {}).get("reasoning_content")
    (s, e), = t.turn_spans
    prompt = template.encode_prompt(first, ADD_TOOLS)
    assert template.decode(t.token_ids[len(prompt):s]) == template.call_prefix("add" if choice == "named" else None)
    assert t.loss_mask[len(prompt):s] == [0] * (s - len(prompt))
    assert template.decode(t.token_ids[e - 1:e]) == "<|im_end|>"
