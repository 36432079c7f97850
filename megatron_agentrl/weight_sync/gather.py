"""The actor's parameters as full Hugging Face tensors, one at a time (the one HF-name gather).

Used by the weight sync (tensors straight to the engines) and by the actor's own exports
(:meth:`MegatronActor.export_hf_state_dict`, :meth:`MegatronActor.export_hf_grads`).
"""
from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist

from megatron_agentrl.convert.base import OUTPUT_LAYER

_EXPERT_INDEX_RE = re.compile(r"(?<=\.mlp\.experts\.local_experts\.)\d+(?=\.)")


def stage_hf_tensors(actor: Any, getter: Callable[[torch.nn.Parameter], torch.Tensor] | None = None
                     ) -> Iterator[tuple[str, torch.Tensor]]:
    """This PP stage's parameters as full (TP-gathered, vocab-unpadded) Hugging Face tensors.

    Yields ``(hf_name, tensor)`` in model order, on the actor's device, in the dtype ``getter``
    gives (default: each weight's value, ``actor.weight_value``: the model's dtype, a LoRA adapter merged into
    the layer it adapts, followed by the weights megatron keeps
    as buffers, i.e. the MoE router's expert bias; ``lambda p: p.main_grad`` for the fp32 gradients,
    parameters only). Collective over the tensor-parallel group and, with expert parallelism, over
    the expert-parallel group (each expert is all-gathered from the rank holding it): every rank of
    those groups must run the iterator to the end. The last stage's copy of a tied embedding is
    skipped (stage 0 has it).
    """
    from megatron.core import parallel_state

    tp_group = parallel_state.get_tensor_model_parallel_group()
    ep_group = parallel_state.get_expert_model_parallel_group() if actor.ep > 1 else None
    tied = bool(getattr(actor.hf_config, "tie_word_embeddings", False))
    named = actor.named_params if getter is not None else [*actor.named_params, *actor.named_buffers]
    for name, p in named:
        if tied and name == OUTPUT_LAYER:
            continue
        t = (actor.weight_value(p) if getter is None else getter(p)).contiguous()
        expert = actor.mapping.expert_index(name)
        if expert is not None and ep_group is not None:
            # experts are not split by TP; expert j of EP rank r is global expert r * local + j
            parts = [torch.empty_like(t) for _ in range(actor.ep)]
            dist.all_gather(parts, t, group=ep_group)
            local = expert - actor.ep_rank * actor.local_experts
            for r, part in enumerate(parts):
                global_name = _EXPERT_INDEX_RE.sub(str(r * actor.local_experts + local), name)
                for hf_name, x in actor.mapping.to_hf(global_name, part).items():
                    yield hf_name, x.contiguous()
            continue
        if actor.tp > 1 and actor.mapping.tp_layout(name).partition_dim is not None:
            shards = [torch.empty_like(t) for _ in range(actor.tp)]
            dist.all_gather(shards, t, group=tp_group)
        else:
            shards = [t]
        full = actor.mapping.unshard(name, shards, strip_vocab=True)
        for hf_name, x in actor.mapping.to_hf(name, full).items():
            yield hf_name, x.contiguous()
