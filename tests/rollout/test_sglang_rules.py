"""The rules SGLang 0.5.23 sets for a client, enforced by the stand-in and kept by our client and weight sync.

Each test reproduces one way a real run against SGLang would fail: a weight update outside the
server's update session, a trainer that waits for the group before the engines join (SGLang's NCCL
communicator forms at the first bucket), a TP=2 server joined as one rank, equal samples in a GRPO
group under deterministic inference, a flattened bucket sent as typed elements instead of raw
bytes, a group name reused after a failed destroy, and servers that want an admin key.
"""
from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest
import torch

from env_controller.http.net import address_towards
from rollout_sglang.engines.local import LocalEngine
from rollout_sglang.engines.protocol import SamplingParams
from rollout_sglang.engines.sglang_client import SGLangEngine, SGLangError
from rollout_sglang.engines.sglang_options import SGLangClientOptions
from rollout_sglang.engines.version_pool import VersionPool
from rollout_sglang.testing.sglang_standin import StandInServer
from rollout_sglang.testing.standin_options import StandInOptions
from rollout_sglang.weight_update import (
    BroadcastOptions,
    BucketBroadcaster,
    BucketUpdate,
    SGLangBroadcast,
    WeightSyncError,
)

DEMO = Path(__file__).resolve().parents[2] / "examples" / "configs" / "tiny_cpu.yaml"


def tiny_config():
    from transformers import Qwen2Config

    return Qwen2Config(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                       num_key_value_heads=2, max_position_embeddings=128, tie_word_embeddings=False)


@pytest.fixture()
def standin():
    """``make(**server_options) -> (server, engine behind it)``; every server is stopped afterwards."""
    servers = []

    def make(**options):
        engine = LocalEngine.from_config(tiny_config(), init_seed=0)
        server = StandInServer(engine, StandInOptions(group_timeout_s=20, **options))
        server.start()
        servers.append(server)
        return server, engine

    yield make
    for s in servers:
        s.stop()


def other_weights(dtype: torch.dtype = torch.float32, seed: int = 1) -> dict[str, torch.Tensor]:
    model = LocalEngine.from_config(tiny_config(), init_seed=seed).model
    return {k: v.to(dtype) for k, v in model.state_dict().items()}


def assert_served(engine: LocalEngine, state: dict[str, torch.Tensor]) -> None:
    served = engine.model.state_dict()
    for name, t in state.items():
        assert torch.equal(served[name], t.to(served[name].dtype)), name


def in_session(client: SGLangEngine, version: int, fn) -> None:
    """``fn()`` inside the server's weight-update session for ``version``, opened and closed by the client
    alone (no version pool, no pause), so that a test checks one rule alone (the session itself is
    covered above)."""
    client.begin_weight_update(version)
    try:
        fn()
    except BaseException:
        client.abort_weight_update()
        raise
    client.end_weight_update()


def client_of(server: StandInServer, **kwargs) -> SGLangEngine:
    return SGLangEngine(server.url, SGLangClientOptions(request_timeout_s=30, control_timeout_s=10,
                                                        update_timeout_s=20, **kwargs))


# ------------------------------------------------------------------------------ the update session
def test_the_stand_in_refuses_updates_outside_a_session(standin):
    server, _ = standin()
    client = client_of(server)
    with pytest.raises(SGLangError, match="must run between begin_weight_update"):
        client.update_weights_from_distributed(BucketUpdate(["model.norm.weight"], ["float32"], [[32]], "g"),
                                               timeout_s=5)
    client._call("POST", "/begin_weight_update", {})
    with pytest.raises(SGLangError, match="already open"):
        client._call("POST", "/begin_weight_update", {})
    client._call("POST", "/end_weight_update", {})
    with pytest.raises(SGLangError, match="no weight-update session is open"):
        client._call("POST", "/end_weight_update", {})


def test_a_pool_update_opens_and_closes_the_servers_session(standin):
    server, engine = standin()
    client = client_of(server)
    pool = VersionPool([[client]])
    state = other_weights()
    sender = BucketBroadcaster([client], "session", BroadcastOptions(
        backend="gloo", weight_sync_init_timeout_s=20, weight_sync_bucket_timeout_s=20))
    slot = pool.begin_update(1, timeout_s=10)
    sender.send(state.items(), bucket_bytes=16 * 1024)
    pool.end_update(slot)
    assert_served(engine, state)
    assert client.version == 1 and engine.version == 1
    order = [p for p in server.requests if p in ("/begin_weight_update", "/update_weights_from_distributed",
                                                 "/end_weight_update", "/flush_cache")]
    assert order[0] == "/begin_weight_update" and order[-2:] == ["/end_weight_update", "/flush_cache"]
    # the pool told the client the version once; the buckets carry it to the server on the last only,
    # as SGLang's string
    stamps = [b.get("weight_version") for p, b in server.bodies if p == "/update_weights_from_distributed"]
    assert len(stamps) > 1 and stamps[-1] == "1" and not any(stamps[:-1])
    assert client.health()["server_weight_version"] == 1

    # a failed update closes the session (the next begins cleanly) and stamps no version
    slot = pool.begin_update(2, timeout_s=10)
    pool.abort_update(slot)
    assert client.version == 1
    slot = pool.begin_update(3, timeout_s=10)
    sender.send(state.items(), bucket_bytes=16 * 1024)
    pool.end_update(slot)
    assert client.version == 3
    sender.close()


def test_a_session_left_open_by_a_dead_trainer_is_closed_first(standin, caplog):
    server, engine = standin()
    client_of(server)._call("POST", "/begin_weight_update", {})  # a trainer that died mid-update
    client = client_of(server)
    with caplog.at_level("WARNING"):
        client.begin_weight_update(5)
    assert "still had a weight-update session open" in caplog.text
    client.end_weight_update()
    assert client.version == 5


# ------------------------------------------------------------------------ the group forms lazily
def test_the_group_forms_inside_the_first_bucket(standin):
    """SGLang on NCCL joins the group's collectives only when the first bucket is received: a trainer
    that waits for the group before sending the first request would hang."""
    server, engine = standin(lazy_join=True)
    client = client_of(server)
    state = other_weights()
    sender = BucketBroadcaster([client], "lazy", BroadcastOptions(
        backend="gloo", weight_sync_init_timeout_s=15, weight_sync_bucket_timeout_s=15))
    t0 = time.perf_counter()
    client.begin_weight_update(1)
    sender.send(state.items(), bucket_bytes=16 * 1024)
    client.end_weight_update()
    assert time.perf_counter() - t0 < 10
    assert_served(engine, state)
    sender.close()


def test_an_engine_that_refuses_the_first_bucket_fails_fast(standin):
    server, _ = standin(lazy_join=True)
    client = client_of(server)  # no session opened: the engine refuses the first bucket before joining
    sender = BucketBroadcaster([client], "refused", BroadcastOptions(
        backend="gloo", weight_sync_init_timeout_s=60, weight_sync_bucket_timeout_s=60))
    t0 = time.perf_counter()
    with pytest.raises(WeightSyncError, match="refused the first bucket before joining.*begin_weight_update"):
        sender.send(other_weights().items(), bucket_bytes=16 * 1024)
    assert time.perf_counter() - t0 < 15
    sender.close()


# --------------------------------------------------------------------- TP > 1, reachable address
@pytest.mark.parametrize("lazy", [True, False])
def test_a_tp2_server_joins_with_both_ranks(standin, lazy):
    """A slot of a TP=2 server and a TP=1 server: four ranks, so the broadcast runs as a tree (rank 0's
    transfer ending says nothing about the ranks below), synced twice."""
    server, engine = standin(tp_size=2, lazy_join=lazy)
    client = client_of(server)  # no num_ranks: asked from /server_info
    assert client.num_ranks == 2
    other_server, other_engine = standin(lazy_join=lazy)  # one backend per job: all lazy or all eager
    other_client = client_of(other_server)
    sender = BucketBroadcaster([client, other_client], "tp2", BroadcastOptions(
        backend="gloo", weight_sync_init_timeout_s=15, weight_sync_bucket_timeout_s=15))
    for version, wire_format in ((1, "flattened_bucket"), (2, "per_tensor")):
        state = other_weights(seed=version)
        for c in (client, other_client):
            c.begin_weight_update(version)
        sender.send(state.items(), bucket_bytes=16 * 1024, wire_format=wire_format)
        for c in (client, other_client):
            c.end_weight_update()
        assert sender.world_size == 4  # the trainer + 2 ranks + 1 rank
        assert_served(engine, state)  # (and rank 1 received the same bytes: the stand-in checks it)
        assert_served(other_engine, state)
    sender.close()


def test_servers_whose_ranks_would_collide_are_refused(standin, monkeypatch):
    server, _ = standin()
    client = client_of(server)
    monkeypatch.setattr(client, "server_info", lambda: {"tp_size": 2, "pp_size": 1, "dp_size": 2})
    with pytest.raises(SGLangError, match="dp_size=2.*one server per data-parallel replica"):
        _ = client.num_ranks


def test_the_master_address_is_the_one_that_routes_to_the_engines():
    from megatron_agentrl.config import ConfigError, load_config
    from megatron_agentrl.pipeline.rollout_side import weight_sync_master_address

    assert address_towards("127.0.0.1") == "127.0.0.1"
    cfg = load_config(DEMO, ['rollout.engine_urls=[["http://127.0.0.1:30000"], ["http://127.0.0.1:30001"]]'])
    assert weight_sync_master_address(cfg) == "127.0.0.1"
    cfg = load_config(DEMO, ['rollout.engine_urls=[["http://127.0.0.1:30000"], ["http://127.0.0.1:30001"]]',
                             "rollout.weight_sync_master_address=10.1.2.3"])
    assert weight_sync_master_address(cfg) == "10.1.2.3"
    with pytest.raises((ConfigError, ValueError), match="weight_sync_master_address"):
        load_config(DEMO, ["rollout.weight_sync_master_address=http://10.1.2.3:80"])


# --------------------------------------------------------------- seeds under deterministic inference
def test_a_group_samples_differently_under_deterministic_inference(standin):
    server, _ = standin(deterministic=True)
    client = client_of(server)
    params = SamplingParams(max_new_tokens=8, temperature=1.0)  # no seed: the run did not ask for one
    prompt = [1, 2, 3, 4]
    outs = asyncio.run(client.generate([prompt] * 4, params))  # one GRPO group in one call
    assert len({tuple(o.token_ids) for o in outs}) > 1
    again = asyncio.run(client.generate([prompt], params))  # and call after call
    assert len({tuple(o.token_ids) for o in outs + again}) > 1
    seeded = SamplingParams(max_new_tokens=8, temperature=1.0, seed=7)  # a seeded run stays reproducible
    a, b = (asyncio.run(client.generate([prompt] * 2, seeded)) for _ in range(2))
    assert [o.token_ids for o in a] == [o.token_ids for o in b] and a[0].token_ids != a[1].token_ids


def test_flush_is_refused_while_requests_run(standin):
    server, _ = standin()
    client = client_of(server)

    async def run() -> None:
        gen = asyncio.ensure_future(client.generate([[1, 2, 3]], SamplingParams(max_new_tokens=4)))
        deadline = time.monotonic() + 10
        while not server._running and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        with pytest.raises(SGLangError, match="requests are still running"):
            await asyncio.to_thread(client.flush_cache)
        server.engine.resume()
        await gen

    server.engine.pause()  # holds the request inside the server while flush is asked
    asyncio.run(run())
    client.flush_cache()  # idle again: accepted


# ----------------------------------------------------------------------- raw bytes, names, keys
class RecordingBroadcast(SGLangBroadcast):
    """SGLang's transport, noting the dtype of every tensor it puts on the wire."""

    def __init__(self) -> None:
        super().__init__()
        self.wire_dtypes: list[torch.dtype] = []

    def post(self, group, payload, seq):
        self.wire_dtypes += [t.dtype for t in payload]
        return super().post(group, payload, seq)


def test_a_flattened_bucket_goes_out_as_raw_bytes(standin):
    """SGLang receives a flattened bucket into a uint8 tensor; NCCL matches a broadcast by count and
    type, so a bf16 view of the same bytes would not meet it."""
    server, engine = standin(lazy_join=False)
    client = client_of(server)
    state = other_weights(torch.bfloat16)
    transport = RecordingBroadcast()
    sender = BucketBroadcaster([client], "raw", BroadcastOptions(
        backend="gloo", weight_sync_init_timeout_s=15, weight_sync_bucket_timeout_s=15, wire_format="flattened_bucket"),
                               transport=transport)
    in_session(client, 1, lambda: sender.send(state.items(), bucket_bytes=16 * 1024))
    assert transport.wire_dtypes and set(transport.wire_dtypes) == {torch.uint8}
    assert_served(engine, state)
    sender.close()


def test_a_new_group_gets_a_fresh_name_after_a_failed_destroy(standin):
    server, engine = standin(lazy_join=False)
    server.refuse_destroy = True  # the old group stays registered on the engine, as after a failed destroy
    client = client_of(server)
    state = other_weights()
    sender = BucketBroadcaster([client], "renamed", BroadcastOptions(
        backend="gloo", weight_sync_init_timeout_s=15, weight_sync_bucket_timeout_s=15))
    names = []
    for version in (1, 2):
        in_session(client, version, lambda: sender.send(state.items(), bucket_bytes=16 * 1024))
        names.append(sender.group_name)
        sender.close_group()  # destroy fails on the server; the next group must not reuse the name
    assert names[0] != names[1] and all(n.startswith("renamed-") for n in names)
    assert engine.version == 2
    sender.close()


def test_admin_endpoints_take_the_admin_key(standin):
    server, engine = standin(api_key="user-key", admin_api_key="admin-key")
    user = client_of(server, api_key="user-key")
    asyncio.run(user.generate([[1, 2]], SamplingParams(max_new_tokens=2)))  # NORMAL: the API key
    with pytest.raises(SGLangError, match="HTTP 401.*admin_api_key"):
        user.pause()
    admin = client_of(server, api_key="user-key", admin_api_key="admin-key")
    admin.pause()
    state = other_weights()
    sender = BucketBroadcaster([admin], "keys", BroadcastOptions(
        backend="gloo", weight_sync_init_timeout_s=15, weight_sync_bucket_timeout_s=15))
    admin.begin_weight_update(1)
    sender.send(state.items(), bucket_bytes=16 * 1024)
    admin.end_weight_update()
    admin.resume()
    assert_served(engine, state)
    assert admin.health()["ok"]
    sender.close()
