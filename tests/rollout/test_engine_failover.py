"""Engines that fail, stall and come back: the version pool takes them out of rotation, generates their
prompts again elsewhere, and lets a restarted engine serve only after its slot's next weight sync."""
from __future__ import annotations

import asyncio
import time

import pytest

from rollout_sglang.engines.protocol import (
    EnginesUnavailable,
    EngineUnavailable,
    GenerationOutput,
    Probe,
    SamplingParams,
)
from rollout_sglang.engines.version_pool import VersionPool

PARAMS = SamplingParams(max_new_tokens=1)


class Server:
    """A remote engine as the pool sees it: it may be dead (refuses), stalled (hangs) or restarted (fresh
    weights, reporting no version of ours)."""

    def __init__(self, eid: int, version: int = 0) -> None:
        self.eid, self.version, self.name = eid, version, f"http://engine-{eid}"
        self.dead = self.stalled = False
        self.reported: int | None = version
        self.pending: int | None = None
        self.served = 0

    async def generate(self, prompts, params, seeds=None):
        if self.dead:
            raise EngineUnavailable(f"{self.name} could not be reached")
        while self.stalled:
            await asyncio.sleep(0.01)
        self.served += len(prompts)
        return [GenerationOutput([self.eid], [-1.0], "length", self.version) for _ in prompts]

    def probe(self, timeout_s):
        if self.dead or self.stalled:
            return Probe(False, error="connection refused" if self.dead else "no answer (stalled)")
        return Probe(True, self.reported)

    def restart(self):
        self.dead, self.stalled, self.reported = False, False, None

    def pause(self):
        if self.dead:
            raise EngineUnavailable(f"{self.name}: pause failed")

    def resume(self):
        pass

    def begin_weight_update(self, version, metadata):
        self.pending = version

    def end_weight_update(self):
        self.version, self.reported, self.pending = self.pending, self.pending, None

    def health(self):
        return {"ok": not self.dead}


def pool_of(*slots: int, **kw) -> tuple[VersionPool, list[Server]]:
    servers, out = [], []
    for n in slots:
        out.append([Server(len(servers) + i) for i in range(n)])
        servers.extend(out[-1])
    return VersionPool(out, **kw), servers


def served(outs) -> list[int]:
    return [o.token_ids[0] for o in outs]


def test_a_dead_engine_costs_no_prompt_and_leaves_rotation():
    pool, (a, b) = pool_of(2)
    a.dead = True
    outs = asyncio.run(pool.generate([[1]] * 6, PARAMS))
    assert served(outs) == [1] * 6  # every prompt, including those routed to the dead one, came back
    assert pool.stats["engine_failures"] == 1 and pool.stats["rerouted"] >= 1
    assert "http://engine-0 (slot 0) down" in pool.slot_states()
    before = b.served
    asyncio.run(pool.generate([[1]] * 4, PARAMS))
    assert b.served == before + 4  # no more requests to the dead engine
    assert pool.inflight() == [0, 0]


def test_a_stalled_engine_is_found_by_its_probe_and_its_running_turns_move():
    pool, (a, b) = pool_of(2)

    async def run():
        a.stalled = True
        task = asyncio.ensure_future(pool.generate([[1]] * 4, PARAMS))
        await asyncio.sleep(0.1)
        assert not task.done()  # the stalled engine holds its half
        t0 = time.monotonic()
        await asyncio.to_thread(pool.probe_once, 0, 1.0)  # the health check's thread
        outs = await asyncio.wait_for(task, 5)
        return outs, time.monotonic() - t0

    outs, after_probe = asyncio.run(run())
    assert served(outs) == [1] * 4 and after_probe < 1.0
    assert pool.inflight() == [0, 0]


def test_a_restarted_engine_serves_only_after_its_slots_next_sync():
    pool, (a, b) = pool_of(1, 1)
    a.dead = True
    assert pool.probe_once(0, 1.0) is False
    a.restart()  # same URL, fresh weights: it reports no version of ours
    assert pool.probe_once(0, 1.0) is True
    assert "back, waiting for weights" in pool.slot_states()
    assert set(served(asyncio.run(pool.generate([[1]] * 4, PARAMS)))) == {1}
    # its slot goes first, although slot 1 holds the same version, and its group must be new
    assert pool.oldest_slot().index == 0
    tag_before = ((0, 0),)
    slot = pool.begin_update(1)
    assert slot.index == 0 and slot.targets == [0] and pool.group_tag(slot) != tag_before
    pool.end_update(slot)
    assert a.version == 1 and pool.engines_out() == 0
    assert set(served(asyncio.run(pool.generate([[1]] * 4, PARAMS)))) == {0}  # latest policy: v1 only


def test_an_engine_back_with_its_slots_weights_serves_at_once():
    pool, (a, b) = pool_of(2)
    a.stalled = True
    pool.probe_once(0, 1.0)
    a.stalled = False
    pool.probe_once(0, 1.0)
    assert pool.engines_out() == 0 and pool.stats["engine_returns"] == 1
    assert set(served(asyncio.run(pool.generate([[1]] * 8, PARAMS)))) == {0, 1}


def test_an_update_leaves_out_a_dead_engine_and_it_returns_for_the_weights():
    pool, (a, b) = pool_of(2)
    a.dead = True  # not yet noticed: its pause fails
    slot = pool.begin_update(1)
    assert slot.targets == [1]
    pool.end_update(slot)
    assert b.version == 1 and a.version == 0
    a.restart()
    a.reported = 0  # the same process came back: it still holds the old weights
    pool.probe_once(0, 1.0)
    assert "waiting for weights" in pool.slot_states()
    assert set(served(asyncio.run(pool.generate([[1]] * 4, PARAMS)))) == {1}


def test_no_engine_left_fails_after_the_budget_naming_each_engine():
    pool, (a, b) = pool_of(1, 1, live_timeout_s=0.3)
    a.dead = b.dead = True
    t0 = time.monotonic()
    with pytest.raises(EnginesUnavailable, match=r"engine-0 \(slot 0\) down .*could not be reached.*engine-1"):
        asyncio.run(pool.generate([[1]] * 2, PARAMS))
    assert time.monotonic() - t0 < 3
    with pytest.raises(EnginesUnavailable, match="no engine can be reached"):
        pool.oldest_slot()


def test_the_health_checks_bring_an_engine_back_on_their_own():
    pool, (a, b) = pool_of(2)
    pool.start_health_checks(interval_s=0.02, timeout_s=1.0)
    try:
        a.dead = True
        deadline = time.monotonic() + 5
        while pool.engines_out() == 0 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert pool.engines_out() == 1
        a.dead = False
        while pool.engines_out() == 1 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert pool.engines_out() == 0
    finally:
        pool.stop_health_checks()


class Hangs(Server):
    """A server whose first call never ends (it stalled mid-request); later calls are served."""

    def __init__(self, eid: int) -> None:
        super().__init__(eid)
        self.hung = False

    async def generate(self, prompts, params, seeds=None):
        if not self.hung:
            self.hung = True
            await asyncio.Event().wait()  # only a cancel ends it
        return await super().generate(prompts, params)


def test_a_stalled_engine_that_recovers_is_not_blocked_by_its_stuck_call():
    from rollout_sglang.engines.batching import BatchingEngine

    a, b = Hangs(0), Server(1)
    pool = VersionPool([[BatchingEngine(a), BatchingEngine(b)]])

    async def run():
        first = asyncio.ensure_future(pool.generate([[1]] * 4, PARAMS))
        await asyncio.sleep(0.05)
        a.stalled = True
        await asyncio.to_thread(pool.probe_once, 0, 1.0)  # taken out: its turns go to b
        assert set(served(await asyncio.wait_for(first, 5))) == {1}
        a.stalled = False
        await asyncio.to_thread(pool.probe_once, 0, 1.0)  # back with its slot's weights
        # its wrapper dropped the stuck call: a call routed to it now is served, not queued behind that one
        return served(await asyncio.wait_for(pool.generate_on(0, [[1]], PARAMS), 5))

    pool.route([None])  # generate_on releases one lease of engine 0: take it first, as the router does
    assert asyncio.run(run()) == [0]


class DiesAfter(Server):
    """A server that generates for ``after_s`` seconds, then dies under the call."""

    def __init__(self, eid: int, after_s: float) -> None:
        super().__init__(eid)
        self.after_s = after_s

    async def generate(self, prompts, params, seeds=None):
        await asyncio.sleep(self.after_s)
        self.dead = True
        raise EngineUnavailable(f"{self.name} died mid-generation")


def test_a_call_longer_than_the_unavailable_budget_is_still_rerouted():
    """The budget for finding another engine starts at the failure: a generation that ran past it (a long one, or
    one an in-flight update held) and then lost its engine goes to the other engine."""
    slow, fine = DiesAfter(0, after_s=0.6), Server(1)
    pool = VersionPool([[slow, fine]], live_timeout_s=0.3)
    pool._inflight[1] = 5  # the router sends the call to the slow engine (fewest in flight)
    (out,) = asyncio.run(pool.generate([[1, 2]], PARAMS))
    assert out.token_ids == [1] and pool.stats["rerouted"] == 1


def test_a_dead_engines_rows_move_while_the_other_engine_still_generates():
    """One call spread over two engines: when one dies, its rows go elsewhere at once, without waiting for the other
    engine's part (which an in-flight update may hold for long)."""
    dying, held, spare = DiesAfter(0, after_s=0.05), Server(1), Server(2)
    pool = VersionPool([[dying, held, spare]], live_timeout_s=10)
    held.stalled = True

    async def main():
        call = asyncio.create_task(pool.generate([[1], [2], [3]], PARAMS, keys=["a", "b", "c"]))
        deadline = time.monotonic() + 10
        while spare.served < 2:  # its own row, then the dead engine's, while `held` still holds its own
            assert time.monotonic() < deadline, pool.slot_states()
            await asyncio.sleep(0.01)
        assert not call.done() and 0 in pool._down
        held.stalled = False
        return await asyncio.wait_for(call, 10)

    outs = asyncio.run(main())
    assert sorted(o.token_ids[0] for o in outs) == [1, 2, 2]  # served by `held` (1) and the spare (2) alone
