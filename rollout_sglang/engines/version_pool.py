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
* **In-flight updates.** With ``update_mode`` "in_place" or "retract" (:data:`~rollout_sglang.engines.protocol.
  PauseMode`) :meth:`VersionPool.begin_update` does not drain: it pauses the slot's engines in that mode, which
  holds their running requests between two tokens, opens the update, and the slot keeps taking requests (they wait
  at the engines); :meth:`VersionPool.end_update` resumes the engines and the held requests continue on the new
  weights. Every output carries the version of each of its tokens, so a turn that the update crossed holds both.
* **Cross-policy sampling.** Per request (per turn of a trajectory) :meth:`VersionPool.route`
  draws a slot by ``policy``, from a seeded generator: ``"latest"`` (on-policy: only slots that
  hold the newest version), ``"uniform"`` (every live version equally likely), ``"recency"``
  (the k-th newest live version with weight ``recency_decay ** k``). Slots that hold the chosen
  version share its requests by load.
* **Router.** Within a slot, a request goes to the engine with the fewest requests in flight,
  except that a trajectory's consecutive turns (same ``key``) stay on the engine that served its
  previous turn when that engine is in the chosen slot and live, so its prefix cache is reused.
* **Engines come and go.** An engine whose call fails for reasons of its own
  (:class:`~rollout_sglang.engines.protocol.EngineUnavailable`: unreachable, stalled, aborted) or whose
  health probe fails (:meth:`VersionPool.start_health_checks`: SGLang's ``/health_generate``, on a
  thread per engine) is taken out of rotation: its in-flight calls are cancelled and every prompt of
  them is generated again on another engine (the turn is re-generated; the episode's earlier turns
  stand), with a growing pause between attempts. A slot without a serving engine is out of rotation.
  When the probe passes again, an engine that still reports its slot's version serves at once; one
  that does not (a restarted server) waits for weights: its slot is the next one a sync updates, in a
  fresh weight-sync group (:meth:`VersionPool.group_tag` changes). Generation fails only when no slot
  could serve for ``live_timeout_s`` (:class:`~rollout_sglang.engines.protocol.EnginesUnavailable`,
  naming every engine and why).

* **Versions as adapters (LoRA runs).** With ``live_adapters=N`` the pool has one slot, whose engines all hold
  the same base, and its N live versions are LoRA adapters on it (:mod:`rollout_sglang.engines.adapter_versions`):
  cross-policy sampling draws a version by ``policy`` as above and the request names that version's adapter.
  :meth:`VersionPool.publish_adapter` loads a new version's adapter on every engine in rotation while they keep
  generating (no drain, no pause); the oldest version then retires: no new requests, and it is unloaded once its
  last request returned. A full-weight update of the slot loads a new base (every adapter is unloaded), or, at the
  same version, restores the base to engines back from a restart, which then get the live adapters again.

Thread-safety: routing, leases and updates are guarded by one lock; :meth:`begin_update` blocks
(waiting for the drain), so call it from outside the rollout's event loop, or when nothing runs.
"""
from __future__ import annotations

import asyncio
import logging
import random
import threading
import time
from collections import OrderedDict
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field
from typing import Any

from rollout_sglang.engines.adapter import Adapter
from rollout_sglang.engines.adapter_versions import AdapterVersions, LiveVersion
from rollout_sglang.engines.protocol import (
    PAUSE_MODES,
    Engine,
    EnginesUnavailable,
    EngineUnavailable,
    GenerationOutput,
    SamplingParams,
    row_seeds,
)

logger = logging.getLogger(__name__)

POLICIES = ("latest", "uniform", "recency")


class CallWithdrawn(EngineUnavailable):
    """The pool withdrew a call from an engine that stays in rotation (its slot's in-flight update failed, so the
    call would go on over partly loaded weights): the prompts are generated again, the engine is not marked down."""

#: how a full-weight update treats the requests running on its slot: wait for them, or hold them (PauseMode)
UPDATE_MODES = ("drain", *PAUSE_MODES)


@dataclass
class Slot:
    """One version slot: its engines (global indices ``engine_ids``), version and state."""

    index: int
    engines: list[Any]
    engine_ids: list[int]
    version: int
    updating: bool = False
    in_flight: bool = False
    #: the update restores engines back from a restart (the slot's version again); the others keep serving
    restoring: bool = False
    failed: bool = False
    pending_version: int | None = None
    targets: list[int] = field(default_factory=list)
    updated_at: float = field(default_factory=time.monotonic)

    @property
    def live(self) -> bool:
        """Whether the slot's state admits requests (no failed sync, not updating unless in flight (requests then
        wait at its paused engines) or restoring); the pool also needs one of its engines in rotation."""
        return (not self.updating or self.in_flight or self.restoring) and not self.failed

    def paused_for_update(self, engine_id: int) -> bool:
        """Whether engine ``engine_id`` of this slot is paused for the slot's update (a restore pauses its targets
        alone)."""
        return self.updating and (not self.restoring or engine_id in self.targets)


class VersionPool:
    """N slots of engines, a cross-policy slot choice and a prefix-affine router.

    slots: the engines of each slot (every slot non-empty; the engines of a slot must report the
        same ``version``).
    policy: "latest" | "uniform" | "recency" (see module doc).
    recency_decay: weight ratio between consecutive versions under "recency", in (0, 1].
    seed: seeds the slot choice (and the router's tie-breaks), so runs are reproducible.
    drain_timeout_s: how long :meth:`begin_update` waits for the slot's in-flight requests.
    max_affinity_keys: how many trajectory -> engine entries the router remembers (LRU).
    live_timeout_s: how long :meth:`generate` waits for a live slot when none is (None: ``drain_timeout_s``);
        also the limit on re-routing a call whose engines keep failing.
    live_adapters: a LoRA run: the number of live versions, each an adapter on the one slot's base (None: each
        version is a slot of full weights).
    update_mode: "drain" (an update waits for the slot's requests to finish, then pauses it) or a
        :data:`~rollout_sglang.engines.protocol.PauseMode`, "in_place" / "retract" (an in-flight update: the running
        requests are held, not waited for; see the module doc). A LoRA run's adapters never pause either way.
    """

    def __init__(self, slots: Sequence[Sequence[Engine]], *, policy: str = "latest", recency_decay: float = 0.5,
                 seed: int = 0, drain_timeout_s: float = 600.0, max_affinity_keys: int = 100_000,
                 live_timeout_s: float | None = None, live_adapters: int | None = None,
                 update_mode: str = "drain") -> None:
        if policy not in POLICIES:
            raise ValueError(f"cross_policy={policy!r} is not one of {POLICIES}")
        if update_mode not in UPDATE_MODES:
            raise ValueError(f"weight_update_mode={update_mode!r} is not one of {UPDATE_MODES}")
        self.update_mode = update_mode
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
        # engines out of rotation (id -> why, since when), back but without their slot's weights, and a
        # counter per engine that moves when it comes back so (its weight-sync group must be new)
        self._down: dict[int, tuple[str, float]] = {}
        self._needs_weights: set[int] = set()
        self._epoch = [0] * len(self.engines)
        self._calls: list[set[tuple[asyncio.AbstractEventLoop, asyncio.Task]]] = [set() for _ in self.engines]
        self._kill_reason: dict[asyncio.Task, str] = {}
        self._withdrawn: set[asyncio.Task] = set()
        self._probes: list[threading.Thread] = []
        self._stop_probes = threading.Event()
        self.stats = {"routed": 0, "affinity_hits": 0, "engine_failures": 0, "engine_returns": 0, "rerouted": 0}
        self.adapters: AdapterVersions | None = None
        if live_adapters is not None:
            if len(self.slots) != 1:
                raise ValueError(f"versions as adapters share one slot of engines, got {len(self.slots)} slots; give "
                                 "the engines as one slot")
            self.adapters = AdapterVersions(live_adapters, self.slots[0].version, self.slots[0].engine_ids)

    @classmethod
    def from_engines(cls, engines: Sequence[Engine], max_versions: int, engines_per_slot: int,
                     **kwargs: Any) -> "VersionPool":
        """Split ``engines`` (``max_versions * engines_per_slot`` of them) into slots, in order; with
        ``live_adapters`` in ``kwargs``, ``engines_per_slot`` engines form the one slot."""
        if kwargs.get("live_adapters") is not None:
            if len(engines) != engines_per_slot:
                raise ValueError(f"{len(engines)} engines for one slot of rollout.engines_per_slot={engines_per_slot} "
                                 "(versions as adapters share one slot); give that many")
            return cls([list(engines)], **kwargs)
        if len(engines) != max_versions * engines_per_slot:
            raise ValueError(f"{len(engines)} engines cannot fill rollout.max_versions={max_versions} slots of "
                             f"rollout.engines_per_slot={engines_per_slot}; give {max_versions * engines_per_slot}")
        return cls([list(engines[i * engines_per_slot:(i + 1) * engines_per_slot]) for i in range(max_versions)],
                   **kwargs)

    # ------------------------------------------------------------------ state
    @property
    def versions(self) -> list[int]:
        """Version of each slot (in slot order); with versions as adapters, the live versions, oldest first."""
        if self.adapters is not None:
            return [v.version for v in self.adapters.routable()]
        return [s.version for s in self.slots]

    @property
    def latest_version(self) -> int:
        """The newest version a live slot serves (-1 when none is live)."""
        live = [s.version for s in self.slots if self._is_live(s)]
        if live and self.adapters is not None:
            return max(v.version for v in self.adapters.routable())
        return max(live) if live else -1

    def _serving(self, s: Slot) -> list[int]:
        """The slot's engines in rotation: not down, not waiting for weights."""
        return [e for e in s.engine_ids if e not in self._down and e not in self._needs_weights]

    def _is_live(self, s: Slot) -> bool:
        if self.adapters is not None:
            return s.live and bool(self._held(self._serving(s)))
        return s.live and bool(self._serving(s))

    def _held(self, serving: list[int]) -> list[LiveVersion]:
        """The routable adapter versions that an engine of ``serving`` holds."""
        assert self.adapters is not None
        return [v for v in self.adapters.routable() if any(self.adapters.holds(e, v) for e in serving)]

    def _state(self, s: Slot) -> str:
        if s.updating:
            return f"live, restoring {len(s.targets)} engine(s) back from a restart" if s.restoring else "updating"
        if s.failed:
            return "failed its last sync"
        return "live" if self._serving(s) else "no engine in rotation"

    def engine_name(self, engine_id: int) -> str:
        """How messages name engine ``engine_id`` (its URL for an SGLang server)."""
        return str(getattr(self.engines[engine_id], "name", None) or f"engine {engine_id}")

    def slot_states(self) -> str:
        """Each slot's index, version and state, and every engine out of rotation with the reason, for messages
        (e.g. "slot 0: v3 live, slot 1: v2 updating; http://h:30001 down for 12s: ...")."""
        text = ", ".join(f"slot {s.index}: v{s.version} {self._state(s)}" for s in self.slots)
        if self.adapters is not None:
            text += f" (versions: {self.adapters.describe()})"
        now = time.monotonic()
        out = [f"{self.engine_name(e)} (slot {self._slot_of[e].index}) down for {now - since:.0f}s: {why}"
               for e, (why, since) in sorted(self._down.items())]
        out += [f"{self.engine_name(e)} (slot {self._slot_of[e].index}) back, waiting for weights"
                for e in sorted(self._needs_weights - set(self._down))]
        return text + ("; " + "; ".join(out) if out else "")

    def newest_live_slot(self) -> Slot:
        """The live slot with the newest version; RuntimeError naming the slot states when none is live
        (an updating or failed slot may hold partly loaded weights)."""
        live = [s for s in self.slots if self._is_live(s)]
        if not live:
            raise RuntimeError(f"no live engine slot in the version pool ({self.slot_states()}); a weight sync "
                               "failed or is still running; see the weight-sync errors in the trainer log")
        return max(live, key=lambda s: s.version)

    def serving_engine(self, slot: Slot) -> Any:
        """An engine of ``slot`` in rotation (the least loaded); RuntimeError when it has none."""
        with self._lock:
            serving = self._serving(slot)
            if not serving:
                raise RuntimeError(f"slot {slot.index} has no engine in rotation ({self.slot_states()})")
            return self.engines[min(serving, key=lambda e: self._inflight[e])]

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

    def _draw(self, weights: dict[int, float]) -> int:
        versions = list(weights)
        if len(versions) == 1:
            return versions[0]
        return self._rng.choices(versions, weights=[weights[x] for x in versions])[0]

    def _choose_adapter_locked(self, serving: list[int], newest: bool) -> LiveVersion:
        """Draw a routable version that an engine of ``serving`` holds, by the policy (``newest``: the newest)."""
        routable = {v.version: v for v in self._held(serving)}
        newest_v = max(routable)
        if newest or self.policy == "latest":
            return routable[newest_v]
        order = sorted(routable, reverse=True)
        weights = {v: (1.0 if self.policy == "uniform" else self.recency_decay ** k) for k, v in enumerate(order)}
        return routable[self._draw(weights)]

    def _choose_locked(self, newest: bool = False) -> Slot:
        """Draw a live slot by the policy (seeded; ``newest``: the newest version whatever the policy);
        RuntimeError when no slot is live."""
        live = [s for s in self.slots if self._is_live(s)]
        if not live:
            raise RuntimeError(f"no live slot in the version pool ({self.slot_states()})")
        weights = {max(s.version for s in live): 1.0} if newest else self._weights(live)
        v = self._draw(weights)
        candidates = [s for s in live if s.version == v]
        if len(candidates) == 1:
            return candidates[0]
        # several slots hold that version (e.g. before the pool filled up): the least loaded one
        return min(candidates, key=lambda s: (sum(self._inflight[e] for e in self._serving(s)) / len(self._serving(s)),
                                              self._rng.random()))

    # ----------------------------------------------------------------- router
    def route(self, keys: Sequence[Hashable | None], newest: bool = False) -> list[int]:
        """Choose a slot (by policy) and an engine for each request; returns global engine ids.

        keys: one per request; requests with the same key (the turns of one trajectory) stick to
        the engine of their previous turn when it is in the chosen slot. Each returned engine
        holds a lease (counted in flight) until :meth:`release`. RuntimeError when no slot is live
        (:meth:`route_wait` waits instead), and for a pool of adapter versions (use :meth:`generate`, which names
        the adapter and returns its lease).
        """
        if self.adapters is not None:
            raise RuntimeError("route() of a pool whose versions are adapters: call generate(), which names each "
                               "request's adapter")
        with self._lock:
            return [e for e, _ in self._route_locked(keys, newest)]

    async def route_wait(self, keys: Sequence[Hashable | None], timeout_s: float | None = None,
                         newest: bool = False) -> list[tuple[int, LiveVersion | None]]:
        """:meth:`route`, but while no slot is live wait for one (polling, without blocking the event
        loop) at most ``timeout_s`` (None: ``live_timeout_s``); EnginesUnavailable (a TimeoutError)
        naming the slots and the engines out of rotation after it. Each request's engine, and with versions as
        adapters its version (whose lease :meth:`generate_on` returns)."""
        t = self.live_timeout_s if timeout_s is None else float(timeout_s)
        deadline = time.monotonic() + t
        delay = 0.002
        while True:
            with self._lock:
                if any(self._is_live(s) for s in self.slots):
                    return self._route_locked(keys, newest)
                left = deadline - time.monotonic()
                if left <= 0:
                    raise EnginesUnavailable(
                        f"no live slot in the version pool for {t:.1f}s ({self.slot_states()}): an update did not "
                        "finish, every slot failed its sync, or no engine is reachable; raise "
                        "rollout.engine_unavailable_timeout_s to wait longer, or check the engines and the "
                        "weight-sync errors in the trainer log")
            await asyncio.sleep(min(delay, max(left, 0.0)))
            delay = min(delay * 2, 0.05)

    def _route_locked(self, keys: Sequence[Hashable | None],
                      newest: bool = False) -> list[tuple[int, LiveVersion | None]]:
        out: list[tuple[int, LiveVersion | None]] = []
        for key in keys:
            slot = self._choose_locked(newest)
            serving = self._serving(slot)
            live = None
            if self.adapters is not None:
                live = self._choose_adapter_locked(serving, newest)
                serving = [e for e in serving if self.adapters.holds(e, live)]
                live.inflight += 1
            eid = None
            if key is not None:
                prev = self._affinity.get(key)
                if prev is not None and prev in serving:
                    eid = prev
                    self.stats["affinity_hits"] += 1
            if eid is None:
                eid = min(serving, key=lambda e: (self._inflight[e], self._assigned[e]))
            if key is not None:
                self._affinity[key] = eid
                self._affinity.move_to_end(key)
                while len(self._affinity) > self._max_affinity:
                    self._affinity.popitem(last=False)
            self._inflight[eid] += 1
            self._assigned[eid] += 1
            self.stats["routed"] += 1
            out.append((eid, live))
        return out

    def release(self, engine_id: int, n: int = 1, versions: Sequence[LiveVersion | None] = ()) -> None:
        """Return ``n`` leases of ``engine_id`` and those of ``versions`` (adapter versions, one per request; wakes a
        waiting :meth:`begin_update` or :meth:`publish_adapter`)."""
        with self._lock:
            self._inflight[engine_id] -= n
            if self._inflight[engine_id] < 0:
                raise RuntimeError(f"engine {engine_id}: more leases released than taken")
            for live in versions:
                if live is not None:
                    live.inflight -= 1
            self._lock.notify_all()

    def forget(self, keys: Sequence[Hashable]) -> None:
        """Drop the router's memory of these trajectories (they ended)."""
        with self._lock:
            for k in keys:
                self._affinity.pop(k, None)

    async def generate_on(self, engine_id: int, prompts: list[list[int]], params: SamplingParams,
                          routing_from: list[int] | None = None,
                          versions: Sequence[LiveVersion | None] = (),
                          seeds: list[int | None] | None = None) -> list[GenerationOutput]:
        """``generate`` on engine ``engine_id``, then release the ``len(prompts)`` leases :meth:`route` took.

        routing_from: MoE models, one start per prompt (``Engine.generate``); None asks the engine for no routing.
        seeds: one seed per prompt (``Engine.generate``); None: as ``params.seed`` says.
        versions: with versions as adapters, each prompt's version (its adapter is named to the engine; its lease
        is returned too).
        EngineUnavailable when the engine fails for reasons of its own or is taken out of rotation while the
        call runs (the call is cancelled then)."""
        loop = asyncio.get_running_loop()
        engine = self.engines[engine_id]
        kwargs: dict[str, Any] = {}
        if routing_from is not None:
            kwargs["routing_from"] = list(routing_from)
        names = [None if v is None else v.name for v in versions]
        if any(n is not None for n in names):
            kwargs["adapters"] = names
        if seeds is not None:
            kwargs["seeds"] = list(seeds)
        task = loop.create_task(engine.generate(prompts, params, **kwargs))
        entry = (loop, task)
        with self._lock:
            down = self._down.get(engine_id)
            if down is None:
                self._calls[engine_id].add(entry)
        try:
            if down is not None:
                task.cancel()
                raise EngineUnavailable(f"{self.engine_name(engine_id)} is out of rotation: {down[0]}")
            return await task
        except asyncio.CancelledError:
            with self._lock:
                reason = self._kill_reason.get(task)
                withdrawn = task in self._withdrawn
            current = asyncio.current_task()
            if reason is None or (current is not None and current.cancelling()):
                raise
            if withdrawn:
                raise CallWithdrawn(f"a call on {self.engine_name(engine_id)} was withdrawn: {reason}") from None
            raise EngineUnavailable(f"{self.engine_name(engine_id)} was taken out of rotation while generating: "
                                    f"{reason}") from None
        finally:
            with self._lock:
                self._calls[engine_id].discard(entry)
                self._kill_reason.pop(task, None)
                self._withdrawn.discard(task)
            self.release(engine_id, len(prompts), versions)

    async def generate(self, prompts: list[list[int]], params: SamplingParams,
                       keys: Sequence[Hashable | None] | None = None, newest: bool = False,
                       routing_from: Sequence[int] | None = None,
                       seeds: Sequence[int | None] | None = None) -> list[GenerationOutput]:
        """Route every prompt (policy + router; ``newest``: the newest live version) and generate; outputs in
        prompt order. ``routing_from``: MoE models, one start per prompt (``Engine.generate``): each row's
        start goes with it to whichever engine serves it, a re-routed row's too. ``seeds``: one per prompt, in
        place of ``params.seed + j`` (``Engine.generate``).

        While no slot is live (e.g. the only slot is updating) the call waits for one. Prompts whose engine
        fails for reasons of its own (:class:`EngineUnavailable`) take that engine out of rotation and are
        generated again elsewhere as soon as their engine's part of the call ends, after a pause that grows per
        attempt (0.05 s doubling, at most 2 s); EnginesUnavailable when, from the first failure on, no slot could
        serve them within ``live_timeout_s``. Other errors (a bad request) are raised as they are. Prompts that
        land on the same engine go in one batched call; seeded, prompt ``j`` samples with its seed (``seed + j``,
        or ``seeds[j]``) whichever engine serves it, a re-routed one too (each engine call names each row's seed),
        so what a seeded call samples does not depend on how many engines there are or which of them failed.
        """
        if not prompts:
            return []
        keys = list(keys) if keys is not None else [None] * len(prompts)
        starts = list(routing_from) if routing_from is not None else None
        if starts is not None and len(starts) != len(prompts):
            raise ValueError(f"routing_from has {len(starts)} starts for {len(prompts)} prompts; give one per prompt")
        row_seed = row_seeds(prompts, params, None if seeds is None else list(seeds))
        seeded = any(s is not None for s in row_seed)
        out: list[GenerationOutput | None] = [None] * len(prompts)
        calls: dict[asyncio.Task, tuple[int, list[int]]] = {}  # each engine call: its engine and rows
        deadline: float | None = None  # re-routing is bounded from the first failure on, not from the call's start

        async def launch(rows: list[int]) -> None:
            left = self.live_timeout_s if deadline is None else max(0.0, deadline - time.monotonic())
            routed = await self.route_wait([keys[i] for i in rows], left, newest)
            by_engine: dict[int, list[int]] = {}
            version_of: dict[int, LiveVersion | None] = {}
            for i, (e, live) in zip(rows, routed):
                by_engine.setdefault(e, []).append(i)
                version_of[i] = live
            for e, mine in by_engine.items():
                task = asyncio.ensure_future(self.generate_on(e, [prompts[i] for i in mine], params,
                                                              None if starts is None else [starts[i] for i in mine],
                                                              [version_of[i] for i in mine],
                                                              [row_seed[i] for i in mine] if seeded else None))
                calls[task] = (e, mine)

        attempt = 0
        try:
            await launch(list(range(len(prompts))))
            while calls:
                # each engine's part is handled as it ends: a dead engine's rows go elsewhere at once, not after
                # the slowest other part (which an in-flight update may hold)
                done, _ = await asyncio.wait(list(calls), return_when=asyncio.FIRST_COMPLETED)
                retry: list[int] = []
                for task in done:
                    e, rows = calls.pop(task)
                    err = task.exception()
                    if isinstance(err, EngineUnavailable):
                        if not isinstance(err, CallWithdrawn):
                            self.mark_down(e, str(err))
                        retry.extend(rows)
                    elif err is not None:
                        raise err
                    else:
                        for i, o in zip(rows, task.result()):
                            out[i] = o
                if not retry:
                    continue
                retry.sort()
                attempt += 1
                with self._lock:
                    self.stats["rerouted"] += len(retry)
                if deadline is None:
                    deadline = time.monotonic() + self.live_timeout_s
                elif time.monotonic() >= deadline:
                    raise EnginesUnavailable(f"{len(retry)} prompts found no engine that could serve them within "
                                             f"{self.live_timeout_s:.1f}s ({self.slot_states()}); raise "
                                             "rollout.engine_unavailable_timeout_s or check the engines")
                await asyncio.sleep(min(0.05 * 2 ** (attempt - 1), 2.0))
                await launch(retry)
        finally:
            for task in calls:
                task.cancel()
            if calls:
                await asyncio.gather(*calls, return_exceptions=True)
        return out  # type: ignore[return-value]

    # ---------------------------------------------------------------- health
    def mark_down(self, engine_id: int, reason: str) -> None:
        """Take engine ``engine_id`` out of rotation: no new requests, its running calls cancelled (their
        callers generate again elsewhere). It returns when its health probe passes."""
        with self._lock:
            if engine_id in self._down:
                return
            self._down[engine_id] = (reason, time.monotonic())
            self.stats["engine_failures"] += 1
        running = self._cancel_calls(engine_id, reason)
        logger.error("%s (slot %d) is out of rotation: %s; %d running calls go to other engines",
                     self.engine_name(engine_id), self._slot_of[engine_id].index, reason, running)

    def _cancel_calls(self, engine_id: int, reason: str, withdraw: bool = False) -> int:
        """Cancel the calls running on engine ``engine_id`` (their callers generate again elsewhere; ``withdraw``: the
        engine stays in rotation, :class:`CallWithdrawn`); how many."""
        with self._lock:
            for loop, task in list(self._calls[engine_id]):
                self._kill_reason[task] = reason
                if withdraw:
                    self._withdrawn.add(task)
                try:
                    loop.call_soon_threadsafe(task.cancel)
                except RuntimeError:  # its event loop has closed: nothing runs there any more
                    pass
            running = len(self._calls[engine_id])
            self._lock.notify_all()
        abandon = getattr(self.engines[engine_id], "abandon", None)
        if callable(abandon):  # a batching wrapper drops the call it runs, so the engine's return finds it free
            abandon()
        return running

    def mark_up(self, engine_id: int, weight_version: int | None) -> None:
        """Engine ``engine_id`` passed its health probe, reporting ``weight_version``: it serves again when that
        is its slot's version, else (a restarted server) after its slot's next sync, in a fresh group."""
        with self._lock:
            if engine_id not in self._down:
                return
            why, since = self._down.pop(engine_id)
            slot = self._slot_of[engine_id]
            fresh = weight_version != slot.version or int(self.engines[engine_id].version) != slot.version
            if fresh:
                self._needs_weights.add(engine_id)
                self._epoch[engine_id] += 1
                if self.adapters is not None:  # a restarted server holds none of the adapters
                    self.adapters.loaded[engine_id].clear()
            self.stats["engine_returns"] += 1
            self._lock.notify_all()
        name, gone = self.engine_name(engine_id), time.monotonic() - since
        if fresh:
            logger.warning("%s (slot %d) is back after %.0fs but reports weight version %s, not the slot's v%d: it "
                           "serves again once the next weight sync (of its slot, next in line) has reached it",
                           name, slot.index, gone, weight_version, slot.version)
        else:
            logger.warning("%s (slot %d) is back after %.0fs with the slot's v%d: serving again", name, slot.index,
                           gone, slot.version)

    def probe_once(self, engine_id: int, timeout_s: float) -> bool | None:
        """Probe engine ``engine_id`` once and update its state; its result (None: the engine has no probe,
        or its slot is updating, when probes of a paused server mean nothing)."""
        engine = self.engines[engine_id]
        probe = getattr(engine, "probe", None)
        slot = self._slot_of[engine_id]
        if not callable(probe) or slot.paused_for_update(engine_id):
            return None
        result = probe(timeout_s)
        if slot.paused_for_update(engine_id):  # paused meanwhile: a refusal may be the pause
            return None
        if result.ok:
            self.mark_up(engine_id, result.weight_version)
        else:
            self.mark_down(engine_id, result.error or "failed its health probe")
        return bool(result.ok)

    def start_health_checks(self, interval_s: float, timeout_s: float) -> None:
        """Probe every engine that can be probed each ``interval_s`` seconds (a daemon thread per engine, so a
        stalled one delays no other), each probe limited to ``timeout_s``. :meth:`stop_health_checks` ends them."""
        if not interval_s > 0 or not timeout_s > 0:
            raise ValueError(f"health checks need interval_s > 0 and timeout_s > 0, got {interval_s!r}, {timeout_s!r}")
        if self._probes:
            return
        self._stop_probes.clear()

        def loop(eid: int) -> None:
            while not self._stop_probes.wait(interval_s):
                try:
                    self.probe_once(eid, timeout_s)
                    self._flush_when_idle(eid)
                except Exception:  # noqa: BLE001 - a probe bug must not end the checks
                    logger.exception("health probe of %s failed", self.engine_name(eid))

        for eid, e in enumerate(self.engines):
            if callable(getattr(e, "probe", None)):
                t = threading.Thread(target=loop, args=(eid,), name=f"probe-{eid}", daemon=True)
                t.start()
                self._probes.append(t)

    def _flush_when_idle(self, eid: int) -> None:
        """An engine that an ``in_place`` update left with old-weights KV in its prefix cache flushes it once it is
        idle (SGLang refuses while requests run; a request that arrives meanwhile makes it wait for the next check)."""
        flush = getattr(self.engines[eid], "flush_if_stale", None)
        with self._lock:
            idle = not self._inflight[eid] and not self._slot_of[eid].paused_for_update(eid) and eid not in self._down
        if callable(flush) and idle and flush():
            logger.debug("%s flushed the prefix cache an in-place update left", self.engine_name(eid))

    def stop_health_checks(self, timeout_s: float = 5.0) -> None:
        """End the probe threads (waits at most ``timeout_s`` for each)."""
        self._stop_probes.set()
        for t in self._probes:
            t.join(timeout_s)
        self._probes = []

    def group_tag(self, slot: Slot) -> tuple[tuple[int, int], ...]:
        """Which engines a slot's update reaches, and how often each came back: a sender keeps its weight-sync
        group while this stays the same and forms a fresh one when it changes."""
        with self._lock:
            return tuple((e, self._epoch[e]) for e in slot.targets)

    # ---------------------------------------------------------------- updates
    def oldest_slot(self) -> Slot:
        """The slot the next sync should update: among slots with an engine that can be reached, one that failed
        its sync first, then one with an engine back and waiting for weights, then the lowest version, then the
        lowest index. EnginesUnavailable when no slot has a reachable engine (nothing to update)."""
        with self._lock:
            candidates = [s for s in self.slots if not s.updating and any(e not in self._down for e in s.engine_ids)]
            if not candidates:
                if all(s.updating for s in self.slots):
                    raise RuntimeError("every slot of the version pool is being updated")
                raise EnginesUnavailable(f"no engine can be reached to take an update ({self.slot_states()})")
            return min(candidates, key=lambda s: (not s.failed, not (self._needs_weights & set(s.engine_ids)),
                                                  s.version, s.index))

    def begin_update(self, version: int, slot: Slot | int | None = None, timeout_s: float | None = None,
                     restore: bool = False) -> Slot:
        """Take ``slot`` (default: the oldest) out of routing, drain it, pause its engines and open their update; in
        flight (``update_mode`` "in_place" / "retract", not with adapter versions) the slot stays in routing and its
        engines are paused in that mode at once, their running requests held. ``restore``: only the slot's engines
        back from a restart and waiting for its weights (:meth:`waiting_for_weights`) take the update, which must be
        the slot's own version again; the others keep serving, neither drained nor paused (EnginesUnavailable when
        none waits).

        Opening the update tells each engine ``version`` (``begin_weight_update``), once: the weights that
        follow (``deliver_direct``, a broadcaster's buckets) carry none. Engines out of rotation are left
        out, as is one that fails to pause or open (it is taken out of rotation); ``slot.targets`` lists
        those in the update (EnginesUnavailable when none is left).

        Blocks until the slot's in-flight requests finished; TimeoutError (and the slot back in
        service) after ``timeout_s`` (default ``drain_timeout_s``). Other slots keep serving.
        """
        t = self.drain_timeout_s if timeout_s is None else float(timeout_s)
        with self._lock:
            s = self.oldest_slot() if slot is None else (self.slots[slot] if isinstance(slot, int) else slot)
            if s.updating:
                raise RuntimeError(f"slot {s.index} is already being updated")
            if restore and int(version) != s.version:
                raise ValueError(f"a restore of slot {s.index} sends its own version {s.version}, not {version}")
            in_flight = self.update_mode != "drain" and self.adapters is None and not restore
            if not in_flight and not restore and not any(x.live for x in self.slots if x is not s):
                logger.debug("updating slot %d leaves no live slot: generation waits until the update ends", s.index)
            s.updating, s.in_flight, s.restoring = True, in_flight, restore
            deadline = time.monotonic() + t
            while not in_flight and not restore and any(self._inflight[e] for e in s.engine_ids):
                left = deadline - time.monotonic()
                if left <= 0:
                    s.updating = s.restoring = False
                    busy = {e: self._inflight[e] for e in s.engine_ids if self._inflight[e]}
                    raise TimeoutError(f"slot {s.index} did not drain within {t:.1f}s (requests in flight per engine: "
                                       f"{busy}); raise rollout.engine_timeout_s or check for a stuck engine")
                self._lock.wait(min(left, 0.5))
            s.targets = [e for e in s.engine_ids if e not in self._down and (not restore or e in self._needs_weights)]
        try:
            for step in ("pause", "begin"):
                for eid in list(s.targets):
                    try:
                        if step == "pause" and in_flight:
                            self.engines[eid].pause(self.update_mode)
                        elif step == "pause":
                            self.engines[eid].pause()
                        else:
                            self.engines[eid].begin_weight_update(int(version), {})
                    except EngineUnavailable as err:
                        self.mark_down(eid, f"could not {step} its weight update: {err}")
                        s.targets.remove(eid)
            if not s.targets:
                raise EnginesUnavailable(f"slot {s.index}: no engine could take the update to version {version} "
                                         f"({self.slot_states()})")
        except BaseException:
            self._resume_quietly(s)
            with self._lock:
                s.updating = s.in_flight = s.restoring = False
                s.targets = []
                self._lock.notify_all()
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
            for eid in list(s.targets):
                try:
                    self.engines[eid].end_weight_update()
                except EngineUnavailable as err:  # the weights are in, the engine is gone: it returns for new ones
                    self.mark_down(eid, f"could not close its weight update: {err}")
                    s.targets.remove(eid)
            if self.adapters is not None:
                self._adapters_after_base(s)
        except BaseException:
            self.abort_update(s)
            raise
        self._resume_quietly(s)
        with self._lock:
            s.version, s.pending_version = s.pending_version, None
            self._needs_weights -= set(s.targets)
            if not s.restoring:  # a restore that reached nobody leaves the serving engines as they were
                s.failed = not s.targets
            s.updating = s.in_flight = s.restoring = False
            s.updated_at = time.monotonic()
            self._lock.notify_all()
        logger.debug("slot %d now serves version %d (pool versions %s)", s.index, s.version, self.versions)

    def _adapters_after_base(self, s: Slot) -> None:
        """After a base update of the adapter pool's slot: a new base (a new version) unloads every adapter; the
        same base again (engines back from a restart) gets each target the live adapters it lacks."""
        assert self.adapters is not None and s.pending_version is not None
        if s.pending_version != s.version:
            for eid in list(s.targets):
                for name in sorted(self.adapters.loaded[eid]):
                    self._call_engine(eid, "unload_adapter", name)
            with self._lock:
                self.adapters.reset(s.pending_version)
            return
        for live in [v for v in self.adapters.versions if v.adapter is not None]:
            for eid in [e for e in s.targets if not self.adapters.holds(e, live)]:
                if self._call_engine(eid, "load_adapter", live.adapter):
                    with self._lock:
                        self.adapters.loaded[eid].add(live.adapter.name)

    def _call_engine(self, eid: int, method: str, arg: Any) -> bool:
        """``engine.method(arg)`` for an adapter load or unload; an engine that fails for reasons of its own goes out
        of rotation (False), other errors are raised."""
        try:
            getattr(self.engines[eid], method)(arg)
            return True
        except EngineUnavailable as err:
            self.mark_down(eid, f"{method} failed: {err}")
            return False

    def publish_adapter(self, adapter: Adapter, timeout_s: float | None = None) -> None:
        """Versions as adapters: ``adapter`` becomes the newest live version. Its adapter is loaded on every engine
        in rotation while they keep generating; the oldest live version beyond ``live_adapters`` retires (no new
        requests) and is unloaded once its last request returned (here, or at a later publish). Blocks only while
        ``live_adapters + 1`` adapters are loaded and none of the retiring ones has drained, at most ``timeout_s``
        (default ``drain_timeout_s``; TimeoutError naming the versions). EnginesUnavailable when no engine took it.
        Engines out of rotation get it when they return (:meth:`end_update` of the base restores adapters)."""
        if self.adapters is None:
            raise RuntimeError("publish_adapter() on a pool of full-weight slots; build it with live_adapters=N")
        t = self.drain_timeout_s if timeout_s is None else float(timeout_s)
        deadline = time.monotonic() + t
        capacity = self.adapters.live_versions + 1
        while True:
            self._unload_drained()
            with self._lock:
                loaded = sum(1 for v in self.adapters.versions if v.adapter is not None)
                if loaded < capacity:
                    break
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"version {adapter.version} cannot be loaded: {loaded} adapters are loaded "
                                       f"({self.adapters.describe()}) and none of the retiring ones drained within "
                                       f"{t:.1f}s; raise rollout.engine_timeout_s or check for a stuck engine")
                self._lock.wait(min(left, 0.5))
        s = self.slots[0]
        with self._lock:
            if s.updating:
                raise RuntimeError(f"slot {s.index} is being updated; publish the adapter after end_update()")
            targets = self._serving(s)
        done = [eid for eid in targets if self._call_engine(eid, "load_adapter", adapter)]
        if not done:
            raise EnginesUnavailable(f"no engine could load the adapter of version {adapter.version} "
                                     f"({self.slot_states()})")
        with self._lock:
            for eid in done:
                self.adapters.loaded[eid].add(adapter.name)
            retired = self.adapters.add(adapter)
            self._lock.notify_all()
        logger.debug("version %d live as adapter %s on %d engines; retiring %s", adapter.version, adapter.name,
                     len(done), [v.version for v in retired])
        self._unload_drained()

    def _unload_drained(self) -> None:
        """Unload every retiring version whose last request returned, from each engine that holds it."""
        assert self.adapters is not None
        with self._lock:
            drained = [(v, [e for e, names in self.adapters.loaded.items() if v.name in names])
                       for v in self.adapters.drained()]
        for live, holders in drained:
            for eid in holders:
                if eid not in self._down:
                    self._call_engine(eid, "unload_adapter", live.name)
            with self._lock:
                self.adapters.drop(live)

    def abort_update(self, slot: Slot | int) -> None:
        """A sync of the slot failed: mark it failed (not sampled until a sync succeeds) and resume it. In flight,
        the requests its engines held are cancelled first (their callers generate again elsewhere): they would go on
        over partly loaded weights. A failed restore leaves the slot serving: its targets still wait for weights."""
        s = self.slots[slot] if isinstance(slot, int) else slot
        restoring = s.restoring
        with self._lock:
            s.failed = s.failed or not restoring  # no new requests while it is closed
        if s.in_flight:
            for eid in s.engine_ids:
                self._cancel_calls(eid, f"slot {s.index}'s in-flight update failed", withdraw=True)
        for e in (self.engines[eid] for eid in s.targets):
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
            s.updating = s.in_flight = s.restoring = False
            s.failed = s.failed or not restoring
            self._lock.notify_all()
        if restoring:
            logger.error("slot %d: restoring engines %s failed; they wait for the next sync, the others serve on",
                         s.index, [self.engine_name(e) for e in s.targets])
        else:
            logger.error("slot %d failed its update and is out of rotation until the next successful sync", s.index)

    def _resume_quietly(self, s: Slot) -> None:
        """Resume the slot's engines in reach (a restore's targets alone: the others were never paused)."""
        engines = s.targets if s.restoring else s.engine_ids
        for e in (self.engines[eid] for eid in engines if eid not in self._down):
            try:
                e.resume()
            except Exception as err:  # noqa: BLE001
                logger.warning("resume of %r failed: %s", e, err)

    def health(self) -> list[dict]:
        """Per slot: ``{"slot", "version", "updating", "failed", "inflight", "down", "waiting_for_weights",
        "engines": [engine.health()]}`` (down: ``{engine position in the slot: why}``); with versions as adapters
        also ``"adapters"``: the live versions described."""
        out = [{"slot": s.index, "version": s.version, "updating": s.updating, "failed": s.failed,
                "inflight": [self._inflight[e] for e in s.engine_ids],
                "down": {i: self._down[e][0] for i, e in enumerate(s.engine_ids) if e in self._down},
                "waiting_for_weights": [i for i, e in enumerate(s.engine_ids) if e in self._needs_weights],
                "engines": [e.health() for e in s.engines]} for s in self.slots]
        if self.adapters is not None:
            out[0]["adapters"] = self.adapters.describe()
        return out

    def stranded(self) -> bool:
        """No slot can serve, yet an engine back from a restart would if it had weights: only a sync gets the
        pool going again (the trainer then pushes without waiting for a batch that cannot come)."""
        with self._lock:
            return not any(self._is_live(s) for s in self.slots) and bool(self._needs_weights - set(self._down))

    def waiting_for_weights(self) -> bool:
        """Whether an engine in reach is back from a restart and waits for its slot's weights."""
        with self._lock:
            return bool(self._needs_weights - set(self._down))

    def engines_out(self) -> int:
        """Engines out of rotation now (down, or back and waiting for weights)."""
        with self._lock:
            return len(set(self._down) | self._needs_weights)

