"""A LoRA run's version pool: every live version an adapter on the same engines, published without a pause."""
from __future__ import annotations

import asyncio
import threading

import pytest
import torch

from rollout_sglang.engines.adapter import Adapter
from rollout_sglang.engines.protocol import EnginesUnavailable, GenerationOutput, SamplingParams
from rollout_sglang.engines.version_pool import VersionPool
from tests.support.fake_engine import UpdatableEngine


class AdapterEngine(UpdatableEngine):
    """An engine that records adapter loads and answers each row with its adapter's version; ``hold`` makes every
    generate call wait until it is set."""

    def __init__(self, name: str) -> None:
        super().__init__()
        self.name = name
        self.loaded: dict[str, int] = {}
        self.log: list[str] = []
        self.hold: threading.Event | None = None
        self.rows = 0

    async def generate(self, prompts, params, routing_from=None, adapters=None, seeds=None):
        assert not self.paused, "a publish must not pause the engine"
        self.rows += len(prompts)
        names = adapters or [None] * len(prompts)
        for n in names:
            assert n is None or n in self.loaded, f"{n} not loaded on {self.name}"
        if self.hold is not None:
            while not self.hold.is_set():
                await asyncio.sleep(0.005)
        return [GenerationOutput([1], [-0.5], "length", self.version if n is None else self.loaded[n]) for n in names]

    def load_adapter(self, adapter):
        assert adapter.name not in self.loaded
        self.loaded[adapter.name] = adapter.version
        self.log.append(f"load {adapter.name}")

    def unload_adapter(self, name):
        del self.loaded[name]
        self.log.append(f"unload {name}")


def _adapter(version: int) -> Adapter:
    return Adapter(version, {"r": 2, "lora_alpha": 4}, {"base_model.model.x.lora_A.weight": torch.zeros(2, 3),
                                                       "base_model.model.x.lora_B.weight": torch.zeros(3, 2)})


def _versions(pool: VersionPool, n: int = 40) -> set[int]:
    outs = asyncio.run(pool.generate([[1, 2]] * n, SamplingParams(max_new_tokens=1)))
    return {o.version for o in outs}


def test_live_versions_are_adapters_on_the_same_engines():
    """Three live versions on two engines: each request is served by one of them, drawn by the policy; the oldest
    retires and is unloaded when a fourth arrives; no engine is paused."""
    engines = [AdapterEngine("a"), AdapterEngine("b")]
    pool = VersionPool([engines], policy="uniform", seed=3, live_adapters=3)
    assert pool.versions == [0] and _versions(pool) == {0}
    pool.publish_adapter(_adapter(1))
    assert pool.versions == [1]  # the base alone is no trained version: it retires at the first adapter
    for v in (2, 3):
        pool.publish_adapter(_adapter(v))
    assert pool.versions == [1, 2, 3]
    assert _versions(pool) == {1, 2, 3}
    assert all(sorted(e.loaded) == ["v1", "v2", "v3"] for e in engines)
    pool.publish_adapter(_adapter(4))
    assert pool.versions == [2, 3, 4] and _versions(pool) == {2, 3, 4}
    assert all(sorted(e.loaded) == ["v2", "v3", "v4"] for e in engines)
    assert pool.latest_version == 4
    newest = asyncio.run(pool.generate([[1]] * 10, SamplingParams(max_new_tokens=1), newest=True))
    assert {o.version for o in newest} == {4}
    with pytest.raises(RuntimeError, match="call generate"):
        pool.route([None])


def test_a_retiring_version_keeps_serving_its_requests_until_they_return():
    """A request on the oldest version still runs when the next one is published: the version leaves routing at
    once but its adapter stays loaded until the request returned, and is unloaded at the next publish."""
    engine = AdapterEngine("a")
    pool = VersionPool([[engine]], live_adapters=1)
    pool.publish_adapter(_adapter(1))
    engine.hold = threading.Event()
    result: list = []

    def run() -> None:
        result.extend(asyncio.run(pool.generate([[1]], SamplingParams(max_new_tokens=1))))

    t = threading.Thread(target=run)
    t.start()
    while pool.adapters.versions[-1].inflight == 0:
        pass
    pool.publish_adapter(_adapter(2))  # v1 retires; its request still runs: it stays loaded
    assert pool.versions == [2] and "v1" in engine.loaded
    engine.hold.set()
    t.join(10)
    assert result[0].version == 1
    pool.publish_adapter(_adapter(3))
    assert sorted(engine.loaded) == ["v3"] and engine.log.count("unload v1") == 1


def test_publish_waits_no_longer_than_its_timeout_for_a_stuck_version():
    """With live versions + 1 adapters loaded and the retiring one stuck, a publish ends in a TimeoutError that names
    the versions, instead of loading one adapter too many."""
    engine = AdapterEngine("a")
    pool = VersionPool([[engine]], live_adapters=1)
    pool.publish_adapter(_adapter(1))
    engine.hold = threading.Event()
    t = threading.Thread(target=lambda: asyncio.run(pool.generate([[1]], SamplingParams(max_new_tokens=1))))
    t.start()
    while pool.adapters.versions[-1].inflight == 0:
        pass
    pool.publish_adapter(_adapter(2))
    with pytest.raises(TimeoutError, match=r"v1 retiring \(1 in flight\)"):
        pool.publish_adapter(_adapter(3), timeout_s=0.3)
    engine.hold.set()
    t.join(10)
    pool.publish_adapter(_adapter(3))
    assert sorted(engine.loaded) == ["v3"]


def test_an_engine_back_from_a_restart_gets_the_base_and_the_live_adapters():
    """An engine that comes back without its weights serves nothing until the base is pushed again (same version);
    it then gets every live adapter back. A new base unloads every adapter."""
    a, b = AdapterEngine("a"), AdapterEngine("b")
    pool = VersionPool([[a, b]], policy="uniform", live_adapters=2)
    pool.publish_adapter(_adapter(1))
    pool.publish_adapter(_adapter(2))
    pool.mark_down(1, "killed")
    b.loaded.clear()
    b.version = -1  # a restarted server reports no version of ours
    pool.mark_up(1, None)
    assert pool.stranded() is False
    outs = asyncio.run(pool.generate([[1]] * 20, SamplingParams(max_new_tokens=1)))
    assert {o.version for o in outs} == {1, 2} and not b.loaded
    slot = pool.begin_update(0)
    pool.end_update(slot)
    assert sorted(b.loaded) == ["v1", "v2"] and sorted(a.loaded) == ["v1", "v2"]
    assert a.log.count("load v1") == 1  # nothing loaded twice
    slot = pool.begin_update(7)
    pool.end_update(slot)
    assert pool.versions == [7] and not a.loaded and not b.loaded


def test_a_restore_sends_the_base_to_the_restarted_engine_alone_while_the_others_serve():
    """An engine back from a restart gets the base (the slot's version again) and the live adapters without pausing
    or draining the engines that serve: requests go on to them during the restore, and the restored one serves
    after. A failed restore leaves the slot serving and the engine waiting; a restore with nobody waiting, or of
    another version, is refused."""
    a, b, c = AdapterEngine("a"), AdapterEngine("b"), AdapterEngine("c")
    pool = VersionPool([[a, b, c]], policy="uniform", live_adapters=2)
    pool.publish_adapter(_adapter(1))
    pool.publish_adapter(_adapter(2))
    with pytest.raises(EnginesUnavailable):
        pool.begin_update(0, restore=True)  # nobody waits
    pool.mark_down(1, "killed")
    b.loaded.clear()
    b.version = -1
    pool.mark_up(1, None)
    assert pool.waiting_for_weights()
    with pytest.raises(ValueError, match="sends its own version 0, not 3"):
        pool.begin_update(3, restore=True)

    slot = pool.begin_update(0, restore=True)
    assert slot.targets == [1] and b.paused and b.pending == 0 and not a.paused and not c.paused
    assert _versions(pool) == {1, 2} and b.rows == 0  # served meanwhile, by a and c
    assert "restoring 1 engine" in pool.slot_states()
    pool.abort_update(slot)  # the send failed: b still waits, the slot serves on
    assert not pool.slots[0].failed and pool.waiting_for_weights() and not b.paused
    assert _versions(pool) == {1, 2} and b.rows == 0

    slot = pool.begin_update(0, restore=True)
    pool.end_update(slot)
    assert sorted(b.loaded) == ["v1", "v2"] and not b.paused and b.version == 0 and not pool.waiting_for_weights()
    assert a.log.count("load v1") == 1 and c.log.count("load v1") == 1  # nothing sent again to a and c
    assert _versions(pool, 200) == {1, 2} and b.rows > 0
