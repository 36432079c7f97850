"""The Trajectory record: one sampled episode, kept as tokens (never re-tokenized)."""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

#: The end status of an episode that our own code failed (a tool-call parser bug, say), not the policy.
INTERNAL_ERROR = "internal error"
#: End statuses that say the infrastructure failed, not the policy: the env (the worker's or controller's
#: "task error": a worker lost, a start or call that failed, a reply we could not read; a session
#: "cancelled" under it) or our own code. Such an episode is never trained or counted as a reward.
INFRA_STATUSES = frozenset({"task error", "cancelled", INTERNAL_ERROR})


@dataclass
class Trajectory:
    """One multi-turn episode as the trainer consumes it.

    token_ids: the whole episode, prompt + every turn + every environment reply, as token ids.
    loss_mask: 1 for tokens the policy generated, 0 for prompt and environment tokens; len == len(token_ids).
    behavior_logprobs: log-prob of each generated token under the engine that sampled it; 0.0 where loss_mask is 0.
    versions: the weight version that sampled each generated turn (one entry per turn).
    turn_spans: [start, end) token positions of each generated turn in token_ids, aligned with versions.
    task: task name; index: the task's sample index; group_id: samples of the same prompt share it.
    reward: final scalar reward; status: how it ended: the env's final status string, one of the agent's
        ("agent validation failed", ...) or :data:`INTERNAL_ERROR`; see :attr:`infra_failed`.
    metrics: task metrics (e.g. success); timings: seconds spent per phase (generate, env).
    error: why the episode ended abnormally (a malformed tool call, an env failure), "" otherwise.
    routed_experts: MoE models with routing capture: the experts the engines chose for positions
        ``[0, n)`` of ``token_ids`` (``[n, MoE layers, top-k]``, :mod:`rollout_sglang.routing`; each turn's
        positions from the engine that sampled that turn); None when not captured.
    """

    token_ids: list[int]
    loss_mask: list[int]
    behavior_logprobs: list[float]
    versions: list[int]
    turn_spans: list[tuple[int, int]]
    task: str
    index: int
    group_id: int
    reward: float = 0.0
    status: str = "running"
    metrics: dict[str, float] = field(default_factory=dict)
    timings: dict[str, float] = field(default_factory=dict)
    error: str = ""
    routed_experts: np.ndarray | None = None

    @property
    def infra_failed(self) -> bool:
        """The episode ended for an infrastructure reason (:data:`INFRA_STATUSES`, or it holds no token at
        all): its reward says nothing of the policy, so it is left out of groups, the loss and reward means."""
        return self.status in INFRA_STATUSES or not self.token_ids

    @property
    def num_generated(self) -> int:
        """Number of policy-generated tokens."""
        return int(sum(self.loss_mask))

