"""Routed experts (MoE rollout routing replay): what the engines return for ``generate(..., routing_from=...)``.

The reference is always one full forward of the Hugging Face model over prompt + generated tokens, its
routers hooked: the experts the engine records for position ``t`` must be those of that forward. Covered:
the local engine (batched prompts of different lengths, left padding, rows that stop early, a multi-turn
continuation asked from a later start, dense layers left out), the batching wrapper and the version pool,
the SGLang client over HTTP against the stand-in (and a server process started with the capture flag),
malformed records refused with a clear error, and a dense model refused.
"""
from __future__ import annotations

import asyncio
import base64
import copy
import dataclasses

import httpx
import numpy as np
import pytest
import torch

from rollout_sglang.engines.batching import BatchingEngine
from rollout_sglang.engines.local import LocalEngine
from rollout_sglang.engines.protocol import EngineUnavailable, SamplingParams
from rollout_sglang.engines.router_capture import RouterCapture, find_routers, routing_layout_from_config
from rollout_sglang.engines.sglang_client import CAPTURE_ROUTING_FLAG, SGLangEngine, SGLangError, SGLangUnavailable
from rollout_sglang.engines.sglang_options import SGLangClientOptions, SGLangLaunchOptions
from rollout_sglang.engines.version_pool import VersionPool
from rollout_sglang.routing import RoutingLayout
from rollout_sglang.testing.sglang_standin import StandInServer
from rollout_sglang.testing.standin_options import StandInOptions
from tests.rollout.support import answer_generate
from tests.support.tiny_models import tiny_config, tiny_model, write_tiny_checkpoint

PROMPTS = [[5, 6, 7, 8, 9, 10, 11, 12, 13], [14, 15], [16, 17, 18, 19, 20]]
STOP = list(range(100, 140))  # a tenth of the vocabulary: some rows stop early and leave the batch


def moe_model(family: str = "qwen3_moe"):
    """A tiny random MoE model of 3 layers; Qwen3-MoE with its middle layer dense (``mlp_only_layers``)."""
    if family == "qwen3_moe":
        import transformers as T

        cfg = tiny_config("qwen3_moe", layers=3)
        cfg.mlp_only_layers = [1]
        torch.manual_seed(0)
        model = T.Qwen3MoeForCausalLM(cfg).eval()
        with torch.no_grad():
            for name, p in model.named_parameters():
                p.copy_(1.0 + 0.1 * torch.randn_like(p) if name.endswith("norm.weight") else 0.1 * torch.randn_like(p))
        return model
    return tiny_model(family, layers=3)[1]


def reference(model: torch.nn.Module, tokens: list[int], start: int) -> np.ndarray:
    """The experts one full forward over ``tokens`` chooses at positions ``[start, len(tokens) - 1)``: ``[n, M, K]``."""
    with torch.no_grad(), RouterCapture(find_routers(model)) as cap:
        model(input_ids=torch.tensor([tokens]))
        chosen = cap.take(1, len(tokens))[0]
    return chosen[start:len(tokens) - 1].numpy()


def same(got: np.ndarray, want: np.ndarray) -> bool:
    """Equal as sets of experts per position and layer (GLM-4.5's router takes an unsorted top-k)."""
    return got.shape == want.shape and bool((np.sort(got, -1) == np.sort(want, -1)).all())


def check_against_reference(engine: LocalEngine, prompts, starts, outs) -> None:
    layout = engine.routing_layout
    for p, s, o in zip(prompts, starts, outs):
        n = len(p) + len(o.token_ids) - 1 - s
        assert o.routed_experts is not None and o.routed_experts.dtype == layout.dtype
        assert o.routed_experts.shape == (max(0, n), len(layout.moe_layers), layout.top_k)
        assert same(o.routed_experts, reference(engine.model, p + o.token_ids, s)), (p, s)


# ----------------------------------------------------------------------------------------- local engine
def test_layouts_of_the_moe_families_and_none_for_dense():
    qwen = LocalEngine(moe_model("qwen3_moe"))
    assert qwen.routing_layout == RoutingLayout(num_layers=3, moe_layers=(0, 2), num_experts=4, top_k=2)
    assert qwen.routing_layout.dtype == np.uint8 and qwen.routing_layout.bytes_per_token == 4
    glm = LocalEngine(moe_model("glm4_moe"))  # its first layer is dense (first_k_dense_replace=1)
    assert glm.routing_layout == RoutingLayout(num_layers=3, moe_layers=(1, 2), num_experts=4, top_k=2)
    assert routing_layout_from_config(glm.model.config) == glm.routing_layout
    assert routing_layout_from_config(tiny_config("qwen2")) is None
    assert LocalEngine.from_config(tiny_config("qwen2"), init_seed=0).routing_layout is None


@pytest.mark.parametrize("family", ["qwen3_moe", "glm4_moe"])
def test_local_engine_records_what_one_full_forward_routes(family):
    engine = LocalEngine(moe_model(family))
    params = SamplingParams(max_new_tokens=8, temperature=1.0, stop_token_ids=STOP, seed=5)
    starts = [0, 1, 5]  # from the first position, one inside the prompt, the prompt's end
    outs = asyncio.run(engine.generate(PROMPTS, params, routing_from=starts))
    assert len({len(o.token_ids) for o in outs}) > 1  # rows left the batch at different steps
    check_against_reference(engine, PROMPTS, starts, outs)
    # the routing changes nothing else: tokens and log-probs are those of a call without it
    plain = asyncio.run(engine.generate(PROMPTS, params))
    assert [o.token_ids for o in plain] == [o.token_ids for o in outs]
    assert all(o.routed_experts is None for o in plain)
    assert np.allclose([x for o in plain for x in o.logprobs], [x for o in outs for x in o.logprobs])


def test_a_later_turn_asks_only_for_its_new_positions():
    engine = LocalEngine(moe_model())
    params = SamplingParams(max_new_tokens=5, temperature=1.0, seed=1)
    first = PROMPTS[0]
    [t1] = asyncio.run(engine.generate([first], params, routing_from=[0]))
    covered = len(first) + len(t1.token_ids) - 1  # the last sampled token was never fed back
    second = first + t1.token_ids + [30, 31, 32]  # + the env's reply
    [t2] = asyncio.run(engine.generate([second], params, routing_from=[covered]))
    episode = second + t2.token_ids
    assert t1.routed_experts.shape[0] + t2.routed_experts.shape[0] == len(episode) - 1
    assert same(np.concatenate([t1.routed_experts, t2.routed_experts]), reference(engine.model, episode, 0))


def test_no_new_tokens_still_routes_the_prompt():
    engine = LocalEngine(moe_model())
    outs = asyncio.run(engine.generate(PROMPTS, SamplingParams(max_new_tokens=0), routing_from=[0, 2, 5]))
    assert [o.token_ids for o in outs] == [[], [], []]
    assert [o.routed_experts.shape[0] for o in outs] == [8, 0, 0]  # [start, len(prompt) - 1)
    check_against_reference(engine, PROMPTS, [0, 2, 5], outs)


def test_bad_routing_requests_are_refused_clearly():
    dense = LocalEngine.from_config(tiny_config("qwen2"), init_seed=0)
    with pytest.raises(ValueError, match="dense model"):
        asyncio.run(dense.generate([[1, 2]], SamplingParams(max_new_tokens=1), routing_from=[0]))
    engine = LocalEngine(moe_model())
    with pytest.raises(ValueError, match=r"routing_from\[0\]=3 must be an int in \[0, 2\]"):
        asyncio.run(engine.generate([[1, 2]], SamplingParams(max_new_tokens=1), routing_from=[3]))
    with pytest.raises(ValueError, match="2 starts for 1 prompts"):
        asyncio.run(engine.generate([[1, 2]], SamplingParams(max_new_tokens=1), routing_from=[0, 0]))


# ------------------------------------------------------------------------------- batching, version pool
class OneCallAtATime:
    """The local engine as an engine that does not batch on its own: :class:`BatchingEngine` merges calls for it."""

    def __init__(self, engine: LocalEngine) -> None:
        self.engine, self.version = engine, engine.version

    async def generate(self, prompts, params, routing_from=None, seeds=None):
        return await self.engine.generate(prompts, params, routing_from=routing_from, seeds=seeds)


@pytest.mark.parametrize("joined", [False, True], ids=["merged-by-the-wrapper", "joined-in-the-engine"])
def test_calls_with_and_without_routing_share_a_batch(joined):
    engine = LocalEngine(moe_model())
    batching = BatchingEngine(engine if joined else OneCallAtATime(engine))
    greedy = SamplingParams(max_new_tokens=6, temperature=0.0, stop_token_ids=STOP)

    async def run():
        return await asyncio.gather(
            batching.generate([PROMPTS[0]], greedy, routing_from=[0]),
            batching.generate(PROMPTS[1:], dataclasses.replace(greedy, max_new_tokens=2), routing_from=[1, 3]),
            batching.generate([PROMPTS[0]], greedy),  # asks no routing
        )

    alone, capped, plain = asyncio.run(run())
    # merged: one engine call for all three; joined: each call goes to the engine, whose loop takes them in
    assert (batching.calls, batching.merged_calls) == ((3, 3) if joined else (1, 3))
    assert plain[0].routed_experts is None and plain[0].token_ids == alone[0].token_ids
    assert all(len(o.token_ids) <= 2 for o in capped)
    check_against_reference(engine, [PROMPTS[0]], [0], alone)
    check_against_reference(engine, PROMPTS[1:], [1, 3], capped)  # cut back to the call's cap, routing too


class FailsOnce:
    """An engine whose first call fails as an unreachable engine's would (the pool re-routes its rows)."""

    def __init__(self, engine) -> None:
        self.engine, self.failed, self.name = engine, False, "flaky"
        self.version = engine.version

    async def generate(self, prompts, params, routing_from=None, seeds=None):
        if not self.failed:
            self.failed = True
            raise EngineUnavailable("flaky: could not be reached")
        return await self.engine.generate(prompts, params, routing_from=routing_from, seeds=seeds)


def test_version_pool_keeps_each_rows_start_through_a_reroute():
    model = moe_model()
    # two engines of the same weights, each its own model: the routers' hooks record every forward of their module
    engines = [FailsOnce(LocalEngine(copy.deepcopy(model))), BatchingEngine(LocalEngine(model))]
    pool = VersionPool([engines], live_timeout_s=30)
    params = SamplingParams(max_new_tokens=4, temperature=1.0, seed=3)
    outs = asyncio.run(pool.generate(PROMPTS, params, keys=["a", "b", "c"], routing_from=[2, 0, 4]))
    assert engines[0].failed and pool.stats["rerouted"] > 0
    check_against_reference(engines[1].engine, PROMPTS, [2, 0, 4], outs)
    with pytest.raises(ValueError, match="2 starts for 3 prompts"):
        asyncio.run(pool.generate(PROMPTS, params, routing_from=[0, 0]))


# ---------------------------------------------------------------------------- SGLang client + stand-in
@pytest.fixture()
def served():
    engine = LocalEngine(moe_model())
    server = StandInServer(engine, StandInOptions(capture_routing=True))
    server.start()
    client = SGLangEngine(server.url, SGLangClientOptions(request_timeout_s=60), routing_layout=engine.routing_layout)
    yield server, client, engine
    server.stop()


def test_sglang_client_gets_the_engines_routing_over_http(served):
    server, client, engine = served
    params = SamplingParams(max_new_tokens=6, temperature=1.0, stop_token_ids=STOP, seed=11)
    starts = [0, 1, 0]
    outs = asyncio.run(client.generate(PROMPTS, params, routing_from=starts))
    check_against_reference(engine, PROMPTS, starts, outs)
    bodies = [b for p, b in server.bodies if p == "/generate"]
    # one request per distinct start (SGLang takes one routed_experts_start_len per request), seeds kept per row
    assert sorted((b["routed_experts_start_len"], len(b["input_ids"])) for b in bodies) == [(0, 2), (1, 1)]
    assert all(b["return_routed_experts"] is True for b in bodies)
    seeds = {tuple(p): sp["sampling_seed"] for b in bodies for p, sp in zip(b["input_ids"], b["sampling_params"])}
    assert [seeds[tuple(p)] for p in PROMPTS] == [11, 12, 13]
    # a start at the prompt's end with one new token: no position, an empty record ("" on the wire)
    [o] = asyncio.run(client.generate([PROMPTS[1]], SamplingParams(max_new_tokens=1), routing_from=[2]))
    assert o.routed_experts.shape == (0, 2, 2)
    # without routing_from the request asks for none
    server.bodies.clear()
    [o] = asyncio.run(client.generate([PROMPTS[1]], SamplingParams(max_new_tokens=2)))
    assert o.routed_experts is None and "return_routed_experts" not in server.bodies[0][1]


def test_stand_in_answers_as_sglang_does(served):
    server, client, engine = served
    layout = engine.routing_layout
    body = {"input_ids": [PROMPTS[0]], "sampling_params": [{"max_new_tokens": 3, "sampling_seed": 1}],
            "return_logprob": True, "return_routed_experts": True, "routed_experts_start_len": 2}
    [item] = httpx.post(f"{server.url}/generate", json=body, timeout=60).json()
    raw = np.frombuffer(base64.b64decode(item["meta_info"]["routed_experts"]), dtype=np.int32)
    full = raw.reshape(-1, layout.num_layers, layout.top_k)  # every decoder layer, as SGLang's capturer
    assert full.shape[0] == len(PROMPTS[0]) + 3 - 1 - 2  # [start, seqlen - 1)
    assert (full[:, 1] == 0).all()  # the dense layer: never written, zeros
    assert same(full[:, list(layout.moe_layers)], reference(engine.model, PROMPTS[0] + item["output_ids"], 2))
    # a start past the prompt: SGLang's scheduler aborts the request, HTTP 400 with its message
    resp = httpx.post(f"{server.url}/generate", json={**body, "routed_experts_start_len": 10}, timeout=60)
    assert resp.status_code == 400 and "is higher than the number of input tokens" in resp.text
    # a server without --enable-return-routed-experts drops the ask: no key, no error
    server.capture_routing = False
    [item] = httpx.post(f"{server.url}/generate", json=body, timeout=60).json()
    assert "routed_experts" not in item["meta_info"]
    with pytest.raises(SGLangError, match=CAPTURE_ROUTING_FLAG) as e:
        asyncio.run(client.generate([PROMPTS[0]], SamplingParams(max_new_tokens=2), routing_from=[0]))
    assert not isinstance(e.value, EngineUnavailable)
    with pytest.raises(ValueError, match="needs a MoE model"):
        StandInServer(LocalEngine.from_config(tiny_config("qwen2"), init_seed=0), StandInOptions(capture_routing=True))


def test_client_without_a_layout_or_with_bad_starts_refuses():
    client = SGLangEngine("http://127.0.0.1:9")
    with pytest.raises(ValueError, match="no routing_layout"):
        asyncio.run(client.generate([[1, 2]], SamplingParams(), routing_from=[0]))
    client.routing_layout = RoutingLayout(2, (1,), 4, 2)
    with pytest.raises(ValueError, match=r"routing_from\[0\]=-1"):
        asyncio.run(client.generate([[1, 2]], SamplingParams(), routing_from=[-1]))


def _fake_answer(routed) -> dict:
    return {"text": "", "output_ids": [5, 6], "meta_info": {
        "id": "r", "finish_reason": {"type": "length", "length": 2}, "prompt_tokens": 3, "completion_tokens": 2,
        "output_token_logprobs": [[-0.5, 5, None], [-0.7, 6, None]], "weight_version": "0", "routed_experts": routed}}


def _b64(arr) -> str:
    return base64.b64encode(np.asarray(arr, dtype=np.int32).tobytes()).decode()


@pytest.mark.parametrize("routed, match", [
    (_b64(np.ones((4, 3, 2))), r"96 bytes, expected 48 \(int32 \[2 positions \[2, 4\), 3 layers, top-2\]\)"),
    (_b64(np.full((2, 3, 2), 7)), r"expert ids in \[7, 7\], outside \[0, 4\)"),
    (_b64(np.full((2, 3, 2), -3)), r"expert ids in \[-3, -3\]"),
    ("not base64!!", r"'not base64!!'\.\.\. is not valid base64"),
    ([1, 2, 3], r"routed_experts is a list"),
], ids=["shape", "ids-too-large", "ids-negative", "bad-base64", "not-a-string"])
def test_malformed_routing_fails_the_call_as_the_engines_failure(routed, match):
    layout = RoutingLayout(num_layers=3, moe_layers=(0, 2), num_experts=4, top_k=2)

    async def run():
        client = SGLangEngine("http://fake-engine:30000", routing_layout=layout)
        answer_generate(client, _fake_answer(routed))
        return await client.generate([[1, 2, 3]], SamplingParams(max_new_tokens=2), routing_from=[2])

    with pytest.raises(SGLangUnavailable, match=match) as e:
        asyncio.run(run())
    assert "malformed routed experts from http://fake-engine:30000" in str(e.value)
    assert isinstance(e.value, EngineUnavailable)  # the pool sends the rows to another engine

    good = np.array([[[1, 9, 2], [3, 9, 0]], [[0, 9, 1], [2, 9, 3]]]).transpose(0, 2, 1)  # [2, 3 layers, 2]
    routed = _b64(good)

    async def ok():
        client = SGLangEngine("http://fake-engine:30000", routing_layout=layout)
        answer_generate(client, _fake_answer(routed))
        return await client.generate([[1, 2, 3]], SamplingParams(max_new_tokens=2), routing_from=[2])

    [o] = asyncio.run(ok())  # the dense layer (index 1, here 9s) is dropped whatever it holds
    assert o.routed_experts.dtype == np.uint8 and o.routed_experts.tolist() == good[:, [0, 2]].tolist()


def test_launch_with_capture_starts_the_server_with_the_flag(tmp_path):
    model_dir = tmp_path / "model"
    write_tiny_checkpoint("qwen3_moe", model_dir, tokenizer=False)
    layout = routing_layout_from_config(model_dir)
    eng = SGLangEngine.launch(model_dir, SGLangLaunchOptions(server_module="rollout_sglang.testing.sglang_standin",
                                                             startup_timeout_s=120, log_dir=tmp_path / "logs",
                                                             capture_routing=True),
                              SGLangClientOptions(request_timeout_s=60), routing_layout=layout)
    try:
        assert CAPTURE_ROUTING_FLAG in eng.process.args
        [o] = asyncio.run(eng.generate([[1, 2, 3, 4]], SamplingParams(max_new_tokens=3, seed=0), routing_from=[1]))
        assert o.routed_experts.shape == (3 + len(o.token_ids) - 1, 2, 2)
    finally:
        eng.shutdown()
