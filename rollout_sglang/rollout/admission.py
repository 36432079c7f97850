"""Admission: when the rollout manager may start another group, and which finished groups are too stale to train.

With trainer weight version ``v`` (steps done), staleness ``eta`` and ``B = batch_groups``, a new group starts
only while ``(v + eta - lag + 1) * B > covered``, where ``covered`` counts the batch slots consumed by the
trainer, waiting in the queue, running, or given up by dynamic sampling, and ``lag`` is how many versions older
than the trainer's a new group's turns may be sampled with (cross-policy over ``max_versions`` slots:
``max_versions - 1``; 0 on-policy). ``eta = 0`` is the synchronous schedule. The queue bound caps
``waiting + running`` as well, a drain (before a checkpoint) admits no more than the next batch needs, and
``total_groups`` ends admission once the run's groups are covered.
"""
from __future__ import annotations

from dataclasses import dataclass

from env_controller.options import Options


@dataclass
class AdmissionOptions(Options):
    """When a new group may start (see the module doc)."""

    #: groups per training step (B)
    batch_groups: int
    #: eta: how many weight versions older than the trained policy a trained token may be (0: synchronous)
    staleness: int = 0
    #: most groups waiting + running (0: ``(staleness + 1) * batch_groups``); at least one batch
    queue_size: int = 0
    #: groups run in lockstep by one agent-loop call (1: each group on its own)
    cohort_groups: int = 1
    #: how many versions older than the trainer's a new group's turns may be sampled with (cross-policy
    #: sampling), 0..staleness
    version_lag: int = 0
    #: stop admitting once ``consumed + waiting + running`` reaches it (the groups the run will train; None: no
    #: limit)
    total_groups: int | None = None

    def check(self) -> None:
        """Sizes are positive, staleness and lag fit together, the queue holds a batch."""
        super().check()
        self.require_positive_int("batch_groups", "cohort_groups")
        self.require_int("staleness", low=0, why="0 = synchronous")
        self.require_int("queue_size", low=0, why="0 = (staleness + 1) * batch_groups")
        self.require_int("version_lag", 0, self.staleness,
                         why="staleness: turns sampled by versions older than that could never be trained")
        self.require(self.queue_limit >= self.batch_groups, "queue_size",
                     f"must hold at least one batch ({self.batch_groups} groups); raise it or use 0 (auto)")
        if self.total_groups is not None:
            self.require_int("total_groups", low=0, why="None = no limit")

    @property
    def queue_limit(self) -> int:
        """The bound on groups waiting + running (``queue_size``, or its automatic value)."""
        return self.queue_size if self.queue_size > 0 else (self.staleness + 1) * self.batch_groups


@dataclass
class Slots:
    """Where the batch slots are now: consumed by the trainer, queued, running, given up (dynamic sampling)."""

    consumed: int
    queued: int
    running: int
    short: int

    @property
    def covered(self) -> int:
        """Slots taken so far (dropped groups hold none)."""
        return self.consumed + self.queued + self.short + self.running


class Admission:
    """The admission rule of :class:`AdmissionOptions` (see the module doc)."""

    def __init__(self, options: AdmissionOptions) -> None:
        self.options = options
        self.batch_groups = options.batch_groups
        self.staleness = options.staleness
        self.queue_limit = options.queue_limit

    def capacity(self, slots: Slots, version: int, draining: bool) -> int:
        """How many groups may start now at trainer version ``version`` (<= 0: none)."""
        o, covered = self.options, slots.covered
        cap = (version + o.staleness - o.version_lag + 1) * o.batch_groups - covered
        cap = min(cap, self.queue_limit - (slots.queued + slots.running))
        if draining:
            cap = min(cap, o.batch_groups - (slots.queued + slots.running + slots.short))
        if o.total_groups is not None:
            cap = min(cap, o.total_groups - covered)
        return cap

    def exhausted(self, slots: Slots) -> bool:
        """No more groups will be admitted (``total_groups`` reached)."""
        return self.options.total_groups is not None and slots.covered >= self.options.total_groups

    def oldest_trainable(self, version: int) -> int:
        """The oldest weight version a group may hold to train at trainer version ``version`` (``v - eta``)."""
        return version - self.staleness
