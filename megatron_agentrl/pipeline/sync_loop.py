"""The synchronous GRPO loop: sample groups, reward, advantages, train, push weights, repeat.

Every rank runs :func:`run_training`. Rank 0 owns the rollout side (the local engine and the
environments) and broadcasts each batch to the other ranks; all ranks train (tensor/pipeline
parallel, data-parallel ranks take their slice); the new weights go from the actor to the
engine through the Megatron -> Hugging Face name mapping after every step.
"""
from __future__ import annotations

import asyncio
import io
import json
import logging
import random
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from env_controller.local import LocalEnvClient
from env_controller.tasks import build_task
from megatron_agentrl.config import Config, ConfigError, config_to_dict
from megatron_agentrl.hf_io import load_hf_config, load_hf_weights, save_hf_checkpoint
from megatron_agentrl.megatron.actor import MegatronActor, TrainBatch
from megatron_agentrl.megatron.parallel import destroy_parallel, initialize_parallel
from megatron_agentrl.metrics import MetricsLogger, plot_task_rewards
from megatron_agentrl.pipeline.batch import build_rl_batch, build_sft_batch, per_task_means
from rollout_sglang.agent_loop import run_group_lockstep
from rollout_sglang.chat_template import ChatTemplate
from rollout_sglang.engine import SamplingParams
from rollout_sglang.local_engine import LocalEngine
from rollout_sglang.tokenizer import load_tokenizer
from rollout_sglang.trajectory import Trajectory

logger = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class RolloutSide:
    """What rank 0 holds for sampling: engine, environments, template, and the index splits."""

    engine: LocalEngine
    env: LocalEnvClient
    template: ChatTemplate
    tasks: dict[str, Any]
    train_indices: dict[str, list[int]]
    eval_indices: dict[str, list[int]]
    rng: random.Random
    weights: list[float] = field(default_factory=list)


def _is_rank0() -> bool:
    return not dist.is_initialized() or dist.get_rank() == 0


def _broadcast(obj: Any) -> Any:
    """Send a picklable object from rank 0 to every rank (identity on one process)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def _build_rollout(cfg: Config, tokenizer, hf_config, dtype) -> RolloutSide:
    tasks: dict[str, Any] = {}
    for spec in cfg.tasks:
        if spec.name in tasks:
            raise ConfigError(f"tasks: '{spec.name}' is listed twice; list each task once (use its weight to sample it more)")
        tasks[spec.name] = build_task(spec.name, **spec.params)
    train_idx, eval_idx = {}, {}
    for name, task in tasks.items():
        idx = list(task.indices())
        n_eval = cfg.eval.samples_per_task
        if n_eval >= len(idx):
            raise ConfigError(f"eval.samples_per_task={n_eval} leaves no training samples for task '{name}' ({len(idx)} samples); lower it")
        train_idx[name], eval_idx[name] = (idx[:-n_eval], idx[-n_eval:]) if n_eval else (idx, [])
    engine = LocalEngine(hf_config, dtype=dtype, device="cuda" if torch.cuda.is_available() else "cpu")
    return RolloutSide(
        engine=engine,
        env=LocalEnvClient(tasks),
        template=ChatTemplate(tokenizer),
        tasks=tasks,
        train_indices=train_idx,
        eval_indices=eval_idx,
        rng=random.Random(cfg.train.seed),
        weights=[s.weight for s in cfg.tasks],
    )


def _sampling(cfg: Config, ro: RolloutSide, temperature: float, seed: int) -> SamplingParams:
    return SamplingParams(
        max_new_tokens=cfg.rollout.max_new_tokens,
        temperature=temperature,
        top_p=cfg.rollout.top_p,
        stop_token_ids=list(ro.template.stop_token_ids),
        seed=seed,
    )


def _rollout(cfg: Config, ro: RolloutSide, requests: list[tuple[str, int, int]], temperature: float, seed: int) -> list[Trajectory]:
    return asyncio.run(
        run_group_lockstep(
            ro.engine, ro.env, ro.template, requests, _sampling(cfg, ro, temperature, seed),
            max_turns=cfg.rollout.max_turns, max_total_tokens=cfg.rollout.max_total_tokens,
        )
    )


def _sample_requests(cfg: Config, ro: RolloutSide, step: int) -> list[tuple[str, int, int]]:
    """``prompts_per_step`` (task, index) draws by task weight, each repeated ``samples_per_prompt`` times."""
    names = list(ro.tasks)
    reqs = []
    for p in range(cfg.rollout.prompts_per_step):
        task = ro.rng.choices(names, weights=ro.weights)[0]
        index = ro.rng.choice(ro.train_indices[task])
        group = step * cfg.rollout.prompts_per_step + p
        reqs += [(task, index, group)] * cfg.rollout.samples_per_prompt
    return reqs


def _push_weights(actor: MegatronActor, ro: RolloutSide | None, version: int) -> float:
    """Export the actor's weights (collective) and load them into the rank-0 engine; returns seconds."""
    t0 = time.perf_counter()
    state = actor.export_hf_state_dict()
    if ro is not None:
        ro.engine.load_state_dict(version, state)
    return time.perf_counter() - t0


def evaluate(cfg: Config, ro: RolloutSide, seed: int) -> dict[str, float]:
    """Per-task mean reward and success on the held-out indices (rank 0 only)."""
    reqs = [(task, i, n) for n, (task, i) in enumerate((t, i) for t, idx in ro.eval_indices.items() for i in idx)]
    if not reqs:
        return {}
    return per_task_means(_rollout(cfg, ro, reqs, cfg.eval.temperature, seed))


def _sft_warmup(cfg: Config, actor: MegatronActor, ro: RolloutSide | None, metrics: MetricsLogger | None) -> None:
    """Supervised steps on the tasks' scripted demonstrations (same token layout as RL turns)."""
    actor.set_lr(cfg.sft.lr)
    for step in range(1, cfg.sft.steps + 1):
        batch = None
        if ro is not None:
            names = list(ro.tasks)
            examples = []
            for _ in range(cfg.sft.batch_size):
                task = ro.rng.choices(names, weights=ro.weights)[0]
                messages, tools = ro.tasks[task].demonstration(ro.rng.choice(ro.train_indices[task]))
                examples.append(ro.template.encode_conversation(messages, tools))
            batch = build_sft_batch(examples)
        batch = _broadcast(batch)
        t0 = time.perf_counter()
        stats = actor.train_step(actor.dp_slice(batch), loss_type="sft")
        if metrics is not None:
            metrics.log(step, {**stats, "step_time_s": time.perf_counter() - t0}, phase="sft")
            if step % cfg.log_every == 0 or step == cfg.sft.steps:
                logger.info("sft step %d/%d | nll/token %.3f | %.2fs", step, cfg.sft.steps, stats["loss"], time.perf_counter() - t0)
    actor.set_lr(cfg.train.lr)


def _format_step(step: int, cfg: Config, m: dict[str, float]) -> str:
    rewards = " ".join(f"{k.split('/', 1)[1]} {v:.2f}" for k, v in m.items() if k.startswith("reward/"))
    return (
        f"step {step}/{cfg.train.steps} | reward {rewards} | gen {m['gen_tokens_per_s']:.0f} tok/s "
        f"train {m['train_tokens_per_s']:.0f} tok/s | step {m['step_time_s']:.1f}s "
        f"(rollout {m['rollout_time_s']:.1f} train {m['train_time_s']:.1f} sync {m['weight_sync_s']:.2f}) | "
        f"loss {m['loss']:+.4f} clip {m.get('clip_frac', 0):.3f}"
    )


def _final_table(before: dict[str, float], after: dict[str, float], task_names: list[str]) -> str:
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


def run_training(cfg: Config) -> dict[str, Any]:
    """Run SFT warm-up (optional), evaluation, synchronous GRPO and the final evaluation.

    Writes under ``cfg.output_dir``: config.yaml, metrics.jsonl, tensorboard/, reward_by_task.png,
    summary.json and hf_export/ (the trained model in Hugging Face format). Returns the summary.
    """
    out = Path(cfg.output_dir)
    initialize_parallel(cfg.parallel.tp, cfg.parallel.pp, seed=cfg.train.seed)
    try:
        return _run(cfg, out)
    finally:
        destroy_parallel()


def _run(cfg: Config, out: Path) -> dict[str, Any]:
    rank0 = _is_rank0()
    dtype = _DTYPES[cfg.model.dtype]
    tokenizer = load_tokenizer(cfg.model.tokenizer)
    hf_config = load_hf_config(cfg.model, tokenizer)
    torch.manual_seed(cfg.train.seed)
    actor = MegatronActor(hf_config, cfg.train, dtype=dtype)
    if cfg.model.checkpoint:
        actor.load_hf_state_dict(load_hf_weights(cfg.model.checkpoint))
    ro = metrics = None
    if rank0:
        out.mkdir(parents=True, exist_ok=True)
        import yaml

        (out / "config.yaml").write_text(yaml.safe_dump(config_to_dict(cfg), sort_keys=False))
        ro = _build_rollout(cfg, tokenizer, hf_config, dtype)
        metrics = MetricsLogger(out)
        logger.info("output_dir: %s | tasks: %s | model: %s", out, ", ".join(ro.tasks), _describe(hf_config))
    task_names = [s.name for s in cfg.tasks]
    _push_weights(actor, ro, version=0)

    if cfg.sft.steps:
        logger.info("supervised warm-up: %d steps of %d demonstrations", cfg.sft.steps, cfg.sft.batch_size)
        _sft_warmup(cfg, actor, ro, metrics)
        _push_weights(actor, ro, version=0)

    before = evaluate(cfg, ro, seed=cfg.train.seed + 1) if rank0 else {}
    if rank0 and before:
        logger.info("before RL: %s", _fmt_eval(before))

    for step in range(1, cfg.train.steps + 1):
        t_step = time.perf_counter()
        trajs: list[Trajectory] | None = None
        batch = None
        if rank0:
            t0 = time.perf_counter()
            trajs = _rollout(cfg, ro, _sample_requests(cfg, ro, step), cfg.rollout.temperature, seed=cfg.train.seed * 1000 + step)
            rollout_s = time.perf_counter() - t0
            batch, sample_adv = build_rl_batch(trajs, task_names, cfg.algo)
        batch = _broadcast(batch)
        t0 = time.perf_counter()
        stats = actor.train_step(actor.dp_slice(batch), loss_type="grpo", temperature=cfg.rollout.temperature)
        train_s = time.perf_counter() - t0
        sync_s = _push_weights(actor, ro, version=step)
        if rank0:
            gen_tokens = sum(t.num_generated for t in trajs)
            m = {
                **per_task_means(trajs),
                **stats,
                "gen_tokens_per_s": gen_tokens / max(rollout_s, 1e-9),
                "train_tokens_per_s": sum(len(t.token_ids) for t in trajs) / max(train_s, 1e-9),
                "rollout_time_s": rollout_s,
                "train_time_s": train_s,
                "weight_sync_s": sync_s,
                "step_time_s": time.perf_counter() - t_step,
                "mean_turns": sum(len(t.versions) for t in trajs) / len(trajs),
                "mean_generated_tokens": gen_tokens / len(trajs),
                "adv_abs_mean": float(sample_adv.abs().mean()),
            }
            metrics.log(step, m)
            if step % cfg.log_every == 0 or step == cfg.train.steps:
                logger.info(_format_step(step, cfg, m))

    after = evaluate(cfg, ro, seed=cfg.train.seed + 1) if rank0 else {}
    final_state = actor.export_hf_state_dict()
    summary: dict[str, Any] = {}
    if rank0:
        export_dir = save_hf_checkpoint(final_state, hf_config, out / "hf_export", tokenizer)
        metrics.close()
        png = plot_task_rewards(metrics.jsonl_path, out / "reward_by_task.png")
        summary = {"before_rl": before, "after_rl": after, "hf_export": str(export_dir), "plot": str(png),
                   "tensorboard": str(out / "tensorboard"), "metrics": str(metrics.jsonl_path)}
        (out / "summary.json").write_text(json.dumps(summary, indent=2))
        if before or after:
            logger.info("\n%s", _final_table(before, after, task_names))
        logger.info("plot: %s | TensorBoard: %s | HF export: %s", png, out / "tensorboard", export_dir)
    return summary


def _fmt_eval(m: dict[str, float]) -> str:
    return ", ".join(f"{k.split('/', 1)[1]} {100 * v:.0f}%" for k, v in m.items() if k.startswith("success/"))


def _describe(hf_config) -> str:
    return (f"{hf_config.model_type} layers={hf_config.num_hidden_layers} hidden={hf_config.hidden_size} "
            f"heads={hf_config.num_attention_heads}/{hf_config.num_key_value_heads} vocab={hf_config.vocab_size}")
