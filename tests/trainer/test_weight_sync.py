"""Bucketed weight sync: buckets, the dedicated gloo group, and a TP=2 / PP=2 actor syncing one slot of engines.

The end-to-end case runs 3 processes: 2 trainer ranks (TP=2 or PP=2 Megatron actor) and one engine host
running three SGLang stand-in servers (local engines): slot 0 = two engines, slot 1 = one. The
trainer drives them exactly as it drives SGLang: HTTP control, gloo broadcast of flat buckets.
"""
from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path

import pytest
import torch

from env_controller.http.net import free_port
from rollout_sglang.testing.checksum import ChecksumMismatch, bucket_checksum, tensors_checksum
from rollout_sglang.testing.transport import StandInReceive, StandInTransport
from rollout_sglang.weight_update import (
    DTYPES,
    BroadcastOptions,
    BucketBroadcaster,
    BucketReceiver,
    SGLangBroadcast,
    WeightSyncError,
    dtype_from_name,
    dtype_name,
    flattened_layout,
    init_weight_group,
    iter_buckets,
    pack,
    plan_buckets,
    unflatten_bytes,
)
from tests.support.dist_utils import run_distributed, wait_for_file

VOCAB = 120


# ------------------------------------------------------------------------------------ buckets
def test_plan_respects_size_dtype_and_order():
    specs = [("a", (10, 10), torch.float32), ("b", (50,), torch.float32), ("c", (30, 10), torch.float32),
             ("d", (8,), torch.bfloat16), ("e", (4,), torch.bfloat16), ("f", (3,), torch.float32)]
    buckets = plan_buckets(specs, bucket_bytes=800)
    assert [b.names for b in buckets] == [["a", "b"], ["c"], ["d", "e"], ["f"]]
    assert buckets[1].nbytes == 1200  # larger than a bucket: a bucket of its own
    assert [b.dtype for b in buckets] == [torch.float32, torch.float32, torch.bfloat16, torch.float32]
    assert [b.index for b in buckets] == [0, 1, 2, 3]
    with pytest.raises(ValueError, match="must be positive"):
        plan_buckets(specs, 0)


def test_pack_unpack_roundtrip_and_streaming_plan_agree():
    g = torch.Generator().manual_seed(0)
    specs = [((3, 4), torch.float32), ((7,), torch.float32), ((2, 2, 2), torch.bfloat16), ((5,), torch.float32)]
    named = [(f"t{i}", torch.randn(*s, generator=g).to(d)) for i, (s, d) in enumerate(specs)]
    streamed = list(iter_buckets(named, bucket_bytes=64))
    planned = plan_buckets([(n, t.shape, t.dtype) for n, t in named], bucket_bytes=64)
    assert [m.names for m, _ in streamed] == [m.names for m in planned]
    for meta, tensors in streamed:
        flat = pack(meta, tensors)
        # raw bytes on the wire: NCCL matches a broadcast by count and type, and SGLang receives uint8
        assert flat.dtype == torch.uint8 and flat.numel() == meta.nbytes
        wire = meta.wire()
        layout, nbytes = flattened_layout(wire["names"], wire["dtypes"], wire["shapes"])
        assert nbytes == meta.nbytes
        back = unflatten_bytes(flat.clone(), layout)
        for (name, t), src in zip(back, tensors):
            assert torch.equal(t, src), name


def test_copy_bytes_is_exact_for_cpu_tensors_and_falls_back_otherwise():
    from rollout_sglang.weight_update.buckets import copy_bytes

    src = torch.randn(300, 7).to(torch.bfloat16)
    dst = torch.zeros(2100, dtype=torch.bfloat16)
    copy_bytes(dst, src)  # the memcpy path (same dtype, contiguous)
    assert torch.equal(dst.view(300, 7), src)
    out = torch.zeros(7, 300)
    copy_bytes(out, src.float().t())  # non-contiguous source: torch's copy
    assert torch.equal(out, src.float().t())


def test_checksum_detects_corruption_and_shifts():
    x = torch.randn(1000)
    c = bucket_checksum(x)
    assert bucket_checksum(x.clone()) == c
    y = x.clone()
    y[10] += 1e-3
    assert bucket_checksum(y) != c
    z = torch.cat([x[1:], x[:1]])  # rotated by one element: the same multiset of words
    assert bucket_checksum(z) != c


def test_flattened_layout_reads_buckets_as_sglang_does():
    # one bucket may mix dtypes, each tensor aligned to its element size (SGLang's FlattenedTensorBucket)
    layout, nbytes = flattened_layout(["a", "b", "c"], ["float32", "bfloat16", "bfloat16"], [[2], [3], [1]])
    assert [(n, d, s, start) for n, d, s, start in layout] == [
        ("a", torch.float32, (2,), 0), ("b", torch.bfloat16, (3,), 8), ("c", torch.bfloat16, (1,), 14)]
    assert nbytes == 16
    raw = torch.cat([torch.tensor([1.0, 2.0]).view(torch.uint8),
                     torch.tensor([3.0, 4.0, 5.0, 6.0], dtype=torch.bfloat16).view(torch.uint8)])
    back = dict(unflatten_bytes(raw, layout))
    assert back["a"].tolist() == [1.0, 2.0] and back["b"].tolist() == [3.0, 4.0, 5.0] and back["c"].tolist() == [6.0]
    with pytest.raises(ValueError, match="same length"):
        flattened_layout(["a"], ["float32", "float32"], [[1]])
    with pytest.raises(ValueError, match="'b' \\(float32\\) would start at byte 2"):
        flattened_layout(["a", "b"], ["bfloat16", "float32"], [[1], [1]])
    with pytest.raises(ValueError, match="negative dimension"):
        flattened_layout(["a"], ["float32"], [[-1]])
    with pytest.raises(ValueError, match="names is empty"):
        flattened_layout([], [], [])
    with pytest.raises(ValueError, match="unknown dtype"):
        flattened_layout(["a"], ["complex32"], [[1]])


def test_dtype_names_round_trip_and_accept_aliases():
    for name, dtype in DTYPES.items():
        assert dtype_name(dtype) == name and dtype_from_name(name) is dtype
    assert dtype_from_name("torch.bfloat16") is torch.bfloat16
    assert dtype_from_name("BF16") is torch.bfloat16 and dtype_from_name("half") is torch.float16
    with pytest.raises(ValueError, match="unknown dtype 'fp8'; expected one of"):
        dtype_from_name("fp8")
    with pytest.raises(ValueError, match="cannot be sent in a weight bucket"):
        dtype_name(torch.complex64)


# ----------------------------------------------------------------------------- transports
class _Target:
    """A weight-update target that only answers which extensions it lists."""

    def __init__(self, name: str, extensions: list[str]) -> None:
        self.name, self.num_ranks, self.extensions = name, 1, extensions

    def has_extension(self, name: str) -> bool:
        return name in self.extensions


def test_transports_tell_each_engine_only_what_it_understands(caplog):
    both, sends_only = _Target("both", ["send_recv", "bucket_checksum"]), _Target("sends", ["send_recv"])
    payload = [torch.arange(6.0), torch.ones(3)]
    assert SGLangBroadcast().request_fields([both, sends_only], payload, packed=False, seq=5) == [{}, {}]
    transport = StandInTransport(checksum=True)
    fields = transport.request_fields([both, sends_only], payload, packed=False, seq=5)
    assert fields[0] == {"agentrl_send_recv_tag": 5, "agentrl_checksum": tensors_checksum(payload)}
    assert fields[1] == {"agentrl_send_recv_tag": 5}  # no checksum for an engine that cannot verify it
    with caplog.at_level("WARNING"):
        transport.check("gloo", [both, sends_only])
    assert "['sends'] cannot verify" in caplog.text
    with pytest.raises(ValueError, match="lacking it: \\['plain'\\]"):
        transport.check("gloo", [_Target("plain", [])])
    assert StandInTransport().small_tensor_bytes < SGLangBroadcast().small_tensor_bytes
    assert StandInTransport(send_recv=False).small_tensor_bytes == SGLangBroadcast().small_tensor_bytes


def test_sender_checksum_needs_a_transport_that_verifies(caplog):
    from types import SimpleNamespace

    from megatron_agentrl.weight_sync import SenderOptions, WeightSender

    actor = SimpleNamespace(dp_rank=0, tp_rank=0, cp_rank=0, ep=1)
    with caplog.at_level("WARNING"):
        plain = WeightSender(actor, SenderOptions(checksum=True))  # SGLang's broadcasts: no checksum field in its API
    assert isinstance(plain.transport, SGLangBroadcast) and "buckets go unverified" in caplog.text
    verified = WeightSender(actor, SenderOptions(checksum=True), transport=StandInTransport(send_recv=False))
    assert verified.transport.checksum and verified.transport.name == "broadcast"
    assert not WeightSender(actor, transport=StandInTransport()).transport.checksum


def test_stand_in_receive_checks_its_fields_and_the_bucket():
    with pytest.raises(ValueError, match="agentrl_send_recv_tag=-1 must be a non-negative integer"):
        StandInReceive(tag=-1)
    with pytest.raises(ValueError, match="agentrl_checksum='x' must be a list of two integers"):
        StandInReceive(checksum="x")
    x = torch.randn(50)
    StandInReceive(checksum=bucket_checksum(x), names=["w"]).verify([x], packed=True)
    with pytest.raises(ChecksumMismatch, match="bucket of 1 tensors \\(w ...\\) arrived with checksum"):
        StandInReceive(checksum=bucket_checksum(x + 1), names=["w"]).verify([x], packed=True)


# ------------------------------------------------------------------------------- the group
def test_group_broadcast_and_init_timeout_in_threads():
    port = free_port()
    groups = {}

    def join(r: int) -> None:
        groups[r] = init_weight_group("127.0.0.1", port, r, 3, "g-test", "gloo", timeout_s=20)

    threads = [threading.Thread(target=join, args=(r,)) for r in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    results = {}

    def recv(r: int) -> None:
        t = torch.zeros(6)
        groups[r].broadcast(t, src=0, timeout_s=20)
        results[r] = t

    threads = [threading.Thread(target=recv, args=(r,)) for r in (1, 2)]
    for t in threads:
        t.start()
    groups[0].broadcast(torch.arange(6.0), src=0, timeout_s=20)
    for t in threads:
        t.join(30)
    assert all(torch.equal(results[r], torch.arange(6.0)) for r in (1, 2))

    # a rank that never joins: the others get a timeout error after init_timeout, not a hang
    from rollout_sglang.weight_update import WeightSyncTimeout

    t0 = time.perf_counter()
    with pytest.raises(WeightSyncTimeout, match="only part of the 2 ranks joined"):
        init_weight_group("127.0.0.1", free_port(), 0, 2, "g-lonely", "gloo", timeout_s=1.5)
    assert time.perf_counter() - t0 < 10


def _sglang_style_rank(rank: int, world: int, port: int) -> list[float]:
    """Rank 0: our trainer-side group; rank 1: the group built the way SGLang's engine builds it."""
    import datetime

    import torch.distributed as dist

    if rank == 0:
        group = init_weight_group("127.0.0.1", port, 0, 2, "compat", "gloo", timeout_s=30)
        group.broadcast(torch.arange(5.0) * 3, src=0)
        return []
    from torch.distributed.distributed_c10d import PrefixStore, _new_process_group_helper, _world, rendezvous

    td = datetime.timedelta(seconds=30)
    store, r, w = next(rendezvous(f"tcp://127.0.0.1:{port}", 1, 2, timeout=td))
    store.set_timeout(td)
    pg, _ = _new_process_group_helper(w, r, [], "gloo", PrefixStore("compat", store), group_name="compat", timeout=td)
    _world.pg_group_ranks[pg] = {i: i for i in range(w)}
    t = torch.zeros(5)
    dist.broadcast(t, src=0, group=pg)
    return t.tolist()


def test_group_rendezvous_matches_sglang_custom_process_group():
    """Our store prefixes meet a group built with torch's registered helper, as SGLang does."""
    out = run_distributed(_sglang_style_rank, 2, free_port(), timeout_s=60)
    assert out[1] == [0.0, 3.0, 6.0, 9.0, 12.0]


def test_checksum_mismatch_fails_the_sync(monkeypatch):
    from transformers import Qwen2Config

    from rollout_sglang.engines.local import LocalEngine
    from rollout_sglang.engines.sglang_client import SGLangEngine
    from rollout_sglang.engines.sglang_options import SGLangClientOptions
    from rollout_sglang.testing.sglang_standin import StandInServer
    from rollout_sglang.testing.standin_options import StandInOptions

    cfg = Qwen2Config(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                      num_key_value_heads=1, max_position_embeddings=32)
    engine = LocalEngine.from_config(cfg, init_seed=0)
    server = StandInServer(engine, StandInOptions(group_timeout_s=20))
    server.start()
    try:
        client = SGLangEngine(server.url, SGLangClientOptions(update_timeout_s=20))
        sender = BucketBroadcaster([client], "ck", BroadcastOptions(
        backend="gloo", weight_sync_init_timeout_s=20, weight_sync_bucket_timeout_s=20),
                                   transport=StandInTransport(checksum=True))
        # the sender's checksum of every bucket is off: what a corrupted transfer looks like to the engine
        monkeypatch.setattr(StandInTransport, "_checksum", staticmethod(lambda payload, packed: [1, 2]))
        client.begin_weight_update(1)
        with pytest.raises(WeightSyncError, match="checksum"):
            sender.send(LocalEngine.from_config(cfg, init_seed=1).model.state_dict().items(), bucket_bytes=1 << 20)
        client.abort_weight_update()
        sender.close()
    finally:
        server.stop()
    r = BucketReceiver()
    with pytest.raises(KeyError, match="not initialised"):
        r.receive(["x"], ["float32"], [[1]], "missing", "flattened_bucket")
    assert issubclass(ChecksumMismatch, RuntimeError)


# ------------------------------------------------------------- TP=2 actor -> slot of engines
def _hf_config(tied: bool, family: str = "qwen2"):
    from tests.support.tiny_models import tiny_config

    return tiny_config(family, tied, vocab=VOCAB)


def _tokens() -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(5))


def _engine_logits(engine) -> torch.Tensor:
    with torch.no_grad():
        return engine.model(_tokens()).logits.float()


def _sync_case(rank: int, world: int, tmp: str, tied: bool, tp: int, pp: int, transport: str, family: str,
               ep: int = 1) -> dict:
    tmpdir = Path(tmp)
    cfg = _hf_config(tied, family)
    if rank == 2:  # the engine host: three stand-ins, slot 0 = engines 0 and 1, slot 1 = engine 2
        from rollout_sglang.engines.local import LocalEngine
        from rollout_sglang.testing.sglang_standin import StandInServer
        from rollout_sglang.testing.standin_options import StandInOptions

        engines = [LocalEngine.from_config(cfg, init_seed=0) for _ in range(3)]
        servers = [StandInServer(e, StandInOptions(group_timeout_s=60)) for e in engines]
        urls = [s.start() for s in servers]
        before = _engine_logits(engines[2])
        (tmpdir / "urls.json.tmp").write_text(json.dumps(urls))
        os.replace(tmpdir / "urls.json.tmp", tmpdir / "urls.json")
        wait_for_file(tmpdir / "done", 120)
        out = {"logits": [_engine_logits(e) for e in engines], "before": before,
               "versions": [e.version for e in engines]}
        out["update_log"] = [line for s in servers for line in s.update_log]
        for s in servers:
            s.stop()
        return out

    os.environ["WORLD_SIZE"] = "2"  # the trainer's own world: ranks 0 and 1
    import torch.distributed as dist
    from megatron.core import parallel_state

    from megatron_agentrl.config import TrainConfig
    from megatron_agentrl.megatron.actor import MegatronActor
    from megatron_agentrl.megatron.parallel import destroy_parallel, initialize_parallel
    from megatron_agentrl.weight_sync import SenderOptions, WeightSender
    from rollout_sglang.engines.sglang_client import SGLangEngine
    from rollout_sglang.engines.sglang_options import SGLangClientOptions
    from rollout_sglang.engines.version_pool import VersionPool

    initialize_parallel(tp, pp, seed=11, ep=ep)
    actor = MegatronActor(cfg, TrainConfig())
    # small_tensor_bytes: matrices one message each, norms packed
    options = SenderOptions(weight_sync_bucket_mb=0.05, weight_sync_init_timeout_s=60, weight_sync_bucket_timeout_s=60,
                            checksum=True, backend="gloo", small_tensor_bytes=4096)
    sender = WeightSender(actor, options, transport=StandInTransport(send_recv=transport == "send_recv"))
    wait_for_file(tmpdir / "urls.json", 120)
    urls = json.loads((tmpdir / "urls.json").read_text())
    box: list = [None]
    pool = None
    if rank == 0:
        clients = [SGLangEngine(u, SGLangClientOptions(request_timeout_s=60, update_timeout_s=60)) for u in urls]
        pool = VersionPool([clients[:2], clients[2:]])
        slot = pool.begin_update(version=1)  # the oldest slot: slot 0 (tie on version 0 -> lowest index)
        box = [slot.index]
    dist.broadcast_object_list(box, src=0)
    if pool is not None:
        targets = pool.slots[box[0]].engines
    else:  # another stage's source rank reaches the same servers with its own clients
        targets = [SGLangEngine(u, SGLangClientOptions(update_timeout_s=60)) for u in (urls[:2], urls[2:])[box[0]]]
    stats = sender.sync(1, slot_key=box[0], targets=targets)
    result: dict = {"bytes": stats.bytes, "buckets": stats.buckets}
    if pool is not None:
        pool.end_update(box[0])
        result["pool_versions"] = pool.versions
        result["client_health"] = [c.health()["server_weight_version"] for c in pool.engines]

    if pp == 1:  # the actor's own logits (vocab-parallel over TP -> gathered, padding stripped)
        actor.ddp.eval()
        with torch.no_grad():
            toks = _tokens()
            pos = torch.arange(toks.shape[1]).unsqueeze(0).expand_as(toks)
            local = actor.model(toks, pos, None).float().contiguous()
            parts = [torch.empty_like(local) for _ in range(actor.tp)]
            dist.all_gather(parts, local, group=parallel_state.get_tensor_model_parallel_group())
            result["logits"] = torch.cat(parts, dim=-1)[..., :VOCAB]
    else:  # PP: the logits of the actor's weights, gathered over the stages (collective)
        from transformers import AutoModelForCausalLM

        state = actor.export_hf_state_dict()
        model = AutoModelForCausalLM.from_config(cfg).eval()
        model.load_state_dict(state, strict=False)
        model.tie_weights()
        result["logits"] = _engine_logits(type("E", (), {"model": model})())
    sender.close()
    destroy_parallel()
    if rank == 0:
        (tmpdir / "done").write_text("ok")
    return result


@pytest.mark.parametrize("tp,pp,ep,tied,transport,family", [(2, 1, 1, False, "send_recv", "qwen2"),
                                                             (1, 2, 1, True, "broadcast", "qwen2"),
                                                             (2, 1, 1, True, "broadcast", "qwen3"),
                                                             (1, 1, 2, False, "broadcast", "glm4_moe")])
def test_actor_syncs_one_slot_and_leaves_the_other(tmp_path, tp, pp, ep, tied, transport, family):
    """TP=2: one source rank, the other TP rank only gathers; PP=2: each stage sends its own
    layers on its own group (the tied embedding from stage 0 only). The stand-ins take
    point-to-point sends (their extension) or, as SGLang does, broadcasts; checksums verified.
    Qwen3: its per-head q/k norms reach the engines under their HF names. GLM-4.5 MoE at EP=2: the
    source sends every expert (half of them gathered from the other EP rank) under the checkpoints'
    per-expert names, with the router's expert bias, the shared expert and the dense first layer."""
    trainer0, trainer1, host = run_distributed(_sync_case, 3, str(tmp_path), tied, tp, pp, transport, family, ep,
                                               timeout_s=240)
    actor_logits = trainer0["logits"]
    assert torch.equal(actor_logits, trainer1["logits"])
    assert trainer0["buckets"] > 1
    assert (trainer1["bytes"] > 0) == (pp == 2)  # a second stage sends its layers; a second TP rank does not
    assert trainer0["pool_versions"] == [1, 0]
    assert trainer0["client_health"] == [1, 1, None]  # slot 1 was never updated: SGLang's "default"
    assert host["versions"] == [1, 1, 0]
    how = transport
    assert {line.split("(")[1] for line in host["update_log"]} == {f"per tensor, {how})", f"flattened_bucket, {how})"}
    for engine_logits in host["logits"][:2]:  # slot 0: the new weights
        torch.testing.assert_close(engine_logits, actor_logits, rtol=1e-4, atol=1e-5)
    # slot 1 kept version 0: its logits are the old ones, not the actor's
    torch.testing.assert_close(host["logits"][2], host["before"], rtol=0, atol=0)
    assert (host["logits"][2] - actor_logits).abs().max() > 1e-2
