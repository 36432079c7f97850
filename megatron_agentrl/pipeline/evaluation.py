"""Evaluation on the held-out samples of every task, and the before/after table of a run."""
from __future__ import annotations

import asyncio
import io
from typing import Any

from megatron_agentrl.config import Config
from megatron_agentrl.pipeline.batch import per_task_means
from megatron_agentrl.pipeline.progress import Phase, Progress
from megatron_agentrl.pipeline.rollout_side import RolloutSide, sampling_params
from rollout_sglang.agent_loop import run_group_lockstep
from rollout_sglang.engine import GenerationOutput, SamplingParams


class _TurnCounter:
    """An engine seen through a lockstep evaluation: each ``generate`` call is one turn of the episodes
    still running, reported to the phase."""

    def __init__(self, engine: Any, phase: Phase) -> None:
        self.engine, self.phase = engine, phase
        self.turns = 0

    @property
    def version(self) -> int:
        """The engine's weight version."""
        return int(self.engine.version)

    async def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[GenerationOutput]:
        """The engine's ``generate``; counts the turn first."""
        self.turns += 1
        self.phase.update(self.turns, {"episodes running": str(len(prompts))})
        return await self.engine.generate(prompts, params)


def evaluate(cfg: Config, ro: RolloutSide, seed: int, progress: Progress | None = None,
             title: str = "evaluation") -> dict[str, float]:
    """Per-task mean reward and success (``reward/<task>``, ``success/<task>``) on the held-out
    indices, newest live weights, no simulated latency. Rank 0 only. ``progress`` shows the turns
    as they run and logs one line at the end (the success per task)."""
    reqs = [(task, i, n) for n, (task, i) in enumerate((t, i) for t, idx in ro.eval_indices.items() for i in idx)]
    if not reqs:
        return {}
    with (progress or Progress(enabled=False)).phase(title, cfg.rollout.max_turns, unit="turns", lines=1) as phase:
        trajs = asyncio.run(run_group_lockstep(
            _TurnCounter(ro.latest_engine(), phase), ro.env, ro.template, reqs,
            sampling_params(cfg, ro, cfg.eval.temperature, seed), max_turns=cfg.rollout.max_turns,
            max_total_tokens=cfg.rollout.max_total_tokens, env_timeout_s=cfg.pipeline.env_timeout_s,
        ))
        result = per_task_means(trajs)
        turns = max((len(t.versions) for t in trajs), default=0)
        phase.update(figures={"success": format_success(result)},
                     done=f"{len(trajs)} episodes (longest {turns} turn{'s' if turns != 1 else ''})")
    return result


def format_success(m: dict[str, float]) -> str:
    """``lookup 50%, calc 10%`` from an evaluation's ``success/<task>`` entries."""
    return ", ".join(f"{k.split('/', 1)[1]} {100 * v:.0f}%" for k, v in m.items() if k.startswith("success/"))


def final_table(before: dict[str, float], after: dict[str, float], task_names: list[str]) -> str:
    """The per-task success before and after RL as a text table (rich)."""
    from rich.console import Console
    from rich.table import Table

    table = Table(title="Per-task success on held-out samples")
    for col in ("task", "before RL", "after RL", "change (points)"):
        table.add_column(col, justify="right" if col != "task" else "left")
    for t in task_names:
        b, a = before.get(f"success/{t}"), after.get(f"success/{t}")
        fmt = lambda x: "-" if x is None else f"{100 * x:.1f}%"  # noqa: E731
        diff = "-" if a is None or b is None else f"{100 * (a - b):+.1f}"
        table.add_row(t, fmt(b), fmt(a), diff)
    console = Console(file=io.StringIO(), width=100)
    console.print(table)
    return console.file.getvalue()
