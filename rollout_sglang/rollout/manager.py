"""The rollout side of both pipelines: trajectory groups in flight, a bounded queue, a staleness cap.

:class:`RolloutManager` runs on the rollout rank in a thread of its own with its own asyncio
event loop. It starts GRPO groups (``samples_per_prompt`` episodes of one task sample, drawn by
a :class:`PromptSampler`) through the agent loop (``run_group_lockstep``) against an engine or a
version pool and an env client, and puts each finished group on a queue. The trainer (another
thread) takes a batch of ``batch_groups`` groups with :meth:`RolloutManager.get_batch` and, after
each optimizer step and weight push, calls :meth:`RolloutManager.set_version`.

Admission (AgentRL / AReaL): with trainer weight version ``v`` (steps done), staleness ``eta``
and ``B = batch_groups``, a new group starts only while
``(v + eta - lag + 1) * B > accepted + running``, where ``accepted`` counts groups trained or waiting
in the queue and ``lag`` is how many versions older than the trainer's a new group's turns may be
sampled with (cross-policy over ``max_versions`` slots: ``max_versions - 1``; 0 on-policy).
``eta = 0`` is the synchronous schedule (a step's groups start after the previous step's weights
arrived; the trainer waits for all of them). ``queue_size`` bounds ``waiting + running`` as well.

Staleness guarantee: the batch for the step that trains version ``v`` takes the queued groups
with the oldest weight version first, and a group whose oldest token was sampled by a version
older than ``v - eta`` is never trained (it is dropped and counted in ``dropped_stale``; the
admission rule keeps that rare). So no trained token is more than ``eta`` versions old.

Partial rollout: a weight update pauses generation of its version slot between turns (see
:class:`~rollout_sglang.engines.version_pool.VersionPool`); in-flight episodes are kept and continue on
the new weights, their turns recording the version that sampled them.

Dynamic sampling (DAPO; :meth:`RolloutManager.enable_dynamic_sampling`): a finished group whose
training rewards are all equal carries no GRPO signal; it is dropped (counted per task in
``dropped_zero_var``, never accepted) and the slot it held is free again, so admission draws another
prompt. Slots are counted per batch: batch ``k`` holds slots ``k*B .. (k+1)*B - 1`` of the sequence
``consumed + queued + running + short``, and a fresh draw is charged to the batch its slot falls in.
Once ``max_groups`` draws were charged to a batch, its remaining free slots are given up (``short``:
they count as covered for admission and the staleness accounting, like accepted groups, but hold no
group), and the trainer takes that batch with fewer groups. A batch left with no group at all trains
on the newest zero-variance groups instead (advantage 0: the policy-gradient term is 0, the pipeline
advances); if none of those is fresh enough for the staleness cap, one slot is reopened for a draw
beyond the budget, so a batch always comes (within ``get_batch``'s timeout) and nothing hangs.

Infrastructure failures (``Trajectory.infra_failed``: the env or our code failed, not the policy) are never
trained: a finished group keeps only its valid episodes when at least ``min_valid_fraction`` of its samples
(and at least 2, or 1 for groups of one) remain; otherwise it is re-run from scratch (a fresh attempt, up to
``max_attempts``) and then dropped, its slot free for another draw. Both are counted per task
(:attr:`ManagerStats.infra_failed`, ``infra_retried``, ``dropped_infra``) and in :attr:`RolloutManager.last_batch`.
A task whose last ``max_dropped_in_row`` finished groups were all dropped fails the run (:class:`RolloutError`
naming the task and the last infrastructure error): its environment is broken, and drawing on would only
wait out ``get_batch``'s timeout.

Periodic evaluation runs on the rollout thread's event loop (:meth:`RolloutManager.submit`), beside
the groups in flight: the engines' batching wrappers serve one event loop at a time.

Checkpoints: :meth:`drain` stops admission once the next batch is covered and waits until
nothing runs, so :meth:`state_dict` (sampler state, queued groups with their trajectories,
counters) holds the complete next batch; a run restored from it trains the same next batch.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import copy
import logging
import math
import random
import threading
import time
from collections import Counter, deque
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field, fields
from typing import Any, TypeVar

from rollout_sglang.agent_loop import run_group_lockstep
from rollout_sglang.engines.protocol import EnginesUnavailable, SamplingParams
from rollout_sglang.trajectory import Trajectory

logger = logging.getLogger(__name__)

T = TypeVar("T")


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
        """The oldest weight version of any generated turn (``start_version`` when none was generated)."""
        vs = [v for t in self.trajectories for v in t.versions]
        return min(vs) if vs else self.start_version


def zero_variance(group: FinishedGroup, reward: Callable[[Trajectory], float]) -> bool:
    """Whether every trajectory of ``group`` has the same ``reward`` (exactly: GRPO's advantages are then 0)."""
    values = [float(reward(t)) for t in group.trajectories]
    return max(values) == min(values)


@dataclass
class ManagerStats:
    """Counters of a :class:`RolloutManager` (cumulative since it started; a resumed run's manager goes on from
    the checkpoint's, see :meth:`RolloutManager.load_state_dict`).

    consumed counts batch slots the trainer took (``batch_groups`` per batch, a short batch's given-up
    slots included); drawn: fresh prompts drawn (retries are not); dropped_zero_var: groups dropped by
    dynamic sampling, per task; short_slots: slots given up when a batch's draw budget ran out;
    fallback_batches: batches trained on zero-variance groups; forced_draws: draws beyond a budget;
    infra_failed: episodes that ended for an infrastructure reason, per task (never trained); infra_retried:
    groups re-run for them; dropped_infra: groups dropped for them once their attempts ran out, per task.
    """

    started: int = 0
    accepted: int = 0
    consumed: int = 0
    dropped_stale: int = 0
    failed: int = 0
    retried: int = 0
    wait_s: float = 0.0
    group_times: list[float] = field(default_factory=list)
    drawn: int = 0
    dropped_zero_var: Counter = field(default_factory=Counter)
    short_slots: int = 0
    fallback_batches: int = 0
    forced_draws: int = 0
    infra_failed: Counter = field(default_factory=Counter)
    infra_retried: int = 0
    dropped_infra: Counter = field(default_factory=Counter)


def _stats_state(stats: ManagerStats) -> dict[str, Any]:
    """The counters of ``stats`` as plain values (Counters as dicts; ``group_times``, one float per group, left out)."""
    return {f.name: dict(v) if isinstance(v := getattr(stats, f.name), Counter) else v
            for f in fields(ManagerStats) if f.name != "group_times"}


def _stats_from_state(state: dict[str, Any], consumed: int) -> ManagerStats:
    """:class:`ManagerStats` from :func:`_stats_state` (``consumed`` as the state's own top-level count)."""
    stats = ManagerStats()
    for f in fields(ManagerStats):
        if f.name in state and f.name != "group_times":
            v = state[f.name]
            setattr(stats, f.name, Counter(v) if isinstance(getattr(stats, f.name), Counter) else v)
    stats.consumed = consumed
    return stats


class RolloutError(RuntimeError):
    """The rollout side failed (its thread died, or groups keep failing); the message says why."""


class RolloutManager:
    """Trajectory groups in flight, a bounded queue and the staleness cap (see the module doc).

    engine: the VersionPool (or one Engine) the groups sample from (``run_group_lockstep`` takes both).
    env: an EnvClient. template: the ChatTemplate.
    sampler: the :class:`PromptSampler`.
    batch_groups: groups per training step (B). staleness: eta (0 = synchronous).
    queue_size: most groups waiting + running (0 = (eta + 1) * B).
    cohort_groups: groups run in lockstep by one agent-loop call (1 = each group on its own).
    sampling: ``seed -> SamplingParams`` of a cohort. max_turns, max_total_tokens, env_timeout_s:
    passed to the agent loop. version: the trainer version at start. seed: base of the cohorts'
    sampling seeds. max_attempts: tries of a group whose agent-loop call raised.
    on_group: optional callback (FinishedGroup) on the rollout thread, e.g. reward shaping.
    total_groups: stop admitting once ``consumed + waiting + running`` reaches it (the groups the
    run will train; None = no limit). min_valid_fraction: the share of a group's samples (at least 2)
    that must end without an infrastructure failure for the group to train on them (see the module doc).
    capture_routing: the agent loop asks the engines for each turn's routed experts (MoE models).
    max_dropped_in_row: groups of one task dropped one after another (infrastructure failures) that fail the
    run (0: never).
    agent: who plays the episodes instead of the built-in agent loop: an object with ``async
    run_group(requests, params) -> trajectories`` (any number per request, each carrying its request's
    ``group_id``), ``async aclose()`` (called on the rollout thread when it stops) and ``metrics() ->
    dict`` (:meth:`agent_metrics`), e.g. :class:`rollout_sglang.gateway.AgentRunner`; None: the agent loop.

    After :meth:`get_batch`, :attr:`last_batch` describes the batch taken: ``groups`` trained,
    ``short`` (slots given up), ``fallback`` (1.0 when it trained on zero-variance groups), ``drawn``
    (fresh prompts drawn since the previous batch), ``dropped/<task>`` (zero-variance groups dropped
    since the previous batch), ``dropped_groups`` (those groups, for the step's reward means), and since the
    previous batch: ``infra_failed`` (task -> episodes), ``infra_retried`` (groups re-run), ``infra_dropped``
    (task -> groups dropped).
    """

    def __init__(self, engine: Any, env: Any, template: Any, sampler: PromptSampler, *, batch_groups: int,
                 staleness: int, queue_size: int = 0, cohort_groups: int = 1,
                 sampling: Callable[[int], SamplingParams], max_turns: int, max_total_tokens: int,
                 env_timeout_s: float = 120.0, version: int = 0, seed: int = 0, max_attempts: int = 3,
                 version_lag: int = 0, on_group: Callable[[FinishedGroup], None] | None = None,
                 total_groups: int | None = None, agent: Any = None, min_valid_fraction: float = 0.5,
                 capture_routing: bool = False, max_dropped_in_row: int = 0) -> None:
        if batch_groups < 1 or staleness < 0 or cohort_groups < 1:
            raise ValueError(f"batch_groups={batch_groups} and cohort_groups={cohort_groups} must be >= 1, "
                             f"staleness={staleness} >= 0")
        if not 0 < min_valid_fraction <= 1:
            raise ValueError(f"min_valid_fraction={min_valid_fraction} must be in (0, 1]")
        if max_dropped_in_row < 0:
            raise ValueError(f"max_dropped_in_row={max_dropped_in_row} must be >= 0 (0: no limit)")
        if not 0 <= version_lag <= staleness:
            raise ValueError(f"version_lag={version_lag} must be in 0..staleness={staleness}: turns sampled by "
                             "versions that old could never be trained")
        self.lag = int(version_lag)
        self.engine = engine
        self.env = env
        self.template = template
        self.sampler = sampler
        self.B = int(batch_groups)
        self.eta = int(staleness)
        self.queue_size = int(queue_size) if queue_size > 0 else (self.eta + 1) * self.B
        if self.queue_size < self.B:
            raise ValueError(f"queue_size={self.queue_size} must hold at least one batch ({self.B} groups)")
        self.cohort_groups = int(cohort_groups)
        self.sampling = sampling
        self.max_turns = int(max_turns)
        self.max_total_tokens = int(max_total_tokens)
        self.env_timeout_s = float(env_timeout_s)
        self.seed = int(seed)
        self.max_attempts = int(max_attempts)
        self.on_group = on_group
        self.total_groups = total_groups
        self.agent = agent
        self.min_valid_fraction = float(min_valid_fraction)
        self.capture_routing = bool(capture_routing)
        self.max_dropped_in_row = int(max_dropped_in_row)
        self._dropped_in_row: Counter = Counter()  # task -> groups dropped since its last kept group
        self.stats = ManagerStats()

        self._cond = threading.Condition()
        self._version = int(version)
        self._queue: list[FinishedGroup] = []
        self._running = 0
        self._seq = 0
        self._retry: list[tuple[GroupRequest, int]] = []  # (request, attempts so far), started first
        self._running_reqs: dict[int, GroupRequest] = {}
        self._draining = False
        self._stopping = False
        self._error: BaseException | None = None
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._wake: asyncio.Event | None = None
        self._tasks: set[asyncio.Task] = set()
        # dynamic sampling (enable_dynamic_sampling): see the module doc
        self._ds_reward: Callable[[Trajectory], float] | None = None
        self._ds_limit = 0
        self._short = 0  # slots given up and not yet consumed by a batch
        self._draws: dict[int, int] = {}  # batch index -> fresh draws charged to it
        self._forced = 0  # draws allowed beyond a batch's budget (an empty batch without a usable fallback)
        self._fallback: deque[FinishedGroup] = deque(maxlen=self.B)  # newest zero-variance groups
        self._dropped_since: list[FinishedGroup] = []
        self._drawn_at_take = 0
        self._warned_batch = -1
        self._infra_at_take = (Counter(), 0, Counter())  # stats.infra_failed, infra_retried, dropped_infra then
        self.last_infra_error = ""
        self.last_batch: dict[str, Any] = {}

    def enable_dynamic_sampling(self, reward: Callable[[Trajectory], float], max_groups: float) -> None:
        """Drop finished groups whose ``reward`` (the training reward, e.g. the run's RewardShaper) is the same
        for every trajectory, drawing at most ``int(max_groups * batch_groups)`` prompts per batch (see the
        module doc). Call before :meth:`start`."""
        if self._thread is not None:
            raise RuntimeError("enable_dynamic_sampling() must come before start()")
        if max_groups < 1:
            raise ValueError(f"max_groups={max_groups} must be >= 1 (in units of batch_groups)")
        self._ds_reward = reward
        self._ds_limit = max(self.B, int(max_groups * self.B))

    @property
    def dynamic_sampling(self) -> bool:
        """Whether dynamic sampling is on."""
        return self._ds_reward is not None

    # ------------------------------------------------------------------ state
    @property
    def version(self) -> int:
        """The trainer's weight version the manager admits against."""
        with self._cond:
            return self._version

    def depth(self) -> tuple[int, int]:
        """``(groups waiting in the queue, groups running)``."""
        with self._cond:
            return len(self._queue), self._running

    def _covered_locked(self) -> int:
        """Slots taken so far: consumed, queued, running, or given up (dropped groups hold none)."""
        return self.stats.consumed + len(self._queue) + self._short + self._running

    def _capacity_locked(self) -> int:
        covered = self._covered_locked()
        cap = (self._version + self.eta - self.lag + 1) * self.B - covered
        cap = min(cap, self.queue_size - (len(self._queue) + self._running))
        if self._draining:
            cap = min(cap, self.B - (len(self._queue) + self._running + self._short))
        if self.total_groups is not None:
            cap = min(cap, self.total_groups - covered)
        return cap

    def _exhausted_locked(self) -> bool:
        """No more groups will be admitted (``total_groups`` reached)."""
        return self.total_groups is not None and self._covered_locked() >= self.total_groups

    def _charge_draw_locked(self, pending: int) -> bool:
        """Charge a fresh draw for the next free slot (``pending`` slots of this admission round come before
        it) to its batch; False when that batch's draw budget is spent (the slot is then given up)."""
        if self._ds_reward is None:
            return True
        k = (self._covered_locked() + pending) // self.B
        drawn = self._draws.get(k, 0)
        if drawn >= self._ds_limit:
            if self._forced <= 0:
                if self._warned_batch != k:
                    self._warned_batch = k
                    logger.warning("dynamic sampling: batch %d drew its %d groups (algo.dynamic_sampling_max_groups "
                                   "x rollout.prompts_per_step) and the rest had zero reward variance; it trains on "
                                   "fewer groups", k + 1, self._ds_limit)
                self._short += 1
                self.stats.short_slots += 1
                return False
            self._forced -= 1
            self.stats.forced_draws += 1
        self._draws[k] = drawn + 1
        return True

    # ------------------------------------------------------------------ thread
    def start(self) -> None:
        """Start the rollout thread (idempotent)."""
        if self._thread is not None:
            return
        ready = threading.Event()

        def main() -> None:
            loop = asyncio.new_event_loop()
            self._loop = loop
            asyncio.set_event_loop(loop)
            self._wake = asyncio.Event()
            ready.set()
            try:
                loop.run_until_complete(self._main())
            except BaseException as e:  # noqa: BLE001 - reported to the trainer
                logger.exception("rollout thread failed")
                with self._cond:
                    self._error = e
                    self._cond.notify_all()
            finally:
                try:
                    loop.run_until_complete(loop.shutdown_asyncgens())
                finally:
                    loop.close()

        self._thread = threading.Thread(target=main, name="rollout-manager", daemon=True)
        self._thread.start()
        if not ready.wait(30):
            raise RolloutError("the rollout thread did not start within 30 s")

    def _poke(self) -> None:
        """Wake the admission loop (from any thread)."""
        loop, wake = self._loop, self._wake
        if loop is None or wake is None or loop.is_closed():
            return
        try:
            loop.call_soon_threadsafe(wake.set)
        except RuntimeError:  # loop closed meanwhile
            pass

    async def _main(self) -> None:
        assert self._wake is not None
        while True:
            with self._cond:
                if self._stopping:
                    break
                cap = self._capacity_locked()
                cohort: list[tuple[GroupRequest, int]] = []
                short = self._short
                while cap > 0 and len(cohort) < self.cohort_groups:
                    cap -= 1
                    if self._retry:
                        cohort.append(self._retry.pop(0))
                    elif self._charge_draw_locked(len(cohort)):
                        cohort.append((self.sampler.next(), 0))
                        self.stats.drawn += 1
                if self._short != short:
                    self._cond.notify_all()  # given-up slots may complete the trainer's batch
                if cohort:
                    self._running += len(cohort)
                    self.stats.started += len(cohort)
                    for req, _ in cohort:
                        self._running_reqs[req.group_id] = req
                    start_version = self._version
            if cohort:
                task = asyncio.get_running_loop().create_task(self._run_cohort(cohort, start_version))
                self._tasks.add(task)
                task.add_done_callback(self._tasks.discard)
                await asyncio.sleep(0)
                continue
            self._wake.clear()
            try:
                await asyncio.wait_for(self._wake.wait(), 0.5)
            except asyncio.TimeoutError:
                pass
        for t in list(self._tasks):
            t.cancel()
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)
        if self.agent is not None:  # before the loop's other tasks go: its server runs on this loop
            try:
                await asyncio.wait_for(self.agent.aclose(), self.env_timeout_s)
            except Exception as e:  # noqa: BLE001
                logger.warning("closing the agent runner at rollout stop: %r", e)
        others = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        for t in others:  # e.g. engine wrappers' workers
            t.cancel()
        if others:
            await asyncio.gather(*others, return_exceptions=True)
        aclose = getattr(self.env, "aclose", None)
        if callable(aclose):
            try:
                await asyncio.wait_for(aclose(), self.env_timeout_s)
            except Exception as e:  # noqa: BLE001
                logger.warning("closing env sessions at rollout stop: %r", e)

    async def _run_cohort(self, cohort: list[tuple[GroupRequest, int]], start_version: int) -> None:
        reqs = [(r.task, r.index, r.group_id) for r, _ in cohort for _ in range(r.size)]
        first = cohort[0][0].group_id
        seed = (self.seed * 1_000_003 + first * 104_729 + cohort[0][1] * 7) % (2 ** 31)
        t0 = time.monotonic()
        try:
            if self.agent is not None:
                trajs = await self.agent.run_group(reqs, self.sampling(seed))
            else:
                trajs = await run_group_lockstep(
                    self.engine, self.env, self.template, reqs, self.sampling(seed), max_turns=self.max_turns,
                    max_total_tokens=self.max_total_tokens, env_timeout_s=self.env_timeout_s,
                    capture_routing=self.capture_routing,
                )
        except asyncio.CancelledError:
            with self._cond:
                self._running -= len(cohort)
                for r, _ in cohort:
                    self._running_reqs.pop(r.group_id, None)
                self._cond.notify_all()
            raise
        except Exception as e:  # noqa: BLE001 - retried, then counted as failed
            logger.error("rollout of groups %s failed: %r", [r.group_id for r, _ in cohort], e)
            with self._cond:
                self._running -= len(cohort)
                for r, attempts in cohort:
                    self._running_reqs.pop(r.group_id, None)
                    if isinstance(e, EnginesUnavailable):  # the pool waited its whole budget for an engine already
                        self._error = RolloutError(str(e))
                    elif attempts + 1 < self.max_attempts:
                        self._retry.append((r, attempts + 1))
                        self.stats.retried += 1
                    else:
                        self.stats.failed += 1
                        self._error = RolloutError(f"group {r.group_id} ({r.task} #{r.index}) failed "
                                                   f"{self.max_attempts} times; last error: {e!r}")
                self._cond.notify_all()
            self._poke()
            return
        t1 = time.monotonic()
        by_group: dict[int, list[Trajectory]] = {}
        for t in trajs:  # an agent may return several trajectories per episode (the gateway's segments)
            by_group.setdefault(t.group_id, []).append(t)
        outcomes: list[tuple[FinishedGroup, int, str, int]] = []  # group, attempts, keep/retry/drop, infra-failed
        for r, attempts in cohort:
            g = FinishedGroup(r, by_group.get(r.group_id, []), start_version, -1, t0, t1)
            verdict, failed = self._settle_infra(g, attempts)
            if verdict == "keep" and self.on_group is not None:
                self.on_group(g)
            outcomes.append((g, attempts, verdict, failed))
        flat = {id(g): verdict == "keep" and self._zero_variance(g) for g, _, verdict, _ in outcomes}
        with self._cond:
            self._running -= len(cohort)
            for g, attempts, verdict, failed in outcomes:
                self._running_reqs.pop(g.request.group_id, None)
                self.stats.infra_failed[g.request.task] += failed
                if verdict == "retry":  # a fresh attempt at the whole group, before any new draw
                    self._retry.append((g.request, attempts + 1))
                    self.stats.retried += 1
                    self.stats.infra_retried += 1
                    continue
                task = g.request.task
                if verdict == "drop":  # never accepted: its slot is free for another draw
                    self.stats.dropped_infra[task] += 1
                    self._dropped_in_row[task] += 1
                    if 0 < self.max_dropped_in_row <= self._dropped_in_row[task] and self._error is None:
                        self._error = RolloutError(
                            f"task {task}: {self._dropped_in_row[task]} groups in a row were dropped for "
                            f"infrastructure failures (each after {self.max_attempts} attempts): its environment "
                            f"looks broken; last error: {self.last_infra_error} (the limit is "
                            "pipeline.max_dropped_groups_in_row)")
                    continue
                self._dropped_in_row[task] = 0
                if flat[id(g)]:  # no GRPO signal: never accepted, its slot is free for another draw
                    self.stats.dropped_zero_var[g.request.task] += 1
                    self._fallback.append(g)
                    self._dropped_since.append(g)
                    continue
                g.seq = self._seq
                self._seq += 1
                self._queue.append(g)
                self.stats.accepted += 1
                self.stats.group_times.append(t1 - t0)
            self._cond.notify_all()
        self._poke()

    def _settle_infra(self, g: FinishedGroup, attempts: int) -> tuple[str, int]:
        """What becomes of a finished group whose episodes may have ended for an infrastructure reason:
        ``("keep", n)`` (``g`` now holds only its valid episodes), ``("retry", n)`` or ``("drop", n)``, with
        ``n`` the episodes that failed (see the module doc)."""
        failed = [t for t in g.trajectories if t.infra_failed]
        if g.trajectories and not failed:
            return "keep", 0
        valid = [t for t in g.trajectories if not t.infra_failed]
        size = g.request.size
        need = max(min(2, size), math.ceil(self.min_valid_fraction * size))
        verdict = "keep" if len(valid) >= need else "retry" if attempts + 1 < self.max_attempts else "drop"
        if not failed:
            self.last_infra_error = "no trajectory came back for the group"
        else:
            first = failed[0]
            self.last_infra_error = f"{first.status}: {first.error}" if first.error else first.status
        logger.warning("group %d (%s #%d): %d of %d episodes ended for an infrastructure reason (%s)%s",
                       g.request.group_id, g.request.task, g.request.index, len(failed), len(g.trajectories),
                       self.last_infra_error[:300],
                       {"keep": f"; training on the {len(valid)} valid ones",
                        "retry": f"; re-running the group (attempt {attempts + 2} of {self.max_attempts})",
                        "drop": f"; dropped after {self.max_attempts} attempts"}[verdict])
        if verdict == "keep":
            g.trajectories = valid
        return verdict, len(failed)

    def _zero_variance(self, g: FinishedGroup) -> bool:
        """Dynamic sampling's test of a finished group; a reward that raises keeps the group (and says so)."""
        if self._ds_reward is None:
            return False
        try:
            return zero_variance(g, self._ds_reward)
        except Exception as e:  # noqa: BLE001 - a failing reward must not stall the rollout thread
            logger.warning("dynamic sampling: the reward of group %d (%s #%d) failed (%r); keeping the group",
                           g.request.group_id, g.request.task, g.request.index, e)
            return False

    def agent_metrics(self) -> dict[str, float]:
        """The agent runner's figures since the previous call (``gateway/...``); {} with the agent loop."""
        return self.agent.metrics() if self.agent is not None else {}

    # ------------------------------------------------------------------ trainer side
    def set_version(self, version: int) -> None:
        """The trainer finished a step and pushed weights ``version``: admit against it."""
        with self._cond:
            self._version = int(version)
            self._cond.notify_all()
        self._poke()

    def _drop_stale_locked(self) -> int:
        floor = self._version - self.eta
        keep = [g for g in self._queue if g.min_version >= floor]
        dropped = len(self._queue) - len(keep)
        if dropped:
            logger.warning("dropped %d finished group(s) older than %d versions (trainer at version %d)",
                           dropped, self.eta, self._version)
            self.stats.dropped_stale += dropped
            self._queue = keep
        return dropped

    def _check_error_locked(self) -> None:
        if self._error is not None:
            raise RolloutError(f"rollout failed: {self._error!r}") from self._error
        if self._thread is not None and not self._thread.is_alive() and not self._stopping:
            raise RolloutError("the rollout thread ended unexpectedly (see the log above)")

    def _take_locked(self) -> list[FinishedGroup] | None:
        """The next batch when it is complete (``batch_groups`` queued, or fewer plus given-up slots), else None.

        A batch whose slots were all given up takes the newest zero-variance groups within the staleness
        cap; when there is none, one slot is reopened for a draw beyond the budget and None is returned.
        """
        q, short_used, fallback = len(self._queue), 0, False
        if q >= self.B:
            n = self.B
        elif q + self._short >= self.B:
            n, short_used = q, self.B - q
        else:
            return None
        self._queue.sort(key=lambda g: (g.min_version, g.seq))
        batch, self._queue = self._queue[:n], self._queue[n:]
        if not batch:
            floor = self._version - self.eta
            usable = [g for g in self._fallback if g.min_version >= floor][-self.B:]
            if not usable:
                # a group still running will either fill the batch or stand in; with none, reopen one slot
                if self._running == 0 and self._forced == 0:
                    self._short -= 1
                    self._forced += 1
                    logger.warning("dynamic sampling: no group for batch %d and no zero-variance group fresh enough "
                                   "to stand in; drawing one group beyond the budget",
                                   self.stats.consumed // self.B + 1)
                    self._poke()
                return None
            ids = {id(g) for g in usable}
            self._fallback = deque((g for g in self._fallback if id(g) not in ids), maxlen=self.B)
            batch, fallback = usable, True
            self.stats.fallback_batches += 1
            logger.warning("dynamic sampling: every group drawn for batch %d had zero reward variance; training on "
                           "%d of them (advantage 0: the step carries no policy-gradient signal)",
                           self.stats.consumed // self.B + 1, len(batch))
        self._short -= short_used
        self._forced = 0
        self.stats.consumed += self.B
        first = self.stats.consumed // self.B - 1
        self._draws = {k: v for k, v in self._draws.items() if k > first}
        dropped = Counter(g.request.task for g in self._dropped_since)
        self.last_batch = {"groups": len(batch), "short": self.B - len(batch) if not fallback else self.B,
                           "fallback": float(fallback), "drawn": self.stats.drawn - self._drawn_at_take,
                           "dropped": dict(dropped), "dropped_groups": self._dropped_since}
        self._dropped_since, self._drawn_at_take = [], self.stats.drawn
        failed0, retried0, dropped0 = self._infra_at_take
        self.last_batch.update({"infra_failed": dict(self.stats.infra_failed - failed0),
                                "infra_retried": self.stats.infra_retried - retried0,
                                "infra_dropped": dict(self.stats.dropped_infra - dropped0)})
        self._infra_at_take = (Counter(self.stats.infra_failed), self.stats.infra_retried,
                               Counter(self.stats.dropped_infra))
        return batch

    def get_batch(self, timeout_s: float, waited_s: float = 0.0) -> list[FinishedGroup]:
        """Block until ``batch_groups`` trainable groups are queued; take them (oldest version first).

        Groups too stale for the current version are dropped first. With dynamic sampling a batch
        whose draw budget ran out comes with fewer groups (see the module doc). Raises TimeoutError
        after ``timeout_s`` seconds (its message counts ``waited_s`` the caller waited before), RolloutError
        when the rollout side failed.
        """
        t0 = time.monotonic()
        deadline = t0 + timeout_s
        with self._cond:
            while True:
                self._check_error_locked()
                if self._drop_stale_locked():
                    self._poke()
                taken = self._take_locked()
                if taken is not None:
                    batch = taken
                    self.stats.wait_s += time.monotonic() - t0
                    break
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(
                        f"no batch of {self.B} groups within {waited_s + timeout_s:.0f}s (queued {len(self._queue)}, "
                        f"running {self._running}, given up {self._short}, version {self._version}; episodes ended by "
                        f"infrastructure failures so far: {sum(self.stats.infra_failed.values())}"
                        + (f", the last: {self.last_infra_error[:300]}" if self.last_infra_error else "")
                        + "); raise pipeline.batch_timeout_s or check the environments and engines")
                self._cond.wait(min(left, 1.0))
        self._poke()
        return batch

    def drain(self, timeout_s: float) -> None:
        """Stop admitting once the next batch is covered and wait until no group runs.

        Afterwards the queue holds at least ``batch_groups`` groups (the next batch; fewer only when
        ``total_groups`` is reached, or with given-up slots under dynamic sampling) and nothing is in
        flight, so :meth:`state_dict` is complete.
        Admission resumes with :meth:`release`.
        """
        deadline = time.monotonic() + timeout_s
        with self._cond:
            self._draining = True
        self._poke()
        with self._cond:
            while True:
                self._check_error_locked()
                self._drop_stale_locked()
                if self._running == 0 and (len(self._queue) + self._short >= self.B or self._exhausted_locked()):
                    return
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"the rollout did not drain within {timeout_s:.0f}s (queued {len(self._queue)}, "
                                       f"running {self._running}); raise pipeline.batch_timeout_s")
                self._cond.wait(min(left, 0.5))
                self._poke()

    def release(self) -> None:
        """End a :meth:`drain`: admission continues."""
        with self._cond:
            self._draining = False
        self._poke()

    def state_dict(self) -> dict[str, Any]:
        """Sampler state, queued groups (with trajectories), requests to restart, counters (``stats``, so that a
        resumed run's totals cover the whole run; ``group_times`` excepted), version.

        Call after :meth:`drain` (nothing running) for an exact resume; otherwise running groups
        are recorded as requests and restarted (re-sampled) after a resume.
        """
        with self._cond:
            restart = [(r, a) for r, a in self._retry] + [(r, 0) for r in self._running_reqs.values()]
            return {
                "sampler": self.sampler.state_dict(),
                "queue": copy.deepcopy(self._queue),
                "restart": copy.deepcopy(restart),
                "consumed": self.stats.consumed,
                "seq": self._seq,
                "version": self._version,
                "short": self._short,
                "draws": dict(self._draws),
                "forced": self._forced,
                "fallback": copy.deepcopy(list(self._fallback)),
                "stats": _stats_state(self.stats),
                # what the next batch's per-step counts (last_batch) are taken against: the counters at the last take
                "at_take": {"drawn": self._drawn_at_take, "infra_failed": dict(self._infra_at_take[0]),
                            "infra_retried": self._infra_at_take[1], "dropped_infra": dict(self._infra_at_take[2])},
                "dropped_since": copy.deepcopy(self._dropped_since),
            }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` (before :meth:`start`); ``total_groups`` stays as constructed."""
        if self._thread is not None:
            raise RuntimeError("load_state_dict() must come before start()")
        self.sampler.load_state_dict(state["sampler"])
        self._queue = list(state["queue"])
        self._retry = [(r, int(a)) for r, a in state["restart"]]
        self.stats.consumed = int(state["consumed"])
        self._seq = int(state["seq"])
        self._version = int(state["version"])
        self._short = int(state.get("short", 0))
        self._draws = {int(k): int(v) for k, v in state.get("draws", {}).items()}
        self._forced = int(state.get("forced", 0))
        self._fallback = deque(state.get("fallback", []), maxlen=self.B)
        if "stats" in state:  # checkpoints written before the counters were saved resume with them at zero
            self.stats = _stats_from_state(state["stats"], consumed=self.stats.consumed)
            t = state["at_take"]
            self._drawn_at_take = int(t["drawn"])
            self._infra_at_take = (Counter(t["infra_failed"]), int(t["infra_retried"]), Counter(t["dropped_infra"]))
            self._dropped_since = list(state.get("dropped_since", []))

    def submit(self, coro: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        """Run ``coro`` on the rollout thread's event loop, beside the groups in flight (e.g. an evaluation:
        the engines' batching wrappers serve one event loop at a time); returns its future. :meth:`stop`
        cancels it when it still runs. RolloutError when the rollout thread does not run."""
        loop = self._loop
        if loop is None or loop.is_closed() or self._thread is None or not self._thread.is_alive() or self._stopping:
            coro.close()
            raise RolloutError("the rollout thread is not running")
        return asyncio.run_coroutine_threadsafe(coro, loop)

    def stop(self, timeout_s: float = 60.0) -> None:
        """Cancel running groups (their env sessions are cancelled) and end the thread."""
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        self._poke()
        if self._thread is not None:
            self._thread.join(timeout_s)
            if self._thread.is_alive():
                logger.error("the rollout thread did not stop within %.0fs; leaving it (daemon)", timeout_s)
