"""The rollout process's HTTP clients under a rollout's load: many requests open at once.

A rollout holds one request open for every running turn: its SGLang client's ``/generate`` at each server, and,
with ``rollout.agent=gateway``, each agent's OpenAI client's request to the gateway: thousands at once in an agentic
run, while the engines generate. This bench sends ``--requests`` concurrent requests, ``--rounds`` times (the turns
of the episodes), to a server in another process that answers each like SGLang's ``/generate`` after ``--gen-ms``
(the generation it stands for) and counts the requests it holds at once. Five pools, interleaved round by round in
one run:

* **sglang_pooled**: :class:`~rollout_sglang.engines.sglang_client.SGLangEngine`'s ``generate`` as shipped for
  ``http://`` servers (``env_controller.http.client.PooledHttp``);
* **sglang_httpx**: the same client on its ``https://`` pool (``HttpxPool``: httpx with the client's limits);
* **sglang_httpx_default**: the same on httpx's default pool (at most 100 connections, 20 kept): the client before;
* **agents_aiohttp**: ``post`` on the agent runner's shared OpenAI HTTP client as shipped (openai's
  ``DefaultAioHttpClient``, aiohttp's transport under httpx's API);
* **agents_httpx**: the same on openai's ``DefaultAsyncHttpxClient`` with the same limits: the runner before.

Per pool: the client process's CPU seconds per request (the rollout's event loop pays them), the wall time of a
round, and the most requests the server held at once (a pool that holds requests back starves the engine's batch).
Prints a table, writes ``bench/results/rollout_http.json`` (``--out``) and ends with
``rollout_http_cpu_ratio_httpx_over_pooled: <sglang_httpx CPU per request / sglang_pooled's>``. ``--smoke``: 60
requests, 2 rounds of each, in seconds.

Usage: ``python bench/rollout_http.py [--requests 1000] [--rounds 3] [--gen-ms 200] [--smoke] [--out PATH]``
"""
from __future__ import annotations

import asyncio
import json
import multiprocessing as mp
import re
import statistics
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench._common import bench_parser, git_commit, parse_bench_args, write_record  # noqa: E402

POOLS = ("sglang_pooled", "sglang_httpx", "sglang_httpx_default", "agents_aiohttp", "agents_httpx")


def _serve(port_q: Any, gen_ms: float) -> None:
    """The server process: ``POST /generate`` answered as SGLang answers one row after ``gen_ms``; ``GET /peak``
    answers and resets the most requests held at once."""
    state = {"open": 0, "peak": 0}
    item = {"text": "", "output_ids": [5], "meta_info": {
        "id": "x", "finish_reason": {"type": "length", "length": 1}, "prompt_tokens": 3, "completion_tokens": 1,
        "cached_tokens": 0, "output_token_logprobs": [[-0.5, 5, None]], "weight_version": "0",
        "weight_versions": [{"version": "0", "start": 0, "end": 1}], "e2e_latency": gen_ms / 1000}}
    answer = json.dumps([item]).encode()

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                m = re.search(rb"content-length: *(\d+)", head, re.I)
                if m:
                    await reader.readexactly(int(m.group(1)))
                if head.startswith(b"GET /peak"):
                    body = json.dumps({"peak": state["peak"]}).encode()
                    state["peak"] = 0
                else:
                    state["open"] += 1
                    state["peak"] = max(state["peak"], state["open"])
                    await asyncio.sleep(gen_ms / 1000)
                    state["open"] -= 1
                    body = answer
                writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n%s"
                             % (len(body), body))
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    async def main() -> None:
        server = await asyncio.start_server(handle, "127.0.0.1", 0, backlog=4096)
        port_q.put(server.sockets[0].getsockname()[1])
        async with server:
            await server.serve_forever()

    asyncio.run(main())


def _client(url: str, pool: str, n: int) -> Any:
    """What ``pool`` sends with (on the running loop): an SGLang client, or an agents' HTTP client."""
    import httpx
    import openai

    from rollout_sglang.engines.sglang_client import KEEPALIVE_S, HttpxPool, SGLangEngine
    from rollout_sglang.engines.sglang_options import SGLangClientOptions
    from rollout_sglang.gateway.agent_runner import _shared_http_client

    if pool == "agents_aiohttp":
        return _shared_http_client(n)
    if pool == "agents_httpx":
        return openai.DefaultAsyncHttpxClient(limits=httpx.Limits(max_connections=n, max_keepalive_connections=n))
    client = SGLangEngine(url, SGLangClientOptions(request_timeout_s=600, max_connections=max(n, 1)))
    if pool == "sglang_httpx":
        limits = httpx.Limits(max_connections=n, max_keepalive_connections=n, keepalive_expiry=KEEPALIVE_S)
        client._pools[asyncio.get_running_loop()] = HttpxPool(limits)
    elif pool == "sglang_httpx_default":
        client._pools[asyncio.get_running_loop()] = HttpxPool(httpx.Limits(max_connections=100,
                                                                           max_keepalive_connections=20))
    return client


async def _one(client: Any, url: str, params: Any) -> None:
    """One request: a generate call of the SGLang client, or a POST of an agents' client."""
    if hasattr(client, "generate"):
        [out] = await client.generate([[1, 2, 3]], params)
        assert out.token_ids == [5]
    else:
        r = await client.post(f"{url}/generate", content=b'{"input_ids": [[1, 2, 3]]}',
                              headers={"Content-Type": "application/json"})
        assert r.status_code == 200 and r.json()[0]["output_ids"] == [5]


async def _rounds(url: str, n: int, rounds: int) -> dict[str, list[dict[str, float]]]:
    """``rounds`` rounds of ``n`` concurrent generate calls per pool, the pools interleaved."""
    import httpx

    from rollout_sglang.engines.protocol import SamplingParams

    clients = {p: _client(url, p, n) for p in POOLS}
    params = SamplingParams(max_new_tokens=1)
    out: dict[str, list[dict[str, float]]] = {p: [] for p in POOLS}
    async with httpx.AsyncClient() as admin:
        for _ in range(rounds):
            for p in POOLS:
                await admin.get(f"{url}/peak")
                cpu0, t0 = time.process_time(), time.perf_counter()
                await asyncio.gather(*(_one(clients[p], url, params) for _ in range(n)))
                wall, cpu = time.perf_counter() - t0, time.process_time() - cpu0
                peak = (await admin.get(f"{url}/peak")).json()["peak"]
                out[p].append({"wall_s": wall, "cpu_s": cpu, "cpu_ms_per_request": 1000 * cpu / n, "peak": peak})
    await clients["agents_aiohttp"].close_pool()
    await clients["agents_httpx"].aclose()
    return out


def main(argv: list[str] | None = None) -> int:
    """See the module docstring."""
    parser = bench_parser("rollout_http", __doc__)
    parser.add_argument("--requests", type=int, default=1000, help="concurrent generate calls per round")
    parser.add_argument("--rounds", type=int, default=3, help="rounds per pool (the first pays the connections)")
    parser.add_argument("--gen-ms", type=float, default=200.0, help="how long the server holds each request")
    args = parse_bench_args(parser, argv, {"requests": 60, "rounds": 2, "gen_ms": 20.0})

    ctx = mp.get_context("spawn")
    port_q = ctx.Queue()
    server = ctx.Process(target=_serve, args=(port_q, args.gen_ms), daemon=True)
    server.start()
    try:
        url = f"http://127.0.0.1:{port_q.get(timeout=60)}"
        runs = asyncio.run(_rounds(url, args.requests, args.rounds))
    finally:
        server.kill()
        server.join(10)

    results: dict[str, dict[str, Any]] = {}
    print(f"{args.requests} concurrent /generate calls, {args.rounds} rounds each, server holds each "
          f"{args.gen_ms:g} ms")
    print(f"{'pool':<21} {'CPU ms/request':>15} {'round wall s':>13} {'held at once':>13}")
    for p in POOLS:
        later = runs[p][1:] or runs[p]  # the first round also opens the connections
        row = {"cpu_ms_per_request": statistics.median(r["cpu_ms_per_request"] for r in later),
               "wall_s": statistics.median(r["wall_s"] for r in later),
               "peak": min(r["peak"] for r in runs[p]), "rounds": runs[p]}
        results[p] = row
        print(f"{p:<21} {row['cpu_ms_per_request']:>15.3f} {row['wall_s']:>13.3f} {row['peak']:>13d}")
    ratio = results["sglang_httpx"]["cpu_ms_per_request"] / max(results["sglang_pooled"]["cpu_ms_per_request"], 1e-9)
    agents = (results["agents_httpx"]["cpu_ms_per_request"]
              / max(results["agents_aiohttp"]["cpu_ms_per_request"], 1e-9))
    write_record(args.out, {"bench": "rollout_http", "commit": git_commit(), "requests": args.requests,
                            "rounds": args.rounds, "gen_ms": args.gen_ms, "results": results,
                            "agents_cpu_ratio_httpx_over_aiohttp": agents,
                            "rollout_http_cpu_ratio_httpx_over_pooled": ratio})
    print(f"agents_cpu_ratio_httpx_over_aiohttp: {agents:.2f}")
    print(f"rollout_http_cpu_ratio_httpx_over_pooled: {ratio:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
