"""``enable_thinking`` off (Qwen3, GLM-4.5): the prompt, the generated turn and the env reply pieces against the
official templates' ``enable_thinking=false`` text; the config switch and its refusal for formats without one."""
from __future__ import annotations

import json
import types

import pytest

from megatron_agentrl.config import ConfigError, load_config
from megatron_agentrl.pipeline.rollout_side import chat_template
from rollout_sglang.chat_template import (
    TURN_END,
    Glm45ChatTemplate,
    Qwen3ChatTemplate,
    build_chat_template,
)
from tests.rollout.chat_formats import TOOLS, render_glm45, render_qwen3
from tests.rollout.support import CONVERSATION, mask_spans

ASSISTANT_AT = [i for i, m in enumerate(CONVERSATION) if m["role"] == "assistant"]
QWEN3_OFF = "<|im_start|>assistant\n<think>\n\n</think>\n\n"
GLM45_OFF = "<|assistant|>\n<think></think>"


@pytest.fixture(scope="module")
def qwen3_off(qwen3_tokenizer) -> Qwen3ChatTemplate:
    return build_chat_template("qwen3", qwen3_tokenizer, enable_thinking=False)


@pytest.fixture(scope="module")
def glm45_off(glm45_tokenizer) -> Glm45ChatTemplate:
    return build_chat_template("glm45", glm45_tokenizer, enable_thinking=False)


def test_the_official_templates_switch_off_as_pinned() -> None:
    """The exact text each official template adds for enable_thinking=false, and nothing for true / unset."""
    user = [{"role": "user", "content": "Hi"}]
    assert render_qwen3(user, None, True, enable_thinking=False) == "<|im_start|>user\nHi<|im_end|>\n" + QWEN3_OFF
    for on in ({}, {"enable_thinking": True}):
        assert render_qwen3(user, None, True, **on) == "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
        assert render_glm45(user, None, True, **on) == "[gMASK]<sop><|user|>\nHi<|assistant|>"
    assert render_glm45(user, None, True, enable_thinking=False) == "[gMASK]<sop><|user|>\nHi/nothink" + GLM45_OFF
    done = [{"role": "user", "content": "Hi/nothink"}]  # not doubled
    assert render_glm45(done, None, True, enable_thinking=False) == "[gMASK]<sop><|user|>\nHi/nothink" + GLM45_OFF


@pytest.mark.parametrize("i", ASSISTANT_AT)
@pytest.mark.parametrize("fmt", ["qwen3", "glm45"])
def test_prompt_and_turn_are_the_templates_text(request: pytest.FixtureRequest, fmt: str, i: int) -> None:
    """The prompt before each assistant turn is the template's render with enable_thinking=false, token for token,
    and the generated turn continues it into the template's render of the conversation up to that turn."""
    t = request.getfixturevalue(f"{fmt}_off")
    render, end, off = ((render_qwen3, "<|im_end|>\n", QWEN3_OFF) if fmt == "qwen3"
                        else (render_glm45, "", GLM45_OFF))
    prompt = render(CONVERSATION[:i], TOOLS, True, enable_thinking=False)
    assert prompt.endswith(off)
    assert t.render_text(CONVERSATION[:i], TOOLS, add_generation_prompt=True) == prompt
    assert t.decode(t.encode_prompt(CONVERSATION[:i], TOOLS)) == prompt
    whole = render(CONVERSATION[: i + 1], TOOLS, False, enable_thinking=False)
    assert prompt + t.render_assistant(CONVERSATION[i]) + end == whole
    assert t.render_text(CONVERSATION[: i + 1], TOOLS) == whole
    # the turn holds no think block of its own, and reads back as it was written
    turn = t.render_assistant(CONVERSATION[i])
    assert "<think>" not in turn
    msg = t.parse_assistant(turn, TOOLS)
    assert msg["reasoning_content"] == "" and msg["content"] == (CONVERSATION[i]["content"] or "")
    assert [json.loads(c["function"]["arguments"]) for c in msg["tool_calls"]] == [
        json.loads(c["function"]["arguments"]) for c in CONVERSATION[i].get("tool_calls") or []]


@pytest.mark.parametrize("fmt", ["qwen3", "glm45"])
def test_pieces_and_demonstrations_end_every_prompt_with_the_empty_block(request: pytest.FixtureRequest,
                                                                         fmt: str) -> None:
    t = request.getfixturevalue(f"{fmt}_off")
    off = QWEN3_OFF if fmt == "qwen3" else GLM45_OFF
    reply = t.decode(t.encode_env_reply(CONVERSATION[3:4], ended_with=TURN_END))
    assert reply.endswith(off)
    if fmt == "glm45":  # a user message in a reply piece carries /nothink too
        assert "\nPlease submit now./nothink<|assistant|>" in t.decode(t.encode_env_reply(CONVERSATION[5:8]))
    ids, mask = t.encode_conversation(CONVERSATION, TOOLS)
    spans = mask_spans(mask)
    assert len(spans) == len(ASSISTANT_AT)
    for (start, stop), i in zip(spans, ASSISTANT_AT):
        assert t.decode(ids[:start]).endswith(off)
        assert t.decode(ids[start:stop - 1]) == t.render_assistant(CONVERSATION[i])
    # reasoning given to a turn is dropped: the model cannot write it after the empty block
    reasoned = {**CONVERSATION[-1], "reasoning_content": "hmm"}
    assert t.render_assistant(reasoned) == t.render_assistant(CONVERSATION[-1])


def test_forced_calls_start_after_the_empty_block(qwen3_off: Qwen3ChatTemplate, glm45_off: Glm45ChatTemplate,
                                                  qwen3_template: Qwen3ChatTemplate,
                                                  glm45_template: Glm45ChatTemplate) -> None:
    assert qwen3_off.call_prefix(None) == "<tool_call>\n"
    assert qwen3_off.call_prefix("search") == '<tool_call>\n{"name": "search", "arguments": '
    assert glm45_off.call_prefix(None) == "\n<tool_call>"
    assert glm45_off.call_prefix("search") == "\n<tool_call>search\n"
    # on (the default), unchanged: the forced turn opens with the empty block itself
    assert qwen3_template.enable_thinking and qwen3_template.call_prefix(None) == "<think>\n\n</think>\n\n<tool_call>\n"
    assert glm45_template.enable_thinking and glm45_template.call_prefix(None) == "\n<think></think>\n<tool_call>"


def test_formats_without_the_switch_refuse_it(qwen25_tokenizer, glm4_tokenizer, qwen3_tokenizer) -> None:
    for name, tok in (("qwen2", qwen25_tokenizer), ("glm4", glm4_tokenizer)):
        for value in (True, False):
            with pytest.raises(ValueError, match=f"chat format \\({name}\\) has no thinking switch"):
                build_chat_template(name, tok, enable_thinking=value)
        build_chat_template(name, tok, enable_thinking=None)
    assert build_chat_template("qwen3", qwen3_tokenizer, enable_thinking=True).enable_thinking


def test_the_config_switch(tmp_path, qwen25_tokenizer) -> None:
    base = tmp_path / "c.yaml"
    base.write_text("model:\n  arch: {model_type: qwen2}\ntasks: [{name: lookup}]\n")
    assert load_config(base).model.enable_thinking is None
    for name in ("qwen3", "glm45"):
        for value in ("true", "false", "null"):
            load_config(base, [f"model.chat_template={name}", f"model.enable_thinking={value}"])
    for name in ("qwen2", "glm4"):
        with pytest.raises(ConfigError, match=r"model\.enable_thinking.*has no thinking switch"):
            load_config(base, [f"model.chat_template={name}", "model.enable_thinking=false"])
    with pytest.raises(ConfigError, match="must be true or false"):
        load_config(base, ["model.chat_template=qwen3", "model.enable_thinking=maybe"])
    # auto is resolved when the format is built: a qwen2 model refuses it there
    cfg = load_config(base, ["model.enable_thinking=false"])
    with pytest.raises(ConfigError, match=r"model\.enable_thinking=False.*\(qwen2\) has no thinking switch"):
        chat_template(cfg, qwen25_tokenizer, types.SimpleNamespace(model_type="qwen2"))
