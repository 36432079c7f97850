"""The gateway in the GLM-4 chat format: the same episode through the openai client (streamed or not) and through
the built-in agent loop gives the same trajectory; a named tool choice forces GLM-4's call head."""
from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest
import test_chat_template_glm4 as glm
from test_agent_loop import TOOLS, FakeEnv
from test_gateway import Script, client, make_gateway, open_session, serving

from rollout_sglang.agent_loop import run_group_lockstep
from rollout_sglang.engine import SamplingParams

tokenizer, template = glm.tokenizer, glm.template  # the GLM-4 stand-in tokenizer and template (module fixtures)


@pytest.mark.parametrize("stream", [False, True])
def test_glm4_episode_equals_the_agent_loop(template, stream):
    """Three turns (a call with content, two calls, an answer): the gateway's trajectory is the agent loop's, token
    for token, with the same loss mask, log-probs, versions and spans; the client types the calls."""
    gw = make_gateway(template, glm._GlmEngine(template), env=FakeEnv())

    async def main():
        async with serving(gw) as srv:
            info = await open_session(srv, task="calc", index=0)
            msgs: list[Any] = list(info["messages"])
            comps = []
            async with client(info) as c:
                for _ in range(3):
                    kw: dict[str, Any] = dict(model="glm", messages=msgs, tools=info["tools"])
                    if stream:
                        async with c.chat.completions.stream(**kw) as st:
                            comp = await st.get_final_completion()
                    else:
                        comp = await c.chat.completions.create(**kw)
                    comps.append(comp)
                    msgs.append(comp.choices[0].message)
                    step = await c.post("/env", body={}, cast_to=object)
                    msgs += step["messages"]
            return comps, step, gw.sessions[info["session_id"]].to_trajectories()

    comps, step, (traj,) = asyncio.run(main())
    assert step["finish"] and traj.status == "completed" and traj.reward == 1.0
    assert [c.choices[0].finish_reason for c in comps] == ["tool_calls", "tool_calls", "stop"]
    assert comps[0].choices[0].message.content == "Let me add."
    calls = comps[1].choices[0].message.tool_calls
    assert [json.loads(tc.function.arguments) for tc in calls] == [{"a": 1, "b": 1}, {"a": 2, "b": 2}]
    assert [tc.id for tc in calls] == ["call_1", "call_2"]
    assert comps[2].choices[0].message.content == "The answer is 42."
    (ref,) = asyncio.run(run_group_lockstep(glm._GlmEngine(template), FakeEnv(), template, [("calc", 0, 0)],
                                            SamplingParams(max_new_tokens=256), max_turns=5, max_total_tokens=4096))
    assert ref.status == "completed"
    assert traj.token_ids == ref.token_ids and traj.loss_mask == ref.loss_mask
    assert traj.behavior_logprobs == ref.behavior_logprobs
    assert traj.versions == ref.versions == [3, 3, 3] and traj.turn_spans == ref.turn_spans


def test_glm4_named_tool_choice_forces_the_name_line(template):
    obs = template.role_ids["observation"]
    engine = Script(template, ['{"a": 1, "b": 2}'], end=obs)
    gw = make_gateway(template, engine)

    async def main():
        async with serving(gw) as srv:
            info = await open_session(srv)
            async with client(info) as c:
                comp = await c.chat.completions.create(
                    model="glm", messages=[{"role": "user", "content": "add 1 and 2"}], tools=TOOLS,
                    tool_choice={"type": "function", "function": {"name": "add"}})
                with pytest.raises(Exception, match="several tools"):
                    await c.chat.completions.create(model="glm", messages=[{"role": "user", "content": "x"}],
                                                    tools=TOOLS + [{"type": "function", "function": {"name": "sub"}}],
                                                    tool_choice="required")
            return comp, gw.sessions[info["session_id"]].to_trajectories()[0]

    comp, t = asyncio.run(main())
    (tc,) = comp.choices[0].message.tool_calls
    assert tc.function.name == "add" and json.loads(tc.function.arguments) == {"a": 1, "b": 2}
    (s, e), = t.turn_spans
    prompt = template.encode_prompt([{"role": "user", "content": "add 1 and 2"}], TOOLS)
    assert template.decode(t.token_ids[len(prompt):s]).startswith("add") and t.loss_mask[len(prompt):s] == [0] * (
        s - len(prompt))
    assert t.token_ids[e - 1] == obs
