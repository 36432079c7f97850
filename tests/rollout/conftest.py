"""Fixtures of the rollout tests: the agent loop's tokenizer and template, and a stand-in tokenizer and template per
chat format (module-scoped, as each test module had its own)."""
from __future__ import annotations

import json

import pytest

from rollout_sglang.chat_template import ChatTemplate, Glm4ChatTemplate, Glm45ChatTemplate, Qwen3ChatTemplate
from rollout_sglang.tokenizer import train_bpe_tokenizer
from tests.rollout import chat_formats
from tests.rollout.support import ADD_TOOLS, SCRIPTS


@pytest.fixture(scope="module")
def template(tmp_path_factory: pytest.TempPathFactory) -> ChatTemplate:
    """Qwen2.5's format on a tokenizer trained on the agent loop's scripted episodes (``support.SCRIPTS``)."""
    corpus = [t for turns in SCRIPTS.values() for t in turns]
    corpus += [json.dumps(ADD_TOOLS), "Solve the task EP=calc. result 42"]
    tok = train_bpe_tokenizer(corpus * 3, vocab_size=500, out_dir=tmp_path_factory.mktemp("tok"))
    return ChatTemplate(tok)


@pytest.fixture(scope="module")
def qwen25_tokenizer(tmp_path_factory: pytest.TempPathFactory):
    return chat_formats.qwen25_tokenizer(tmp_path_factory.mktemp("tok"))


@pytest.fixture(scope="module")
def qwen25_template(qwen25_tokenizer) -> ChatTemplate:
    return ChatTemplate(qwen25_tokenizer)


@pytest.fixture(scope="module")
def glm4_tokenizer(tmp_path_factory: pytest.TempPathFactory):
    return chat_formats.glm4_tokenizer(tmp_path_factory.mktemp("glmtok"))


@pytest.fixture(scope="module")
def glm4_template(glm4_tokenizer) -> Glm4ChatTemplate:
    return Glm4ChatTemplate(glm4_tokenizer)


@pytest.fixture(scope="module")
def glm45_tokenizer(tmp_path_factory: pytest.TempPathFactory):
    return chat_formats.glm45_tokenizer(tmp_path_factory.mktemp("glm45tok"))


@pytest.fixture(scope="module")
def glm45_template(glm45_tokenizer) -> Glm45ChatTemplate:
    return Glm45ChatTemplate(glm45_tokenizer)


@pytest.fixture(scope="module")
def qwen3_tokenizer(tmp_path_factory: pytest.TempPathFactory):
    return chat_formats.qwen3_tokenizer(tmp_path_factory.mktemp("qwen3tok"))


@pytest.fixture(scope="module")
def qwen3_template(qwen3_tokenizer) -> Qwen3ChatTemplate:
    return Qwen3ChatTemplate(qwen3_tokenizer)
