"""What every chat format must do, one test per property parametrized over the formats (Qwen2.5, GLM-4-0414, GLM-4.5,
Qwen3): render as ``transformers.apply_chat_template`` renders the format's jinja template, refuse what it cannot
lay out, refuse a tokenizer without its chat tokens, force a call's head and split the reasoning, end an episode on
a malformed turn. The format-specific pins (exact text, parsers, token pieces) are in test_chat_template*.py."""
from __future__ import annotations

import asyncio
from typing import Any

import pytest

from rollout_sglang.agent_loop import run_group_lockstep
from rollout_sglang.chat_template import Glm4ChatTemplate, Glm45ChatTemplate, Qwen3ChatTemplate
from rollout_sglang.engines.protocol import SamplingParams
from rollout_sglang.tokenizer import GLM4_SPECIAL_TOKENS, train_bpe_tokenizer
from tests.rollout import chat_formats as cf
from tests.rollout.support import CONVERSATION, REASONING_CONVERSATION, TRIP_TOOLS, FakeEnv, episode

FORMATS = ["qwen25", "glm4", "glm45", "qwen3"]
# per format: the jinja template, the messages in the shape it takes, and the (messages, tools, generation prompt)
# rendered through transformers
APPLY = {
    "qwen25": (cf.QWEN25_TEMPLATE, cf.qwen25_messages, [(CONVERSATION, cf.QWEN25_TOOLS, False)]),
    "glm4": (cf.GLM4_0414_TEMPLATE, cf.glm4_messages, [(CONVERSATION, cf.TOOLS, True), (CONVERSATION, None, True)]),
    "glm45": (cf.GLM45_TEMPLATE, cf.glm45_messages,
              [(REASONING_CONVERSATION, TRIP_TOOLS, True), (CONVERSATION, None, True)]),
    "qwen3": (cf.QWEN3_TEMPLATE, cf.qwen3_messages_as_given,
              [(REASONING_CONVERSATION, TRIP_TOOLS, True), (cf.AGENTIC, cf.TOOLS, True),
               (CONVERSATION[1:], None, True)]),
}


@pytest.mark.parametrize("fmt", FORMATS)
def test_render_matches_transformers_apply_chat_template(request, fmt: str) -> None:
    tokenizer, template = request.getfixturevalue(f"{fmt}_tokenizer"), request.getfixturevalue(f"{fmt}_template")
    jinja, shape, cases = APPLY[fmt]
    for messages, tools, add_generation_prompt in cases:
        hf = tokenizer.apply_chat_template(shape(messages), tools=tools, chat_template=jinja, tokenize=False,
                                           add_generation_prompt=add_generation_prompt)
        assert template.render_text(messages, tools, add_generation_prompt=add_generation_prompt) == hf


@pytest.mark.parametrize("fmt", FORMATS)
def test_unknown_roles_and_conversations_without_an_assistant_turn_are_refused(request, fmt: str) -> None:
    template = request.getfixturevalue(f"{fmt}_template")
    with pytest.raises(ValueError, match="role 'robot'"):
        template.encode_env_reply([{"role": "robot", "content": "x"}])
    with pytest.raises(ValueError, match="at least one assistant"):
        template.encode_conversation(CONVERSATION[:2])


# per format: the chat tokens a tokenizer lacks (None: Qwen2.5-style, the repo's default), a template class it is
# enough for, and the refusal of the format's class
WRONG_TOKENIZER = {
    "glm4": (None, None, Glm4ChatTemplate, r"no \[gMASK\], <sop>, <\|system\|>.*model.chat_template"),
    "glm45": (GLM4_SPECIAL_TOKENS, Glm4ChatTemplate, Glm45ChatTemplate,
              r"no <think>, </think>, <tool_call>.* token\(s\); the GLM-4.5 chat format needs .*use GLM-4.5's "
              r"tokenizer.*model.chat_template"),
    "qwen3": (GLM4_SPECIAL_TOKENS, None, Qwen3ChatTemplate,
              r"no '<\|im_start\|>' token; the Qwen3 chat format needs <\|im_start\|>"),
}


@pytest.mark.parametrize("fmt", sorted(WRONG_TOKENIZER))
def test_tokenizer_without_the_format_tokens_fails_clearly(tmp_path, fmt: str) -> None:
    special, enough_for, cls, match = WRONG_TOKENIZER[fmt]
    kw: dict[str, Any] = {} if special is None else {"special_tokens": special, "text_tokens": ()}
    tok = train_bpe_tokenizer(["hello world"] * 3, vocab_size=300, out_dir=tmp_path, **kw)
    if enough_for is not None:
        enough_for(tok)
    with pytest.raises(ValueError, match=match):
        cls(tok)


# per format with reasoning: the forced head of any call and of a named one, and reasoning splits (text, expected)
FORCED = {
    "glm45": ("\n<think></think>\n<tool_call>", "\n<think></think>\n<tool_call>search\n",
              [("\n<think> r </think>\nx", ("r", "\nx")), ("\n<think> cut by length", ("", "\n<think> cut by length")),
               ("no think", ("", "no think"))]),
    "qwen3": ("<think>\n\n</think>\n\n<tool_call>\n",
              '<think>\n\n</think>\n\n<tool_call>\n{"name": "search", "arguments": ',
              [("<think>\n r \n</think>\n\nx", ("r", "\n\nx")),
               ("<think>\ncut by length", ("", "<think>\ncut by length")), ("no think", ("", "no think"))]),
}


@pytest.mark.parametrize("fmt", sorted(FORCED))
def test_forced_call_prefix_and_reasoning_split(request, fmt: str) -> None:
    t = request.getfixturevalue(f"{fmt}_template")
    any_call, named, splits = FORCED[fmt]
    assert t.call_prefix(None) == any_call
    assert t.call_prefix("search") == named
    for text, expected in splits:
        assert t.split_reasoning(text) == expected


# per format with a structured call: a turn whose call is malformed, and the error the episode ends with
MALFORMED = {
    "glm45": (cf.glm45_engine, ["\n<think></think>\n<tool_call>add\n<arg_key>a</arg_key>\n</tool_call><|observation|>"],
              "argument 'a' of tool call 'add' has no <arg_value>"),
    "qwen3": (cf.qwen3_engine,
              ['<think>\nr\n</think>\n\n<tool_call>\n{"name": "add", "arguments": {"a": 1,}}\n</tool_call>'],
              "tool call is not valid JSON"),
}


@pytest.mark.parametrize("fmt", sorted(MALFORMED))
def test_agent_loop_ends_a_malformed_turn(request, fmt: str) -> None:
    template = request.getfixturevalue(f"{fmt}_template")
    engine, bad, error = MALFORMED[fmt]
    (traj,) = asyncio.run(run_group_lockstep(engine(template, bad), FakeEnv(), template, [("calc", 0, 0)],
                                             SamplingParams(max_new_tokens=256), episode(5, 4096)))
    assert traj.status == "agent validation failed" and traj.reward == 0.0
    assert error in traj.error
