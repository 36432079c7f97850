"""Low-rank adapters on megatron-core's parallel linear layers, sharded as the layers they adapt.

Each adapted layer keeps its own parameters and names (loading, export and the full-weight path are unchanged)
and gets a child ``lora`` whose output a forward hook adds to the layer's: ``y = W x + (alpha / r) B A dropout(x)``.
The adapters are megatron's own parallel linear layers, so that their tensor-parallel communication and gradients
are megatron's:

* a column-parallel layer (``linear_qkv``, ``linear_fc1``: the output split over TP) gets ``A`` column-parallel
  over the rank with its output gathered (``[r / tp, in]`` per rank) and ``B`` column-parallel like the layer
  (``[out / tp, r]``, the same rows as the layer's own shard, gated ``[gate; up]`` halves included);
* a row-parallel layer (``linear_proj``, ``linear_fc2``: the input split over TP) gets ``A`` row-parallel
  (``[r, in / tp]``, its output summed over TP) and ``B`` column-parallel with its output gathered.

Every parameter of the model but the adapters' is frozen: no gradient, no optimizer state. ``A`` starts as the
same full tensor on every layout (seeded by the layer's global name), ``B`` at 0.
"""
from __future__ import annotations

import contextlib
import hashlib
import math
from collections.abc import Iterator
from typing import Any

import torch
from torch import Tensor

from megatron_agentrl.lora.options import LoraOptions

#: the adapter child of an adapted layer, and the marker of adapter parameters in names
ADAPTER = "lora"


def _seed(name: str, seed: int) -> int:
    return int.from_bytes(hashlib.sha256(f"{seed}:{name}".encode()).digest()[:8], "little")


def initial_a(name: str, rank: int, in_features: int, options: LoraOptions, seed: int) -> Tensor:
    """The full ``A [rank, in_features]`` of the layer named ``name`` (global megatron name), the same on every
    layout: kaiming-uniform as PEFT's default, or gaussian with std ``1 / rank``."""
    generator = torch.Generator().manual_seed(_seed(name, seed))
    a = torch.empty(rank, in_features)
    if options.init == "gaussian":
        return a.normal_(0.0, 1.0 / rank, generator=generator)
    bound = 1.0 / math.sqrt(in_features)  # kaiming_uniform_ with a = sqrt(5), as nn.Linear and PEFT
    return a.uniform_(-bound, bound, generator=generator)


class LoraAdapter(torch.nn.Module):
    """The adapter of one parallel linear layer: ``(alpha / r) B A dropout(x)``, sharded as the layer (module
    doc). ``column``: the layer is column-parallel (else row-parallel)."""

    def __init__(self, layer: Any, column: bool, options: LoraOptions, config: Any) -> None:
        super().__init__()
        from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear

        in_features, out_features = layer.input_size, layer.output_size
        self.column = column
        self.scaling = options.scaling
        #: False while the base alone computes (:func:`adapters_off`)
        self.enabled = True
        self.dropout = torch.nn.Dropout(options.dropout) if options.dropout else torch.nn.Identity()
        zero = torch.nn.init.zeros_
        if column:
            self.lora_a = ColumnParallelLinear(in_features, options.rank, config=config, init_method=zero, bias=False,
                                               gather_output=True)
        else:
            self.lora_a = RowParallelLinear(in_features, options.rank, config=config, init_method=zero, bias=False,
                                            input_is_parallel=True, skip_bias_add=True)
        self.lora_b = ColumnParallelLinear(options.rank, out_features, config=config, init_method=zero, bias=False,
                                           gather_output=not column)

    def forward(self, x: Tensor) -> Tensor:
        """The adapter's addition to the layer's output for the layer's input ``x``."""
        hidden, _ = self.lora_a(self.dropout(x))
        out, _ = self.lora_b(hidden)
        return out * self.scaling


def _add_adapter(layer: Any, inputs: tuple[Any, ...], output: tuple[Tensor, Tensor | None]) -> tuple[Any, Any]:
    if not layer.lora.enabled:
        return output
    out, bias = output
    return out + layer.lora(inputs[0]), bias


@contextlib.contextmanager
def adapters_off(model: torch.nn.Module) -> Iterator[None]:
    """Inside the block ``model`` computes with its base alone (every adapter's output left out): the reference
    policy of a LoRA run."""
    adapters = [m for m in model.modules() if isinstance(m, LoraAdapter)]
    for a in adapters:
        a.enabled = False
    try:
        yield
    finally:
        for a in adapters:
            a.enabled = True


def attach_adapters(model: Any, options: LoraOptions, global_name: Any, seed: int = 0) -> list[str]:
    """Adapt ``options.megatron_modules()`` of every decoder layer of ``model`` (one PP stage's ``GPTModel``) and
    freeze everything else; the adapted layers' global names (``global_name(local) -> global``).

    Refused with a ValueError naming the fix: sequence parallelism (MoE models at TP > 1) and expert layers."""
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear

    config = model.config
    tp, tp_rank = parallel_state.get_tensor_model_parallel_world_size(), parallel_state.get_tensor_model_parallel_rank()
    if config.sequence_parallel:
        raise ValueError("lora: adapters under sequence parallelism are not supported (a MoE model at TP > 1, or a "
                         "dense one built without adapters: MegatronActor(..., adapters_later=True)); set lora.rank=0, "
                         "or parallel.tp=1")
    if options.rank % tp:
        raise ValueError(f"lora.rank={options.rank} does not split over parallel.tp={tp} (A is split over the rank "
                         f"in column-parallel layers); choose a multiple of {tp}")
    for p in model.parameters():
        p.requires_grad_(False)
    adapted = []
    for local, module in list(model.named_modules()):
        if not any(local.endswith(suffix) for suffix in options.megatron_modules()):
            continue
        if ".experts." in local:
            raise ValueError(f"lora: {local} is an expert layer; adapters on experts are not supported: name "
                             "attention projections only in lora.target_modules (q_proj, k_proj, v_proj, o_proj)")
        column = isinstance(module, ColumnParallelLinear)
        if not column and not isinstance(module, RowParallelLinear):
            raise ValueError(f"lora: {local} is a {type(module).__name__}, not one of megatron's parallel linear "
                             "layers (Transformer Engine layers are not supported yet); run without "
                             "TransformerEngine or set lora.rank=0")
        adapter = LoraAdapter(module, column, options, config).to(next(module.parameters()).dtype)
        name = global_name(local)
        full_a = initial_a(name, options.rank, module.input_size, options, seed)
        with torch.no_grad():
            if column:
                per = options.rank // tp
                adapter.lora_a.weight.copy_(full_a[tp_rank * per:(tp_rank + 1) * per])
            else:
                per = module.input_size // tp
                adapter.lora_a.weight.copy_(full_a[:, tp_rank * per:(tp_rank + 1) * per])
        module.add_module(ADAPTER, adapter)
        module.register_forward_hook(_add_adapter)
        adapted.append(name)
    if not adapted:
        raise ValueError(f"lora.target_modules={options.target_modules} adapt no layer of this model")
    return adapted


def merged_weight(layer: Any) -> Tensor:
    """This rank's shard of the adapted ``layer``'s weight with its adapter merged in, ``W + (alpha / r) B A``, in
    the weight's dtype. Collective over the TP group (the factor not split like the weight is gathered)."""
    from megatron.core import parallel_state

    adapter = getattr(layer, ADAPTER)
    weight = layer.weight.detach()
    a, b = adapter.lora_a.weight.detach(), adapter.lora_b.weight.detach()
    tp = parallel_state.get_tensor_model_parallel_world_size()
    if tp > 1:
        # a column-parallel layer needs the whole A (split over the rank), a row-parallel one the whole B
        part = a if adapter.column else b
        parts = [torch.empty_like(part) for _ in range(tp)]
        torch.distributed.all_gather(parts, part.contiguous(), group=parallel_state.get_tensor_model_parallel_group())
        if adapter.column:
            a = torch.cat(parts, dim=0)
        else:
            b = torch.cat(parts, dim=0)
    return merge(weight, a, b, adapter.scaling)


def merge(weight: Tensor, a: Tensor, b: Tensor, scaling: float) -> Tensor:
    """``weight + scaling * b @ a`` (``[out, in]``, ``[r, in]``, ``[out, r]``), computed in fp32, in ``weight``'s
    dtype."""
    return (weight.float() + (b.float() @ a.float()) * scaling).to(weight.dtype)


def adapter_parameters(model: Any) -> Iterator[tuple[str, torch.nn.Parameter]]:
    """``(local name, parameter)`` of every adapter parameter of ``model``."""
    for name, p in model.named_parameters():
        if f".{ADAPTER}." in name:
            yield name, p


def is_adapter(name: str) -> bool:
    """Whether the parameter ``name`` belongs to an adapter."""
    return f".{ADAPTER}." in name
