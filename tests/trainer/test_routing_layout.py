"""The routed-experts layout is one fact seen from two sides: the trainer's family mapping
(``megatron_agentrl.megatron.moe.routing_layout``) and the engine's routers (``router_capture``) must agree,
and the run refuses routing settings a dense model cannot honour."""
from __future__ import annotations

import pytest

from megatron_agentrl.config import ConfigError
from megatron_agentrl.megatron.moe import routing_capture, routing_layout
from rollout_sglang.engines.router_capture import routing_layout_from_config
from tests.support.tiny_models import tiny_config


@pytest.mark.parametrize("family,layers", [("qwen3_moe", 3), ("glm4_moe", 3)])
def test_trainer_and_engine_agree_on_the_layout(family: str, layers: int) -> None:
    cfg = tiny_config(family, layers=layers)
    if family == "qwen3_moe":
        cfg.mlp_only_layers = [1]  # a dense layer in the middle
    ours, engines = routing_layout(cfg), routing_layout_from_config(cfg)
    assert ours == engines
    assert ours.moe_layers == ((0, 2) if family == "qwen3_moe" else (1, 2))


def test_dense_models_have_no_layout_and_refuse_routing_settings() -> None:
    cfg = tiny_config("qwen2")
    assert routing_layout(cfg) is None and routing_capture("auto", False, cfg) is None
    with pytest.raises(ConfigError, match="rollout.capture_routing=on needs a mixture-of-experts model"):
        routing_capture("on", False, cfg)
    with pytest.raises(ConfigError, match="train.moe_routing_replay=true needs a mixture-of-experts model"):
        routing_capture("auto", True, cfg)
    assert routing_capture("off", False, tiny_config("qwen3_moe")) is None
