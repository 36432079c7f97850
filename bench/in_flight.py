#!/usr/bin/env python
"""In-flight weight updates against draining, side by side in one run: one slot, long-tailed generation lengths.

The rollout side of an asynchronous run, with the trainer's GPU work stood in for by a wait: one version slot of one
local engine (continuous batching: requests join the running batch between decode steps) behind a
:class:`~rollout_sglang.engines.version_pool.VersionPool`; ``--clients`` producers, each generating one sample after
another, ``max_new_tokens`` drawn from a Pareto(``--alpha``) law from ``--min-tokens`` (capped at ``--max-tokens``;
no stop token, so each sample is that long), none starting while ``(--staleness + 1) x --batch`` samples are running
or waiting to be trained (the admission of the asynchronous pipeline); a trainer thread that, ``--steps`` times,
takes ``--batch`` finished samples, waits ``--train-s`` (the training step) and pushes the weights
(``begin_update``, every tensor of the model, ``end_update``). The same run once per ``--modes``
(``rollout.weight_update_mode``): ``drain`` (the update waits for the slot's running requests, and no new one starts
meanwhile), ``retract`` and ``in_place`` (the running requests are held between two tokens, the weights loaded, the
requests continued).

Per mode: ``trained_samples_per_s`` and ``trained_tokens_per_s`` (what the trainer took / the wall time of its steps;
the staleness cap drops long samples more often than short ones, so the two ratios differ); around the updates
(from ``begin_update`` to the end of ``end_update``): ``update_s`` (the trainer blocked, mean), ``update_rows`` and
``other_rows`` (the mean requests running during the updates and the rest of the time, sampled every 5 ms) and
``update_idle_frac`` = 1 - update_rows / other_rows (the share of the engine's usual batch left unused while an
update is open: a drained slot finishes its long tail alone, then idles); the share of samples (and tokens) that an
update crossed; the staleness of the trained samples (the trainer's version minus each sample's oldest token's) and
``dropped_stale``, the finished samples left out for being older than ``--staleness`` (as the pipeline drops them).
The ratios are against ``drain`` in this run. Writes ``bench/results/in_flight.json`` (``--out``); the last line is
``in_flight_speedup: <retract / drain trained samples per second>``.
"""
from __future__ import annotations

import asyncio
import random
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench._common import bench_parser, git_commit, parse_bench_args, write_record  # noqa: E402

SMOKE = {"steps": 2, "batch": 4, "clients": 4, "min_tokens": 2, "max_tokens": 12, "train_s": 0.01, "hidden": 32,
         "layers": 1}


def pareto_tokens(rng: random.Random, alpha: float, low: int, high: int) -> int:
    """A Pareto(alpha) draw with minimum ``low``, capped at ``high``, as a token count."""
    return min(high, int(low * rng.paretovariate(alpha)))


def run_mode(mode: str, args: Any) -> dict[str, Any]:
    """One run of the producers and the trainer with ``weight_update_mode`` = ``mode``; its figures."""
    import torch
    from transformers import Qwen2Config

    from rollout_sglang.engines.batching import BatchingEngine
    from rollout_sglang.engines.local import LocalEngine
    from rollout_sglang.engines.protocol import SamplingParams
    from rollout_sglang.engines.version_pool import VersionPool
    from rollout_sglang.weight_update.direct import deliver_direct

    torch.manual_seed(0)
    cfg = Qwen2Config(vocab_size=512, hidden_size=args.hidden, intermediate_size=4 * args.hidden,
                      num_hidden_layers=args.layers, num_attention_heads=4, num_key_value_heads=2,
                      max_position_embeddings=args.max_tokens + 64, tie_word_embeddings=True)
    local = LocalEngine.from_config(cfg, init_seed=0, seed=1)
    engine = BatchingEngine(local)
    pool = VersionPool([[engine]], update_mode=mode, live_timeout_s=600, drain_timeout_s=600)
    weights = {k: v.clone() for k, v in local.model.state_dict().items()}
    finished: list[Any] = []
    cond = threading.Condition()
    stop = threading.Event()
    record: dict[str, list[float]] = {"update_s": [], "update_rows": [], "other_rows": [], "staleness": []}
    trained: list[Any] = []
    running = [0]  # samples being generated
    dropped = [0]  # finished samples older than the staleness cap
    cap = (args.staleness + 1) * args.batch

    async def producer(i: int) -> None:
        rng = random.Random(1000 * i + 7)
        prompt = [rng.randrange(1, 512) for _ in range(8)]
        while not stop.is_set():
            deadline = time.monotonic() + 600
            while running[0] + len(finished) >= cap and not stop.is_set():  # admission holds new samples back
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{mode}: the queue stayed full for 600 s")
                await asyncio.sleep(0.002)
            n = pareto_tokens(rng, args.alpha, args.min_tokens, args.max_tokens)
            params = SamplingParams(max_new_tokens=n, temperature=1.0, seed=rng.randrange(1 << 30))
            running[0] += 1
            try:
                (out,) = await pool.generate([prompt], params)
            except Exception:  # noqa: BLE001 - the run ends under it
                if stop.is_set():
                    return
                raise
            finally:
                running[0] -= 1
            with cond:
                finished.append(out)
                cond.notify_all()

    def rows_monitor(window: list[float]) -> None:
        while not stop.is_set():
            open_ = bool(window) and window[-1] < 0  # an update is open
            record["update_rows" if open_ else "other_rows"].append(float(sum(pool.inflight())))
            time.sleep(0.005)

    def trainer() -> None:
        window: list[float] = []
        monitor = threading.Thread(target=rows_monitor, args=(window,), daemon=True)
        monitor.start()
        try:
            for step in range(1, args.steps + 1):
                with cond:
                    def ready(version: int = step - 1) -> bool:  # samples beyond the staleness cap are dropped
                        keep = [o for o in finished if version - min(o.token_versions) <= args.staleness]
                        dropped[0] += len(finished) - len(keep)
                        finished[:] = keep
                        return len(finished) >= args.batch

                    if not cond.wait_for(ready, timeout=600):
                        raise TimeoutError(f"{mode}: no batch of {args.batch} samples within 600 s")
                    batch, finished[:] = finished[:args.batch], finished[args.batch:]
                trained.extend(batch)
                record["staleness"] += [step - 1 - min(o.token_versions) for o in batch if o.token_versions]
                time.sleep(args.train_s)
                t0 = time.perf_counter()
                window.append(-1.0)
                slot = pool.begin_update(step)
                deliver_direct([engine], weights.items(), 64 << 20)
                pool.end_update(slot)
                window[-1] = 1.0
                record["update_s"].append(time.perf_counter() - t0)
        finally:
            stop.set()
            monitor.join(timeout=5)

    async def main() -> float:
        tasks = [asyncio.create_task(producer(i)) for i in range(args.clients)]
        await asyncio.sleep(0)
        t0 = time.perf_counter()
        busy0 = engine.busy_seconds()
        await asyncio.to_thread(trainer)
        wall = time.perf_counter() - t0
        busy = engine.busy_seconds() - busy0
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        return wall, busy

    wall, busy = asyncio.run(main())
    crossed = [o for o in trained if len(set(o.token_versions)) > 1]
    tokens = sum(len(o.token_ids) for o in trained)
    after = sum(sum(1 for v in o.token_versions[1:] if v != o.token_versions[0]) for o in trained)
    update_rows = statistics.fmean(record["update_rows"]) if record["update_rows"] else 0.0
    other_rows = statistics.fmean(record["other_rows"]) if record["other_rows"] else 0.0
    return {
        "mode": mode, "wall_s": wall, "trained_samples": len(trained), "dropped_stale": dropped[0],
        "trained_samples_per_s": len(trained) / wall, "trained_tokens_per_s": tokens / wall,
        "update_s": statistics.fmean(record["update_s"]),
        "update_idle_frac": max(0.0, 1.0 - update_rows / other_rows) if other_rows else 0.0,
        "update_rows": update_rows, "other_rows": other_rows,
        "engine_idle_frac": max(0.0, 1.0 - busy / wall),
        "crossed_samples_frac": len(crossed) / max(len(trained), 1),
        "tokens_after_update_frac": after / max(tokens, 1),
        "mean_tokens": tokens / max(len(trained), 1),
        "staleness_mean": statistics.fmean(record["staleness"]) if record["staleness"] else 0.0,
        "staleness_max": max(record["staleness"], default=0),
    }


def main(argv: list[str] | None = None) -> int:
    """Parse the options, run each mode, print the table, write the record."""
    p = bench_parser("in_flight", __doc__)
    p.add_argument("--modes", default="drain,retract,in_place", help="weight_update_mode values, drain first")
    p.add_argument("--steps", type=int, default=40, help="trainer steps (weight updates) per mode")
    p.add_argument("--batch", type=int, default=16, help="samples the trainer takes per step")
    p.add_argument("--clients", type=int, default=48, help="producers, each generating one sample after another")
    p.add_argument("--staleness", type=int, default=1, help="admission: at most (staleness + 1) x batch samples "
                   "running or waiting")
    p.add_argument("--alpha", type=float, default=1.2, help="the Pareto shape of the generation lengths")
    p.add_argument("--min-tokens", type=int, default=8, help="the shortest generation")
    p.add_argument("--max-tokens", type=int, default=384, help="the cap on a generation's length")
    p.add_argument("--train-s", type=float, default=0.1, help="the trainer's step time, seconds")
    p.add_argument("--hidden", type=int, default=128, help="the engine model's hidden size")
    p.add_argument("--layers", type=int, default=2, help="the engine model's layers")
    args = parse_bench_args(p, argv, SMOKE)
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    if not modes or modes[0] != "drain":
        p.error(f"--modes={args.modes!r} must start with drain (the baseline of the ratios)")
    results = {m: run_mode(m, args) for m in modes}
    base = results["drain"]["trained_samples_per_s"]
    print(f"{'mode':<9} {'samples/s':>9} {'x drain':>8} {'tokens/s':>9} {'x drain':>8} {'update s':>9} "
          f"{'idle in upd':>11} {'rows in upd':>11} "
          f"{'rows other':>10} {'crossed':>8} {'dropped':>7}")
    for m, r in results.items():
        r["speedup_vs_drain"] = r["trained_samples_per_s"] / base
        r["tokens_speedup_vs_drain"] = r["trained_tokens_per_s"] / results["drain"]["trained_tokens_per_s"]
        print(f"{m:<9} {r['trained_samples_per_s']:>9.2f} {r['speedup_vs_drain']:>8.2f} "
              f"{r['trained_tokens_per_s']:>9.0f} {r['tokens_speedup_vs_drain']:>8.2f} {r['update_s']:>9.3f} "
              f"{r['update_idle_frac']:>11.2f} {r['update_rows']:>11.1f} {r['other_rows']:>10.1f} "
              f"{r['crossed_samples_frac']:>8.2f} {r['dropped_stale']:>7}")
    write_record(args.out, {"bench": "in_flight", "smoke": args.smoke, "commit": git_commit(),
                            "args": {k: v for k, v in vars(args).items() if k != "out"}, "results": results})
    headline = results.get("retract", results[modes[-1]])
    print(f"in_flight_speedup: {headline['speedup_vs_drain']:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
