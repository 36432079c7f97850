"""GLM-4-0414 chat format: exact text against GLM-4-9B-0414's jinja template, incremental token
pieces, the GLM-4 tool-call parser, template selection, and the agent loop on GLM turns."""
from __future__ import annotations

import json

import pytest

from megatron_agentrl.convert import resolve_chat_template
from rollout_sglang.chat_template import (
    CHAT_TEMPLATES,
    ChatTemplate,
    Glm4ChatTemplate,
    build_chat_template,
)
from rollout_sglang.tokenizer import train_bpe_tokenizer
from rollout_sglang.tool_parser import parse_glm4_assistant_text
from tests.rollout.chat_formats import GLM4_SCRIPT as SCRIPT
from tests.rollout.chat_formats import TOOLS, check_jinja_render, glm4_engine, render_cases
from tests.rollout.chat_formats import glm4_messages as _glm_messages
from tests.rollout.chat_formats import render_glm4 as _jinja_render
from tests.rollout.support import (
    ADD_TOOLS,
    CONVERSATION,
    check_chat_template_option,
    check_turns_as_generated,
    mask_spans,
    parse_error,
    play_calc,
)


@pytest.mark.parametrize("add_generation_prompt", [False, True])
@pytest.mark.parametrize("messages, tools", render_cases(TOOLS, late_system=True))
def test_render_text_matches_glm4_jinja(glm4_template: Glm4ChatTemplate, messages, tools,
                                        add_generation_prompt) -> None:
    # and messages already in GLM form render the same
    check_jinja_render(glm4_template, _jinja_render, _glm_messages, messages, tools, add_generation_prompt)


def test_format_details(glm4_template: Glm4ChatTemplate) -> None:
    text = glm4_template.render_text(CONVERSATION, TOOLS)
    assert text.startswith("[gMASK]<sop><|system|>\n# 可用工具\n\n## search\n\n{\n    \"name\": \"search\",\n")
    assert '"description": "Search the web (données, 搜索).",' in text  # non-ASCII kept
    assert "在调用上述函数时，请使用 Json 格式表示调用的参数。\n## submit\n\n{" in text
    assert "参数。<|system|>\nYou are a careful research agent.<|user|>\nWho wrote" in text
    assert ('<|assistant|>\nI will search for it.<|assistant|>search \n{"q": "Le Petit Prince auteur"}'
            '<|observation|>\nAntoine de Saint-Exupéry (1943).<|assistant|>search \n{"q": "Saint-Exupéry"}'
            '<|assistant|>search \n{"q": "1943 novella"}<|observation|>\nFrench writer and aviator.'
            '<|observation|>\n{"title": "The Little Prince"}<|user|>\nPlease submit now.<|assistant|>submit \n') in text
    assert text.endswith("<|observation|>\nok<|assistant|>\nDone: Antoine de Saint-Exupéry.")
    assert glm4_template.render_assistant(CONVERSATION[4]) == (
        'search \n{"q": "Saint-Exupéry"}<|assistant|>search \n{"q": "1943 novella"}')
    assert glm4_template.render_assistant({"role": "assistant", "content": "Hi"}) == "\nHi"
    tok = glm4_template.tokenizer
    stops = ("<|user|>", "<|observation|>", "<|endoftext|>")
    assert glm4_template.stop_token_ids == [tok.convert_tokens_to_ids(t) for t in stops]


def test_incremental_pieces_decode_to_full_render(glm4_template: Glm4ChatTemplate, glm4_tokenizer) -> None:
    """prompt + (assistant turn + its stop token + env reply)* decodes to the full render, token for token."""
    msgs = CONVERSATION
    a_idx = [i for i, m in enumerate(msgs) if m["role"] == "assistant"]
    ids = glm4_template.encode_prompt(msgs[: a_idx[0]], TOOLS)
    assert glm4_template.decode(ids) == glm4_template.render_text(msgs[: a_idx[0]], TOOLS, add_generation_prompt=True)
    for k, i in enumerate(a_idx):
        following = msgs[i + 1 : a_idx[k + 1]] if k + 1 < len(a_idx) else []
        turn = glm4_template.encode_assistant(msgs[i], glm4_template.turn_end_id(following))
        assert glm4_template.decode(turn[:-1]) == glm4_template.render_assistant(msgs[i])
        ids += turn
        if k + 1 < len(a_idx):
            assert turn[-1] in glm4_template.stop_token_ids
            ids += glm4_template.encode_env_reply(following, ended_with=turn[-1])
            assert glm4_template.decode(ids) == glm4_template.render_text(msgs[: a_idx[k + 1]], TOOLS,
                                                                          add_generation_prompt=True)
    full = glm4_template.render_text(msgs, TOOLS)
    assert full == _jinja_render(msgs, TOOLS, False)
    assert glm4_template.decode(ids) == full + "<|user|>"  # the last turn ends as the model ends it
    # pieces split at chat tokens: identical to tokenizing the whole text at once
    assert ids == glm4_tokenizer.encode(full + "<|user|>", add_special_tokens=False)

    conv_ids, mask = glm4_template.encode_conversation(msgs, TOOLS)
    assert conv_ids == ids and len(mask) == len(conv_ids)
    spans = mask_spans(mask)
    ends = ["<|observation|>", "<|observation|>", "<|observation|>", "<|user|>"]
    assert [glm4_template.decode(conv_ids[s:e]) for s, e in spans] == [
        glm4_template.render_assistant(msgs[i]) + end for i, end in zip(a_idx, ends)
    ]


def test_env_reply_piece_shapes(glm4_template: Glm4ChatTemplate) -> None:
    obs, user = glm4_template.role_ids["observation"], glm4_template.role_ids["user"]
    tool_then_user = [{"role": "tool", "content": "a"}, {"role": "user", "content": "b"}]
    assert glm4_template.decode(glm4_template.encode_env_reply(tool_then_user)) == "\na<|user|>\nb<|assistant|>"
    assert glm4_template.decode(glm4_template.encode_env_reply(tool_then_user, ended_with=obs)) == (
        "\na<|user|>\nb<|assistant|>")
    # the turn was cut by length, or ended with another stop token: the reply's role token is kept
    for ended in (None, user, glm4_template.eos_token_id):
        assert glm4_template.decode(glm4_template.encode_env_reply(tool_then_user, ended_with=ended)) == (
            "<|observation|>\na<|user|>\nb<|assistant|>"
        )
    assert glm4_template.decode(glm4_template.encode_env_reply([])) == "<|assistant|>"
    system = [{"role": "system", "content": "s"}]
    assert glm4_template.decode(glm4_template.encode_env_reply(system, ended_with=None)) == (
        "<|system|>\ns<|assistant|>"
    )


# ----------------------------------------------------------------------------------- the parser
def test_parse_content_calls_and_stop_tokens() -> None:
    text = '\nI will look.<|assistant|>search \n{"q": "héllo", "k": 3}<|assistant|>submit\n{}<|observation|>'
    msg = parse_glm4_assistant_text(text, TOOLS, call_id_start=4)
    assert msg["content"] == "I will look."
    assert [c["id"] for c in msg["tool_calls"]] == ["call_4", "call_5"]
    assert [c["function"]["name"] for c in msg["tool_calls"]] == ["search", "submit"]
    assert json.loads(msg["tool_calls"][0]["function"]["arguments"]) == {"q": "héllo", "k": 3}
    assert msg["tool_calls"][1]["function"]["arguments"] == "{}"
    assert parse_glm4_assistant_text("\nThe answer is 42.  <|user|>", TOOLS) == {
        "role": "assistant", "content": "The answer is 42.", "tool_calls": []}
    # a call with no argument line, and any name when no tool list is given
    assert parse_glm4_assistant_text("anything")["tool_calls"][0]["function"] == {"name": "anything", "arguments": "{}"}


def test_parse_round_trips_render(glm4_template: Glm4ChatTemplate) -> None:
    for m in CONVERSATION:
        if m["role"] != "assistant":
            continue
        msg = glm4_template.parse_assistant(glm4_template.render_assistant(m), TOOLS)
        assert msg["content"] == (m["content"] or "")
        assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in msg["tool_calls"]] == [
            (c["function"]["name"], json.loads(c["function"]["arguments"])) for c in m.get("tool_calls") or []]


@pytest.mark.parametrize(
    "text, problem, quoted",
    [
        ('search\n{"q": }', "arguments of tool call 'search' are not valid JSON", '{"q": }'),
        ('search\n["x"]', "must be a JSON object, got list", '["x"]'),
        ('delete_all\n{}', "unknown tool 'delete_all' (available: search, submit)", "delete_all"),
        ("Sure, here it is.", "neither content", "Sure, here it is."),
        ('\nok<|assistant|>{"name": "search"}', "neither content", '{"name": "search"}'),
        (' \n{"q": "x"}', "empty function name line", '{"q": "x"}'),
    ],
)
def test_parse_errors_name_the_bad_text(text: str, problem: str, quoted: str) -> None:
    msg = parse_error(parse_glm4_assistant_text, text, TOOLS)
    assert problem in msg and quoted in msg
    assert "function name on its own line" in msg


# -------------------------------------------------------------------------------- selection
def test_template_selection(glm4_tokenizer, tmp_path) -> None:
    assert resolve_chat_template("auto", "glm4") == "glm4"
    assert resolve_chat_template("auto", "qwen2") == resolve_chat_template("auto", "llama") == "qwen2"
    assert resolve_chat_template("glm4", "qwen2") == "glm4"
    with pytest.raises(ValueError, match="'chatml' is not one of auto, qwen2, glm4"):
        resolve_chat_template("chatml")
    with pytest.raises(ValueError, match="'auto' is not one of qwen2, glm4.*resolved from the model's family"):
        build_chat_template("auto", glm4_tokenizer)  # the trainer resolves auto from the family registry first
    assert isinstance(build_chat_template(resolve_chat_template("auto", "glm4"), glm4_tokenizer), Glm4ChatTemplate)
    qwen_tok = train_bpe_tokenizer(["hello world"] * 3, vocab_size=300, out_dir=tmp_path)
    assert isinstance(build_chat_template(resolve_chat_template("auto", "qwen2"), qwen_tok), ChatTemplate)


def test_config_accepts_the_template_names(tmp_path) -> None:
    from megatron_agentrl.config import CHAT_TEMPLATE_CHOICES, ModelConfig

    assert ModelConfig().chat_template == "auto" and CHAT_TEMPLATE_CHOICES == ("auto", *CHAT_TEMPLATES)
    check_chat_template_option(tmp_path, "glm4", ("auto", *CHAT_TEMPLATES), "chatml",
                               "model.chat_template='chatml' is not one of auto, qwen2, glm4")


# ------------------------------------------------------------------------- the agent loop
def test_agent_loop_runs_glm4_turns(glm4_template: Glm4ChatTemplate) -> None:
    template = glm4_template
    traj, _, h = play_calc(glm4_engine(template), template)
    # the trajectory: prompt, then each generated turn as generated, then the env reply without the
    # <|observation|> the model already wrote; it is the template's render of the episode (+ the
    # final stop token) up to the space GLM-4's template puts after a call's name
    obs = template.role_ids["observation"]
    tok = template.tokenizer
    expected = template.encode_prompt(h[:2], ADD_TOOLS) + tok.encode(SCRIPT[0], add_special_tokens=False)
    expected += template.encode_env_reply(h[3:4], ended_with=obs) + tok.encode(SCRIPT[1], add_special_tokens=False)
    expected += template.encode_env_reply(h[5:7], ended_with=obs) + tok.encode(SCRIPT[2], add_special_tokens=False)
    assert traj.token_ids == expected
    rendered = template.render_text(h, ADD_TOOLS) + "<|user|>"
    rendered = rendered.replace('<|assistant|>add \n{"a": 1', '<|assistant|>add\n{"a": 1')
    rendered = rendered.replace('<|assistant|>add \n{"a": 2', '<|assistant|>add\n{"a": 2')
    assert template.decode(traj.token_ids) == rendered
    check_turns_as_generated(traj, template, SCRIPT)
