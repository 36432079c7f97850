"""The rollout side of both pipelines: trajectory groups in flight, a bounded queue, a staleness cap.

:class:`RolloutManager` runs on the rollout rank in a thread of its own with its own asyncio
event loop. It starts GRPO groups (``samples_per_prompt`` episodes of one task sample, drawn by
a :class:`PromptSampler`) through the agent loop (``run_group_lockstep``) against an engine or a
version pool and an env client, and puts each finished group on a queue. The trainer (another
thread) takes a batch of ``batch_groups`` groups with :meth:`RolloutManager.get_batch` and, after
each optimizer step and weight push, calls :meth:`RolloutManager.set_version`.

The manager orchestrates three policies, each in its own module with its own options (nested in
:class:`RolloutOptions`): admission (:mod:`~rollout_sglang.rollout.admission`: when a group may start, with
trainer version ``v``, ``staleness`` and ``batch_groups``, ``(v + staleness - lag + 1) * batch_groups`` slots are
open; ``staleness = 0`` is the synchronous schedule), infrastructure retries (:mod:`~rollout_sglang.rollout.retries`:
groups whose episodes the env or our code failed are trained on their valid episodes, re-run or dropped; a task
whose groups keep being dropped fails the run, :class:`RolloutError`) and dynamic sampling
(:mod:`~rollout_sglang.rollout.dynamic_sampling`, DAPO: groups whose training rewards are all equal are dropped and
more are drawn, within a budget per batch).

Staleness guarantee: the batch for the step that trains version ``v`` takes the queued groups
with the oldest weight version first, and a group whose oldest token was sampled by a version
older than ``v - staleness`` is never trained (it is dropped and counted in ``dropped_stale``; the
admission rule keeps that rare). So no trained token is more than ``staleness`` versions old.

Partial rollout: a weight update pauses generation of its version slot between turns (see
:class:`~rollout_sglang.engines.version_pool.VersionPool`); in-flight episodes are kept and continue on
the new weights, their turns recording the version that sampled them.

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
import dataclasses
import logging
import threading
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass, field
from typing import Any, TypeVar

from env_controller.options import Options
from rollout_sglang.agent_loop import run_group_lockstep
from rollout_sglang.engines.protocol import EnginesUnavailable, SamplingParams
from rollout_sglang.episode_options import EpisodeOptions
from rollout_sglang.rollout.admission import Admission, AdmissionOptions, Slots
from rollout_sglang.rollout.dynamic_sampling import DynamicSampling, DynamicSamplingOptions, zero_variance
from rollout_sglang.rollout.groups import FinishedGroup, GroupRequest, PromptSampler
from rollout_sglang.rollout.retries import DropLimitOptions, InfraRetries, RetryOptions
from rollout_sglang.rollout.stats import ManagerStats, stats_from_state, stats_state
from rollout_sglang.trajectory import Trajectory

__all__ = ["AdmissionOptions", "DropLimitOptions", "DynamicSamplingOptions", "FinishedGroup", "GroupRequest",
           "ManagerStats", "PromptSampler", "RetryOptions", "RolloutError", "RolloutManager", "RolloutOptions",
           "zero_variance"]

logger = logging.getLogger(__name__)

T = TypeVar("T")


class RolloutError(RuntimeError):
    """The rollout side failed (its thread died, or groups keep failing); the message says why."""


@dataclass
class RolloutOptions(Options):
    """Everything the rollout manager is told, by concern."""

    #: when a new group may start: batch size, staleness, queue bound, cohorts, cross-policy lag, the run's groups
    admission: AdmissionOptions
    #: how each episode is played: its limits, the environment's time limit, routing capture (MoE)
    episode: EpisodeOptions = field(default_factory=EpisodeOptions)
    #: the sampling settings of every turn; each cohort's seed (from ``seed``) replaces theirs
    sampling: SamplingParams = field(default_factory=SamplingParams)
    #: groups with infrastructure failures: the share of valid episodes a group needs, its attempts
    retry: RetryOptions = field(default_factory=RetryOptions)
    #: dynamic sampling's draw budget per batch (dynamic sampling is on when the manager is given a reward)
    dynamic_sampling: DynamicSamplingOptions = field(default_factory=DynamicSamplingOptions)
    #: groups of one task dropped one after another (infrastructure failures) that fail the run
    drop_limit: DropLimitOptions = field(default_factory=DropLimitOptions)
    #: base of the cohorts' sampling seeds
    seed: int = 0


class RolloutManager:
    """Trajectory groups in flight, a bounded queue and the staleness cap (see the module doc).

    engine: the VersionPool (or one Engine) the groups sample from (``run_group_lockstep`` takes both).
    env: an EnvClient. template: the ChatTemplate. sampler: the :class:`PromptSampler`.
    options: the :class:`RolloutOptions`.
    agent: who plays the episodes instead of the built-in agent loop: an object with ``async
    run_group(requests, params) -> trajectories`` (any number per request, each carrying its request's
    ``group_id``), ``async aclose()`` (called on the rollout thread when it stops) and ``metrics() ->
    dict`` (:meth:`agent_metrics`), e.g. :class:`rollout_sglang.gateway.AgentRunner`; None: the agent loop.
    on_group: optional callback (FinishedGroup) on the rollout thread for each kept group, e.g. reward shaping.
    reward: the training reward (e.g. the run's RewardShaper) by which dynamic sampling drops groups whose
    trajectories all score the same; None: dynamic sampling off.
    score: a step on every cohort's episodes before their groups are settled, e.g. the teachers of on-policy
    distillation (:class:`rollout_sglang.distill.scorer.TeacherScorer`): ``async score(trajectories)``, which may
    mark episodes as infrastructure failures; None: none.

    The trainer version starts at 0; :meth:`set_version` (or :meth:`load_state_dict`) sets another before
    :meth:`start`.

    After :meth:`get_batch`, :attr:`last_batch` describes the batch taken: ``groups`` trained,
    ``short`` (slots given up), ``fallback`` (1.0 when it trained on zero-variance groups), ``drawn``
    (fresh prompts drawn since the previous batch), ``dropped/<task>`` (zero-variance groups dropped
    since the previous batch), ``dropped_groups`` (those groups, for the step's reward means), and since the
    previous batch: ``infra_failed`` (task -> episodes), ``infra_retried`` (groups re-run), ``infra_dropped``
    (task -> groups dropped).
    """

    def __init__(self, engine: Any, env: Any, template: Any, sampler: PromptSampler, options: RolloutOptions, *,
                 agent: Any = None, on_group: Callable[[FinishedGroup], None] | None = None,
                 reward: Callable[[Trajectory], float] | None = None,
                 score: Callable[[list[Trajectory]], Awaitable[None]] | None = None) -> None:
        self.engine = engine
        self.env = env
        self.template = template
        self.sampler = sampler
        self.options = options
        self.agent = agent
        self.on_group = on_group
        self.score = score
        self._admission = Admission(options.admission)
        self._retries = InfraRetries(options.retry, options.drop_limit)
        self.batch_groups = options.admission.batch_groups
        self.staleness = options.admission.staleness
        self._sampling = DynamicSampling(options.dynamic_sampling, self.batch_groups, reward)
        self.stats = ManagerStats()

        self._cond = threading.Condition()
        self._version = 0
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
        self.last_batch: dict[str, Any] = {}

    @property
    def dynamic_sampling(self) -> bool:
        """Whether dynamic sampling is on."""
        return self._sampling.enabled

    @property
    def capture_routing(self) -> bool:
        """Whether the episodes carry the engines' routed experts."""
        return self.options.episode.capture_routing

    @property
    def total_groups(self) -> int | None:
        """The groups the run will train (None: no limit)."""
        return self.options.admission.total_groups

    @property
    def last_infra_error(self) -> str:
        """The last infrastructure error of a finished group ("" while none)."""
        return self._retries.last_error

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

    def _slots_locked(self) -> Slots:
        return Slots(self.stats.consumed, len(self._queue), self._running, self._sampling.short)

    def _capacity_locked(self) -> int:
        return self._admission.capacity(self._slots_locked(), self._version, self._draining)

    def _exhausted_locked(self) -> bool:
        """No more groups will be admitted (``total_groups`` reached)."""
        return self._admission.exhausted(self._slots_locked())

    def _charge_draw_locked(self, pending: int) -> bool:
        """Charge a fresh draw for the next free slot (``pending`` slots of this admission round come before
        it) to its batch; False when that batch's draw budget is spent (the slot is then given up)."""
        batch = (self._slots_locked().covered + pending) // self.batch_groups
        return self._sampling.charge_draw(batch, self.stats)

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
                short = self._sampling.short
                while cap > 0 and len(cohort) < self.options.admission.cohort_groups:
                    cap -= 1
                    if self._retry:
                        cohort.append(self._retry.pop(0))
                    elif self._charge_draw_locked(len(cohort)):
                        cohort.append((self.sampler.next(), 0))
                        self.stats.drawn += 1
                if self._sampling.short != short:
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
        await self._shutdown()

    async def _shutdown(self) -> None:
        """Cancel the groups in flight, close the agent runner, the loop's other tasks and the env sessions."""
        timeout_s = self.options.episode.env_timeout_s
        for t in list(self._tasks):
            t.cancel()
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)
        if self.agent is not None:  # before the loop's other tasks go: its server runs on this loop
            try:
                await asyncio.wait_for(self.agent.aclose(), timeout_s)
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
                await asyncio.wait_for(aclose(), timeout_s)
            except Exception as e:  # noqa: BLE001
                logger.warning("closing env sessions at rollout stop: %r", e)

    async def _play(self, cohort: list[tuple[GroupRequest, int]]) -> list[Trajectory]:
        """The cohort's episodes, played by the agent or the agent loop with the cohort's sampling seed."""
        reqs = [(r.task, r.index, r.group_id) for r, _ in cohort for _ in range(r.size)]
        first = cohort[0][0].group_id
        seed = (self.options.seed * 1_000_003 + first * 104_729 + cohort[0][1] * 7) % (2 ** 31)
        params = dataclasses.replace(self.options.sampling, seed=seed)
        if self.agent is not None:
            return await self.agent.run_group(reqs, params)
        return await run_group_lockstep(self.engine, self.env, self.template, reqs, params, self.options.episode)

    async def _run_cohort(self, cohort: list[tuple[GroupRequest, int]], start_version: int) -> None:
        t0 = time.monotonic()
        try:
            trajs = await self._play(cohort)
            if self.score is not None:
                await self.score(trajs)
        except asyncio.CancelledError:
            with self._cond:
                self._running -= len(cohort)
                for r, _ in cohort:
                    self._running_reqs.pop(r.group_id, None)
                self._cond.notify_all()
            raise
        except Exception as e:  # noqa: BLE001 - retried, then counted as failed
            logger.error("rollout of groups %s failed: %r", [r.group_id for r, _ in cohort], e)
            self._raised(cohort, e)
            return
        t1 = time.monotonic()
        by_group: dict[int, list[Trajectory]] = {}
        for t in trajs:  # an agent may return several trajectories per episode (the gateway's segments)
            by_group.setdefault(t.group_id, []).append(t)
        outcomes: list[tuple[FinishedGroup, int, str, int]] = []  # group, attempts, keep/retry/drop, infra-failed
        for r, attempts in cohort:
            g = FinishedGroup(r, by_group.get(r.group_id, []), start_version, -1, t0, t1)
            verdict, failed = self._retries.settle(g, attempts)
            if verdict == "keep" and self.on_group is not None:
                self.on_group(g)
            outcomes.append((g, attempts, verdict, failed))
        flat = {id(g): verdict == "keep" and self._sampling.is_flat(g) for g, _, verdict, _ in outcomes}
        with self._cond:
            self._running -= len(cohort)
            for g, attempts, verdict, failed in outcomes:
                self._finished_locked(g, attempts, verdict, failed, flat[id(g)], t1 - t0)
            self._cond.notify_all()
        self._poke()

    def _raised(self, cohort: list[tuple[GroupRequest, int]], e: Exception) -> None:
        """The cohort's agent-loop call raised: re-run its groups while they have attempts left, else fail."""
        with self._cond:
            self._running -= len(cohort)
            for r, attempts in cohort:
                self._running_reqs.pop(r.group_id, None)
                if isinstance(e, EnginesUnavailable):  # the pool waited its whole budget for an engine already
                    self._error = RolloutError(str(e))
                elif self._retries.may_retry(attempts):
                    self._retry.append((r, attempts + 1))
                    self.stats.retried += 1
                else:
                    self.stats.failed += 1
                    self._error = RolloutError(f"group {r.group_id} ({r.task} #{r.index}) failed "
                                               f"{self._retries.max_attempts} times; last error: {e!r}")
            self._cond.notify_all()
        self._poke()

    def _finished_locked(self, g: FinishedGroup, attempts: int, verdict: str, failed: int, flat: bool,
                         seconds: float) -> None:
        """Book a finished group by its verdict: re-run, dropped (infrastructure or zero variance) or queued."""
        self._running_reqs.pop(g.request.group_id, None)
        task = g.request.task
        self.stats.infra_failed[task] += failed
        if verdict == "retry":  # a fresh attempt at the whole group, before any new draw
            self._retry.append((g.request, attempts + 1))
            self.stats.retried += 1
            self.stats.infra_retried += 1
            return
        if verdict == "drop":  # never accepted: its slot is free for another draw
            self.stats.dropped_infra[task] += 1
            reason = self._retries.dropped(task)
            if reason is not None and self._error is None:
                self._error = RolloutError(reason)
            return
        self._retries.kept(task)
        if flat:  # no GRPO signal: never accepted, its slot is free for another draw
            self._sampling.drop(g, self.stats)
            return
        g.seq = self._seq
        self._seq += 1
        self._queue.append(g)
        self.stats.accepted += 1
        self.stats.group_times.append(seconds)

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
        floor = self._admission.oldest_trainable(self._version)
        keep = [g for g in self._queue if g.min_version >= floor]
        dropped = len(self._queue) - len(keep)
        if dropped:
            logger.warning("dropped %d finished group(s) older than %d versions (trainer at version %d)",
                           dropped, self.staleness, self._version)
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
        sampling = self._sampling
        queued, short_used, fallback = len(self._queue), 0, False
        if queued >= self.batch_groups:
            size = self.batch_groups
        elif queued + sampling.short >= self.batch_groups:
            size, short_used = queued, self.batch_groups - queued
        else:
            return None
        self._queue.sort(key=lambda g: (g.min_version, g.seq))
        batch, self._queue = self._queue[:size], self._queue[size:]
        if not batch:
            batch = sampling.stand_in(self._admission.oldest_trainable(self._version))
            if not batch:
                # a group still running will either fill the batch or stand in; with none, reopen one slot
                if self._running == 0 and sampling.reopen_slot():
                    logger.warning("dynamic sampling: no group for batch %d and no zero-variance group fresh enough "
                                   "to stand in; drawing one group beyond the budget",
                                   self.stats.consumed // self.batch_groups + 1)
                    self._poke()
                return None
            fallback = True
            self.stats.fallback_batches += 1
            logger.warning("dynamic sampling: every group drawn for batch %d had zero reward variance; training on "
                           "%d of them (advantage 0: the step carries no policy-gradient signal)",
                           self.stats.consumed // self.batch_groups + 1, len(batch))
        self.stats.consumed += self.batch_groups
        sampling.taken(short_used, self.stats.consumed // self.batch_groups)
        short = self.batch_groups if fallback else self.batch_groups - len(batch)
        self.last_batch = {"groups": len(batch), "short": short, "fallback": float(fallback),
                           **sampling.since_take(self.stats), **self._retries.since_take(self.stats)}
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
                        f"no batch of {self.batch_groups} groups within {waited_s + timeout_s:.0f}s "
                        f"(queued {len(self._queue)}, running {self._running}, given up {self._sampling.short}, "
                        f"version {self._version}; "
                        f"episodes ended by infrastructure failures so far: {sum(self.stats.infra_failed.values())}"
                        + (f", the last: {self._retries.last_error[:300]}" if self._retries.last_error else "")
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
                covered = len(self._queue) + self._sampling.short >= self.batch_groups
                if self._running == 0 and (covered or self._exhausted_locked()):
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
            failed, retried, dropped = self._retries.at_take
            return {
                "sampler": self.sampler.state_dict(),
                "queue": copy.deepcopy(self._queue),
                "restart": copy.deepcopy(restart),
                "consumed": self.stats.consumed,
                "seq": self._seq,
                "version": self._version,
                **self._sampling.state_dict(),
                "stats": stats_state(self.stats),
                # what the next batch's per-step counts (last_batch) are taken against: the counters at the last take
                "at_take": {"drawn": self._sampling.drawn_at_take, "infra_failed": dict(failed),
                            "infra_retried": retried, "dropped_infra": dict(dropped)},
                "dropped_since": copy.deepcopy(self._sampling.dropped_since),
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
        self._sampling.load_state_dict(state)
        if "stats" in state:  # a checkpoint without the counters resumes with them at zero
            self.stats = stats_from_state(state["stats"], consumed=self.stats.consumed)
            t = state["at_take"]
            self._sampling.drawn_at_take = int(t["drawn"])
            self._retries.at_take = (Counter(t["infra_failed"]), int(t["infra_retried"]), Counter(t["dropped_infra"]))
            self._sampling.dropped_since = list(state.get("dropped_since", []))

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
