"""The gateway's three APIs through their real SDKs: Chat Completions and Responses (the `openai` client) and Anthropic
Messages (the `anthropic` client) play the same tool-calling episode on a tiny taught model into the same token-exact
trajectory; reasoning items and thinking blocks; each API's errors in its own shape; per-session keys; 429 with
Retry-After under a saturated rollout, which the SDKs' retries wait out."""
from __future__ import annotations

import asyncio
import json
from typing import Any

import anthropic
import openai
import pytest
from anthropic import AsyncAnthropic

from rollout_sglang.engines.protocol import SamplingParams
from rollout_sglang.engines.version_pool import VersionPool
from tests.rollout.support import ADD_TOOLS as TOOLS
from tests.rollout.support import CALC_FIRST as FIRST
from tests.rollout.support import Script, Spy, client, http, make_gateway, open_session, serving

CALC_TURNS = ["Let me add.\n" + '<tool_call>\n{"name": "add", "arguments": {"a": 40, "b": 2}}\n</tool_call>',
              "The answer is 42."]
FN = TOOLS[0]["function"]
RESPONSES_TOOLS = [{"type": "function", "name": FN["name"], "description": FN["description"],
                    "parameters": FN["parameters"]}]
ANTHROPIC_TOOLS = [{"name": FN["name"], "description": FN["description"], "input_schema": FN["parameters"]}]
WARM = SamplingParams(max_new_tokens=256, temperature=0.5)


def anthropic_client(info: dict, key: str | None = None, **kw: Any) -> AsyncAnthropic:
    return AsyncAnthropic(base_url=info["anthropic_base_url"], api_key=key or info["api_key"],
                          **{"max_retries": 0, **kw})


# ------------------------------------------------------------------------------------------------ the episode
async def play_chat(info: dict, stream: bool) -> list[str]:
    async with client(info) as c:
        msgs: list[Any] = list(FIRST)
        r1 = await c.chat.completions.create(model="p", messages=msgs, tools=TOOLS)
        (call,) = r1.choices[0].message.tool_calls
        assert json.loads(call.function.arguments) == {"a": 40, "b": 2}
        msgs += [r1.choices[0].message, {"role": "tool", "tool_call_id": call.id, "content": "42"}]
        r2 = await c.chat.completions.create(model="p", messages=msgs, tools=TOOLS)
        return [r1.choices[0].message.content, r2.choices[0].message.content]


async def _response(c: openai.AsyncOpenAI, stream: bool, **kw: Any) -> Any:
    if not stream:
        return await c.responses.create(model="p", **kw)
    events = [e async for e in await c.responses.create(model="p", stream=True, **kw)]
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] == "response.completed"
    assert [e.sequence_number for e in events] == list(range(len(events)))
    return events[-1].response


async def play_responses(info: dict, stream: bool) -> list[str]:
    """Turn 2 chains with previous_response_id when not streaming, and re-sends the output items when streaming."""
    async with client(info) as c:
        kw = dict(instructions=FIRST[0]["content"], tools=RESPONSES_TOOLS)
        r1 = await _response(c, stream, input=FIRST[1]["content"], **kw)
        assert r1.status == "completed" and [o.type for o in r1.output] == ["message", "function_call"]
        call = r1.output[1]
        assert call.name == "add" and json.loads(call.arguments) == {"a": 40, "b": 2}
        result = {"type": "function_call_output", "call_id": call.call_id, "output": "42"}
        if stream:
            items = [{"role": "user", "content": FIRST[1]["content"]}]
            items += [o.model_dump(exclude_none=True) for o in r1.output] + [result]
            r2 = await _response(c, stream, input=items, **kw)
        else:
            r2 = await _response(c, stream, input=[result], previous_response_id=r1.id, **kw)
        assert r2.output_text == "The answer is 42." and r2.usage.output_tokens > 0
        return [r1.output_text, r2.output_text]


async def _message(a: AsyncAnthropic, stream: bool, **kw: Any) -> Any:
    if not stream:
        return await a.messages.create(model="p", max_tokens=256, **kw)
    async with a.messages.stream(model="p", max_tokens=256, **kw) as s:
        kinds = [e.type async for e in s]
        message = await s.get_final_message()
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop"
    return message


async def play_anthropic(info: dict, stream: bool) -> list[str]:
    async with anthropic_client(info) as a:
        msgs: list[Any] = [{"role": "user", "content": FIRST[1]["content"]}]
        kw = dict(system=FIRST[0]["content"], tools=ANTHROPIC_TOOLS)
        m1 = await _message(a, stream, messages=msgs, **kw)
        assert m1.stop_reason == "tool_use" and [b.type for b in m1.content] == ["text", "tool_use"]
        use = m1.content[1]
        assert use.name == "add" and use.input == {"a": 40, "b": 2}
        msgs += [{"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in m1.content]},
                 {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "42"}]}]
        m2 = await _message(a, stream, messages=msgs, **kw)
        assert m2.stop_reason == "end_turn" and m2.usage.output_tokens > 0
        return [m1.content[0].text, m2.content[0].text]


PLAYERS = {"chat": play_chat, "responses": play_responses, "messages": play_anthropic}


@pytest.mark.parametrize("stream", [False, True])
def test_three_apis_play_one_token_exact_trajectory(template, taught_engine, stream):
    """The calc episode (a tool call, its result, the answer) through each SDK, streamed or not: each trajectory holds
    the engine's sampled tokens and log-probs, the chat template's pieces between them, the loss mask on the sampled
    tokens only; and the three are the same trajectory."""
    trajs = {}
    for api, play in PLAYERS.items():
        spy = Spy(taught_engine)
        gw = make_gateway(template, spy, sampling=WARM)

        async def main(gw=gw, play=play):
            async with serving(gw) as srv:
                info = await open_session(srv)
                texts = await play(info, stream)
                return texts, gw.sessions[info["session_id"]]

        texts, s = asyncio.run(main())
        assert texts == ["Let me add.", "The answer is 42."], api
        (t,) = s.to_trajectories()
        assert s.history_rewrites == 0 and t.turn_versions == [3, 3]
        assert [template.decode(o[0].token_ids) for _, o in spy.calls] == [x + "<|im_end|>" for x in CALC_TURNS]
        for (st, e), (prompts, outs) in zip(t.turn_spans, spy.calls, strict=True):
            assert t.token_ids[st:e] == outs[0].token_ids and t.behavior_logprobs[st:e] == outs[0].logprobs
            assert prompts[0] == t.token_ids[:st]  # the engine continued exactly the trajectory
        (s0, e0), (s1, e1) = t.turn_spans
        assert t.token_ids[:s0] == template.encode_prompt(FIRST, TOOLS) and e1 == len(t.token_ids)
        assert t.loss_mask == [int(s0 <= j < e0 or s1 <= j < e1) for j in range(len(t.token_ids))]
        trajs[api] = (t.token_ids, t.loss_mask, t.behavior_logprobs, t.turn_spans)
    assert trajs["responses"] == trajs["chat"] and trajs["messages"] == trajs["chat"]


# ------------------------------------------------------------------------------------------------ reasoning
def test_reasoning_comes_back_as_reasoning_items_and_thinking_blocks(qwen3_template):
    """Qwen3's think block: a Responses reasoning item and an Anthropic thinking block; either sent back is the
    same conversation (no history rewrite). thinking disabled forces the empty think block (loss mask 0)."""
    t = qwen3_template
    turn = ("<think>\nI add 1 and 2.\n</think>\n\n"
            '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>')
    engine = Script(t, [turn, "Three.", turn, "Three.", "Three."])  # the k-th call samples the k-th text
    gw = make_gateway(t, engine)

    async def main():
        async with serving(gw) as srv:
            a_info, r_info, n_info = await open_session(srv), await open_session(srv), await open_session(srv)
            async with client(r_info) as c:
                r1 = await c.responses.create(model="p", input="1+2?", tools=RESPONSES_TOOLS)
                call = r1.output[-1]
                items = [{"role": "user", "content": "1+2?"}] + [o.model_dump(exclude_none=True) for o in r1.output]
                await c.responses.create(model="p", tools=RESPONSES_TOOLS, input=items + [
                    {"type": "function_call_output", "call_id": call.call_id, "output": "3"}])
            async with anthropic_client(a_info) as a:
                msgs: list[Any] = [{"role": "user", "content": "1+2?"}]
                m1 = await a.messages.create(model="p", max_tokens=64, messages=msgs, tools=ANTHROPIC_TOOLS)
                msgs += [{"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in m1.content]},
                         {"role": "user", "content": [{"type": "tool_result", "tool_use_id": m1.content[-1].id,
                                                       "content": "3"}]}]
                await a.messages.create(model="p", max_tokens=64, messages=msgs, tools=ANTHROPIC_TOOLS)
            async with anthropic_client(n_info) as a:
                m3 = await a.messages.create(model="p", max_tokens=64, messages=[{"role": "user", "content": "hi"}],
                                             thinking={"type": "disabled"})
            return r1, m1, m3, {k: gw.sessions[i["session_id"]] for k, i in
                                (("r", r_info), ("a", a_info), ("n", n_info))}

    r1, m1, m3, sessions = asyncio.run(main())
    assert [o.type for o in r1.output] == ["reasoning", "function_call"]
    assert r1.output[0].content[0].text == "I add 1 and 2."
    assert [b.type for b in m1.content] == ["thinking", "tool_use"] and m1.content[0].thinking == "I add 1 and 2."
    assert sessions["r"].history_rewrites == 0 and sessions["a"].history_rewrites == 0
    assert len(sessions["r"].turns) == 2 and len(sessions["a"].turns) == 2
    (traj,) = sessions["n"].to_trajectories()
    (s, _), = traj.turn_spans
    prompt = t.encode_prompt([{"role": "user", "content": "hi"}])
    assert t.decode(traj.token_ids[len(prompt):s]) == t.NO_THINKING and set(traj.loss_mask[len(prompt):s]) == {0}
    assert [b.type for b in m3.content] == ["text"] and m3.content[0].text == "Three."


# ------------------------------------------------------------------------------------------------ errors
def test_each_api_refuses_in_its_own_error_shape(template):
    gw = make_gateway(template, Script(template, ["x"]), enforce_sampling=True, sampling=WARM)

    async def main():
        async with serving(gw) as srv:
            info, other = await open_session(srv), await open_session(srv)
            out: dict[str, Any] = {}
            url = info["anthropic_base_url"] + "/v1/messages"
            body = {"model": "p", "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}]}
            out["no version"] = await http("POST", url, info["api_key"], json=body)
            async with anthropic_client(info) as a:
                image = [{"type": "image", "source": {"type": "url", "url": "http://x"}}]
                for name, kw in (("temperature", {"extra_body": {"temperature": 0.9}}),
                                 ("image", {"messages": [{"role": "user", "content": image}]}),
                                 ("parallel", {"tool_choice": {"type": "auto", "disable_parallel_tool_use": True},
                                               "tools": ANTHROPIC_TOOLS}),
                                 ("thinking", {"thinking": {"type": "enabled", "budget_tokens": 1024}})):
                    with pytest.raises(anthropic.BadRequestError) as e:
                        await a.messages.create(**{**body, **kw})
                    out[name] = e.value
            async with anthropic_client(info, other["api_key"]) as a:
                with pytest.raises(anthropic.PermissionDeniedError) as e:
                    await a.messages.create(**body)
                out["key"] = e.value
            async with client(info) as c:
                for name, kw in (("previous", {"previous_response_id": "resp_nope"}),
                                 ("web", {"tools": [{"type": "web_search"}]}),
                                 ("format", {"text": {"format": {"type": "json_object"}}}),
                                 ("rtemperature", {"temperature": 0.1})):
                    with pytest.raises(openai.BadRequestError) as e:
                        await c.responses.create(model="p", input="hi", **kw)
                    out[name] = e.value
            return out

    out = asyncio.run(main())
    status, body = out["no version"]
    assert status == 400 and body["type"] == "error" and body["error"]["type"] == "invalid_request_error"
    assert "anthropic-version" in body["error"]["message"]
    for name, field in (("temperature", "temperature: is 0.9"), ("image", "'image' blocks are not supported"),
                        ("parallel", "disable_parallel_tool_use"), ("thinking", "does not reason")):
        e = out[name]
        assert e.status_code == 400 and e.body["type"] == "error" and field in e.body["error"]["message"], name
    assert "temperature=0.5" in out["temperature"].message
    assert out["key"].status_code == 403 and out["key"].body["error"]["type"] == "permission_error"
    for name, param in (("previous", "previous_response_id"), ("web", "tools[0].type"), ("format", "text.format"),
                        ("rtemperature", "temperature")):
        assert out[name].status_code == 400 and out[name].param == param, name
    assert out["previous"].code == "previous_response_not_found"


# ------------------------------------------------------------------------------------------------ backpressure
class Slow(Script):
    async def generate(self, prompts, params, seeds=None):
        await asyncio.sleep(0.3)
        return await super().generate(prompts, params)


def test_saturated_rollout_answers_429_and_the_sdks_retry(template):
    """Each reason for backpressure answers a new turn 429 with Retry-After: no slot of the version pool can serve
    (an update runs: the openai client retries), more turns queued than max_queued_turns (the anthropic client
    retries), the rollout ahead of training (the admission hook); every turn completes through the SDK's own retry.
    The counts are on /metrics."""
    pool = VersionPool([[Slow(template, ["ok"])]])
    ahead = iter(["3 groups wait for the trainer (staleness budget 1)"])
    gw = make_gateway(template, pool, max_queued_turns=1, retry_after_s=0.2, admission=lambda: next(ahead, None))

    async def main():
        async with serving(gw) as srv:
            infos = [await open_session(srv) for _ in range(4)]
            out: dict[str, Any] = {}
            out["ahead"] = await http("POST", infos[0]["base_url"] + "/chat/completions", infos[0]["api_key"],
                                      json={"model": "p", "messages": FIRST})
            pool.slots[0].updating = True  # a weight update holds the only slot
            out["busy"] = await http("POST", infos[0]["base_url"] + "/chat/completions", infos[0]["api_key"],
                                     json={"model": "p", "messages": FIRST})

            async def finish_update():
                await asyncio.sleep(0.5)
                pool.slots[0].updating = False

            async with client(infos[0], max_retries=5) as c:
                done, comp = await asyncio.gather(finish_update(), c.chat.completions.create(model="p", messages=FIRST))
            out["after update"] = comp.choices[0].message.content

            async def ask(info):
                async with anthropic_client(info, max_retries=5) as a:
                    m = await a.messages.create(model="p", max_tokens=8, messages=[{"role": "user", "content": "hi"}])
                    return m.content[0].text

            out["queued"] = await asyncio.gather(*(ask(i) for i in infos[1:]))
            async with http_text(srv.url + "/metrics") as text:
                out["metrics"] = text
            return out

    out = asyncio.run(main())
    for name, code in (("ahead", "rollout_ahead"), ("busy", "engines_busy")):
        status, body = out[name]
        assert status == 429 and body["error"]["code"] == code and body["error"]["type"] == "rate_limit_error", name
    assert "staleness budget" in out["ahead"][1]["error"]["message"]
    assert out["after update"] == "ok" and out["queued"] == ["ok"] * 3
    st = gw.stats
    assert st.throttled["rollout_ahead"] == 1 and st.throttled["engines_busy"] >= 2 and st.throttled["queue_full"] >= 2
    assert st.queue_depth == 0 and st.queue_depth_max == 1
    assert f'agentrl_gateway_throttled_total{{reason="queue_full"}} {st.throttled["queue_full"]}' in out["metrics"]
    assert "agentrl_gateway_queue_depth 0" in out["metrics"]


def test_429_carries_retry_after(template):
    gw = make_gateway(template, Script(template, ["x"]), retry_after_s=1.5, admission=lambda: "ahead")

    async def main():
        import aiohttp

        async with serving(gw) as srv:
            info = await open_session(srv)
            async with aiohttp.ClientSession() as h, h.post(
                    info["base_url"] + "/responses", json={"model": "p", "input": "hi"},
                    headers={"Authorization": f"Bearer {info['api_key']}"}) as r:
                return r.status, dict(r.headers), await r.json()

    status, headers, body = asyncio.run(main())
    assert status == 429 and headers["Retry-After"] == "2" and headers["retry-after-ms"] == "1500"
    assert body["error"]["code"] == "rollout_ahead"


class http_text:
    """``async with http_text(url) as text``: a GET's body as text."""

    def __init__(self, url: str) -> None:
        self.url = url

    async def __aenter__(self) -> str:
        import aiohttp

        async with aiohttp.ClientSession() as h, h.get(self.url) as r:
            return await r.text()

    async def __aexit__(self, *exc: Any) -> None:
        return None
