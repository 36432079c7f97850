"""The version pool: N engine slots holding the latest N weight versions, and the cross-policy router.

* **Slots.** Slot ``i`` is a list of engines that always serve the same weight version. A weight
  sync updates one slot, the oldest (:meth:`VersionPool.oldest_slot`: a failed slot first, then the
  lowest version, then the lowest index), so after N syncs the pool holds the latest N versions
  (``rollout.max_versions`` = N, ``rollout.engines_per_slot`` engines each).
* **Updating a slot.** :meth:`VersionPool.begin_update` stops routing to the slot, waits until its
  in-flight generations finished (``drain_timeout_s``), pauses only that slot's engines and opens
  their weight update; the other slots keep generating. :meth:`VersionPool.end_update` closes the
  update (each engine stamps the new version, SGLang engines flush their prefix cache) and
  resumes the slot; :meth:`VersionPool.abort_update` marks the slot failed (never sampled until a
  later sync succeeds) and resumes it.
* **Cross-policy sampling.** Per request (per turn of a trajectory) :meth:`VersionPool.route`
  draws a slot by ``policy``, from a seeded generator: ``"latest"`` (on-policy: only slots that
  hold the newest version), ``"uniform"`` (every live version equally likely), ``"recency"``
  (the k-th newest live version with weight ``recency_decay ** k``). Slots that hold the chosen
  version share its requests by load.
* **Router.** Within a slot, a request goes to the engine with the fewest requests in flight,
  except that a trajectory's consecutive turns (same ``key``) stay on the engine that served its
  previous turn when that engine is in the chosen slot and live, so its prefix cache is reused.

Thread-safety: routing, leases and updates are guarded by one lock; :meth:`begin_update` blocks
(waiting for the drain), so call it from outside the rollout's event loop, or when nothing runs.
"""
from __future__ import annotations

import dataclasses
import logging
import random
import threading
import time
from collections import OrderedDict
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field
from typing import Any

from rollout_sglang.engines.protocol import Engine, GenerationOutput, SamplingParams

logger = logging.getLogger(__name__)

POLICIES = ("latest", "uniform", "recency")


@dataclass
class Slot:
    """One version slot: its engines (global indices ``engine_ids``), version and state."""

    index: int
    engines: list[Any]
    engine_ids: list[int]
    version: int
    updating: bool = False
    failed: bool = False
    pending_version: int | None = None
    updated_at: float = field(default_factory=time.monotonic)

    @property
    def live(self) -> bool:
        """Whether requests may be routed here."""
        return not self.updating and not self.failed


class VersionPool:
    """N slots of engines, a cross-policy slot choice and a prefix-affine router.

    slots: the engines of each slot (every slot non-empty; the engines of a slot must report the
        same ``version``).
    policy: "latest" | "uniform" | "recency" (see module doc).
    recency_decay: weight ratio between consecutive versions under "recency", in (0, 1].
    seed: seeds the slot choice (and the router's tie-breaks), so runs are reproducible.
    drain_timeout_s: how long :meth:`begin_update` waits for the slot's in-flight requests.
    max_affinity_keys: how many trajectory -> engine entries the router remembers (LRU).
    live_timeout_s: how long :meth:`generate` waits for a live slot when none is (None: ``drain_timeout_s``).
    """

    def __init__(self, slots: Sequence[Sequence[Engine]], *, policy: str = "latest", recency_decay: float = 0.5,
                 seed: int = 0, drain_timeout_s: float = 600.0, max_affinity_keys: int = 100_000,
                 live_timeout_s: float | None = None) -> None:
        if policy not in POLICIES:
            raise ValueError(f"cross_policy={policy!r} is not one of {POLICIES}")
        if not 0 < recency_decay <= 1:
            raise ValueError(f"recency_decay={recency_decay!r} must be in (0, 1]")
        if not slots or any(len(s) == 0 for s in slots):
            raise ValueError("a version pool needs at least one slot and at least one engine per slot")
        self.policy = policy
        self.recency_decay = float(recency_decay)
        self.drain_timeout_s = float(drain_timeout_s)
        self.live_timeout_s = self.drain_timeout_s if live_timeout_s is None else float(live_timeout_s)
        if not self.live_timeout_s >= 0:
            raise ValueError(f"live_timeout_s={live_timeout_s!r} must be >= 0 seconds")
        self._rng = random.Random(seed)
        self._lock = threading.Condition()
        self.engines: list[Any] = []
        self.slots: list[Slot] = []
        for i, engines in enumerate(slots):
            versions = {int(e.version) for e in engines}
            if len(versions) != 1:
                raise ValueError(f"slot {i}: its engines serve different versions {sorted(versions)}; "
                                 "load the same weights into every engine of a slot")
            ids = list(range(len(self.engines), len(self.engines) + len(engines)))
            self.engines.extend(engines)
            self.slots.append(Slot(i, list(engines), ids, versions.pop()))
        self._slot_of = {eid: s for s in self.slots for eid in s.engine_ids}
        self._inflight = [0] * len(self.engines)
        self._assigned = [0] * len(self.engines)
        self._affinity: OrderedDict[Hashable, int] = OrderedDict()
        self._max_affinity = int(max_affinity_keys)
        self.stats = {"routed": 0, "affinity_hits": 0}

    @classmethod
    def from_engines(cls, engines: Sequence[Engine], max_versions: int, engines_per_slot: int,
                     **kwargs: Any) -> "VersionPool":
        """Split ``engines`` (``max_versions * engines_per_slot`` of them) into slots, in order."""
        if len(engines) != max_versions * engines_per_slot:
            raise ValueError(f"{len(engines)} engines cannot fill rollout.max_versions={max_versions} slots of "
                             f"rollout.engines_per_slot={engines_per_slot}; give {max_versions * engines_per_slot}")
        return cls([list(engines[i * engines_per_slot:(i + 1) * engines_per_slot]) for i in range(max_versions)],
                   **kwargs)

    # ------------------------------------------------------------------ state
    @property
    def versions(self) -> list[int]:
        """Version of each slot (in slot order)."""
        return [s.version for s in self.slots]

    @property
    def latest_version(self) -> int:
        """The newest version a live slot serves (-1 when none is live)."""
        live = [s.version for s in self.slots if s.live]
        return max(live) if live else -1

    def slot_states(self) -> str:
        """Each slot's index, version and state, for messages (e.g. "slot 0: v3 live, slot 1: v2 updating")."""
        return ", ".join(f"slot {s.index}: v{s.version} {'live' if s.live else 'failed' if s.failed else 'updating'}"
                         for s in self.slots)

    def newest_live_slot(self) -> Slot:
        """The live slot with the newest version; RuntimeError naming the slot states when none is live
        (an updating or failed slot may hold partly loaded weights)."""
        live = [s for s in self.slots if s.live]
        if not live:
            raise RuntimeError(f"no live engine slot in the version pool ({self.slot_states()}); a weight sync "
                               "failed or is still running; see the weight-sync errors in the trainer log")
        return max(live, key=lambda s: s.version)

    def slot_of_engine(self, engine_id: int) -> Slot:
        """The slot that holds global engine ``engine_id``."""
        return self._slot_of[engine_id]

    def inflight(self) -> list[int]:
        """Requests in flight per engine (global order)."""
        with self._lock:
            return list(self._inflight)

    # ------------------------------------------------------------ slot choice
    def _weights(self, live: list[Slot]) -> dict[int, float]:
        """Policy weight of each live version."""
        versions = sorted({s.version for s in live}, reverse=True)
        if self.policy == "latest":
            return {versions[0]: 1.0}
        if self.policy == "uniform":
            return {v: 1.0 for v in versions}
        return {v: self.recency_decay ** k for k, v in enumerate(versions)}

    def _choose_locked(self) -> Slot:
        """Draw a live slot by the policy (seeded); RuntimeError when every slot is updating or failed."""
        live = [s for s in self.slots if s.live]
        if not live:
            raise RuntimeError("no live slot in the version pool: every slot is updating or failed a sync")
        weights = self._weights(live)
        versions = list(weights)
        v = versions[0]
        if len(versions) > 1:
            v = self._rng.choices(versions, weights=[weights[x] for x in versions])[0]
        candidates = [s for s in live if s.version == v]
        if len(candidates) == 1:
            return candidates[0]
        # several slots hold that version (e.g. before the pool filled up): the least loaded one
        return min(candidates, key=lambda s: (sum(self._inflight[e] for e in s.engine_ids) / len(s.engine_ids),
                                              self._rng.random()))

    # ----------------------------------------------------------------- router
    def route(self, keys: Sequence[Hashable | None]) -> list[int]:
        """Choose a slot (by policy) and an engine for each request; returns global engine ids.

        keys: one per request; requests with the same key (the turns of one trajectory) stick to
        the engine of their previous turn when it is in the chosen slot. Each returned engine
        holds a lease (counted in flight) until :meth:`release`. RuntimeError when no slot is live
        (:meth:`route_wait` waits instead).
        """
        with self._lock:
            return self._route_locked(keys)

    async def route_wait(self, keys: Sequence[Hashable | None], timeout_s: float | None = None) -> list[int]:
        """:meth:`route`, but while no slot is live wait for one (polling, without blocking the event
        loop) at most ``timeout_s`` (None: ``live_timeout_s``); TimeoutError naming the slots after it."""
        import asyncio

        t = self.live_timeout_s if timeout_s is None else float(timeout_s)
        deadline = time.monotonic() + t
        delay = 0.002
        while True:
            with self._lock:
                if any(s.live for s in self.slots):
                    return self._route_locked(keys)
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(
                        f"no live slot in the version pool for {t:.1f}s ({self.slot_states()}): an update did not "
                        "finish or every slot failed its sync; raise rollout.engine_timeout_s for slow syncs, or "
                        "check the weight-sync errors in the trainer log")
            await asyncio.sleep(min(delay, max(left, 0.0)))
            delay = min(delay * 2, 0.05)

    def _route_locked(self, keys: Sequence[Hashable | None]) -> list[int]:
        out = []
        for key in keys:
            slot = self._choose_locked()
            eid = None
            if key is not None:
                prev = self._affinity.get(key)
                if prev is not None and prev in slot.engine_ids:
                    eid = prev
                    self.stats["affinity_hits"] += 1
            if eid is None:
                eid = min(slot.engine_ids, key=lambda e: (self._inflight[e], self._assigned[e]))
            if key is not None:
                self._affinity[key] = eid
                self._affinity.move_to_end(key)
                while len(self._affinity) > self._max_affinity:
                    self._affinity.popitem(last=False)
            self._inflight[eid] += 1
            self._assigned[eid] += 1
            self.stats["routed"] += 1
            out.append(eid)
        return out

    def release(self, engine_id: int, n: int = 1) -> None:
        """Return ``n`` leases of ``engine_id`` (wakes a waiting :meth:`begin_update`)."""
        with self._lock:
            self._inflight[engine_id] -= n
            if self._inflight[engine_id] < 0:
                raise RuntimeError(f"engine {engine_id}: more leases released than taken")
            self._lock.notify_all()

    def forget(self, keys: Sequence[Hashable]) -> None:
        """Drop the router's memory of these trajectories (they ended)."""
        with self._lock:
            for k in keys:
                self._affinity.pop(k, None)

    async def generate_on(self, engine_id: int, prompts: list[list[int]],
                          params: SamplingParams) -> list[GenerationOutput]:
        """``generate`` on engine ``engine_id``, then release the ``len(prompts)`` leases :meth:`route` took."""
        try:
            return await self.engines[engine_id].generate(prompts, params)
        finally:
            self.release(engine_id, len(prompts))

    async def generate(self, prompts: list[list[int]], params: SamplingParams,
                       keys: Sequence[Hashable | None] | None = None) -> list[GenerationOutput]:
        """Route every prompt (policy + router) and generate; outputs in prompt order.

        While no slot is live (e.g. the only slot is updating) the call waits for one, at most
        ``live_timeout_s`` (TimeoutError after it). Prompts that land on the same engine go in one
        batched call; with ``params.seed`` set,
        the call on global engine ``e`` uses ``seed + e * len(prompts)`` (row ``j`` of it then
        ``seed + e * len(prompts) + j``), so no two rows share a random stream.
        """
        import asyncio

        if not prompts:
            return []
        eids = await self.route_wait(list(keys) if keys is not None else [None] * len(prompts))
        by_engine: dict[int, list[int]] = {}
        for i, e in enumerate(eids):
            by_engine.setdefault(e, []).append(i)
        calls = []
        for e, rows in by_engine.items():
            p = params if params.seed is None else dataclasses.replace(params, seed=params.seed + e * len(prompts))
            calls.append(self.generate_on(e, [prompts[i] for i in rows], p))
        results = await asyncio.gather(*calls)
        out: list[GenerationOutput | None] = [None] * len(prompts)
        for rows, res in zip(by_engine.values(), results):
            for i, o in zip(rows, res):
                out[i] = o
        return out  # type: ignore[return-value]

    # ---------------------------------------------------------------- updates
    def oldest_slot(self) -> Slot:
        """The slot the next sync should update: failed first, then lowest version, then lowest index."""
        with self._lock:
            candidates = [s for s in self.slots if not s.updating]
            if not candidates:
                raise RuntimeError("every slot of the version pool is being updated")
            return min(candidates, key=lambda s: (not s.failed, s.version, s.index))

    def begin_update(self, version: int, slot: Slot | int | None = None, timeout_s: float | None = None) -> Slot:
        """Take ``slot`` (default: the oldest) out of routing, drain it, pause its engines and open their update.

        Opening the update tells each engine ``version`` (``begin_weight_update``), once: the weights that
        follow (``deliver_direct``, a broadcaster's buckets) carry none.

        Blocks until the slot's in-flight requests finished; TimeoutError (and the slot back in
        service) after ``timeout_s`` (default ``drain_timeout_s``). Other slots keep serving.
        """
        t = self.drain_timeout_s if timeout_s is None else float(timeout_s)
        with self._lock:
            s = self.oldest_slot() if slot is None else (self.slots[slot] if isinstance(slot, int) else slot)
            if s.updating:
                raise RuntimeError(f"slot {s.index} is already being updated")
            if not any(x.live for x in self.slots if x is not s):
                logger.debug("updating slot %d leaves no live slot: generation waits until the update ends", s.index)
            s.updating = True
            deadline = time.monotonic() + t
            while any(self._inflight[e] for e in s.engine_ids):
                left = deadline - time.monotonic()
                if left <= 0:
                    s.updating = False
                    busy = {e: self._inflight[e] for e in s.engine_ids if self._inflight[e]}
                    raise TimeoutError(f"slot {s.index} did not drain within {t:.1f}s (requests in flight per engine: "
                                       f"{busy}); raise rollout.engine_timeout_s or check for a stuck engine")
                self._lock.wait(min(left, 0.5))
        try:
            for e in s.engines:
                e.pause()
            for e in s.engines:
                e.begin_weight_update(int(version), {})
        except BaseException:
            self._resume_quietly(s)
            with self._lock:
                s.updating = False
            raise
        s.pending_version = int(version)
        logger.debug("slot %d (version %d) paused for the update to version %d", s.index, s.version, version)
        return s

    def end_update(self, slot: Slot | int) -> None:
        """Close the slot's update (each engine stamps the new version), resume it, stamp the slot."""
        s = self.slots[slot] if isinstance(slot, int) else slot
        if not s.updating or s.pending_version is None:
            raise RuntimeError(f"slot {s.index} has no update in progress; call begin_update() first")
        try:
            for e in s.engines:
                e.end_weight_update()
        except BaseException:
            self.abort_update(s)
            raise
        self._resume_quietly(s)
        with self._lock:
            s.version, s.pending_version = s.pending_version, None
            s.updating = False
            s.failed = False
            s.updated_at = time.monotonic()
            self._lock.notify_all()
        logger.debug("slot %d now serves version %d (pool versions %s)", s.index, s.version, self.versions)

    def abort_update(self, slot: Slot | int) -> None:
        """A sync of the slot failed: mark it failed (not sampled until a sync succeeds) and resume it."""
        s = self.slots[slot] if isinstance(slot, int) else slot
        for e in s.engines:
            abort = getattr(e, "abort_weight_update", None)
            try:
                if callable(abort):
                    abort()
                else:
                    e.end_weight_update()
            except Exception as err:  # noqa: BLE001 - the slot is marked failed anyway
                logger.warning("closing the failed update of %r: %s", e, err)
        self._resume_quietly(s)
        with self._lock:
            s.pending_version = None
            s.updating = False
            s.failed = True
            self._lock.notify_all()
        logger.error("slot %d failed its update and is out of rotation until the next successful sync", s.index)

    def _resume_quietly(self, s: Slot) -> None:
        for e in s.engines:
            try:
                e.resume()
            except Exception as err:  # noqa: BLE001
                logger.warning("resume of %r failed: %s", e, err)

    def health(self) -> list[dict]:
        """Per slot: ``{"slot", "version", "updating", "failed", "inflight", "engines": [engine.health()]}``."""
        return [{"slot": s.index, "version": s.version, "updating": s.updating, "failed": s.failed,
                 "inflight": [self._inflight[e] for e in s.engine_ids], "engines": [e.health() for e in s.engines]}
                for s in self.slots]
