"""The adapters in PEFT's format: ``adapter_config.json`` and ``adapter_model.safetensors``, loadable by
``peft.PeftModel.from_pretrained`` on the Hugging Face base model.

A fused megatron layer's adapter becomes one PEFT adapter per projection it holds: each gets the shared ``A``
and its own rows of ``B`` (q/k/v de-interleaved per query group, gate/up split), through the model family's own
weight mapping (:mod:`megatron_agentrl.convert`). Loading does the inverse, and refuses an adapter whose fused
parts have different ``A``s (one ``A`` per fused layer is what trains here).

Every function here is collective over the trainer's ranks (gathers over TP, then PP).
"""
from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from megatron_agentrl.lora.adapters import ADAPTER
from megatron_agentrl.lora.options import LoraOptions
from rollout_sglang.engines.adapter import PEFT_PREFIX, Adapter


def _adapted_layers(actor: Any) -> Iterator[tuple[str, Any]]:
    """``(global megatron name of the layer, layer)`` of every adapted layer of this stage."""
    for local, module in actor.model.named_modules():
        if hasattr(module, ADAPTER) and isinstance(getattr(module, ADAPTER), torch.nn.Module):
            yield actor._global_name(local), module


def _tp_gather(actor: Any, shard: Tensor) -> list[Tensor]:
    from megatron.core import parallel_state

    if actor.tp == 1:
        return [shard]
    shards = [torch.empty_like(shard) for _ in range(actor.tp)]
    dist.all_gather(shards, shard.contiguous(), group=parallel_state.get_tensor_model_parallel_group())
    return shards


def peft_names(hf_weight: str) -> tuple[str, str]:
    """PEFT's saved names of ``A`` and ``B`` for the Hugging Face weight ``hf_weight`` (``...q_proj.weight``)."""
    module = PEFT_PREFIX + hf_weight.removesuffix(".weight")
    return f"{module}.lora_A.weight", f"{module}.lora_B.weight"


def export_adapters(actor: Any, getter: Callable[[torch.nn.Parameter], Tensor] | None = None) -> dict[str, Tensor]:
    """The adapters of the whole model under PEFT's names, full tensors on every rank, on the CPU (``getter``: what
    to read of each parameter, e.g. its gradient; default its value). Collective."""
    read = getter or (lambda p: p.data)
    local: dict[str, Tensor] = {}
    for name, layer in _adapted_layers(actor):
        adapter = getattr(layer, ADAPTER)
        a_shards = _tp_gather(actor, read(adapter.lora_a.weight).detach())
        b_shards = _tp_gather(actor, read(adapter.lora_b.weight).detach())
        weight = f"{name}.weight"
        full_a = torch.cat(a_shards, dim=0 if adapter.column else 1)
        full_b = actor.mapping.unshard(weight, b_shards) if adapter.column else torch.cat(b_shards, dim=0)
        for hf_weight, b in actor.mapping.to_hf(weight, full_b).items():
            a_name, b_name = peft_names(hf_weight)
            local[a_name] = full_a.to("cpu", copy=True)
            local[b_name] = b.to("cpu", copy=True)
    return local if actor.pp == 1 else actor._gather_over_pp(local)


def load_adapters(actor: Any, tensors: Mapping[str, Tensor]) -> None:
    """Set this rank's adapter shards from PEFT-named full tensors (:func:`export_adapters`' inverse); a
    ValueError names a missing tensor or fused parts with different ``A``s. The optimizer's main weights follow."""
    for name, layer in _adapted_layers(actor):
        adapter = getattr(layer, ADAPTER)
        weight = f"{name}.weight"
        hf_weights = actor.mapping.hf_names(weight)
        parts = [peft_names(w) for w in hf_weights]
        missing = [n for pair in parts for n in pair if n not in tensors]
        if missing:
            raise ValueError(f"lora: the adapter has no {missing[0]} (and {len(missing) - 1} more missing); was it "
                             "exported for this model and lora.target_modules?")
        full_a = tensors[parts[0][0]]
        for a_name, _ in parts[1:]:
            if not torch.equal(tensors[a_name], full_a):
                raise ValueError(f"lora: {a_name} differs from {parts[0][0]}: megatron adapts {'/'.join(hf_weights)} "
                                 "as one layer with one A; this adapter was trained with an A per projection")
        full_b = actor.mapping.to_megatron(weight, {w: tensors[b] for w, (_, b) in zip(hf_weights, parts)})
        rank, tp = actor.tp_rank, actor.tp
        with torch.no_grad():
            if adapter.column:
                per = full_a.shape[0] // tp
                adapter.lora_a.weight.copy_(full_a[rank * per:(rank + 1) * per])
                adapter.lora_b.weight.copy_(actor.mapping.shard(weight, full_b, rank, tp))
            else:
                per = full_a.shape[1] // tp
                adapter.lora_a.weight.copy_(full_a[:, rank * per:(rank + 1) * per])
                rows = full_b.shape[0] // tp
                adapter.lora_b.weight.copy_(full_b[rank * rows:(rank + 1) * rows])
    actor.optimizer.reload_model_params()


def adapter_config(options: LoraOptions, tensors: Mapping[str, Tensor], base: str | None) -> dict[str, Any]:
    """The ``adapter_config.json`` of these adapters (``base``: the base model's path or name, for PEFT)."""
    targets = sorted({n.rsplit(".", 3)[1] for n in tensors})  # <module path>.<projection>.lora_X.weight
    return {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": options.rank, "lora_alpha": options.alpha,
            "lora_dropout": options.dropout, "target_modules": targets, "bias": "none", "fan_in_fan_out": False,
            "use_rslora": False, "init_lora_weights": True, "base_model_name_or_path": base}


def save_adapters(actor: Any, options: LoraOptions, out_dir: str | Path, base: str | None = None) -> Path:
    """Write the adapters to ``out_dir`` in PEFT's format (rank 0 writes, as :meth:`Adapter.save
    <rollout_sglang.engines.adapter.Adapter.save>` does; collective). The directory."""
    tensors = export_adapters(actor)
    out = Path(out_dir)
    if dist.get_rank() == 0:
        Adapter(0, adapter_config(options, tensors, base), tensors).save(out)
    dist.barrier()
    return out
