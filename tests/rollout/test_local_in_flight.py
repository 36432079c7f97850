"""LocalEngine under an in-flight weight update: a running call held between two tokens, the weights loaded, the call
continued; every token's version recorded, and in ``retract`` mode every token scored exactly by its own weights."""
from __future__ import annotations

import asyncio
import time

import pytest
import torch
from transformers import Qwen2Config

from rollout_sglang.engines.local import LocalEngine
from rollout_sglang.engines.protocol import SamplingParams

PROMPTS = [[1, 2, 3, 4], [5, 6]]
TEMPERATURE = 0.9
HOLD_AFTER = 3  # forwards before the pause lands: the prefill and two decode steps, so tokens 0-2 are the old version's


def _config() -> Qwen2Config:
    return Qwen2Config(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                       num_key_value_heads=2, max_position_embeddings=256, initializer_range=0.2,
                       tie_word_embeddings=True)


def _logprobs(model: torch.nn.Module, prompt: list[int], generated: list[int]) -> torch.Tensor:
    """log_softmax(logits / T) of ``generated`` from one full forward of prompt + generated."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt + generated])).logits[0].float()
    logp = torch.log_softmax(logits / TEMPERATURE, dim=-1)[len(prompt) - 1:-1]
    return logp.gather(-1, torch.tensor(generated)[:, None])[:, 0]


def _cross_update(mode: str):
    """Generate 12 tokens per prompt on version 0 while a pause(``mode``) lands after :data:`HOLD_AFTER` forwards,
    version 1's weights are loaded and the engine resumed; (outputs, old model, new model)."""
    engine = LocalEngine.from_config(_config(), init_seed=0)
    old = LocalEngine.from_config(_config(), init_seed=0).model
    new = LocalEngine.from_config(_config(), init_seed=1).model
    forwards = 0

    def pause_mid_call(*_):
        nonlocal forwards
        forwards += 1
        if forwards == HOLD_AFTER:
            engine.pause(mode)  # from inside the running call: it holds before its next forward

    hook = engine.model.register_forward_hook(pause_mid_call)

    async def main():
        call = asyncio.create_task(engine.generate(PROMPTS, SamplingParams(max_new_tokens=12, temperature=TEMPERATURE,
                                                                           seed=5)))
        deadline = time.monotonic() + 30
        while engine.health()["held"] == 0:
            assert time.monotonic() < deadline, "the running call was never held"
            assert not call.done(), "the call finished without holding"
            await asyncio.sleep(0.01)
        assert engine.health()["pause_mode"] == mode
        engine.load_state_dict(1, dict(new.state_dict()))  # the held call released the weights lock
        engine.resume()
        return await asyncio.wait_for(call, 30)

    try:
        outs = asyncio.run(main())
    finally:
        hook.remove()
    return outs, old, new


@pytest.mark.parametrize("mode", ["retract", "in_place"])
def test_a_held_call_records_each_tokens_version(mode):
    outs, old, new = _cross_update(mode)
    for prompt, out in zip(PROMPTS, outs):
        assert len(out.token_ids) == 12 and out.version == 1
        assert out.token_versions == [0] * HOLD_AFTER + [1] * (12 - HOLD_AFTER)
        before, after = out.token_ids[:HOLD_AFTER], out.token_ids
        # the tokens sampled before the update are the old weights' exactly
        torch.testing.assert_close(torch.tensor(out.logprobs[:HOLD_AFTER]), _logprobs(old, prompt, before),
                                   atol=1e-5, rtol=0)
        under_new = _logprobs(new, prompt, after)[HOLD_AFTER:]
        got = torch.tensor(out.logprobs[HOLD_AFTER:])
        if mode == "retract":  # the KV cache was recomputed: each later token is the new weights' exactly
            torch.testing.assert_close(got, under_new, atol=1e-5, rtol=0)
        else:  # the old weights' KV cache was kept: the later tokens are scored over a context the old weights encoded
            assert (got - under_new).abs().max() > 1e-3


def test_a_held_call_that_is_never_resumed_times_out_and_frees_the_engine():
    engine = LocalEngine.from_config(_config(), init_seed=0, resume_timeout_s=0.3)
    hook = engine.model.register_forward_hook(lambda *_: engine.pause("retract"))

    async def main():
        return await engine.generate([[1, 2]], SamplingParams(max_new_tokens=4, seed=1))

    with pytest.raises(TimeoutError, match="resume"):
        asyncio.run(main())
    hook.remove()
    assert engine.health()["held"] == 0
    engine.resume()
    (out,) = asyncio.run(main())  # the weights lock was released: the engine serves again
    assert len(out.token_ids) == 4 and out.token_versions == [0] * 4


def test_an_unknown_pause_mode_is_refused():
    engine = LocalEngine.from_config(_config(), init_seed=0)
    with pytest.raises(ValueError, match="'abort'"):
        engine.pause("abort")
    assert not engine.health()["paused"]
