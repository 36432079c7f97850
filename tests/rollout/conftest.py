"""Fixtures of the rollout tests: the pinned SGLang wheel, the agent loop's tokenizer and template, and a
stand-in tokenizer and template per chat format (module-scoped, as each test module had its own)."""
from __future__ import annotations

import importlib.util
import json
import sys
import zipfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from rollout_sglang.chat_template import ChatTemplate, Glm4ChatTemplate, Glm45ChatTemplate, Qwen3ChatTemplate
from rollout_sglang.testing.sglang_contract import API_TYPES, SGLANG_PIN, find_wheel
from rollout_sglang.tokenizer import train_bpe_tokenizer
from tests.rollout import chat_formats
from tests.rollout.support import ADD_TOOLS, SCRIPTS, taught_calc_engine


@pytest.fixture(scope="session")
def wheel() -> Path:
    """The pinned SGLang wheel (fetched once when missing); the test skips, saying why, when it cannot be had."""
    path = find_wheel(fetch=True)
    if path is None:
        pytest.skip(f"the sglang=={SGLANG_PIN} wheel could not be fetched (pip download --no-deps); set "
                    "AGENTRL_SGLANG_WHEEL to a local copy")
    return path


@pytest.fixture(scope="session")
def api_types(wheel: Path, tmp_path_factory: pytest.TempPathFactory) -> Any:
    """SGLang's generated api/v1 decoders, loaded from the wheel as a module of their own (they need msgspec)."""
    pytest.importorskip("msgspec")
    path = tmp_path_factory.mktemp("sglang_api") / "sglang_api_types.py"
    with zipfile.ZipFile(wheel) as z:
        path.write_bytes(z.read(API_TYPES))
    spec = importlib.util.spec_from_file_location("sglang_api_types", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def template(tmp_path_factory: pytest.TempPathFactory) -> ChatTemplate:
    """Qwen2.5's format on a tokenizer trained on the agent loop's scripted episodes (``support.SCRIPTS``)."""
    corpus = [t for turns in SCRIPTS.values() for t in turns]
    corpus += [json.dumps(ADD_TOOLS), "Solve the task EP=calc. result 42"]
    tok = train_bpe_tokenizer(corpus * 3, vocab_size=500, out_dir=tmp_path_factory.mktemp("tok"))
    return ChatTemplate(tok)


@pytest.fixture(scope="module")
def taught_engine(template: ChatTemplate) -> Any:
    """The calc episode taught to a tiny model (``support.taught_calc_engine``), on ``template``."""
    return taught_calc_engine(template)


def _format_fixtures(fmt: str, make_tokenizer: Callable[[Path], Any], template_cls: type[ChatTemplate]):
    """The module-scoped fixtures ``<fmt>_tokenizer`` (``make_tokenizer`` in a temporary folder of its own) and
    ``<fmt>_template`` (``template_cls`` on it)."""

    @pytest.fixture(scope="module", name=f"{fmt}_tokenizer")
    def tokenizer(tmp_path_factory: pytest.TempPathFactory):
        return make_tokenizer(tmp_path_factory.mktemp(f"{fmt}tok"))

    @pytest.fixture(scope="module", name=f"{fmt}_template")
    def template(request: pytest.FixtureRequest) -> ChatTemplate:
        return template_cls(request.getfixturevalue(f"{fmt}_tokenizer"))

    return tokenizer, template


qwen25_tokenizer, qwen25_template = _format_fixtures("qwen25", chat_formats.qwen25_tokenizer, ChatTemplate)
glm4_tokenizer, glm4_template = _format_fixtures("glm4", chat_formats.glm4_tokenizer, Glm4ChatTemplate)
glm45_tokenizer, glm45_template = _format_fixtures("glm45", chat_formats.glm45_tokenizer, Glm45ChatTemplate)
qwen3_tokenizer, qwen3_template = _format_fixtures("qwen3", chat_formats.qwen3_tokenizer, Qwen3ChatTemplate)
