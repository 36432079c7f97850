#!/usr/bin/env python
"""The AgentRL paper's ablation (its Table 6) in small, on the CPU demo: what cross-policy sampling, per-task
normalization and DAPO's dynamic sampling each do to the per-task gains of RL.

Variants (each the demo's config, ``examples/configs/tiny_cpu.yaml``, with overrides):

* ``shipped``: the demo as it ships (async, cross-policy sampling over two live versions, per-task
  normalization);
* ``latest``: every turn from the newest weights (``rollout.cross_policy=latest``), no cross-policy sampling;
* ``no_task_norm``: advantages not normalised per task (``algo.normalize_per_task=false``);
* ``dynamic``: DAPO's dynamic sampling on (``algo.dynamic_sampling=true``): zero-variance groups dropped.

Each variant runs once per seed (``train.seed``: the same seed gives every variant the same warm-up, so the
variants differ in RL only), each in its own process (``bench/demo_learning.py``'s runner). The gain of a task
is after-RL minus before-RL success (held-out samples) in percentage points; the table gives each variant's
mean gain per task over the seeds and its difference to ``shipped``, with the spread of the per-seed
differences. Writes ``bench/results/ablation.json`` (``--out``); runs go under ``--workdir``; ``--reuse`` takes
a run whose ``summary.json`` is already there instead of running it again (to add seeds or variants). The last
line is ``ablation_runs: <runs in the table>``.

``--smoke``: one seed of each variant on the tiny demo of ``bench/demo_learning.py --smoke``; its numbers
mean nothing.
"""
from __future__ import annotations

import json
import os
import platform
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from statistics import mean, pstdev
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench._common import bench_parser, git_commit, parse_bench_args, write_record  # noqa: E402
from bench.demo_learning import SMOKE_OVERRIDES, run_seed, task_success  # noqa: E402

VARIANTS: dict[str, list[str]] = {
    "shipped": [],
    "latest": ["rollout.cross_policy=latest"],
    "no_task_norm": ["algo.normalize_per_task=false"],
    "dynamic": ["algo.dynamic_sampling=true"],
}
SMOKE = {"seeds": "1", "timeout": 600.0, "jobs": 2}  # the four variants two at a time


def gains(summary: dict[str, Any]) -> dict[str, float]:
    """``{task: after - before}`` success points of one run."""
    before, after = task_success(summary, "before_rl"), task_success(summary, "after_rl")
    return {t: 100 * (after[t] - before[t]) for t in before}


def main(argv: list[str] | None = None) -> None:
    """Parse the options, run (or reuse) every variant x seed, print the table and write the record."""
    p = bench_parser("ablation", __doc__)
    p.add_argument("--config", default="examples/configs/tiny_cpu.yaml")
    p.add_argument("--seeds", default="1,2,3", help="comma-separated train.seed values")
    p.add_argument("--variants", default=",".join(VARIANTS), help=f"comma-separated, of {', '.join(VARIANTS)}")
    p.add_argument("--workdir", default=None, help="run dirs go under here (default bench/results/ablation; with "
                                                   "--smoke a temporary directory)")
    p.add_argument("--reuse", action="store_true", help="take runs whose summary.json exists instead of rerunning")
    p.add_argument("--timeout", type=float, default=3600.0,
                   help="limit on one run, seconds (runs sharing the cores take longer each)")
    p.add_argument("--jobs", type=int, default=1, help="runs at a time (each with cores / jobs threads)")
    args = parse_bench_args(p, argv, SMOKE)
    seeds = [int(s) for s in args.seeds.split(",") if s.strip()]
    variants = [v for v in args.variants.split(",") if v.strip()]
    bad = [v for v in variants if v not in VARIANTS]
    if bad or not variants or not seeds:
        raise SystemExit(f"--variants {args.variants!r} / --seeds {args.seeds!r}: give seeds like 1,2,3 and variants "
                         f"of {', '.join(VARIANTS)}" + (f" (unknown: {bad})" if bad else ""))
    if args.jobs < 1:
        raise SystemExit(f"--jobs {args.jobs} must be at least 1")
    if args.smoke and args.workdir is None:
        with tempfile.TemporaryDirectory(prefix="agentrl_ablation_smoke_") as tmp:
            run_all(args, seeds, variants, Path(tmp))
    else:
        run_all(args, seeds, variants, (ROOT / (args.workdir or "bench/results/ablation")).resolve())


def run_all(args: Any, seeds: list[int], variants: list[str], root: Path) -> None:
    """Run the grid under ``root``, print the table, write the JSON, print the last line."""
    jobs = args.jobs
    threads = max(1, (os.cpu_count() or 1) // jobs)
    base = [*SMOKE_OVERRIDES] if args.smoke else []

    def one(key: tuple[str, int]) -> tuple[tuple[str, int], dict[str, Any]]:
        variant, seed = key
        out = root / variant / f"seed{seed}"
        if args.reuse and (out / "summary.json").is_file():
            return key, json.loads((out / "summary.json").read_text())
        summary, wall = run_seed(args.config, seed, out, [*base, *VARIANTS[variant]], args.timeout, threads)
        print(f"{variant} seed {seed}: done in {wall:.0f}s", flush=True)
        return key, summary

    grid = [(v, s) for s in seeds for v in variants]
    with ThreadPoolExecutor(max_workers=jobs) as pool:
        summaries = dict(pool.map(one, grid))
    per_run = {f"{v}/seed{s}": gains(summaries[v, s]) for v, s in grid}
    tasks = sorted(next(iter(per_run.values())))
    table: dict[str, dict[str, Any]] = {}
    print(f"\n{'variant':<14}" + "".join(f"{t + ' gain':>14}" for t in tasks) + "   vs shipped (mean +- sd over seeds)")
    for v in variants:
        row = {t: mean(per_run[f"{v}/seed{s}"][t] for s in seeds) for t in tasks}
        diff = None
        if "shipped" in variants and v != "shipped":
            d = {t: [per_run[f"{v}/seed{s}"][t] - per_run[f"shipped/seed{s}"][t] for s in seeds] for t in tasks}
            diff = {t: {"mean": mean(x), "sd": pstdev(x)} for t, x in d.items()}
        table[v] = {"mean_gain_points": row, "vs_shipped_points": diff}
        vs = "   " + ", ".join(f"{t} {diff[t]['mean']:+.1f} +- {diff[t]['sd']:.1f}" for t in tasks) if diff else ""
        print(f"{v:<14}" + "".join(f"{row[t]:>14.1f}" for t in tasks) + vs)
    record = {"config": args.config, "smoke": args.smoke, "seeds": seeds,
              "variants": {v: VARIANTS[v] for v in variants}, "threads_per_run": threads,
              "gain_points_per_run": per_run, "table": table, "commit": git_commit(),
              "machine": {"cpus": os.cpu_count(), "platform": platform.platform()}, "date": time.strftime("%Y-%m-%d")}
    print(f"results: {write_record(args.out, record)}")
    print(f"ablation_runs: {len(grid)}")


if __name__ == "__main__":
    main()
