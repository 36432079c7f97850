"""The weight push into the version pool: the oldest slot (or every slot) is drained, paused, loaded
and resumed under the new version; a delivery that fails marks the slot failed, resumes its engines
and ends the push with the error; a sync to servers in other processes that a dying server broke is sent
again at once to the servers left."""
from __future__ import annotations

import pytest
import torch

from megatron_agentrl.weight_sync.options import SenderOptions
from megatron_agentrl.weight_sync.publisher import WeightPublisher
from rollout_sglang.engines.protocol import EngineUnavailable
from rollout_sglang.engines.version_pool import VersionPool
from rollout_sglang.weight_update import WeightSyncError


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


class DyingEngine(FakeEngine):
    """An engine in another process: once ``dead``, every call fails as an unreachable server's does."""

    dead = False

    def pause(self, mode=None) -> None:
        if self.dead:
            raise EngineUnavailable("connection refused")
        super().pause()


class FakeSender:
    """The remote path's sender: the first ``fail`` syncs raise as a broadcast to a server that died does (and
    ``on_fail`` runs: the server is gone); records each sync's targets."""

    def __init__(self, fail: int, on_fail=lambda: None) -> None:
        self.fail, self.on_fail = fail, on_fail
        self.targets: list[list] = []

    def sync(self, version, slot_key=0, targets=None, group_tag=None):
        self.targets.append(list(targets))
        if len(self.targets) <= self.fail:
            self.on_fail()
            raise WeightSyncError(f"weight sync of version {version} failed: Connection reset by peer")


def _remote_publisher(engines, sender, max_failures=3):
    pool = VersionPool([engines])
    publisher = WeightPublisher(FakeActor(), pool, SenderOptions(weight_sync_bucket_mb=1), max_failures=max_failures)
    publisher.remote_slots, publisher.sender = [engines], sender  # the targets are the engines themselves
    return pool, publisher


def test_a_sync_that_a_dying_server_broke_is_sent_again_at_once_to_the_servers_left():
    # one slot of two servers; server 0 dies mid-broadcast. With one slot, leaving the slot failed until the next
    # step's push would stop generation for good (that step's batch is never generated)
    engines = [DyingEngine(0), DyingEngine(0)]
    sender = FakeSender(fail=1, on_fail=lambda: setattr(engines[0], "dead", True))
    pool, publisher = _remote_publisher(engines, sender)
    publisher.push(1)
    assert sender.targets == [engines, [engines[1]]]  # sent again, without the dead server
    assert pool.versions == [1] and not pool.slots[0].failed and not pool.slots[0].updating
    assert engines[1].events == ["pause", "begin1", "abort", "resume", "pause", "begin1", "end", "resume"]
    assert publisher.failed_syncs == 1 and publisher._failures_in_a_row == 0


def test_syncs_failing_in_a_row_end_the_run_within_one_push():
    engines = [DyingEngine(0)]
    pool, publisher = _remote_publisher(engines, FakeSender(fail=10), max_failures=3)
    with pytest.raises(WeightSyncError, match=r"3 weight syncs failed in a row \(rollout.weight_sync_max_failures=3\)"):
        publisher.push(1)
    assert publisher.failed_syncs == 3 and pool.slots[0].failed and not pool.slots[0].updating
