"""Fixtures of the trainer tests: the chat template of the rollout managers' fake engines (module-scoped, as each test
module had its own)."""
from __future__ import annotations

import pytest

from rollout_sglang.chat_template import ChatTemplate
from tests.trainer.support import tiny_agent_template


@pytest.fixture(scope="module")
def template() -> ChatTemplate:
    """Qwen2.5's chat format on the repo's tiny agent tokenizer."""
    return tiny_agent_template()
