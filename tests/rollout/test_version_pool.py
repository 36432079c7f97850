"""Version pool: oldest-slot updates, pausing only the updated slot, drain, policies, router affinity;
and cross-policy sampling through the agent loop with real local engines of different versions."""
from __future__ import annotations

import asyncio
import collections
import threading
import time

import pytest
import torch

from env_controller.protocol import SampleStatus, TaskReply
from rollout_sglang.engines.protocol import GenerationOutput, SamplingParams
from rollout_sglang.engines.version_pool import VersionPool
from rollout_sglang.episode_options import EpisodeLimits, EpisodeOptions


class FakeEngine:
    """Engine protocol stand-in that records pauses and updates; outputs carry its id and version."""

    def __init__(self, eid: int, version: int = 0, delay_s: float = 0.0) -> None:
        self.eid, self.version, self.delay_s = eid, version, delay_s
        self.paused = False
        self.pending: int | None = None
        self.calls: list[int] = []
        self.events: list[str] = []

    async def generate(self, prompts, params, seeds=None):
        assert not self.paused, f"engine {self.eid} generated while paused"
        self.calls.append(len(prompts))
        if self.delay_s:
            await asyncio.sleep(self.delay_s)
        return [GenerationOutput([self.eid], [-1.0], "length", self.version) for _ in prompts]

    def pause(self):
        self.paused = True
        self.events.append("pause")

    def resume(self):
        self.paused = False
        self.events.append("resume")

    def begin_weight_update(self, version, metadata):
        self.pending = version
        self.events.append(f"begin{version}")

    def receive_bucket(self, named):
        pass

    def end_weight_update(self):
        self.version, self.pending = self.pending, None
        self.events.append("end")

    def health(self):
        return {"ok": True, "version": self.version}


def make_pool(slots=(2, 2, 1), versions=None, **kw) -> VersionPool:
    engines, eid = [], 0
    for i, n in enumerate(slots):
        v = 0 if versions is None else versions[i]
        engines.append([FakeEngine(eid + j, v) for j in range(n)])
        eid += n
    return VersionPool(engines, **kw)


def test_sync_updates_the_oldest_slot_so_the_pool_keeps_the_latest_versions():
    pool = make_pool(slots=(1, 1, 1))
    for version in range(1, 8):
        slot = pool.begin_update(version)
        assert slot.index == [s.index for s in pool.slots if s.version == min(pool.versions)][0]
        pool.end_update(slot)
    assert sorted(pool.versions) == [5, 6, 7] and pool.latest_version == 7


def test_update_pauses_only_its_slot_while_others_keep_generating():
    pool = make_pool(slots=(2, 1), versions=(3, 2))
    slot = pool.begin_update(4)  # the oldest: slot 1 (version 2)
    assert slot.index == 1
    assert [e.paused for e in pool.engines] == [False, False, True]
    assert pool.engines[2].events == ["pause", "begin4"]
    outs = asyncio.run(pool.generate([[1]] * 6, SamplingParams(max_new_tokens=1)))
    assert {o.token_ids[0] for o in outs} == {0, 1} and {o.version for o in outs} == {3}
    pool.end_update(slot)
    assert pool.engines[2].events == ["pause", "begin4", "end", "resume"]
    assert pool.versions == [3, 4] and not any(e.paused for e in pool.engines)


def test_begin_update_drains_in_flight_requests_and_times_out():
    pool = make_pool(slots=(1, 1), versions=(0, 1))
    (eid,) = pool.route(["traj"])
    assert pool.slot_of_engine(eid).index == 1  # latest policy
    other = pool.slots[0]
    # slot 1 has a request in flight: updating it waits for the lease, then times out
    t0 = time.perf_counter()
    with pytest.raises(TimeoutError, match="did not drain"):
        pool.begin_update(2, slot=1, timeout_s=0.3)
    assert time.perf_counter() - t0 < 3 and not pool.slots[1].updating
    threading.Timer(0.2, pool.release, args=(eid,)).start()
    slot = pool.begin_update(2, slot=1, timeout_s=10)
    assert slot.index == 1 and pool.engines[1].paused and not other.engines[0].paused
    pool.end_update(slot)


def test_failed_sync_takes_the_slot_out_until_a_later_sync_succeeds():
    pool = make_pool(slots=(1, 1), versions=(5, 4))
    slot = pool.begin_update(6)
    pool.abort_update(slot)
    assert pool.slots[1].failed and not pool.engines[1].paused
    assert all(pool.slot_of_engine(e).index == 0 for e in pool.route([None] * 20))
    assert pool.oldest_slot().index == 1  # a failed slot is updated first
    slot = pool.begin_update(7)
    pool.end_update(slot)
    assert not pool.slots[1].failed and pool.versions == [5, 7]


def _draws(policy: str, n: int = 4000, seed: int = 0) -> collections.Counter:
    pool = make_pool(slots=(1, 1, 1), versions=(2, 0, 1), policy=policy, seed=seed)
    eids = pool.route([None] * n)
    return collections.Counter(pool.slot_of_engine(e).version for e in eids)


def test_policies_latest_uniform_recency_and_seeding():
    assert _draws("latest") == {2: 4000}
    uni = _draws("uniform")
    assert set(uni) == {0, 1, 2} and all(abs(c / 4000 - 1 / 3) < 0.04 for c in uni.values())
    rec = _draws("recency")  # weights 1, 0.5, 0.25
    assert abs(rec[2] / 4000 - 4 / 7) < 0.04 and abs(rec[1] / 4000 - 2 / 7) < 0.04 and abs(rec[0] / 4000 - 1 / 7) < 0.04
    assert _draws("uniform", n=50, seed=3) == _draws("uniform", n=50, seed=3)
    with pytest.raises(ValueError, match="cross_policy"):
        make_pool(policy="newest")


def test_router_keeps_a_trajectory_on_its_engine_and_balances_the_rest():
    pool = make_pool(slots=(3,), versions=(0,))
    first = pool.route(["a", "b", "c"])
    assert sorted(first) == [0, 1, 2]  # balanced: one each
    for e in first:
        pool.release(e)
    for _ in range(5):  # later turns of the same trajectories stay put
        again = pool.route(["a", "b", "c"])
        assert again == first
        for e in again:
            pool.release(e)
    assert pool.stats["affinity_hits"] == 15
    loads = collections.Counter(pool.route([None] * 30))
    assert sorted(loads.values()) == [10, 10, 10]


def test_pool_generate_batches_per_engine_and_seeds_each_prompt_by_its_place():
    """An engine's prompts go in one call; seeded, the call names each row's seed, so prompt j samples with
    seed + j wherever it lands."""
    pool = make_pool(slots=(2,), versions=(0,))
    seen = []

    async def record(prompts, params, eng, seeds):
        seen.append((eng.eid, len(prompts), seeds))
        return [GenerationOutput([eng.eid], [0.0], "length", 0) for _ in prompts]

    for e in pool.engines:
        e.generate = lambda p, s, _e=e, seeds=None: record(p, s, _e, seeds)
    outs = asyncio.run(pool.generate([[1]] * 4, SamplingParams(), keys=["a", "b", "c", "d"]))
    assert [o.token_ids[0] for o in outs] == [0, 1, 0, 1]
    assert sorted(seen) == [(0, 2, None), (1, 2, None)]
    seen.clear()
    outs = asyncio.run(pool.generate([[1]] * 4, SamplingParams(seed=100), keys=["a", "b", "c", "d"]))
    assert [o.token_ids[0] for o in outs] == [0, 1, 0, 1]  # the keys keep their engines
    assert sorted(seen) == [(0, 2, [100, 102]), (1, 2, [101, 103])]
    assert pool.inflight() == [0, 0]


def test_a_seeded_group_samples_the_same_on_one_engine_two_or_after_a_failure():
    """The episodes of a seeded group come out token for token the same whether one engine plays them, two share
    them, or one of two fails mid-group and the other takes its rows over; and an episode's turns do not depend on
    which other episodes still run."""
    from transformers import Qwen2Config

    from rollout_sglang.agent_loop import run_group_lockstep
    from rollout_sglang.chat_template import ChatTemplate
    from rollout_sglang.engines.local import LocalEngine
    from rollout_sglang.engines.protocol import EngineUnavailable
    from rollout_sglang.tokenizer import load_tokenizer

    template = ChatTemplate(load_tokenizer("examples/tokenizer/tiny_agent"))
    cfg = Qwen2Config(vocab_size=len(template.tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024)

    def engine() -> LocalEngine:
        return LocalEngine.from_config(cfg, init_seed=0, version=0)  # the same weights each time

    class FailsOnce:
        def __init__(self, inner: LocalEngine, after: int) -> None:
            self.inner, self.calls, self.after = inner, 0, after
            self.continuous_batching = True

        def __getattr__(self, name):
            return getattr(self.inner, name)

        async def generate(self, prompts, params, **kw):
            self.calls += 1
            if self.calls == self.after:
                raise EngineUnavailable("killed")
            return await self.inner.generate(prompts, params, **kw)

    def play(slot: list, env: ChattyEnv | None = None) -> list[list[int]]:
        pool = VersionPool([slot], seed=1)
        params = SamplingParams(max_new_tokens=6, temperature=1.0, seed=11)
        env = env or ChattyEnv(turns=3)
        trajs = asyncio.run(run_group_lockstep(pool, env, template, [("chat", i, 0) for i in range(6)],
                                               params, EpisodeOptions(EpisodeLimits(max_turns=4,
                                                                                    max_total_tokens=2000))))
        return [t.token_ids for t in trajs]

    alone = play([engine()])
    assert len({tuple(t) for t in alone}) == 6  # six different samples: no two rows share a stream
    assert play([engine(), engine()]) == alone
    flaky = FailsOnce(engine(), after=2)  # its second turn fails; the other engine plays its rows
    pool_rows = play([engine(), flaky])
    assert flaky.calls >= 2 and pool_rows == alone

    class EarlyEnds(ChattyEnv):  # episodes 0 and 1 end after their first turn, the others after three
        async def interact(self, session_id, messages):
            if session_id.startswith(("chat-0-", "chat-1-")):
                return TaskReply(messages=[], status=SampleStatus.COMPLETED, finish=True, reward=1.0)
            return await super().interact(session_id, messages)

    early = play([engine(), engine()], EarlyEnds(turns=3))
    assert all(len(early[j]) < len(alone[j]) for j in (0, 1)) and early[2:] == alone[2:]


# ---------------------------------------------------- cross-policy through the agent loop
class ChattyEnv:
    """Replies with a user message to whatever the agent says; finishes after ``turns`` turns."""

    def __init__(self, turns: int = 5) -> None:
        self.turns = turns
        self.n: dict[str, int] = {}

    async def start_sample(self, task, index):
        sid = f"{task}-{index}-{len(self.n)}"
        self.n[sid] = 0
        return sid, TaskReply(messages=[{"role": "user", "content": f"Say anything, episode {index}."}])

    async def interact(self, session_id, messages):
        self.n[session_id] += 1
        if self.n[session_id] >= self.turns:
            return TaskReply(messages=[], status=SampleStatus.COMPLETED, finish=True, reward=1.0)
        return TaskReply(messages=[{"role": "user", "content": "go on"}])

    async def cancel(self, session_id):
        pass


def _token_logprobs(engine, tokens: list[int], temperature: float) -> list[float]:
    """log softmax(logits / T)[token] at every position t >= 1 under ``engine``'s model (one forward); [0] = 0."""
    with torch.no_grad():
        logits = engine.model(torch.tensor([tokens])).logits[0].float() / temperature
    logp = torch.log_softmax(logits[:-1], dim=-1).gather(-1, torch.tensor(tokens[1:])[:, None])[:, 0]
    return [0.0] + logp.tolist()


def test_cross_policy_turns_mix_versions_and_log_probs_match_the_sampling_engine():
    from transformers import Qwen2Config

    from rollout_sglang.agent_loop import run_group_lockstep
    from rollout_sglang.chat_template import ChatTemplate
    from rollout_sglang.engines.local import LocalEngine
    from rollout_sglang.tokenizer import load_tokenizer

    tok = load_tokenizer("examples/tokenizer/tiny_agent")
    template = ChatTemplate(tok)
    cfg = Qwen2Config(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024)
    # three versions in three slots (slot 1 has two engines with the same weights)
    by_version = {v: LocalEngine.from_config(cfg, init_seed=v, version=v) for v in (7, 8, 9)}
    twin = LocalEngine.from_config(cfg, init_seed=9, version=9)
    pool = VersionPool([[by_version[7]], [by_version[9], twin], [by_version[8]]], policy="uniform", seed=1)
    temperature = 0.9
    params = SamplingParams(max_new_tokens=5, temperature=temperature, seed=11)
    requests = [("chat", i, i // 2) for i in range(6)]
    trajs = asyncio.run(run_group_lockstep(pool, ChattyEnv(turns=5), template, requests, params,
                                           EpisodeOptions(EpisodeLimits(max_turns=8, max_total_tokens=2000))))
    mixed = [t for t in trajs if len(set(t.turn_versions)) > 1]
    assert mixed, [t.turn_versions for t in trajs]
    assert any(t.num_turns >= 3 for t in trajs)
    checked = 0
    for t in trajs:
        under = {v: _token_logprobs(e, t.token_ids, temperature) for v, e in by_version.items()}
        for (start, end), v in zip(t.turn_spans, t.turn_versions):
            recorded = t.behavior_logprobs[start:end]
            assert recorded == pytest.approx(under[v][start:end], abs=1e-4), (v, start)
            for o in by_version:  # and they are not those of the other versions
                if o != v:
                    assert max(abs(a - b) for a, b in zip(recorded, under[o][start:end])) > 1e-3
            checked += end - start
    assert checked > 50
    assert pool.inflight() == [0, 0, 0, 0] and not pool._affinity  # leases returned, router memory freed


def test_single_slot_requests_wait_for_its_update_instead_of_failing():
    """max_versions=1 with several engines: generation waits while the only slot updates, then gets the new version."""
    pool = make_pool(slots=(2,), live_timeout_s=30)
    prompts = [[1], [2], [3]]

    async def run() -> tuple[list[GenerationOutput], float]:
        slot = await asyncio.to_thread(pool.begin_update, 1)
        with pytest.raises(RuntimeError, match="no live slot"):
            pool.route([None])  # the synchronous router still refuses
        threading.Timer(0.3, pool.end_update, args=(slot,)).start()
        t0 = time.monotonic()
        outs = await pool.generate(prompts, SamplingParams(max_new_tokens=1))
        return outs, time.monotonic() - t0

    outs, waited = asyncio.run(run())
    assert waited >= 0.25
    assert [o.version for o in outs] == [1, 1, 1]
    assert sorted({o.token_ids[0] for o in outs}) == [0, 1]  # both engines of the slot serve
    assert pool.inflight() == [0, 0]


def test_waiting_for_a_live_slot_times_out_with_a_clear_error():
    pool = make_pool(slots=(2,), live_timeout_s=0.2)
    pool.begin_update(1)
    t0 = time.monotonic()
    with pytest.raises(TimeoutError, match=r"no live slot .* for 0.2s .*updating.*engine_unavailable_timeout_s"):
        asyncio.run(pool.generate([[1]], SamplingParams(max_new_tokens=1)))
    assert time.monotonic() - t0 < 5
    assert pool.inflight() == [0, 0]


def test_config_accepts_async_with_one_slot_of_several_engines():
    from megatron_agentrl.config import load_config

    cfg = load_config("tests/configs/tiny_test.yaml", ["pipeline.mode=async", "rollout.max_versions=1",
                                                         "rollout.engines_per_slot=2"])
    assert cfg.rollout.engines_per_slot == 2 and cfg.pipeline.mode == "async"


def test_evaluation_reads_only_a_live_slot():
    """Evaluation takes the newest *live* slot whatever the sampling policy, and gives up (after the pool's
    unavailable timeout) when every slot is updating or failed, instead of reading half-loaded weights."""
    from megatron_agentrl.pipeline.evaluation import _NewestWeights
    from megatron_agentrl.pipeline.rollout_side import RolloutSide

    pool = VersionPool([[FakeEngine(0, version=3)], [FakeEngine(1, version=2)]], policy="uniform",
                       live_timeout_s=0.2)
    side = RolloutSide(pool=pool, engines=[], env=None, train_env=None, template=None, tasks={}, task_names=[],
                       train_indices={}, eval_indices={}, rng=None)
    newest = _NewestWeights(side)

    def served_by() -> set[int]:
        outs = asyncio.run(newest.generate([[1]] * 8, SamplingParams(max_new_tokens=1)))
        return {o.token_ids[0] for o in outs}

    assert served_by() == {0} and newest.version == 3
    pool.slots[0].updating = True  # the newest slot is mid-update: the older live one serves evaluation
    assert served_by() == {1} and newest.version == 2
    pool.slots[1].failed = True
    with pytest.raises(TimeoutError, match="no live slot"):
        served_by()
