"""The record of one RL step (what metrics.jsonl and TensorBoard get) and its console line."""
from __future__ import annotations

import torch

from megatron_agentrl.config import Config
from megatron_agentrl.metrics import gpu_stats
from megatron_agentrl.pipeline.batch import per_task_means
from megatron_agentrl.pipeline.rollout_manager import FinishedGroup, RolloutManager
from rollout_sglang.trajectory import Trajectory


def step_metrics(step: int, groups: list[FinishedGroup], stats: dict[str, float], rewards: torch.Tensor,
                 sample_adv: torch.Tensor, eta: int, times: dict[str, float], manager: RolloutManager,
                 busy_delta: float) -> tuple[dict[str, float], list[int]]:
    """The metrics of RL step ``step`` (trained on weight version ``step - 1``) and the staleness of
    each trained sample (versions between the trainer and the oldest turn).

    groups: the step's groups; stats: the trainer's; rewards, sample_adv: ``[B]`` shaped rewards
    and sample advantages; eta: the staleness cap (``staleness/<k>`` for k <= eta); times: seconds
    of ``wait_batch_s``, ``train_time_s``, ``weight_sync_s``, ``step_time_s``; busy_delta: engine
    seconds spent generating during the step.
    """
    trajs: list[Trajectory] = [t for g in groups for t in g.trajectories]
    version = step - 1
    staleness = [version - min(t.versions) if t.versions else version - g.start_version
                 for g in groups for t in g.trajectories]
    nversions = [len(set(t.versions)) for t in trajs]
    gen_tokens = sum(t.num_generated for t in trajs)
    train_tokens = sum(len(t.token_ids) for t in trajs)
    rollout_s = sum(g.t_end - g.t_start for g in groups) / len(groups)
    queued, running = manager.depth()
    step_s = times["step_time_s"]
    m: dict[str, float] = {
        **per_task_means(trajs),
        **stats,
        **times,
        "reward_shaped_mean": float(rewards.mean()),
        "adv_abs_mean": float(sample_adv.abs().mean()),
        "gen_tokens_per_s": gen_tokens / max(rollout_s, 1e-9),
        "train_tokens_per_s": train_tokens / max(times["train_time_s"], 1e-9),
        "trained_tokens_per_s": train_tokens / max(step_s, 1e-9),
        "rollout_time_s": rollout_s,
        "mean_turns": sum(len(t.versions) for t in trajs) / len(trajs),
        "mean_generated_tokens": gen_tokens / len(trajs),
        "train_tokens": float(train_tokens),
        "traj_tokens_min": float(min(len(t.token_ids) for t in trajs)),
        "traj_tokens_max": float(max(len(t.token_ids) for t in trajs)),
        "staleness_mean": sum(staleness) / len(staleness),
        "staleness_max": float(max(staleness)),
        "versions_per_traj_mean": sum(nversions) / len(nversions),
        "versions_per_traj_max": float(max(nversions)),
        "queue_depth": float(queued),
        "groups_running": float(running),
        "groups_started": float(manager.stats.started),
        "dropped_stale": float(manager.stats.dropped_stale),
        "trainer_idle_frac": min(1.0, times["wait_batch_s"] / max(step_s, 1e-9)),
        "engine_idle_frac": max(0.0, 1.0 - busy_delta / max(step_s, 1e-9)),
        **gpu_stats(),
    }
    for k in range(eta + 1):
        m[f"staleness/{k}"] = sum(1 for s in staleness if s == k) / len(staleness)
    return m, staleness


def format_step(step: int, cfg: Config, m: dict[str, float]) -> str:
    """The console line of RL step ``step`` from its metrics ``m`` (the async pipeline's figures too)."""
    rewards = " ".join(f"{k.split('/', 1)[1]} {v:.2f}" for k, v in m.items() if k.startswith("reward/"))
    line = (
        f"step {step}/{cfg.train.steps} | reward {rewards} | gen {m['gen_tokens_per_s']:.0f} tok/s "
        f"train {m['train_tokens_per_s']:.0f} tok/s | step {m['step_time_s']:.1f}s "
        f"(wait {m['wait_batch_s']:.1f} train {m['train_time_s']:.1f} sync {m['weight_sync_s']:.2f}) | "
        f"loss {m['loss']:+.4f} clip {m.get('clip_frac', 0):.3f}"
    )
    if cfg.pipeline.mode == "async":
        line += (f" | stale mean {m['staleness_mean']:.2f} max {m['staleness_max']:.0f} | queue {m['queue_depth']:.0f} "
                 f"running {m['groups_running']:.0f} | idle trainer {100 * m['trainer_idle_frac']:.0f}% "
                 f"engine {100 * m['engine_idle_frac']:.0f}%")
    return line
