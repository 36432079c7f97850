"""The Trajectory record: one sampled episode, kept as tokens (never re-tokenized)."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Trajectory:
    """One multi-turn episode as the trainer consumes it.

    token_ids: the whole episode, prompt + every turn + every environment reply, as token ids.
    loss_mask: 1 for tokens the policy generated, 0 for prompt and environment tokens; len == len(token_ids).
    behavior_logprobs: log-prob of each generated token under the engine that sampled it; 0.0 where loss_mask is 0.
    versions: the weight version that sampled each generated turn (one entry per turn).
    turn_spans: [start, end) token positions of each generated turn in token_ids, aligned with versions.
    task: task name; index: the task's sample index; group_id: samples of the same prompt share it.
    reward: final scalar reward; status: the env's final status string.
    metrics: task metrics (e.g. success); timings: seconds spent per phase (generate, env).
    error: why the episode ended abnormally (a malformed tool call, an env failure), "" otherwise.
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

    @property
    def num_generated(self) -> int:
        """Number of policy-generated tokens."""
        return int(sum(self.loss_mask))

