"""Engine.score, the teacher side of on-policy distillation: each token's untempered log-prob given the tokens before
it, from the local engine (one forward per chunk) and from an SGLang server (``/generate`` with ``max_new_tokens:
0``, ``return_logprob`` and ``logprob_start_len``, read from ``meta_info.input_token_logprobs``), checked against
a direct transformers forward, the stand-in that follows SGLang's wheel, and SGLang's request contract."""
from __future__ import annotations

import asyncio
import json
import urllib.error
import urllib.request
import zipfile

import pytest
import torch

from rollout_sglang.engines import local
from rollout_sglang.engines.batching import BatchingEngine
from rollout_sglang.engines.local import LocalEngine
from rollout_sglang.engines.protocol import SamplingParams
from rollout_sglang.engines.sglang_client import SGLangEngine, SGLangError
from rollout_sglang.engines.sglang_options import SGLangClientOptions
from rollout_sglang.testing.sglang_contract import load_contract
from rollout_sglang.testing.sglang_standin import StandInServer
from rollout_sglang.testing.standin_options import StandInOptions

VOCAB = 96
# multi-turn-like: a prompt, then sampled tokens; the starts skip each sequence's context
SEQUENCES = [[1, 2, 3, 4, 5, 6, 7, 8, 9], [10, 11], [12], list(range(20, 61)), [95, 3, 95, 0, 94]]
STARTS = [4, 1, 0, 17, 2]


def _config():
    from transformers import Qwen2Config

    return Qwen2Config(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                       tie_word_embeddings=False)


@pytest.fixture(scope="module")
def engine() -> LocalEngine:
    return LocalEngine.from_config(_config(), init_seed=0)


@pytest.fixture(scope="module")
def served(engine):
    """(stand-in server of ``engine``, client)."""
    server = StandInServer(engine, StandInOptions())
    server.start()
    client = SGLangEngine(server.url, SGLangClientOptions(request_timeout_s=30, control_timeout_s=10))
    yield server, client
    server.stop()


def direct(model: torch.nn.Module, seq: list[int], start: int) -> list[float]:
    """The reference: one plain transformers forward of ``seq`` alone, fp32 log_softmax, gathered; 0.0 at position 0
    and before ``start``."""
    with torch.no_grad():
        logits = model(torch.tensor([seq])).logits[0].float()
    logp = torch.log_softmax(logits, dim=-1)[:-1].gather(-1, torch.tensor(seq[1:])[:, None])[:, 0].tolist()
    return [lp if t >= start else 0.0 for t, lp in enumerate([0.0] + logp)]


def _close(got: list[list[float]], want: list[list[float]], tol: float = 1e-5) -> None:
    assert [len(g) for g in got] == [len(w) for w in want]
    for g, w in zip(got, want):
        assert g == pytest.approx(w, abs=tol)


# ------------------------------------------------------------------------------------------------ the local engine
def test_local_score_is_a_direct_forward(engine, monkeypatch):
    want = [direct(engine.model, q, s) for q, s in zip(SEQUENCES, STARTS)]
    got = asyncio.run(engine.score(SEQUENCES, STARTS))
    _close(got, want)
    assert got[2] == [0.0] and got[0][:4] == [0.0] * 4 and all(lp < 0 for lp in got[0][4:])
    # without starts every position from 1 on; untempered whatever generate last used
    _close(asyncio.run(engine.score(SEQUENCES)), [direct(engine.model, q, 0) for q in SEQUENCES])
    # chunks of a few tokens (each sequence alone, some too long for any chunk) give the same numbers
    monkeypatch.setattr(local, "SCORE_CHUNK_TOKENS", 10)
    _close(asyncio.run(engine.score(SEQUENCES, STARTS)), want)
    assert asyncio.run(engine.score([])) == []


def test_local_score_uses_the_base_with_adapters_loaded(engine):
    from rollout_sglang.engines.adapter import Adapter

    base = asyncio.run(engine.score(SEQUENCES[:2], STARTS[:2]))
    g = torch.Generator().manual_seed(3)
    tensors = {"base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight": torch.randn(4, 32, generator=g),
               "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight": torch.randn(32, 4, generator=g)}
    engine.load_adapter(Adapter(1, {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj"]}, tensors))
    try:
        _close(asyncio.run(engine.score(SEQUENCES[:2], STARTS[:2])), base, tol=0.0)
        params = SamplingParams(max_new_tokens=1, temperature=0)  # the adapter does change the model's answers
        on, off = (asyncio.run(engine.generate(SEQUENCES[:1], params, adapters=[a]))[0].logprobs for a in ("v1", None))
        assert on != pytest.approx(off, abs=1e-4)
    finally:
        engine.unload_adapter("v1")


@pytest.mark.parametrize(("sequences", "starts", "match"), [
    ([[1, 2], []], None, "sequence 1 is empty"),
    ([[1, VOCAB]], None, f"sequence 0 has token id {VOCAB} outside the model vocabulary"),
    ([[1, -3]], None, "sequence 0 has token id -3"),
    ([[1, 2, 3]], [4], r"starts\[0\]=4 must be an int in \[0, 3\]"),
    ([[1, 2, 3]], [-1], r"starts\[0\]=-1 must be an int"),
    ([[1, 2], [3]], [0], "starts has 1 entries for 2 sequences"),
])
def test_bad_inputs_are_refused_naming_the_value(engine, served, sequences, starts, match):
    with pytest.raises(ValueError, match=match):
        asyncio.run(engine.score(sequences, starts))
    if "vocabulary" not in match:  # the client checks all but the vocabulary, which it does not know
        with pytest.raises(ValueError, match=match):
            asyncio.run(served[1].score(sequences, starts))


def test_a_paused_engine_scores_after_resume():
    eng = LocalEngine.from_config(_config(), init_seed=0, resume_timeout_s=5)

    async def run() -> list[list[float]]:
        eng.pause()
        task = asyncio.ensure_future(eng.score(SEQUENCES, STARTS))
        await asyncio.sleep(0.2)
        assert not task.done()
        eng.resume()
        return await asyncio.wait_for(task, 10)

    _close(asyncio.run(run()), [direct(eng.model, q, s) for q, s in zip(SEQUENCES, STARTS)])
    eng.resume_timeout_s = 0.1
    eng.pause()
    with pytest.raises(TimeoutError, match="paused for more than"):
        asyncio.run(eng.score(SEQUENCES[:1]))
    eng.resume()


def test_batching_engine_passes_score_through(engine):
    _close(asyncio.run(BatchingEngine(engine).score(SEQUENCES, STARTS)), asyncio.run(engine.score(SEQUENCES, STARTS)),
           tol=0.0)


# ------------------------------------------------------------------------------------------ SGLang and the stand-in
def test_sglang_score_equals_the_local_engine_and_fits_the_contract(engine, served):
    server, client = served
    n = len(server.bodies)
    got = asyncio.run(client.score(SEQUENCES, STARTS))
    _close(got, asyncio.run(engine.score(SEQUENCES, STARTS)))
    bodies = [b for p, b in server.bodies[n:] if p == "/generate"]
    assert bodies == [{"input_ids": SEQUENCES, "sampling_params": [{"max_new_tokens": 0}] * len(SEQUENCES),
                       "return_logprob": True, "logprob_start_len": [max(s - 1, 0) for s in STARTS]}]
    contract = load_contract()
    contract.check_request("/generate", bodies[0])  # raises, naming the field, on any mismatch
    assert set(bodies[0]) <= contract.fields("/generate")
    _close(asyncio.run(client.score(SEQUENCES)), [direct(engine.model, q, 0) for q in SEQUENCES])


def test_the_score_body_passes_sglangs_own_decoder(api_types, served):
    server, client = served
    n = len(server.bodies)
    asyncio.run(client.score(SEQUENCES[:2], STARTS[:2]))
    body = [b for p, b in server.bodies[n:] if p == "/generate"][0]
    api_types.GenerateRequest.from_json_value(body)


def _post(url: str, body: dict) -> tuple[int, object]:
    req = urllib.request.Request(url + "/generate", json.dumps(body).encode(), {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=30) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def test_the_stand_in_answers_input_logprobs_as_sglang(engine, served):
    server, _ = served
    seq = [5, 6, 7, 8, 95]  # 95 = vocab_size - 1: SGLang reports its id as 0
    ref = direct(engine.model, seq, 0)
    status, item = _post(server.url, {"input_ids": seq, "sampling_params": {"max_new_tokens": 0},
                                      "return_logprob": True, "logprob_start_len": 2})
    assert status == 200 and item["output_ids"] == []
    entries = item["meta_info"]["input_token_logprobs"]
    assert [e[1] for e in entries] == [7, 8, 0] and [e[2] for e in entries] == [None] * 3
    assert entries[0][0] is None  # position 2's logits come from position 1, which is not computed
    assert [e[0] for e in entries[1:]] == pytest.approx(ref[3:], abs=1e-5)
    # the default (-1): output tokens only; the prompt's length: none either; past it: the scheduler's abort
    for extra in ({}, {"logprob_start_len": -1}, {"logprob_start_len": len(seq)}):
        status, item = _post(server.url, {"input_ids": seq, "sampling_params": {"max_new_tokens": 0},
                                          "return_logprob": True, **extra})
        assert status == 200 and item["meta_info"]["input_token_logprobs"] == []
    status, item = _post(server.url, {"input_ids": seq, "sampling_params": {"max_new_tokens": 0},
                                      "return_logprob": True, "logprob_start_len": 6})
    assert status == 400 and "logprob_start_len=6 is higher than the number of input tokens" in str(item)
    # without return_logprob SGLang ignores the start and returns no log-probs
    status, item = _post(server.url, {"input_ids": seq, "sampling_params": {"max_new_tokens": 0},
                                      "logprob_start_len": 6})
    assert status == 200 and "input_token_logprobs" not in item["meta_info"]


def test_the_stand_in_follows_the_wheel(wheel):
    """The facts the stand-in and the client rest on, as text of the pinned wheel's source."""
    with zipfile.ZipFile(wheel) as z:
        read = {name: z.read(f"sglang/srt/{name}").decode() for name in (
            "managers/scheduler_components/logprob_result_processor.py", "managers/scheduler.py",
            "managers/io_struct.py", "managers/schedule_batch.py")}
    processor = read["managers/scheduler_components/logprob_result_processor.py"]
    assert "[None] + input_token_logprobs[:-1]" in processor  # the start's own log-prob is None
    assert "req.origin_input_ids[req.logprob_start_len :]" in processor
    assert "x if x < self.model_config.vocab_size - 1 else 0" in processor  # the id clip
    scheduler = read["managers/scheduler.py"]
    assert "req.logprob_start_len = len(req.origin_input_ids)" in scheduler  # -1: no input log-probs
    assert "is higher than the number of input tokens" in scheduler
    assert "self.logprob_start_len = -1" in read["managers/io_struct.py"]  # the default
    assert "origin_input_ids[\n                    global_start_idx + 1 : global_end_idx + 1" in \
        read["managers/schedule_batch.py"]  # position p scores token p + 1


def test_sglang_score_errors_name_server_and_endpoint(served):
    server, client = served
    with pytest.raises(SGLangError, match=rf"/generate on {server.url}.*{VOCAB}"):
        asyncio.run(client.score([[1, VOCAB]]))
