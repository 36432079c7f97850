"""The Trajectory record: one sampled episode, kept as tokens (never re-tokenized)."""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

#: The end status of an episode that our own code failed (a tool-call parser bug, say), not the policy.
INTERNAL_ERROR = "internal error"
#: The end status of an episode that its teacher could not score (on-policy distillation: every teacher engine
#: failed or timed out), whatever the episode's own ending.
TEACHER_ERROR = "teacher error"
#: End statuses that say the infrastructure failed, not the policy: the env (the worker's or controller's
#: "task error": a worker lost, a start or call that failed, a reply we could not read; a session
#: "cancelled" under it), the teacher, or our own code. Such an episode is never trained or counted as a reward.
INFRA_STATUSES = frozenset({"task error", "cancelled", INTERNAL_ERROR, TEACHER_ERROR})
#: :attr:`Trajectory.versions` of a token the policy did not sample (prompt, environment reply)
NOT_SAMPLED = -1


class SampledTokens:
    """Appending to five aligned records of an episode's tokens: ``token_ids``, ``loss_mask``, ``behavior_logprobs``,
    ``versions`` (per token) and ``turn_spans`` (a mixin of :class:`Trajectory` and the gateway's segments)."""

    token_ids: list[int]
    loss_mask: list[int]
    behavior_logprobs: list[float]
    versions: list[int]
    turn_spans: list[tuple[int, int]]

    def append_turn(self, token_ids: list[int], logprobs: list[float], versions: list[int]) -> tuple[int, int]:
        """Append one generated turn: its tokens (loss mask 1), their log-probs and per-token versions; its span."""
        if not len(token_ids) == len(logprobs) == len(versions):
            raise ValueError(f"a turn of {len(token_ids)} tokens needs as many log-probs ({len(logprobs)}) and "
                             f"versions ({len(versions)})")
        start = len(self.token_ids)
        self.token_ids.extend(int(t) for t in token_ids)
        self.loss_mask.extend([1] * len(token_ids))
        self.behavior_logprobs.extend(float(x) for x in logprobs)
        self.versions.extend(int(v) for v in versions)
        self.turn_spans.append((start, len(self.token_ids)))
        return start, len(self.token_ids)

    def append_context(self, token_ids: list[int]) -> None:
        """Append tokens the policy did not sample (a prompt, an environment reply): loss mask 0."""
        self.token_ids.extend(int(t) for t in token_ids)
        self.loss_mask.extend([0] * len(token_ids))
        self.behavior_logprobs.extend([0.0] * len(token_ids))
        self.versions.extend([NOT_SAMPLED] * len(token_ids))


@dataclass
class Trajectory(SampledTokens):
    """One multi-turn episode as the trainer consumes it.

    token_ids: the whole episode, prompt + every turn + every environment reply, as token ids.
    loss_mask: 1 for tokens the policy generated, 0 for prompt and environment tokens; len == len(token_ids).
    behavior_logprobs: log-prob of each generated token under the engine that sampled it; 0.0 where loss_mask is 0.
    versions: per token of token_ids, the weight version that sampled it; :data:`NOT_SAMPLED` (-1) where
        loss_mask is 0. A turn that an in-flight weight update crossed holds two versions.
    turn_spans: [start, end) token positions of each generated turn in token_ids.
    task: task name; index: the task's sample index; group_id: samples of the same prompt share it.
    reward: final scalar reward; status: how it ended: the env's final status string, one of the agent's
        ("agent validation failed", ...) or :data:`INTERNAL_ERROR`; see :attr:`infra_failed`.
    metrics: task metrics (e.g. success); timings: seconds spent per phase (generate, env).
    error: why the episode ended abnormally (a malformed tool call, an env failure), "" otherwise.
    routed_experts: MoE models with routing capture: the experts the engines chose for positions
        ``[0, n)`` of ``token_ids`` (``[n, MoE layers, top-k]``, :mod:`rollout_sglang.routing`; each turn's
        positions from the engine that sampled that turn); None when not captured.
    teacher_logprobs: on-policy distillation: per token of token_ids, the teacher's log-prob of it in the
        context before it (untempered), 0.0 where loss_mask is 0; None when no teacher scored the episode.
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
    teacher_logprobs: list[float] | None = None

    def __post_init__(self) -> None:
        n = len(self.token_ids)
        if not len(self.loss_mask) == len(self.behavior_logprobs) == len(self.versions) == n:
            raise ValueError(f"a trajectory of {n} tokens needs as many loss_mask ({len(self.loss_mask)}), "
                             f"behavior_logprobs ({len(self.behavior_logprobs)}) and versions ({len(self.versions)}) "
                             "entries (versions: one per token, -1 where not sampled)")

    @property
    def infra_failed(self) -> bool:
        """The episode ended for an infrastructure reason (:data:`INFRA_STATUSES`, or it holds no token at
        all): its reward says nothing of the policy, so it is left out of groups, the loss and reward means."""
        return self.status in INFRA_STATUSES or not self.token_ids

    @property
    def num_generated(self) -> int:
        """Number of policy-generated tokens."""
        return int(sum(self.loss_mask))

    @property
    def num_turns(self) -> int:
        """Number of generated turns."""
        return len(self.turn_spans)

    @property
    def sampled_versions(self) -> list[int]:
        """The weight version of each generated token, in order."""
        return [v for v in self.versions if v != NOT_SAMPLED]

    @property
    def oldest_version(self) -> int | None:
        """The oldest version that sampled a token of this episode (its staleness is the trained version minus
        this); None when it holds no generated token."""
        return min(self.sampled_versions, default=None)

    @property
    def turn_versions(self) -> list[int]:
        """The version each generated turn started on (its first token's; an empty turn: none)."""
        return [self.versions[start] for start, end in self.turn_spans if end > start]

    @property
    def tokens_after_update(self) -> int:
        """Number of generated tokens sampled after an in-flight weight update crossed their turn (their version
        differs from their turn's first token's); 0 when no update crossed a turn."""
        return sum(1 for start, end in self.turn_spans
                   for v in self.versions[start + 1:end] if v != self.versions[start])


