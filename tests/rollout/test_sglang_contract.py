"""Our SGLang client against SGLang 0.5.23's own request definitions, read from its wheel.

The wheel is fetched once into the cache (``pip download --no-deps``; ``.ci/run`` fetches it ahead);
the wheel-reading tests skip, naming the reason, only when it cannot be had. The committed contract
must equal what the wheel says, every body the client sends must fit the endpoint's request class,
and ``/generate`` bodies must pass SGLang's own generated decoder.
"""
from __future__ import annotations

import ast
import asyncio
import base64
import re
import threading
import zipfile
from pathlib import Path

import numpy as np
import pytest
from aiohttp import web

from rollout_sglang.engines.protocol import SamplingParams
from rollout_sglang.engines.sglang_client import CAPTURE_ROUTING_FLAG, SGLangEngine
from rollout_sglang.engines.sglang_options import SGLangClientOptions
from rollout_sglang.routing import RoutingLayout
from rollout_sglang.testing.sglang_contract import (
    SGLANG_PIN,
    ContractError,
    extract_contract,
    load_contract,
)
from rollout_sglang.weight_update import BucketUpdate

ROOT = Path(__file__).resolve().parents[2]
# the routing layout the recorded client asks with: 3 layers, the middle one dense, 4 experts, top-2
LAYOUT = RoutingLayout(num_layers=3, moe_layers=(0, 2), num_experts=4, top_k=2)


class Recorder:
    """A loopback HTTP server that records each request's JSON body and answers like SGLang would."""

    def __init__(self) -> None:
        self.bodies: list[tuple[str, str, object]] = []
        self.url = ""
        self._ready = threading.Event()
        self._loop: asyncio.AbstractEventLoop | None = None

    async def _handle(self, request: web.Request) -> web.Response:
        body = await request.json() if request.body_exists else None
        self.bodies.append((request.method, request.path, body))
        if request.path == "/generate":
            rows = len(body["input_ids"])
            item = {"text": "", "output_ids": [5, 6], "meta_info": {
                "id": "r", "finish_reason": {"type": "length", "length": 2}, "prompt_tokens": 2,
                "completion_tokens": 2, "cached_tokens": 0, "output_token_logprobs": [[-0.5, 5, None], [-0.7, 6, None]],
                "weight_version": "0", "e2e_latency": 0.01}}
            items = [item] * rows
            if body.get("return_routed_experts"):  # as SGLang: int32 [start, seqlen - 1) x every layer x top-k
                start = body.get("routed_experts_start_len", 0)
                items = [{**item, "meta_info": {**item["meta_info"], "routed_experts": base64.b64encode(np.zeros(
                    (len(p) + 2 - 1 - start, LAYOUT.num_layers, LAYOUT.top_k), np.int32).tobytes()).decode()}}
                    for p in body["input_ids"]]
            return web.json_response(items)
        if request.path == "/server_info":
            return web.json_response({"tp_size": 1, "pp_size": 1, "dp_size": 1})
        if request.path in ("/pause_generation", "/continue_generation"):
            return web.json_response({"message": "ok", "status": "ok"})
        if request.path == "/flush_cache":
            return web.Response(text="Cache flushed.\n")
        return web.json_response({"success": True, "message": "ok"})

    def __enter__(self) -> "Recorder":
        def run() -> None:
            loop = asyncio.new_event_loop()
            self._loop = loop
            app = web.Application()
            app.router.add_route("*", "/{tail:.*}", self._handle)
            runner = web.AppRunner(app, access_log=None)
            loop.run_until_complete(runner.setup())
            site = web.TCPSite(runner, "127.0.0.1", 0)
            loop.run_until_complete(site.start())
            self.url = f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"
            self._ready.set()
            loop.run_forever()
            loop.run_until_complete(runner.cleanup())

        threading.Thread(target=run, daemon=True).start()
        assert self._ready.wait(10)
        return self

    def __exit__(self, *exc) -> None:
        assert self._loop is not None
        self._loop.call_soon_threadsafe(self._loop.stop)


def client_bodies() -> list[tuple[str, str, object]]:
    """Every kind of request SGLangEngine sends, as it sends them."""
    with Recorder() as rec:
        c = SGLangEngine(rec.url, SGLangClientOptions(control_timeout_s=10, update_timeout_s=10, request_timeout_s=10))
        asyncio.run(c.generate([[1, 2], [3, 4, 5]], SamplingParams(max_new_tokens=2, temperature=0.7, top_p=0.9,
                                                                   top_k=20, stop_token_ids=[2], seed=3)))
        asyncio.run(c.generate([[1, 2]], SamplingParams(max_new_tokens=2)))  # unseeded
        c.routing_layout = LAYOUT  # routed experts: one request per start
        asyncio.run(c.generate([[1, 2], [3, 4, 5], [6]], SamplingParams(max_new_tokens=2, seed=1),
                               routing_from=[0, 3, 0]))
        c.routing_layout = None
        c.pause()
        c.resume()
        c.flush_cache()
        assert c.num_ranks == 1
        c.begin_weight_update(1)
        c.init_weights_update_group("10.0.0.4", 29500, 1, 2, "agentrl-slot0-pp0-0123abcd", backend="nccl")
        c.update_weights_from_distributed(BucketUpdate(["a", "b"], ["bfloat16", "bfloat16"], [[2, 3], [4]], "g",
                                                       load_format="flattened_bucket", flush_cache=False),
                                          last_bucket=True)
        c.update_weights_from_distributed(BucketUpdate(["a"], ["float32"], [[2]], "g", flush_cache=False))
        c.end_weight_update()
        c.begin_weight_update(2)
        c.abort_weight_update()
        c.destroy_weights_update_group("g")
    return rec.bodies


# --------------------------------------------------------------------------- the contract itself
def test_the_committed_contract_is_the_wheels(wheel):
    fresh = extract_contract(wheel)
    committed = load_contract().data
    diff = sorted(k for k in set(fresh) | set(committed) if fresh.get(k) != committed.get(k))
    assert not diff, (f"rollout_sglang/testing/sglang_contract_*.json differs from {wheel.name} in {diff}; "
                      "regenerate it: python -m rollout_sglang.testing.sglang_contract --wheel W --out JSON")
    assert committed["sglang"] == SGLANG_PIN


def test_the_pin_is_the_sglang_extras():
    assert re.search(rf'"sglang": \["sglang=={re.escape(SGLANG_PIN)}"\]', (ROOT / "setup.py").read_text())


def test_every_client_body_fits_sglangs_request_classes():
    contract = load_contract()
    bodies = client_bodies()
    seen = {path for _, path, _ in bodies}
    assert {"/generate", "/pause_generation", "/continue_generation", "/flush_cache", "/init_weights_update_group",
            "/update_weights_from_distributed", "/begin_weight_update", "/end_weight_update",
            "/destroy_weights_update_group", "/server_info"} <= seen
    for method, path, body in bodies:
        contract.check_request(path, body, method=method)  # raises, naming the field, on any mismatch
        if isinstance(body, dict):
            assert set(body) <= contract.fields(path), (path, sorted(set(body) - contract.fields(path)))
    # the control endpoints SGLang guards with the admin key
    assert {p for p in contract.paths if contract.auth_level(p) == "ADMIN_OPTIONAL"} == {
        "/pause_generation", "/continue_generation", "/flush_cache", "/init_weights_update_group",
        "/update_weights_from_distributed", "/begin_weight_update", "/end_weight_update",
        "/destroy_weights_update_group", "/load_lora_adapter", "/unload_lora_adapter",
        "/load_lora_adapter_from_tensors"}


def test_generate_bodies_pass_sglangs_own_decoder(api_types):
    bodies = [b for _, p, b in client_bodies() if p == "/generate"]
    assert len(bodies) == 4
    for body in bodies:
        api_types.GenerateRequest.from_json_value(body)
        assert all("sampling_seed" in sp for sp in body["sampling_params"])  # every row seeded


def test_the_contract_agrees_with_sglangs_decoder(api_types):
    contract = load_contract()
    good = {"input_ids": [[1, 2]], "sampling_params": [{"max_new_tokens": 3, "sampling_seed": 4}],
            "return_logprob": True}
    bad = [
        {"input_ids": [[1]], "sampling_params": {"max_new_token": 3}},  # unknown sampling key: rejected
        {"input_ids": [[1]], "sampling_params": {"max_new_tokens": "3"}},  # wrong type
        {"input_ids": [[1]], "sampling_params": {"temperature": "hot"}},
        {"input_ids": [[1]], "sampling_params": {"sampling_seed": True}},  # a bool is not an int
        {"input_ids": [[1]], "stream": "yes"},
    ]
    api_types.GenerateRequest.from_json_value(good)
    contract.check_request("/generate", good)
    for body in bad:
        with pytest.raises(api_types.JsonContractError):
            api_types.GenerateRequest.from_json_value(body)
        with pytest.raises(ContractError):
            contract.check_request("/generate", body)


def test_stand_in_answers_decode_as_sglang_responses(api_types):
    from transformers import Qwen2Config

    from rollout_sglang.engines.local import LocalEngine
    from rollout_sglang.testing.sglang_standin import StandInServer

    cfg = Qwen2Config(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, max_position_embeddings=128, tie_word_embeddings=False)
    server = StandInServer(LocalEngine.from_config(cfg, init_seed=0))
    server.start()
    try:
        client = SGLangEngine(server.url, SGLangClientOptions(request_timeout_s=30))
        import httpx

        body = {"input_ids": [[1, 2, 3]], "sampling_params": [{"max_new_tokens": 3, "sampling_seed": 1}],
                "return_logprob": True}
        answer = httpx.post(f"{client.base_url}/generate", json=body, timeout=30).json()
        for item in answer:
            api_types.GenerateResponse.from_json_value(item)
    finally:
        server.stop()


def test_contract_rules_name_the_field_and_the_fix():
    contract = load_contract()
    ok = {"names": ["a"], "dtypes": ["float32"], "shapes": [[2]], "group_name": "g"}
    contract.check_request("/update_weights_from_distributed", ok)
    with pytest.raises(ContractError, match=r"\['agentrl_checksum'\] are not fields .* silently ignore"):
        contract.check_request("/update_weights_from_distributed", {**ok, "agentrl_checksum": [1, 2]})
    contract.check_request("/update_weights_from_distributed", {**ok, "agentrl_checksum": [1, 2]},
                           allow_extra={"agentrl_checksum"})
    with pytest.raises(ContractError, match="required field 'master_port'"):
        contract.check_request("/init_weights_update_group", {"master_address": "h", "rank_offset": 1,
                                                              "world_size": 2})
    with pytest.raises(ContractError, match="mode='pause'"):
        contract.check_request("/pause_generation", {"mode": "pause"})
    with pytest.raises(ContractError, match="shapes=.*List\\[List\\[int\\]\\]"):
        contract.check_request("/update_weights_from_distributed", {**ok, "shapes": [["2"]]})
    with pytest.raises(ContractError, match="serves it with"):
        contract.check_request("/begin_weight_update", {}, method="GET")
    with pytest.raises(ContractError, match="not an endpoint"):
        contract.check_request("/update_weights_from_tensor", {})


# --------------------------------------------------------------------------- routed experts (MoE, R3)
def test_routed_experts_requests_fit_generate_req_input():
    contract = load_contract()
    routed = [b for _, p, b in client_bodies() if p == "/generate" and b.get("return_routed_experts")]
    # SGLang takes one routed_experts_start_len per request: the client sends one request per start
    assert sorted((b["routed_experts_start_len"], b["input_ids"]) for b in routed) == [(0, [[1, 2], [6]]),
                                                                                       (3, [[3, 4, 5]])]
    target = contract.data["classes"]["GenerateReqInput"]["fields"]
    assert target["return_routed_experts"]["type"] == "bool" and target["routed_experts_start_len"]["type"] == "int"
    assert "return_routed_experts" not in contract.data["classes"]["GenerateRequest"]["fields"]  # the gate ignores it
    assert contract.route("/generate")["target"] == "GenerateReqInput"
    with pytest.raises(ContractError, match="return_routed_experts='yes' does not match GenerateReqInput"):
        contract.check_request("/generate", {"input_ids": [[1]], "return_routed_experts": "yes"})
    with pytest.raises(ContractError, match="routed_experts_start_len=.*GenerateRequest"):  # the gate checks it
        contract.check_request("/generate", {"input_ids": [[1]], "routed_experts_start_len": [0, 1]})


def test_routed_experts_layout_is_the_wheels():
    """What the client decodes (and the stand-in sends) is what SGLang 0.5.23's source says a response is."""
    facts = load_contract().data["routed_experts"]
    # the server option, a bool field of the server args, is the flag --enable-return-routed-experts
    assert facts["server_option"] == {"name": "enable_return_routed_experts", "default": False}
    assert CAPTURE_ROUTING_FLAG == "--" + facts["server_option"]["name"].replace("_", "-")
    # the capturer's host buffer: int32 [token slots, num_hidden_layers, num_experts_per_tok] (zeroed, so a dense
    # layer, which no router writes, reads 0)
    [alloc] = facts["host_buffer"]
    assert alloc.startswith("alloc((num_tokens, num_layers, topk_size), dtype=torch.int32")
    assert facts["num_layers"] == "model_config.hf_text_config.num_hidden_layers"
    assert facts["top_k"] == "model_config.hf_text_config.num_experts_per_tok"
    # positions [start, seqlen - 1) of prompt + output (the start clamped to seqlen - 1)
    assert facts["positions"] == ["start_len:seqlen - 1"] and facts["start_clamp"] == "min(start_len, seqlen - 1)"
    assert facts["seqlen"] == "len(req.origin_input_ids) + len(req.output_ids_through_stop)"
    # base64 of the raw bytes, read back as int32 by SGLang's own helper
    assert facts["encoding"] == ["pybase64.b64encode(item.numpy().tobytes())"]
    assert facts["decoding"] == ["np.frombuffer(pybase64.b64decode(routed_experts_base64.encode('utf-8')), "
                                 "dtype=np.int32)"]


def test_stand_in_routed_experts_decode_with_sglangs_own_helper(wheel, api_types):
    """The stand-in's answer, decoded by ``extract_routed_experts_from_meta_info`` taken from the wheel."""
    from rollout_sglang.engines.local import LocalEngine
    from rollout_sglang.testing.sglang_standin import StandInServer
    from rollout_sglang.testing.standin_options import StandInOptions
    from tests.support.tiny_models import tiny_model

    with zipfile.ZipFile(wheel) as z:
        tree = ast.parse(z.read("sglang/srt/state_capturer/routed_experts.py").decode())
    name = "extract_routed_experts_from_meta_info"
    fn = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == name)
    scope = {"np": np, "pybase64": base64}
    exec(compile(ast.Module([fn], []), "routed_experts.py", "exec"), scope)
    extract = scope[name]

    engine = LocalEngine(tiny_model("glm4_moe", layers=3)[1])  # layer 0 dense
    layout = engine.routing_layout
    server = StandInServer(engine, StandInOptions(capture_routing=True))
    server.start()
    try:
        import httpx

        prompt = [3, 4, 5, 6, 7]
        body = {"input_ids": [prompt], "sampling_params": [{"max_new_tokens": 4, "sampling_seed": 2}],
                "return_logprob": True, "return_routed_experts": True, "routed_experts_start_len": 1}
        server.contract.check_request("/generate", body)
        [item] = httpx.post(f"{server.url}/generate", json=body, timeout=60).json()
        api_types.GenerateResponse.from_json_value(item)  # meta_info.routed_experts: an extra key, ignored
        flat = extract(item)
        assert flat.dtype == np.int32
        full = flat.reshape(-1, layout.num_layers, layout.top_k)
        assert full.shape[0] == len(prompt) + len(item["output_ids"]) - 1 - 1
        assert (full[:, 0] == 0).all()
        [again] = asyncio.run(engine.generate([prompt], SamplingParams(max_new_tokens=4, seed=2), routing_from=[1]))
        assert again.token_ids == item["output_ids"]
        assert (np.sort(full[:, list(layout.moe_layers)], -1) == np.sort(again.routed_experts, -1)).all()
    finally:
        server.stop()
