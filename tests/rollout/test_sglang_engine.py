"""The SGLang client against the SGLang stand-in (loopback HTTP, local engine behind it).

Covers generate (token ids + log-probs), the weight-update group (init, bucketed update over
gloo, destroy), pause / continue, flush, the server launcher, and that a stalled server ends in
a timeout error rather than a hang.
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import re
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import torch

from rollout_sglang.engines.local import LocalEngine
from rollout_sglang.engines.protocol import SamplingParams, row_seeds
from rollout_sglang.engines.sglang_client import SGLangEngine, SGLangError, SGLangTimeout, sampling_params_to_sglang
from rollout_sglang.engines.sglang_options import SGLangClientOptions, SGLangLaunchOptions
from rollout_sglang.testing.sglang_standin import StandInServer
from rollout_sglang.testing.standin_options import StandInOptions
from rollout_sglang.testing.transport import StandInTransport
from rollout_sglang.weight_update import BroadcastOptions, BucketBroadcaster, BucketUpdate, WeightSyncError


def tiny_config():
    from transformers import Qwen2Config

    return Qwen2Config(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                       num_key_value_heads=2, max_position_embeddings=128, tie_word_embeddings=False)


@pytest.fixture()
def served():
    """(server, client, engine behind the server, a second engine with other weights)."""
    cfg = tiny_config()
    engine = LocalEngine.from_config(cfg, init_seed=0)
    other = LocalEngine.from_config(cfg, init_seed=1)
    server = StandInServer(engine, StandInOptions(group_timeout_s=20))
    server.start()
    client = SGLangEngine(server.url, SGLangClientOptions(request_timeout_s=30, control_timeout_s=10,
                                                          update_timeout_s=30))
    yield server, client, engine, other
    server.stop()


def test_sampling_params_follow_the_per_row_seed_rule():
    def sp_for(params: SamplingParams, rows: int, seeds=None):
        return sampling_params_to_sglang(params, row_seeds([[1]] * rows, params, seeds))

    sp = sp_for(SamplingParams(max_new_tokens=4, seed=10, stop_token_ids=[3]), 3)
    assert [x["sampling_seed"] for x in sp] == [10, 11, 12]
    assert sp[0]["stop_token_ids"] == [3] and sp[0]["no_stop_trim"] is True
    # a call's seeds name each row's, in place of seed + i (the version pool's rows of one engine)
    assert [x["sampling_seed"] for x in sp_for(SamplingParams(seed=10), 3, [10, 12, 15])] == [10, 12, 15]
    # unseeded: still one seed per row (SGLang's deterministic sampler would give every unseeded row
    # seed 42), a fresh base per call
    a, b = (sp_for(SamplingParams(), 2) for _ in range(2))
    assert a[1]["sampling_seed"] == a[0]["sampling_seed"] + 1 and a[0]["sampling_seed"] != b[0]["sampling_seed"]
    assert all(0 <= x["sampling_seed"] < 2**63 for x in a + b)
    mixed = sp_for(SamplingParams(), 2, [7, None])
    assert mixed[0]["sampling_seed"] == 7 and mixed[1]["sampling_seed"] != 7
    with pytest.raises(ValueError, match="seeds has 1 seeds for 2 prompts"):
        sp_for(SamplingParams(), 2, [1])
    with pytest.raises(ValueError, match=r"seeds\[1\]=-1: a row's seed must be an int in \[0, 2\*\*63\)"):
        sp_for(SamplingParams(), 2, [1, -1])


@pytest.mark.parametrize("wire_format", ["per_tensor", "flattened_bucket"])
def test_client_generate_update_pause_continue(served, wire_format):
    server, client, engine, other = served
    prompts = [[1, 2, 3, 4], [5, 6]]
    params = SamplingParams(max_new_tokens=6, temperature=0.8, top_p=0.9, stop_token_ids=[7], seed=42)

    # generate: token ids and log-probs exactly as the local engine samples them (same per-row seeds)
    outs = asyncio.run(client.generate(prompts, params))
    ref = asyncio.run(engine.generate(prompts, params))
    assert [o.token_ids for o in outs] == [r.token_ids for r in ref]
    for o, r in zip(outs, ref):
        assert o.logprobs == pytest.approx(r.logprobs, abs=1e-6)
    assert all(o.version == 0 and len(o.token_ids) == len(o.logprobs) for o in outs)

    # init group + bucketed update over gloo: the served weights become `other`'s, version stamped
    sender = BucketBroadcaster([client], "test-group", BroadcastOptions(
        backend="gloo", weight_sync_init_timeout_s=20, weight_sync_bucket_timeout_s=20, wire_format=wire_format,
                                                                        small_tensor_bytes=1024),
                               transport=StandInTransport(checksum=True))
    assert client.has_extension("bucket_checksum")  # the stand-in's extension; real SGLang servers do not list it
    client.begin_weight_update(3)
    stats = sender.send(other.model.state_dict().items(), bucket_bytes=16 * 1024)
    kinds = {line.split("(")[1] for line in server.update_log}
    # per_tensor: matrices one message each, the small norms packed; flattened: everything packed;
    # the stand-in's transport on gloo: the tensors come as point-to-point sends
    assert sender.transport.name == "send_recv"
    assert kinds == ({"per tensor, send_recv)", "flattened_bucket, send_recv)"} if wire_format == "per_tensor"
                     else {"flattened_bucket, send_recv)"})
    client.end_weight_update()
    assert stats.buckets > 3 and client.version == 3 and engine.version == 3
    for name, t in other.model.state_dict().items():
        assert torch.equal(engine.model.state_dict()[name], t), name
    outs = asyncio.run(client.generate(prompts, params))
    assert all(o.version == 3 for o in outs)
    assert client.health()["server_weight_version"] == 3

    # pause: a request waits (it is not refused) until continue
    client.pause()
    assert server.engine.health()["paused"]

    async def gen_while_paused() -> tuple[list, float]:
        task = asyncio.ensure_future(client.generate([[1, 2]], SamplingParams(max_new_tokens=2)))
        await asyncio.sleep(0.5)
        assert not task.done()
        t0 = time.perf_counter()
        await asyncio.to_thread(client.resume)
        return await task, time.perf_counter() - t0

    res, waited = asyncio.run(gen_while_paused())
    assert len(res[0].token_ids) == 2 and waited < 10
    client.flush_cache()
    sender.close()
    expected = ["/generate", "/server_info", "/begin_weight_update", "/init_weights_update_group",
                "/update_weights_from_distributed", "/end_weight_update", "/flush_cache", "/pause_generation",
                "/continue_generation", "/destroy_weights_update_group"]
    assert set(expected) <= set(server.requests)


def test_bad_requests_give_clear_errors(served):
    server, client, engine, _ = served
    with pytest.raises(SGLangError, match="outside the model vocabulary"):
        asyncio.run(client.generate([[10_000]], SamplingParams(max_new_tokens=2)))
    with pytest.raises(SGLangError, match="nccl"):
        client.init_weights_update_group("127.0.0.1", 1, 1, 2, "g", backend="nccl", timeout_s=5)
    client.begin_weight_update(1)
    with pytest.raises(SGLangError, match="not initialised"):
        client.update_weights_from_distributed(BucketUpdate(["model.norm.weight"], ["float32"], [[32]], "nope"),
                                               timeout_s=5)
    client.abort_weight_update()
    dead = SGLangEngine("http://127.0.0.1:9", SGLangClientOptions(control_timeout_s=2))
    with pytest.raises(SGLangError, match="could not be reached"):
        dead.pause()
    assert dead.health()["ok"] is False


def test_stalled_server_times_out_instead_of_hanging(served):
    server, _, engine, other = served
    client = SGLangEngine(server.url, SGLangClientOptions(request_timeout_s=1.5, control_timeout_s=1.0,
                                                          update_timeout_s=1.0))
    server.stall()
    t0 = time.perf_counter()
    with pytest.raises(SGLangTimeout, match="/generate"):
        asyncio.run(client.generate([[1, 2, 3]], SamplingParams(max_new_tokens=2)))
    with pytest.raises(SGLangTimeout, match="/pause_generation"):
        client.pause()
    with pytest.raises(SGLangTimeout):
        client.flush_cache()
    # weight sync to a stalled engine: the group never forms -> a timeout error, not a hang
    sender = BucketBroadcaster([client], "stalled-group", BroadcastOptions(
        backend="gloo", weight_sync_init_timeout_s=2, weight_sync_bucket_timeout_s=2))
    with pytest.raises(WeightSyncError, match="could not be formed|failed to join|rank count"):
        sender.send(other.model.state_dict().items(), bucket_bytes=1 << 20)
    assert time.perf_counter() - t0 < 20
    server.stall(False)
    assert client.health()["ok"]
    sender.close()


def test_send_recv_goes_only_to_engines_that_offer_it(served):
    """An engine that does not list the send_recv extension (as SGLang's servers do not) gets broadcasts."""
    server, client, engine, other = served
    state = other.model.state_dict()
    assert client.has_extension("send_recv")
    sglang_like = SGLangEngine(server.url, SGLangClientOptions(update_timeout_s=30))
    sglang_like._extensions = ["bucket_checksum"]  # what /server_info would list without the extension
    sender = BucketBroadcaster([sglang_like], "g-bcast", BroadcastOptions(
        backend="gloo", weight_sync_init_timeout_s=20, weight_sync_bucket_timeout_s=20, small_tensor_bytes=1024))
    assert sender.transport.name == "broadcast"
    sglang_like.begin_weight_update(4)
    sender.send(state.items(), bucket_bytes=16 * 1024)
    sglang_like.end_weight_update()
    assert server.update_log and all(line.endswith(", broadcast)") for line in server.update_log)
    for name, t in state.items():
        assert torch.equal(engine.model.state_dict()[name], t), name
    with pytest.raises(ValueError, match="send_recv extension .*lacking it: \\['http"):
        sender.send(state.items(), bucket_bytes=16 * 1024, transport=StandInTransport())
    with pytest.raises(ValueError, match="does not list the send_recv extension"):
        StandInTransport().request_fields([client, sglang_like], [state["model.norm.weight"]], packed=False, seq=0)
    with pytest.raises(ValueError, match="would replace SGLang's own request fields"):
        sglang_like.update_weights_from_distributed(BucketUpdate(["model.norm.weight"], ["float32"], [[32]], "g-bcast"),
                                                    timeout_s=5, extra_fields={"group_name": "other"})
    sender.close()
    client.begin_weight_update(5)
    with pytest.raises(SGLangError, match="agentrl_send_recv_tag=-1 must be a non-negative integer"):
        client._call("POST", "/update_weights_from_distributed", {
            "names": ["model.norm.weight"], "dtypes": ["float32"], "shapes": [[32]], "group_name": "g-bcast",
            "agentrl_send_recv_tag": -1}, 5)
    client.abort_weight_update()
    with pytest.raises(ValueError, match="for gloo groups"):
        BucketBroadcaster([client], "g-nccl", BroadcastOptions(backend="nccl"), transport=StandInTransport())


@pytest.mark.parametrize("send_recv", [True, False])
def test_stalled_update_times_out_per_bucket(served, send_recv):
    """The group forms (inside a first sync), then the engine stops answering: the bucket's transfer times out."""
    server, _, engine, other = served
    client = SGLangEngine(server.url, SGLangClientOptions(control_timeout_s=2.0, update_timeout_s=2.0))
    transport = StandInTransport() if send_recv else None  # None: SGLang's broadcasts
    sender = BucketBroadcaster([client], "bucket-stall", BroadcastOptions(
        backend="gloo", weight_sync_init_timeout_s=10, weight_sync_bucket_timeout_s=2), transport=transport)
    client.begin_weight_update(1)
    sender.send(other.model.state_dict().items(), bucket_bytes=1 << 20)
    client.end_weight_update()
    client.begin_weight_update(2)
    server.stall()
    t0 = time.perf_counter()
    with pytest.raises(WeightSyncError, match="did not finish within|no answer"):
        sender.send(other.model.state_dict().items(), bucket_bytes=1 << 20)
    assert time.perf_counter() - t0 < 15
    server.stall(False)
    sender.close()


def test_launch_waits_for_health_and_reports_failures(tmp_path, monkeypatch, caplog):
    cfg = tiny_config()
    model_dir = tmp_path / "model"
    LocalEngine.from_config(cfg, init_seed=0).model.save_pretrained(model_dir)

    with caplog.at_level(logging.INFO, logger="rollout_sglang.engines.sglang_client"):
        eng = SGLangEngine.launch(model_dir, SGLangLaunchOptions(server_module="rollout_sglang.testing.sglang_standin",
                                                                 startup_timeout_s=120, log_dir=tmp_path / "logs",
                                                                 server_args={"mem_fraction_static": 0.8,
                                                                              "context_length": "32k",
                                                                              "enable_torch_compile": True}),
                                  SGLangClientOptions(request_timeout_s=60, api_key="k-api-123",
                                                      admin_api_key="k-admin-456"))
    try:
        assert eng.health()["ok"]
        # the server got the user's flags (SGLang reports its server args by field name)
        info = eng.server_info()
        assert (info["mem_fraction_static"], info["context_length"], info["enable_torch_compile"]) == ("0.8", "32k",
                                                                                                       True)
        out = asyncio.run(eng.generate([[1, 2, 3]], SamplingParams(max_new_tokens=3, seed=0)))
        assert len(out[0].token_ids) == 3
        # the server took the client's keys: a request without them is refused
        request = urllib.request.Request(eng.base_url + "/generate", data=b'{"input_ids": [1]}',
                                         headers={"Content-Type": "application/json"})
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(request, timeout=10)
        assert refused.value.code == 401
        assert "--api-key <hidden> --admin-api-key <hidden>" in caplog.text and "k-api-123" not in caplog.text
    finally:
        eng.shutdown()
    assert eng.process is None

    with pytest.raises(SGLangError, match="exited with code"):
        SGLangEngine.launch(tmp_path / "missing", SGLangLaunchOptions(
            server_module="rollout_sglang.testing.sglang_standin", startup_timeout_s=120, log_dir=tmp_path / "logs"))

    # a server that dies and leaves a child (a scheduler) behind: the failed launch's shutdown reaches the child too
    child_pid = tmp_path / "child.pid"
    (tmp_path / "orphaning_server.py").write_text(
        "import subprocess, sys\n"
        f"child = subprocess.Popen(['sleep', '300'])\nopen({str(child_pid)!r}, 'w').write(str(child.pid))\n"
        "sys.exit(3)\n")
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    with pytest.raises(SGLangError, match="exited with code 3"):
        SGLangEngine.launch(model_dir, SGLangLaunchOptions(server_module="orphaning_server", startup_timeout_s=60,
                                                           log_dir=tmp_path / "logs", python=sys.executable))
    pid = int(child_pid.read_text())
    deadline = time.monotonic() + 10
    while _alive(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _alive(pid), "the dead server's child outlived its shutdown"

    (tmp_path / "slow_server.py").write_text("import time\ntime.sleep(120)\n")
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    t0 = time.perf_counter()
    with pytest.raises(SGLangTimeout, match="not healthy within"):
        SGLangEngine.launch(model_dir, SGLangLaunchOptions(server_module="slow_server", startup_timeout_s=2,
                                                           log_dir=tmp_path / "logs", python=sys.executable))
    assert time.perf_counter() - t0 < 30


def _alive(pid: int) -> bool:
    """Whether process ``pid`` runs (a zombie waiting for its reaper does not)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"


def test_every_concurrent_request_reaches_the_server_at_once():
    """SGLang's scheduler batches only what reached it: a busy rollout's requests (here 300, past httpx's default
    pool of 100) are all open at the server at once, turn after turn."""
    n = 300

    async def main() -> list[int]:
        open_now = peak = 0
        peaks = []
        all_in = asyncio.Event()

        async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            nonlocal open_now, peak
            try:
                while True:
                    head = await reader.readuntil(b"\r\n\r\n")
                    length = int(re.search(rb"content-length: *(\d+)", head, re.I).group(1))
                    seq = json.loads(await reader.readexactly(length))["input_ids"][0]
                    open_now += 1
                    peak = max(peak, open_now)
                    if open_now >= n:
                        all_in.set()
                    with contextlib.suppress(asyncio.TimeoutError):
                        await asyncio.wait_for(all_in.wait(), 3.0)
                    open_now -= 1
                    logprobs = [[None, seq[0], None]] + [[-0.5, t, None] for t in seq[1:]]
                    out = json.dumps([{"meta_info": {"input_token_logprobs": logprobs}}]).encode()
                    writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n%s"
                                 % (len(out), out))
                    await writer.drain()
            except (asyncio.IncompleteReadError, ConnectionError):
                pass
            finally:
                writer.close()

        server = await asyncio.start_server(handle, "127.0.0.1", 0, backlog=1024)
        client = SGLangEngine(f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}",
                              SGLangClientOptions(request_timeout_s=30))
        try:
            for _ in range(2):  # two turns of every episode
                scores = await asyncio.gather(*(client.score([[1, 2, 3]]) for _ in range(n)))
                assert all(s == [[0.0, -0.5, -0.5]] for s in scores)
                peaks.append(peak)
                all_in.clear()
                peak = 0
        finally:
            server.close()
        return peaks

    assert asyncio.run(main()) == [n, n]


def test_an_https_server_is_called_through_httpx_with_the_same_errors():
    """The pooled client speaks plain HTTP; an ``https://`` server gets httpx, and an unreachable one is the same
    SGLangUnavailable (the version pool sends its rows elsewhere)."""
    from env_controller.http.net import free_port
    from rollout_sglang.engines.sglang_client import HttpxPool, SGLangUnavailable

    client = SGLangEngine(f"https://127.0.0.1:{free_port()}", SGLangClientOptions(request_timeout_s=5))

    async def run() -> None:
        with pytest.raises(SGLangUnavailable, match="could not be reached"):
            await client.generate([[1, 2, 3]], SamplingParams(max_new_tokens=2))
        assert isinstance(client._pools[asyncio.get_running_loop()], HttpxPool)

    asyncio.run(run())
