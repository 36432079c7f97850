"""The family registry (``megatron_agentrl.convert``): each family module declares its megatron
``TransformerConfig`` options, its router (MoE) and its default chat format; the registry answers without torch."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from megatron_agentrl.config import ConfigError
from megatron_agentrl.convert import (
    ARCHITECTURES,
    MAPPINGS,
    MODEL_TYPES,
    default_chat_template,
    get_mapping,
    resolve_chat_template,
)
from rollout_sglang.chat_template import CHAT_TEMPLATES
from tests.support.tiny_models import FAMILIES, tiny_config

REPO = Path(__file__).resolve().parents[2]

# (add_qkv_bias, qk_layernorm, rotary_interleaved) of each family's tiny config
OPTIONS = {"qwen2": (True, False, False), "qwen3": (False, True, False), "llama": (False, False, False),
           "glm4": (True, False, True), "qwen3_moe": (False, True, False), "glm4_moe": (True, True, False)}
CHAT = {"qwen2": "qwen2", "qwen3": "qwen3", "llama": "qwen2", "glm4": "glm4", "qwen3_moe": "qwen3",
        "glm4_moe": "glm45"}
PARTIAL = {"glm4", "glm4_moe"}


def test_the_registry_lists_every_family_once() -> None:
    assert MODEL_TYPES == tuple(MAPPINGS) == FAMILIES
    assert {cls.model_type for cls in MAPPINGS.values()} == set(MODEL_TYPES)
    assert sorted(ARCHITECTURES.values()) == sorted(MODEL_TYPES)
    for model_type, cls in MAPPINGS.items():
        assert cls.default_chat_template in CHAT_TEMPLATES, model_type
        assert default_chat_template(model_type) == CHAT[model_type]
        assert resolve_chat_template("auto", model_type) == CHAT[model_type]
    assert default_chat_template(None) == default_chat_template("gpt_neox") == "qwen2"


@pytest.mark.parametrize("family", FAMILIES)
def test_transformer_options_of_each_family(family: str) -> None:
    cfg = tiny_config(family)
    mapping = get_mapping(cfg)
    qkv_bias, qk_norm, interleaved = OPTIONS[family]
    rotary = 0.5 if family in PARTIAL else 1.0
    assert mapping.transformer_options(rotary) == {"add_qkv_bias": qkv_bias, "qk_layernorm": qk_norm,
                                                    "rotary_interleaved": interleaved}
    assert mapping.partial_rotary == (family in PARTIAL)
    if family not in PARTIAL:
        with pytest.raises(ConfigError, match=r"partial_rotary_factor=0.5 is only supported for glm4 and glm4_moe"):
            mapping.transformer_options(0.5)
    else:
        with pytest.raises(ConfigError, match=r"partial_rotary_factor=1.5 must be in \(0, 1\]"):
            mapping.transformer_options(1.5)


def _tiny(family: str, **fields: object) -> object:
    cfg = tiny_config(family)
    for name, value in fields.items():
        setattr(cfg, name, value)
    return cfg


def test_the_options_follow_the_config() -> None:
    assert get_mapping(_tiny("qwen3", attention_bias=True)).transformer_options()["add_qkv_bias"] is True
    assert get_mapping(_tiny("glm4", attention_bias=False)).transformer_options(0.5)["add_qkv_bias"] is False
    assert get_mapping(_tiny("glm4_moe", use_qk_norm=False)).transformer_options(0.5)["qk_layernorm"] is False
    for flag in ("attention_bias", "mlp_bias"):
        with pytest.raises(ConfigError, match=f"llama config has {flag}=True, which megatron's GPT layer cannot "
                                              "express .*q/k/v bias only"):
            get_mapping(_tiny("llama", **{flag: True}))


def test_router_options_of_the_moe_families() -> None:
    qwen = tiny_config("qwen3_moe")
    assert get_mapping(qwen).router_options(qwen) == {"moe_router_score_function": "softmax",
                                                      "moe_router_pre_softmax": False}
    glm = tiny_config("glm4_moe")
    assert get_mapping(glm).router_options(glm) == {
        "moe_router_score_function": "sigmoid", "moe_router_enable_expert_bias": True,
        "moe_router_bias_update_rate": 0.0, "moe_router_topk_scaling_factor": 2.5,
        "moe_shared_expert_intermediate_size": 32}
    dense = tiny_config("qwen2")
    with pytest.raises(NotImplementedError, match="Qwen2Mapping declares no router_options"):
        get_mapping(dense).router_options(dense)


def test_the_registry_and_config_load_without_torch(tmp_path) -> None:
    """The CLI and config loading read the registry (model types, options, chat formats) without importing torch
    (nor aiohttp: the chat formats' list loads with the config)."""
    conf = tmp_path / "c.yaml"
    conf.write_text("model:\n  arch: {model_type: glm4_moe}\ntasks: [{name: lookup}]\n")
    arch = dict(model_type="glm4_moe", num_hidden_layers=2, hidden_size=64, num_attention_heads=4,
                num_key_value_heads=2, intermediate_size=96, vocab_size=300, n_routed_experts=4,
                moe_intermediate_size=32, first_k_dense_replace=1, use_qk_norm=True)
    code = (
        "import sys\n"
        "from types import SimpleNamespace\n"
        "from megatron_agentrl.config import load_config\n"
        "from megatron_agentrl import convert\n"
        f"cfg = load_config({str(conf)!r}, ['model.chat_template=glm45'])\n"
        "assert convert.MODEL_TYPES and convert.resolve_chat_template('auto', 'glm4_moe') == 'glm45'\n"
        f"opts = convert.get_mapping(SimpleNamespace(**{arch!r})).transformer_options(0.5)\n"
        "assert opts == {'add_qkv_bias': True, 'qk_layernorm': True, 'rotary_interleaved': False}\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'aiohttp')))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120,
                         env={**os.environ, "PYTHONPATH": str(REPO)})
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def test_an_unknown_family_is_named() -> None:
    with pytest.raises(ConfigError, match=r"model_type='gpt_neox' has no Megatron weight mapping; supported: "):
        get_mapping(SimpleNamespace(model_type="gpt_neox"))
