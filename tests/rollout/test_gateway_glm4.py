"""The gateway in the GLM chat formats (GLM-4-0414 and GLM-4.5): the same episode through the openai client (streamed
or not) and through the built-in agent loop gives the same trajectory; a tool choice forces the format's call head."""
from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest

from rollout_sglang.agent_loop import run_group_lockstep
from rollout_sglang.engines.protocol import SamplingParams
from tests.rollout.chat_formats import glm4_engine, glm45_engine
from tests.rollout.support import ADD_TOOLS as TOOLS
from tests.rollout.support import (
    FakeEnv,
    Script,
    client,
    episode,
    make_gateway,
    open_session,
    play_episode,
    serving,
)

ARGS45 = "<arg_key>a</arg_key>\n<arg_value>1</arg_value>\n<arg_key>b</arg_key>\n<arg_value>2</arg_value>\n</tool_call>"
# per format: what the engine samples after a forced call to "add" (named) and after a forced "some call"
# (required; None: the format cannot force one among several tools), and the forced head of the named call
FORCED = {
    "glm4": {"named": '{"a": 1, "b": 2}', "required": None, "head": "add \n"},
    "glm45": {"named": ARGS45, "required": "sub\n" + ARGS45, "head": "\n<think></think>\n<tool_call>add\n"},
}


@pytest.fixture(params=["glm4", "glm45"])
def fmt(request) -> tuple[str, Any, Any]:
    """(name, template, a factory of fresh scripted engines for the calc episode) of each GLM format."""
    if request.param == "glm4":
        t = request.getfixturevalue("glm4_template")
        return "glm4", t, lambda: glm4_engine(t)
    t = request.getfixturevalue("glm45_template")
    return "glm45", t, lambda: glm45_engine(t)


@pytest.mark.parametrize("stream", [False, True])
def test_glm_episode_equals_the_agent_loop(fmt, stream):
    """Three turns (a call with content, two calls, an answer): the gateway's trajectory is the agent loop's, token
    for token, with the same loss mask, log-probs, versions and spans; the client types the calls (and GLM-4.5's
    reasoning comes back as reasoning_content)."""
    name, template, engine = fmt
    gw = make_gateway(template, engine(), env=FakeEnv())

    comps, step, (traj,) = asyncio.run(play_episode(gw, "glm", 3, stream))
    assert step["finish"] and traj.status == "completed" and traj.reward == 1.0
    assert [c.choices[0].finish_reason for c in comps] == ["tool_calls", "tool_calls", "stop"]
    assert comps[0].choices[0].message.content == "Let me add."
    calls = comps[1].choices[0].message.tool_calls
    assert [json.loads(tc.function.arguments) for tc in calls] == [{"a": 1, "b": 1}, {"a": 2, "b": 2}]
    assert [tc.id for tc in calls] == ["call_1", "call_2"]
    assert comps[2].choices[0].message.content == "The answer is 42."
    if name == "glm45":
        reasoning = [(c.choices[0].message.model_extra or {}).get("reasoning_content") for c in comps]
        assert reasoning == ["Add them.", None, "Both sums are in."]
    (ref,) = asyncio.run(run_group_lockstep(engine(), FakeEnv(), template, [("calc", 0, 0)],
                                            SamplingParams(max_new_tokens=256), episode(5, 4096)))
    assert ref.status == "completed"
    assert traj.token_ids == ref.token_ids and traj.loss_mask == ref.loss_mask
    assert traj.behavior_logprobs == ref.behavior_logprobs
    assert traj.versions == ref.versions and traj.turn_versions == [3, 3, 3] and traj.turn_spans == ref.turn_spans


def test_glm_tool_choice_forces_the_call_head(fmt):
    """A named tool choice forces the format's head of that call (GLM-4: the name line; GLM-4.5: an empty think
    block and <tool_call>name), as loss-mask-0 tokens; 'required' forces some call where the format can."""
    name, template, _ = fmt
    forced = FORCED[name]
    obs = template.role_ids["observation"]
    engine = Script(template, [forced["named"]] + ([forced["required"]] if forced["required"] else []), end=obs)
    gw = make_gateway(template, engine)
    several = TOOLS + [{"type": "function", "function": {"name": "sub"}}]

    async def main():
        async with serving(gw) as srv:
            info = await open_session(srv)
            async with client(info) as c:
                comp = await c.chat.completions.create(
                    model="glm", messages=[{"role": "user", "content": "add 1 and 2"}], tools=TOOLS,
                    tool_choice={"type": "function", "function": {"name": "add"}})
                required = None
                if forced["required"] is None:
                    with pytest.raises(Exception, match="several tools"):
                        await c.chat.completions.create(model="glm", messages=[{"role": "user", "content": "x"}],
                                                        tools=several, tool_choice="required")
                else:
                    required = await c.chat.completions.create(
                        model="glm", messages=[{"role": "user", "content": "x"}], tools=several,
                        tool_choice="required")
            return comp, required, gw.sessions[info["session_id"]].to_trajectories()

    comp, required, trajs = asyncio.run(main())
    (tc,) = comp.choices[0].message.tool_calls
    assert tc.function.name == "add" and json.loads(tc.function.arguments) == {"a": 1, "b": 2}
    t = trajs[0]
    s, e = t.turn_spans[0]
    prompt = template.encode_prompt([{"role": "user", "content": "add 1 and 2"}], TOOLS)
    assert template.decode(t.token_ids[len(prompt):s]) == forced["head"]
    assert t.loss_mask[len(prompt):s] == [0] * (s - len(prompt))
    assert t.token_ids[e - 1] == obs
    if required is not None:  # a new history: a second segment, whose forced head names no tool
        (tc,) = required.choices[0].message.tool_calls
        assert tc.function.name == "sub" and json.loads(tc.function.arguments) == {"a": 1, "b": 2}
        t2 = trajs[-1]
        s2, _ = t2.turn_spans[0]
        prompt2 = template.encode_prompt([{"role": "user", "content": "x"}], several)
        assert template.decode(t2.token_ids[len(prompt2):s2]) == "\n<think></think>\n<tool_call>"
