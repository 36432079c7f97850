"""LocalEngine's continuous batching: a call that arrives while another decodes joins it at the next decode step,
finishes when its own rows do, and samples exactly what it would alone; a seeded row keeps its seed in any batch, one
the engine joined or one :class:`BatchingEngine` merged."""
from __future__ import annotations

import asyncio
import time

import torch
from transformers import Qwen2Config

from rollout_sglang.engines.batching import BatchingEngine
from rollout_sglang.engines.local import LocalEngine
from rollout_sglang.engines.protocol import SamplingParams

LONG, SHORT = [1, 2, 3, 4, 5, 6, 7], [9, 10]


def _engine() -> LocalEngine:
    cfg = Qwen2Config(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, max_position_embeddings=512, initializer_range=0.2,
                      tie_word_embeddings=True)
    return LocalEngine.from_config(cfg, init_seed=0)


def _alone(prompt: list[int], params: SamplingParams):
    return asyncio.run(_engine().generate([prompt], params))[0]


class Slowed:
    """Within the block every forward of ``engine``'s model takes ~5 ms more; ``forwards`` counts them."""

    def __init__(self, engine: LocalEngine) -> None:
        self.engine, self.forwards = engine, 0

    def __enter__(self) -> "Slowed":
        def slow(*_):
            self.forwards += 1
            time.sleep(0.005)

        self.hook = self.engine.model.register_forward_hook(slow)
        return self

    def __exit__(self, *exc) -> None:
        self.hook.remove()


def _concurrent(second: SamplingParams):
    """A long call (seeded, slowed to ~5 ms a forward) and, once it has decoded a few steps, ``second`` on SHORT;
    (long output, short output, the order they finished in)."""
    engine = _engine()
    done: list[str] = []

    async def run(name, prompt, params):
        out = await engine.generate([prompt], params)
        done.append(name)
        return out[0]

    async def main(slowed: Slowed):
        first = asyncio.create_task(run("long", LONG, SamplingParams(max_new_tokens=120, temperature=0.8, seed=5)))
        while slowed.forwards < 4:
            await asyncio.sleep(0.001)
        return await asyncio.gather(first, run("short", SHORT, second))

    with Slowed(engine) as slowed:
        long_out, short_out = asyncio.run(main(slowed))
    return long_out, short_out, done


def test_a_call_joins_the_running_one_and_samples_as_it_would_alone():
    short = SamplingParams(max_new_tokens=6, temperature=0.8, seed=11)
    long_out, short_out, done = _concurrent(short)
    assert done == ["short", "long"]  # it joined: it did not wait for the long call to finish
    for out, prompt, params in ((long_out, LONG, SamplingParams(max_new_tokens=120, temperature=0.8, seed=5)),
                                (short_out, SHORT, short)):
        ref = _alone(prompt, params)
        assert out.token_ids == ref.token_ids and out.finish_reason == ref.finish_reason
        torch.testing.assert_close(torch.tensor(out.logprobs), torch.tensor(ref.logprobs), atol=1e-5, rtol=0)
        assert out.token_versions == [0] * len(out.token_ids)


def test_an_unseeded_call_joins_a_seeded_one_whose_rows_keep_their_seeds():
    long_out, short_out, done = _concurrent(SamplingParams(max_new_tokens=6, temperature=0.8))
    assert done == ["short", "long"]
    assert long_out.token_ids == _alone(LONG, SamplingParams(max_new_tokens=120, temperature=0.8, seed=5)).token_ids
    assert len(short_out.token_ids) == 6


def test_a_merged_call_names_each_rows_seed_and_samples_each_as_alone():
    """An engine that runs one call at a time gets concurrent calls merged: seeded calls (by ``params.seed`` or by
    ``seeds``) and an unseeded one in one engine call, each seeded row sampling what it samples alone."""
    engine = _engine()

    class OneCallAtATime:
        version = 0

        def __init__(self) -> None:
            self.seeds: list = []

        async def generate(self, prompts, params, seeds=None):
            self.seeds.append(seeds)
            return await engine.generate(prompts, params, seeds=seeds)

    inner = OneCallAtATime()
    batching = BatchingEngine(inner)
    params = SamplingParams(max_new_tokens=8, temperature=1.0)

    async def run():
        return await asyncio.gather(
            batching.generate([LONG, SHORT], SamplingParams(max_new_tokens=8, temperature=1.0, seed=20)),
            batching.generate([SHORT, LONG], params, seeds=[7, 40]),
            batching.generate([SHORT], params),
        )

    seeded, named, _ = asyncio.run(run())
    assert (batching.calls, batching.merged_calls) == (1, 3)  # the three arrived together: one engine call
    assert inner.seeds == [[20, 21, 7, 40, None]]
    for out, prompt, seed in ((seeded[0], LONG, 20), (seeded[1], SHORT, 21), (named[0], SHORT, 7),
                              (named[1], LONG, 40)):
        assert out.token_ids == _alone(prompt, SamplingParams(max_new_tokens=8, temperature=1.0, seed=seed)).token_ids


def test_a_call_with_other_sampling_settings_waits_for_the_running_one():
    short = SamplingParams(max_new_tokens=6, temperature=0.5, seed=11)
    long_out, short_out, done = _concurrent(short)
    assert done == ["long", "short"]
    ref = _alone(SHORT, short)
    assert short_out.token_ids == ref.token_ids


def test_calls_that_cannot_join_wait_without_polling_and_then_run_together():
    """Calls with other settings than the running loop's wait for it without polling: each checks again when a loop
    ends or turns joinable (a few times while the long call decodes for over half a second, where a 2 ms poll would
    check hundreds of times), then the first starts a loop and the others join it."""
    engine = _engine()
    checks = 0
    try_join = engine._try_join_locked

    def counted(*args):
        nonlocal checks
        checks += 1
        return try_join(*args)

    engine._try_join_locked = counted
    other = [SamplingParams(max_new_tokens=4, temperature=0.5, seed=s) for s in range(20)]

    async def main(slowed: Slowed):
        first = asyncio.create_task(engine.generate([LONG], SamplingParams(max_new_tokens=120, temperature=0.8,
                                                                           seed=5)))
        while slowed.forwards < 4:
            await asyncio.sleep(0.001)
        waiting = [asyncio.create_task(engine.generate([SHORT], p)) for p in other]
        await asyncio.sleep(0.05)
        assert engine._wakeup.armed() == len(other) and not first.done()
        await first
        return await asyncio.wait_for(asyncio.gather(*waiting), timeout=60)

    with Slowed(engine) as slowed:
        outs = asyncio.run(main(slowed))
        forwards = slowed.forwards
    assert checks <= 4 * len(other), checks
    # the long call's 121 forwards, then one loop that the twenty join (a prefill each as they come), well under
    # the 20 x 4 of twenty loops one after another
    assert forwards < 121 + 20 * 4 // 2, forwards
    for (out,), params in zip(outs, other):
        assert out.token_ids == _alone(SHORT, params).token_ids


def test_a_caller_cancelled_while_joined_leaves_the_running_call_and_the_others_unharmed():
    """Callers are cancelled (a run ending, a request timing out) while their rows are in the running batch: the
    running call and the calls still awaited finish, and sample what they would alone."""
    engine = _engine()
    long_params = SamplingParams(max_new_tokens=60, temperature=0.8, seed=5)
    short_params = SamplingParams(max_new_tokens=20, temperature=0.8, seed=6)

    async def main(slowed: Slowed):
        first = asyncio.create_task(engine.generate([LONG], long_params))
        while slowed.forwards < 3:
            await asyncio.sleep(0.001)
        doomed = [asyncio.create_task(engine.generate([SHORT], short_params)) for _ in range(3)]
        kept = asyncio.create_task(engine.generate([SHORT], short_params))
        while slowed.forwards < 8:  # the three have joined (or wait to)
            await asyncio.sleep(0.001)
        for t in doomed:
            t.cancel()
        await asyncio.gather(*doomed, return_exceptions=True)
        return await asyncio.wait_for(asyncio.gather(first, kept), timeout=60)

    with Slowed(engine) as slowed:
        (long_out,), (short_out,) = asyncio.run(main(slowed))
    assert long_out.token_ids == _alone(LONG, long_params).token_ids
    assert short_out.token_ids == _alone(SHORT, short_params).token_ids
