"""The gateway through the real `openai` client: every completion a turn of a token-exact trajectory, history
rewrites as new segments, the OpenAI surface (tool calls, streaming, errors), limits, credentials, the agent runner.

Engines: a tiny Qwen2 taught the calc episode of ``support.SCRIPTS`` (a real LocalEngine with real log-probs),
and scripted engines where a test needs a given turn."""
from __future__ import annotations

import asyncio
import json
from typing import Any

import openai
import pytest
from openai import AsyncOpenAI

from rollout_sglang.agent_loop import run_group_lockstep
from rollout_sglang.engines.protocol import SamplingParams
from rollout_sglang.engines.version_pool import VersionPool
from rollout_sglang.gateway import AgentRunner, AgentRunnerOptions, GatewayOptions, GatewayServer
from tests.rollout.support import ADD_TOOLS as TOOLS
from tests.rollout.support import CALC_FIRST as FIRST
from tests.rollout.support import (
    FakeEngine,
    FakeEnv,
    Script,
    Spy,
    call,
    client,
    complete,
    episode,
    http,
    make_gateway,
    open_session,
    serving,
)
from tests.support.http_cap import check_connection_cap


def turn_versions(traj: dict[str, Any]) -> list[int]:
    """The version each sampled turn of a trajectory's JSON (``versions`` per token) started on."""
    return [traj["versions"][s] for s, e in traj["turn_spans"] if e > s]

CALC_TURNS = ["Let me add.\n" + call(40, 2), "The answer is 42."]


# ------------------------------------------------------------------------------------------------ acceptance
@pytest.mark.parametrize("stream", [False, True])
def test_tool_calling_episode_is_token_exact(template, taught_engine, stream):
    """A multi-turn tool-calling episode with the openai client against a tiny local engine: the trajectory holds
    the engine's sampled tokens and log-probs for every turn and the chat template's pieces between them; the
    client parses the replies into its typed objects (streamed or not)."""
    spy = Spy(taught_engine)
    gw = make_gateway(template, spy, env=FakeEnv())

    async def main():
        async with serving(gw) as srv:
            info = await open_session(srv, task="calc", index=0, group_id=9)
            assert info["messages"] == FIRST and info["tools"] == TOOLS and info["status"] == "running"
            c = client(info)
            msgs: list[Any] = list(info["messages"])
            comps, steps = [], []
            for _ in range(2):
                kw = dict(model="policy", messages=msgs, tools=info["tools"], temperature=0.5, seed=11, logprobs=True)
                if stream:
                    kw["stream_options"] = {"include_usage": True}
                comp = await complete(c, stream, **kw)
                comps.append(comp)
                msgs.append(comp.choices[0].message)
                step = await c.post("/env", body={"messages": [comp.choices[0].message.model_dump(exclude_none=True)]},
                                    cast_to=object)
                steps.append(step)
                msgs += step["messages"]
            _, traj = await http("GET", f"{srv.url}/sessions/{info['session_id']}/trajectory")
            await c.close()
            return comps, steps, traj

    comps, steps, traj = asyncio.run(main())
    sampled = [outs[0] for _, outs in spy.calls]
    assert [template.decode(o.token_ids) for o in sampled] == [t + "<|im_end|>" for t in CALC_TURNS]
    # the OpenAI surface, as the client typed it
    first, second = comps[0].choices[0], comps[1].choices[0]
    assert first.finish_reason == "tool_calls" and second.finish_reason == "stop"
    assert first.message.content == "Let me add." and second.message.content == "The answer is 42."
    (tc,) = first.message.tool_calls
    assert isinstance(tc, openai.types.chat.ChatCompletionMessageFunctionToolCall)
    assert tc.type == "function" and tc.id == "call_0" and tc.function.name == "add"
    assert json.loads(tc.function.arguments) == {"a": 40, "b": 2}
    assert second.message.tool_calls in (None, [])
    for comp, out in zip(comps, sampled):
        assert [t.logprob for t in comp.choices[0].logprobs.content] == out.logprobs
        assert comp.usage.completion_tokens == len(out.token_ids)
        assert comp.system_fingerprint == "v3"
    assert steps[0]["messages"] == [{"role": "tool", "tool_call_id": "call_0", "content": "42"}]
    assert steps[1]["finish"] and steps[1]["reward"] == 1.0
    # the trajectory: the engine's tokens and log-probs per turn, the template's encoding between them
    assert traj["status"] == "completed" and traj["reward"] == 1.0 and traj["group_id"] == 9
    assert turn_versions(traj) == [3, 3] and traj["history_rewrites"] == 0 and len(traj["segments"]) == 1
    ids, mask, lps = traj["token_ids"], traj["loss_mask"], traj["logprobs"]
    (s0, e0), (s1, e1) = traj["turn_spans"]
    for (s, e), (prompts, outs) in zip(traj["turn_spans"], spy.calls):
        assert ids[s:e] == outs[0].token_ids and lps[s:e] == outs[0].logprobs
        assert prompts[0] == ids[:s]  # the engine continued exactly the trajectory
    assert ids[:s0] == template.encode_prompt(FIRST, TOOLS)
    assert ids[e0:s1] == template.encode_env_reply(steps[0]["messages"], ended_with=template.im_end_id)
    assert e1 == len(ids)
    assert mask == [int(s0 <= j < e0 or s1 <= j < e1) for j in range(len(ids))]
    assert all(lp == 0.0 for lp, m in zip(lps, mask) if not m)


def test_history_rewrite_starts_a_segment_and_never_retokenizes(template):
    """Whitespace changed in an earlier message: the gateway keeps the first segment as sampled, counts a rewrite and
    starts a new segment from the new messages; arguments that are equal JSON are not a rewrite."""
    engine = FakeEngine(template)
    gw = make_gateway(template, Spy(engine), env=FakeEnv())

    async def main():
        async with serving(gw) as srv:
            info = await open_session(srv, task="calc", index=0)
            c = client(info)
            msgs: list[Any] = list(FIRST)
            comp = await c.chat.completions.create(model="p", messages=msgs, tools=TOOLS)
            reply = comp.choices[0].message.model_dump(exclude_none=True)
            # the agent re-serializes the arguments with another key order: the same JSON, the same conversation
            reply["tool_calls"][0]["function"]["arguments"] = '{"b":2,"a":40}'
            msgs += [reply, {"role": "tool", "tool_call_id": "call_0", "content": "42"}]
            await c.chat.completions.create(model="p", messages=msgs, tools=TOOLS)
            _, before = await http("GET", f"{srv.url}/sessions/{info['session_id']}/trajectory")
            edited = [FIRST[0], {"role": "user", "content": "Solve the task  EP=calc."}] + msgs[2:]
            comp = await c.chat.completions.create(model="p", messages=edited, tools=TOOLS)
            _, after = await http("GET", f"{srv.url}/sessions/{info['session_id']}/trajectory")
            await c.close()
            return before, after, comp, edited

    before, after, comp, edited = asyncio.run(main())
    assert before["history_rewrites"] == 0 and len(before["segments"]) == 1 and len(turn_versions(before)) == 2
    assert after["history_rewrites"] == 1 and gw.stats.history_rewrites == 1
    first, second = after["segments"]
    assert first == before["segments"][0]  # kept exactly as sampled
    s, e = second["turn_spans"][0]
    edited_prompt = template.encode_prompt(edited, TOOLS)  # the new segment: the messages as sent, encoded once
    assert second["token_ids"][:s] == edited_prompt and after["token_ids"] == second["token_ids"]
    old_prompt = template.encode_prompt(FIRST, TOOLS)
    assert edited_prompt[:len(old_prompt)] != old_prompt and first["token_ids"][:len(old_prompt)] == old_prompt
    assert turn_versions(second) == [7] and comp.choices[0].message.content == "The answer is 42."
    assert [t["segment"] for t in after["turns"]] == [0, 0, 1]


def test_dropped_reply_and_changed_tools_are_rewrites(template):
    """A re-asked turn (the reply dropped) and a changed tool list each start a segment; a reply whose text the
    agent edited does too. Each segment is its own trajectory of the episode."""
    gw = make_gateway(template, Script(template, ["one", "two", "three", "four"]))

    async def main():
        async with serving(gw) as srv:
            info = await open_session(srv)
            c = client(info)
            msgs = [{"role": "user", "content": "hi"}]
            await c.chat.completions.create(model="p", messages=msgs)
            await c.chat.completions.create(model="p", messages=msgs)  # the same request again
            r = await c.chat.completions.create(model="p", messages=msgs, tools=TOOLS)
            edited = msgs + [{"role": "assistant", "content": r.choices[0].message.content + " "},
                             {"role": "user", "content": "more"}]
            await c.chat.completions.create(model="p", messages=edited, tools=TOOLS)
            await c.close()
            return gw.sessions[info["session_id"]]

    s = asyncio.run(main())
    assert s.history_rewrites == 3 and len(s.segments) == 4
    trajs = s.to_trajectories()
    assert len(trajs) == 4 and all(t.num_turns == 1 for t in trajs)
    assert all(t.metrics["history_rewrites"] == 3.0 for t in trajs)


def test_cross_policy_turns_record_their_version_and_logprobs(template):
    """Every completion is one request routed by the version pool: a session's turns carry the version of the engine
    that sampled each, and that engine's log-probs."""
    old, new = Script(template, ["old"], version=0), Script(template, ["new"], version=1)
    pool = VersionPool([[old], [new]], policy="uniform", seed=0)
    gw = make_gateway(template, pool, max_turns=12)

    async def main():
        async with serving(gw) as srv:
            info = await open_session(srv)
            c = client(info)
            msgs: list[Any] = [{"role": "user", "content": "go"}]
            for _ in range(10):
                comp = await c.chat.completions.create(model="p", messages=msgs)
                msgs += [comp.choices[0].message, {"role": "user", "content": "go"}]
            await c.close()
            return gw.sessions[info["session_id"]].to_trajectories()

    (t,) = asyncio.run(main())
    assert set(t.turn_versions) == {0, 1} and t.num_turns == 10
    for (s, e), v in zip(t.turn_spans, t.turn_versions):
        assert template.decode(t.token_ids[s:e - 1]) == ("old" if v == 0 else "new")
        assert t.behavior_logprobs[s] < 0 and all(m == 1 for m in t.loss_mask[s:e])


# ------------------------------------------------------------------------------------------------ the surface
def test_unparsable_tool_call_is_a_plain_reply_and_kept(template):
    """A malformed call comes back as text (no tool_calls, finish "stop"); its tokens stay in the trajectory."""
    bad_call = '<tool_call>\n{"name": "add", "arguments": {"a": 1,}}\n</tool_call>'
    gw = make_gateway(template, Script(template, [bad_call]))

    async def main():
        async with serving(gw) as srv:
            info = await open_session(srv)
            async with client(info) as c:
                comp = await c.chat.completions.create(model="p", messages=FIRST, tools=TOOLS)
            return comp, gw.sessions[info["session_id"]]

    comp, s = asyncio.run(main())
    choice = comp.choices[0]
    assert choice.finish_reason == "stop" and not choice.message.tool_calls and choice.message.content == bad_call
    assert s.tool_parse_errors == 1 and "not valid JSON" in s.turns[0].parse_error
    (t,) = s.to_trajectories()
    (start, end), = t.turn_spans
    assert template.decode(t.token_ids[start:end]) == bad_call + "<|im_end|>"
    assert t.metrics == {"tool_parse_errors": 1.0}


@pytest.mark.parametrize("choice", ["named", "required"])
def test_forced_tool_choice_prefills_the_call(template, choice):
    """tool_choice named / required: the call's head is forced (loss mask 0), the engine samples the rest."""
    engine = Script(template, ['{"a": 1, "b": 2}}\n</tool_call>'] if choice == "named" else
                    ['{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>'])
    gw = make_gateway(template, engine)
    tool_choice = {"type": "function", "function": {"name": "add"}} if choice == "named" else "required"

    async def main():
        async with serving(gw) as srv:
            info = await open_session(srv)
            async with client(info) as c:
                comp = await c.chat.completions.create(model="p", messages=FIRST, tools=TOOLS, tool_choice=tool_choice)
            return comp, gw.sessions[info["session_id"]].to_trajectories()[0]

    comp, t = asyncio.run(main())
    (tc,) = comp.choices[0].message.tool_calls
    assert comp.choices[0].finish_reason == "tool_calls" and json.loads(tc.function.arguments) == {"a": 1, "b": 2}
    forced = '<tool_call>\n{"name": "add", "arguments": ' if choice == "named" else "<tool_call>\n"
    (s, e), = t.turn_spans
    prompt = template.encode_prompt(FIRST, TOOLS)
    assert template.decode(t.token_ids[len(prompt):s]) == forced
    assert t.loss_mask[len(prompt):s] == [0] * (s - len(prompt))
    assert engine.prompts[0] == t.token_ids[:s]


def test_forced_prefixes_are_cached_within_a_bound_whatever_tools_agents_send(template, monkeypatch):
    """Each forced tool name costs one cached prefix; agents that send ever new names fill at most
    ``PREFIX_CACHE`` entries (an agent decides the keys)."""
    from rollout_sglang.gateway import gateway as gateway_module

    monkeypatch.setattr(gateway_module, "PREFIX_CACHE", 4)
    names = [f"tool_{i}" for i in range(12)]
    engine = Script(template, ['{"a": 1}}\n</tool_call>'] * len(names))
    gw = make_gateway(template, engine)

    async def main():
        async with serving(gw) as srv:
            for name in names:
                tools = [{**TOOLS[0], "function": {**TOOLS[0]["function"], "name": name}}]
                info = await open_session(srv)
                async with client(info) as c:
                    comp = await c.chat.completions.create(model="p", messages=FIRST, tools=tools,
                                                           tool_choice={"type": "function", "function": {"name": name}})
                assert comp.choices[0].message.tool_calls[0].function.name == name

    asyncio.run(main())
    info = gw._encode_prefix.cache_info()
    assert info.currsize == 4 and info.misses == len(names), info


def test_stop_strings_cut_the_turn_where_the_text_stops(template):
    """A stop string ends the text before it; the turn keeps the sampled tokens up to the one that completed it,
    and the next env piece closes it with an <|im_end|> of its own (mask 0)."""
    engine = Script(template, ["Hello world. STOP and more", "ok"])
    gw = make_gateway(template, engine)

    async def main():
        async with serving(gw) as srv:
            info = await open_session(srv)
            async with client(info) as c:
                comp = await c.chat.completions.create(model="p", messages=[{"role": "user", "content": "hi"}],
                                                       stop=["STOP"])
                msgs = [{"role": "user", "content": "hi"}, comp.choices[0].message, {"role": "user", "content": "x"}]
                await c.chat.completions.create(model="p", messages=msgs)
            return comp, gw.sessions[info["session_id"]].to_trajectories()[0]

    comp, t = asyncio.run(main())
    assert comp.choices[0].message.content == "Hello world." and comp.choices[0].finish_reason == "stop"
    (s, e), (s2, _) = t.turn_spans
    text = template.decode(t.token_ids[s:e])
    assert "STOP" in text and "more" not in text and text.startswith("Hello world. ")
    assert t.token_ids[e] == template.im_end_id and t.loss_mask[e] == 0  # the env closes the cut turn
    assert engine.prompts[1] == t.token_ids[:s2]


def test_models_logprobs_and_usage(template):
    gw = make_gateway(template, Script(template, ["abc def"]), model_name="my-policy")

    async def main():
        async with serving(gw) as srv:
            info = await open_session(srv)
            async with client(info) as c:
                models = await c.models.list()
                chunks = [ch async for ch in await c.chat.completions.create(
                    model="x", messages=[{"role": "user", "content": "hi"}], stream=True, logprobs=True,
                    stream_options={"include_usage": True})]
            return models, chunks

    models, chunks = asyncio.run(main())
    assert [m.id for m in models.data] == ["my-policy"]
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices) == "abc def"
    lps = [x for ch in chunks if ch.choices and ch.choices[0].logprobs for x in ch.choices[0].logprobs.content]
    assert "".join(x.token for x in lps) == "abc def<|im_end|>" and lps[0].logprob == -1.0
    assert bytes(b for x in lps for b in x.bytes).decode() == "abc def<|im_end|>"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(lps)
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == "stop"


def test_bad_requests_name_the_field(template):
    gw = make_gateway(template, Script(template, ["x"]), env=FakeEnv())

    async def main():
        async with serving(gw) as srv:
            info = await open_session(srv)
            base, sid, key = info["base_url"], info["session_id"], info["api_key"]
            out = {}
            out["unknown session"] = await http("POST", f"{srv.url}/sessions/nope/v1/chat/completions",
                                                json={"model": "p", "messages": FIRST})
            out["messages"] = await http("POST", base + "/chat/completions", key, json={"model": "p", "messages": "hi"})
            out["tools[0]"] = await http("POST", base + "/chat/completions", key,
                                         json={"model": "p", "messages": FIRST, "tools": ["add"]})
            out["tools[0].function.parameters"] = await http(
                "POST", base + "/chat/completions", key,
                json={"model": "p", "messages": FIRST, "tools": [{"type": "function", "function": {
                    "name": "add", "parameters": "a, b"}}]})
            out["unsupported"] = await http("POST", base + "/chat/completions", key,
                                            json={"model": "p", "messages": FIRST, "response_format": {"type": "x"}})
            out["reward"] = await http("POST", f"{srv.url}/sessions/{sid}/reward", json={"metrics": {}})
            out["reward nan"] = await http("POST", f"{srv.url}/sessions/{sid}/reward", data=b'{"reward": NaN}')
            out["index"] = await http("POST", srv.url + "/sessions", json={"task": "calc"})
            async with client(info) as c:
                with pytest.raises(openai.BadRequestError) as n:
                    await c.chat.completions.create(model="p", messages=FIRST, n=2)
                with pytest.raises(openai.NotFoundError) as nf:
                    await AsyncOpenAI(base_url=f"{srv.url}/sessions/nope/v1", api_key="x",
                                      max_retries=0).chat.completions.create(model="p", messages=FIRST)
            return out, n.value, nf.value

    out, n, nf = asyncio.run(main())
    assert out["unknown session"][0] == 404 and out["unknown session"][1]["error"]["param"] == "session_id"
    for name, param in [("messages", "messages"), ("tools[0]", "tools[0]"),
                        ("tools[0].function.parameters", "tools[0].function.parameters"),
                        ("unsupported", "response_format"), ("reward", "reward"), ("index", "index")]:
        status, body = out[name]
        assert status == 400 and body["error"]["param"] == param, (name, body)
        assert body["error"]["type"] == "invalid_request_error" and param in body["error"]["message"]
    assert out["reward nan"][0] == 400
    assert n.status_code == 400 and n.param == "n" and "n: must be 1" in n.message
    assert nf.status_code == 404 and nf.code == "session_not_found"


def test_episode_endings_reward_limits_and_delete(template):
    """POST reward ends an episode (a later completion or reward: 409); the turn and context limits end theirs
    with the agent loop's statuses and a 400 that says why; DELETE forgets a session."""
    gw = make_gateway(template, Script(template, ["word " * 30]), max_turns=2, max_total_tokens=200)

    async def main():
        async with serving(gw) as srv:
            out: dict[str, Any] = {}
            a, b, d = await open_session(srv), await open_session(srv), await open_session(srv)
            async with client(a) as c:
                await c.chat.completions.create(model="p", messages=[{"role": "user", "content": "hi"}])
            out["reward"] = await http("POST", f"{srv.url}/sessions/{a['session_id']}/reward",
                                       json={"reward": 0.5, "metrics": {"success": 1}})
            out["again"] = await http("POST", f"{srv.url}/sessions/{a['session_id']}/reward", json={"reward": 1})
            async with client(a) as c:
                with pytest.raises(openai.ConflictError):
                    await c.chat.completions.create(model="p", messages=[{"role": "user", "content": "hi"}])
            out["a"] = await http("GET", f"{srv.url}/sessions/{a['session_id']}/trajectory")
            msgs: list[Any] = [{"role": "user", "content": "hi"}]
            async with client(b) as c:
                for _ in range(2):
                    r = await c.chat.completions.create(model="p", messages=msgs, max_tokens=5)
                    msgs += [r.choices[0].message, {"role": "user", "content": "more"}]
                with pytest.raises(openai.BadRequestError) as turns:
                    await c.chat.completions.create(model="p", messages=msgs)
            out["b"] = gw.sessions[b["session_id"]].status, turns.value.code
            async with client(d) as c:
                with pytest.raises(openai.BadRequestError) as ctx:
                    await c.chat.completions.create(model="p", messages=[{"role": "user", "content": "x " * 400}])
            out["d"] = gw.sessions[d["session_id"]].status, ctx.value.code
            out["delete"] = await http("DELETE", f"{srv.url}/sessions/{a['session_id']}")
            out["gone"] = await http("GET", f"{srv.url}/sessions/{a['session_id']}/trajectory")
            return out

    out = asyncio.run(main())
    assert out["reward"] == (200, {"session_id": out["a"][1]["session_id"], "status": "completed", "reward": 0.5})
    assert out["again"][0] == 409 and out["again"][1]["error"]["code"] == "session_ended"
    assert out["a"][1]["metrics"] == {"success": 1.0}
    assert out["b"] == ("task limit reached", "turn_limit_reached")
    assert out["d"] == ("agent context limit", "context_length_exceeded")
    assert out["delete"][0] == 200 and out["gone"][0] == 404


def test_env_steps_end_the_episode_like_the_agent_loop(template):
    """Through /env the task's reply comes back; its finish ends the episode with its reward; an env that fails
    ends it as a task error (a finished reply, not an HTTP error)."""
    class Failing(FakeEnv):
        async def interact(self, session_id, messages):
            raise RuntimeError("sandbox crashed")

    async def main():
        out = {}
        for name, env in (("ok", FakeEnv()), ("fails", Failing())):
            gw = make_gateway(template, FakeEngine(template), env=env)
            async with serving(gw) as srv:
                info = await open_session(srv, task="calc", index=0)
                async with client(info) as c:
                    comp = await c.chat.completions.create(model="p", messages=FIRST, tools=TOOLS)
                    out[name] = await c.post("/env", body={}, cast_to=object)  # default: the last reply
                    out[name + " status"] = gw.sessions[info["session_id"]].status
                    if name == "ok":
                        msgs = FIRST + [comp.choices[0].message] + out["ok"]["messages"]
                        await c.chat.completions.create(model="p", messages=msgs, tools=TOOLS)
                        out["final"] = await c.post("/env", body={}, cast_to=object)
                        out["final status"] = gw.sessions[info["session_id"]].to_trajectories()[0]
                        with pytest.raises(openai.ConflictError):
                            await c.post("/env", body={}, cast_to=object)
        return out

    out = asyncio.run(main())
    assert out["ok"]["messages"][0]["content"] == "42" and not out["ok"]["finish"]
    assert out["final"]["finish"] and out["final"]["reward"] == 1.0 and out["final"]["status"] == "completed"
    t = out["final status"]
    assert t.status == "completed" and t.reward == 1.0 and t.metrics == {"success": 1.0} and t.turn_versions == [7, 7]
    assert out["fails"]["finish"] and out["fails"]["status"] == "task error"
    assert "sandbox crashed" in out["fails"]["error"]
    assert out["fails status"] == "task error"


def test_training_sampling_refuses_another_temperature(template):
    gw = make_gateway(template, Script(template, ["x"]), enforce_sampling=True,
                      sampling=SamplingParams(max_new_tokens=8, temperature=0.7))

    async def main():
        async with serving(gw) as srv:
            info = await open_session(srv)
            async with client(info) as c:
                with pytest.raises(openai.BadRequestError) as e:
                    await c.chat.completions.create(model="p", messages=FIRST, temperature=0.2)
                await c.chat.completions.create(model="p", messages=FIRST, temperature=0.7, max_tokens=3, seed=5)
            return e.value

    e = asyncio.run(main())
    assert e.param == "temperature" and "0.7" in e.message
    (p,) = gw.engine.params
    assert p.temperature == 0.7 and p.max_new_tokens == 3 and p.seed == 5 and template.im_end_id in p.stop_token_ids


def test_credentials_follow_the_controller_rules(template):
    """Loopback without a token; elsewhere a token is required; with one, the admin routes need it (not /health), while
    a session's base URL takes the session's own API key (which an OpenAI client sends as its api key) and no other
    credential: none is a 401, another session's key or the admin token a 403."""
    gw = make_gateway(template, Script(template, ["x"]))

    async def main():
        with pytest.raises(ValueError, match="needs a bearer token"):
            await GatewayServer(gw, GatewayOptions(host="0.0.0.0")).start()
        async with serving(gw, token="s3cret") as srv:
            no_token = await http("POST", srv.url + "/sessions", json={})
            health = await http("GET", srv.url + "/health")
            info, other = await open_session(srv, token="s3cret"), await open_session(srv, token="s3cret")
            refused = {}
            for name, key in (("another session's", other["api_key"]), ("admin", "s3cret")):
                with pytest.raises(openai.PermissionDeniedError) as e:
                    async with client(info, key) as c:
                        await c.chat.completions.create(model="p", messages=FIRST)
                refused[name] = e.value
            none = await http("POST", info["base_url"] + "/chat/completions", json={"model": "p", "messages": FIRST})
            async with client(info) as c:
                comp = await c.chat.completions.create(model="p", messages=FIRST)
            traj = await http("GET", f"{srv.url}/sessions/{info['session_id']}/trajectory", token=info["api_key"])
            return no_token, health, comp, refused, none, traj

    no_token, health, comp, refused, none, traj = asyncio.run(main())
    assert no_token[0] == 401 and health[0] == 200 and comp.choices[0].message.content == "x"
    assert all(e.status_code == 403 and e.code == "invalid_api_key" for e in refused.values())
    assert none[0] == 401 and none[1]["error"]["code"] == "missing_api_key"
    assert traj[0] == 401  # a session key is no admin credential
    assert [s.turns for s in gw.sessions.values()].count([]) == 1  # the refused requests sampled nothing


def test_the_gateways_connections_are_capped(template, caplog):
    """``gateway.max_connections`` holds as the controller's: one connection past it is answered 503 and closed."""
    gw = make_gateway(template, Script(template, ["x"]))

    async def main():
        srv = GatewayServer(gw, GatewayOptions(max_connections=2))
        await srv.start()
        try:
            await check_connection_cap(srv.port, 2, caplog, "/health")
        finally:
            await srv.stop()

    asyncio.run(main())


# ------------------------------------------------------------------------------------------------ the agent runner
def test_example_agent_gives_the_agent_loops_trajectories(template):
    """The example agent through the gateway and the built-in agent loop play the same episodes into the same
    trajectories: tokens, loss mask, log-probs, versions, spans, status, reward and metrics."""
    from megatron_agentrl.config import load_agent_fn

    example = load_agent_fn("examples.agents.openai_tool_agent:run_agent")
    requests = [("calc", 0, 1), ("two", 1, 2), ("malformed", 2, 3)]
    runner = AgentRunner(make_gateway(template, FakeEngine(template), env=FakeEnv()), example)

    async def main():
        try:
            return await runner.run_group(requests, SamplingParams(seed=0))
        finally:
            await runner.aclose()

    ours = asyncio.run(main())
    ref = asyncio.run(run_group_lockstep(FakeEngine(template), FakeEnv(), template, requests,
                                         SamplingParams(max_new_tokens=256, seed=0), episode(5, 4096)))
    for a, b in zip(ours[:2], ref[:2], strict=True):
        assert (a.token_ids, a.loss_mask, a.behavior_logprobs) == (b.token_ids, b.loss_mask, b.behavior_logprobs)
        assert (a.versions, a.turn_spans, a.status, a.reward, a.metrics) == \
            (b.versions, b.turn_spans, b.status, b.reward, b.metrics)
    # a malformed call: the loop ends the episode at once; through the gateway the agent gets the text as a reply
    # and sends it on, and the task decides (FakeEnv takes any reply without calls as the final answer; the built-in
    # tasks end the episode with "agent invalid action", reward 0). The tokens are the same.
    bad, bad_ref = ours[2], ref[2]
    assert bad_ref.status == "agent validation failed" and bad.status == "completed"
    assert bad.token_ids == bad_ref.token_ids and bad.loss_mask == bad_ref.loss_mask
    assert bad.metrics["tool_parse_errors"] == 1.0


async def raising_agent(client, sample):
    await client.chat.completions.create(model=sample["model"], messages=sample["messages"], tools=sample["tools"])
    raise KeyError("no such tool result")


async def reward_agent(client, sample):
    comp = await client.chat.completions.create(model=sample["model"], messages=sample["messages"])
    return 0.25 if comp.choices[0].message.content else 0.0


async def idle_agent(client, sample):
    return None


async def slow_agent(client, sample):
    await asyncio.sleep(30)


def test_agent_runner_plays_episodes_and_survives_agent_errors(template, caplog):
    """The example agent plays the calc task through the gateway; a raising, a reward-returning, an idle and a slow
    agent each end their episode as documented, and none stops the group."""
    from megatron_agentrl.config import load_agent_fn

    example = load_agent_fn("examples.agents.openai_tool_agent:run_agent")
    pool = VersionPool([[FakeEngine(template, version=4)]])

    def run(fn, n=2, **kw):
        runner = AgentRunner(make_gateway(template, pool, env=FakeEnv()), fn, **kw)

        async def main():
            try:
                return await runner.run_group([("calc", i, 3) for i in range(n)], SamplingParams(seed=1)), runner
            finally:
                await runner.aclose()
        return asyncio.run(main())

    trajs, runner = run(example)
    assert [t.status for t in trajs] == ["completed", "completed"] and all(t.reward == 1.0 for t in trajs)
    assert all(t.turn_versions == [4, 4] and t.group_id == 3 and t.timings["agent_s"] > 0 for t in trajs)
    assert runner.metrics()["gateway/completions"] == 4.0 and runner.metrics()["gateway/completions"] == 0.0
    assert not runner.gateway.sessions
    trajs, runner = run(raising_agent)
    assert {t.status for t in trajs} == {"agent error"} and all(t.metrics == {"agent_error": 1.0} for t in trajs)
    assert trajs[0].error == "KeyError: 'no such tool result'" and trajs[0].num_generated > 0
    assert runner.metrics()["gateway/agent_errors"] == 2.0
    assert caplog.text.count("KeyError: 'no such tool result' (each distinct error is logged once)") == 1
    trajs, _ = run(reward_agent, n=1)
    assert trajs[0].status == "completed" and trajs[0].reward == 0.25
    trajs, _ = run(idle_agent, n=1)
    assert trajs[0].status == "cancelled" and trajs[0].token_ids == [] and "returned None" in trajs[0].error
    trajs, _ = run(slow_agent, n=1, options=AgentRunnerOptions(agent_timeout_s=0.2))
    assert trajs[0].status == "agent error" and "agent_timeout_s=0.2" in trajs[0].error


def test_an_agent_cannot_post_its_own_reward_to_the_runners_gateway(template):
    """The agent runner's gateway takes rewards from the runner alone (in process): its admin routes need a token
    that no agent is given, so an agent's own post is refused and the episode ends as the environment says."""
    import aiohttp

    posts: list[list[int]] = []

    async def reward_posting_agent(client, sample):
        """Its code (the policy's, say) posts its own reward to the admin route, with no credential and with its
        session's key, then leaves the ending to the environment."""
        url = sample["base_url"].removesuffix("/v1") + "/reward"
        async with aiohttp.ClientSession() as http:
            got = []
            for headers in ({}, {"Authorization": f"Bearer {sample['api_key']}"}):
                async with http.post(url, json={"reward": 1.0}, headers=headers) as r:
                    got.append(r.status)
        posts.append(got)

    runner = AgentRunner(make_gateway(template, FakeEngine(template), env=FakeEnv()), reward_posting_agent)

    async def main():
        try:
            return await runner.run_group([("calc", 0, 0)], SamplingParams(seed=1))
        finally:
            await runner.aclose()

    (t,) = asyncio.run(main())
    assert posts == [[401, 401]]  # neither is the admin token
    assert t.status == "cancelled" and t.reward == 0.0, (t.status, t.reward)


async def two_turn_agent(client, sample):
    msgs = list(sample["messages"])
    for _ in range(2):
        comp = await client.chat.completions.create(model=sample["model"], messages=msgs)
        msgs += [comp.choices[0].message, {"role": "user", "content": "again"}]
    return 1.0


def test_agent_runner_seeds_each_episode_and_turn(template):
    """Episode j, turn k of a seeded group samples with seed + k * stride + j (stride: the group's size, one
    engine): no two turns of the group share a seed."""
    engine = Script(template, ["x"])
    runner = AgentRunner(make_gateway(template, engine, env=FakeEnv()), two_turn_agent)

    async def main():
        try:
            return await runner.run_group([("calc", j, 0) for j in range(3)], SamplingParams(seed=100))
        finally:
            await runner.aclose()

    trajs = asyncio.run(main())
    assert [t.reward for t in trajs] == [1.0] * 3
    assert sorted(p.seed for p in engine.params) == list(range(100, 106))
