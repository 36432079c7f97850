"""Routed experts: which experts of a mixture-of-experts model the engine chose for each token.

Rollout routing replay (R3) trains a MoE policy on the experts the engine used when it sampled, not
on the trainer's own top-k (which flips on some tokens under any numeric difference). An engine asked
for routing (``Engine.generate(..., routing_from=...)``) returns, per sequence, an array
``[positions, M, K]``: for each position ``t`` (the forward pass of token ``t``: it produced the
distribution of token ``t + 1``) and each of the model's ``M`` MoE layers (dense layers left out),
the ``K`` experts chosen, in the engine's order. :class:`RoutingLayout` holds the shape facts every
record is checked against.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np


class RoutingError(ValueError):
    """A routed-experts record does not fit the model (wrong shape, expert ids out of range)."""


@dataclass(frozen=True)
class RoutingLayout:
    """The routing facts of a MoE model.

    num_layers: decoder layers; moe_layers: indices (ascending) of the MoE layers among them;
    num_experts: routed experts per MoE layer; top_k: experts chosen per token.
    Records are stored as :attr:`dtype` (uint8 up to 256 experts, else int16).
    """

    num_layers: int
    moe_layers: tuple[int, ...]
    num_experts: int
    top_k: int

    def __post_init__(self) -> None:
        if not self.moe_layers or list(self.moe_layers) != sorted(set(self.moe_layers)) or \
                not 0 <= self.moe_layers[0] <= self.moe_layers[-1] < self.num_layers:
            raise RoutingError(f"moe_layers={list(self.moe_layers)} must be distinct ascending layer indices in "
                               f"[0, {self.num_layers})")
        if not 1 <= self.top_k <= self.num_experts <= 32767:
            raise RoutingError(f"top_k={self.top_k} and num_experts={self.num_experts} need "
                               "1 <= top_k <= num_experts <= 32767")

    @property
    def dtype(self) -> np.dtype:
        """The storage dtype of a record."""
        return np.dtype(np.uint8 if self.num_experts <= 256 else np.int16)

    @property
    def bytes_per_token(self) -> int:
        """Bytes one position of a record takes."""
        return len(self.moe_layers) * self.top_k * self.dtype.itemsize

    def empty(self) -> np.ndarray:
        """A record of no positions."""
        return np.zeros((0, len(self.moe_layers), self.top_k), dtype=self.dtype)

    def check(self, routing: np.ndarray, positions: int, source: str) -> np.ndarray:
        """``routing`` as a record of ``positions`` positions in :attr:`dtype`; RoutingError naming
        ``source`` (e.g. the engine's URL) when its shape or expert ids do not fit the model."""
        want = (positions, len(self.moe_layers), self.top_k)
        if tuple(routing.shape) != want:
            raise RoutingError(f"{source}: routed experts of shape {tuple(routing.shape)}, expected {want} "
                               "(positions x MoE layers x top-k)")
        if routing.size and (int(routing.min()) < 0 or int(routing.max()) >= self.num_experts):
            raise RoutingError(f"{source}: routed expert ids in [{int(routing.min())}, {int(routing.max())}], "
                               f"outside [0, {self.num_experts})")
        return np.ascontiguousarray(routing, dtype=self.dtype)
