"""Agent frameworks, unchanged but for base URL and key, play a tool-using episode through the gateway on a tiny model:
the OpenAI Agents SDK (`openai-agents`, Responses API, streamed or not) and smolagents (a graph of tool-calling
steps over Chat Completions).

Each framework writes its own prompt (instructions, tool schemas), so the tiny model is taught that prompt: a first
pass with a scripted engine records the episode's trajectory as the gateway lays it out, a tiny Qwen2 learns its
sampled turns by rote, and the second pass, on that real local engine, must give the same token-exact trajectory
(the engine's sampled tokens and log-probs, the loss mask on them only) with the tool calls round-tripped."""
from __future__ import annotations

import asyncio
from typing import Any

import pytest

from rollout_sglang.engines.protocol import SamplingParams
from tests.rollout.support import Script, Spy, make_gateway, open_session, serving, teach

WARM = SamplingParams(max_new_tokens=128, temperature=0.5)
ADD_CALL = '<tool_call>\n{"name": "add", "arguments": {"a": 40, "b": 2}}\n</tool_call>'


def two_passes(template, turns: list[str], play, max_total_tokens: int = 4096):
    """``play(info)`` first on a scripted engine, then on a tiny model taught that episode's turns; returns both
    passes' (result, trajectories) and the second pass's engine calls."""
    out = []
    engine: Any = Script(template, turns)
    for _ in range(2):
        spy = Spy(engine)
        gw = make_gateway(template, spy, sampling=WARM, max_total_tokens=max_total_tokens)

        async def main(gw=gw):
            async with serving(gw) as srv:
                info = await open_session(srv)
                result = await play(info)
                return result, gw.sessions[info["session_id"]].to_trajectories()

        out.append((*asyncio.run(main()), spy.calls))
        first, *rest = out[0][1]  # a framework that rewrites its history has several segments
        engine = teach(template, first.token_ids, first.loss_mask, version=2,
                       more=[(t.token_ids, t.loss_mask) for t in rest])
    return out


def check_token_exact(template, traj, calls, turns: list[str]) -> None:
    assert [template.decode(o[0].token_ids) for _, o in calls] == [t + "<|im_end|>" for t in turns]
    for (s, e), (prompts, outs) in zip(traj.turn_spans, calls, strict=True):
        assert traj.token_ids[s:e] == outs[0].token_ids and traj.behavior_logprobs[s:e] == outs[0].logprobs
        assert prompts[0] == traj.token_ids[:s]
    spans = [j for s, e in traj.turn_spans for j in range(s, e)]
    assert [j for j, m in enumerate(traj.loss_mask) if m] == spans and traj.turn_versions == [2] * len(turns)


# ------------------------------------------------------------------------------------------------ openai-agents
@pytest.mark.parametrize("stream", [False, True])
def test_openai_agents_sdk(template, stream):
    from agents import Agent, OpenAIResponsesModel, Runner, function_tool, set_tracing_disabled
    from openai import AsyncOpenAI

    set_tracing_disabled(True)  # its traces would go to api.openai.com
    results: list[int] = []

    @function_tool
    def add(a: int, b: int) -> int:
        """Add two integers."""
        results.append(a + b)
        return a + b

    async def play(info):
        client = AsyncOpenAI(base_url=info["base_url"], api_key=info["api_key"], max_retries=0)
        agent = Agent(name="calc", instructions="You add numbers.", tools=[add],
                      model=OpenAIResponsesModel(model="policy", openai_client=client))
        if stream:
            run = Runner.run_streamed(agent, "Solve the task EP=calc.")
            kinds = {e.type async for e in run.stream_events()}
            assert "raw_response_event" in kinds
        else:
            run = await Runner.run(agent, "Solve the task EP=calc.")
        await client.close()
        return run.final_output

    turns = ["Let me add.\n" + ADD_CALL, "The answer is 42."]
    (out1, trajs1, _), (out2, trajs2, calls) = two_passes(template, turns, play)
    assert out1 == out2 == "The answer is 42." and results == [42, 42]
    (t1,), (t2,) = trajs1, trajs2
    check_token_exact(template, t2, calls, turns)
    assert (t2.token_ids, t2.loss_mask) == (t1.token_ids, t1.loss_mask)


# ------------------------------------------------------------------------------------------------ smolagents
def smol_add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: the first integer.
        b: the second integer.
    """
    return a + b


@pytest.mark.slow  # its system prompt is ~2,900 tokens of the tiny vocabulary: teaching the model takes minutes
def test_smolagents_tool_calling_agent(template):
    from smolagents import OpenAIServerModel, ToolCallingAgent, tool

    add = tool(smol_add)

    async def play(info):
        model = OpenAIServerModel(model_id="policy", api_base=info["base_url"], api_key=info["api_key"])
        agent = ToolCallingAgent(tools=[add], model=model, max_steps=3, verbosity_level=0)
        return await asyncio.to_thread(agent.run, "Solve the task EP=calc.")

    # tool_choice "required": the gateway forces "<tool_call>\n", the engine samples the rest of each call
    turns = ['{"name": "smol_add", "arguments": {"a": 40, "b": 2}}\n</tool_call>',
             '{"name": "final_answer", "arguments": {"answer": "42"}}\n</tool_call>']
    (out1, trajs1, _), (out2, trajs2, calls) = two_passes(template, turns, play, max_total_tokens=16384)
    assert str(out1) == str(out2) == "42"
    # smolagents re-renders its memory as text ("Calling tools: [...]", "Observation: 42" as a user message): the
    # second request rewrites the history, so each turn is a segment of its own, each token-exact
    assert len(trajs2) == 2 and all(t.metrics["history_rewrites"] == 1.0 for t in trajs2)
    for t, t1, call, turn in zip(trajs2, trajs1, calls, turns, strict=True):
        assert (t.token_ids, t.loss_mask) == (t1.token_ids, t1.loss_mask)
        check_token_exact(template, t, [call], [turn])
        (s, _), = t.turn_spans
        assert template.decode(t.token_ids[s - 3:s]).endswith("<tool_call>\n")  # forced by tool_choice required
