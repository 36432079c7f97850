"""The one run configuration: dataclasses loaded from YAML plus ``key=value`` overrides.

``load_config("run.yaml", ["train.lr=1e-4", "parallel.tp=2"])`` returns a validated
:class:`Config`. An unknown key, a value of the wrong type or an out-of-range value raises
:class:`ConfigError` naming the dotted key, the bad value and what is accepted.
"""
from __future__ import annotations

import dataclasses
import difflib
import math
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml


class ConfigError(ValueError):
    """A bad config file, key or value; the message names it and the fix."""


#: ``model.chat_template`` values: "auto" and ``rollout_sglang.chat_template.CHAT_TEMPLATES``.
CHAT_TEMPLATE_CHOICES = ("auto", "qwen2", "glm4")


@dataclass
class ModelConfig:
    """The policy model.

    hf_config: a Hugging Face config (a directory holding config.json, or a config.json path),
        or None to use ``arch`` below to build a tiny model from scratch (or, with
        megatron_checkpoint set and no arch, the config the converter stored in ``<dir>/hf``).
    arch: inline Hugging Face config fields (``model_type`` plus sizes) used when hf_config is None.
    checkpoint: Hugging Face weights directory (safetensors) to load; None = random init. SGLang
        engines are launched from it (or from hf_config).
    megatron_checkpoint: a megatron-core distributed checkpoint (``agentrl convert hf-to-megatron
        --out-dir``) the trainer loads at start instead of ``checkpoint``'s safetensors, at any
        TP x PP (it reshards on load); None = use ``checkpoint``.
    tokenizer: a tokenizer directory or tokenizer.json file.
    dtype: compute dtype of actor and engine: float32 | bfloat16 | float16.
    chat_template: the chat format of prompts, env replies and tool calls: qwen2 (ChatML with
        Hermes tool calls) | glm4 (GLM-4-0414) | auto (glm4 for a glm4 model, else qwen2).
    """

    hf_config: str | None = None
    arch: dict[str, Any] = field(default_factory=dict)
    checkpoint: str | None = None
    megatron_checkpoint: str | None = None
    tokenizer: str = "examples/tokenizer/tiny_agent"
    dtype: str = "float32"
    chat_template: str = "auto"


@dataclass
class ParallelConfig:
    """Megatron model parallelism; data parallel size = world size / (tp * pp)."""

    tp: int = 1
    pp: int = 1


@dataclass
class TrainConfig:
    """Optimizer and policy-loss settings of the RL phase.

    steps: RL steps (one rollout batch + one optimizer pass each).
    lr: Adam learning rate; weight_decay, adam_beta1/2, grad_clip: as usual.
    micro_batch_size: samples per forward/backward; global batch = the whole rollout batch.
    clip_eps_low / clip_eps_high: PPO ratio clip range [1 - low, 1 + high] (asymmetric allowed).
    seed: seeds model init, sampling and task order.
    tis_cap: truncated importance sampling for stale and cross-policy tokens: > 0 uses the
        decoupled loss (ratio against the trainer's own log-probs at the step start, each token
        weighted by min(pi_old / pi_behavior, tis_cap)); 0 = the classic loss, ratio against the
        behavior log-probs, no weight (see ``megatron_agentrl.algo.losses``).
    kl_coef: weight of the low-variance (k3) KL to the reference policy (the policy when RL
        starts, after the SFT warm-up); 0 = off (no reference model kept).
    entropy_coef: weight of the entropy bonus (mean token entropy is subtracted); 0 = off.
    micro_batch_tokens: token budget of a micro-batch: samples are packed (longest first) so that
        rows x longest row <= budget, each micro-batch cut to its own length; 0 = fixed
        micro_batch_size rows.
    """

    steps: int = 20
    lr: float = 1e-4
    weight_decay: float = 0.0
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    grad_clip: float = 1.0
    micro_batch_size: int = 8
    clip_eps_low: float = 0.2
    clip_eps_high: float = 0.28
    seed: int = 1234
    tis_cap: float = 0.0
    kl_coef: float = 0.0
    entropy_coef: float = 0.0
    micro_batch_tokens: int = 0


@dataclass
class SFTConfig:
    """Optional supervised warm-up on the tasks' scripted demonstrations before RL (0 steps = off).

    short_format_steps: the first of ``steps`` (all of them when larger) render each
        demonstration with an empty system prompt and no tool schemas (sequences ~4x shorter,
        so ~4x cheaper): a tiny model learns to copy arguments from the prompt and tool replies
        there first; the rest use the full chat format of RL.
    careless_fraction: share of the full-format demonstrations played by the task's careless
        player (e.g. answering without the tool) instead of the expert, for tasks that have one;
        the warm-up policy then holds a bad habit that RL has to unlearn from reward alone.
    lr_decay_style: "constant" | "linear" | "cosine": the learning rate goes from ``lr`` down to
        ``min_lr`` over each phase of the warm-up (the short-format steps, then the full-format
        ones: it restarts at ``lr`` when the format changes), so that each phase ends on small,
        low-noise steps; "constant" keeps ``lr`` throughout.
    min_lr: the learning rate at the end of each phase (0 <= min_lr <= lr).
    """

    steps: int = 0
    lr: float = 1e-3
    batch_size: int = 16
    short_format_steps: int = 0
    careless_fraction: float = 0.0
    lr_decay_style: str = "constant"
    min_lr: float = 0.0

    def lr_at(self, step: int) -> float:
        """The learning rate of warm-up step ``step`` (1-based), by ``lr_decay_style``."""
        short = min(self.short_format_steps, self.steps)
        start, length = (0, short) if step <= short else (short, self.steps - short)
        if self.lr_decay_style == "constant" or length <= 1:
            return self.lr
        frac = (step - start - 1) / (length - 1)  # 0 at the phase's first step, 1 at its last
        decay = 1.0 - frac if self.lr_decay_style == "linear" else 0.5 * (1.0 + math.cos(math.pi * frac))
        return self.min_lr + (self.lr - self.min_lr) * decay


@dataclass
class RolloutConfig:
    """Sampling of trajectory groups.

    prompts_per_step: distinct task samples per RL step; samples_per_prompt: group size for GRPO.
    max_turns: agent turns per episode; max_new_tokens: tokens per turn;
    max_total_tokens: whole-episode cap (context limit).

    Engines, versions and weight sync (``rollout_sglang.version_pool``, ``megatron_agentrl.weight_sync``):
    max_versions: version slots kept alive (each sync updates the oldest slot, so the pool holds
        the latest ``max_versions`` weight versions); engines_per_slot: engines per slot.
    cross_policy: which version samples each turn: "latest" (on-policy, cross-policy off),
        "uniform" (every live version alike), "recency" (k-th newest with weight recency_decay**k).
    recency_decay: in (0, 1], used by "recency".
    engine_timeout_s: limit on one generate call and on draining a slot before its update, seconds.
    engine_startup_timeout_s: limit on an SGLang server becoming healthy, seconds.
    weight_sync_bucket_mb: bucket size of the weight broadcast, MiB.
    weight_sync_init_timeout_s / weight_sync_bucket_timeout_s: limits on the weight-sync group
        rendezvous and on each bucket, seconds.
    weight_sync_checksum: verify every bucket on engines that support it (not SGLang's API).
    engine_urls: SGLang servers that are already running, one list per version slot (exactly
        ``max_versions`` slots of ``engines_per_slot`` URLs ``http(s)://host:port`` each), e.g.
        ``[["http://10.0.0.5:30000"], ["http://10.0.0.6:30000"]]``; empty = the run starts its own
        engines (local engines, or SGLang servers that the Ray launcher starts).
    """

    prompts_per_step: int = 8
    samples_per_prompt: int = 4
    temperature: float = 1.0
    top_p: float = 1.0
    max_turns: int = 4
    max_new_tokens: int = 48
    max_total_tokens: int = 512
    max_versions: int = 1
    engines_per_slot: int = 1
    cross_policy: str = "latest"
    recency_decay: float = 0.5
    engine_timeout_s: float = 600.0
    engine_startup_timeout_s: float = 900.0
    weight_sync_bucket_mb: int = 512
    weight_sync_init_timeout_s: float = 300.0
    weight_sync_bucket_timeout_s: float = 120.0
    weight_sync_checksum: bool = False
    engine_urls: list[list[str]] = field(default_factory=list)


@dataclass
class EvalConfig:
    """Per-task success measured before and after RL on held-out samples (0 samples = off).

    samples_per_task: held-out indices per task (taken from the end of each task's index list,
    never trained on); temperature: sampling temperature of the evaluation.
    """

    samples_per_task: int = 32
    temperature: float = 1.0


@dataclass
class AlgoConfig:
    """GRPO settings: group advantages (reward minus group mean, optionally / group std),
    then per-task normalization of token advantages over the global batch."""

    group_std_norm: bool = True
    normalize_per_task: bool = True
    eps: float = 1e-6


@dataclass
class PipelineConfig:
    """How rollout and training are scheduled (``megatron_agentrl.pipeline``).

    mode: "sync" (generate a step's groups, then train on them, then push weights) or "async"
        (rollout keeps groups in flight while the trainer trains; a bounded queue between them).
        Both run the same rollout manager and training step.
    staleness: eta, async only: a new group starts only while
        (version + eta + 1) * prompts_per_step > accepted + running groups, and no trained sample
        has a token more than eta weight versions older than the trained policy (sync: 0).
    queue_size: most finished groups waiting for the trainer plus groups in flight; 0 = auto
        ((eta + 1) * prompts_per_step); at least prompts_per_step.
    cohort_groups: groups that run their turns in lockstep in one agent-loop call; 0 = auto (the
        whole step in sync mode, 1 in async mode).
    batch_timeout_s: limit on the trainer waiting for one batch (and on a checkpoint's drain), s.
    env_timeout_s: limit on every environment call of the agent loop, seconds.
    sim_env_latency_s: > 0 adds simulated environment latency to every env call of the training
        rollouts: Pareto(alpha) seconds with scale (minimum) sim_env_latency_s, capped at
        sim_env_latency_max_s (0 = 100 x the scale). For benchmarks and tests; 0 = off.
    sim_env_latency_alpha: Pareto shape (smaller = heavier tail; 1.5 has a finite mean 3 x scale
        and infinite variance).
    """

    mode: str = "sync"
    staleness: int = 1
    queue_size: int = 0
    cohort_groups: int = 0
    batch_timeout_s: float = 1800.0
    env_timeout_s: float = 120.0
    sim_env_latency_s: float = 0.0
    sim_env_latency_alpha: float = 1.5
    sim_env_latency_max_s: float = 0.0


@dataclass
class CheckpointConfig:
    """Checkpoints (megatron distributed checkpoint of model + optimizer, plus the pipeline state).

    interval: save every this many RL steps (and after the last step); 0 = never.
    dir: where checkpoints go (None: ``<output_dir>/checkpoints``); one ``step_<k>`` folder each
        and a ``latest`` file naming the newest.
    resume: None (start fresh), "latest" (the newest checkpoint under ``dir``, fresh start when
        there is none) or the path of one ``step_<k>`` folder. A resumed run skips the SFT
        warm-up and the first evaluation and trains step k+1 on the batch the uninterrupted run
        would have trained on.
    keep: how many newest checkpoints to keep (older ones are deleted); 0 = keep all.
    """

    interval: int = 0
    dir: str | None = None
    resume: str | None = None
    keep: int = 2


@dataclass
class TaskSpec:
    """One built-in task: its registry ``name``, sampling ``weight`` and constructor ``params``.

    weight: the task's share of RL prompts (relative to the other tasks' weights).
    sft_weight: its share of the warm-up demonstrations (None: ``weight``); e.g. give the task
        the warm-up leaves weakest more RL rollouts without changing the warm-up mixture.
    binary_reward: train on 1.0 for a successful episode (the task's ``success`` metric, else
        reward >= 1) and 0.0 otherwise, instead of the task's own reward.
    timeout_penalty: subtracted from the reward of an episode that ran out of turns or context
        ("task limit reached", "agent context limit") or whose env call timed out (>= 0).
    """

    name: str = ""
    weight: float = 1.0
    sft_weight: float | None = None
    params: dict[str, Any] = field(default_factory=dict)
    binary_reward: bool = False
    timeout_penalty: float = 0.0


@dataclass
class EnvConfig:
    """Where the tasks run when they are not built in (``megatron_agentrl.launch``, the GLM-4 recipe).

    controller_url: an env controller (AgentRL task-worker protocol) that serves the tasks, e.g.
        "http://10.0.0.1:5020"; "" = the built-in tasks run in process (or, with ``ray.controller``,
        behind the controller that the Ray launcher starts).
    workers: the task workers expected to register with that controller, ``{task: [worker API URL, ...]}``
        (``agentrl plan --check`` probes them; the workers register by heartbeat themselves).
    token: bearer token of the controller ("" = ``$AGENTRL_CONTROLLER_TOKEN`` or none).
    """

    controller_url: str = ""
    workers: dict[str, list[str]] = field(default_factory=dict)
    token: str = ""


@dataclass
class RayConfig:
    """Ray placement of a run (``megatron_agentrl.launch.ray_placement``).

    enabled: run ``agentrl train`` as Ray actors; with ``address`` empty a local Ray is started.
    address: a Ray cluster to join ("auto", "host:6379"); setting it implies enabled.
    namespace: Ray namespace of the run's actors and placement groups.
    num_cpus: CPUs a local Ray offers (0 = all of this machine); ignored when joining a cluster.
    train_workers: trainer ranks, the train pool (0 = parallel.tp * parallel.pp, data parallel 1).
    train_gpus_per_worker / train_cpus_per_worker: resources of one trainer rank (0 GPUs on CPU).
    train_strategy: placement strategy of the train pool: PACK, SPREAD, STRICT_PACK or STRICT_SPREAD.
    rollout_gpus_per_engine: GPUs of one rollout engine (its tensor-parallel size); 0 = no rollout
        pool: the engine runs inside trainer rank 0 (the local engine, CPU runs).
    rollout_cpus_per_engine: CPUs of one rollout engine. The rollout side is one placement group
        per version slot (``rollout.max_versions``) of ``rollout.engines_per_slot`` engines.
    rollout_strategy: placement strategy of each rollout slot's group.
    engine_server_module: the module run as ``python -m`` for each engine (SGLang's server).
    controller: start the env controller as a Ray actor in its own placement group.
    controller_cpus / controller_port: its CPUs and port (0 = a free port).
    placement_timeout_s: limit on the placement groups becoming ready, seconds.
    health_check_interval_s: how often the launcher checks its actors and nodes, seconds.
    """

    enabled: bool = False
    address: str = ""
    namespace: str = "agentrl"
    num_cpus: int = 0
    train_workers: int = 0
    train_gpus_per_worker: float = 0.0
    train_cpus_per_worker: float = 1.0
    train_strategy: str = "PACK"
    rollout_gpus_per_engine: int = 0
    rollout_cpus_per_engine: float = 1.0
    rollout_strategy: str = "PACK"
    engine_server_module: str = "sglang.launch_server"
    controller: bool = False
    controller_cpus: float = 1.0
    controller_port: int = 5020
    placement_timeout_s: float = 300.0
    health_check_interval_s: float = 5.0

    @property
    def active(self) -> bool:
        """Whether ``agentrl train`` runs on Ray (``enabled`` or an ``address`` given)."""
        return self.enabled or bool(self.address)


@dataclass
class SlurmConfig:
    """Defaults of ``agentrl slurm submit`` (``megatron_agentrl.launch.slurm``); its flags override them.

    nodes / gpus_per_node: the allocation; cpus_per_node: 0 = what SLURM gives (whole node with exclusive).
    partition, account, time ("HH:MM:SS" or "D-HH:MM:SS"), job_name: as in sbatch ("" = cluster default).
    container_image: run every step in this image (pyxis/enroot ``srun --container-image``); "" = none.
    container_mounts: ``--container-mounts`` of those steps.
    ray: start a Ray cluster in the allocation (head on the first node, workers on the rest) and train
        on it; false = ``agentrl train`` directly (one node), or torchrun on every node.
    ray_port: port of the Ray head; ray_start_timeout_s: limit on all nodes joining, seconds.
    exclusive: ask for whole nodes.
    setup: shell lines run on the first node before anything else (module load, source env, ...).
    sbatch_args: extra ``#SBATCH`` options, e.g. ["--qos=high", "--mem=0"].
    """

    nodes: int = 1
    gpus_per_node: int = 0
    cpus_per_node: int = 0
    partition: str = ""
    account: str = ""
    time: str | int = "04:00:00"
    job_name: str = "agentrl"
    container_image: str = ""
    container_mounts: str = ""
    ray: bool = True
    ray_port: int = 6379
    ray_start_timeout_s: float = 300.0
    exclusive: bool = False
    setup: list[str] = field(default_factory=list)
    sbatch_args: list[str] = field(default_factory=list)


@dataclass
class Config:
    """The whole run. Everything a run writes goes under ``output_dir``."""

    output_dir: str = "outputs/run"
    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    sft: SFTConfig = field(default_factory=SFTConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    algo: AlgoConfig = field(default_factory=AlgoConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    pipeline: PipelineConfig = field(default_factory=PipelineConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    tasks: list[TaskSpec] = field(default_factory=list)
    log_every: int = 1
    env: EnvConfig = field(default_factory=EnvConfig)
    ray: RayConfig = field(default_factory=RayConfig)
    slurm: SlurmConfig = field(default_factory=SlurmConfig)

    def validate(self) -> None:
        """Range checks that types alone cannot express; raises ConfigError."""
        _positive(self, "parallel.tp", "parallel.pp", "train.steps", "train.micro_batch_size",
                  "rollout.prompts_per_step", "rollout.samples_per_prompt", "rollout.max_turns",
                  "rollout.max_new_tokens", "rollout.max_total_tokens", "sft.batch_size")
        if not self.train.lr > 0:
            raise ConfigError(f"train.lr={self.train.lr!r} must be > 0")
        if not self.rollout.temperature > 0:
            raise ConfigError(f"rollout.temperature={self.rollout.temperature!r} must be > 0 (use a small value such as 0.01 for near-greedy)")
        if not 0 < self.rollout.top_p <= 1:
            raise ConfigError(f"rollout.top_p={self.rollout.top_p!r} must be in (0, 1]")
        _positive(self, "rollout.max_versions", "rollout.engines_per_slot", "rollout.weight_sync_bucket_mb")
        if self.rollout.cross_policy not in ("latest", "uniform", "recency"):
            raise ConfigError(f"rollout.cross_policy={self.rollout.cross_policy!r} is not one of latest, uniform, recency "
                              "(latest = on-policy, cross-policy sampling off)")
        if not 0 < self.rollout.recency_decay <= 1:
            raise ConfigError(f"rollout.recency_decay={self.rollout.recency_decay!r} must be in (0, 1]")
        if self.rollout.cross_policy != "latest" and self.rollout.max_versions < 2:
            raise ConfigError(f"rollout.cross_policy={self.rollout.cross_policy!r} needs rollout.max_versions >= 2 "
                              "(one slot holds only the latest version); raise max_versions or use cross_policy=latest")
        for key in ("engine_timeout_s", "engine_startup_timeout_s", "weight_sync_init_timeout_s",
                    "weight_sync_bucket_timeout_s"):
            if not getattr(self.rollout, key) > 0:
                raise ConfigError(f"rollout.{key}={getattr(self.rollout, key)!r} must be > 0 seconds")
        _validate_engine_urls(self.rollout)
        if self.eval.samples_per_task < 0:
            raise ConfigError(f"eval.samples_per_task={self.eval.samples_per_task!r} must be >= 0 (0 disables evaluation)")
        if not self.eval.temperature > 0:
            raise ConfigError(f"eval.temperature={self.eval.temperature!r} must be > 0")
        if self.sft.steps < 0:
            raise ConfigError(f"sft.steps={self.sft.steps!r} must be >= 0 (0 disables the warm-up)")
        if self.sft.short_format_steps < 0:
            raise ConfigError(f"sft.short_format_steps={self.sft.short_format_steps!r} must be >= 0: it counts the "
                              "first warm-up steps (of sft.steps), which use the short format")
        if self.sft.lr_decay_style not in ("constant", "linear", "cosine"):
            raise ConfigError(f"sft.lr_decay_style={self.sft.lr_decay_style!r} is not one of constant, linear, cosine")
        if not 0.0 <= self.sft.min_lr <= self.sft.lr:
            raise ConfigError(f"sft.min_lr={self.sft.min_lr!r} must be in [0, sft.lr={self.sft.lr!r}]: the warm-up "
                              "decays from lr down to min_lr")
        if not 0.0 <= self.sft.careless_fraction < 1.0:
            raise ConfigError(f"sft.careless_fraction={self.sft.careless_fraction!r} must be in [0, 1): "
                              "the share of demonstrations played carelessly")
        if self.model.dtype not in ("float32", "bfloat16", "float16"):
            raise ConfigError(f"model.dtype={self.model.dtype!r} is not one of float32, bfloat16, float16")
        if self.model.hf_config is None and not self.model.arch and not self.model.megatron_checkpoint:
            raise ConfigError("model: set model.hf_config (a Hugging Face config dir) or model.arch (inline config fields)")
        if self.model.chat_template not in CHAT_TEMPLATE_CHOICES:
            raise ConfigError(f"model.chat_template={self.model.chat_template!r} is not one of "
                              f"{', '.join(CHAT_TEMPLATE_CHOICES)} (auto: glm4 for a glm4 model, else qwen2)")
        if not self.tasks:
            raise ConfigError("tasks: the list is empty; add at least one entry such as {name: lookup}")
        for i, t in enumerate(self.tasks):
            if not t.name:
                raise ConfigError(f"tasks[{i}].name is empty; give a registered task name")
            if not t.weight > 0:
                raise ConfigError(f"tasks[{i}].weight={t.weight!r} must be > 0")
            if t.sft_weight is not None and not t.sft_weight > 0:
                raise ConfigError(f"tasks[{i}].sft_weight={t.sft_weight!r} must be > 0 (or left out: the task's weight)")
            if t.timeout_penalty < 0:
                raise ConfigError(f"tasks[{i}].timeout_penalty={t.timeout_penalty!r} must be >= 0 "
                                  "(it is subtracted from the reward)")
        self._validate_train_extras()
        self._validate_pipeline()
        self._validate_checkpoint()
        _validate_launch(self)

    def _validate_train_extras(self) -> None:
        t = self.train
        for key in ("tis_cap", "kl_coef", "entropy_coef"):
            if getattr(t, key) < 0:
                raise ConfigError(f"train.{key}={getattr(t, key)!r} must be >= 0 (0 turns it off)")
        if 0 < t.tis_cap < 1:
            raise ConfigError(f"train.tis_cap={t.tis_cap!r} must be 0 (off) or >= 1 (a cap below 1 would "
                              "down-weight on-policy tokens); 2.0 is a common choice")
        if t.micro_batch_tokens < 0:
            raise ConfigError(f"train.micro_batch_tokens={t.micro_batch_tokens!r} must be >= 0 "
                              "(0 = fixed train.micro_batch_size rows per micro-batch)")
        if 0 < t.micro_batch_tokens < self.rollout.max_total_tokens:
            raise ConfigError(f"train.micro_batch_tokens={t.micro_batch_tokens} is smaller than one episode can be "
                              f"(rollout.max_total_tokens={self.rollout.max_total_tokens}); raise it to at least that")

    def _validate_pipeline(self) -> None:
        p = self.pipeline
        if p.mode not in ("sync", "async"):
            raise ConfigError(f"pipeline.mode={p.mode!r} is not one of sync, async")
        if p.staleness < 0:
            raise ConfigError(f"pipeline.staleness={p.staleness!r} must be >= 0 (0 = every sample from the "
                              "newest weights)")
        if p.queue_size < 0:
            raise ConfigError(f"pipeline.queue_size={p.queue_size!r} must be >= 0 (0 = auto)")
        if 0 < p.queue_size < self.rollout.prompts_per_step:
            raise ConfigError(f"pipeline.queue_size={p.queue_size} cannot hold one step's "
                              f"rollout.prompts_per_step={self.rollout.prompts_per_step} groups; raise it or use 0 (auto)")
        if p.cohort_groups < 0:
            raise ConfigError(f"pipeline.cohort_groups={p.cohort_groups!r} must be >= 0 (0 = auto)")
        if p.cohort_groups > self.rollout.prompts_per_step:
            raise ConfigError(f"pipeline.cohort_groups={p.cohort_groups} exceeds rollout.prompts_per_step="
                              f"{self.rollout.prompts_per_step}; use at most that (or 0 = auto)")
        for key in ("batch_timeout_s", "env_timeout_s"):
            if not getattr(p, key) > 0:
                raise ConfigError(f"pipeline.{key}={getattr(p, key)!r} must be > 0 seconds")
        if p.sim_env_latency_s < 0 or p.sim_env_latency_max_s < 0:
            raise ConfigError("pipeline.sim_env_latency_s and pipeline.sim_env_latency_max_s must be >= 0 (0 = off / auto)")
        if not p.sim_env_latency_alpha > 0:
            raise ConfigError(f"pipeline.sim_env_latency_alpha={p.sim_env_latency_alpha!r} must be > 0")
        eta = p.staleness if p.mode == "async" else 0
        if self.rollout.cross_policy != "latest" and self.rollout.max_versions - 1 > eta:
            raise ConfigError(
                f"rollout.max_versions={self.rollout.max_versions} keeps weights up to {self.rollout.max_versions - 1} "
                f"versions old for cross-policy sampling, but pipeline.staleness allows {eta} "
                f"(mode {p.mode}); use pipeline.mode=async with pipeline.staleness >= {self.rollout.max_versions - 1}, "
                "or lower rollout.max_versions"
            )

    def _validate_checkpoint(self) -> None:
        c = self.checkpoint
        if c.interval < 0:
            raise ConfigError(f"checkpoint.interval={c.interval!r} must be >= 0 (0 = no checkpoints)")
        if c.keep < 0:
            raise ConfigError(f"checkpoint.keep={c.keep!r} must be >= 0 (0 = keep all)")
        if c.resume is not None and c.resume != "latest" and not Path(c.resume).is_dir():
            raise ConfigError(f"checkpoint.resume={c.resume!r} is not a directory; give 'latest' or the path of a "
                              "step_<k> checkpoint folder (under <output_dir>/checkpoints)")


def _validate_engine_urls(r: RolloutConfig) -> None:
    """``rollout.engine_urls``: empty, or max_versions slots of engines_per_slot http(s)://host:port URLs."""
    if not r.engine_urls:
        return
    shape = [len(slot) for slot in r.engine_urls]
    if len(shape) != r.max_versions or any(n != r.engines_per_slot for n in shape):
        raise ConfigError(f"rollout.engine_urls={r.engine_urls!r} has {len(shape)} slot(s) of {shape} URL(s), but "
                          f"rollout.max_versions={r.max_versions} slots of rollout.engines_per_slot="
                          f"{r.engines_per_slot} URL(s) each are needed; give one list of SGLang server URLs per "
                          "version slot, or [] to start the engines here")
    for i, slot in enumerate(r.engine_urls):
        for j, url in enumerate(slot):
            if not _is_host_port_url(url):
                raise ConfigError(f"rollout.engine_urls[{i}][{j}]={url!r} is not an http(s)://host:port URL "
                                  "such as http://10.0.0.5:30000")


def _is_host_port_url(url: str) -> bool:
    """True for ``http(s)://host:port`` with an optional trailing slash and nothing else."""
    from urllib.parse import urlsplit

    try:
        u = urlsplit(url)
        port = u.port
    except ValueError:
        return False
    return (u.scheme in ("http", "https") and bool(u.hostname) and port is not None and u.path in ("", "/")
            and not (u.query or u.fragment or u.username or u.password))


_RAY_STRATEGIES = ("PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD")


def _validate_launch(cfg: Config) -> None:
    """Range checks of the ``env``, ``ray`` and ``slurm`` sections."""
    import re

    r, s = cfg.ray, cfg.slurm
    if r.train_workers < 0 or (r.train_workers and r.train_workers % (cfg.parallel.tp * cfg.parallel.pp)):
        raise ConfigError(f"ray.train_workers={r.train_workers!r} must be 0 (= parallel.tp * parallel.pp) or a positive "
                          f"multiple of parallel.tp * parallel.pp = {cfg.parallel.tp * cfg.parallel.pp}")
    for key in ("train_gpus_per_worker", "rollout_gpus_per_engine", "num_cpus", "controller_port"):
        if getattr(r, key) < 0:
            raise ConfigError(f"ray.{key}={getattr(r, key)!r} must be >= 0")
    for key in ("train_cpus_per_worker", "rollout_cpus_per_engine", "controller_cpus", "placement_timeout_s",
                "health_check_interval_s"):
        if not getattr(r, key) > 0:
            raise ConfigError(f"ray.{key}={getattr(r, key)!r} must be > 0")
    if r.train_gpus_per_worker > 1 and r.train_gpus_per_worker != int(r.train_gpus_per_worker):
        raise ConfigError(f"ray.train_gpus_per_worker={r.train_gpus_per_worker!r}: above 1 only whole GPUs are possible")
    for key in ("train_strategy", "rollout_strategy"):
        if getattr(r, key) not in _RAY_STRATEGIES:
            raise ConfigError(f"ray.{key}={getattr(r, key)!r} is not one of {', '.join(_RAY_STRATEGIES)}")
    if r.address and not (r.address == "auto" or re.fullmatch(r"(ray://)?[\w.\-\[\]:]+:\d+", r.address)):
        raise ConfigError(f"ray.address={r.address!r} is not 'auto' or host:port (e.g. 10.0.0.1:6379); "
                          "leave it empty to start a local Ray")
    _positive(cfg, "slurm.nodes")
    for key in ("gpus_per_node", "cpus_per_node"):
        if getattr(s, key) < 0:
            raise ConfigError(f"slurm.{key}={getattr(s, key)!r} must be >= 0")
    if not 0 < s.ray_port < 65536:
        raise ConfigError(f"slurm.ray_port={s.ray_port!r} must be a TCP port (1-65535)")
    if not s.ray_start_timeout_s > 0:
        raise ConfigError(f"slurm.ray_start_timeout_s={s.ray_start_timeout_s!r} must be > 0 seconds")
    if isinstance(s.time, int):
        raise ConfigError(f"slurm.time={s.time!r} was read as a number (YAML reads an unquoted 04:00:00 in base 60); "
                          "quote it: time: \"04:00:00\" (on the command line: --time 04:00:00)")
    if s.time and not re.fullmatch(r"(\d+-)?\d+(:\d{2}){0,2}", s.time):
        raise ConfigError(f"slurm.time={s.time!r} is not a SLURM time limit such as 04:00:00 or 1-12:00:00")
    if cfg.env.controller_url and not cfg.env.controller_url.startswith(("http://", "https://")):
        raise ConfigError(f"env.controller_url={cfg.env.controller_url!r} must start with http:// or https://, "
                          "e.g. http://127.0.0.1:5020")
    for task, urls in cfg.env.workers.items():
        if not isinstance(urls, list) or not all(isinstance(u, str) and u.startswith(("http://", "https://")) for u in urls):
            raise ConfigError(f"env.workers.{task}={urls!r} must be a list of worker URLs such as "
                              "['http://10.0.0.2:5021/api']")


def _positive(cfg: Config, *keys: str) -> None:
    for key in keys:
        obj: Any = cfg
        for part in key.split("."):
            obj = getattr(obj, part)
        if obj < 1:
            raise ConfigError(f"{key}={obj!r} must be a positive integer")


def _resolve_hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _coerce(value: Any, hint: Any, key: str) -> Any:
    """Check/convert ``value`` to the annotated type ``hint``; ConfigError on mismatch."""
    origin = typing.get_origin(hint)
    args = typing.get_args(hint)
    if hint is Any:
        return value
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        errors = []
        for a in args:
            if a is type(None):
                continue
            try:
                return _coerce(value, a, key)
            except ConfigError as e:
                errors.append(str(e))
        raise ConfigError(errors[0] if errors else f"{key}: bad value {value!r}")
    if dataclasses.is_dataclass(hint):
        if isinstance(value, hint):
            return value
        if not isinstance(value, dict):
            raise ConfigError(f"{key} must be a mapping of {hint.__name__} fields, got {value!r}")
        return _build(hint, value, key)
    if origin is list:
        if not isinstance(value, list):
            raise ConfigError(f"{key} must be a list, got {value!r}")
        (item,) = args or (Any,)
        return [_coerce(v, item, f"{key}[{i}]") for i, v in enumerate(value)]
    if origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{key} must be a mapping, got {value!r}")
        return dict(value)
    if hint is bool:
        if isinstance(value, bool):
            return value
        raise ConfigError(f"{key}={value!r} must be true or false")
    if hint is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        raise ConfigError(f"{key}={value!r} must be an integer")
    if hint is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        raise ConfigError(f"{key}={value!r} must be a number")
    if hint is str:
        if isinstance(value, str):
            return value
        raise ConfigError(f"{key}={value!r} must be a string")
    return value


def _build(cls: type, data: dict[str, Any], prefix: str) -> Any:
    hints = _resolve_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    kwargs = {}
    for k, v in data.items():
        key = f"{prefix}.{k}" if prefix else str(k)
        if k not in names:
            close = difflib.get_close_matches(str(k), names, n=1, cutoff=0.5)
            if not close:
                close = [n for n in names if _abbreviates(n, str(k))][:1]
            hint = f"; did you mean '{(prefix + '.' if prefix else '') + close[0]}'?" if close else ""
            raise ConfigError(f"unknown config key '{key}'{hint} (valid keys here: {', '.join(names)})")
        kwargs[k] = _coerce(v, hints[k], key)
    return cls(**kwargs)


def _abbreviates(short: str, long: str) -> bool:
    """True when ``short`` is an abbreviation of ``long`` (same first letter, letters in order): lr ~ learning_rate."""
    it = iter(long)
    return bool(short) and short[0] == long[:1] and all(c in it for c in short)


def _set_dotted(data: dict[str, Any], key: str, value: Any) -> None:
    parts = key.split(".")
    node = data
    for p in parts[:-1]:
        nxt = node.get(p)
        if nxt is None:
            nxt = node[p] = {}
        if not isinstance(nxt, dict):
            raise ConfigError(f"override '{key}': '{p}' is not a section")
        node = nxt
    node[parts[-1]] = value


def load_config(path: str | Path | None = None, overrides: list[str] | None = None) -> Config:
    """Load a YAML config, apply ``key=value`` overrides (values parsed as YAML), validate.

    Raises ConfigError for a missing/unreadable file, bad YAML, an unknown key or a bad value.
    """
    data: dict[str, Any] = {}
    if path is not None:
        p = Path(path)
        if not p.is_file():
            raise ConfigError(f"config file '{path}' does not exist; pass an existing YAML file such as examples/configs/tiny_cpu.yaml")
        try:
            loaded = yaml.safe_load(p.read_text())
        except yaml.YAMLError as e:
            raise ConfigError(f"config file '{path}' is not valid YAML: {e}") from None
        if loaded is None:
            loaded = {}
        if not isinstance(loaded, dict):
            raise ConfigError(f"config file '{path}' must hold a mapping at the top level, got {type(loaded).__name__}")
        data = loaded
    for ov in overrides or []:
        if "=" not in ov:
            raise ConfigError(f"override '{ov}' is not of the form key=value (e.g. train.lr=1e-4)")
        key, raw = ov.split("=", 1)
        try:
            value = yaml.safe_load(raw) if raw != "" else ""
        except yaml.YAMLError:
            value = raw
        # YAML reads 1e-4 as a string; accept plain float literals too.
        if isinstance(value, str):
            try:
                value = float(value) if any(c in value for c in ".eE") else value
            except ValueError:
                pass
        _set_dotted(data, key.strip(), value)
    cfg = _build(Config, data, "")
    cfg.validate()
    return cfg


def config_to_dict(cfg: Config) -> dict[str, Any]:
    """Plain-dict form of the config (for saving next to the run's outputs)."""
    return dataclasses.asdict(cfg)
