#!/usr/bin/env python
"""Does the CPU demo learn? Per-task success after RL minus after the warm-up, over seeds.

Runs the demo (``agentrl train --config examples/configs/tiny_cpu.yaml``, the command behind
``make demo``) once per seed (``train.seed=<s>``: model initialisation, task draws, sampling), each
in its own process and output directory, and reads each run's ``summary.json``: per-task success
on the held-out evaluation samples right after the supervised warm-up (``before_rl``) and after
RL (``after_rl``), same samples, same sampling temperature. The gain of a task is the mean over
seeds of (after - before), in percentage points.

Prints a table per seed and the means, writes ``bench/results/demo_learning.json``; the last line
is ``demo_min_task_gain_points: <the smallest mean gain over the tasks>``.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path
from statistics import mean
from typing import Any

ROOT = Path(__file__).resolve().parent.parent


def run_seed(config: str, seed: int, out_dir: Path, overrides: list[str], timeout_s: float) -> tuple[dict[str, Any], float]:
    """Run the demo for one seed in a subprocess; returns (its summary.json, wall seconds)."""
    cmd = [sys.executable, "-m", "megatron_agentrl.cli", "train", "--config", config,
           f"train.seed={seed}", f"output_dir={out_dir}", *overrides]
    t0 = time.perf_counter()
    log = out_dir.with_suffix(".log")
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "w") as fh:
        try:
            proc = subprocess.run(cmd, cwd=ROOT, stdout=fh, stderr=subprocess.STDOUT, timeout=timeout_s)
        except subprocess.TimeoutExpired:
            raise SystemExit(f"seed {seed}: the demo ran past --timeout {timeout_s:.0f}s; its log is {log}")
    if proc.returncode != 0:
        raise SystemExit(f"seed {seed}: the demo failed (exit {proc.returncode}); its log is {log}")
    return json.loads((out_dir / "summary.json").read_text()), time.perf_counter() - t0


def task_success(summary: dict[str, Any], phase: str) -> dict[str, float]:
    """``{task: success in [0, 1]}`` of one phase (``before_rl`` | ``after_rl``) of a summary."""
    return {k.split("/", 1)[1]: v for k, v in summary[phase].items() if k.startswith("success/")}


def main() -> None:
    """Run the seeds, print the table, write the JSON, print the last line."""
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--config", default="examples/configs/tiny_cpu.yaml")
    p.add_argument("--seeds", default="1,2,3", help="comma-separated train.seed values")
    p.add_argument("--out", default="bench/results/demo_learning", help="per-seed output dirs go under here")
    p.add_argument("--timeout", type=float, default=1800.0, help="limit on one seed's run, seconds")
    p.add_argument("overrides", nargs="*", help="extra key=value config overrides for every seed")
    args = p.parse_args()
    seeds = [int(s) for s in args.seeds.split(",") if s.strip()]
    if not seeds:
        raise SystemExit(f"--seeds {args.seeds!r} names no seed; give e.g. --seeds 1,2,3")
    out_root = (ROOT / args.out).resolve()

    rows, per_seed = [], {}
    for seed in seeds:
        summary, wall = run_seed(args.config, seed, out_root / f"seed{seed}", args.overrides, args.timeout)
        before, after = task_success(summary, "before_rl"), task_success(summary, "after_rl")
        per_seed[seed] = {"before": before, "after": after, "wall_s": wall, "rl_wall_s": summary.get("rl_wall_s")}
        for task in sorted(before):
            rows.append((seed, task, before[task], after[task]))
        print(f"seed {seed}: {wall:.0f}s | " + ", ".join(
            f"{t} {100 * before[t]:.0f}% -> {100 * after[t]:.0f}%" for t in sorted(before)), flush=True)

    tasks = sorted({r[1] for r in rows})
    gains = {t: 100 * mean(a - b for _, task, b, a in rows if task == t) for t in tasks}
    print(f"\n{'task':<10}{'before RL %':>13}{'after RL %':>12}{'gain (points)':>15}")
    for t in tasks:
        b = 100 * mean(r[2] for r in rows if r[1] == t)
        a = 100 * mean(r[3] for r in rows if r[1] == t)
        print(f"{t:<10}{b:>13.1f}{a:>12.1f}{gains[t]:>15.1f}")
    result = {"config": args.config, "seeds": seeds, "overrides": args.overrides, "per_seed": per_seed,
              "mean_gain_points": gains, "demo_min_task_gain_points": min(gains.values()),
              "machine": {"cpus": os.cpu_count(), "platform": platform.platform()},
              "date": time.strftime("%Y-%m-%d")}
    out = ROOT / "bench" / "results" / "demo_learning.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    print(f"demo_min_task_gain_points: {min(gains.values()):.1f}")


if __name__ == "__main__":
    main()
