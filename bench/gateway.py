"""Benchmark: what the agent gateway adds per completion over calling the engine directly, for each of its APIs.

``--sessions`` agents at once (256) each play ``--turns`` tool-calling turns, with a simulated tool time of
``--think-ms`` (jittered) between a reply and the next request. The same workload runs twice in one run:

* **direct**: each agent calls the version pool with its token ids (what the built-in agent loop does per
  turn), in the engines' process;
* **gateway**: each agent is an ``openai.AsyncOpenAI`` client in this process, against a gateway served by
  another process over loopback HTTP: session, messages, tools, the tool-call parse, the trajectory.

The engine is a **stub that answers at once** (a fixed tool call, no model), so that the engine's time does
not hide the gateway's; the figure that counts is the gateway's **added time per completion**: its
handler's wall time minus the engine call's (request parsing and validation, the history check, the env
piece's encoding, routing, the tool-call parse, the response; plus any wait for the gateway's event loop
under the load of the other sessions). The client's round trip minus the direct call's latency (which adds
the HTTP stack and the openai client's own work) and the throughput with no tool time (saturated) are
reported beside it. The loaded workload runs once per API (Chat Completions, Responses, Anthropic Messages:
``stub_with_tool_time``, ``stub_responses``, ``stub_messages``), each turn re-sending the conversation in that
API's own shape. A last phase plays a few sessions against a tiny local engine (a real model behind the
batching wrapper) for an end-to-end figure.

    .venv/bin/python bench/gateway.py                 # 256 sessions x 8 turns, 500 ms tool time
    .venv/bin/python bench/gateway.py --think-ms 0    # no tool time: the gateway saturated
    .venv/bin/python bench/gateway.py --smoke    # seconds

Prints a table, writes ``bench/results/gateway.json`` (``--out``); the last line is
``gateway_overhead_p99_ms: <value>`` (Chat Completions; target < 5 ms); ``added_p99_ms_by_api`` in the record
holds each API's.
"""
from __future__ import annotations

import asyncio
import math
import multiprocessing as mp
import os
import platform
import random
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench._common import bench_parser, git_commit, parse_bench_args, write_record  # noqa: E402

SMOKE = {"sessions": 16, "turns": 2, "think_ms": 5.0, "local_sessions": 4, "local_turns": 2}
TOOLS = [{"type": "function", "function": {"name": "add", "description": "Add two integers.", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}}}}]
FIRST = [{"role": "system", "content": "You add numbers with the tool."}, {"role": "user", "content": "What is 1 + 2?"}]
REPLY = '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>'
TOOL_RESULT = {"role": "tool", "tool_call_id": "call_0", "content": "3"}


def pct(values: list[float], q: float) -> float:
    """The q-quantile (0..1) by nearest rank; nan for no values."""
    if not values:
        return float("nan")
    s = sorted(values)
    return s[min(len(s) - 1, max(0, math.ceil(q * len(s)) - 1))]


def summary_ms(values_s: list[float]) -> dict[str, float]:
    """p50 / p99 / mean in milliseconds of values in seconds."""
    ms = [v * 1000 for v in values_s]
    return {"p50_ms": pct(ms, 0.5), "p99_ms": pct(ms, 0.99), "mean_ms": sum(ms) / max(1, len(ms)), "n": len(ms)}


def loadavg() -> float:
    try:
        return float(Path("/proc/loadavg").read_text().split()[0])
    except (OSError, ValueError):
        return float("nan")


# ------------------------------------------------------------------------------------------------ engines side
class InstantEngine:
    """The stub engine: the same tool call at once, whatever the prompt (no model)."""

    def __init__(self, template: Any) -> None:
        ids = template.tokenizer.encode(REPLY, add_special_tokens=False) + [template.im_end_id]
        self.ids, self.lps, self.version = ids, [-0.5] * len(ids), 0

    async def generate(self, prompts, params, seeds=None):
        from rollout_sglang.engines.protocol import GenerationOutput

        return [GenerationOutput(list(self.ids), list(self.lps), "stop", self.version) for _ in prompts]


async def direct_phase(pool: Any, template: Any, sessions: int, turns: int, think_s: float,
                       max_new_tokens: int) -> list[float]:
    """Per-call latency of the version pool, with the workload's shape (growing prompts, tool time)."""
    from rollout_sglang.engines.protocol import SamplingParams

    params = SamplingParams(max_new_tokens=max_new_tokens, stop_token_ids=list(template.stop_token_ids))
    prompt = template.encode_prompt(FIRST, TOOLS)
    piece = template.encode_env_reply([TOOL_RESULT], ended_with=template.im_end_id)
    rng = random.Random(0)

    async def agent(j: int) -> list[float]:
        await asyncio.sleep(think_s * rng.random())
        toks, lat = list(prompt), []
        for _ in range(turns):
            t0 = time.perf_counter()
            out = (await pool.generate([toks], params, keys=[("direct", j)]))[0]
            lat.append(time.perf_counter() - t0)
            toks += out.token_ids + piece
            await asyncio.sleep(think_s * rng.uniform(0.5, 1.5))
        return lat

    return [x for lat in await asyncio.gather(*(agent(j) for j in range(sessions))) for x in lat]


def _serve_entry(args: dict, to_parent: Any, from_parent: Any) -> None:
    """The engines' process: direct phases, then two gateways (stub, local) until the parent says stop."""
    try:
        asyncio.run(_serve(args, to_parent, from_parent))
    except BaseException as e:  # noqa: BLE001 - reported to the parent
        import traceback

        to_parent.put({"error": f"{e!r}\n{traceback.format_exc()}"})


async def _serve(args: dict, to_parent: Any, from_parent: Any) -> None:
    import torch
    from transformers import Qwen2Config

    from rollout_sglang.chat_template import ChatTemplate
    from rollout_sglang.engines.batching import BatchingEngine
    from rollout_sglang.engines.local import LocalEngine
    from rollout_sglang.engines.protocol import SamplingParams
    from rollout_sglang.engines.version_pool import VersionPool
    from rollout_sglang.episode_options import EpisodeLimits, EpisodeOptions
    from rollout_sglang.gateway import Gateway, GatewayOptions, GatewayServer
    from rollout_sglang.tokenizer import load_tokenizer

    torch.set_num_threads(1)  # the other core runs the agents' process
    template = ChatTemplate(load_tokenizer(REPO / "examples/tokenizer/tiny_agent"))
    stub_pool = VersionPool([[InstantEngine(template)]])
    local = LocalEngine(Qwen2Config(vocab_size=len(template.tokenizer), hidden_size=64, intermediate_size=128,
                                    num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                    max_position_embeddings=2048), init_seed=0)
    local_pool = VersionPool([[BatchingEngine(local)]])
    think_s = args["think_ms"] / 1000
    direct_stub = await direct_phase(stub_pool, template, args["sessions"], args["turns"], think_s, 64)
    direct_local = await direct_phase(local_pool, template, args["local_sessions"], args["local_turns"], think_s,
                                      args["local_tokens"])
    servers = {}
    for name, pool, tokens in (("stub", stub_pool, 64), ("local", local_pool, args["local_tokens"])):
        limits = EpisodeLimits(max_turns=args["turns"] + 1, max_total_tokens=8192)
        gw = Gateway(pool, template, SamplingParams(max_new_tokens=tokens), EpisodeOptions(limits),
                     GatewayOptions(max_sessions=args["sessions"] + 16))
        servers[name] = GatewayServer(gw, record_timings=True)
        await servers[name].start()
    to_parent.put({"ports": {k: s.port for k, s in servers.items()}, "direct_stub": direct_stub,
                   "direct_local": direct_local})
    loop = asyncio.get_running_loop()
    while True:
        msg = await loop.run_in_executor(None, from_parent.get)
        if msg == "stop":
            break
        timings = list(servers[msg].timings)  # (handler s, engine s) per completion since the last snapshot
        servers[msg].timings.clear()
        to_parent.put({"timings": timings, "completions": servers[msg].gateway.stats.completions})
    for s in servers.values():
        await s.stop()


# ------------------------------------------------------------------------------------------------ agents side
def _api_request(api: str, base: str, key: str, convo: list[Any]) -> tuple[str, dict[str, Any], dict[str, str]]:
    """``(url, body, headers)`` of one turn of ``convo`` (chat messages; assistant turns as the API returned them)."""
    auth = {"Authorization": f"Bearer {key}"}
    if api == "chat":
        return base + "/chat/completions", {"model": "policy", "messages": convo, "tools": TOOLS}, auth
    if api == "responses":
        items: list[Any] = []
        for m in convo[1:]:
            items += m if isinstance(m, list) else [
                {"type": "function_call_output", "call_id": m["tool_call_id"], "output": m["content"]}
                if m["role"] == "tool" else {"role": m["role"], "content": m["content"]}]
        tools = [{"type": "function", **TOOLS[0]["function"]}]
        return base + "/responses", {"model": "policy", "instructions": convo[0]["content"], "input": items,
                                     "tools": tools}, auth
    msgs: list[Any] = []
    for m in convo[1:]:
        if m["role"] == "tool":
            msgs.append({"role": "user", "content": [{"type": "tool_result", "tool_use_id": m["tool_call_id"],
                                                      "content": m["content"]}]})
        else:
            msgs.append(m)
    fn = TOOLS[0]["function"]
    tools = [{"name": fn["name"], "description": fn["description"], "input_schema": fn["parameters"]}]
    return base[: -len("/v1")] + "/v1/messages", {"model": "policy", "max_tokens": 64, "system": convo[0]["content"],
                                                  "messages": msgs, "tools": tools}, \
        {"x-api-key": key, "anthropic-version": "2023-06-01"}


def _api_reply(api: str, body: dict[str, Any]) -> tuple[Any, str]:
    """The assistant turn as the next request re-sends it, and the call id the tool result answers."""
    if api == "chat":
        msg = body["choices"][0]["message"]
        return msg, msg["tool_calls"][0]["id"]
    if api == "responses":
        return body["output"], next(o["call_id"] for o in body["output"] if o["type"] == "function_call")
    return {"role": "assistant", "content": body["content"]}, next(
        b["id"] for b in body["content"] if b["type"] == "tool_use")


async def gateway_phase(url: str, sessions: int, turns: int, think_s: float, openai_client: bool = False,
                        api: str = "chat") -> dict[str, Any]:
    """``sessions`` agents at once, ``turns`` completions each; client latency and wall time.

    The agents post request bodies of ``api`` ("chat", "responses", "messages") with aiohttp (light: the figures
    are the gateway's, not a client library's), or with ``openai_client`` are ``openai.AsyncOpenAI`` clients
    (Chat Completions)."""
    import aiohttp
    import openai

    rng = random.Random(1)
    pool = openai.DefaultAsyncHttpxClient()  # one for all: a client of its own costs each an SSL context
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as http:

        async def complete_raw(base: str, key: str, msgs: list[Any]) -> tuple[Any, str]:
            target, body, headers = _api_request(api, base, key, msgs)
            async with http.post(target, json=body, headers=headers) as r:
                reply = await r.json()
                assert r.status == 200, reply
                return _api_reply(api, reply)

        async def agent(j: int) -> list[float]:
            await asyncio.sleep(think_s * rng.random())  # starts spread over one tool time, not one burst
            async with http.post(url + "/sessions", json={"group_id": j}) as r:
                info = await r.json()
            lat: list[float] = []
            msgs: list[Any] = list(FIRST)
            c = openai.AsyncOpenAI(base_url=info["base_url"], api_key=info["api_key"], max_retries=0,
                                   http_client=pool)
            for _ in range(turns):
                t0 = time.perf_counter()
                if openai_client:
                    reply: Any = (await c.chat.completions.create(model="policy", messages=msgs,
                                                                  tools=TOOLS)).choices[0].message
                    call_id = reply.tool_calls[0].id if reply.tool_calls else "call_0"  # a random model: none
                else:
                    reply, call_id = await complete_raw(info["base_url"], info["api_key"], msgs)
                lat.append(time.perf_counter() - t0)
                msgs += [reply, {**TOOL_RESULT, "tool_call_id": call_id}]
                await asyncio.sleep(think_s * rng.uniform(0.5, 1.5))
            async with http.delete(f"{url}/sessions/{info['session_id']}") as r:
                assert r.status == 200, await r.text()
            return lat

        t0 = time.perf_counter()
        lats = await asyncio.gather(*(agent(j) for j in range(sessions)))
        wall = time.perf_counter() - t0
        await pool.aclose()
    flat = [x for lat in lats for x in lat]
    return {"completions": len(flat), "wall_s": wall, "completions_per_s": len(flat) / wall, "client": flat}


def added(timings: list[tuple[float, float, str]]) -> list[float]:
    """The gateway's own time per completion: handler wall time minus the engine call's."""
    return [max(0.0, h - e) for h, e, _ in timings]


def main(argv: list[str] | None = None) -> int:
    parser = bench_parser("gateway", __doc__)
    parser.add_argument("--sessions", type=int, default=256, help="agents at once")
    parser.add_argument("--turns", type=int, default=8, help="completions per session")
    parser.add_argument("--think-ms", type=float, default=500.0,
                        help="simulated time between a reply and the next request (mean): the agent's tools")
    parser.add_argument("--local-sessions", type=int, default=16, help="sessions of the local-engine phase")
    parser.add_argument("--local-turns", type=int, default=3)
    parser.add_argument("--local-tokens", type=int, default=16, help="tokens per turn of the local engine")
    args = parse_bench_args(parser, argv, SMOKE)
    ctx = mp.get_context("spawn")
    to_parent, from_parent = ctx.Queue(), ctx.Queue()
    child = ctx.Process(target=_serve_entry, args=(vars(args), to_parent, from_parent), daemon=True)
    load0 = loadavg()
    child.start()
    try:
        ready = to_parent.get(timeout=600)
        if "error" in ready:
            raise SystemExit(f"the engines' process failed:\n{ready['error']}")

        def snapshot(name: str) -> dict:
            from_parent.put(name)
            return to_parent.get(timeout=120)

        think_s = args.think_ms / 1000
        stub_url = f"http://127.0.0.1:{ready['ports']['stub']}"
        loaded = asyncio.run(gateway_phase(stub_url, args.sessions, args.turns, think_s))
        loaded_t = snapshot("stub")["timings"]
        per_api = {}
        for api in ("responses", "messages"):
            per_api[api] = asyncio.run(gateway_phase(stub_url, args.sessions, args.turns, think_s, api=api))
            per_api[api]["timings"] = snapshot("stub")["timings"]
        saturated = asyncio.run(gateway_phase(stub_url, args.sessions, args.turns, 0.0))
        saturated_t = snapshot("stub")["timings"]
        local_url = f"http://127.0.0.1:{ready['ports']['local']}"
        local = asyncio.run(gateway_phase(local_url, args.local_sessions, args.local_turns, think_s,
                                          openai_client=True))
        local_t = snapshot("local")["timings"]
        from_parent.put("stop")
    finally:
        child.join(30)
        if child.is_alive():
            child.kill()
    direct = summary_ms(ready["direct_stub"])
    rows = {
        "stub_with_tool_time": {"completions_per_s": loaded["completions_per_s"], "added": summary_ms(added(loaded_t)),
                                "client": summary_ms(loaded["client"]), "direct": direct},
        **{f"stub_{api}": {"completions_per_s": r["completions_per_s"], "added": summary_ms(added(r["timings"])),
                           "client": summary_ms(r["client"])} for api, r in per_api.items()},
        "stub_saturated": {"completions_per_s": saturated["completions_per_s"],
                           "added": summary_ms(added(saturated_t)), "client": summary_ms(saturated["client"])},
        "local_engine": {"completions_per_s": local["completions_per_s"], "added": summary_ms(added(local_t)),
                         "client": summary_ms(local["client"]), "direct": summary_ms(ready["direct_local"])},
    }
    for r in rows.values():
        if "direct" in r:
            r["client_minus_direct_p50_ms"] = r["client"]["p50_ms"] - r["direct"]["p50_ms"]
            r["client_minus_direct_p99_ms"] = r["client"]["p99_ms"] - r["direct"]["p99_ms"]
    overhead_p99 = rows["stub_with_tool_time"]["added"]["p99_ms"]
    by_api = {"chat": overhead_p99, "responses": rows["stub_responses"]["added"]["p99_ms"],
              "messages": rows["stub_messages"]["added"]["p99_ms"]}
    print(f"gateway: {args.sessions} sessions x {args.turns} turns, tool time {args.think_ms:g} ms (+-50 %), "
          f"stub engine (answers at once); load average {load0:.1f} -> {loadavg():.1f}")
    print(f"{'phase':<22}{'compl/s':>9}{'added p50':>11}{'added p99':>11}{'client p50':>12}{'client p99':>12}"
          f"{'direct p50':>12}")
    for name, r in rows.items():
        d = r.get("direct", {}).get("p50_ms", float("nan"))
        print(f"{name:<22}{r['completions_per_s']:>9.0f}{r['added']['p50_ms']:>11.2f}{r['added']['p99_ms']:>11.2f}"
              f"{r['client']['p50_ms']:>12.2f}{r['client']['p99_ms']:>12.2f}{d:>12.3f}")
    print("added: the gateway's handler time minus the engine call (ms per completion); client: the openai client's "
          "round trip; direct: the pool's generate called in the engines' process")
    record = {"bench": "gateway", "commit": git_commit(), "machine": platform.node(), "cpus": os.cpu_count(),
              "smoke": args.smoke, "args": {k: v for k, v in vars(args).items() if k != "out"},
              "loadavg_start": load0, "loadavg_end": loadavg(), "results": rows,
              "completions_per_s": rows["stub_with_tool_time"]["completions_per_s"],
              "gateway_overhead_p50_ms": rows["stub_with_tool_time"]["added"]["p50_ms"],
              "gateway_overhead_p99_ms": overhead_p99, "added_p99_ms_by_api": by_api}
    print("added p99 per API (ms): " + ", ".join(f"{k} {v:.2f}" for k, v in by_api.items()))
    print(f"wrote {write_record(args.out, record)}")
    print(f"gateway_overhead_p99_ms: {overhead_p99:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
