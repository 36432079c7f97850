#!/usr/bin/env python
"""Asynchronous vs synchronous GRPO pipeline: trained samples per second, side by side in one process.

Both modes run ``megatron_agentrl.pipeline.loop.run_training`` on the same tiny model (same seed,
same random initialisation), the same multi-turn workload with heavy-tailed environment latency,
and the same number of trained samples (``train.steps`` x ``rollout.prompts_per_step`` x
``rollout.samples_per_prompt``). Every setting that matters is set here, not taken from the demo config
(``key=value`` arguments override them, in both modes): one version slot with on-policy sampling
(``rollout.max_versions=1``, ``rollout.cross_policy=latest``) in both modes, no warm-up, no
evaluation, no checkpoint. Only ``pipeline.mode`` (and its ``pipeline.staleness``) differs:

* ``sync``: a step's groups start once the previous step's weights are loaded, run their turns in
  lockstep (one batched generate per turn), the trainer waits for the slowest episode, trains,
  pushes weights;
* ``async``: the rollout keeps up to ``(staleness + 1)`` steps of groups in flight (each group on
  its own, generate calls merged by the batching engine) while the trainer trains on the groups
  that finished, within the staleness cap.

The workload ("dialog", registered for this process only): every episode asks for 2..max_turns
assistant turns (by sample index) and answers each with a short user message; the reward is 1 when
the last assistant turn holds a digit. It is multi-turn whatever the (untrained) policy writes.
Every env call (start and each turn) first waits a Pareto(``pipeline.sim_env_latency_alpha``) delay with
minimum ``pipeline.sim_env_latency_s`` seconds, capped at ``pipeline.sim_env_latency_max_s``.

Throughput = trained samples / wall seconds of the RL phase (first step to last step, no
evaluation). ``--update-modes drain,retract,in_place`` runs the async mode once more per
``rollout.weight_update_mode`` and reports, beside its ratio to sync, the train-vs-rollout mismatch of its
trained tokens at version lag 0 and 1 (``mismatch/abs_lag<k>``, token-weighted over the run) and the share of
trained tokens sampled after an in-flight update crossed their turn. Prints a table, writes
``bench/results/async_vs_sync.json`` (``--out``); the last line
is ``async_speedup: <async / sync throughput>``. ``--smoke``: 2 steps of 2 groups of 2 on a
one-layer model with short turns and 10 ms latencies, in seconds; its speedup means nothing.
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import platform
import re
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench._common import bench_parser, parse_bench_args, write_record  # noqa: E402
from env_controller.protocol import SampleStatus, TaskReply  # noqa: E402
from env_controller.tasks import TASKS  # noqa: E402
from env_controller.tasks.base import TaskSession, ToolTask  # noqa: E402
from env_controller.tasks.options import TaskOptions  # noqa: E402


class DialogSession(TaskSession):
    """Answers every assistant turn with a user message until ``turns`` turns were taken."""

    def __init__(self, index: int, turns: int) -> None:
        self.index, self.left = index, turns

    async def interact(self, assistant_message: dict[str, Any]) -> TaskReply:
        self.left -= 1
        if self.left <= 0:
            text = assistant_message.get("content") or ""
            r = 1.0 if re.search(r"\d", text) else 0.0
            return TaskReply(messages=[], status=SampleStatus.COMPLETED, finish=True, reward=r, metrics={"success": r})
        return TaskReply(messages=[{"role": "user", "content": f"Go on ({self.left} turns left); end with a number."}])

    async def close(self) -> None:
        return None


@dataclass
class DialogOptions(TaskOptions):
    """The dialog's params: ``max_turns`` is its longest episode (in assistant turns)."""

    KEY = "dialog"

    #: assistant turns of the longest episode (episodes take 2 .. max_turns)
    max_turns: int = 6


class DialogTask(ToolTask):
    """A multi-turn workload whose length does not depend on the policy (see the module doc)."""

    name = "dialog"
    Options = DialogOptions
    TOOLS = []  # plain-text turns: the episode never calls a tool

    def new_session(self, index: int) -> tuple[DialogSession, list[dict[str, Any]]]:  # type: ignore[override]
        turns = 2 + index % (self.max_turns - 1)
        return DialogSession(index, turns), [
            {"role": "user", "content": f"Sample {index}: let us talk for {turns} turns; end with a number."}]

    async def start(self, index: int) -> tuple[TaskSession, TaskReply]:
        self.check_index(index)
        session, messages = self.new_session(index)
        return session, TaskReply(messages=messages)  # no tools offered

    def expert(self, index: int) -> Any:
        raise NotImplementedError("dialog has no expert (the benchmark runs without SFT)")

    def demonstration(self, index: int) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
        raise NotImplementedError("dialog has no demonstrations (the benchmark runs without SFT)")


SMOKE = {"max_turns": 3, "hidden": 32}
SMOKE_OVERRIDES = ["train.steps=2", "rollout.prompts_per_step=2", "rollout.samples_per_prompt=2",
                   "pipeline.sim_env_latency_s=0.01", "pipeline.sim_env_latency_max_s=0.05",
                   "rollout.max_new_tokens=4", "model.arch.num_hidden_layers=1"]


def _overrides(args: argparse.Namespace, mode: str, out: Path, cohort: int = 0, update_mode: str = "") -> list[str]:
    """The config overrides of one mode's run (on top of the demo config, whose own choices do not count)."""
    staleness = args.staleness if mode == "async" else 0
    return [f"pipeline.cohort_groups={cohort}",
        f"output_dir={out}", f"pipeline.mode={mode}", f"pipeline.staleness={staleness}", "pipeline.queue_size=0",
        "rollout.max_versions=1", "rollout.engines_per_slot=1", "rollout.cross_policy=latest",
        "rollout.temperature=1.0", "checkpoint.interval=0", "parallel.tp=1", "parallel.pp=1",
        "pipeline.sim_env_latency_s=0.05", "pipeline.sim_env_latency_alpha=1.2", "pipeline.sim_env_latency_max_s=4",
        f"model.arch.hidden_size={args.hidden}", f"model.arch.intermediate_size={args.hidden * 3}",
        "model.arch.num_hidden_layers=2", "model.arch.num_attention_heads=4", "model.arch.num_key_value_heads=2",
        "sft.steps=0", "eval.samples_per_task=0", "train.steps=12", "train.micro_batch_size=8",
        "loss.tis_cap=2.0", "train.lr=1e-4", "train.seed=1234",
        "rollout.prompts_per_step=4", "rollout.samples_per_prompt=4",
        f"rollout.max_turns={args.max_turns}", "rollout.max_new_tokens=16", "rollout.max_total_tokens=1024",
        f"tasks=[{{name: dialog, params: {{max_turns: {args.max_turns}}}}}]",
        "log_every=1", *args.overrides,
        *([f"rollout.weight_update_mode={update_mode}"] if update_mode else []),
    ]


def run_mode(args: argparse.Namespace, mode: str, out: Path, cohort: int, update_mode: str = "") -> dict[str, Any]:
    """Train one mode into ``out``; its throughput (trained samples and tokens per RL second) and step means."""
    from megatron_agentrl.config import load_config
    from megatron_agentrl.pipeline.loop import run_training

    cfg = load_config(ROOT / "examples" / "configs" / "tiny_cpu.yaml", _overrides(args, mode, out, cohort, update_mode))
    os.chdir(ROOT)
    t0 = time.perf_counter()
    summary = run_training(cfg)
    total = time.perf_counter() - t0
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    rl = [r for r in rows if r.get("phase") == "rl"]

    def mean(key: str) -> float:
        return sum(r[key] for r in rl) / len(rl)

    def token_mean(key: str) -> float:  # a mismatch figure over the run's tokens at that lag (0 when none)
        n = sum(r.get(key.replace("abs_", "tokens_"), 0.0) for r in rl)
        return sum(r.get(key, 0.0) * r.get(key.replace("abs_", "tokens_"), 0.0) for r in rl) / n if n else 0.0

    return {
        "trained_samples": summary["trained_samples"],
        "trained_tokens": summary["trained_tokens"],
        "rl_wall_s": summary["rl_wall_s"],
        "samples_per_s": summary["samples_per_s"],
        "tokens_per_s": summary["trained_tokens"] / summary["rl_wall_s"],
        "run_wall_s": total,
        "mean_step_s": mean("step_time_s"),
        "mean_wait_batch_s": mean("wait_batch_s"),
        "mean_train_s": mean("train_time_s"),
        "mean_turns": mean("mean_turns"),
        "staleness_mean": mean("staleness_mean"),
        "staleness_max": max(r["staleness_max"] for r in rl),
        "trainer_idle_frac": mean("trainer_idle_frac"),
        "engine_idle_frac": mean("engine_idle_frac"),
        "dropped_stale": summary["dropped_stale"],
        "weight_update_mode": cfg.rollout.weight_update_mode,
        "mismatch_abs_lag0": token_mean("mismatch/abs_lag0"),
        "mismatch_abs_lag1": token_mean("mismatch/abs_lag1"),
        "in_flight_tokens_frac": sum(r["in_flight/tokens"] for r in rl) / max(summary["trained_tokens"], 1),
    }


def main(argv: list[str] | None = None) -> int:
    """Run sync, async (and with ``--sync-independent`` sync with independent groups); print, write the JSON."""
    p = bench_parser("async_vs_sync", __doc__)
    p.add_argument("--staleness", type=int, default=1, help="pipeline.staleness of the async mode (sync: 0)")
    p.add_argument("--max-turns", type=int, default=6, help="rollout.max_turns, and the dialog's longest episode")
    p.add_argument("--hidden", type=int, default=64, help="model.arch.hidden_size (the MLP's: three times it)")
    p.add_argument("--sync-independent", action="store_true",
                   help="also run sync with every group on its own (pipeline.cohort_groups=1) instead of the whole "
                        "step in lockstep, and report its ratio too")
    p.add_argument("--update-modes", default="",
                   help="comma-separated rollout.weight_update_mode values: the async mode also runs once with each "
                        "(its samples/s against sync, the train-vs-rollout mismatch at lag 0 and 1)")
    p.add_argument("-v", "--verbose", action="store_true", help="show the training log")
    p.add_argument("overrides", nargs="*", help="key=value config overrides of both modes (after the bench's own)")
    args = parse_bench_args(p, argv, SMOKE)
    if args.smoke:
        args.overrides = [*SMOKE_OVERRIDES, *args.overrides]

    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, format="%(asctime)s %(message)s",
                        datefmt="%H:%M:%S", stream=sys.stdout, force=True)
    import warnings

    warnings.filterwarnings("ignore")
    TASKS[DialogTask.name] = DialogTask  # this process only

    results: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory(prefix="agentrl_bench_") as tmp:
        runs = [("sync", "sync", 0), ("async", "async", 0)]
        if args.sync_independent:
            runs.append(("sync_independent", "sync", 1))
        runs += [(f"async_{m}", "async", 0) for m in args.update_modes.split(",") if m.strip()]
        for name, mode, cohort in runs:
            out = Path(tmp) / name
            update_mode = name.removeprefix("async_") if name.startswith("async_") else ""
            results[name] = run_mode(args, mode, out, cohort, update_mode)
    s, a = results["sync"], results["async"]
    speedup = a["samples_per_s"] / s["samples_per_s"]
    cols = ["trained_samples", "rl_wall_s", "samples_per_s", "tokens_per_s", "mean_step_s", "mean_wait_batch_s",
            "mean_train_s", "mean_turns", "staleness_mean", "staleness_max", "trainer_idle_frac", "engine_idle_frac",
            "dropped_stale", "mismatch_abs_lag0", "mismatch_abs_lag1", "in_flight_tokens_frac"]
    names = list(results)
    print(f"{'metric':<20}" + "".join(f"{n:>18}" for n in names))
    for c in cols:
        print(f"{c:<20}" + "".join(f"{results[n][c]:>18.3f}" if isinstance(results[n][c], float)
                                   else f"{results[n][c]:>18}" for n in names))
    extra = {}
    for name in (n for n in results if n.startswith("async_")):
        ratio = results[name]["samples_per_s"] / s["samples_per_s"]
        extra[f"async_speedup_{name.removeprefix('async_')}"] = ratio
        print(f"{name} / sync: {ratio:.2f}")
    if "sync_independent" in results:
        extra["async_speedup_vs_sync_independent"] = a["samples_per_s"] / results["sync_independent"]["samples_per_s"]
        print(f"async / sync_independent: {extra['async_speedup_vs_sync_independent']:.2f}")
    try:
        load = os.getloadavg()
    except OSError:
        load = (float("nan"),) * 3
    record = {
        "benchmark": "async_vs_sync", "time": time.strftime("%Y-%m-%dT%H:%M:%S"), "args": vars(args),
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "loadavg_at_end": load},
        "results": results, "async_speedup": speedup, **extra,
    }
    write_record(args.out, record)
    print(f"load average at end: {load[0]:.2f} {load[1]:.2f} {load[2]:.2f} ({os.cpu_count()} CPUs) | "
          f"results: {args.out}")
    print(f"async_speedup: {speedup:.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
