"""The GRPO training run, synchronous or asynchronous (``pipeline.mode``), with one code path.

Every rank runs :func:`run_training`. Rank 0 owns the rollout side: the engines (local PyTorch
engines behind :class:`~.engine_batching.BatchingEngine`, in a version pool when
``rollout.max_versions > 1``), the environments and the :class:`~.rollout_manager.RolloutManager`
that keeps groups in flight on its own thread. All ranks train through :class:`~.trainer.Trainer`
(rank 0 broadcasts each batch; data-parallel ranks take their slice) and push weights through
:class:`~.trainer.WeightPublisher` after every step.

The two modes differ only in the manager's settings: ``sync`` admits a step's groups after the
previous step's weights arrived and the trainer waits for all of them (staleness 0, the whole
step in one lockstep agent-loop call); ``async`` keeps up to ``(staleness + 1)`` steps of groups
in flight while the trainer trains, each group on its own, within the staleness cap.

Outputs under ``cfg.output_dir``: config.yaml, metrics.jsonl, batches.jsonl (the sample ids,
versions and staleness of every trained step), tensorboard/, reward_by_task.png, summary.json,
hf_export/, and checkpoints/ when ``checkpoint.interval > 0``.
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

from env_controller.local import LocalEnvClient
from env_controller.tasks import build_task
from megatron_agentrl.config import Config, ConfigError, TaskSpec, config_to_dict
from megatron_agentrl.hf_io import load_hf_config, load_hf_weights, save_hf_checkpoint
from megatron_agentrl.megatron.actor import MegatronActor
from megatron_agentrl.megatron.parallel import destroy_parallel, initialize_parallel
from megatron_agentrl.metrics import MetricsLogger, gpu_stats, plot_task_rewards
from megatron_agentrl.pipeline.batch import build_rl_batch_raw, build_sft_batch, per_task_means
from megatron_agentrl.pipeline.checkpoint import find_latest, load_checkpoint, save_checkpoint
from megatron_agentrl.pipeline.engine_batching import BatchingEngine
from megatron_agentrl.pipeline.rollout_manager import FinishedGroup, PromptSampler, RolloutManager
from megatron_agentrl.pipeline.sim_env import LatencyEnvClient
from megatron_agentrl.pipeline.trainer import Trainer, WeightPublisher, broadcast_object, is_rank0
from rollout_sglang.agent_loop import run_group_lockstep
from rollout_sglang.chat_template import AnyChatTemplate, build_chat_template
from rollout_sglang.engine import SamplingParams
from rollout_sglang.local_engine import LocalEngine
from rollout_sglang.tokenizer import load_tokenizer
from rollout_sglang.trajectory import Trajectory
from rollout_sglang.version_pool import VersionPool

logger = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class RolloutSide:
    """What rank 0 holds for sampling.

    engine: what the training rollouts use: a BatchingEngine, or a VersionPool of them.
    engines: every BatchingEngine (for the busy-time counters).
    env: the env client (in-process, or the env controller over HTTP); train_env: the same,
    behind simulated latency when ``pipeline.sim_env_latency_s > 0``. template; tasks: the
    built-in Task objects (demonstrations for SFT); task_names (config order), train/eval index
    splits, rng (SFT demonstrations), task weights (RL prompts), SFT weights (demonstrations)
    and per-task specs.
    """

    engine: Any
    engines: list[BatchingEngine]
    env: Any
    train_env: Any
    template: AnyChatTemplate
    tasks: dict[str, Any]
    task_names: list[str]
    train_indices: dict[str, list[int]]
    eval_indices: dict[str, list[int]]
    rng: random.Random
    weights: list[float] = field(default_factory=list)
    sft_weights: list[float] = field(default_factory=list)
    specs: dict[str, TaskSpec] = field(default_factory=dict)

    def latest_engine(self) -> Any:
        """An engine of the live slot with the newest weights (for evaluation).

        RuntimeError when no slot is live (every slot updating or failed its last sync): an
        updating or failed slot may hold partly loaded weights, which evaluation must not read.
        """
        if isinstance(self.engine, VersionPool):
            return self.engine.newest_live_slot().engines[0]
        return self.engine

    def busy_seconds(self) -> float:
        """Seconds the engines spent generating, averaged over engines."""
        return sum(e.busy_seconds() for e in self.engines) / max(1, len(self.engines))


def _controller_indices(client: Any, names: list[str], timeout_s: float) -> dict[str, list[int]]:
    """Each task's sample indices from the env controller (``GET /api/get_indices``)."""

    async def fetch() -> dict[str, list[int]]:
        try:
            out = {}
            for name in names:
                idx = await asyncio.wait_for(client.indices(name), timeout_s)
                bad = [i for i in idx if isinstance(i, bool) or not isinstance(i, int)]
                if bad:
                    raise ConfigError(f"task '{name}' on the env controller has non-integer sample indices (e.g. "
                                      f"{bad[0]!r}); the trainer needs integer indices")
                out[name] = list(idx)
            return out
        finally:
            await client.aclose()

    try:
        return asyncio.run(fetch())
    except ConfigError:
        raise
    except Exception as e:  # noqa: BLE001 - unreachable controller, unknown task
        raise ConfigError(f"env.controller_url={client.url!r}: cannot list the sample indices of the tasks "
                          f"{names} ({e!r}); start the controller and its task workers, or clear env.controller_url "
                          "to run the built-in tasks in process") from e


def _build_env(cfg: Config) -> tuple[Any, dict[str, Any], dict[str, list[int]]]:
    """The env client (in-process, or the env controller over HTTP when ``env.controller_url`` is set),
    the built-in Task objects (for demonstrations), and every task's sample indices."""
    from env_controller.tasks import TASKS

    names = [s.name for s in cfg.tasks]
    if len(set(names)) != len(names):
        dup = next(n for n in names if names.count(n) > 1)
        raise ConfigError(f"tasks: '{dup}' is listed twice; list each task once (use its weight to sample it more)")
    tasks: dict[str, Any] = {}
    for spec in cfg.tasks:
        if spec.name in TASKS and (not cfg.env.controller_url or cfg.sft.steps):
            tasks[spec.name] = build_task(spec.name, **spec.params)
    if cfg.env.controller_url:
        from env_controller.client import HttpEnvClient

        if cfg.sft.steps and len(tasks) < len(names):
            remote = [n for n in names if n not in tasks]
            raise ConfigError(f"sft.steps={cfg.sft.steps}: the tasks {remote} run behind the env controller and have "
                              "no scripted demonstrations here; set sft.steps=0 or list only built-in tasks")
        client = HttpEnvClient(cfg.env.controller_url, token=cfg.env.token or None,
                               timeout_s=cfg.pipeline.env_timeout_s)
        indices = _controller_indices(client, names, cfg.pipeline.env_timeout_s)
        logger.info("environments: env controller %s", client.url)
        return client, tasks, indices
    unknown = [n for n in names if n not in tasks]
    if unknown:
        raise ConfigError(f"tasks {unknown} are not built-in tasks (built-in: {', '.join(sorted(TASKS))}); set "
                          "env.controller_url to the env controller that serves them")
    return LocalEnvClient(tasks, timeout_s=cfg.pipeline.env_timeout_s), tasks, \
        {n: list(t.indices()) for n, t in tasks.items()}


def remote_engine_slots(cfg: Config) -> list[list[Any]] | None:
    """SGLang engine clients per version slot when the launcher started engine servers (the
    ``AGENTRL_ROLLOUT_ENGINES`` hand-off of ``megatron_agentrl.launch.ray_placement``); None when
    the rollout runs on local engines. Built on every rank (each is a small HTTP client)."""
    from megatron_agentrl.launch.ray_placement import ENGINES_ENV, rollout_engines_from_env

    urls = rollout_engines_from_env()
    if not urls:
        return None
    if len(urls) != cfg.rollout.max_versions or any(len(s) != cfg.rollout.engines_per_slot for s in urls):
        raise ConfigError(f"{ENGINES_ENV} lists {[len(s) for s in urls]} engines per slot, but the config asks for "
                          f"rollout.max_versions={cfg.rollout.max_versions} slots of rollout.engines_per_slot="
                          f"{cfg.rollout.engines_per_slot}; launch with the same config")
    from rollout_sglang.sglang_engine import SGLangEngine

    r = cfg.rollout
    return [[SGLangEngine(u, request_timeout_s=r.engine_timeout_s, update_timeout_s=r.weight_sync_bucket_timeout_s)
             for u in slot] for slot in urls]


def _build_rollout(cfg: Config, tokenizer: Any, hf_config: Any, dtype: torch.dtype,
                   remote: list[list[Any]] | None = None, template: AnyChatTemplate | None = None) -> RolloutSide:
    env, tasks, indices = _build_env(cfg)
    train_idx, eval_idx = {}, {}
    for name, idx in indices.items():
        n_eval = cfg.eval.samples_per_task
        if n_eval >= len(idx):
            raise ConfigError(f"eval.samples_per_task={n_eval} leaves no training samples for task '{name}' ({len(idx)} samples); lower it")
        train_idx[name], eval_idx[name] = (idx[:-n_eval], idx[-n_eval:]) if n_eval else (idx, [])
    device = "cuda" if torch.cuda.is_available() else "cpu"
    n = cfg.rollout.max_versions * cfg.rollout.engines_per_slot
    if remote is not None:
        for c in (c for slot in remote for c in slot):
            c.wait_healthy(cfg.rollout.engine_startup_timeout_s)
        engines = [BatchingEngine(c, resume_timeout_s=cfg.rollout.engine_timeout_s) for slot in remote for c in slot]
        logger.info("rollout engines: %s", [[c.base_url for c in slot] for slot in remote])
    else:
        engines = [BatchingEngine(LocalEngine(hf_config, dtype=dtype, device=device, seed=cfg.train.seed + i,
                                              resume_timeout_s=cfg.rollout.engine_timeout_s),
                                  resume_timeout_s=cfg.rollout.engine_timeout_s) for i in range(n)]
    if n == 1:
        engine: Any = engines[0]
    else:
        engine = VersionPool.from_engines(engines, cfg.rollout.max_versions, cfg.rollout.engines_per_slot,
                                          policy=cfg.rollout.cross_policy, recency_decay=cfg.rollout.recency_decay,
                                          seed=cfg.train.seed, drain_timeout_s=cfg.rollout.engine_timeout_s)
    p = cfg.pipeline
    train_env: Any = env
    if p.sim_env_latency_s > 0:
        train_env = LatencyEnvClient(env, p.sim_env_latency_s, p.sim_env_latency_alpha, p.sim_env_latency_max_s,
                                     seed=cfg.train.seed)
    return RolloutSide(
        engine=engine, engines=engines, env=env, train_env=train_env,
        template=template or _chat_template(cfg, tokenizer, hf_config), tasks=tasks,
        task_names=[s.name for s in cfg.tasks], train_indices=train_idx, eval_indices=eval_idx,
        rng=random.Random(cfg.train.seed), weights=[s.weight for s in cfg.tasks],
        sft_weights=[s.weight if s.sft_weight is None else s.sft_weight for s in cfg.tasks],
        specs={s.name: s for s in cfg.tasks},
    )


def _chat_template(cfg: Config, tokenizer: Any, hf_config: Any) -> AnyChatTemplate:
    """The chat format ``model.chat_template`` names (auto: from the model type), on ``tokenizer``."""
    try:
        return build_chat_template(cfg.model.chat_template, tokenizer, getattr(hf_config, "model_type", None))
    except ValueError as e:
        raise ConfigError(f"model.chat_template={cfg.model.chat_template!r} with model.tokenizer="
                          f"'{cfg.model.tokenizer}': {e}") from None


def _sampling(cfg: Config, ro: RolloutSide, temperature: float, seed: int | None) -> SamplingParams:
    return SamplingParams(
        max_new_tokens=cfg.rollout.max_new_tokens,
        temperature=temperature,
        top_p=cfg.rollout.top_p,
        stop_token_ids=list(ro.template.stop_token_ids),
        seed=seed,
    )


def evaluate(cfg: Config, ro: RolloutSide, seed: int) -> dict[str, float]:
    """Per-task mean reward and success on the held-out indices (rank 0 only), newest weights, no latency."""
    reqs = [(task, i, n) for n, (task, i) in enumerate((t, i) for t, idx in ro.eval_indices.items() for i in idx)]
    if not reqs:
        return {}
    trajs = asyncio.run(run_group_lockstep(
        ro.latest_engine(), ro.env, ro.template, reqs, _sampling(cfg, ro, cfg.eval.temperature, seed),
        max_turns=cfg.rollout.max_turns, max_total_tokens=cfg.rollout.max_total_tokens,
        env_timeout_s=cfg.pipeline.env_timeout_s,
    ))
    return per_task_means(trajs)


def _sft_example(cfg: Config, ro: RolloutSide, short: bool) -> tuple[list[int], list[int]]:
    """One demonstration as ``(token_ids, loss_mask)``: a task drawn by SFT weight, a training index,
    in the short format (empty system prompt, no tool schemas: the expert only) or the full one
    (the careless player with probability ``sft.careless_fraction``, when the task has one)."""
    task = ro.rng.choices(ro.task_names, weights=ro.sft_weights)[0]
    index = ro.rng.choice(ro.train_indices[task])
    demo = None
    if not short and cfg.sft.careless_fraction and ro.rng.random() < cfg.sft.careless_fraction:
        demo = ro.tasks[task].careless_demonstration(index)
    messages, tools = demo or ro.tasks[task].demonstration(index)
    if short:
        return ro.template.encode_conversation([{"role": "system", "content": ""}, *messages], None)
    return ro.template.encode_conversation(messages, tools)


def _sft_warmup(cfg: Config, actor: MegatronActor, ro: RolloutSide | None, metrics: MetricsLogger | None) -> None:
    """Supervised steps on the tasks' demonstrations (same token layout as RL turns; the first
    ``sft.short_format_steps`` in the short format; learning rate by ``sft.lr_at``)."""
    for step in range(1, cfg.sft.steps + 1):
        lr = cfg.sft.lr_at(step)
        actor.set_lr(lr)
        batch = None
        if ro is not None:
            short = step <= cfg.sft.short_format_steps
            batch = build_sft_batch([_sft_example(cfg, ro, short) for _ in range(cfg.sft.batch_size)])
        batch = broadcast_object(batch)
        t0 = time.perf_counter()
        stats = actor.train_step(actor.dp_slice(batch), loss_type="sft")
        if metrics is not None:
            metrics.log(step, {**stats, "lr": lr, "step_time_s": time.perf_counter() - t0}, phase="sft")
            if step % cfg.log_every == 0 or step == cfg.sft.steps:
                logger.info("sft step %d/%d | nll/token %.3f | %.2fs", step, cfg.sft.steps, stats["loss"], time.perf_counter() - t0)
    actor.set_lr(cfg.train.lr)


def _format_step(step: int, cfg: Config, m: dict[str, float]) -> str:
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
    """Run SFT warm-up (optional), evaluation, GRPO (``pipeline.mode`` sync or async), final evaluation.

    With ``checkpoint.resume`` set, continues a run from its checkpoint instead (no warm-up, no
    first evaluation). Writes under ``cfg.output_dir`` (see the module doc). Returns the summary
    (on rank 0; ``{}`` elsewhere): before/after evaluation, paths, ``mode``, ``rl_wall_s`` (seconds
    from the first to the last RL step), ``trained_samples``, ``trained_tokens``,
    ``samples_per_s``, ``dropped_stale``, ``last_checkpoint``.
    """
    out = Path(cfg.output_dir)
    initialize_parallel(cfg.parallel.tp, cfg.parallel.pp, seed=cfg.train.seed)
    try:
        return _run(cfg, out)
    finally:
        destroy_parallel()


def _load_megatron_weights(cfg: Config, actor: MegatronActor) -> None:
    """The actor's start weights from ``model.megatron_checkpoint`` (any TP x PP); errors name the key."""
    path = cfg.model.megatron_checkpoint
    try:
        actor.load_megatron_checkpoint(path)
    except (FileNotFoundError, ConfigError) as e:
        hint = ""
        if isinstance(e, ConfigError) and (Path(path) / "hf" / "config.json").is_file() and cfg.model.hf_config:
            hint = f" (the checkpoint's own config is '{Path(path) / 'hf'}'; set model.hf_config to it)"
        raise ConfigError(f"model.megatron_checkpoint='{path}': {e}{hint}") from e
    logger.info("start weights: megatron checkpoint %s", path)


def _resolve_resume(cfg: Config, ckpt_root: Path) -> Path | None:
    path: Path | None = None
    if is_rank0() and cfg.checkpoint.resume:
        if cfg.checkpoint.resume == "latest":
            path = find_latest(ckpt_root)
            if path is None:
                logger.info("checkpoint.resume=latest: no checkpoint under %s, starting fresh", ckpt_root)
        else:
            path = Path(cfg.checkpoint.resume)
    return broadcast_object(path)


def _make_manager(cfg: Config, ro: RolloutSide, version: int) -> RolloutManager:
    sync = cfg.pipeline.mode == "sync"
    B = cfg.rollout.prompts_per_step
    sampler = PromptSampler(ro.task_names, ro.weights, ro.train_indices, cfg.rollout.samples_per_prompt,
                            seed=cfg.train.seed)
    cohort = cfg.pipeline.cohort_groups or (B if sync else 1)
    return RolloutManager(
        ro.engine, ro.train_env, ro.template, sampler, batch_groups=B,
        staleness=0 if sync else cfg.pipeline.staleness,
        queue_size=cfg.pipeline.queue_size, cohort_groups=cohort,
        sampling=lambda seed: _sampling(cfg, ro, cfg.rollout.temperature, seed),
        max_turns=cfg.rollout.max_turns, max_total_tokens=cfg.rollout.max_total_tokens,
        env_timeout_s=cfg.pipeline.env_timeout_s, version=version, seed=cfg.train.seed,
        version_lag=0 if sync or cfg.rollout.cross_policy == "latest" else cfg.rollout.max_versions - 1,
        total_groups=cfg.train.steps * B,
    )


def _step_metrics(step: int, groups: list[FinishedGroup], trajs: list[Trajectory], stats: dict[str, float],
                  rewards: torch.Tensor, sample_adv: torch.Tensor, eta: int, times: dict[str, float],
                  manager: RolloutManager, busy_delta: float) -> tuple[dict[str, float], list[int]]:
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


def _run(cfg: Config, out: Path) -> dict[str, Any]:
    rank0 = is_rank0()
    dtype = _DTYPES[cfg.model.dtype]
    tokenizer = load_tokenizer(cfg.model.tokenizer)
    hf_config = load_hf_config(cfg.model, tokenizer)
    template = _chat_template(cfg, tokenizer, hf_config)  # on every rank: a bad choice fails everywhere
    torch.manual_seed(cfg.train.seed)
    actor = MegatronActor(hf_config, cfg.train, dtype=dtype)
    if cfg.model.megatron_checkpoint:
        _load_megatron_weights(cfg, actor)
    elif cfg.model.checkpoint:
        actor.load_hf_state_dict(load_hf_weights(cfg.model.checkpoint))
    ckpt_root = Path(cfg.checkpoint.dir) if cfg.checkpoint.dir else out / "checkpoints"
    resume = _resolve_resume(cfg, ckpt_root)
    ro: RolloutSide | None = None
    metrics: MetricsLogger | None = None
    remote = remote_engine_slots(cfg)
    if rank0:
        out.mkdir(parents=True, exist_ok=True)
        import yaml

        (out / "config.yaml").write_text(yaml.safe_dump(config_to_dict(cfg), sort_keys=False))
        ro = _build_rollout(cfg, tokenizer, hf_config, dtype, remote, template)
        metrics = MetricsLogger(out)
        logger.info("output_dir: %s | mode: %s | tasks: %s | model: %s", out, cfg.pipeline.mode, ", ".join(ro.task_names),
                    _describe(hf_config))
    task_names = [s.name for s in cfg.tasks]
    r = cfg.rollout
    publisher = WeightPublisher(
        actor, ro.engine if ro is not None else None, r.weight_sync_bucket_mb, timeout_s=r.engine_timeout_s,
        remote_slots=remote,
        sender_kwargs={"init_timeout_s": r.weight_sync_init_timeout_s, "bucket_timeout_s": r.weight_sync_bucket_timeout_s,
                       "checksum": r.weight_sync_checksum},
    )
    trainer = Trainer(actor, cfg, task_names)

    state: dict[str, Any] | None = None
    if resume is not None:
        state = load_checkpoint(resume, actor)
        if cfg.train.kl_coef > 0 and not actor.has_reference:
            logger.warning("train.kl_coef > 0 but the checkpoint holds no reference policy: using its weights")
            actor.snapshot_reference()
        publisher.push(int(state["version"]), all_slots=True)
        before = state.get("before_rl", {}) if rank0 else {}
        start_step = int(state["step"])
        logger.info("resumed at step %d (weight version %d)", start_step, state["version"])
    else:
        publisher.push(0, all_slots=True)
        if cfg.sft.steps:
            logger.info("supervised warm-up: %d steps of %d demonstrations", cfg.sft.steps, cfg.sft.batch_size)
            _sft_warmup(cfg, actor, ro, metrics)
            publisher.push(0, all_slots=True)
        if cfg.train.kl_coef > 0:
            actor.snapshot_reference()
        before = evaluate(cfg, ro, seed=cfg.train.seed + 1) if rank0 else {}
        if rank0 and before:
            logger.info("before RL: %s", _fmt_eval(before))
        start_step = 0

    eta = cfg.pipeline.staleness if cfg.pipeline.mode == "async" else 0
    if rank0 and (eta > 0 or cfg.rollout.cross_policy != "latest") and cfg.train.tis_cap == 0:
        logger.warning("off-policy tokens (pipeline.staleness=%d, rollout.cross_policy=%s) with train.tis_cap=0: they "
                       "are corrected only by the PPO clip against their behavior log-probs; set train.tis_cap "
                       "(e.g. 2.0) for truncated importance weights", eta, cfg.rollout.cross_policy)
    manager: RolloutManager | None = None
    batches_log = None
    if rank0:
        manager = _make_manager(cfg, ro, version=start_step)
        if state is not None:
            manager.load_state_dict(state["manager"])
        batches_log = (out / "batches.jsonl").open("a")
    consumed_ids: list[int] = list(state.get("consumed_sample_ids", [])) if state else []
    trained_samples = trained_tokens = 0
    last_ckpt: str | None = None
    t_rl = time.perf_counter()
    if manager is not None:
        manager.start()
    try:
        for step in range(start_step + 1, cfg.train.steps + 1):
            t_step = time.perf_counter()
            rl = None
            groups: list[FinishedGroup] = []
            trajs: list[Trajectory] = []
            busy0 = ro.busy_seconds() if ro is not None else 0.0
            if manager is not None:
                groups = manager.get_batch(cfg.pipeline.batch_timeout_s)
                trajs = [t for g in groups for t in g.trajectories]
                rl = build_rl_batch_raw(trajs, task_names, cfg.algo, ro.specs)
            wait_s = time.perf_counter() - t_step
            t0 = time.perf_counter()
            stats = trainer.step(rl)
            train_s = time.perf_counter() - t0
            sync_s = publisher.push(step)
            if manager is not None:
                manager.set_version(step)
            if rank0:
                times = {"wait_batch_s": wait_s, "train_time_s": train_s, "weight_sync_s": sync_s,
                         "step_time_s": time.perf_counter() - t_step}
                m, staleness = _step_metrics(step, groups, trajs, stats, rl.rewards, rl.sample_adv, eta, times,
                                             manager, ro.busy_seconds() - busy0)
                ids = [sid for g in groups for sid in g.request.sample_ids()]
                consumed_ids.extend(ids)
                trained_samples += len(trajs)
                trained_tokens += int(m["train_tokens"])
                metrics.log(step, m)
                metrics.histogram(step, "staleness", [float(s) for s in staleness])
                batches_log.write(json.dumps({
                    "step": step, "trained_version": step - 1, "group_ids": [g.request.group_id for g in groups],
                    "sample_ids": ids, "tasks": [g.request.task for g in groups],
                    "min_versions": [g.min_version for g in groups], "staleness": staleness,
                    "loss": stats["loss"], "grad_norm": stats.get("grad_norm"),
                }) + "\n")
                batches_log.flush()
                if step % cfg.log_every == 0 or step == cfg.train.steps:
                    logger.info(_format_step(step, cfg, m))
            if cfg.checkpoint.interval and (step % cfg.checkpoint.interval == 0 or step == cfg.train.steps):
                pstate = None
                if manager is not None:
                    manager.drain(cfg.pipeline.batch_timeout_s)
                    pstate = {"step": step, "version": step, "manager": manager.state_dict(), "before_rl": before,
                              "consumed_sample_ids": consumed_ids, "mode": cfg.pipeline.mode}
                last_ckpt = str(save_checkpoint(ckpt_root, step, actor, pstate, keep=cfg.checkpoint.keep))
                if manager is not None:
                    manager.release()
    finally:
        if manager is not None:
            manager.stop(timeout_s=cfg.pipeline.env_timeout_s)
        if batches_log is not None:
            batches_log.close()
    rl_wall = time.perf_counter() - t_rl

    after = evaluate(cfg, ro, seed=cfg.train.seed + 1) if rank0 else {}
    publisher.close()
    final_state = actor.export_hf_state_dict()
    summary: dict[str, Any] = {}
    if rank0:
        export_dir = save_hf_checkpoint(final_state, hf_config, out / "hf_export", tokenizer)
        metrics.close()
        png = plot_task_rewards(metrics.jsonl_path, out / "reward_by_task.png")
        summary = {"before_rl": before, "after_rl": after, "hf_export": str(export_dir), "plot": str(png),
                   "tensorboard": str(out / "tensorboard"), "metrics": str(metrics.jsonl_path),
                   "batches": str(out / "batches.jsonl"), "mode": cfg.pipeline.mode, "rl_wall_s": rl_wall,
                   "trained_samples": trained_samples, "trained_tokens": trained_tokens,
                   "samples_per_s": trained_samples / max(rl_wall, 1e-9),
                   "dropped_stale": manager.stats.dropped_stale if manager else 0, "last_checkpoint": last_ckpt}
        (out / "summary.json").write_text(json.dumps(summary, indent=2))
        if before or after:
            logger.info("\n%s", _final_table(before, after, task_names))
        logger.info("plot: %s | TensorBoard: %s", png, out / "tensorboard")
        logger.info("checkpoint (resume with checkpoint.resume=<dir>): %s | HF export of the trained model: %s",
                    last_ckpt or "none (checkpoint.interval=0)", export_dir)
    return summary


def _fmt_eval(m: dict[str, float]) -> str:
    return ", ".join(f"{k.split('/', 1)[1]} {100 * v:.0f}%" for k, v in m.items() if k.startswith("success/"))


def _describe(hf_config: Any) -> str:
    return (f"{hf_config.model_type} layers={hf_config.num_hidden_layers} hidden={hf_config.hidden_size} "
            f"heads={hf_config.num_attention_heads}/{hf_config.num_key_value_heads} vocab={hf_config.vocab_size}")
