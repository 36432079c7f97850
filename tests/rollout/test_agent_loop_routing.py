"""Routed experts through the agent loop and into the training batch: each turn asks only for the positions
earlier turns did not cover, the trajectory holds every position's experts from the engine that sampled it,
and an engine that gives none costs the episode its routing, not the run."""
from __future__ import annotations

import numpy as np
import torch

from megatron_agentrl.config import AlgoConfig
from megatron_agentrl.pipeline.batch import build_rl_batch
from rollout_sglang.chat_template import ChatTemplate
from tests.rollout.support import FakeEngine, FakeEnv, run

LAYERS, TOPK, EXPERTS = 3, 2, 16


def experts_at(pos: int, version: int) -> np.ndarray:
    """The experts the fake engine 'chose' at ``pos``: a function of the position and the engine's version."""
    base = np.arange(LAYERS * TOPK).reshape(LAYERS, TOPK)
    return ((base + pos * 3 + version * 5) % EXPERTS).astype(np.uint8)


class RoutingEngine(FakeEngine):
    """FakeEngine that answers ``routing_from`` as the protocol says: positions [from, prompt + generated - 1)."""

    def __init__(self, template: ChatTemplate, version: int = 7, give_routing: bool = True) -> None:
        super().__init__(template, version)
        self.asked: list[list[int]] = []
        self.give_routing = give_routing

    async def generate(self, prompts, params, routing_from=None, seeds=None):
        outs = await super().generate(prompts, params)
        self.asked.append(list(routing_from))
        for p, out, start in zip(prompts, outs, routing_from):
            end = len(p) + len(out.token_ids) - 1
            if self.give_routing:
                out.routed_experts = np.stack([experts_at(t, self.version) for t in range(start, end)])
        return outs


def test_each_turn_asks_for_new_positions_and_the_trajectory_holds_them_all(template: ChatTemplate) -> None:
    engine = RoutingEngine(template)
    trajs = run(engine, FakeEnv(), template, [("calc", 0, 1), ("two", 1, 2)], capture_routing=True)
    for i, t in enumerate(trajs):
        assert t.status == "completed"
        last = t.turn_spans[-1][1] - 1  # the last generated token: no forward pass has run on it
        assert t.routed_experts.shape == (last, LAYERS, TOPK) and t.routed_experts.dtype == np.uint8
        assert np.array_equal(t.routed_experts, np.stack([experts_at(p, 7) for p in range(last)]))
        # turn 0 from position 0, turn 1 from the first turn's last token (env tokens in between included)
        assert [asked[i] for asked in engine.asked] == [0, t.turn_spans[0][1] - 1]


def test_a_turn_cut_by_the_context_limit_keeps_only_its_kept_tokens(template: ChatTemplate) -> None:
    engine = RoutingEngine(template)
    (t,) = run(engine, FakeEnv(), template, [("chatty", 0, 1)], max_total_tokens=340, capture_routing=True)
    assert t.status == "agent context limit"
    assert len(t.token_ids) == 340 and t.routed_experts.shape[0] == 339


def test_an_engine_without_routing_leaves_the_episode_without_any(template: ChatTemplate, caplog) -> None:
    engine = RoutingEngine(template, give_routing=False)
    trajs = run(engine, FakeEnv(), template, [("calc", 0, 1)], capture_routing=True)
    assert trajs[0].status == "completed" and trajs[0].routed_experts is None
    assert "trains on the trainer's own routing" in caplog.text


def test_without_capture_no_routing_is_asked(template: ChatTemplate) -> None:
    engine = FakeEngine(template)  # its generate takes no routing_from: asking would fail
    (t,) = run(engine, FakeEnv(), template, [("calc", 0, 1)])
    assert t.status == "completed" and t.routed_experts is None


def test_the_batch_holds_each_rows_routing_and_minus_one_elsewhere(template: ChatTemplate) -> None:
    engine = RoutingEngine(template)
    trajs = run(engine, FakeEnv(), template, [("calc", 0, 1), ("two", 1, 1), ("calc", 2, 1)], capture_routing=True)
    trajs[2].routed_experts = None  # e.g. its engine gave none
    for t in trajs:
        t.task = "calc"
    rl = build_rl_batch(trajs, ["calc"], AlgoConfig())
    r = rl.batch.routed_experts
    assert r.dtype == torch.int16 and r.shape == (3, rl.batch.tokens.shape[1], LAYERS, TOPK)
    for i in range(2):
        n = len(trajs[i].routed_experts)
        assert torch.equal(r[i, :n], torch.from_numpy(trajs[i].routed_experts.astype(np.int16)))
        assert (r[i, n:] == -1).all()
    assert (r[2] == -1).all()
    for t in trajs:
        t.routed_experts = None
    assert build_rl_batch(trajs, ["calc"], AlgoConfig()).batch.routed_experts is None


class RoutingScript:
    """Gateway engine: scripted turns (``support.Script``) that answer ``routing_from`` by position."""

    def __init__(self, template: ChatTemplate, texts: list[str], version: int = 5) -> None:
        from tests.rollout.support import Script

        self.script = Script(template, texts, version=version)
        self.version = version
        self.asked: list[int] = []

    async def generate(self, prompts, params, routing_from=None, seeds=None):
        outs = await self.script.generate(prompts, params)
        self.asked += list(routing_from)
        (p,), (o,), (start,) = prompts, outs, routing_from
        o.routed_experts = np.stack([experts_at(t, self.version) for t in range(start, len(p) + len(o.token_ids) - 1)])
        return outs


def test_gateway_segments_carry_each_turns_routing(template: ChatTemplate) -> None:
    """Through the gateway (openai client, two turns with a tool reply between them): the second turn asks only for
    the positions after the first turn's last token, and the session's trajectory holds every position's experts."""
    import asyncio

    from tests.rollout.support import ADD_TOOLS, client, make_gateway, open_session, serving

    engine = RoutingScript(template, ["Let me add.\n" + '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}'
                                      "\n</tool_call>", "It is 3."])
    gw = make_gateway(template, engine, capture_routing=True)
    msgs = [{"role": "user", "content": "Add 1 and 2."}]

    async def main():
        async with serving(gw) as srv:
            info = await open_session(srv)
            c = client(info)
            first = await c.chat.completions.create(model="policy", messages=msgs, tools=ADD_TOOLS)
            call = first.choices[0].message
            msgs.append(call.model_dump(exclude_none=True))
            msgs.append({"role": "tool", "tool_call_id": call.tool_calls[0].id, "content": "3"})
            await c.chat.completions.create(model="policy", messages=msgs, tools=ADD_TOOLS)
            await c.close()
            return gw.session(info["session_id"]).to_trajectories()

    (traj,) = asyncio.run(main())
    last = traj.turn_spans[-1][1] - 1
    assert np.array_equal(traj.routed_experts, np.stack([experts_at(p, 5) for p in range(last)]))
    assert engine.asked == [0, traj.turn_spans[0][1] - 1]
