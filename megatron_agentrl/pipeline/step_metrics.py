"""The record of one RL step (what metrics.jsonl and TensorBoard get) and its console line."""
from __future__ import annotations

from typing import Any

from megatron_agentrl.config import Config
from megatron_agentrl.metrics import gpu_stats
from megatron_agentrl.pipeline.batch import RLBatch, distill_metrics, per_task_means
from rollout_sglang.rollout.manager import FinishedGroup, RolloutManager
from rollout_sglang.trajectory import Trajectory


def step_metrics(step: int, groups: list[FinishedGroup], stats: dict[str, float], batch: RLBatch, max_staleness: int,
                 times: dict[str, float], manager: RolloutManager,
                 busy_delta: float) -> tuple[dict[str, float], list[int]]:
    """The metrics of RL step ``step`` (trained on weight version ``step - 1``) and the staleness of
    each trained sample (versions between the trainer and the oldest turn).

    groups: the step's groups; stats: the trainer's; batch: the step's RL batch (its ``[B]`` shaped
    ``rewards`` and ``sample_adv``); max_staleness: the staleness cap (``staleness/<k>`` for k <= max_staleness);
    times: seconds of ``wait_batch_s``, ``train_time_s``, ``weight_sync_s``, ``step_time_s``; busy_delta: engine
    seconds spent generating during the step.

    With dynamic sampling, ``reward/<task>`` and ``success/<task>`` also count the zero-variance groups
    dropped since the previous step (every finished episode: a task whose groups all fail must still show
    0, for the curve and the collapse alarm), and :func:`dynamic_sampling_metrics` are added. With routing
    capture, ``routing/captured_frac`` is the share of the step's trajectories that carry the engines' routing.
    """
    trajs: list[Trajectory] = [t for g in groups for t in g.trajectories]
    finished = trajs
    if manager.dynamic_sampling:
        trained = {id(g) for g in groups}
        finished = trajs + [t for g in manager.last_batch.get("dropped_groups", []) if id(g) not in trained
                            for t in g.trajectories]
    version = step - 1
    staleness = [version - (g.start_version if t.oldest_version is None else t.oldest_version)
                 for g in groups for t in g.trajectories]
    nversions = [len(set(t.sampled_versions)) for t in trajs]
    crossed = [t.tokens_after_update for t in trajs]
    gen_tokens = sum(t.num_generated for t in trajs)
    train_tokens = sum(len(t.token_ids) for t in trajs)
    rollout_s = sum(g.t_end - g.t_start for g in groups) / len(groups)
    queued, running = manager.depth()
    step_s = times["step_time_s"]
    metrics: dict[str, float] = {
        **per_task_means(finished),
        **stats,
        **times,
        "reward_shaped_mean": float(batch.rewards.mean()),
        "adv_abs_mean": float(batch.sample_adv.abs().mean()),
        "gen_tokens_per_s": gen_tokens / max(rollout_s, 1e-9),
        "train_tokens_per_s": train_tokens / max(times["train_time_s"], 1e-9),
        "trained_tokens_per_s": train_tokens / max(step_s, 1e-9),
        "rollout_time_s": rollout_s,
        "mean_turns": sum(t.num_turns for t in trajs) / len(trajs),
        "mean_generated_tokens": gen_tokens / len(trajs),
        "train_tokens": float(train_tokens),
        "traj_tokens_min": float(min(len(t.token_ids) for t in trajs)),
        "traj_tokens_max": float(max(len(t.token_ids) for t in trajs)),
        "staleness_mean": sum(staleness) / len(staleness),
        "staleness_max": float(max(staleness)),
        "versions_per_traj_mean": sum(nversions) / len(nversions),
        "versions_per_traj_max": float(max(nversions)),
        "in_flight/samples": float(sum(1 for n in crossed if n)),
        "in_flight/tokens": float(sum(crossed)),
        "queue_depth": float(queued),
        "groups_running": float(running),
        "groups_started": float(manager.stats.started),
        "dropped_stale": float(manager.stats.dropped_stale),
        "trainer_idle_frac": min(1.0, times["wait_batch_s"] / max(step_s, 1e-9)),
        "engine_idle_frac": max(0.0, 1.0 - busy_delta / max(step_s, 1e-9)),
        **gpu_stats(),
    }
    for k in range(max_staleness + 1):
        metrics[f"staleness/{k}"] = sum(1 for s in staleness if s == k) / len(staleness)
    if manager.capture_routing:  # an engine that returns no routing leaves its episodes on the trainer's own
        metrics["routing/captured_frac"] = sum(t.routed_experts is not None for t in trajs) / len(trajs)
    metrics.update(distill_metrics(batch, manager.sampler.tasks, trajs))
    metrics.update(infra_metrics(manager))
    if manager.dynamic_sampling:
        metrics.update(dynamic_sampling_metrics(manager))
    return metrics, staleness


def infra_metrics(manager: RolloutManager) -> dict[str, float]:
    """The step's infrastructure failures since the previous step (``manager.last_batch``), none of them
    trained: ``infra/failed_<task>`` (episodes, every task), ``infra/groups_retried`` (groups re-run) and
    ``infra/groups_dropped`` (groups given up after their attempts)."""
    last = manager.last_batch
    failed = last.get("infra_failed", {})
    metrics = {f"infra/failed_{task}": float(failed.get(task, 0)) for task in manager.sampler.tasks}
    metrics["infra/groups_retried"] = float(last.get("infra_retried", 0))
    metrics["infra/groups_dropped"] = float(sum(last.get("infra_dropped", {}).values()))
    return metrics


def engine_metrics(pool: Any, publisher: Any) -> dict[str, float]:
    """Engines coming and going, as counts over the run so far: ``engines/out_of_rotation`` (now: down, or
    back and waiting for weights), ``engines/failures`` (taken out of rotation), ``engines/returns``,
    ``engines/rerouted_prompts`` (generated again on another engine), ``weight_sync/failed`` and
    ``weight_sync/skipped`` (no engine reachable)."""
    return {"engines/out_of_rotation": float(pool.engines_out()),
            "engines/failures": float(pool.stats["engine_failures"]),
            "engines/returns": float(pool.stats["engine_returns"]),
            "engines/rerouted_prompts": float(pool.stats["rerouted"]),
            "weight_sync/failed": float(publisher.failed_syncs),
            "weight_sync/skipped": float(publisher.skipped_syncs)}


def dynamic_sampling_metrics(manager: RolloutManager) -> dict[str, float]:
    """The step's dynamic-sampling figures (from ``manager.last_batch``): ``dynamic_sampling/dropped_<task>``
    (zero-variance groups dropped since the previous step, every task), ``dynamic_sampling/groups_drawn``
    (prompts drawn since the previous step), ``dynamic_sampling/batch_groups`` (groups trained),
    ``dynamic_sampling/short_slots`` (of the batch's ``prompts_per_step`` slots, those without a group with
    signal) and ``dynamic_sampling/fallback`` (1: every group of the batch had zero variance; it trained on
    them, with advantage 0)."""
    last = manager.last_batch
    metrics = {f"dynamic_sampling/dropped_{task}": float(last.get("dropped", {}).get(task, 0))
               for task in manager.sampler.tasks}
    metrics.update({"dynamic_sampling/groups_drawn": float(last.get("drawn", 0)),
                    "dynamic_sampling/batch_groups": float(last.get("groups", 0)),
                    "dynamic_sampling/short_slots": float(last.get("short", 0)),
                    "dynamic_sampling/fallback": float(last.get("fallback", 0.0))})
    return metrics


def format_step(step: int, cfg: Config, metrics: dict[str, float]) -> str:
    """The console line of RL step ``step`` from its ``metrics`` (the async pipeline's figures too)."""
    rewards = " ".join(f"{k.split('/', 1)[1]} {v:.2f}" for k, v in metrics.items() if k.startswith("reward/"))
    line = (
        f"step {step}/{cfg.train.steps} | reward {rewards} | gen {metrics['gen_tokens_per_s']:.0f} tok/s "
        f"train {metrics['train_tokens_per_s']:.0f} tok/s | step {metrics['step_time_s']:.1f}s "
        f"(wait {metrics['wait_batch_s']:.1f} train {metrics['train_time_s']:.1f} "
        f"sync {metrics['weight_sync_s']:.2f}) | loss {metrics['loss']:+.4f} clip {metrics.get('clip_frac', 0):.3f}"
    )
    if "dynamic_sampling/groups_drawn" in metrics:
        dropped = sum(v for k, v in metrics.items() if k.startswith("dynamic_sampling/dropped_"))
        line += (f" | groups {metrics['dynamic_sampling/batch_groups']:.0f} "
                 f"drawn {metrics['dynamic_sampling/groups_drawn']:.0f} flat {dropped:.0f}")
    failed = sum(v for k, v in metrics.items() if k.startswith("infra/failed_"))
    if failed or metrics.get("infra/groups_dropped"):
        line += (f" | infra-failed episodes {failed:.0f} (not trained), groups re-run "
                 f"{metrics.get('infra/groups_retried', 0):.0f} dropped {metrics.get('infra/groups_dropped', 0):.0f}")
    if cfg.pipeline.mode == "async":
        line += (f" | stale mean {metrics['staleness_mean']:.2f} max {metrics['staleness_max']:.0f} "
                 f"| queue {metrics['queue_depth']:.0f} running {metrics['groups_running']:.0f} "
                 f"| idle trainer {100 * metrics['trainer_idle_frac']:.0f}% "
                 f"engine {100 * metrics['engine_idle_frac']:.0f}%")
    return line
