"""The GRPO training run, synchronous or asynchronous (``pipeline.mode``), as stages.

:func:`run_training` runs on every rank and calls the stages of a :class:`TrainingRun` one by one:
``setup`` (model, start weights, rollout side, weight publisher), ``warm_up`` (resume from a
checkpoint, or publish the start weights, SFT warm-up and the first evaluation), then per RL step
``step`` (a batch from the rollout side, one optimizer step, the weight push) and ``checkpoint``
when one is due, and ``finish`` (final evaluation, HF export, summary).

Rank 0 owns the rollout side (:mod:`.rollout_side`: the engines in one version pool, the
environments and the :class:`~rollout_sglang.rollout.manager.RolloutManager` that keeps groups in flight on its
own thread). All ranks train through :class:`~.trainer.Trainer` (rank 0 broadcasts each batch;
data-parallel ranks take their slice) and push weights through
:class:`~megatron_agentrl.weight_sync.publisher.WeightPublisher` after every step.

The two modes differ only in the manager's settings: ``sync`` admits a step's groups after the
previous step's weights arrived and the trainer waits for all of them (staleness 0, the whole
step in one lockstep agent-loop call); ``async`` keeps up to ``(staleness + 1)`` steps of groups
in flight while the trainer trains, each group on its own, within the staleness cap. Dynamic
sampling (``algo.dynamic_sampling``) is the manager's too.

Periodic evaluation (``eval.interval``) runs on the rollout thread's event loop: in ``sync`` mode after
the step's weight push and before the next groups start (the trainer waits for it; it runs alone on
the engines, on exactly that step's weights, seeded like the other evaluations); in ``async`` mode
beside the training rollouts while the trainer goes on (at most ``MAX_EVALS_IN_FLIGHT`` at a time; one
due beyond that is skipped with a warning), its row logged when it ends.

Outputs under ``cfg.output_dir``: config.yaml, metrics.jsonl (phases ``sft``, ``rl`` and ``eval``),
batches.jsonl (the sample ids, versions and staleness of every trained step), tensorboard/, wandb/
(``logging.wandb``), reward_by_task.png, summary.json, hf_export/, and checkpoints/ when
``checkpoint.interval > 0``.

:func:`run_evaluation` (``agentrl eval``) evaluates a policy without training, through the same stages: ``setup``,
then ``evaluate_only`` (the weights of a run's checkpoint, of ``model.megatron_checkpoint`` or of the HF
``model.checkpoint`` in every slot, then the held-out samples), its outputs under ``<output_dir>/eval``.
"""
from __future__ import annotations

import concurrent.futures
import contextlib
import json
import logging
import time
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import IO, Any

import torch

from megatron_agentrl.config import Config, ConfigError, config_to_dict
from megatron_agentrl.distributed import broadcast_object, is_rank0, wait_for_rank0
from megatron_agentrl.hf_io import load_hf_config, load_hf_weights, save_hf_checkpoint
from megatron_agentrl.lora.checkpoint import BASE_DIR, BaseRef
from megatron_agentrl.megatron.actor import MegatronActor
from megatron_agentrl.megatron.parallel import destroy_parallel, initialize_parallel
from megatron_agentrl.metrics import MetricsLogger, plot_task_rewards, require_wandb, truncate_jsonl
from megatron_agentrl.pipeline.batch import build_rl_batch
from megatron_agentrl.pipeline.checkpoint import (
    LORA_BASE_KEY,
    find_latest,
    load_checkpoint,
    save_checkpoint,
    write_base,
    write_model_state,
)
from megatron_agentrl.pipeline.collapse import CollapseMonitor
from megatron_agentrl.pipeline.evaluation import (
    evaluate,
    evaluate_during_rl,
    final_table,
    format_success,
    no_signal_warnings,
    success_table,
)
from megatron_agentrl.pipeline.progress import Progress
from megatron_agentrl.pipeline.rollout_side import (
    RolloutSide,
    build_rollout_side,
    chat_template,
    make_manager,
    remote_engines,
    weight_sync_master_address,
)
from megatron_agentrl.pipeline.sft import sft_warmup
from megatron_agentrl.pipeline.step_metrics import engine_metrics, format_step, step_metrics
from megatron_agentrl.pipeline.trainer import Trainer
from megatron_agentrl.weight_sync.options import SenderOptions
from megatron_agentrl.weight_sync.publisher import WeightPublisher
from rollout_sglang.rollout.manager import FinishedGroup, RolloutManager
from rollout_sglang.tokenizer import load_tokenizer
from rollout_sglang.weight_update.buckets import dtype_from_name

logger = logging.getLogger(__name__)

# periodic evaluations running at once in async mode; one due beyond that is skipped (the trainer never waits)
MAX_EVALS_IN_FLIGHT = 2


def run_training(cfg: Config) -> dict[str, Any]:
    """Run SFT warm-up (optional), evaluation, GRPO (``pipeline.mode`` sync or async), final evaluation.

    With ``checkpoint.resume`` set, continues a run from its checkpoint instead (no warm-up, no
    first evaluation). Writes under ``cfg.output_dir`` (see the module doc). Returns the summary
    (on rank 0; ``{}`` elsewhere): before/after evaluation, paths, ``mode``, ``rl_wall_s`` (seconds
    from the first to the last RL step), ``trained_samples``, ``trained_tokens``,
    ``samples_per_s``, ``dropped_stale``, ``last_checkpoint``; with dynamic sampling ``groups_drawn`` and
    ``dropped_zero_variance`` (per task); with ``eval.interval`` ``evals_skipped``; with W&B ``wandb``.
    A resumed run's counters and ``rl_wall_s`` cover the whole run (the checkpoint carries those before it);
    ``resumes`` counts the resumes behind it, ``resumed_from_step`` is the step this part started from.
    """
    if cfg.logging.wandb:
        require_wandb()  # on every rank, before anything starts: a clear error instead of a late one on rank 0
    with _run_on_layout(cfg) as run:
        try:
            run.setup()
            run.warm_up()
            run.start_rollouts()
            try:
                for step in range(run.start_step + 1, cfg.train.steps + 1):
                    run.step(step)
                    if run.checkpoint_due(step):
                        run.checkpoint(step)
                run.end_evals()
            finally:
                run.stop_rollouts()
            return run.finish()
        except BaseException:
            if run.metrics is not None:
                run.metrics.close(failed=True)  # the W&B run ends as failed; the files are flushed
            raise


@contextlib.contextmanager
def _run_on_layout(cfg: Config) -> Iterator[TrainingRun]:
    """A :class:`TrainingRun` of ``cfg`` inside its parallel layout: the rollout side (its tasks' containers, servers
    and threads) closed and the layout destroyed on the way out, also on errors."""
    par = cfg.parallel
    initialize_parallel(par.tp, par.pp, seed=cfg.train.seed, cp=par.cp, ep=par.ep, timeout_s=par.collective_timeout_s,
                        rank0_timeout_s=par.rank0_timeout_s)
    run: TrainingRun | None = None
    try:
        run = TrainingRun(cfg)
        yield run
    finally:
        try:
            if run is not None and run.rollout_side is not None:
                run.rollout_side.close()
        finally:
            destroy_parallel()


def evaluation_config(cfg: Config) -> Config:
    """``cfg`` as ``agentrl eval`` runs it: outputs under ``<output_dir>/eval`` (the run's checkpoints still found
    under ``<output_dir>/checkpoints``), no warm-up, no checkpoints written, no TensorBoard or W&B, no teachers
    (an evaluation trains nothing: a distillation run is evaluated without loading its teachers). ConfigError
    when it names no weights to evaluate (the random initialisation says nothing of a policy)."""
    c = cfg.checkpoint
    if not (c.resume or cfg.model.megatron_checkpoint or cfg.model.checkpoint):
        raise ConfigError("agentrl eval: no weights to evaluate; give checkpoint.resume=latest (or a step_<k> folder) "
                          "for a run's checkpoint, model.checkpoint=<HF directory> (e.g. a run's hf_export), or "
                          "model.megatron_checkpoint=<directory>")
    out = Path(cfg.output_dir)
    ckpt_dir = c.dir or str(out / "checkpoints")
    if c.resume == "latest" and find_latest(ckpt_dir) is None:
        raise ConfigError(f"checkpoint.resume=latest: no checkpoint under {ckpt_dir}; point checkpoint.dir (or "
                          "output_dir) at the run's, or name a step_<k> folder")
    if c.resume and c.resume != "latest" and not (Path(c.resume) / "meta.json").is_file():
        raise ConfigError(f"checkpoint.resume={c.resume}: not a checkpoint folder (no meta.json); name a step_<k> "
                          f"folder of a run's checkpoints, or latest")
    return replace(cfg, output_dir=str(out / "eval"),
                   checkpoint=replace(c, dir=ckpt_dir, interval=0, after_warmup=False),
                   sft=replace(cfg.sft, steps=0, short_format_steps=0),
                   logging=replace(cfg.logging, tensorboard=False, wandb=False),
                   distill=replace(cfg.distill, teachers=[]))


def run_evaluation(cfg: Config) -> dict[str, Any]:
    """Evaluate a policy on every task's held-out samples without training (``agentrl eval``), on every rank.

    The weights: a run's checkpoint (``checkpoint.resume``: ``latest`` or a ``step_<k>`` folder, at any layout),
    else ``model.megatron_checkpoint``, else the HF ``model.checkpoint``; played by the run's engines (local, or
    the SGLang servers of ``rollout.engine_urls``, which receive those weights) at ``eval.temperature``, seeded
    as the run's own evaluations. Writes ``<output_dir>/eval/``: config.yaml, metrics.jsonl and eval.json (the
    weights, the step, the per-task entries of :func:`~.evaluation.evaluate`), and logs the per-task table.
    Returns eval.json's record on rank 0 (``{}`` elsewhere)."""
    with _run_on_layout(evaluation_config(cfg)) as run:
        run.setup()
        return run.evaluate_only()


def eval_due(cfg: Config, step: int) -> bool:
    """Whether a periodic evaluation follows RL step ``step``: every ``eval.interval`` steps (0: never), except
    after the last step, which has the final evaluation."""
    interval = cfg.eval.interval
    return bool(interval) and step % interval == 0 and step < cfg.train.steps


def load_start_weights(cfg: Config, actor: MegatronActor) -> None:
    """The actor's start weights: ``model.megatron_checkpoint`` (any TP x PP; errors name the key),
    else the HF ``model.checkpoint``, else the random initialisation stays."""
    path = cfg.model.megatron_checkpoint
    if not path:
        if cfg.model.checkpoint:
            actor.load_hf_state_dict(load_hf_weights(cfg.model.checkpoint))
        return
    try:
        actor.load_megatron_checkpoint(path)
    except (FileNotFoundError, ConfigError) as e:
        hint = ""
        if isinstance(e, ConfigError) and (Path(path) / "hf" / "config.json").is_file() and cfg.model.hf_config:
            hint = f" (the checkpoint's own config is '{Path(path) / 'hf'}'; set model.hf_config to it)"
        raise ConfigError(f"model.megatron_checkpoint='{path}': {e}{hint}") from e
    logger.info("start weights: megatron checkpoint %s", path)


def _resume_path(cfg: Config, ckpt_root: Path) -> Path | None:
    """The checkpoint ``checkpoint.resume`` names (``latest``: the newest under ``ckpt_root``), on every rank."""
    path: Path | None = None
    if is_rank0() and cfg.checkpoint.resume:
        if cfg.checkpoint.resume == "latest":
            path = find_latest(ckpt_root)
            if path is None:
                logger.info("checkpoint.resume=latest: no checkpoint under %s, starting fresh", ckpt_root)
        else:
            path = Path(cfg.checkpoint.resume)
    return broadcast_object(path)


class TrainingRun:
    """One training run on this rank, as stages (see the module doc and :func:`run_training`).

    The stages are collective: every rank calls each of them, in order. Rank 0 alone holds the
    rollout side (``rollout_side``), the rollout manager and the output files.
    """

    def __init__(self, cfg: Config) -> None:
        self.cfg = cfg
        self.out = Path(cfg.output_dir)
        self.rank0 = is_rank0()
        self.progress = Progress(enabled=self.rank0)
        self.task_names = [s.name for s in cfg.tasks]
        self.max_staleness = cfg.pipeline.staleness if cfg.pipeline.mode == "async" else 0
        self.rollout_side: RolloutSide | None = None
        self.metrics: MetricsLogger | None = None
        self.manager: RolloutManager | None = None
        self.batches_log: IO[str] | None = None
        self.state: dict[str, Any] | None = None  # the pipeline state of the checkpoint resumed from
        self.before: dict[str, float] = {}
        self.start_step = 0
        self.consumed_ids: list[int] = []
        self.trained_samples = self.trained_tokens = 0
        self.last_ckpt: str | None = None
        self.t_rl = self.rl_wall = 0.0
        self.evals: list[tuple[int, concurrent.futures.Future]] = []  # periodic evaluations running (async)
        self.evals_skipped = 0
        self.rl_wall_before = 0.0  # RL seconds of the run before the checkpoint resumed from
        self.resumes = 0  # resumes in the run's history, this one included
        self.engines_before: dict[str, float] = {}  # engine counters of the run before the checkpoint resumed from
        self.lora_base: BaseRef | None = None  # a LoRA run's base (hf_base/), once the adapters started

    # ------------------------------------------------------------------ stages
    def setup(self) -> None:
        """Tokenizer, model config, chat template, the actor and its start weights; on rank 0 the output
        folder (config.yaml), the rollout side and the metrics; the weight publisher and the trainer."""
        cfg = self.cfg
        dtype = dtype_from_name(cfg.model.dtype)
        self.tokenizer = load_tokenizer(cfg.model.tokenizer)
        self.hf_config = load_hf_config(cfg.model, self.tokenizer)
        template = chat_template(cfg, self.tokenizer, self.hf_config)  # on every rank: a bad choice fails everywhere
        torch.manual_seed(cfg.train.seed)
        # with LoRA the warm-up trains every parameter; the adapters start with RL (warm_up)
        self.actor = MegatronActor(self.hf_config, cfg.train, cfg.loss, dtype=dtype, adapters_later=cfg.lora.enabled)
        load_start_weights(cfg, self.actor)
        self.ckpt_root = Path(cfg.checkpoint.dir) if cfg.checkpoint.dir else self.out / "checkpoints"
        self.resume = _resume_path(cfg, self.ckpt_root)
        remote = remote_engines(cfg, self.hf_config)
        if self.rank0:
            import yaml

            self.out.mkdir(parents=True, exist_ok=True)
            (self.out / "config.yaml").write_text(yaml.safe_dump(config_to_dict(cfg), sort_keys=False))
            self.rollout_side = build_rollout_side(cfg, self.hf_config, dtype, template, remote)
            self.metrics = MetricsLogger(self.out, tensorboard=cfg.logging.tensorboard, wandb=cfg.logging,
                                         run_config=config_to_dict(cfg))
            logger.info("output_dir: %s | mode: %s | tasks: %s | model: %s", self.out, cfg.pipeline.mode,
                        ", ".join(self.task_names), _describe(self.hf_config))
        r = cfg.rollout
        sync = SenderOptions(**r.weight_sync_limits(), checksum=r.weight_sync_checksum,
                             master_address=weight_sync_master_address(cfg))
        pool = self.rollout_side.pool if self.rollout_side is not None else None
        self.publisher = WeightPublisher(self.actor, pool, sync, timeout_s=r.engine_timeout_s, remote_slots=remote,
                                         max_failures=r.weight_sync_max_failures,
                                         adapter_dir=cfg.lora.adapter_dir or self.out / "adapters")
        self.trainer = Trainer(self.actor, cfg, self.task_names)
        p = cfg.pipeline
        self.collapse = CollapseMonitor(p.collapse_window, p.collapse_drop, patience=p.collapse_patience)

    def warm_up(self) -> None:
        """The weights RL starts from, in every slot: a checkpoint's (``checkpoint.resume``: its step,
        weight version, rollout state and first evaluation), or the start weights after the SFT warm-up
        (``sft.steps``), the KL reference snapshot (``loss.kl_coef > 0``) and the first evaluation."""
        cfg = self.cfg
        if self.resume is not None:
            self.state = load_checkpoint(self.resume, self.actor, lora=cfg.lora)
            self._resume_adapters()
            if cfg.loss.kl_coef > 0 and not self.actor.has_reference:
                logger.warning("loss.kl_coef > 0 but the checkpoint holds no reference policy: using its weights")
                self.actor.snapshot_reference()
            self.publisher.push(int(self.state["version"]), all_slots=True)
            self.before = self.state.get("before_rl", {}) if self.rank0 else {}
            self.start_step = int(self.state["step"])
            self.consumed_ids = list(self.state.get("consumed_sample_ids", []))
            self._restore_totals(self.state.get("totals", {}))
            if self.rank0:  # an earlier run in this output_dir may have gone past the checkpoint: record each step once
                self.metrics.resume_at(self.start_step)
                truncate_jsonl(self.out / "batches.jsonl", lambda r: int(r["step"]) <= self.start_step)
            logger.info("resumed at step %d (weight version %d)", self.start_step, self.state["version"])
            return
        if cfg.sft.steps:
            sft_warmup(cfg, self.actor, self.rollout_side, self.metrics, self.progress)
        warm_state = None
        if cfg.lora.enabled:
            if cfg.checkpoint.after_warmup:  # the warm-up trained every parameter: its checkpoint is a full one
                warm_state = write_model_state(self.ckpt_root, 0, self.actor)
            self._start_adapters()
        self.publisher.push(0, all_slots=True)
        if cfg.loss.kl_coef > 0:
            self.actor.snapshot_reference()
        if self.rank0:
            self.before = evaluate(cfg, self.rollout_side, seed=cfg.train.seed + 1, progress=self.progress,
                                   title="evaluation before RL")
            if self.before:
                self.metrics.log(0, self.before, phase="eval")
            for warning in no_signal_warnings(self.before):
                logger.warning(warning)
        wait_for_rank0()  # the evaluation may outlast a collective's timeout
        if cfg.checkpoint.after_warmup:
            self._save(0, None, model_state=warm_state)

    def _start_adapters(self) -> None:
        """A LoRA run's adapters start on the model as it is now, which becomes the run's base: written once
        (``hf_base/``, hashed) for its checkpoints and exports to reference. Collective."""
        self.actor.start_adapters(self.cfg.lora)
        self.lora_base = write_base(self.actor, self.hf_config, self.tokenizer, self.out / BASE_DIR)

    def _resume_adapters(self) -> None:
        """A LoRA run after a checkpoint's load: a LoRA checkpoint brought its base and adapters; from the warm-up's
        (full) checkpoint the adapters start here, as in the run that saved it, with the reference taken then."""
        if not self.cfg.lora.enabled:
            return
        if self.actor.lora is not None:
            self.lora_base = self.state[LORA_BASE_KEY]
            return
        self._start_adapters()
        if self.cfg.loss.kl_coef > 0:
            self.actor.snapshot_reference()

    def evaluate_only(self) -> dict[str, Any]:
        """``agentrl eval``'s stage after ``setup``: the weights to evaluate (a checkpoint's, or the start weights)
        in every slot, the held-out samples played, eval.json written; the record on rank 0, ``{}`` elsewhere."""
        cfg = self.cfg
        version = 0
        if self.resume is not None:
            self.state = load_checkpoint(self.resume, self.actor, lora=cfg.lora)
            self.lora_base = self.state[LORA_BASE_KEY]
            version, self.start_step = int(self.state["version"]), int(self.state["step"])
            weights = f"checkpoint {self.resume} (step {self.start_step})"
        elif cfg.checkpoint.resume:
            raise ConfigError(f"checkpoint.resume={cfg.checkpoint.resume}: no checkpoint under {self.ckpt_root}; "
                              "point checkpoint.dir (or output_dir) at the run's")
        else:
            weights = (f"megatron checkpoint {cfg.model.megatron_checkpoint}" if cfg.model.megatron_checkpoint
                       else f"HF checkpoint {cfg.model.checkpoint}")
        self.publisher.push(version, all_slots=True)
        self.publisher.close()
        if not self.rank0:
            return {}
        self._warn_if_trained_on()
        result = evaluate(cfg, self.rollout_side, seed=cfg.train.seed + 1, progress=self.progress, title="evaluation")
        self.metrics.log(self.start_step, result, phase="eval")
        self.metrics.close()
        record = {"weights": weights, "step": self.start_step, "weight_version": version,
                  "samples_per_task": cfg.eval.samples_per_task, "temperature": cfg.eval.temperature,
                  "results": result}
        (self.out / "eval.json").write_text(json.dumps(record, indent=2))
        logger.info("%s\n%s", weights, success_table({"success": result}, self.task_names))
        logger.info("evaluation: %s", self.out / "eval.json")
        return record

    def _warn_if_trained_on(self) -> None:
        """Warn when the run whose output folder holds this evaluation's held out fewer samples per task: the held-out
        samples are each task's last indices, so the extra ones were the run's training samples."""
        import yaml

        run_config = self.out.parent / "config.yaml"
        try:
            held_out = (yaml.safe_load(run_config.read_text()) or {}).get("eval", {}).get("samples_per_task")
        except (OSError, yaml.YAMLError, AttributeError):
            return
        n = self.cfg.eval.samples_per_task
        if isinstance(held_out, int) and n > held_out:
            logger.warning("eval.samples_per_task=%d is more than the %d the run held out (%s): %d of each task's "
                           "samples evaluated here were its training samples; use at most %d", n, held_out,
                           run_config, n - held_out, held_out)

    def start_rollouts(self) -> None:
        """Rank 0: the rollout manager (with the checkpoint's state when resuming) starts sampling."""
        cfg = self.cfg
        off_policy = self.max_staleness > 0 or cfg.rollout.cross_policy != "latest"
        if self.rank0 and off_policy and cfg.loss.tis_cap == 0 and cfg.loss.mis_cap == 0:
            logger.warning("off-policy tokens (pipeline.staleness=%d, rollout.cross_policy=%s) with loss.tis_cap=0 "
                           "and loss.mis_cap=0: they are corrected only by the PPO clip against their behavior "
                           "log-probs; set loss.tis_cap (e.g. 2.0) for truncated importance weights, or "
                           "loss.mis_cap for masked ones",
                           self.max_staleness, cfg.rollout.cross_policy)
        if self.rank0:
            self.manager = make_manager(cfg, self.rollout_side, version=self.start_step)
            if self.state is not None and self.state["manager"] is not None:  # None: saved before RL began
                self.manager.load_state_dict(self.state["manager"])
            self.batches_log = (self.out / "batches.jsonl").open("a")
        self.t_rl = time.perf_counter()
        if self.manager is not None:
            self.manager.start()

    def step(self, step: int) -> None:
        """RL step ``step``: rank 0 takes a batch of groups from the manager, every rank trains on it
        and publishes weight version ``step``; rank 0 records the step."""
        cfg = self.cfg
        t_step = time.perf_counter()
        rl = None
        groups: list[FinishedGroup] = []
        busy_before = self.rollout_side.busy_seconds() if self.rollout_side is not None else 0.0
        groups = self._next_batch(step)
        if self.manager is not None:
            rl = build_rl_batch([t for g in groups for t in g.trajectories], self.task_names, cfg.algo,
                                self.rollout_side.shaper, trained_version=step - 1, distill=cfg.distill.enabled)
        wait_s = time.perf_counter() - t_step
        t0 = time.perf_counter()
        stats = self.trainer.step(rl, step)
        train_s = time.perf_counter() - t0
        sync_s = self.publisher.push(step)
        eval_s = 0.0
        if self.manager is not None:
            t0 = time.perf_counter()
            self._periodic_eval(step)
            eval_s = time.perf_counter() - t0
            self.manager.set_version(step)
        if self.rank0:
            times = {"wait_batch_s": wait_s, "train_time_s": train_s, "weight_sync_s": sync_s,
                     "step_time_s": time.perf_counter() - t_step}
            if cfg.eval.interval:
                times["eval_wait_s"] = eval_s
            metrics, staleness = step_metrics(step, groups, stats, rl, self.max_staleness, times, self.manager,
                                              self.rollout_side.busy_seconds() - busy_before)
            metrics.update(self.manager.agent_metrics())  # rollout.agent: gateway: history rewrites, agent errors
            metrics.update(self._engine_counts())
            metrics["weight_sync/bytes"] = float(self.publisher.last_bytes)  # a LoRA run's: its adapters
            self._record(step, groups, stats, metrics, staleness, rl.sample_adv.tolist())

    def _next_batch(self, step: int) -> list[FinishedGroup]:
        """Rank 0: the groups of RL step ``step`` (``pipeline.batch_timeout_s`` at most); [] elsewhere.

        With servers in other processes every rank takes part while rank 0 waits: when no slot can serve and
        a server back from a restart waits for weights (every engine restarted, or the only one), nothing
        would ever sample, so all ranks join a push of the current weights (version ``step - 1``) to it."""
        timeout_s = self.cfg.pipeline.batch_timeout_s
        if self.publisher.sender is None:
            return self.manager.get_batch(timeout_s) if self.manager is not None else []
        t0 = time.monotonic()
        deadline = t0 + timeout_s
        while True:
            groups, status = [], None
            if self.manager is not None:
                try:
                    now = time.monotonic()
                    groups = self.manager.get_batch(min(1.0, max(0.0, deadline - now)), waited_s=now - t0)
                    status = "ready"
                except TimeoutError as e:
                    if time.monotonic() >= deadline:
                        status = f"error: {e}"
                    else:
                        status = "resync" if self.rollout_side.pool.stranded() else "wait"
            status = broadcast_object(status)
            if status == "ready":
                return groups
            if status.startswith("error: "):
                raise TimeoutError(status[len("error: "):])
            if status == "resync":
                logger.warning("no engine can serve and a restarted one waits for weights: sending it version %d "
                               "before step %d", step - 1, step)
                self.publisher.push(step - 1)

    # ------------------------------------------------------------------ periodic evaluation
    def _periodic_eval(self, step: int) -> None:
        """Rank 0, after the weight push of step ``step`` and before the manager admits against it: log the
        evaluations that ended, and start the one due. Sync mode waits for it (nothing else runs then)."""
        self._collect_evals(wait=False)
        if not eval_due(self.cfg, step) or not any(self.rollout_side.eval_indices.values()):
            return
        if len(self.evals) >= MAX_EVALS_IN_FLIGHT:
            self.evals_skipped += 1
            logger.warning("evaluation after step %d skipped: %d evaluations still run (raise eval.interval or lower "
                           "eval.samples_per_task)", step, len(self.evals))
            return
        coro = evaluate_during_rl(self.cfg, self.rollout_side, seed=self.cfg.train.seed + 1)
        self.evals.append((step, self.manager.submit(coro)))
        if self.cfg.pipeline.mode == "sync":
            self._collect_evals(wait=True)

    def _collect_evals(self, wait: bool) -> None:
        """Rank 0: log every periodic evaluation that ended (phase ``eval``, at the step it followed); with
        ``wait``, wait for the running ones first (at most ``pipeline.batch_timeout_s`` in all; one still
        running then is cancelled). A failed evaluation is a warning, not the end of the run."""
        deadline = time.monotonic() + self.cfg.pipeline.batch_timeout_s
        running = []
        for step, fut in self.evals:
            try:
                result = fut.result(timeout=max(0.0, deadline - time.monotonic())) if wait else \
                    fut.result(timeout=0) if fut.done() else None
            except concurrent.futures.TimeoutError:
                fut.cancel()
                logger.warning("evaluation after step %d did not end within pipeline.batch_timeout_s=%.0fs; "
                               "cancelled", step, self.cfg.pipeline.batch_timeout_s)
                continue
            except (Exception, concurrent.futures.CancelledError) as e:  # noqa: BLE001 - training goes on
                logger.warning("evaluation after step %d failed: %r", step, e)
                continue
            if result is None:
                running.append((step, fut))
            elif result:
                self.metrics.log(step, result, phase="eval")
                logger.info("evaluation after step %d (weights v%.0f-v%.0f, %.1fs): %s", step, result["version_min"],
                            result["version_max"], result["eval_time_s"], format_success(result))
        self.evals = running

    def end_evals(self) -> None:
        """Rank 0, after the last step: wait for the periodic evaluations still running and log them."""
        if self.manager is not None:
            self._collect_evals(wait=True)

    def _record(self, step: int, groups: list[FinishedGroup], stats: dict[str, float], metrics: dict[str, float],
                staleness: list[int], advantages: list[float]) -> None:
        """Rank 0: the step's metrics (metrics.jsonl, TensorBoard), its batches.jsonl row (with each trained
        sample's end status and advantage, in the order of ``staleness``), its console line."""
        ids = [sid for g in groups for sid in g.request.sample_ids()]
        self.consumed_ids.extend(ids)
        self.trained_samples += sum(len(g.trajectories) for g in groups)
        self.trained_tokens += int(metrics["train_tokens"])
        flags, alarms = self.collapse.update(step, metrics)
        metrics.update(flags)
        for message in alarms:
            logger.warning(message)
        self.metrics.log(step, metrics)
        self.metrics.histogram(step, "staleness", [float(s) for s in staleness])
        self.batches_log.write(json.dumps({
            "step": step, "trained_version": step - 1, "group_ids": [g.request.group_id for g in groups],
            "sample_ids": ids, "tasks": [g.request.task for g in groups],
            "min_versions": [g.min_version for g in groups], "staleness": staleness,
            "statuses": [t.status for g in groups for t in g.trajectories], "advantages": advantages,
            "tokens_after_update": [t.tokens_after_update for g in groups for t in g.trajectories],
            "loss": stats["loss"], "grad_norm": stats.get("grad_norm"),
        }) + "\n")
        self.batches_log.flush()
        if step % self.cfg.log_every == 0 or step == self.cfg.train.steps:
            logger.info(format_step(step, self.cfg, metrics))

    def checkpoint_due(self, step: int) -> bool:
        """Whether a checkpoint follows step ``step`` (every ``checkpoint.interval`` steps and the last)."""
        interval = self.cfg.checkpoint.interval
        return bool(interval) and (step % interval == 0 or step == self.cfg.train.steps)

    def checkpoint(self, step: int) -> None:
        """Save a resumable checkpoint after step ``step`` (rank 0 drains the manager first, so the groups
        in flight are part of it, and lets it go on after)."""
        if self.manager is not None:
            self.manager.drain(self.cfg.pipeline.batch_timeout_s)
        wait_for_rank0()
        self._save(step, self.manager.state_dict() if self.manager is not None else None)
        if self.manager is not None:
            self.manager.release()

    def _save(self, step: int, manager_state: dict[str, Any] | None, model_state: dict[str, Any] | None = None) -> None:
        """Write checkpoint ``step`` with the rollout manager's state (None before RL has started); ``model_state``:
        its model and optimizer were written earlier (:func:`write_model_state`)."""
        pstate = None
        if self.rank0:
            pstate = {"step": step, "version": step, "manager": manager_state, "before_rl": self.before,
                      "consumed_sample_ids": self.consumed_ids, "mode": self.cfg.pipeline.mode,
                      "totals": self._totals()}
        with self.progress.phase(f"checkpoint step {step}") as phase:
            path = save_checkpoint(self.ckpt_root, step, self.actor, pstate, keep=self.cfg.checkpoint.keep,
                                   base=self.lora_base, model_state=model_state)
            phase.update(figures={"saved to": str(path)})
        self.last_ckpt = str(path)

    def _engine_counts(self) -> dict[str, float]:
        """Rank 0: :func:`engine_metrics` over the whole run (the counts before the checkpoint resumed from added;
        ``engines/out_of_rotation`` is a state, not a count)."""
        counts = engine_metrics(self.rollout_side.pool, self.publisher)
        return {k: v + (0.0 if k == "engines/out_of_rotation" else float(self.engines_before.get(k, 0.0)))
                for k, v in counts.items()}

    def _totals(self) -> dict[str, Any]:
        """Rank 0: the run's own counters so far, for the checkpoint (the manager's are in its state)."""
        return {"trained_samples": self.trained_samples, "trained_tokens": self.trained_tokens,
                "evals_skipped": self.evals_skipped, "resumes": self.resumes,
                "rl_wall_s": self.rl_wall_before + (time.perf_counter() - self.t_rl if self.t_rl else 0.0),
                "engines": self._engine_counts() if self.rollout_side is not None else {}}

    def _restore_totals(self, totals: dict[str, Any]) -> None:
        """The counters of :meth:`_totals` from the checkpoint resumed from (absent in older checkpoints: zero),
        so that summary.json covers the whole run; counts this resume."""
        self.trained_samples = int(totals.get("trained_samples", 0))
        self.trained_tokens = int(totals.get("trained_tokens", 0))
        self.evals_skipped = int(totals.get("evals_skipped", 0))
        self.rl_wall_before = float(totals.get("rl_wall_s", 0.0))
        self.resumes = int(totals.get("resumes", 0)) + 1
        self.engines_before = {k: float(v) for k, v in dict(totals.get("engines", {})).items()}

    def stop_rollouts(self) -> None:
        """Rank 0: stop the manager (its env sessions end) and close batches.jsonl; the RL wall time ends."""
        try:
            if self.manager is not None:
                self.manager.stop(timeout_s=self.cfg.pipeline.env_timeout_s)  # cancels evaluations still running
        finally:
            if self.batches_log is not None:
                self.batches_log.close()
            if self.rollout_side is not None:
                self.rollout_side.pool.stop_health_checks()
        self.rl_wall = self.rl_wall_before + time.perf_counter() - self.t_rl

    def _export_adapter(self) -> str:
        """With LoRA: the adapters in PEFT's format (``adapter``) on the base they were trained on (the warmed-up
        model, ``hf_base``, written when they started); ``hf_export`` holds them merged. Collective; the adapter's
        path."""
        from megatron_agentrl.lora.peft_format import save_adapters

        assert self.actor.lora is not None and self.lora_base is not None
        return str(save_adapters(self.actor, self.actor.lora, self.out / "adapter", base=self.lora_base.path))

    def finish(self) -> dict[str, Any]:
        """The final evaluation, the HF export of the trained model, the reward plot and summary.json;
        returns the summary (``{}`` on ranks other than 0)."""
        cfg = self.cfg
        after = evaluate(cfg, self.rollout_side, seed=cfg.train.seed + 1, progress=self.progress,
                         title="evaluation after RL") if self.rank0 else {}
        wait_for_rank0()
        self.publisher.close()
        with self.progress.phase("HF export") as phase:
            final_state = self.actor.export_hf_state_dict()  # collective
            if self.rank0:
                export_dir = save_hf_checkpoint(final_state, self.hf_config, self.out / "hf_export", self.tokenizer)
                phase.update(figures={"saved to": str(export_dir)})
            wait_for_rank0()
            adapter_dir = self._export_adapter() if cfg.lora.enabled else None
        if not self.rank0:
            return {}
        if after:
            self.metrics.log(cfg.train.steps, after, phase="eval")
        wandb_dir = self.metrics.wandb_dir
        self.metrics.close()
        png = plot_task_rewards(self.metrics.jsonl_path, self.out / "reward_by_task.png")
        summary = {"before_rl": self.before, "after_rl": after, "hf_export": str(export_dir), "plot": str(png),
                   "tensorboard": str(self.out / "tensorboard"), "metrics": str(self.metrics.jsonl_path),
                   "batches": str(self.out / "batches.jsonl"), "mode": cfg.pipeline.mode, "rl_wall_s": self.rl_wall,
                   "trained_samples": self.trained_samples, "trained_tokens": self.trained_tokens,
                   "samples_per_s": self.trained_samples / max(self.rl_wall, 1e-9),
                   "dropped_stale": self.manager.stats.dropped_stale if self.manager else 0,
                   "last_checkpoint": self.last_ckpt, "resumes": self.resumes, "lora_adapter": adapter_dir,
                   "resumed_from_step": self.start_step if self.resume is not None else None}
        if self.manager is not None:  # rollouts ended by infrastructure failures: counted, never trained
            st = self.manager.stats
            summary["infra"] = {"failed_episodes": dict(st.infra_failed), "groups_retried": st.infra_retried,
                                "groups_dropped": dict(st.dropped_infra)}
        if self.manager is not None and self.manager.dynamic_sampling:
            st = self.manager.stats
            summary.update({"groups_drawn": st.drawn, "dropped_zero_variance": dict(st.dropped_zero_var),
                            "short_slots": st.short_slots, "fallback_batches": st.fallback_batches,
                            "forced_draws": st.forced_draws})
        if self.rollout_side is not None and self.publisher.sender is not None:  # servers that came and went
            summary["engines"] = self._engine_counts()
        if cfg.eval.interval:
            summary["evals_skipped"] = self.evals_skipped
        if wandb_dir is not None:
            summary["wandb"] = str(wandb_dir)
        (self.out / "summary.json").write_text(json.dumps(summary, indent=2))
        if self.before or after:
            logger.info("\n%s", final_table(self.before, after, self.task_names))
        logger.info("plot: %s | TensorBoard: %s", png, self.out / "tensorboard")
        logger.info("checkpoint (resume with checkpoint.resume=<dir>): %s | HF export of the trained model: %s",
                    self.last_ckpt or "none (checkpoint.interval=0)", export_dir)
        return summary


def _describe(hf_config: Any) -> str:
    return (f"{hf_config.model_type} layers={hf_config.num_hidden_layers} hidden={hf_config.hidden_size} "
            f"heads={hf_config.num_attention_heads}/{hf_config.num_key_value_heads} vocab={hf_config.vocab_size}")
