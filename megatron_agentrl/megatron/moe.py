"""Mixture-of-experts: megatron-core's MoE settings of a MoE family, and the per-step MoE metrics.

The MoE facts of a family are declared by its module in ``megatron_agentrl.convert``: which layers are MoE
layers, the expert and shared-expert widths, and its router as megatron ``TransformerConfig`` fields
(``router_options``: ``qwen3_moe``'s softmax router, ``glm4_moe``'s sigmoid router with a score-correction
bias, group-limited top-k and scaling). :func:`moe_options` adds the settings every MoE family shares.

Training settings (``train.moe_*``) and the layout (``parallel.ep``): router logits always in fp32,
the all-to-all token dispatcher, experts not split by TP (expert tensor parallel 1, as the peers'
MoE recipes use), the auxiliary load-balancing loss with ``train.moe_aux_loss_coeff`` (0 = off),
token dropping when ``train.moe_capacity_factor`` is set (None = dropless). The router's expert
bias stays fixed during RL (megatron's aux-loss-free bias update rate 0), so the engines, which
receive it as ``e_score_correction_bias``, route exactly as the trainer does.
"""
from __future__ import annotations

from typing import Any

import torch

from megatron_agentrl.config import ConfigError, ParallelConfig
from megatron_agentrl.convert import get_mapping
from rollout_sglang.routing import RoutingLayout


def is_moe(hf_config: Any) -> bool:
    """Whether ``hf_config`` describes a mixture-of-experts model."""
    return get_mapping(hf_config).is_moe


def routing_layout(hf_config: Any) -> RoutingLayout | None:
    """The routed-experts layout of ``hf_config``'s model (None for a dense model): what the engines'
    routing records (``rollout_sglang.routing``) and ``TrainBatch.routed_experts`` are checked against."""
    mapping = get_mapping(hf_config)
    if not mapping.is_moe:
        return None
    return RoutingLayout(num_layers=mapping.num_layers,
                         moe_layers=tuple(i for i, m in enumerate(mapping.moe_layers) if m),
                         num_experts=mapping.num_experts, top_k=int(hf_config.num_experts_per_tok))


def routing_capture(capture: str, replay: bool, hf_config: Any) -> RoutingLayout | None:
    """The layout the run's engines capture routing in, or None: ``rollout.capture_routing`` ("auto": MoE
    models only) and ``train.moe_routing_replay``; ConfigError when a dense model is asked for either."""
    layout = routing_layout(hf_config)
    model_type = getattr(hf_config, "model_type", None)
    if layout is None and (capture == "on" or replay):
        what = "train.moe_routing_replay=true" if replay else "rollout.capture_routing=on"
        raise ConfigError(f"{what} needs a mixture-of-experts model; model_type={model_type!r} has no MoE layer: "
                          "turn it off (capture_routing: auto)")
    return None if capture == "off" else layout


def moe_options(hf_config: Any, ep: int, aux_loss_coeff: float = 0.0,
                capacity_factor: float | None = None) -> dict[str, Any]:
    """megatron ``TransformerConfig`` fields for ``hf_config``'s experts ({} for a dense family).

    ep: expert-parallel size (:meth:`~megatron_agentrl.parallel_layout.ParallelLayout.check_experts`: 1 for a
    dense model, else a divisor of the expert count); aux_loss_coeff: the load-balancing
    loss's coefficient (0 = none); capacity_factor: expert capacity as a multiple of the even share
    (None = no token dropping). Raises ConfigError for router settings megatron cannot express.
    """
    mapping = get_mapping(hf_config)
    model_type = mapping.model_type
    ParallelConfig(ep=ep).check_experts(model_type, mapping.num_experts if mapping.is_moe else 0)
    if not mapping.is_moe:
        return {}
    experts = mapping.num_experts
    topk = int(hf_config.num_experts_per_tok)
    if not 1 <= topk <= experts:
        raise ConfigError(f"{model_type}: num_experts_per_tok={topk} must be in [1, {experts}] (the expert count)")
    pattern = mapping.moe_layers
    opts: dict[str, Any] = {
        "num_moe_experts": experts,
        "moe_router_topk": topk,
        "moe_ffn_hidden_size": int(hf_config.moe_intermediate_size),
        # an int 1 keeps megatron's stacked checkpoint layout; a list makes its keys per layer
        "moe_layer_freq": 1 if all(pattern) else [int(x) for x in pattern],
        "moe_router_dtype": "fp32",
        "moe_token_dispatcher_type": "alltoall",
        "moe_grouped_gemm": False,
        "moe_permute_fusion": False,
        "moe_router_fusion": False,
        "moe_aux_loss_coeff": float(aux_loss_coeff),
        "moe_router_load_balancing_type": "aux_loss" if aux_loss_coeff > 0 else "none",
        "moe_expert_capacity_factor": capacity_factor,
        "moe_pad_expert_input_to_capacity": False,
        "expert_model_parallel_size": ep,
        "expert_tensor_parallel_size": 1,
    }
    opts.update(mapping.router_options(hf_config))  # the family's router (score function, bias, groups)
    return opts


class MoEStats:
    """The MoE metrics of each training step: token routing of every router of this rank's model chunk,
    and megatron's auxiliary-loss tracker.

    Hooks each megatron ``TopKRouter`` (whose forward returns ``(probs, routing_map)``, the map
    ``[tokens, experts]`` after any capacity drop) and, while :attr:`recording`, sums the routed tokens
    per expert over the forward passes; :meth:`step_metrics` reduces them over the data-parallel
    (x context-parallel) ranks and the pipeline stages and starts over. Padding tokens are routed, and
    counted, too. ``num_layers``: the model's layers; ``aux_loss``: whether megatron tracks its
    load-balancing loss (``train.moe_aux_loss_coeff`` > 0); ``sequence_parallel``: each TP rank routes its
    own share of the tokens (summed over TP too).
    """

    AUX_LOSS_NAME = "load_balancing_loss"  # megatron's tracker name for the "aux_loss" balancing type

    def __init__(self, model: torch.nn.Module, topk: int, num_layers: int, aux_loss: bool,
                 sequence_parallel: bool = False) -> None:
        from megatron.core.transformer.moe.router import TopKRouter

        self.topk = topk
        self.num_layers = num_layers
        self.aux_loss = aux_loss
        self.sequence_parallel = sequence_parallel
        self.recording = False
        self._counts: dict[int, torch.Tensor] = {}
        self._tokens: dict[int, float] = {}
        self._handles = []
        for i, module in enumerate(m for m in model.modules() if isinstance(m, TopKRouter)):
            self._handles.append(module.register_forward_hook(self._hook(i)))

    def _hook(self, idx: int) -> Any:
        def hook(module: Any, args: Any, output: Any) -> None:
            if not self.recording:
                return  # log-prob passes are not training steps
            routing_map = output[1].detach()
            counts = routing_map.sum(dim=0).to(torch.float64)
            prev = self._counts.get(idx)
            self._counts[idx] = counts if prev is None else prev + counts
            self._tokens[idx] = self._tokens.get(idx, 0.0) + float(routing_map.shape[0])
        return hook

    def step_metrics(self, num_micro_batches: int) -> dict[str, float]:
        """The step's MoE metrics, averaged over every MoE layer of the model; collective over all ranks.

        ``moe/load_imbalance``: tokens of the busiest expert over the mean (1.0 = perfectly even);
        ``moe/expert_tokens_cv``: coefficient of variation of tokens per expert;
        ``moe/dropped_frac``: share of routed (token, expert) assignments dropped by the capacity;
        ``moe/<aux loss name>``: megatron's tracked router losses (the load-balancing loss, without
        its coefficient) per micro-batch, when ``train.moe_aux_loss_coeff`` > 0.
        """
        import torch.distributed as dist
        from megatron.core import parallel_state
        from megatron.core.transformer.moe.moe_utils import (
            clear_aux_losses_tracker,
            get_moe_layer_wise_logging_tracker,
        )

        dp_cp = parallel_state.get_data_parallel_group(with_context_parallel=True)
        pp = parallel_state.get_pipeline_model_parallel_group()
        sums = torch.zeros(4, dtype=torch.float64)  # imbalance, cv, dropped, layers: summed over the stages
        if self._counts:
            idx = sorted(self._counts)
            counts = torch.stack([self._counts[i] for i in idx])  # [layers of this stage, experts]
            tokens = torch.tensor([self._tokens[i] for i in idx], dtype=torch.float64)
            groups = [dp_cp, parallel_state.get_tensor_model_parallel_group()] if self.sequence_parallel else [dp_cp]
            for group in groups:
                dist.all_reduce(counts, group=group)
                dist.all_reduce(tokens, group=group)
            mean = counts.mean(dim=1).clamp_min(1e-12)
            sums[0] = (counts.max(dim=1).values / mean).sum()
            sums[1] = (counts.std(dim=1, unbiased=False) / mean).sum()
            sums[2] = (1.0 - counts.sum(dim=1) / (tokens * self.topk).clamp_min(1.0)).clamp_min(0.0).sum()
            sums[3] = len(idx)
        self._counts.clear()
        self._tokens.clear()
        dist.all_reduce(sums, group=pp)
        layers = max(float(sums[3]), 1.0)
        out = {"moe/load_imbalance": float(sums[0]) / layers, "moe/expert_tokens_cv": float(sums[1]) / layers,
               "moe/dropped_frac": float(sums[2]) / layers}
        tracker = get_moe_layer_wise_logging_tracker()
        # the same names on every rank, also on a stage without MoE layers (its tracker is empty)
        for name in [self.AUX_LOSS_NAME] if self.aux_loss else []:
            entry = tracker.get(name)
            values = (entry["values"].to(torch.float64) if entry is not None
                      else torch.zeros(self.num_layers, dtype=torch.float64))
            dist.all_reduce(values, group=pp)
            dist.all_reduce(values, group=dp_cp)
            values /= dist.get_world_size(dp_cp) * max(num_micro_batches, 1)
            out[f"moe/{name}"] = float(values.sum()) / layers
        clear_aux_losses_tracker()
        return out

    def close(self) -> None:
        """Remove the hooks."""
        for h in self._handles:
            h.remove()
        self._handles.clear()
