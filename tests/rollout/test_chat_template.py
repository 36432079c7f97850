"""Qwen2.5 chat format: exact text against a Qwen2.5-style jinja template, and incremental token pieces."""
from __future__ import annotations

from pathlib import Path

import pytest

from rollout_sglang.chat_template import ChatTemplate
from rollout_sglang.tokenizer import SPECIAL_TOKENS, TOOL_TOKENS, load_tokenizer, train_bpe_tokenizer
from tests.rollout.chat_formats import QWEN25_TOOLS as TOOLS
from tests.rollout.chat_formats import check_jinja_render, render_cases
from tests.rollout.chat_formats import qwen25_messages as _hf_messages
from tests.rollout.chat_formats import render_qwen25 as _jinja_render
from tests.rollout.support import CONVERSATION, mask_spans


def test_tokenizer_chat_tokens_are_single_ids_and_reload(qwen25_tokenizer, tmp_path: Path) -> None:
    for tok in SPECIAL_TOKENS + TOOL_TOKENS:
        ids = qwen25_tokenizer.encode(tok, add_special_tokens=False)
        assert len(ids) == 1, tok
    assert qwen25_tokenizer.eos_token == "<|endoftext|>" and qwen25_tokenizer.pad_token == "<|endoftext|>"
    text = "<|im_start|>user\n<tool_response>\nçà 🎉 {\"a\": 1}\n</tool_response><|im_end|>"
    ids = qwen25_tokenizer.encode(text, add_special_tokens=False)
    assert qwen25_tokenizer.decode(ids) == text
    # determinism: same corpus -> the same tokenizer.json
    a = train_bpe_tokenizer(["hello world " * 10, "foo bar baz"] * 3, 300, tmp_path / "a")
    b = train_bpe_tokenizer(["hello world " * 10, "foo bar baz"] * 3, 300, tmp_path / "b")
    assert (tmp_path / "a" / "tokenizer.json").read_text() == (tmp_path / "b" / "tokenizer.json").read_text()
    assert (tmp_path / "a" / "tokenizer_config.json").is_file()
    assert load_tokenizer(tmp_path / "a").encode("hello world") == a.encode("hello world")
    assert load_tokenizer(tmp_path / "a" / "tokenizer.json").encode("hello world") == b.encode("hello world")


def test_missing_tokenizer_path_names_path_and_fix(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="does-not-exist.*train_bpe_tokenizer"):
        load_tokenizer(tmp_path / "does-not-exist")
    with pytest.raises(FileNotFoundError, match="no tokenizer in directory"):
        load_tokenizer(tmp_path)


@pytest.mark.parametrize("add_generation_prompt", [False, True])
@pytest.mark.parametrize("messages, tools", render_cases(TOOLS))  # without a system message: the default one
def test_render_text_matches_qwen25_jinja(qwen25_template: ChatTemplate, messages, tools,
                                          add_generation_prompt) -> None:
    # and HF-style messages (arguments as objects) render the same
    check_jinja_render(qwen25_template, _jinja_render, _hf_messages, messages, tools, add_generation_prompt)


def test_format_details(qwen25_template: ChatTemplate) -> None:
    text = qwen25_template.render_text(CONVERSATION, TOOLS)
    assert text.startswith("<|im_start|>system\nYou are a careful research agent.\n\n# Tools\n\n")
    assert ('\n<tools>\n{"type": "function", "function": {"name": "search", '
            '"description": "Search the web (données).') in text
    assert (
        '<|im_start|>assistant\nI will search for it.\n<tool_call>\n{"name": "search", "arguments": '
        '{"q": "Le Petit Prince auteur"}}\n</tool_call><|im_end|>\n'
    ) in text
    assert (
        "<|im_start|>user\n<tool_response>\nFrench writer and aviator.\n</tool_response>\n<tool_response>\n"
        '{"title": "The Little Prince"}\n</tool_response><|im_end|>\n<|im_start|>user\nPlease submit now.<|im_end|>'
    ) in text
    assert "<|im_start|>assistant\n<tool_call>\n" in text  # no content: the call starts the turn
    assert qwen25_template.render_assistant(CONVERSATION[4]).startswith("<tool_call>\n")
    assert qwen25_template.stop_token_ids == [qwen25_template.im_end_id, qwen25_template.tokenizer.eos_token_id]


def test_incremental_pieces_decode_to_full_render(qwen25_template: ChatTemplate, qwen25_tokenizer) -> None:
    """prompt + (assistant turn + env reply)* decodes to the full render, token for token."""
    msgs = CONVERSATION
    a_idx = [i for i, m in enumerate(msgs) if m["role"] == "assistant"]
    ids = qwen25_template.encode_prompt(msgs[: a_idx[0]], TOOLS)
    assert qwen25_template.decode(ids) == qwen25_template.render_text(msgs[: a_idx[0]], TOOLS,
                                                                      add_generation_prompt=True)
    for k, i in enumerate(a_idx):
        turn = qwen25_template.encode_assistant(msgs[i])
        assert turn[-1] == qwen25_template.im_end_id
        assert qwen25_template.decode(turn[:-1]) == qwen25_template.render_assistant(msgs[i])
        ids += turn
        # after each assistant turn, the incremental text is the full render minus its final "\n"
        assert qwen25_template.decode(ids) + "\n" == qwen25_template.render_text(msgs[: i + 1], TOOLS)
        if k + 1 < len(a_idx):
            ids += qwen25_template.encode_env_reply(msgs[i + 1 : a_idx[k + 1]])
            assert qwen25_template.decode(ids) == qwen25_template.render_text(msgs[: a_idx[k + 1]], TOOLS,
                                                                              add_generation_prompt=True)
    full = qwen25_template.render_text(msgs, TOOLS)
    assert qwen25_template.decode(ids) + "\n" == full == _jinja_render(msgs, TOOLS, False)
    # pieces split at chat tokens: identical to tokenizing the whole text at once
    assert ids == qwen25_tokenizer.encode(full[:-1], add_special_tokens=False)

    conv_ids, mask = qwen25_template.encode_conversation(msgs, TOOLS)
    assert conv_ids == ids
    assert len(mask) == len(conv_ids)
    # mask-1 tokens are exactly the assistant turns (text + <|im_end|>)
    spans = mask_spans(mask)
    assert [qwen25_template.decode(conv_ids[s:e]) for s, e in spans] == [
        qwen25_template.render_assistant(msgs[i]) + "<|im_end|>" for i in a_idx
    ]


def test_env_reply_piece_shapes(qwen25_template: ChatTemplate) -> None:
    assert qwen25_template.decode(qwen25_template.encode_env_reply([])) == "\n<|im_start|>assistant\n"
    piece = qwen25_template.encode_env_reply([{"role": "tool", "content": "a"}, {"role": "user", "content": "b"}])
    assert qwen25_template.decode(piece) == (
        "\n<|im_start|>user\n<tool_response>\na\n</tool_response><|im_end|>\n<|im_start|>user\nb<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
