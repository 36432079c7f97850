"""In-flight weight updates on an SGLang engine: a generation crosses an update done in a ``pause("retract")`` or
``pause("in_place")``, each token's version comes from SGLang's spans (``meta_info.weight_versions``), and each
mode's flush rules hold. The real client drives the stand-in on loopback (the local engine behind it holds the
running request between two tokens); malformed spans and the client's requests are checked on fake answers.

Where the update lands is made certain: a forward hook holds the engine's model in a chosen forward pass until the
pause has been sent, so the pause takes effect after a known number of tokens.
"""
from __future__ import annotations

import asyncio
import json
import sys
import threading
import time
import types
import zipfile
from typing import Any

import httpx
import pytest
import torch

from rollout_sglang.engines.local import LocalEngine
from rollout_sglang.engines.protocol import EngineUnavailable, SamplingParams
from rollout_sglang.engines.sglang_client import (
    SGLangEngine,
    SGLangError,
    SGLangUnavailable,
    token_versions_from_spans,
)
from rollout_sglang.engines.sglang_options import SGLangClientOptions
from rollout_sglang.testing.sglang_standin import StandInServer, weight_version_spans
from rollout_sglang.testing.standin_options import StandInOptions
from rollout_sglang.weight_update import BroadcastOptions, BucketBroadcaster, BucketUpdate, WeightSyncError
from tests.rollout.support import answer_generate

PROMPT = [3, 14, 15, 92, 65]
LONG = SamplingParams(max_new_tokens=120, temperature=1.0, seed=11)
# the forward pass the pause lands in: the prefill samples token 0 and decode pass j token j - 1, so the engine
# holds the request after OLD_TOKENS tokens of the old weights
OLD_TOKENS = 40
FAKE = "http://fake-engine:30000"


def tiny_config():
    from transformers import Qwen2Config

    return Qwen2Config(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                       num_key_value_heads=2, max_position_embeddings=1024, tie_word_embeddings=False)


def nudged(state: dict[str, torch.Tensor], scale: float = 2e-3) -> dict[str, torch.Tensor]:
    """``state`` after a small step (Gaussian noise of std ``scale``), the size of a policy update."""
    g = torch.Generator().manual_seed(5)
    return {k: v + scale * torch.randn(v.shape, generator=g, dtype=v.dtype) for k, v in state.items()}


def forward_logprobs(state: dict[str, torch.Tensor], prompt: list[int], tokens: list[int]) -> torch.Tensor:
    """log p(token i | prompt, tokens[:i]) under ``state``, from one forward over prompt + tokens (temperature 1)."""
    model = LocalEngine.from_config(tiny_config(), init_seed=0).model
    model.load_state_dict(state)
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([prompt + tokens])).logits[0].float()
    lp = torch.log_softmax(logits[len(prompt) - 1:-1], dim=-1)
    return lp.gather(-1, torch.tensor(tokens)[:, None])[:, 0]


class FlushAskingClient(SGLangEngine):
    """A client whose buckets ask for a flush whatever its pause, to see the server's rule without our client's
    guard (a caller that knows nothing of in-flight pauses)."""

    def update_weights_from_distributed(self, bucket: BucketUpdate, *, last_bucket: bool = False,
                                        timeout_s: float | None = None, extra_fields: Any = None) -> None:
        body = {**bucket.body(), **(extra_fields or {}), "flush_cache": True}
        if last_bucket and self._pending_version is not None:
            body["weight_version"] = str(self._pending_version)
        self._call("POST", "/update_weights_from_distributed", body, timeout_s)


@pytest.fixture()
def served():
    """``make(client_cls) -> (server, client, engine, sender, old weights)``; all stopped afterwards."""
    made: list[tuple[StandInServer, BucketBroadcaster]] = []

    def make(client_cls: type[SGLangEngine] = SGLangEngine):
        engine = LocalEngine.from_config(tiny_config(), init_seed=0)
        old = {k: v.clone() for k, v in engine.model.state_dict().items()}
        server = StandInServer(engine, StandInOptions(group_timeout_s=20))
        server.start()
        client = client_cls(server.url, SGLangClientOptions(request_timeout_s=60, control_timeout_s=10,
                                                            update_timeout_s=30))
        sender = BucketBroadcaster([client], "in-flight", BroadcastOptions(
            backend="gloo", weight_sync_init_timeout_s=20, weight_sync_bucket_timeout_s=20))
        made.append((server, sender))
        return server, client, engine, sender, old

    yield make
    for server, sender in made:
        sender.close()
        server.stop()


class HoldForward:
    """A forward hook that holds ``model`` at the end of its ``n``-th forward pass until :meth:`release`."""

    def __init__(self, model: torch.nn.Module, n: int) -> None:
        self.n, self.calls = n, 0
        self.reached, self._released = threading.Event(), threading.Event()
        self._handle = model.register_forward_hook(self)

    def __call__(self, module: torch.nn.Module, args: Any, output: Any) -> None:
        self.calls += 1
        if self.calls == self.n:
            self.reached.set()
            if not self._released.wait(30):
                raise TimeoutError("the test did not release the held forward pass within 30s")

    def release(self) -> None:
        self._released.set()
        self._handle.remove()


def generate_while(client: SGLangEngine, engine: LocalEngine, mode: str, during: Any) -> Any:
    """The output of :func:`generation_paused`'s request, with ``during()`` run (on a thread) while it is held."""
    async def run():
        task = await generation_paused(client, engine, mode)
        await asyncio.to_thread(during)
        return await asyncio.wait_for(task, 60)

    [out] = asyncio.run(run())
    return out


async def generation_paused(client: SGLangEngine, engine: LocalEngine, mode: str) -> asyncio.Future:
    """``client.generate([PROMPT], LONG)`` as a task, once ``client.pause(mode)`` took effect after ``OLD_TOKENS``
    tokens (the engine holds the request before its next forward pass)."""
    hook = HoldForward(engine.model, OLD_TOKENS)
    task = asyncio.ensure_future(client.generate([PROMPT], LONG))
    try:
        assert await asyncio.to_thread(hook.reached.wait, 30), "the engine did not reach the chosen forward pass"
        await asyncio.to_thread(client.pause, mode)
    finally:
        hook.release()
    return task


def update_across(served, mode: str):
    """A generation in flight across an update to nudged weights (version 1) done in ``pause(mode)``: (output,
    old weights, new weights, server)."""
    server, client, engine, sender, old = served()
    new = nudged(old)

    def update() -> None:
        assert client.health()["pause_mode"] == mode
        client.begin_weight_update(1)
        sender.send(new.items(), bucket_bytes=16 * 1024)
        client.end_weight_update()
        client.resume()

    out = generate_while(client, engine, mode, update)
    assert client.version == 1 and engine.version == 1
    return out, old, new, server


def split_at_update(out) -> int:
    """The position of the first token the new weights sampled, where the update landed: the versions are the
    old (the server's "default", so the call's stamp 0) up to it, then the new (1, from the server's spans)."""
    n, k = len(out.token_ids), OLD_TOKENS
    assert n == LONG.max_new_tokens and out.token_versions == [0] * k + [1] * (n - k)
    assert out.version == 1  # the last token's
    return k


def test_retract_crosses_an_update_exactly(served):
    out, old, new, _ = update_across(served, "retract")
    k = split_at_update(out)
    lp = torch.tensor(out.logprobs)
    old_lp, new_lp = forward_logprobs(old, PROMPT, out.token_ids), forward_logprobs(new, PROMPT, out.token_ids)
    # the old weights sampled the tokens before the update, the new ones (their KV recomputed) those after it
    assert (lp[:k] - old_lp[:k]).abs().max() <= 1e-5
    assert (lp[k:] - new_lp[k:]).abs().max() <= 1e-5
    assert (lp[:k] - new_lp[:k]).abs().max() > 1e-3 and (lp[k:] - old_lp[k:]).abs().max() > 1e-3  # told apart


def test_in_place_crosses_an_update_over_the_old_kv(served):
    out, old, new, server = update_across(served, "in_place")
    k = split_at_update(out)
    lp = torch.tensor(out.logprobs)
    old_lp, new_lp = forward_logprobs(old, PROMPT, out.token_ids), forward_logprobs(new, PROMPT, out.token_ids)
    assert (lp[:k] - old_lp[:k]).abs().max() <= 1e-5
    # after the update: the new weights over context the old weights encoded (the held KV), so not the new
    # weights' own log-probs, but much closer to them than the old weights' are
    off = (lp[k:] - new_lp[k:]).abs()
    step = (old_lp[k:] - new_lp[k:]).abs()
    assert off.max() > 1e-5, "in_place gave the new weights' exact log-probs: was the KV recomputed?"
    assert off.mean() < 0.5 * step.mean(), (off.mean(), step.mean())
    # the update asked for no flush and the client sent none while the request was held (the stand-in, as
    # SGLang, refuses both then)
    held = server.requests[server.requests.index("/pause_generation"):server.requests.index("/continue_generation")]
    assert "/flush_cache" not in held and "/update_weights_from_distributed" in held
    asked = [b.get("flush_cache") for p, b in server.bodies if p == "/update_weights_from_distributed"]
    assert asked and not any(asked)


@pytest.mark.parametrize("mode", ["in_place", "retract"])
def test_the_stand_in_flushes_as_sglang_while_requests_are_held(served, mode):
    """SGLang's scheduler flushes only when idle, ignoring its waiting queue while paused: in_place keeps the held
    request in the running batch (flush and an update asking for one fail), retract moves it to the waiting
    queue (both succeed)."""
    server, client, engine, sender, old = served(FlushAskingClient)
    new = nudged(old)

    def held() -> None:
        client.begin_weight_update(1)
        if mode == "in_place":
            with pytest.raises(SGLangError, match="HTTP 400.*requests are still running"):
                client.flush_cache()
            with pytest.raises(WeightSyncError, match="the cache was not flushed because requests are still running"):
                sender.send(new.items(), bucket_bytes=1 << 20)
            client.abort_weight_update()
        else:
            client.flush_cache()
            sender.send(new.items(), bucket_bytes=1 << 20)
            client.end_weight_update()
        client.resume()

    out = generate_while(client, engine, mode, held)
    assert len(out.token_ids) == LONG.max_new_tokens
    if mode == "retract":  # the update went through: the tokens after the pause are the new version's
        assert out.token_versions == [0] * OLD_TOKENS + [1] * (LONG.max_new_tokens - OLD_TOKENS)
    client.flush_cache()  # idle again: accepted in either mode


# ------------------------------------------------------------------------------------------- fake answers
def answer(spans: Any = None, ids: Any = (5, 6), **meta: Any) -> dict:
    """An SGLang ``/generate`` answer of one row with ``ids`` and, unless None, ``weight_versions`` ``spans``."""
    ids = list(ids)
    m = {"id": "r", "finish_reason": {"type": "length", "length": len(ids)}, "prompt_tokens": 3,
         "completion_tokens": len(ids), "cached_tokens": 0, "weight_version": "0", "e2e_latency": 0.01,
         "output_token_logprobs": [[-0.5, t, None] for t in ids], **meta}
    if spans is not None:
        m["weight_versions"] = spans
    return {"text": "", "output_ids": ids, "meta_info": m}


def generate_on(item: Any, version: int = 3):
    """The client's ``generate`` of one prompt against a server that answers ``[item]``."""

    async def run():
        client = SGLangEngine(FAKE, version=version)
        answer_generate(client, item)
        return await client.generate([[1, 2, 3]], SamplingParams(max_new_tokens=2))

    return asyncio.run(run())


def span(version: Any, start: Any, end: Any) -> dict:
    return {"version": version, "start": start, "end": end}


@pytest.mark.parametrize("spans, match", [
    ({"version": "1"}, r"weight_versions is dict .*not a non-empty list"),
    ([], r"weight_versions is list \[\], not a non-empty list"),
    (["1"], r"weight_versions\[0\] is str '1', not an object"),
    ([span(1, 0, 2)], r"weight_versions\[0\]\.version is int 1, not a string"),
    ([span("1", 0, 2.0)], r"weight_versions\[0\]\.end is float 2\.0, not an integer"),
    ([span("1", False, 2)], r"weight_versions\[0\]\.start is bool False, not an integer"),
    ([{"version": "1", "start": 0}], r"weight_versions\[0\]\.end is NoneType None"),
    ([span("1", 0, 2), span("2", 1, 2)], r"weight_versions\[1\] starts at 1 but the spans before it end at 2: it "
                                         r"overlaps"),
    ([span("1", 0, 1), span("2", 2, 2)], r"weight_versions\[1\] starts at 2 .* leaves a gap"),
    ([span("1", 0, 1)], r"covers output tokens \[0, 1\) of 2"),
    ([span("1", 0, 3)], r"weight_versions\[0\] ends at 3, past the 2 output tokens"),
    ([span("1", 1, 2)], r"weight_versions\[0\] starts at 1 but the spans before it end at 0"),
    ([span("1", 0, 1), span("2", 1, 0)], r"weight_versions\[1\] ends at 0, before its start 1"),
], ids=["object", "empty", "not-a-span", "int-version", "float-bound", "bool-bound", "missing-end", "overlap",
        "gap", "short", "past-the-end", "late-start", "backwards"])
def test_malformed_spans_fail_the_call_naming_what_is_wrong(spans, match):
    with pytest.raises(SGLangUnavailable, match=match) as e:
        generate_on(answer(spans))
    assert f"malformed weight versions from {FAKE} (/generate on {FAKE}, row 0)" in str(e.value)
    assert isinstance(e.value, SGLangError) and isinstance(e.value, EngineUnavailable)  # another engine is tried


@pytest.mark.parametrize("item, match", [
    ("oops", r"row 0: the answer is str 'oops', not a JSON object"),
    ({"output_ids": [5], "meta_info": ["x"]}, r"meta_info is list \['x'\], not a JSON object"),
    (answer(output_token_logprobs=[["x", 5, None], [-0.2, 6, None]]), r"output_token_logprobs are malformed"),
    (answer(output_token_logprobs=[None, None]), r"output_token_logprobs are malformed"),
    ({**answer(), "output_ids": [5, {"a": 1}]}, r"output_ids / output_token_logprobs are malformed"),
], ids=["not-an-object", "meta-not-an-object", "logprob-text", "logprob-null", "id-object"])
def test_a_hostile_answer_is_an_sglang_error_not_a_crash(item, match):
    with pytest.raises(SGLangError, match=match):
        generate_on(item)


def test_token_versions_come_from_the_spans_with_the_stamp_for_versions_not_ours():
    [o] = generate_on(answer([span("default", 0, 1), span("7", 1, 2)]), version=3)
    assert o.token_versions == [3, 7] and o.version == 7  # "default" is no version of ours: the call's stamp
    [o] = generate_on(answer(None), version=3)  # a server without spans: the stamp for every token
    assert o.token_versions == [3, 3] and o.version == 3
    [o] = generate_on(answer([span("5", 0, 0)], ids=[]), version=3)  # no tokens: the one (empty) span's version
    assert o.token_ids == [] and o.token_versions == [] and o.version == 5


# ------------------------------------------------------------------------------------------ what is sent
class Recorded:
    """The client's requests, answered as SGLang would (success everywhere, a flush accepted)."""

    def __init__(self) -> None:
        self.requests: list[tuple[str, Any]] = []

    def __call__(self, request: httpx.Request) -> httpx.Response:
        body = request.read()
        self.requests.append((request.url.path, json.loads(body) if body else None))
        if request.url.path == "/flush_cache":
            return httpx.Response(200, text="Cache flushed.\n")
        if request.url.path == "/model_info":
            return httpx.Response(200, json={"weight_version": "1"})
        return httpx.Response(200, json={"success": True, "message": "ok"})

    def paths(self) -> list[str]:
        return [p for p, _ in self.requests]


def recorded_client() -> tuple[SGLangEngine, Recorded]:
    client, rec = SGLangEngine(FAKE, SGLangClientOptions(control_timeout_s=5, update_timeout_s=5)), Recorded()
    client._local.client = httpx.Client(transport=httpx.MockTransport(rec))
    return client, rec


def update_in(client: SGLangEngine, rec: Recorded, version: int) -> dict:
    """One update to ``version`` whose bucket asks for a flush; the bucket request's body."""
    client.begin_weight_update(version)
    client.update_weights_from_distributed(BucketUpdate(["a"], ["float32"], [[2]], "g", flush_cache=True),
                                           last_bucket=True)
    client.end_weight_update()
    return [b for p, b in rec.requests if p == "/update_weights_from_distributed"][-1]


def test_an_in_place_update_neither_asks_for_a_flush_nor_flushes():
    client, rec = recorded_client()
    client.pause("in_place")
    assert rec.requests[-1] == ("/pause_generation", {"mode": "in_place"})
    body = update_in(client, rec, 1)
    assert body["flush_cache"] is False and body["weight_version"] == "1"
    assert "/flush_cache" not in rec.paths() and client.version == 1
    health = client.health()
    assert health["pause_mode"] == "in_place" and health["server_pause_mode"] == "in_place"
    assert health["stale_prefix_cache"] and health["server_weight_version"] == 1
    client.resume()
    assert client.health()["pause_mode"] is None and client.health()["stale_prefix_cache"]
    client.flush_cache()  # later, when the server is idle: the old weights' KV is gone
    assert not client.health()["stale_prefix_cache"]


def test_retract_and_drained_updates_flush_as_before():
    client, rec = recorded_client()
    client.pause("retract")
    body = update_in(client, rec, 1)
    assert body["flush_cache"] is True and rec.paths()[-2:] == ["/end_weight_update", "/flush_cache"]
    client.resume()
    client.pause()  # drained: the configured mode, 'abort' by default
    assert rec.requests[-1] == ("/pause_generation", {"mode": "abort"})
    assert client.health()["pause_mode"] is None and client.health()["server_pause_mode"] == "abort"
    body = update_in(client, rec, 2)
    assert body["flush_cache"] is True and rec.paths()[-2:] == ["/end_weight_update", "/flush_cache"]
    assert not client.health()["stale_prefix_cache"]
    client.resume()
    with pytest.raises(ValueError, match=r"pause mode 'abort' is not one of \['in_place', 'retract'\]"):
        client.pause("abort")


# ---------------------------------------------------------------------------------------- the wheel's spans
@pytest.fixture(scope="module")
def wheel_spans(wheel) -> types.ModuleType:
    """SGLang's ``srt/utils/weight_versions.py`` from the wheel (pure Python on msgspec), as a module."""
    pytest.importorskip("msgspec")
    with zipfile.ZipFile(wheel) as z:
        src = z.read("sglang/srt/utils/weight_versions.py").decode()
    line = "from sglang.srt.utils.msgspec_utils import msgspec_struct_pydantic_core_schema\n"
    assert line in src, "the wheel's weight_versions.py changed its imports; update this loader"
    module = types.ModuleType("sglang_wheel_weight_versions")
    module.msgspec_struct_pydantic_core_schema = lambda cls, handler: None
    sys.modules[module.__name__] = module  # dataclasses look their module up
    exec(compile(src.replace(line, ""), "sglang/srt/utils/weight_versions.py", "exec"), module.__dict__)
    return module


def test_the_stand_ins_spans_are_the_wheels_and_the_client_reads_them_back(wheel_spans):
    g = torch.Generator().manual_seed(0)
    cases = [[], [4], [0, 0, 0], [0, 0, 1, 1, 1], [2, 3, 3, 4]]
    cases += [torch.randint(0, 3, (int(torch.randint(1, 12, (1,), generator=g)),), generator=g).tolist()
              for _ in range(200)]
    for versions in cases:
        names = ["default" if v == 0 else str(v) for v in versions]
        n = len(names)
        # the scheduler records an event at each update a live request crosses: the old version, the tokens so far
        events = [wheel_spans.WeightVersionEvent(old_version=names[i - 1], num_output_tokens=i)
                  for i in range(1, n) if names[i] != names[i - 1]]
        current = names[-1] if names else "9"
        meta: dict[str, Any] = {}
        wheel_spans.add_weight_versions_to_meta_info(
            meta, wheel_spans.compute_weight_version_spans(events, current_version=current, num_output_tokens=n), n)
        ours = weight_version_spans(names, current)
        assert ours == meta["weight_versions"] and ours[-1]["version"] == meta["weight_version"], versions
        read, last = token_versions_from_spans(ours, n, stamp=0)  # "default" is no version of ours: the stamp 0
        assert read == versions and last == (versions[-1] if versions else 9)


def test_a_server_left_paused_mid_update_serves_again_once_taken_over():
    """A trainer that died between pause and continue leaves the server paused with its weight-update session open: it
    then fails every /health_generate probe (as SGLang's does), so a new run takes it over first."""
    with StandInServer(LocalEngine.from_config(tiny_config(), init_seed=0)) as server:
        dead = SGLangEngine(server.url, version=0)
        dead.pause("retract")
        dead.begin_weight_update(1)
        fresh = SGLangEngine(server.url, version=0)
        assert not fresh.probe(timeout_s=1.0).ok  # paused: the probe gets no answer in time
        fresh.take_over()
        assert fresh.probe(timeout_s=5.0).ok
        (out,) = asyncio.run(fresh.generate([[3, 4]], SamplingParams(max_new_tokens=3)))
        assert len(out.token_ids) == 3
        fresh.begin_weight_update(1)  # the stale session was closed: a new update opens
        fresh.abort_weight_update()


def test_the_pool_flushes_the_prefix_cache_an_in_place_update_left_once_the_server_is_idle():
    """An in_place update skips SGLang's flush (requests are held in its running batch), so the prefix cache keeps
    old-weights KV; the version pool's health checks flush it when the server has no request of ours."""
    from rollout_sglang.engines.batching import BatchingEngine
    from rollout_sglang.engines.version_pool import VersionPool

    with StandInServer(LocalEngine.from_config(tiny_config(), init_seed=0)) as server:
        client = SGLangEngine(server.url, version=0)
        client.pause("in_place")
        client.begin_weight_update(1)
        client.end_weight_update()
        client.resume()
        assert client.health()["stale_prefix_cache"]
        pool = VersionPool([[BatchingEngine(client)]])
        pool._inflight[0] = 1  # a request of ours runs: no flush yet
        pool.start_health_checks(0.05, 5.0)
        try:
            time.sleep(0.5)
            assert client.health()["stale_prefix_cache"]
            with pool._lock:
                pool._inflight[0] = 0
            deadline = time.monotonic() + 10
            while client.health()["stale_prefix_cache"]:
                assert time.monotonic() < deadline, "the owed flush never came"
                time.sleep(0.05)
        finally:
            pool.stop_health_checks()
