"""The local engine's decoding while calls wait behind it: what the waiting costs the running call.

The local engine runs one decoding loop at a time; a call with the loop's sampling settings joins it, a call with
other settings (an evaluation's temperature during a rollout, say) waits for it to end, as does every call while the
engine is paused for a weight update. This bench decodes ``--tokens`` tokens for ``--rows`` rows while ``--waiters``
calls with another temperature wait, and times the running call. Three ways, interleaved round by round in one run:

* **alone**: no call waits (the baseline);
* **woken**: the waiting calls as shipped: each is woken when the engine's state changes (``engines/wakeup.py``);
* **polled**: the same calls, each checking again every 2 ms instead (the engine's waits before the wake-ups).

Per way: the running call's wall time and the process's CPU seconds while it runs (the event loop's wake-ups take
the GIL from the decoding thread, which waits for it after each torch operation); a round that does not end within
``--round-timeout-s`` counts as that long (the table says ``>=``). Each round has an engine of its own (the same
weights). Prints a table, writes ``bench/results/local_waits.json`` (``--out``) and ends
with ``local_waits_slowdown_polled_over_woken: <polled wall / woken wall>``. ``--smoke``: tiny sizes, seconds.

Usage: ``python bench/local_waits.py [--waiters 256] [--rows 8] [--tokens 200] [--rounds 3] [--round-timeout-s 120]
[--smoke] [--out PATH]``
"""
from __future__ import annotations

import asyncio
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench._common import bench_parser, git_commit, parse_bench_args, write_record  # noqa: E402

WAYS = ("alone", "woken", "polled")


def _engine(hidden: int):
    from transformers import Qwen2Config

    from rollout_sglang.engines.local import LocalEngine

    cfg = Qwen2Config(vocab_size=512, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048)
    return LocalEngine.from_config(cfg, init_seed=0)


def _polling():
    """A :class:`~rollout_sglang.engines.wakeup.Wakeup` whose waits return after 2 ms whatever happened: every
    waiting call checks the engine again on each tick."""
    from rollout_sglang.engines.wakeup import Wakeup

    class Polling(Wakeup):
        async def wait(self, fut: asyncio.Future, timeout_s: float) -> bool:
            self.disarm(fut)
            await asyncio.sleep(0.002)
            return False

    return Polling()


async def _round(engine, way: str, waiters: int, rows: int, tokens: int) -> dict[str, float]:
    from rollout_sglang.engines.protocol import SamplingParams

    if way == "polled":
        engine._wakeup = _polling()
    running = SamplingParams(max_new_tokens=tokens, temperature=0.8, seed=1)
    other = SamplingParams(max_new_tokens=2, temperature=0.5, seed=2)
    prompts = [[1 + (i % 7), 2, 3, 4] for i in range(rows)]
    wall0, cpu0 = time.perf_counter(), time.process_time()
    first = asyncio.create_task(engine.generate(prompts, running))
    await asyncio.sleep(0)  # the running call claims the engine first
    waiting = [asyncio.create_task(engine.generate([[5, 6]], other)) for _ in range(waiters if way != "alone" else 0)]
    outs = await first
    wall, cpu = time.perf_counter() - wall0, time.process_time() - cpu0
    await asyncio.gather(*waiting)
    assert all(len(o.token_ids) == tokens for o in outs)
    return {"wall_s": wall, "cpu_s": cpu}


async def _bounded(engine, way: str, args) -> dict[str, float]:
    """:func:`_round` within ``args.round_timeout_s``: past it, the round counts as that long (``timed_out``)."""
    wall0, cpu0 = time.perf_counter(), time.process_time()
    try:
        got = await asyncio.wait_for(_round(engine, way, args.waiters, args.rows, args.tokens), args.round_timeout_s)
        return {**got, "timed_out": False}
    except asyncio.TimeoutError:
        return {"wall_s": time.perf_counter() - wall0, "cpu_s": time.process_time() - cpu0, "timed_out": True}


def main(argv: list[str] | None = None) -> int:
    """Run the bench (see the module doc); returns the exit status."""
    parser = bench_parser("local_waits", __doc__)
    parser.add_argument("--waiters", type=int, default=256, help="calls waiting behind the running one")
    parser.add_argument("--rows", type=int, default=8, help="rows of the running call")
    parser.add_argument("--tokens", type=int, default=200, help="tokens each row of the running call decodes")
    parser.add_argument("--hidden", type=int, default=128, help="hidden size of the model")
    parser.add_argument("--rounds", type=int, default=3, help="rounds of each way, interleaved (the median is kept)")
    parser.add_argument("--round-timeout-s", type=float, default=120.0,
                        help="a round that runs longer counts as this long")
    args = parse_bench_args(parser, argv, {"waiters": 16, "tokens": 16, "rounds": 1, "hidden": 32})
    asyncio.run(_round(_engine(args.hidden), "alone", 0, args.rows, 4))  # warm-up
    runs: dict[str, list[dict[str, float]]] = {w: [] for w in WAYS}
    for _ in range(args.rounds):
        for way in WAYS:
            runs[way].append(asyncio.run(_bounded(_engine(args.hidden), way, args)))
    table = {w: {k: statistics.median(r[k] for r in runs[w]) for k in ("wall_s", "cpu_s")} for w in WAYS}
    print(f"{'way':8} {'wall s':>8} {'cpu s':>8} {'tokens/s':>10}   ({args.waiters} waiting, {args.rows} rows x "
          f"{args.tokens} tokens)")
    for w in WAYS:
        t, late = table[w], ">=" if any(r["timed_out"] for r in runs[w]) else ""
        print(f"{w:8} {late:>2}{t['wall_s']:6.3f} {t['cpu_s']:8.3f} {args.rows * args.tokens / t['wall_s']:10.0f}")
    ratio = table["polled"]["wall_s"] / table["woken"]["wall_s"]
    write_record(args.out, {"bench": "local_waits", "commit": git_commit(), "args": vars(args), "runs": runs,
                            "median": table, "slowdown_polled_over_woken": ratio,
                            "slowdown_woken_over_alone": table["woken"]["wall_s"] / table["alone"]["wall_s"]})
    print(f"local_waits_slowdown_polled_over_woken: {ratio:.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
