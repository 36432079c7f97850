"""Random PEFT LoRA adapters on a Hugging Face model, as the engines' :class:`Adapter` records (tests only)."""
from __future__ import annotations

import copy
from typing import Any

import torch

from rollout_sglang.engines.adapter import Adapter


def random_peft(base: torch.nn.Module, seed: int, targets: list[str], rank: int = 4, alpha: float = 8.0) -> Any:
    """PEFT's LoRA on a copy of ``base`` with random A and B (B is 0 at init, which would test nothing)."""
    import peft

    model = peft.get_peft_model(copy.deepcopy(base), peft.LoraConfig(r=rank, lora_alpha=alpha, target_modules=targets))
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
    return model.eval()


def as_adapter(model: Any, version: int) -> Adapter:
    """``model``'s (a PEFT model's) adapter as weight version ``version``: its config and PEFT-named tensors."""
    import peft

    cfg = model.peft_config["default"].to_dict()
    cfg["target_modules"] = sorted(cfg["target_modules"])
    cfg = {k: v for k, v in cfg.items() if isinstance(v, (int, float, str, list, bool)) or v is None}
    return Adapter(version, cfg, {k: v.clone() for k, v in peft.get_peft_model_state_dict(model).items()})
