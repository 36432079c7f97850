"""The version pool's in-flight weight updates: an update that lands while a request generates holds it instead of
waiting for it, every token keeps the version that sampled it, and in ``retract`` mode each is scored exactly by its
own weights; a failed in-flight update keeps nothing sampled on partly loaded weights."""
from __future__ import annotations

import asyncio
import threading
import time

import pytest
import torch
from transformers import Qwen2Config

from megatron_agentrl.algo.mismatch import lag_metrics, lag_sums
from megatron_agentrl.config import AlgoConfig
from megatron_agentrl.pipeline.batch import build_rl_batch
from rollout_sglang.engines.batching import BatchingEngine
from rollout_sglang.engines.local import LocalEngine
from rollout_sglang.engines.protocol import SamplingParams
from rollout_sglang.engines.version_pool import VersionPool
from rollout_sglang.trajectory import Trajectory
from rollout_sglang.weight_update.direct import deliver_direct

PROMPT = [1, 2, 3, 4, 5]
NEW_TOKENS = 16
TEMPERATURE = 0.9


def _config() -> Qwen2Config:
    return Qwen2Config(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                       num_key_value_heads=2, max_position_embeddings=256, initializer_range=0.2,
                       tie_word_embeddings=True)


def _model(seed: int) -> torch.nn.Module:
    return LocalEngine.from_config(_config(), init_seed=seed).model


def _trajectory(outs) -> Trajectory:
    t = Trajectory([], [], [], [], [], "lookup", 0, 0, reward=1.0)
    t.append_context(PROMPT)
    t.append_turn(outs[0].token_ids, outs[0].logprobs, outs[0].token_versions)
    return t


def _trainer_logprobs(model: torch.nn.Module, t: Trajectory) -> torch.Tensor:
    """``[1, T]``: log p(token t | tokens < t) under ``model`` at temperature :data:`TEMPERATURE` (0 at t = 0), as the
    trainer scores a sample."""
    with torch.no_grad():
        logits = model(torch.tensor([t.token_ids])).logits[0].float() / TEMPERATURE
    logp = torch.log_softmax(logits[:-1], -1).gather(-1, torch.tensor(t.token_ids[1:])[:, None])[:, 0]
    return torch.cat([torch.zeros(1), logp])[None]


def _pool(mode: str) -> tuple[VersionPool, LocalEngine]:
    engine = LocalEngine.from_config(_config(), init_seed=0)
    return VersionPool([[BatchingEngine(engine)]], update_mode=mode, live_timeout_s=60), engine


def _update_when(engine: LocalEngine, pool: VersionPool, version: int, state: dict, after_forwards: int,
                 fail: bool = False) -> None:
    """Plant an update of the pool's slot to ``version`` (the weights of model seed ``version``) on a thread, started
    once the engine ran ``after_forwards`` forward passes; ``fail``: the sync fails (``abort_update``) after the first
    bucket. ``state`` records when ``begin_update`` returned and the requests in flight then."""
    weights = dict(_model(version).state_dict())
    forwards = 0

    def update() -> None:
        slot = pool.begin_update(version, timeout_s=30)
        state["inflight_at_begin"] = sum(pool.inflight())
        if fail:
            deliver_direct([pool.engines[0]], list(weights.items())[:1], 1 << 20)
            pool.abort_update(slot)
            return
        deliver_direct([pool.engines[0]], weights.items(), 1 << 20)
        pool.end_update(slot)

    def hook(*_):
        nonlocal forwards
        forwards += 1
        if forwards == after_forwards:
            state["thread"] = threading.Thread(target=update)
            state["thread"].start()

    state["hook"] = engine.model.register_forward_hook(hook)


def _generate_across_update(mode: str) -> tuple[list, dict]:
    """One request on a one-slot pool in ``mode`` while an update to version 1 is planted after 4 forwards; its
    outputs and the update's record."""
    pool, engine = _pool(mode)
    state: dict = {}
    _update_when(engine, pool, 1, state, after_forwards=4)
    outs = asyncio.run(pool.generate([PROMPT], SamplingParams(max_new_tokens=NEW_TOKENS, temperature=TEMPERATURE,
                                                              seed=3)))
    state["thread"].join(30)
    state["hook"].remove()
    state["versions"] = pool.versions
    return outs, state


def test_an_in_flight_update_holds_the_request_and_each_token_is_scored_by_its_own_weights():
    outs, state = _generate_across_update("retract")
    assert state["inflight_at_begin"] == 1  # the update did not wait for the running request
    t = _trajectory(outs)
    versions = t.sampled_versions
    assert 0 in versions and 1 in versions and versions == sorted(versions)  # the turn crossed the update
    assert t.oldest_version == 0 and t.tokens_after_update == versions.count(1)
    # the staleness cap counts the oldest token: a batch trained on version 2 holds this sample at staleness 2
    rl = build_rl_batch([t], ["lookup"], AlgoConfig(), trained_version=1)
    lag = rl.batch.version_lag
    assert sorted(set(lag[lag >= 0].tolist())) == [0, 1]
    # the trainer holding version 1 scores every version-1 token as the engine sampled it (retract: exact)
    sums = lag_sums(_trainer_logprobs(_model(1), t), rl.batch.behavior_logprobs, rl.batch.loss_mask, lag)
    assert lag_metrics(sums)["mismatch/abs_lag0"] < 1e-4
    # and the version-0 tokens are the old weights' own
    old = torch.tensor([lag.tolist()[0][i] == 1 for i in range(len(t.token_ids))])
    torch.testing.assert_close(_trainer_logprobs(_model(0), t)[0][old], rl.batch.behavior_logprobs[0][old],
                               atol=1e-5, rtol=0)


def test_in_place_keeps_the_old_kv_and_shows_at_lag_zero():
    outs, _ = _generate_across_update("in_place")
    t = _trajectory(outs)
    assert set(t.sampled_versions) == {0, 1}
    rl = build_rl_batch([t], ["lookup"], AlgoConfig(), trained_version=1)
    sums = lag_sums(_trainer_logprobs(_model(1), t), rl.batch.behavior_logprobs, rl.batch.loss_mask,
                    rl.batch.version_lag)
    assert lag_metrics(sums)["mismatch/abs_lag0"] > 1e-3  # scored over a context the old weights encoded


def test_drain_waits_for_the_request_before_it_pauses():
    outs, state = _generate_across_update("drain")
    assert state["inflight_at_begin"] == 0 and outs[0].token_versions == [0] * NEW_TOKENS
    assert state["versions"] == [1]


def test_a_failed_in_flight_update_regenerates_what_it_held():
    pool, engine = _pool("retract")
    state: dict = {}
    _update_when(engine, pool, 1, state, after_forwards=4, fail=True)

    async def main():
        call = asyncio.create_task(pool.generate([PROMPT], SamplingParams(max_new_tokens=NEW_TOKENS,
                                                                          temperature=TEMPERATURE, seed=3)))
        deadline = time.monotonic() + 30
        while "inflight_at_begin" not in state or state["thread"].is_alive():
            assert time.monotonic() < deadline
            await asyncio.sleep(0.01)
        assert pool.slots[0].failed and not call.done()  # the held request was cancelled and waits for a live slot
        state["hook"].remove()
        slot = await asyncio.to_thread(pool.begin_update, 2)  # the next sync succeeds
        deliver_direct([pool.engines[0]], _model(2).state_dict().items(), 1 << 20)
        pool.end_update(slot)
        return await asyncio.wait_for(call, 60)

    (out,) = asyncio.run(main())
    assert out.token_versions == [2] * NEW_TOKENS  # generated again, whole, on the next version


def test_an_unknown_update_mode_is_refused():
    with pytest.raises(ValueError, match="weight_update_mode='abort'"):
        VersionPool([[LocalEngine.from_config(_config(), init_seed=0)]], update_mode="abort")


def test_a_slot_updated_in_flight_keeps_serving_beside_the_other_versions():
    """Two slots (versions 0 and 1) under uniform cross-policy sampling: slot 0's in-flight update to version 2 holds
    its requests and continues them, while slot 1 serves version 1 throughout."""
    e0 = LocalEngine.from_config(_config(), init_seed=0)
    e1 = LocalEngine.from_config(_config(), init_seed=1, version=1)
    pool = VersionPool([[BatchingEngine(e0)], [BatchingEngine(e1)]], policy="uniform", seed=4, update_mode="retract",
                       live_timeout_s=60)
    state: dict = {}
    weights = dict(_model(2).state_dict())
    forwards = 0

    def update() -> None:
        slot = pool.begin_update(2, slot=0, timeout_s=30)
        state["inflight_at_begin"] = pool.inflight()
        deliver_direct([pool.engines[0]], weights.items(), 1 << 20)
        pool.end_update(slot)

    def hook(*_):
        nonlocal forwards
        forwards += 1
        if forwards == 4:
            state["thread"] = threading.Thread(target=update)
            state["thread"].start()

    handle = e0.model.register_forward_hook(hook)
    prompts = [[i + 1, i + 2, i + 3] for i in range(8)]
    outs = asyncio.run(pool.generate(prompts, SamplingParams(max_new_tokens=NEW_TOKENS, temperature=TEMPERATURE,
                                                             seed=3)))
    state["thread"].join(30)
    handle.remove()
    assert state["inflight_at_begin"][0] > 0  # slot 0 was not drained
    seen = [tuple(sorted(set(o.token_versions))) for o in outs]
    assert (0, 2) in seen and (1,) in seen and set(seen) <= {(0, 2), (1,), (2,)}, seen
    assert pool.versions == [2, 1]
