"""Helpers shared by the rollout tests.

The conversations the chat-format tests render, a jinja2 chat template rendered as Hugging Face renders it and an
engine that plays a scripted episode; the agent loop's fake engine and environment (the ``add`` tool, episodes
scripted per kind in Qwen2.5's format); the gateway served on loopback and an episode played through the openai
client."""
from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import re
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from jinja2.sandbox import ImmutableSandboxedEnvironment
from openai import AsyncOpenAI
from openai.lib.streaming.chat import ChatCompletionStreamState

from env_controller.http.client import Response
from env_controller.protocol import SampleStatus, TaskReply
from rollout_sglang.agent_loop import run_group_lockstep
from rollout_sglang.chat_template import ChatTemplate
from rollout_sglang.engines.protocol import GenerationOutput, SamplingParams
from rollout_sglang.episode_options import EpisodeLimits, EpisodeOptions
from rollout_sglang.gateway import Gateway, GatewayOptions, GatewayServer
from rollout_sglang.tool_parser import ToolCallParseError


def tool_call(cid: str, name: str, args: dict) -> dict:
    """An OpenAI tool call with JSON-string arguments."""
    return {"id": cid, "type": "function", "function": {"name": name, "arguments": json.dumps(args)}}


# system, user, calls with content / several calls / no content, tool results (one JSON), a late
# user turn and a final plain answer; non-ASCII text throughout
CONVERSATION = [
    {"role": "system", "content": "You are a careful research agent."},
    {"role": "user", "content": "Who wrote Le Petit Prince? Answer with the name."},
    {"role": "assistant", "content": "I will search for it.",
     "tool_calls": [tool_call("call_0", "search", {"q": "Le Petit Prince auteur"})]},
    {"role": "tool", "tool_call_id": "call_0", "content": "Antoine de Saint-Exupéry (1943)."},
    {"role": "assistant", "content": "",
     "tool_calls": [tool_call("call_1", "search", {"q": "Saint-Exupéry"}),
                    tool_call("call_2", "search", {"q": "1943 novella"})]},
    {"role": "tool", "tool_call_id": "call_1", "content": "French writer and aviator."},
    {"role": "tool", "tool_call_id": "call_2", "content": "{\"title\": \"The Little Prince\"}"},
    {"role": "user", "content": "Please submit now."},
    {"role": "assistant", "content": None,
     "tool_calls": [tool_call("call_3", "submit", {"answer": "Antoine de Saint-Exupéry"})]},
    {"role": "tool", "tool_call_id": "call_3", "content": "ok"},
    {"role": "assistant", "content": "Done: Antoine de Saint-Exupéry."},
]


def hf_tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None,
              sort_keys: bool = False) -> str:
    """The ``tojson`` filter as Hugging Face's chat-template environment defines it (non-ASCII kept)."""
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def render_jinja(template: str, messages: list[dict], tools: list[dict] | None, add_generation_prompt: bool,
                 **kwargs: Any) -> str:
    """Render the jinja chat ``template`` with jinja2 configured as Hugging Face does; ``messages``
    must already be in the shape the template expects; ``kwargs`` are the template's options (enable_thinking)."""
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.filters["tojson"] = hf_tojson
    return env.from_string(template).render(messages=messages, tools=tools,
                                            add_generation_prompt=add_generation_prompt, **kwargs)


def parse_error(parse: Callable[..., Any], text: str, tools: list[dict] | None) -> str:
    """The message of the ``ToolCallParseError`` that ``parse(text, tools)`` (a format's parser) raises."""
    with pytest.raises(ToolCallParseError) as e:
        parse(text, tools)
    return str(e.value)


def check_chat_template_option(tmp_path: Path, model_type: str, accepted: Iterable[str], refused: str,
                               error: str) -> None:
    """A config of a ``model_type`` model takes each of ``accepted`` as ``model.chat_template`` and refuses ``refused``
    with a ``ConfigError`` that matches ``error``."""
    from megatron_agentrl.config import ConfigError, load_config

    base = tmp_path / "c.yaml"
    base.write_text(f"model:\n  arch: {{model_type: {model_type}}}\ntasks: [{{name: lookup}}]\n")
    for name in accepted:
        assert load_config(base, [f"model.chat_template={name}"]).model.chat_template == name
    with pytest.raises(ConfigError, match=error):
        load_config(base, [f"model.chat_template={refused}"])


def mask_spans(mask: list[int]) -> list[tuple[int, int]]:
    """``(start, end)`` of each run of 1s in a loss mask, end exclusive."""
    spans: list[tuple[int, int]] = []
    start = None
    for j, m in enumerate(mask + [0]):
        if m and start is None:
            start = j
        if not m and start is not None:
            spans.append((start, j))
            start = None
    return spans


# For formats that render reasoning (GLM-4.5): reasoning before the last user turn (as ``reasoning_content``)
# and after it (as a ``<think>`` block opening the content, and as ``reasoning_content``), arguments of every
# JSON type (a string that looks like a number too), non-ASCII names and values, several calls in one turn,
# consecutive tool messages, a turn with calls and no content.
TRIP_TOOLS = [
    {"type": "function", "function": {
        "name": "search_trains", "description": "Trains between two stations (駅).",
        "parameters": {"type": "object", "properties": {
            "from": {"type": "string"}, "to": {"type": "string"}, "max_changes": {"type": "integer"},
            "filters": {"type": "object"}, "date": {"type": ["string", "null"]}}}}},
    {"type": "function", "function": {
        "name": "book", "description": "Book a seat.",
        "parameters": {"type": "object", "properties": {
            "train": {"type": "string"}, "price": {"type": "number"}, "window": {"type": "boolean"},
            "seat": {"type": "string"}}}}},
]
REASONING_CONVERSATION = [
    {"role": "system", "content": "You plan train trips. Réponds brièvement."},
    {"role": "user", "content": "東京から大阪へ、乗り換えは1回まで。"},
    {"role": "assistant", "reasoning_content": "\nThe user wants Tokyo → Osaka, at most one change.\n",
     "content": "Let me look.",
     "tool_calls": [tool_call("call_0", "search_trains", {
         "from": "東京", "to": "大阪", "max_changes": 1,
         "filters": {"fast": True, "classes": ["green", "ordinary"], "note": "é"}, "date": None})]},
    {"role": "tool", "tool_call_id": "call_0", "content": "Nozomi 1 (10:03), Hikari 5 (10:33)"},
    {"role": "user", "content": "Book the Nozomi, a window seat."},
    {"role": "assistant", "content": "<think>\nNozomi 1 it is; book it twice to compare.\n</think>\n\n",
     "tool_calls": [tool_call("call_1", "book", {"train": "Nozomi 1", "price": 14720.5, "window": True,
                                                 "seat": "42"}),
                    tool_call("call_2", "book", {"train": "Hikari 5", "window": False})]},
    {"role": "tool", "tool_call_id": "call_1", "content": "booked: car 7, seat 42"},
    {"role": "tool", "tool_call_id": "call_2", "content": "{\"error\": \"sold out\"}"},
    {"role": "assistant", "reasoning_content": "One booking worked.",
     "content": "  Booked: Nozomi 1, car 7, seat 42 (窓側).  "},
]


class ScriptEngine:
    """Emits ``script[k]`` (plus the token ``end_id`` when given) on its k-th call, one episode; log-prob
    -(k + 1) per token. Each prompt must end with ``prompt_end`` (the format's generation prompt) and each
    turn with one of the sampling's stop tokens."""

    def __init__(self, template: Any, script: list[str], prompt_end: str, end_id: int | None = None) -> None:
        self.template, self.script, self.prompt_end, self.end_id = template, script, prompt_end, end_id
        self.calls = 0

    async def generate(self, prompts: list[list[int]], params: Any, seeds=None) -> list[Any]:
        """One scripted turn for each prompt."""
        from rollout_sglang.engines.protocol import GenerationOutput

        turn, self.calls = self.calls, self.calls + 1
        outs = []
        for p in prompts:
            assert self.template.decode(p).endswith(self.prompt_end)
            ids = self.template.tokenizer.encode(self.script[turn], add_special_tokens=False)
            if self.end_id is not None:
                ids.append(self.end_id)
            assert ids[-1] in params.stop_token_ids
            outs.append(GenerationOutput(ids, [-(turn + 1.0)] * len(ids), "stop", 3))
        await asyncio.sleep(0)
        return outs


# ------------------------------------------------------------------------------ the agent loop's fakes
ADD_TOOLS = [
    {"type": "function", "function": {
        "name": "add", "description": "Add two integers.",
        "parameters": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}}}},
]


def call(a: int, b: int) -> str:
    return '<tool_call>\n{"name": "add", "arguments": {"a": %d, "b": %d}}\n</tool_call>' % (a, b)


# Scripted assistant turns per episode kind (the fake engine picks them by the EP=<kind> marker in the prompt).
SCRIPTS: dict[str, list[str]] = {
    "calc": ["Let me add.\n" + call(40, 2), "The answer is 42."],
    "two": [call(1, 1) + "\n" + call(2, 2), "Done."],
    "malformed": ['<tool_call>\n{"name": "add", "arguments": {"a": 1,}}\n</tool_call>'],
    "unknown": ['<tool_call>\n{"name": "delete_all", "arguments": {}}\n</tool_call>'],
    "forever": [call(1, 2)] * 10,
    "cut": [call(3, 4) + " and then I will keep talking for quite a while longer", "Seven."],
    "chatty": ["word " * 40],
    "verbose_env": [call(5, 5)] * 5,
    "raises": [call(1, 1)],
    "hangs": [call(1, 1)],
}


class FakeEngine:
    """Emits the scripted turn for each prompt; log-prob of generated token j in turn t is -(t + 1) - j / 1000."""

    def __init__(self, template: ChatTemplate, version: int = 7) -> None:
        self.template = template
        self.version = version
        self.batch_sizes: list[int] = []
        self.max_new_tokens_seen: list[int] = []

    async def generate(self, prompts: list[list[int]], params: SamplingParams, seeds=None) -> list[GenerationOutput]:
        self.batch_sizes.append(len(prompts))
        self.max_new_tokens_seen.append(params.max_new_tokens)
        outs = []
        for p in prompts:
            text = self.template.decode(p)
            kind = re.search(r"EP=(\w+)", text).group(1)
            turn = text.count("<|im_start|>assistant") - 1
            ids = self.template.tokenizer.encode(SCRIPTS[kind][turn], add_special_tokens=False)
            ids = ids + [self.template.im_end_id]
            reason = "stop"
            assert self.template.im_end_id in params.stop_token_ids
            if len(ids) > params.max_new_tokens:
                ids, reason = ids[: params.max_new_tokens], "length"
            lps = [-(turn + 1) - j / 1000 for j in range(len(ids))]
            outs.append(GenerationOutput(ids, lps, reason, self.version))
        await asyncio.sleep(0)
        return outs


class FakeEnv:
    """An in-process EnvClient: ``add`` tool, finishes with reward 1 on a plain-text answer."""

    def __init__(self, tool_output: str = "{result}") -> None:
        self.received: dict[str, list[dict]] = {}
        self.cancelled: list[str] = []
        self.history: dict[str, list[dict]] = {}
        self.tool_output = tool_output
        self._n = 0

    async def start_sample(self, task: str, index: int) -> tuple[str, TaskReply]:
        if task == "nostart":
            raise ConnectionError("worker unreachable")
        self._n += 1
        sid = f"{task}-{index}-{self._n}"
        msgs = [{"role": "system", "content": "You add numbers."},
                {"role": "user", "content": f"Solve the task EP={task}."}]
        self.received[sid] = []
        self.history[sid] = list(msgs)
        return sid, TaskReply(messages=msgs, tools=ADD_TOOLS)

    async def interact(self, session_id: str, messages: list[dict]) -> TaskReply:
        kind = session_id.split("-")[0]
        if kind == "raises":
            raise RuntimeError("sandbox crashed")
        if kind == "hangs":
            await asyncio.sleep(3600)
        (msg,) = messages
        self.received[session_id].append(msg)
        self.history[session_id].append(msg)
        if not msg.get("tool_calls"):
            return TaskReply(messages=[], status=SampleStatus.COMPLETED, finish=True, reward=1.0,
                             metrics={"success": 1.0})
        replies = []
        for c in msg["tool_calls"]:
            args = json.loads(c["function"]["arguments"])
            out = self.tool_output.format(result=args["a"] + args["b"])
            replies.append({"role": "tool", "tool_call_id": c["id"], "content": out})
        self.history[session_id].extend(replies)
        return TaskReply(messages=replies)

    async def cancel(self, session_id: str) -> None:
        self.cancelled.append(session_id)


def episode(max_turns: int, max_total_tokens: int, **kw) -> EpisodeOptions:
    """The agent loop's and the gateway's options: these limits, and ``kw`` (env_timeout_s, capture_routing)."""
    return EpisodeOptions(EpisodeLimits(max_turns=max_turns, max_total_tokens=max_total_tokens), **kw)


def run(engine, env, template, requests, max_turns=5, max_total_tokens=4096, max_new_tokens=256, timeout=5.0,
        capture_routing=False):
    params = SamplingParams(max_new_tokens=max_new_tokens, temperature=1.0, seed=0)
    return asyncio.run(
        run_group_lockstep(engine, env, template, requests, params,
                           episode(max_turns, max_total_tokens, env_timeout_s=timeout, capture_routing=capture_routing))
    )


def play_calc(engine, template) -> tuple[Any, list[dict], list[dict]]:
    """The calc episode (``FakeEnv``) played by a scripted ``engine`` in ``template``'s format through the agent loop:
    checks that it completed with reward 1 after a turn with a call ("Let me add."), one with two calls (the second
    adding 2 and 2) and an answer; returns the trajectory, the assistant messages the environment received and the
    episode's messages."""
    env = FakeEnv()
    (traj,) = run(engine, env, template, [("calc", 0, 0)])
    assert traj.status == "completed" and traj.reward == 1.0
    (sid,) = env.history
    sent = env.received[sid]
    assert [len(m.get("tool_calls", [])) for m in sent] == [1, 2, 0]
    assert sent[0]["content"] == "Let me add."
    assert json.loads(sent[1]["tool_calls"][1]["function"]["arguments"]) == {"a": 2, "b": 2}
    return traj, sent, env.history[sid]


def check_turns_as_generated(traj, template, turns: list[str]) -> None:
    """Each turn span of ``traj`` decodes to ``turns``' text and is trained (mask 1); nothing else is."""
    for (s, e), text in zip(traj.turn_spans, turns, strict=True):
        assert template.decode(traj.token_ids[s:e]) == text
        assert traj.loss_mask[s:e] == [1] * (e - s)
    assert sum(traj.loss_mask) == sum(e - s for s, e in traj.turn_spans)


def _check_alignment(traj) -> None:
    """Lengths agree; mask 1 exactly on the turn spans; log-probs nonzero exactly there."""
    n = len(traj.token_ids)
    assert len(traj.loss_mask) == len(traj.behavior_logprobs) == n
    in_span = [0] * n
    for s, e in traj.turn_spans:
        in_span[s:e] = [1] * (e - s)
    assert traj.loss_mask == in_span
    assert all((lp != 0.0) == bool(m) for lp, m in zip(traj.behavior_logprobs, traj.loss_mask))
    assert len(traj.versions) == n
    assert [v >= 0 for v in traj.versions] == [bool(m) for m in traj.loss_mask]  # a version on sampled tokens only


# -------------------------------------------------------------------------------------------- the gateway
GATEWAY_OPTIONS = {f.name for f in dataclasses.fields(GatewayOptions)}
EPISODE_OPTIONS = {"env_timeout_s", "capture_routing"}


def make_gateway(template, engine, env=None, *, sampling=None, max_turns=5, max_total_tokens=4096,
                 model_name=None, **kw) -> Gateway:
    """A gateway over ``engine`` (and ``env``): ``kw`` are the gateway's options, ``env_timeout_s`` and
    ``capture_routing``, or its keywords (``enforce_sampling``, ``admission``)."""
    options = GatewayOptions(**{k: kw.pop(k) for k in list(kw) if k in GATEWAY_OPTIONS})
    played = episode(max_turns, max_total_tokens, **{k: kw.pop(k) for k in list(kw) if k in EPISODE_OPTIONS})
    gw = Gateway(engine, template, sampling or SamplingParams(max_new_tokens=256), played, options, env=env, **kw)
    if model_name is not None:
        gw.model_name = model_name
    return gw


@contextlib.asynccontextmanager
async def serving(gw: Gateway, token: str | None = None):
    srv = GatewayServer(gw, token=token)
    await srv.start()
    try:
        yield srv
    finally:
        await srv.stop()


async def http(method: str, url: str, token: str | None = None, **kw) -> tuple[int, Any]:
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    async with aiohttp.ClientSession() as h, h.request(method, url, headers=headers, **kw) as r:
        return r.status, await r.json()


async def open_session(srv: GatewayServer, token: str | None = None, **body) -> dict:
    status, info = await http("POST", srv.url + "/sessions", token, json=body)
    assert status == 201, info
    return info


def client(info: dict, token: str | None = None, **kw: Any) -> AsyncOpenAI:
    """An openai client on the session's base URL with its API key (``token``: another key)."""
    return AsyncOpenAI(base_url=info["base_url"], api_key=token or info["api_key"], **{"max_retries": 0, **kw})


async def complete(c: AsyncOpenAI, stream: bool, **kw: Any) -> Any:
    """One chat completion with the arguments ``kw``: streamed (the chunks accumulated into the final completion by
    the client's own stream state) or not. Not ``chat.completions.stream()``: openai 2.x refuses there any tool that
    is not ``strict`` (it auto-parses the arguments), and the `sglang` extra pins openai 2.x."""
    if stream:
        state = ChatCompletionStreamState()
        async for chunk in await c.chat.completions.create(stream=True, **kw):
            state.handle_chunk(chunk)
        return state.get_final_completion()
    return await c.chat.completions.create(**kw)


async def play_episode(gw: Gateway, model: str, turns: int, stream: bool, task: str = "calc",
                       index: int = 0) -> tuple[list[Any], Any, list[Any]]:
    """``turns`` completions of one ``task`` episode through the openai client (streamed or not), each reply
    sent on to the environment with an empty ``/env`` body; returns the completions, the last env step and the
    session's trajectories."""
    async with serving(gw) as srv:
        info = await open_session(srv, task=task, index=index)
        msgs: list[Any] = list(info["messages"])
        comps = []
        async with client(info) as c:
            for _ in range(turns):
                comp = await complete(c, stream, model=model, messages=msgs, tools=info["tools"])
                comps.append(comp)
                msgs.append(comp.choices[0].message)
                step = await c.post("/env", body={}, cast_to=object)
                msgs += step["messages"]
        return comps, step, gw.sessions[info["session_id"]].to_trajectories()


class Script:
    """Emits ``texts[k]`` (plus ``end`` token, when given) on its k-th call; log-prob of token j: -(k + 1) - j/1000."""

    def __init__(self, template, texts: list[str], version: int = 5, end: int | None = -1) -> None:
        self.template, self.texts, self.version = template, texts, version
        self.end = template.stop_token_ids[0] if end == -1 else end
        self.prompts: list[list[int]] = []
        self.params: list[SamplingParams] = []

    async def generate(self, prompts, params, seeds=None):
        k = len(self.prompts)
        self.prompts.append(list(prompts[0]))
        self.params.append(params)
        ids = self.template.tokenizer.encode(self.texts[k % len(self.texts)], add_special_tokens=False)
        ids = ids + ([self.end] if self.end is not None else [])
        await asyncio.sleep(0)
        return [GenerationOutput(ids, [-(k + 1) - j / 1000 for j in range(len(ids))], "stop", self.version)]


def teach(template, ids: list[int], mask: list[int], version: int = 3, seed: int = 0,
          more: list[tuple[list[int], list[int]]] = ()) -> Any:
    """A tiny Qwen2 taught by rote the tokens of ``ids`` where ``mask`` is 1 (the turns of an episode in the RL
    layout; ``more``: other such sequences, e.g. the other segments of an episode), as a real LocalEngine: sampled
    at temperature 0.5 its turns are then near certain."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from rollout_sglang.engines.local import LocalEngine

    torch.manual_seed(seed)
    cfg = Qwen2Config(vocab_size=len(template.tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2,
                      max_position_embeddings=max(1024, 2 * max(len(x) for x, _ in [(ids, mask), *more])),
                      tie_word_embeddings=False)
    model = Qwen2ForCausalLM(cfg)
    seqs = [(torch.tensor([x]), torch.tensor([[t if m else -100 for t, m in zip(x, y)]])) for x, y in
            [(ids, mask), *more]]
    opt = torch.optim.AdamW(model.parameters(), lr=2e-2)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # matrices this small: more threads only wait on each other
    try:
        for _ in range(300):  # about 100 steps; sampled at temperature 0.5 the taught turns are then near certain
            loss = sum(model(input_ids=x, labels=labels).loss for x, labels in seqs) / len(seqs)
            loss.backward()
            opt.step()
            opt.zero_grad()
            if loss.item() < 1e-2:
                break
    finally:
        torch.set_num_threads(threads)
    assert loss.item() < 1e-2, f"the tiny model did not learn the episode (loss {loss.item():.4f})"
    return LocalEngine(model.eval(), version=version)


# ------------------------------------------------------------------------------ the gateway's calc episode
#: the calc episode's opening messages, as the env sends them
CALC_FIRST = [{"role": "system", "content": "You add numbers."}, {"role": "user", "content": "Solve the task EP=calc."}]


def taught_calc_engine(template) -> Any:
    """A tiny Qwen2 taught (by rote, :func:`teach`) the calc episode in the RL layout: a real LocalEngine whose
    sampled turns are the episode's tool call and answer."""
    conv = CALC_FIRST + [
        {"role": "assistant", "content": "Let me add.", "tool_calls": [
            {"id": "call_0", "type": "function", "function": {"name": "add", "arguments": '{"a": 40, "b": 2}'}}]},
        {"role": "tool", "tool_call_id": "call_0", "content": "42"},
        {"role": "assistant", "content": "The answer is 42."},
    ]
    ids, mask = template.encode_conversation(conv, ADD_TOOLS)
    return teach(template, ids, mask, version=3)


class Spy:
    """An engine wrapper that records every call: (prompts, outputs)."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self.calls: list[tuple[list[list[int]], list[GenerationOutput]]] = []

    @property
    def version(self) -> int:
        return self.engine.version

    async def generate(self, prompts, params, seeds=None):
        outs = await self.engine.generate(prompts, params, seeds=seeds)
        self.calls.append((prompts, outs))
        return outs


class AnsweringPool:
    """Stands in for an SGLang client's HTTP pool of one event loop (``SGLangEngine._pools``): every request is
    answered ``[item]`` with HTTP 200, as a server that generated one row."""

    def __init__(self, item: Any) -> None:
        self.item = item

    async def request(self, method: str, url: str, body: bytes | None, headers: Any, timeout_s: float) -> Any:
        return Response(200, {}, json.dumps([self.item]).encode())


def answer_generate(client: Any, item: Any) -> None:
    """Make every ``/generate`` of ``client`` (an SGLangEngine) on the running loop answer ``[item]``."""
    client._pools[asyncio.get_running_loop()] = AnsweringPool(item)
