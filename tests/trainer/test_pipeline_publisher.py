"""The weight push into the version pool: the oldest slot (or every slot) is drained, paused, loaded
and resumed under the new version; a delivery that fails marks the slot failed, resumes its engines
and ends the push with the error."""
from __future__ import annotations

import pytest
import torch

from megatron_agentrl.weight_sync.options import SenderOptions
from megatron_agentrl.weight_sync.publisher import WeightPublisher
from rollout_sglang.engines.version_pool import VersionPool


class FakeActor:
    """Exports two HF-named tensors (what ``MegatronActor.export_hf_state_dict`` returns)."""

    def export_hf_state_dict(self) -> dict[str, torch.Tensor]:
        return {"model.embed_tokens.weight": torch.ones(4, 2), "lm_head.weight": torch.full((4, 2), 2.0)}


class FakeEngine:
    """Records the protocol calls; ``fail`` makes ``receive_bucket`` raise."""

    def __init__(self, version: int = 0, fail: bool = False) -> None:
        self.version, self.fail = version, fail
        self.pending: int | None = None
        self.events: list[str] = []
        self.received: dict[str, torch.Tensor] = {}

    def pause(self) -> None:
        self.events.append("pause")

    def resume(self) -> None:
        self.events.append("resume")

    def begin_weight_update(self, version, metadata) -> None:
        self.pending = version
        self.events.append(f"begin{version}")

    def receive_bucket(self, named) -> None:
        if self.fail:
            raise ConnectionError("engine went away")
        self.received.update({n: t.clone() for n, t in named})

    def end_weight_update(self) -> None:
        self.version, self.pending = self.pending, None
        self.events.append("end")

    def abort_weight_update(self) -> None:
        self.pending = None
        self.events.append("abort")


def test_push_loads_the_oldest_slot_and_all_slots_on_request():
    engines = [FakeEngine(0), FakeEngine(0)]
    pool = VersionPool([[engines[0]], [engines[1]]])
    publisher = WeightPublisher(FakeActor(), pool, SenderOptions(weight_sync_bucket_mb=1))
    publisher.push(0, all_slots=True)
    assert pool.versions == [0, 0] and all(e.events == ["pause", "begin0", "end", "resume"] for e in engines)
    publisher.push(1)
    publisher.push(2)
    assert sorted(pool.versions) == [1, 2]
    assert torch.equal(engines[0].received["lm_head.weight"], torch.full((4, 2), 2.0))
    assert pool.newest_live_slot().version == 2


def test_one_slot_failed_delivery_marks_it_failed_and_resumes_it():
    engine = FakeEngine(0, fail=True)
    pool = VersionPool([[engine]])
    publisher = WeightPublisher(FakeActor(), pool, SenderOptions(weight_sync_bucket_mb=1))
    with pytest.raises(ConnectionError, match="engine went away"):
        publisher.push(1)
    assert engine.events == ["pause", "begin1", "abort", "resume"] and engine.version == 0
    assert pool.slots[0].failed and not pool.slots[0].updating
    with pytest.raises(RuntimeError, match="no live engine slot"):
        pool.newest_live_slot()  # evaluation does not read the half-loaded slot
    engine.fail = False
    publisher.push(2)  # the next sync repairs it
    assert pool.versions == [2] and not pool.slots[0].failed


def test_ranks_without_a_pool_only_take_part_in_the_export():
    exported = []

    class CountingActor(FakeActor):
        def export_hf_state_dict(self):
            exported.append(1)
            return super().export_hf_state_dict()

    WeightPublisher(CountingActor(), None).push(3, all_slots=True)
    assert exported == [1]
