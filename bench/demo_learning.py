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

``--warmup-seed S --runs N``: the warm-up runs once (``train.seed=S``, saved as the checkpoint
``step_000000`` by ``checkpoint.after_warmup``) and RL runs N times from it (``checkpoint.resume``), so
the spread over the runs is RL's own (asynchronous timing: which weight version samples which turn)
and not the warm-up's. The record's ``per_run`` takes the place of ``per_seed``; a run's
``collapse_steps`` counts the RL steps on which the collapse alarm was up for some task.

``--smoke``: the tiny demo (2 warm-up steps, 1 RL step, 2 evaluation samples per task, short
turns; in a temporary directory) warmed up once and run once from that warm-up, in seconds; its
gain means nothing.
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

SMOKE = {"seeds": "1", "warmup_seed": 1, "runs": 1, "timeout": 600.0}
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
    p.add_argument("--timeout", type=float, default=None,
                   help="limit on one run, seconds (default 1800, times jobs / cores where more runs than cores "
                        "share them)")
    p.add_argument("--jobs", type=int, default=1, help="seeds run at a time (each with cores / jobs threads)")
    p.add_argument("--warmup-seed", type=int, default=None,
                   help="warm up once with this train.seed and run RL --runs times from that warm-up (instead of "
                        "one whole run per --seeds entry)")
    p.add_argument("--runs", type=int, default=3, help="with --warmup-seed: RL runs from the one warm-up")
    p.add_argument("overrides", nargs="*", help="extra key=value config overrides for every seed")
    args = parse_bench_args(p, argv, SMOKE)
    seeds = [int(s) for s in args.seeds.split(",") if s.strip()]
    if not seeds:
        raise SystemExit(f"--seeds {args.seeds!r} names no seed; give e.g. --seeds 1,2,3")
    if args.jobs < 1:
        raise SystemExit(f"--jobs {args.jobs} must be at least 1")
    if args.warmup_seed is not None and args.runs < 1:
        raise SystemExit(f"--runs {args.runs} must be at least 1")
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


def collapse_steps(out_dir: Path) -> int:
    """RL steps of a run (its ``metrics.jsonl``) on which the collapse alarm was up for at least one task."""
    rows = [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return sum(1 for r in rows if r.get("phase") == "rl" and any(
        v for k, v in r.items() if k.startswith("collapse/")))


def run_seeds(args: argparse.Namespace, seeds: list[int], overrides: list[str], out_root: Path) -> None:
    """Run the seeds (or, with ``--warmup-seed``, the RL runs from one warm-up) under ``out_root``, print the
    table, write the JSON, print the last line."""
    cores = os.cpu_count() or 1
    jobs = min(args.jobs, len(seeds) if args.warmup_seed is None else args.runs)
    threads = max(1, cores // jobs)
    if args.timeout is None:  # runs sharing the cores take proportionally longer (5 on 2 cores: 27 min of warm-up)
        args.timeout = 1800.0 * max(1.0, jobs / cores)
    warmup = None
    if args.warmup_seed is not None:
        wdir = out_root / f"warmup_seed{args.warmup_seed}"
        print(f"warm-up (train.seed={args.warmup_seed}) ...", flush=True)
        _, wall = run_seed(args.config, args.warmup_seed, wdir, [*overrides, "train.steps=1",
                                                                 "checkpoint.after_warmup=true"], args.timeout, cores)
        warmup = {"seed": args.warmup_seed, "checkpoint": str(wdir / "checkpoints" / "step_000000"), "wall_s": wall}
        print(f"warm-up done in {wall:.0f}s: {warmup['checkpoint']}", flush=True)
        labels = [f"run{i}" for i in range(1, args.runs + 1)]
    else:
        labels = [str(seed) for seed in seeds]

    def one(label: str) -> tuple[dict[str, Any], float]:
        if warmup is None:
            result = run_seed(args.config, int(label), out_root / f"seed{label}", overrides, args.timeout, threads)
        else:
            result = run_seed(args.config, warmup["seed"], out_root / label,
                              [*overrides, f"checkpoint.resume={warmup['checkpoint']}"], args.timeout, threads)
        print(f"{'seed ' if warmup is None else ''}{label} done in {result[1]:.0f}s", flush=True)
        return result

    with ThreadPoolExecutor(max_workers=jobs) as pool:
        results = dict(zip(labels, pool.map(one, labels)))
    rows, per_run = [], {}
    for label, (summary, wall) in results.items():
        before, after = task_success(summary, "before_rl"), task_success(summary, "after_rl")
        lo_hi = {"before": task_interval(summary, "before_rl"), "after": task_interval(summary, "after_rl")}
        run_dir = out_root / (f"seed{label}" if warmup is None else label)
        per_run[label] = {"before": before, "after": after, "interval_95": lo_hi, "wall_s": wall,
                          "rl_wall_s": summary.get("rl_wall_s"), "threads": threads,
                          "collapse_steps": collapse_steps(run_dir)}
        for task in sorted(before):
            rows.append((label, task, before[task], after[task]))

        print(f"{'seed ' if warmup is None else ''}{label}: {wall:.0f}s | " + ", ".join(
            f"{t} {_rate(before[t], lo_hi['before'].get(t))} -> {_rate(after[t], lo_hi['after'].get(t))}"
            for t in sorted(before)) + f" | collapse alarm on {per_run[label]['collapse_steps']} steps", flush=True)

    tasks = sorted({r[1] for r in rows})
    gains = {t: 100 * mean(a - b for _, task, b, a in rows if task == t) for t in tasks}
    worst = {t: 100 * min(a - b for _, task, b, a in rows if task == t) for t in tasks}
    worst_of = "worst seed" if warmup is None else "worst run"
    print(f"\n{'task':<10}{'before RL %':>13}{'after RL %':>12}{'mean gain':>11}{worst_of:>12}  (points)")
    for t in tasks:
        b = 100 * mean(r[2] for r in rows if r[1] == t)
        a = 100 * mean(r[3] for r in rows if r[1] == t)
        print(f"{t:<10}{b:>13.1f}{a:>12.1f}{gains[t]:>11.1f}{worst[t]:>12.1f}")
    runs = {"per_seed": per_run} if warmup is None else {"warmup": warmup, "per_run": per_run}
    result = {"config": args.config, "smoke": args.smoke, "seeds": seeds if warmup is None else [warmup["seed"]],
              "overrides": overrides, "jobs": jobs, "threads_per_run": threads, **runs, "mean_gain_points": gains,
              "worst_seed_gain_points": worst, "demo_min_task_gain_points": min(gains.values()),
              "commit": git_commit(), "machine": {"cpus": os.cpu_count(), "platform": platform.platform()},
              "date": time.strftime("%Y-%m-%d")}
    print(f"results: {write_record(args.out, result)}")
    print(f"demo_min_task_gain_points: {min(gains.values()):.1f}")


if __name__ == "__main__":
    main()
