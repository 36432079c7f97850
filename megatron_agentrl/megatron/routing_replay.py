"""MoE rollout routing replay (R3): the trainer's routers take the experts the engine chose, and the flip rate.

An expert choice is a discrete top-k: the smallest numeric difference between the engine and the trainer
(bf16 vs fp32 router, other kernels, other batch shapes) flips experts on some tokens, and on those tokens the
trainer's log-prob is of another network than the one that sampled. With replay, every forward of the
trainer (the loss, old and reference log-probs) routes each token to the experts the engine chose for it.

The batch gives ``routed_experts [B, T, M, K]`` (``TrainBatch.routed_experts``): for each token, the ``K``
experts of each of the model's ``M`` MoE layers (global order, dense layers excluded:
``mapping.moe_layers``), -1 where the engine gave none. :class:`RoutingReplay` drives megatron-core's hook
for it (``TransformerConfig.moe_enable_routing_replay``: every ``TopKRouter`` gets a ``RouterReplay``
whose ``get_replay_topk`` replaces its top-k) for THIS rank's routers only: megatron keeps a process-wide
list of them (``RouterReplay.global_router_replay_instances``), which would mix the models of a process
(the actor and a reference, tests); each router here gets its own :class:`_LayerReplay`, taken out of
that list, mapped to its global MoE-layer index (pipeline stages own different layers).

Per micro-batch (:meth:`RoutingReplay.set_micro_batch`, just before the model's forward) the routers'
targets are cut from the micro-batch's ``routed_experts`` as the router sees its tokens: ``[s, b]``
flattened sequence-major (a packed THD micro-batch is ``[t, 1]``), the context-parallel shard (the actor
cuts ``routed_experts`` like ``tokens``, never rolled: routing is a model input), and under sequence
parallelism (MoE with TP > 1) this TP rank's ``s / tp`` slice. Inside the router's top-k:

* megatron's own top-k function always runs first (bias and group-limited routing included); tokens whose
  target is -1 (padding, the last token, anything the engine did not cover) keep its choice;
* with replay on (``train.moe_routing_replay``: the router's action ``REPLAY_FORWARD``) the other tokens take
  the engine's experts, and their routing weights are the router's scores at those experts (megatron's
  ``scores.gather``, so gradients reach the router through them as usual); with replay off (action None) the
  trainer's own routing is used and the engine's is only observed;
* the flip rate is counted on the forward passes of a training step (:attr:`RoutingReplay.counting`):
  the share of (token, MoE layer) pairs with a target whose trainer top-k SET differs from the engine's.

Activation recompute (``train.recompute=full``): the forward of a checkpointed layer runs the routers once
more in the backward. Each target set for a micro-batch is also queued per router (megatron's
``replay_backward_list``, FIFO); a top-k computed inside the backward (``torch._C._current_graph_task_id()
!= -1``: only recomputation routes there) takes the oldest queued target, the same micro-batch's, since the
schedules (1F1B included) run the backwards in the forwards' order. :meth:`RoutingReplay.clear` empties
the targets and queues after each forward(-backward) so that nothing leaks into the next.

The auxiliary load-balancing loss (``train.moe_aux_loss_coeff``) and the z-loss are kept as megatron computes
them under replay: from the router's logits with its OWN top-k (``compute_routing_scores_for_aux_loss``),
not from the replayed experts. Cost: one ``[tokens, K]`` index and a gather per MoE layer and micro-batch,
and the sort that compares the two top-k sets.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

FLIP_RATE = "routing/flip_rate"


def _topk_sets_differ(own: Tensor, target: Tensor) -> Tensor:
    """``[N]`` bool: whether the top-k sets of two ``[N, K]`` expert indices differ (order ignored)."""
    return (own.sort(dim=-1).values != target.sort(dim=-1).values).any(dim=-1)


def _layer_replay_class() -> type:
    """``_LayerReplay`` (built lazily, so that importing this module does not import megatron-core)."""
    global _LAYER_REPLAY
    if _LAYER_REPLAY is not None:
        return _LAYER_REPLAY
    from megatron.core.transformer.moe.router_replay import RouterReplay, RouterReplayAction

    class _LayerReplay(RouterReplay):
        """One router's replay: megatron's ``RouterReplay`` (its target, backward queue and action) with a top-k
        that merges the target with megatron's own top-k (-1 rows) and counts flips for its owner.

        ``owner``: the :class:`RoutingReplay` (counting); ``moe_index``: the router's global MoE-layer index."""

        def __init__(self, owner: "RoutingReplay", moe_index: int) -> None:
            super().__init__()
            # megatron registers every instance process-wide; this one is driven by its owner alone
            RouterReplay.global_router_replay_instances.remove(self)
            self.owner = owner
            self.moe_index = moe_index

        def get_replay_topk(self, scores: Tensor, topk: int, num_groups: int | None = None,
                            group_topk: int | None = None,
                            default_compute_topk: Callable[..., tuple[Tensor, Tensor]] | None = None,
                            ) -> tuple[Tensor, Tensor]:
            assert default_compute_topk is not None
            values, own = default_compute_topk(scores, topk, num_groups=num_groups, group_topk=group_topk)
            backward = torch._C._current_graph_task_id() != -1  # a recompute of a checkpointed layer
            if backward:
                target = self.replay_backward_list.pop(0) if self.replay_backward_list else None
            else:
                target = self.target_topk_idx
            if target is None:
                return values, own
            target = target.to(scores.device)
            if target.shape != own.shape:
                raise RuntimeError(f"routing replay: MoE layer {self.moe_index} routes {own.shape[0]} tokens x top-"
                                   f"{own.shape[1]}, but its target from routed_experts is {tuple(target.shape)}")
            given = (target >= 0).all(dim=-1)
            if not backward and self.owner.counting:
                self.owner._count(_topk_sets_differ(own, target) & given, given)
            if self.router_replay_action != RouterReplayAction.REPLAY_FORWARD:
                return values, own  # observed only
            index = torch.where(given.unsqueeze(-1), target, own)
            return scores.gather(1, index), index

    _LAYER_REPLAY = _LayerReplay
    return _LAYER_REPLAY


_LAYER_REPLAY: type | None = None


class RoutingReplay:
    """Routing replay and the flip-rate metric for the routers of this rank's model chunk.

    Args:
        model: this rank's megatron ``GPTModel`` chunk, built with ``moe_enable_routing_replay``.
        moe_layers: per global layer, whether it is a MoE layer (``mapping.moe_layers``); ``M`` = their count.
        replay: route by the targets (``train.moe_routing_replay``); False = observe them only (the flip rate).
        sequence_parallel: each TP rank routes its own ``s / tp`` slice of the sequence (MoE under TP > 1).

    Use: :meth:`set_micro_batch` before each micro-batch's forward, :meth:`clear` after each
    forward(-backward) schedule; :attr:`counting` on for a training step's forwards, then
    :meth:`step_metrics` (collective) reports and restarts the flip rate.
    """

    def __init__(self, model: torch.nn.Module, moe_layers: list[bool], replay: bool,
                 sequence_parallel: bool = False) -> None:
        from megatron.core import parallel_state
        from megatron.core.transformer.moe.router import TopKRouter
        from megatron.core.transformer.moe.router_replay import RouterReplay, RouterReplayAction

        self.num_moe_layers = sum(bool(x) for x in moe_layers)
        self.replay = replay
        self.sequence_parallel = sequence_parallel
        self.tp = parallel_state.get_tensor_model_parallel_world_size() if sequence_parallel else 1
        self.tp_rank = parallel_state.get_tensor_model_parallel_rank() if sequence_parallel else 0
        self.counting = False
        self._counts: Tensor | None = None  # (flipped pairs, pairs with a target), on the model's device
        moe_index = [sum(bool(x) for x in moe_layers[:i]) for i in range(len(moe_layers))]
        cls = _layer_replay_class()
        self.layers: list[Any] = []
        for layer in model.decoder.layers:
            router = getattr(getattr(layer, "mlp", None), "router", None)
            if not isinstance(router, TopKRouter):
                continue
            g = layer.layer_number - 1  # megatron's layer numbers are global and 1-based
            if not moe_layers[g]:
                raise RuntimeError(f"layer {g} has a router but moe_layers says it is dense")
            if router.router_replay is None:
                raise RuntimeError("routing replay needs a model built with moe_enable_routing_replay=True")
            if router.router_replay in RouterReplay.global_router_replay_instances:
                RouterReplay.global_router_replay_instances.remove(router.router_replay)
            router.router_replay = cls(self, moe_index[g])
            router.router_replay.router_replay_action = RouterReplayAction.REPLAY_FORWARD if replay else None
            self.layers.append(router.router_replay)

    def set_micro_batch(self, routed_experts: Tensor | None) -> None:
        """Set every router's target for the next forward (and queue it for a recompute in the backward) from a
        micro-batch's ``routed_experts [b, s, M, K]`` as the model gets it (padded rows, or a packed ``[1, t]``
        row, after the context-parallel cut); None = no target (the trainer's own routing)."""
        if routed_experts is None:
            for r in self.layers:
                r.set_target_indices(None)
            return
        b, s, m, k = routed_experts.shape
        if m != self.num_moe_layers:
            raise ValueError(f"routed_experts has {m} MoE layers, the model {self.num_moe_layers}")
        x = routed_experts.transpose(0, 1)  # [s, b, M, K]: the router's token order is sequence-major
        if self.tp > 1:
            if s % self.tp:
                raise ValueError(f"sequence parallelism: a micro-batch of {s} positions does not split over "
                                 f"{self.tp} TP ranks")
            n = s // self.tp
            x = x[self.tp_rank * n:(self.tp_rank + 1) * n]
        for r in self.layers:
            r.set_target_indices(x[:, :, r.moe_index].reshape(-1, k).long())

    def clear(self) -> None:
        """Forget every target and queued target (after a forward-backward, or one that failed)."""
        for r in self.layers:
            r.clear_indices()

    def _count(self, flipped: Tensor, given: Tensor) -> None:
        counts = torch.stack([flipped.sum(), given.sum()]).to(torch.float64)  # no host sync per router call
        self._counts = counts if self._counts is None else self._counts + counts

    def step_metrics(self, given: bool, device: torch.device | str = "cpu") -> dict[str, float]:
        """``routing/flip_rate`` of the forwards counted since the last call, when any rank was ``given``
        routing (else {}): flipped (token, MoE layer) pairs over the pairs with a target, summed over the
        data-parallel x context-parallel ranks, the TP ranks' sequence slices and the pipeline stages.
        Restarts the counts. Collective over all ranks."""
        from megatron.core import parallel_state

        sums = torch.tensor([0.0, 0.0, float(given)], dtype=torch.float64, device=device)
        if self._counts is not None:
            sums[:2] += self._counts.to(device)
        self._counts = None
        groups = [parallel_state.get_data_parallel_group(with_context_parallel=True),
                  parallel_state.get_pipeline_model_parallel_group()]
        if self.tp > 1:
            groups.append(parallel_state.get_tensor_model_parallel_group())
        for group in groups:
            dist.all_reduce(sums, group=group)
        if float(sums[2]) == 0:
            return {}
        return {FLIP_RATE: float(sums[0]) / max(float(sums[1]), 1.0)}
