#!/usr/bin/env python
"""Does the CPU demo learn? Per-task success after RL minus after the warm-up, over seeds.

Runs the demo (``agentrl train --config examples/configs/tiny_cpu.yaml``, the command behind
``make demo``) once per seed (``train.seed=<s>``: model initialisation, task draws, sampling), each
in its own process and output directory, and reads each run's ``summary.json``: per-task success
on the held-out evaluation samples right after the supervised warm-up (``before_rl``) and after
RL (``after_rl``), same samples, same sampling temperature. The gain of a task is the mean over
seeds of (after - before), in percentage points.

Prints a line per seed (success before -> after RL with its 95 % interval), then per task the
means and the smallest gain of any seed; writes ``bench/results/demo_learning.json`` (``--out``;
the runs' output directories go under ``--workdir``); the last line is
``demo_min_task_gain_points: <the smallest mean gain over the tasks>``.

``--jobs N`` runs N seeds at a time, each with ``OMP_NUM_THREADS`` = cores / N (at least 1): on a
2-core machine two one-thread runs take about as long as one two-thread run. The thread count is
part of what a seed gives: float sums in another order change the warm-up's trajectory, so a seed
reproduces exactly only at the same thread count (the record keeps it).

``--smoke``: one seed of a tiny demo (2 warm-up steps, 1 RL step, 2 evaluation samples per task,
short turns; the runs in a temporary directory), in seconds; its gain means nothing.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from statistics import mean
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench._common import bench_parser, git_commit, parse_bench_args, write_record  # noqa: E402

SMOKE = {"seeds": "1", "timeout": 600.0}
# the demo at its smallest: each phase runs once, on short sequences
SMOKE_OVERRIDES = ["sft.steps=2", "sft.short_format_steps=1", "sft.batch_size=4", "train.steps=1",
                   "train.micro_batch_size=4", "rollout.prompts_per_step=2", "rollout.samples_per_prompt=2",
                   "rollout.max_turns=2", "rollout.max_new_tokens=8", "eval.samples_per_task=2",
                   "checkpoint.interval=0", "model.arch.hidden_size=32", "model.arch.intermediate_size=64",
                   "model.arch.num_hidden_layers=1"]


def run_seed(config: str, seed: int, out_dir: Path, overrides: list[str], timeout_s: float,
             threads: int) -> tuple[dict[str, Any], float]:
    """Run the demo for one seed in a subprocess with ``threads`` torch threads; returns (its
    summary.json, wall seconds)."""
    cmd = [sys.executable, "-m", "megatron_agentrl.cli", "train", "--config", config,
           f"train.seed={seed}", f"output_dir={out_dir}", *overrides]
    t0 = time.perf_counter()
    log = out_dir.with_suffix(".log")
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "w") as fh:
        try:
            proc = subprocess.run(cmd, cwd=ROOT, stdout=fh, stderr=subprocess.STDOUT, timeout=timeout_s,
                                  env={**os.environ, "OMP_NUM_THREADS": str(threads)})
        except subprocess.TimeoutExpired:
            _log_tail(log)
            raise SystemExit(f"seed {seed}: the demo ran past --timeout {timeout_s:.0f}s; its log is {log}") from None
    if proc.returncode != 0:
        _log_tail(log)
        raise SystemExit(f"seed {seed}: the demo failed (exit {proc.returncode}); its log is {log}")
    return json.loads((out_dir / "summary.json").read_text()), time.perf_counter() - t0


def _log_tail(log: Path, lines: int = 40) -> None:
    """Copy the last ``lines`` of a failed run's log to stderr (a temporary workdir goes away)."""
    sys.stderr.write("".join(log.read_text(errors="replace").splitlines(keepends=True)[-lines:]))


def task_success(summary: dict[str, Any], phase: str) -> dict[str, float]:
    """``{task: success in [0, 1]}`` of one phase (``before_rl`` | ``after_rl``) of a summary."""
    return {k.split("/", 1)[1]: v for k, v in summary[phase].items() if k.startswith("success/")}


def task_interval(summary: dict[str, Any], phase: str) -> dict[str, list[float]]:
    """``{task: [low, high]}``: the 95 % interval of each task's success in one phase of a summary."""
    m = summary[phase]
    return {k.split("/", 1)[1]: [v, m[f"success_high/{k.split('/', 1)[1]}"]]
            for k, v in m.items() if k.startswith("success_low/")}


def main(argv: list[str] | None = None) -> None:
    """Parse the options, run the seeds under ``--workdir`` (a temporary one with ``--smoke``)."""
    p = bench_parser("demo_learning", __doc__)
    p.add_argument("--config", default="examples/configs/tiny_cpu.yaml")
    p.add_argument("--seeds", default="1,2,3", help="comma-separated train.seed values")
    p.add_argument("--workdir", default=None,
                   help="per-seed output dirs go under here (default bench/results/demo_learning; with --smoke a "
                        "temporary directory)")
    p.add_argument("--timeout", type=float, default=1800.0, help="limit on one seed's run, seconds")
    p.add_argument("--jobs", type=int, default=1, help="seeds run at a time (each with cores / jobs threads)")
    p.add_argument("overrides", nargs="*", help="extra key=value config overrides for every seed")
    args = parse_bench_args(p, argv, SMOKE)
    seeds = [int(s) for s in args.seeds.split(",") if s.strip()]
    if not seeds:
        raise SystemExit(f"--seeds {args.seeds!r} names no seed; give e.g. --seeds 1,2,3")
    if args.jobs < 1:
        raise SystemExit(f"--jobs {args.jobs} must be at least 1")
    overrides = [*SMOKE_OVERRIDES, *args.overrides] if args.smoke else args.overrides
    if args.workdir is not None:
        run_seeds(args, seeds, overrides, (ROOT / args.workdir).resolve())
    elif args.smoke:
        with tempfile.TemporaryDirectory(prefix="agentrl_demo_smoke_") as tmp:
            run_seeds(args, seeds, overrides, Path(tmp))
    else:
        run_seeds(args, seeds, overrides, ROOT / "bench" / "results" / "demo_learning")


def _rate(success: float, interval: list[float] | None) -> str:
    """``52% (44-61)``: a success rate with its interval, in percent."""
    return f"{100 * success:.0f}%" + (f" ({100 * interval[0]:.0f}-{100 * interval[1]:.0f})" if interval else "")


def run_seeds(args: argparse.Namespace, seeds: list[int], overrides: list[str], out_root: Path) -> None:
    """Run the seeds under ``out_root``, print the table, write the JSON, print the last line."""
    jobs = min(args.jobs, len(seeds))
    threads = max(1, (os.cpu_count() or 1) // jobs)

    def one(seed: int) -> tuple[dict[str, Any], float]:
        result = run_seed(args.config, seed, out_root / f"seed{seed}", overrides, args.timeout, threads)
        print(f"seed {seed} done in {result[1]:.0f}s", flush=True)
        return result

    with ThreadPoolExecutor(max_workers=jobs) as pool:
        results = dict(zip(seeds, pool.map(one, seeds)))
    rows, per_seed = [], {}
    for seed, (summary, wall) in results.items():
        before, after = task_success(summary, "before_rl"), task_success(summary, "after_rl")
        lo_hi = {"before": task_interval(summary, "before_rl"), "after": task_interval(summary, "after_rl")}
        per_seed[seed] = {"before": before, "after": after, "interval_95": lo_hi, "wall_s": wall,
                          "rl_wall_s": summary.get("rl_wall_s"), "threads": threads}
        for task in sorted(before):
            rows.append((seed, task, before[task], after[task]))

        print(f"seed {seed}: {wall:.0f}s | " + ", ".join(
            f"{t} {_rate(before[t], lo_hi['before'].get(t))} -> {_rate(after[t], lo_hi['after'].get(t))}"
            for t in sorted(before)), flush=True)

    tasks = sorted({r[1] for r in rows})
    gains = {t: 100 * mean(a - b for _, task, b, a in rows if task == t) for t in tasks}
    worst = {t: 100 * min(a - b for _, task, b, a in rows if task == t) for t in tasks}
    print(f"\n{'task':<10}{'before RL %':>13}{'after RL %':>12}{'mean gain':>11}{'worst seed':>12}  (points)")
    for t in tasks:
        b = 100 * mean(r[2] for r in rows if r[1] == t)
        a = 100 * mean(r[3] for r in rows if r[1] == t)
        print(f"{t:<10}{b:>13.1f}{a:>12.1f}{gains[t]:>11.1f}{worst[t]:>12.1f}")
    result = {"config": args.config, "smoke": args.smoke, "seeds": seeds, "overrides": overrides, "jobs": jobs,
              "threads_per_run": threads, "per_seed": per_seed, "mean_gain_points": gains,
              "worst_seed_gain_points": worst, "demo_min_task_gain_points": min(gains.values()),
              "commit": git_commit(), "machine": {"cpus": os.cpu_count(), "platform": platform.platform()},
              "date": time.strftime("%Y-%m-%d")}
    print(f"results: {write_record(args.out, result)}")
    print(f"demo_min_task_gain_points: {min(gains.values()):.1f}")


if __name__ == "__main__":
    main()
