"""Evaluation on the held-out samples of every task, and the before/after table of a run.

:func:`evaluate` plays the held-out samples before and after RL (nothing else runs then);
:func:`evaluate_during_rl` is the periodic evaluation (``eval.interval``), a coroutine for the rollout
thread's event loop that plays them beside the training rollouts, every turn on the newest live weights.
With ``rollout.agent: gateway`` the user's agent function plays them, as it plays the training episodes.
"""
from __future__ import annotations

import asyncio
import io
import math
import time
from collections import Counter
from typing import Any

from megatron_agentrl.config import Config
from megatron_agentrl.pipeline.batch import per_task_means
from megatron_agentrl.pipeline.progress import Phase, Progress
from megatron_agentrl.pipeline.rewards import is_success
from megatron_agentrl.pipeline.rollout_side import (
    RolloutSide,
    build_eval_agent_runner,
    episode_options,
    sampling_params,
)
from rollout_sglang.agent_loop import run_group_lockstep
from rollout_sglang.engines.protocol import GenerationOutput, SamplingParams
from rollout_sglang.trajectory import Trajectory


class _TurnCounter:
    """An engine seen through an evaluation: each ``generate`` call is one turn of the episodes still
    running (lockstep), or one completion of one episode (the user's agent), reported to the phase."""

    def __init__(self, engine: Any, phase: Phase) -> None:
        self.engine, self.phase = engine, phase
        self.turns = 0

    @property
    def version(self) -> int:
        """The engine's weight version."""
        return int(self.engine.version)

    async def generate(self, prompts: list[list[int]], params: SamplingParams,
                       seeds: list[int | None] | None = None) -> list[GenerationOutput]:
        """The engine's ``generate`` (``seeds``: each row's, as ``Engine.generate``); counts the turn first."""
        self.turns += 1
        self.phase.update(self.turns, {"episodes running": str(len(prompts))})
        return await self.engine.generate(prompts, params, seeds=seeds)


class _NewestWeights:
    """The version pool seen by an evaluation: every turn goes to the newest live weights through the pool's
    router (``newest=True`` whatever the sampling policy), so it holds a lease (a weight update drains it
    before pausing the slot: no half-loaded weights, no request aborted by an SGLang pause) and a turn whose
    engine fails is generated again on another.
    """

    def __init__(self, rollout_side: RolloutSide) -> None:
        self.rollout_side = rollout_side

    @property
    def version(self) -> int:
        """The newest live weight version."""
        return int(self.rollout_side.pool.latest_version)

    async def generate(self, prompts: list[list[int]], params: SamplingParams,
                       seeds: list[int | None] | None = None) -> list[GenerationOutput]:
        """One turn of the episodes still running, on the newest live weights (``seeds``: each row's)."""
        return await self.rollout_side.pool.generate(prompts, params, newest=True, seeds=seeds)


def _requests(rollout_side: RolloutSide) -> list[tuple[str, int, int]]:
    """``(task, index, episode number)`` of every held-out sample."""
    held_out = ((t, i) for t, idx in rollout_side.eval_indices.items() for i in idx)
    return [(task, i, n) for n, (task, i) in enumerate(held_out)]


async def _play(cfg: Config, rollout_side: RolloutSide, engine: Any, seed: int) -> list[Trajectory]:
    """The held-out episodes on ``engine`` at ``eval.temperature``: in lockstep by the agent loop, or with
    ``rollout.agent: gateway`` each by the user's agent function (one trajectory per episode: its last
    segment, which carries the episode's ending)."""
    requests, params = _requests(rollout_side), sampling_params(cfg, rollout_side.template, cfg.eval.temperature, seed)
    if cfg.rollout.agent == "gateway":
        runner = build_eval_agent_runner(cfg, rollout_side, engine, len(requests))
        try:
            trajs = await runner.run_group(requests, params)
        finally:
            await runner.aclose()
        return list({t.group_id: t for t in trajs}.values())
    return await run_group_lockstep(engine, rollout_side.env, rollout_side.template, requests, params,
                                    episode_options(cfg))


def eval_metrics(trajs: list[Trajectory]) -> dict[str, float]:
    """Per task: ``reward/``, ``success/``, ``episodes/``, ``success_low/``, ``success_high/`` (95 % Wilson),
    ``gen_tokens/`` (tokens the policy generated per episode, mean) and ``gen_logprob/`` (the log-probability of
    a generated token under the engine that sampled it, mean over the task's generated tokens) over the valid
    episodes, and ``infra_failed/`` (episodes that ended for an infrastructure reason: left out of the others,
    since their outcome says nothing of the policy)."""
    valid = [t for t in trajs if not t.infra_failed]
    result = per_task_means(valid)
    episodes, successes = Counter(t.task for t in valid), Counter(t.task for t in valid if is_success(t))
    generated: Counter[str] = Counter()
    logprob: dict[str, float] = {}
    for t in valid:
        generated[t.task] += t.num_generated
        logprob[t.task] = logprob.get(t.task, 0.0) + math.fsum(
            lp for lp, m in zip(t.behavior_logprobs, t.loss_mask) if m)
    failed = Counter(t.task for t in trajs if t.infra_failed)
    for task in sorted(set(episodes) | set(failed)):
        n = episodes[task]
        if n:
            low, high = wilson_interval(successes[task], n)
            result.update({f"success_low/{task}": low, f"success_high/{task}": high,
                           f"gen_tokens/{task}": generated[task] / n,
                           f"gen_logprob/{task}": logprob[task] / generated[task] if generated[task] else 0.0})
        result.update({f"episodes/{task}": float(n), f"infra_failed/{task}": float(failed[task])})
    return result


def evaluate(cfg: Config, rollout_side: RolloutSide, seed: int, progress: Progress | None = None,
             title: str = "evaluation") -> dict[str, float]:
    """Per-task mean reward and success (``reward/<task>``, ``success/<task>``) on the held-out
    indices, with the episode count (``episodes/<task>``) and the 95 % Wilson interval of the success
    rate (``success_low/<task>``, ``success_high/<task>``); newest live weights, no simulated
    latency. Rank 0 only, while no rollout runs (its own event loop). ``progress`` shows the turns as
    they run and logs one line at the end (the success per task with its interval)."""
    if not _requests(rollout_side):
        return {}
    agent = cfg.rollout.agent == "gateway"  # completions of many episodes, not lockstep turns: no fixed total
    with (progress or Progress(enabled=False)).phase(title, None if agent else cfg.rollout.max_turns,
                                                     unit="completions" if agent else "turns", lines=1) as phase:
        trajs = asyncio.run(_play(cfg, rollout_side, _TurnCounter(_NewestWeights(rollout_side), phase), seed))
        result = eval_metrics(trajs)
        turns = max((t.num_turns for t in trajs), default=0)
        phase.update(figures={"success": format_success(result)},
                     done=f"{len(trajs)} episodes (longest {turns} turn{'s' if turns != 1 else ''})")
    return result


async def evaluate_during_rl(cfg: Config, rollout_side: RolloutSide, seed: int) -> dict[str, float]:
    """The periodic evaluation: :func:`evaluate`'s entries plus ``eval_time_s`` and the weight versions
    that sampled its turns (``version_start``: the newest live version when it began, ``version_min``,
    ``version_max``; in async mode an evaluation can span weight updates). A coroutine for the rollout
    thread's event loop (``RolloutManager.submit``); ``{}`` without held-out samples."""
    if not _requests(rollout_side):
        return {}
    t0 = time.perf_counter()
    engine = _NewestWeights(rollout_side)
    start = engine.version
    trajs = await _play(cfg, rollout_side, engine, seed)
    versions = [v for t in trajs for v in t.sampled_versions] or [start]
    return {**eval_metrics(trajs), "eval_time_s": time.perf_counter() - t0, "version_start": float(start),
            "version_min": float(min(versions)), "version_max": float(max(versions))}


def wilson_interval(successes: int, n: int, z: float = 1.96) -> tuple[float, float]:
    """The Wilson score interval of a success rate from ``successes`` of ``n`` trials (in [0, 1];
    z = 1.96: 95 %); ``(0, 1)`` when ``n`` is 0. Unlike the normal approximation it stays inside
    [0, 1] and keeps its width at 0 or n successes."""
    if n <= 0:
        return 0.0, 1.0
    p = successes / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return max(0.0, centre - half), min(1.0, centre + half)


#: a task whose success rate is below this (the top of its 95 % interval) gives GRPO almost no group with a success
NO_SIGNAL_SUCCESS = 0.05


def no_signal_warnings(m: dict[str, float]) -> list[str]:
    """A warning for each task of the evaluation before RL ``m`` whose success rate is surely below
    ``NO_SIGNAL_SUCCESS`` (the top of its 95 % interval is): from there a group of samples almost never holds a
    success to learn from. Each names the task, its count and the ways forward."""
    out = []
    for key, high in m.items():
        if not key.startswith("success_high/") or high >= NO_SIGNAL_SUCCESS:
            continue
        task = key.split("/", 1)[1]
        n = m[f"episodes/{task}"]
        out.append(f"task {task} succeeds in {m[f'success/{task}'] * n:.0f} of {n:.0f} held-out episodes before RL "
                   f"(at most {100 * high:.1f} %, 95 % interval): GRPO learns from groups whose rewards differ, and "
                   "from here its groups almost never hold a success, so RL may not move it. A stronger start helps "
                   "(more or better warm-up, sft.steps; another train.seed for a scripted warm-up), as do more "
                   "samples per group (rollout.samples_per_prompt) or a reward that credits partial progress")
    return out


def _success_text(m: dict[str, float], task: str) -> str:
    """``50.0% (43.1-56.9)``: a task's success with its interval when the evaluation has one."""
    text = f"{100 * m[f'success/{task}']:.1f}%"
    if f"success_low/{task}" in m:
        text += f" ({100 * m[f'success_low/{task}']:.0f}-{100 * m[f'success_high/{task}']:.0f})"
    return text


def format_success(m: dict[str, float]) -> str:
    """``lookup 50.0% (43-57), calc 10.0% (6-15)`` from an evaluation's entries, and the episodes left out
    for infrastructure failures when there were any."""
    tasks = [k.split("/", 1)[1] for k in m if k.startswith("success/")]
    text = ", ".join(f"{t} {_success_text(m, t)}" for t in tasks)
    failed = {k.split("/", 1)[1]: int(v) for k, v in m.items() if k.startswith("infra_failed/") and v}
    if failed:
        text += " (left out, infrastructure failures: " + ", ".join(f"{t} {n}" for t, n in failed.items()) + ")"
    return text


def success_table(evals: dict[str, dict[str, float]], task_names: list[str],
                  title: str = "Per-task success on held-out samples (95 % interval)") -> str:
    """The per-task success of one or more evaluations (a column each, named by ``evals``' keys, in order) as a
    text table (rich); with two or more, the change from the first to the last in points."""
    from rich.console import Console
    from rich.table import Table

    names, columns = list(evals), list(evals.values())
    table = Table(title=title)
    for col in ("task", "episodes", *names, *(["change (points)"] if len(columns) > 1 else [])):
        table.add_column(col, justify="right" if col != "task" else "left")
    for t in task_names:
        n = next((m[f"episodes/{t}"] for m in reversed(columns) if f"episodes/{t}" in m), None)
        cells = ["-" if f"success/{t}" not in m else _success_text(m, t) for m in columns]
        if len(columns) > 1:
            first, last = columns[0].get(f"success/{t}"), columns[-1].get(f"success/{t}")
            cells.append("-" if first is None or last is None else f"{100 * (last - first):+.1f}")
        table.add_row(t, "-" if n is None else f"{n:.0f}", *cells)
    console = Console(file=io.StringIO(), width=100)
    console.print(table)
    return console.file.getvalue()


def final_table(before: dict[str, float], after: dict[str, float], task_names: list[str]) -> str:
    """The per-task success before and after RL as a text table (rich)."""
    return success_table({"before RL": before, "after RL": after}, task_names)
