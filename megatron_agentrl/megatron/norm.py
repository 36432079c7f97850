"""The PyTorch norm of megatron-core's local layer specs, usable under sequence parallelism.

megatron's ``WrappedTorchNorm`` (the local specs' norm without apex) refuses ``sequence_parallel``:
under it every TP rank normalises its own slice of the tokens, so each rank's gradient of the norm
weight covers only those and must be summed over TP, which megatron does for parameters flagged
``sequence_parallel`` (``finalize_model_grads``). :class:`TorchNorm` builds the same
``torch.nn.RMSNorm`` / ``LayerNorm`` and sets that flag; :func:`with_torch_norm` puts it in a spec.
"""
from __future__ import annotations

import dataclasses
from typing import Any

import torch


class TorchNorm:
    """``torch.nn.RMSNorm`` or ``LayerNorm`` (``config.normalization``) of ``hidden_size`` whose weights are
    flagged for megatron's TP gradient sum when ``config.sequence_parallel``."""

    def __new__(cls, config: Any, hidden_size: int, eps: float = 1e-5, persist_layer_norm: bool = False,
                zero_centered_gamma: bool = False, normalization: str = "LayerNorm") -> torch.nn.Module:
        if config.layernorm_zero_centered_gamma:
            raise ValueError("layernorm_zero_centered_gamma is not supported by the torch norm")
        if config.normalization == "RMSNorm":
            norm: torch.nn.Module = torch.nn.RMSNorm(hidden_size, eps=eps)
        elif config.normalization == "LayerNorm":
            norm = torch.nn.LayerNorm(hidden_size, eps=eps)
        else:
            raise ValueError(f"normalization={config.normalization!r}: only RMSNorm and LayerNorm are supported")
        for p in norm.parameters():
            p.sequence_parallel = bool(config.sequence_parallel)
        return norm


def with_torch_norm(spec: Any) -> Any:
    """``spec`` (a module spec, a dataclass of submodules, or a list of them) with every megatron
    ``WrappedTorchNorm`` replaced by :class:`TorchNorm`."""
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    if spec is WrappedTorchNorm:
        return TorchNorm
    if isinstance(spec, list):
        return [with_torch_norm(s) for s in spec]
    if dataclasses.is_dataclass(spec) and not isinstance(spec, type):
        changes = {f.name: with_torch_norm(getattr(spec, f.name)) for f in dataclasses.fields(spec)}
        return dataclasses.replace(spec, **{k: v for k, v in changes.items() if v is not getattr(spec, k)})
    return spec
