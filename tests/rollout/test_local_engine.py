"""LocalEngine: batched left-padded KV-cache generation, log-probs, stops, weight updates, pause."""
from __future__ import annotations

import asyncio
import logging
from pathlib import Path

import pytest
import torch
from transformers import Qwen2Config

from rollout_sglang.engines.local import LocalEngine
from rollout_sglang.engines.protocol import Engine, SamplingParams

VOCAB = 96


def _config() -> Qwen2Config:
    # initializer_range 0.2: peaked (non-uniform) next-token distributions, so sampling is not trivial
    return Qwen2Config(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=256, initializer_range=0.2, tie_word_embeddings=True,
    )


@pytest.fixture(scope="module")
def engine() -> LocalEngine:
    return LocalEngine.from_config(_config(), init_seed=0)


PROMPTS = [[1, 2, 3], [4, 5, 6, 7, 8, 9, 10, 11, 12], [13], [14, 15, 16, 17]]


def _rescore(engine: LocalEngine, prompt: list[int], generated: list[int], temperature: float) -> torch.Tensor:
    """log_softmax(logits / T) of ``generated`` from one plain full forward of prompt + generated."""
    seq = torch.tensor([prompt + generated])
    with torch.no_grad():
        logits = engine.model(seq).logits[0].float()
    logp = torch.log_softmax(logits / temperature, dim=-1)[len(prompt) - 1 : -1]
    return logp.gather(-1, torch.tensor(generated)[:, None])[:, 0]


def test_protocol(engine: LocalEngine) -> None:
    assert isinstance(engine, Engine)
    h = engine.health()
    assert h["ok"] and h["version"] == 0 and h["device"] == "cpu" and h["dtype"] == "float32"


def test_batched_generation_equals_single_runs_and_full_forward(engine: LocalEngine) -> None:
    params = SamplingParams(max_new_tokens=16, temperature=0.8, top_p=0.9, top_k=40, seed=123)
    batch = asyncio.run(engine.generate(PROMPTS, params))
    assert len(batch) == len(PROMPTS)
    for i, (prompt, out) in enumerate(zip(PROMPTS, batch)):
        assert len(out.token_ids) == len(out.logprobs) == 16 and out.finish_reason == "length"
        assert out.version == 0
        # row i of a batch seeded s samples like a lone prompt seeded s + i
        single = asyncio.run(engine.generate([prompt], SamplingParams(**{**params.__dict__, "seed": 123 + i})))[0]
        assert single.token_ids == out.token_ids
        torch.testing.assert_close(torch.tensor(single.logprobs), torch.tensor(out.logprobs), atol=1e-5, rtol=0)
        # log-probs are those of the untruncated tempered distribution
        ref = _rescore(engine, prompt, out.token_ids, params.temperature)
        torch.testing.assert_close(torch.tensor(out.logprobs), ref, atol=1e-5, rtol=0)
    # same seed: same result; different seed: different tokens
    again = asyncio.run(engine.generate(PROMPTS, params))
    assert [o.token_ids for o in again] == [o.token_ids for o in batch]
    other = asyncio.run(engine.generate(PROMPTS, SamplingParams(**{**params.__dict__, "seed": 7})))
    assert [o.token_ids for o in other] != [o.token_ids for o in batch]


def test_top_k_one_is_greedy(engine: LocalEngine) -> None:
    greedy = asyncio.run(engine.generate(PROMPTS, SamplingParams(max_new_tokens=8, temperature=0.0)))
    topk1 = asyncio.run(engine.generate(PROMPTS, SamplingParams(max_new_tokens=8, temperature=1.0, top_k=1, seed=1)))
    assert [o.token_ids for o in greedy] == [o.token_ids for o in topk1]
    for prompt, out in zip(PROMPTS, topk1):  # log-probs are still those before truncation (not 0)
        torch.testing.assert_close(torch.tensor(out.logprobs), _rescore(engine, prompt, out.token_ids, 1.0),
                                   atol=1e-5, rtol=0)
        assert max(out.logprobs) < 0


def test_stop_tokens_end_rows_independently(engine: LocalEngine) -> None:
    free = asyncio.run(engine.generate(PROMPTS, SamplingParams(max_new_tokens=12, temperature=0.0)))
    stop_tok = free[0].token_ids[3]
    first = free[0].token_ids.index(stop_tok)
    params = SamplingParams(max_new_tokens=12, temperature=0.0, stop_token_ids=[stop_tok])
    outs = asyncio.run(engine.generate(PROMPTS, params))
    assert outs[0].token_ids == free[0].token_ids[: first + 1]  # stop token kept
    assert outs[0].finish_reason == "stop" and len(outs[0].logprobs) == first + 1
    for f, o in zip(free, outs):
        if stop_tok in f.token_ids:
            k = f.token_ids.index(stop_tok)
            assert o.token_ids == f.token_ids[: k + 1] and o.finish_reason == "stop"
        else:  # rows that never emit it continue, unaffected by finished rows leaving the batch
            assert o.token_ids == f.token_ids and o.finish_reason == "length"
        torch.testing.assert_close(torch.tensor(o.logprobs), torch.tensor(f.logprobs[: len(o.logprobs)]),
                                   atol=1e-5, rtol=0)


def test_edge_cases_and_errors(engine: LocalEngine) -> None:
    assert asyncio.run(engine.generate([], SamplingParams())) == []
    out = asyncio.run(engine.generate([[1, 2]], SamplingParams(max_new_tokens=0)))
    assert out[0].token_ids == [] and out[0].finish_reason == "length"
    with pytest.raises(ValueError, match="prompt 1 is empty"):
        asyncio.run(engine.generate([[1], []], SamplingParams()))
    with pytest.raises(ValueError, match=f"token id {VOCAB} outside the model vocabulary"):
        asyncio.run(engine.generate([[1, VOCAB]], SamplingParams()))


def test_weight_update_changes_outputs_and_version(caplog: pytest.LogCaptureFixture) -> None:
    eng = LocalEngine.from_config(_config(), init_seed=1, version=3)
    params = SamplingParams(max_new_tokens=6, temperature=0.0)
    before = asyncio.run(eng.generate(PROMPTS[:2], params))
    assert all(o.version == 3 for o in before)
    other = LocalEngine.from_config(_config(), init_seed=2)
    expected = asyncio.run(other.generate(PROMPTS[:2], params))

    # bucketed update with HF names; the tied lm_head name is accepted too
    state = other.model.state_dict()
    names = list(state)
    eng.begin_weight_update(4, {"num_buckets": 2})
    eng.receive_bucket((n, state[n]) for n in names[: len(names) // 2])
    assert eng.version == 3 and eng.health()["updating"]
    eng.receive_bucket((n, state[n]) for n in names[len(names) // 2 :])
    eng.end_weight_update()
    after = asyncio.run(eng.generate(PROMPTS[:2], params))
    assert all(o.version == 4 for o in after)
    assert [o.token_ids for o in after] == [o.token_ids for o in expected]
    assert [o.token_ids for o in after] != [o.token_ids for o in before]

    with pytest.raises(KeyError,
                       match="unknown parameter name 'model.layers.0.self_attn.q_proj.weigth'.*close matches"):
        eng.load_state_dict(5, {"model.layers.0.self_attn.q_proj.weigth": torch.zeros(1)})
    with pytest.raises(ValueError, match="shape mismatch for 'model.norm.weight'"):
        eng.load_state_dict(5, {"model.norm.weight": torch.zeros(7)})
    assert eng.version == 4 and not eng.health()["updating"]
    with pytest.raises(RuntimeError, match="begin_weight_update"):
        eng.receive_bucket([("model.norm.weight", torch.ones(32))])

    # a partial update is applied, logged, and still bumps the version
    with caplog.at_level(logging.WARNING, logger="rollout_sglang.engines.local"):
        eng.load_state_dict(6, {"model.norm.weight": torch.full((32,), 2.0, dtype=torch.bfloat16)})
    assert eng.version == 6
    assert torch.equal(eng.model.model.norm.weight, torch.full((32,), 2.0))
    assert "did not receive" in caplog.text and "model.embed_tokens.weight" in caplog.text


def test_pause_holds_generation_until_resume() -> None:
    eng = LocalEngine.from_config(_config(), init_seed=0, resume_timeout_s=0.2)
    params = SamplingParams(max_new_tokens=2, temperature=0.0)

    async def main() -> None:
        eng.pause()
        assert eng.health()["paused"]
        task = asyncio.create_task(eng.generate([[1, 2]], params))
        await asyncio.sleep(0.05)
        assert not task.done()
        eng.resume()
        out = await asyncio.wait_for(task, 5)
        assert len(out[0].token_ids) == 2
        eng.pause()
        with pytest.raises(TimeoutError, match="paused for more than"):
            await eng.generate([[1, 2]], params)
        eng.resume()

    asyncio.run(main())


def test_constructors_and_missing_path(tmp_path: Path, engine: LocalEngine) -> None:
    with pytest.raises(FileNotFoundError, match="no Hugging Face checkpoint at .*nowhere.*from_config"):
        LocalEngine.from_pretrained(tmp_path / "nowhere")
    with pytest.raises(TypeError, match="a transformers config or a checkpoint path; got dict"):
        LocalEngine({"hidden_size": 8})
    engine.model.save_pretrained(tmp_path / "ckpt")
    params = SamplingParams(max_new_tokens=5, temperature=0.0)
    a = asyncio.run(engine.generate(PROMPTS, params))
    # a checkpoint path, a config (seeded) or a module: the same model serves the same tokens
    for other in (
        LocalEngine.from_pretrained(tmp_path / "ckpt", dtype="float32"),
        LocalEngine(str(tmp_path / "ckpt")),
        LocalEngine(_config(), init_seed=0),
        LocalEngine(engine.model),
    ):
        b = asyncio.run(other.generate(PROMPTS, params))
        assert [o.token_ids for o in a] == [o.token_ids for o in b]


def test_bfloat16_engine_runs() -> None:
    eng = LocalEngine.from_config(_config(), init_seed=0, dtype="bfloat16")
    out = asyncio.run(eng.generate(PROMPTS, SamplingParams(max_new_tokens=4, seed=0)))
    assert all(len(o.token_ids) == 4 and all(lp <= 0 for lp in o.logprobs) for o in out)
    assert eng.health()["dtype"] == "bfloat16"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_engine_logprobs_match_full_forward() -> None:
    eng = LocalEngine.from_config(_config(), init_seed=0, device="cuda", dtype="float32")
    params = SamplingParams(max_new_tokens=16, temperature=0.7, top_p=0.95, seed=3)
    outs = asyncio.run(eng.generate(PROMPTS, params))
    for prompt, out in zip(PROMPTS, outs):
        seq = torch.tensor([prompt + out.token_ids], device="cuda")
        with torch.no_grad():
            logits = eng.model(seq).logits[0].float()
        ref = torch.log_softmax(logits / 0.7, dim=-1)[len(prompt) - 1 : -1]
        ref = ref.gather(-1, torch.tensor(out.token_ids, device="cuda")[:, None])[:, 0].cpu()
        torch.testing.assert_close(torch.tensor(out.logprobs), ref, atol=1e-4, rtol=0)
