"""The routers of a Hugging Face mixture-of-experts model: where they are, and what they choose.

``transformers`` MoE blocks call a router module (Qwen3-MoE ``Qwen3MoeTopKRouter``, GLM-4.5
``Glm4MoeTopkRouter``, ...) that returns ``(router_logits, weights, indices)``; ``indices`` is ``[tokens,
top_k]``, the experts the block then runs, with the tokens of the ``[batch, seq]`` input flattened row-major.
The routers are found generically: a module under ``layers.<i>.`` whose class name contains "router"
(any case) and that has integer ``top_k`` and ``num_experts`` attributes. Layers without one are dense.

:func:`routing_layout_of` reads the :class:`~rollout_sglang.routing.RoutingLayout` from a model,
:func:`routing_layout_from_config` from a config (the model is built on the meta device, no memory);
:class:`RouterCapture` records the routers' choices of each forward pass while it is open (hooks are
registered on entry and removed on exit, so a forward without it costs nothing).
"""
from __future__ import annotations

import re
from typing import Any

import torch

from rollout_sglang.routing import RoutingLayout

_LAYER_RE = re.compile(r"(?:^|\.)layers\.(\d+)\.")


def find_routers(model: torch.nn.Module) -> dict[int, torch.nn.Module]:
    """``{decoder layer index: router module}`` of the model's MoE layers (empty for a dense model)."""
    found: dict[int, torch.nn.Module] = {}
    for name, module in model.named_modules():
        if "router" not in type(module).__name__.lower():
            continue
        top_k, experts = getattr(module, "top_k", None), getattr(module, "num_experts", None)
        if not isinstance(top_k, int) or not isinstance(experts, int):
            continue
        m = _LAYER_RE.search(name + ".")
        if m is None:
            continue
        layer = int(m.group(1))
        if layer in found:
            raise ValueError(f"two router modules in decoder layer {layer} of {type(model).__name__} "
                             f"({type(found[layer]).__name__}, {type(module).__name__}); routing capture "
                             "expects one per MoE layer")
        found[layer] = module
    return dict(sorted(found.items()))


def _num_layers(model: torch.nn.Module) -> int:
    cfg = getattr(model, "config", None)
    if cfg is not None and hasattr(cfg, "get_text_config"):
        cfg = cfg.get_text_config()
    n = getattr(cfg, "num_hidden_layers", None)
    if not isinstance(n, int):
        raise ValueError(f"{type(model).__name__} has no config.num_hidden_layers; cannot lay out its routing")
    return n


def routing_layout_of(model: torch.nn.Module) -> RoutingLayout | None:
    """The routing layout of a ``transformers`` model from its router modules; None for a dense model."""
    routers = find_routers(model)
    if not routers:
        return None
    tops = {(int(r.num_experts), int(r.top_k)) for r in routers.values()}
    if len(tops) != 1:
        raise ValueError(f"the routers of {type(model).__name__} disagree on (num_experts, top_k): {sorted(tops)}")
    (experts, top_k), = tops
    return RoutingLayout(num_layers=_num_layers(model), moe_layers=tuple(routers), num_experts=experts, top_k=top_k)


def routing_layout_from_config(hf_config: Any) -> RoutingLayout | None:
    """The routing layout of the model a ``transformers`` config (or a checkpoint directory with a config.json)
    describes, found as :func:`routing_layout_of` finds it on a model built on the meta device; None if dense."""
    from transformers import AutoConfig, AutoModelForCausalLM

    if not hasattr(hf_config, "to_dict"):
        hf_config = AutoConfig.from_pretrained(str(hf_config), local_files_only=True)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(hf_config)
    return routing_layout_of(model)


def _indices(output: Any) -> torch.Tensor:
    """The expert indices in a router's output (its last integer tensor)."""
    items = output if isinstance(output, (tuple, list)) else (output,)
    for item in reversed(items):
        if isinstance(item, torch.Tensor) and not item.is_floating_point():
            return item
    raise TypeError(f"a router returned no integer tensor of expert indices (got {type(output).__name__})")


class RouterCapture:
    """Records the experts every router chose, one forward pass at a time (a context manager).

    Use: ``with RouterCapture(routers) as cap: model(...); step = cap.take(batch, seq)`` -> ``[batch, seq,
    M, K]`` (``M`` routers in layer order), the choices of the forward pass that just ran, on its device.
    """

    def __init__(self, routers: dict[int, torch.nn.Module]) -> None:
        self.routers = routers
        self._seen: dict[int, torch.Tensor] = {}
        self._handles: list[Any] = []

    def __enter__(self) -> "RouterCapture":
        for layer, module in self.routers.items():
            self._handles.append(module.register_forward_hook(self._hook(layer)))
        return self

    def __exit__(self, *exc: Any) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []
        self._seen = {}

    def _hook(self, layer: int) -> Any:
        def hook(module: torch.nn.Module, inputs: Any, output: Any) -> None:
            self._seen[layer] = _indices(output)
        return hook

    def take(self, batch: int, seq: int) -> torch.Tensor:
        """The choices of the last forward pass over a ``[batch, seq]`` input: ``[batch, seq, M, K]`` int64."""
        missing = [layer for layer in self.routers if layer not in self._seen]
        if missing:
            raise RuntimeError(f"routers of layers {missing} did not run in the last forward pass")
        out = torch.stack([self._seen[layer].reshape(batch, seq, -1) for layer in self.routers], dim=2)
        self._seen = {}
        return out.long()
