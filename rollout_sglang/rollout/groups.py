"""The rollout's records: a group to sample (:class:`GroupRequest`), a sampled one (:class:`FinishedGroup`), and
the stream of requests a run draws from (:class:`PromptSampler`)."""
from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any

from rollout_sglang.trajectory import Trajectory


@dataclass
class GroupRequest:
    """One GRPO group to sample: ``size`` episodes of ``task`` sample ``index``; ``group_id`` is unique per run."""

    group_id: int
    task: str
    index: int
    size: int

    def sample_ids(self) -> list[int]:
        """Run-unique ids of the group's samples: ``group_id * size + j``."""
        return [self.group_id * self.size + j for j in range(self.size)]


class PromptSampler:
    """A reproducible stream of :class:`GroupRequest` s: task by weight, index uniformly from its training indices.

    tasks: task names; weights: their sampling weights; train_indices: task -> indices;
    group_size: samples per group; seed: the stream's seed. The stream depends only on the seed
    and how many groups were drawn, so :meth:`state_dict` / :meth:`load_state_dict` resume it.
    """

    def __init__(self, tasks: list[str], weights: list[float], train_indices: dict[str, list[int]],
                 group_size: int, seed: int) -> None:
        if len(tasks) != len(weights) or not tasks:
            raise ValueError("PromptSampler needs one weight per task and at least one task")
        missing = [t for t in tasks if not train_indices.get(t)]
        if missing:
            raise ValueError(f"tasks {missing} have no training indices")
        self.tasks = list(tasks)
        self.weights = list(weights)
        self.train_indices = {t: list(v) for t, v in train_indices.items()}
        self.group_size = int(group_size)
        self._rng = random.Random(seed)
        self.next_group_id = 0

    def next(self) -> GroupRequest:
        """The next group of the stream."""
        task = self._rng.choices(self.tasks, weights=self.weights)[0]
        index = self._rng.choice(self.train_indices[task])
        req = GroupRequest(self.next_group_id, task, index, self.group_size)
        self.next_group_id += 1
        return req

    def state_dict(self) -> dict[str, Any]:
        """``{"rng": random state, "next_group_id": int}``."""
        return {"rng": self._rng.getstate(), "next_group_id": self.next_group_id}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue the stream from :meth:`state_dict`."""
        self._rng.setstate(state["rng"])
        self.next_group_id = int(state["next_group_id"])


@dataclass
class FinishedGroup:
    """A sampled group: its request, trajectories (``request.size``; more when an agent's episode came back
    in several segments), the trainer version when it started, its acceptance order ``seq``, and wall times
    (``time.monotonic``)."""

    request: GroupRequest
    trajectories: list[Trajectory]
    start_version: int
    seq: int
    t_start: float = 0.0
    t_end: float = 0.0

    @property
    def min_version(self) -> int:
        """The oldest weight version of any generated token (``start_version`` when none was generated)."""
        vs = [v for t in self.trajectories if (v := t.oldest_version) is not None]
        return min(vs, default=self.start_version)
