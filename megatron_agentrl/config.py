"""The one run configuration: dataclasses loaded from YAML plus ``key=value`` overrides.

``load_config("run.yaml", ["train.lr=1e-4", "parallel.tp=2"])`` returns a validated
:class:`Config`. Each section checks its own fields when it is built (``__post_init__``, with
``Literal`` types for choices), so one class holds a section's fields and their rules; the
checks that span sections live in :meth:`Config.validate`. An unknown key, a value of the wrong
type or an out-of-range value raises :class:`ConfigError` naming the dotted key, the bad value
and what is accepted.
"""
from __future__ import annotations

import dataclasses
import json
import math
import re
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Literal

import yaml

from env_controller.clients.options import ControllerAccess
from env_controller.http.net import is_host
from env_controller.options import FieldError, Options, build_options, placed
from env_controller.options import OptionError as ConfigError
from megatron_agentrl.lora.options import LoraOptions
from megatron_agentrl.parallel_layout import ParallelLayout
from rollout_sglang.chat_template import CHAT_TEMPLATES, thinking_switch_problem
from rollout_sglang.distill.options import DistillOptions
from rollout_sglang.engines.sglang_server_args import server_arg, server_args_argv
from rollout_sglang.episode_options import EpisodeLimits
from rollout_sglang.gateway.options import AgentRunnerOptions, GatewayOptions
from rollout_sglang.rollout.admission import AdmissionOptions
from rollout_sglang.rollout.dynamic_sampling import DynamicSamplingOptions
from rollout_sglang.rollout.retries import DropLimitOptions, RetryOptions
from rollout_sglang.weight_sync_limits import WeightSyncLimits

#: ``model.chat_template`` values: "auto" (the default format of the model's family, which
#: ``megatron_agentrl.convert.resolve_chat_template`` reads from the family registry) and the formats of
#: ``rollout_sglang.chat_template``.
CHAT_TEMPLATE_CHOICES: tuple[str, ...] = ("auto", *CHAT_TEMPLATES)
RayStrategy = Literal["PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"]


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


@dataclass
class ModelConfig(Options):
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
    chat_template: the chat format of prompts, env replies and tool calls: qwen2 (Qwen2.5: ChatML with
        Hermes tool calls) | qwen3 (Qwen3 / Qwen3-MoE: qwen2's turns without a default system message,
        <think> reasoning) | glm4 (GLM-4-0414) | glm45 (GLM-4.5 / GLM-4.5-Air: <arg_key>/<arg_value>
        tool calls, <think> reasoning) | auto (the format the model's family declares in
        ``megatron_agentrl.convert``; qwen2 for a model type without a family). The names are
        ``rollout_sglang.chat_template.CHAT_TEMPLATES`` (:data:`CHAT_TEMPLATE_CHOICES`).
    enable_thinking: the official template's ``enable_thinking`` switch, for the formats that have one (qwen3,
        glm45): null (the default) = the format's default, on; false = no reasoning: the generation prompt ends with
        an empty think block (and, GLM-4.5, each user message with ``/nothink``), as the template writes it; the
        same template object renders the engine's prompts and the trainer's encoding. Refused for a format without
        the switch (checked here for a named format, when the format is built for auto).

    Which of hf_config / arch / megatron_checkpoint is set is checked by :meth:`Config.validate`
    (a section may be built empty and filled in).
    """

    KEY: ClassVar[str] = "model"

    hf_config: str | None = None
    arch: dict[str, Any] = field(default_factory=dict)
    checkpoint: str | None = None
    megatron_checkpoint: str | None = None
    tokenizer: str = "examples/tokenizer/tiny_agent"
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    chat_template: str = "auto"
    enable_thinking: bool | None = None

    def check(self) -> None:
        """See :class:`Options`; the paths are checked where they are read (``megatron_agentrl.hf_io``)."""
        super().check()
        self.require(self.chat_template in CHAT_TEMPLATE_CHOICES, "chat_template",
                     f"is not one of {', '.join(CHAT_TEMPLATE_CHOICES)} (auto: the default format of the model's "
                     "family, qwen2 for a model type without one)")
        problem = thinking_switch_problem(self.chat_template, self.enable_thinking)
        self.require(problem is None, "enable_thinking", f"is set but {problem}")
        for name in ("hf_config", "checkpoint", "megatron_checkpoint", "tokenizer"):
            self.require(getattr(self, name) != "", name, "is empty; give a path"
                         + ("" if name == "tokenizer" else " or leave it out"))

    def hf_field(self, name: str) -> Any:
        """Field ``name`` of the policy's Hugging Face config as far as it can be read here: from ``arch``, or
        from the config.json of ``hf_config`` / ``megatron_checkpoint`` when it exists (None otherwise; a bad
        path is reported where it is read)."""
        if self.hf_config is None and self.arch:
            return self.arch.get(name)
        path = Path(self.hf_config) if self.hf_config is not None else (
            Path(self.megatron_checkpoint) / "hf" if self.megatron_checkpoint else None)
        if path is None:
            return None
        path = path / "config.json" if path.is_dir() else path
        try:
            return read_mapping_file(path, "json", str(path)).get(name)
        except ConfigError:
            return None

    def num_layers(self) -> int | None:
        """``num_hidden_layers`` of the policy as far as it can be read here (see :meth:`hf_field`)."""
        value = self.hf_field("num_hidden_layers")
        return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


@dataclass
class ParallelConfig(ParallelLayout):
    """Megatron model parallelism (``parallel:``): the fields ``tp``, ``pp``, ``cp``, ``ep`` and the rules of
    :class:`~megatron_agentrl.parallel_layout.ParallelLayout`, its messages naming them ``parallel.<field>``; and
    how long the trainer's ranks wait for each other."""

    KEY: ClassVar[str] = "parallel"

    #: limit on one collective of the trainer's ranks (a gradient all-reduce, a pipeline send; NCCL's watchdog,
    #: gloo's wait), seconds: how soon a dead or hung rank ends the run
    collective_timeout_s: float = 600.0
    #: limit on the other ranks waiting for work rank 0 does alone (taking a batch from the rollouts, an
    #: evaluation, a checkpoint's drain of the rollouts in flight, writing the LoRA base and the exports), seconds;
    #: they wait on a gloo group of their own, so this may exceed collective_timeout_s (a rank 0 that dies ends the
    #: wait at once); more than pipeline.batch_timeout_s, which bounds rank 0's waits for rollouts
    rank0_timeout_s: float = 7200.0

    def check(self) -> None:
        """See :class:`Options`."""
        super().check()
        self.require_seconds("collective_timeout_s", "rank0_timeout_s")


def scheduled_lr(step: int, length: int, peak: float, min_lr: float, style: str, warmup: int = 0) -> float:
    """The learning rate of step ``step`` (1-based) of a phase of ``length`` steps: a linear warm-up to
    ``peak`` over the first ``warmup`` steps, then ``style`` ("constant" | "linear" | "cosine") from
    ``peak`` at the first step after the warm-up down to ``min_lr`` at the phase's last step (what
    megatron's ``OptimizerParamScheduler`` does, per phase)."""
    if step <= warmup:
        return peak * step / warmup
    length -= warmup
    if style == "constant" or length <= 1:
        return peak
    frac = min(1.0, (step - warmup - 1) / (length - 1))  # 0 at the first decaying step, 1 at the last
    decay = 1.0 - frac if style == "linear" else 0.5 * (1.0 + math.cos(math.pi * frac))
    return min_lr + (peak - min_lr) * decay


@dataclass
class TrainConfig(Options):
    """Optimizer settings of the RL phase (the policy loss has its own section, :class:`LossConfig`).

    steps: RL steps (one rollout batch + one optimizer pass each).
    lr: Adam learning rate; weight_decay (>= 0), adam_beta1/2 (in [0, 1)), grad_clip (0 = off): as usual.
    lr_warmup_steps: the first RL steps raise the learning rate linearly from lr / lr_warmup_steps to lr.
    lr_decay_style: "constant" | "linear" | "cosine": after the warm-up, from ``lr`` down to ``min_lr``
        at the last RL step; min_lr: 0 <= min_lr <= lr.
    micro_batch_size: samples per forward/backward; global batch = the whole rollout batch.
    seed: seeds model init, sampling and task order (0 <= seed < 2**32).
    micro_batch_tokens: token budget of a micro-batch (samples placed longest first): packed, the
        summed lengths of its samples <= budget; unpacked, rows x longest row <= budget, each
        micro-batch cut to its own length; 0 = micro_batch_size samples per micro-batch.
    sequence_packing: pack each micro-batch's samples into one sequence (THD, ``cu_seqlens``;
        positions restart in every sample, attention stays within it), so that no token is
        computed for padding; false = right-padded rows.
    use_distributed_optimizer: megatron-core's distributed optimizer: the fp32 main weights and
        Adam moments are sharded over the data-parallel ranks (each holds 1/DP of them), gradients
        reduce-scattered and parameters all-gathered; false = every DP rank keeps all of them.
    recompute: activation recomputation in the backward pass: "none"; "selective" (the core
        attention of every layer: megatron-core's ``recompute_granularity=selective``); "full"
        (whole layers: only each layer's input is kept).
    recompute_num_layers: with recompute=full, how many layers of each pipeline stage recompute
        (the first ones; megatron's ``recompute_method=block``); 0 = all of them.
    moe_aux_loss_coeff: mixture-of-experts models: weight of the router's auxiliary load-balancing
        loss (megatron's ``aux_loss``); 0 = off, the usual choice in RL, where routing should stay as
        the engines sample it.
    moe_capacity_factor: expert capacity as a multiple of an even share of the tokens (tokens past it
        are dropped, counted in ``moe/dropped_frac``); null = no dropping (dropless).
    moe_routing_replay: mixture-of-experts models: rollout routing replay (R3): every forward of the trainer
        (loss, old and reference log-probs) routes each token to the experts the engine chose for it
        (``rollout.capture_routing`` must not be off); false = the trainer's own top-k. Either way
        ``routing/flip_rate`` reports how often the two differ (docs/training.md, "MoE routing replay").
    """

    KEY: ClassVar[str] = "train"
    MOVED: ClassVar[dict[str, str]] = {name: f"loss.{name}" for name in (
        "clip_eps_low", "clip_eps_high", "tis_cap", "kl_coef", "kl_estimator", "entropy_coef", "ratio_level",
        "mis_cap", "mis_level")}

    steps: int = 20
    lr: float = 1e-4
    lr_warmup_steps: int = 0
    lr_decay_style: Literal["constant", "linear", "cosine"] = "constant"
    min_lr: float = 0.0
    weight_decay: float = 0.0
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    grad_clip: float = 1.0
    micro_batch_size: int = 8
    seed: int = 1234
    micro_batch_tokens: int = 0
    sequence_packing: bool = True
    use_distributed_optimizer: bool = True
    recompute: Literal["none", "selective", "full"] = "none"
    recompute_num_layers: int = 0
    moe_aux_loss_coeff: float = 0.0
    moe_capacity_factor: float | None = None
    moe_routing_replay: bool = False

    def check(self) -> None:
        """See :class:`Options`."""
        super().check()
        self.require_positive_int("steps", "micro_batch_size")
        self.require_above_zero("lr")
        self.require(0 <= self.lr_warmup_steps < self.steps, "lr_warmup_steps",
                     f"must be in [0, train.steps={self.steps}): the warm-up's steps come first")
        self.require(0.0 <= self.min_lr <= self.lr, "min_lr", f"must be in [0, train.lr={self.lr!r}]: RL decays "
                     "from lr down to min_lr")
        self.require_non_negative("weight_decay")
        self.require_non_negative("grad_clip", why="0 = no clipping")
        for name in ("adam_beta1", "adam_beta2"):
            self.require(0 <= getattr(self, name) < 1, name, "must be in [0, 1) (a decay rate of Adam's moments)")
        self.require(0 <= self.seed < 2**32, "seed", "must be in [0, 2**32)")
        self.require_non_negative("micro_batch_tokens", why="0 = train.micro_batch_size samples per micro-batch")
        self.require_non_negative("recompute_num_layers", why="0 = every layer of a stage, with recompute=full")
        self.require(self.recompute_num_layers == 0 or self.recompute == "full", "recompute_num_layers",
                     f"only applies to train.recompute=full (it is {self.recompute!r}); set it to 0")
        self.require_non_negative("moe_aux_loss_coeff", why="0 turns it off")
        self.require(self.moe_capacity_factor is None or self.moe_capacity_factor > 0, "moe_capacity_factor",
                     "must be > 0 (1.0 = an even share per expert), or null for no token dropping")

    def lr_at(self, step: int) -> float:
        """The learning rate of RL step ``step`` (1-based): warm-up, then ``lr_decay_style``."""
        return scheduled_lr(step, self.steps, self.lr, self.min_lr, self.lr_decay_style, self.lr_warmup_steps)

    def check_recompute_layers(self, num_layers: int, layout: ParallelLayout) -> int:
        """``recompute_num_layers`` asks for no more layers than a pipeline stage of ``layout`` has, of a model of
        ``num_layers``; returns the layers of a stage (:meth:`ParallelLayout.stage_layers`, which checks them)."""
        stage = layout.stage_layers(num_layers)
        self.require(self.recompute_num_layers <= stage, "recompute_num_layers",
                     f"exceeds the {stage} layers of a pipeline stage (num_hidden_layers={num_layers} / "
                     f"{layout.key('pp')}={layout.pp}); use at most {stage} (0 = all of them)")
        return stage


@dataclass
class LossConfig(Options):
    """The policy loss of the RL phase (``megatron_agentrl.algo.losses.policy_loss``, per micro-batch).

    clip_eps_low / clip_eps_high: PPO ratio clip range [1 - low, 1 + high] (asymmetric allowed;
        low in [0, 1), high >= 0).
    tis_cap: truncated importance sampling for stale and cross-policy tokens: > 0 uses the
        decoupled loss (ratio against the trainer's own log-probs at the step start, each token
        weighted by min(pi_old / pi_behavior, tis_cap)); 0 = the classic loss, ratio against the
        behavior log-probs, no weight.
    kl_coef: weight of the KL to the reference policy (the policy when RL starts, after the SFT
        warm-up); 0 = off (no reference model kept).
    kl_estimator: the per-token KL term: "k3" (``exp(d) - d - 1``, GRPO's) or "k2" (``d**2 / 2``,
        whose gradient stays linear in ``d = log p_ref - log p``; see ``algo.losses.kl_to_reference``).
    entropy_coef: weight of the entropy bonus (mean token entropy is subtracted); 0 = off.
    ratio_level: "token" (PPO / GRPO: a ratio and a clip per token) or "sequence" (GSPO: one ratio per
        sequence, the geometric mean of its tokens' ratios, clipped as one; use small clip ranges, e.g.
        3e-4 / 4e-4).
    mis_cap: masked importance sampling for stale and cross-policy tokens ("ICEPOP"): tokens (or, with
        ``mis_level: sequence``, whole sequences, by the geometric mean of their ratios) whose
        pi_old / pi_behavior lies outside [1 / mis_cap, mis_cap] get no gradient; 0 = off, else > 1.
        Combines with ``tis_cap`` (truncation of the weights that stay).
    mis_level: "token" or "sequence": what ``mis_cap`` drops.
    agg: how per-token losses make the batch loss: "token_mean" (every token of the batch alike),
        "seq_mean_token_sum" (sum over each sequence's tokens, mean over sequences), or
        "seq_mean_token_mean" (mean over each sequence's tokens, then over sequences).
    """

    KEY: ClassVar[str] = "loss"

    clip_eps_low: float = 0.2
    clip_eps_high: float = 0.28
    tis_cap: float = 0.0
    kl_coef: float = 0.0
    kl_estimator: Literal["k3", "k2"] = "k3"
    entropy_coef: float = 0.0
    ratio_level: Literal["token", "sequence"] = "token"
    mis_cap: float = 0.0
    mis_level: Literal["token", "sequence"] = "token"
    agg: Literal["token_mean", "seq_mean_token_sum", "seq_mean_token_mean"] = "token_mean"

    def check(self) -> None:
        """See :class:`Options`."""
        super().check()
        self.require(0 <= self.clip_eps_low < 1, "clip_eps_low",
                     "must be in [0, 1): the ratio is clipped from below at 1 - clip_eps_low (0.2 is usual)")
        self.require(self.clip_eps_high >= 0, "clip_eps_high",
                     "must be >= 0: the ratio is clipped from above at 1 + clip_eps_high (0.28 is usual)")
        self.require_non_negative("tis_cap", "kl_coef", "entropy_coef", why="0 turns it off")
        self.require(not 0 < self.tis_cap < 1, "tis_cap", "must be 0 (off) or >= 1 (a cap below 1 would "
                     "down-weight on-policy tokens); 2.0 is a common choice")
        self.require(self.mis_cap == 0 or self.mis_cap > 1, "mis_cap",
                     "must be 0 (off) or > 1: tokens whose ratio lies outside [1 / mis_cap, mis_cap] are masked "
                     "(2.0 is a common choice)")

    @property
    def needs_old_logprobs(self) -> bool:
        """Whether the loss weighs or masks tokens by ``pi_old / pi_behavior`` (``tis_cap`` or ``mis_cap``)."""
        return self.tis_cap > 0 or self.mis_cap > 0

    @property
    def needs_sequences(self) -> bool:
        """Whether a term of the loss is taken per sequence (GSPO's ratio, sequence-level MIS)."""
        return self.ratio_level == "sequence" or (self.mis_cap > 0 and self.mis_level == "sequence")


@dataclass
class SFTConfig(Options):
    """Optional supervised warm-up on the tasks' scripted demonstrations before RL (0 steps = off).

    short_format_steps: the first of ``steps`` (all of them when larger) render each
        demonstration with an empty system prompt and no tool schemas (much shorter sequences,
        so cheaper steps): a tiny model learns to copy arguments from the prompt and tool replies
        there first; the rest use the full chat format of RL.
    careless_fraction: share of the full-format demonstrations played by the task's careless
        player (e.g. answering without the tool) instead of the expert, for tasks that have one;
        the warm-up policy then holds a bad habit that RL has to unlearn from reward alone.
    lr_decay_style: "constant" | "linear" | "cosine": the learning rate goes from ``lr`` down to
        ``min_lr`` over each phase of the warm-up (the short-format steps, then the full-format
        ones: it restarts at ``lr`` when the format changes), so that each phase ends on small,
        low-noise steps; "constant" keeps ``lr`` throughout.
    min_lr: the learning rate at the end of each phase (0 <= min_lr <= lr).
    full_format_lr: the learning rate the full-format phase starts from (default: ``lr``), so that
        the two phases can run at different rates.
    lr_warmup_steps: the first warm-up steps raise the learning rate linearly from lr / lr_warmup_steps
        to lr (the first phase only; the second starts with the optimizer's moments of the first).
    """

    KEY: ClassVar[str] = "sft"

    steps: int = 0
    lr: float = 1e-3
    batch_size: int = 16
    short_format_steps: int = 0
    careless_fraction: float = 0.0
    lr_decay_style: Literal["constant", "linear", "cosine"] = "constant"
    min_lr: float = 0.0
    full_format_lr: float | None = None
    lr_warmup_steps: int = 0

    def check(self) -> None:
        """See :class:`Options`."""
        super().check()
        self.require_non_negative("steps", why="0 disables the warm-up")
        self.require_above_zero("lr")
        self.require_positive_int("batch_size")
        self.require(self.short_format_steps >= 0, "short_format_steps", "must be >= 0: it counts the first "
                     "warm-up steps (of sft.steps), which use the short format")
        first = min(self.short_format_steps, self.steps) or self.steps
        self.require(isinstance(self.lr_warmup_steps, int) and 0 <= self.lr_warmup_steps < max(first, 1),
                     "lr_warmup_steps", f"must be an integer in [0, {first}): the learning rate rises over the first "
                     "steps of the warm-up's first phase")
        self.require(0.0 <= self.min_lr <= self.lr, "min_lr", f"must be in [0, sft.lr={self.lr!r}]: the warm-up "
                     "decays from lr down to min_lr")
        if self.full_format_lr is not None:
            self.require_above_zero("full_format_lr")
            self.require(self.min_lr <= self.full_format_lr, "full_format_lr", f"must be >= sft.min_lr="
                         f"{self.min_lr!r}: the full-format phase decays from it down to min_lr")
        self.require(0.0 <= self.careless_fraction < 1.0, "careless_fraction", "must be in [0, 1): the share of "
                     "demonstrations played carelessly")

    def lr_at(self, step: int) -> float:
        """The learning rate of warm-up step ``step`` (1-based), by ``lr_decay_style``."""
        short = min(self.short_format_steps, self.steps)
        start, length = (0, short) if step <= short else (short, self.steps - short)
        peak = self.lr if step <= short or self.full_format_lr is None else self.full_format_lr
        warmup = self.lr_warmup_steps if start == 0 else 0
        return scheduled_lr(step - start, length, peak, self.min_lr, self.lr_decay_style, warmup)


@dataclass
class RolloutConfig(EpisodeLimits, RetryOptions, WeightSyncLimits, AgentRunnerOptions):
    """Sampling of trajectory groups.

    Four groups of fields are declared and checked by the components that use them, and the section is handed to
    them as it is: the episode limits ``max_turns`` and ``max_total_tokens``
    (:class:`~rollout_sglang.episode_options.EpisodeLimits`: the agent loop, the gateway), the treatment of
    infrastructure failures, ``min_valid_fraction`` and ``max_attempts``
    (:class:`~rollout_sglang.rollout.retries.RetryOptions`: the rollout manager), the weight sync's
    ``weight_sync_bucket_mb``, ``weight_sync_init_timeout_s`` and ``weight_sync_bucket_timeout_s``
    (:class:`~rollout_sglang.weight_sync_limits.WeightSyncLimits`: the trainer's sender and its broadcasters), and
    ``agent_timeout_s`` (:class:`~rollout_sglang.gateway.options.AgentRunnerOptions`: the agent runner).

    prompts_per_step: distinct task samples per RL step; samples_per_prompt: group size for GRPO.
    max_new_tokens: tokens per turn (below max_total_tokens).
    temperature (> 0), top_p (in (0, 1]): sampling of the training rollouts.

    Engines, versions and weight sync (``rollout_sglang.engines.version_pool``, ``megatron_agentrl.weight_sync``):
    max_versions: version slots kept alive (each sync updates the oldest slot, so the pool holds
        the latest ``max_versions`` weight versions); engines_per_slot: engines per slot.
    cross_policy: which version samples each turn: "latest" (on-policy, cross-policy off),
        "uniform" (every live version alike), "recency" (k-th newest with weight recency_decay**k).
    recency_decay: in (0, 1], used by "recency".
    weight_update_mode: what a full-weight update does with the requests running on the slot it updates:
        "drain" waits for them to finish (``engine_timeout_s`` at most), then pauses the slot's engines; "retract"
        and "in_place" update in flight: the engines hold their running requests between two tokens, load the
        weights and continue them, over a KV cache recomputed with the new weights ("retract": exact) or kept
        from the old ones ("in_place": cheaper, slightly off-policy). Every token's version is recorded either
        way (docs/rollout.md, "In-flight weight updates"). A LoRA run's adapter versions never pause.
    engine_timeout_s: limit on one generate call and on draining a slot before its update, seconds.
    engine_startup_timeout_s: limit on an SGLang server becoming healthy, seconds.
    engine_health_interval_s / engine_health_timeout_s: how often each SGLang server's health is probed
        (``/health_generate``, which waits up to 20 s for the scheduler) and the limit on one probe, seconds;
        a failed probe takes the server out of rotation until one passes (docs/training.md, "When parts fail").
    engine_unavailable_timeout_s: how long generation waits while no slot can serve (every engine down,
        or updating) before the run fails with a message naming each engine and why, seconds.
    weight_sync_max_failures: weight syncs that may fail in a row before the run stops (a server died mid-sync:
        the sync is sent again at once to the slot's servers still reachable).
    weight_sync_checksum: verify every bucket where the transport can (the stand-in's transport in
        rollout_sglang.testing); SGLang's broadcasts carry no checksum, so with them it only warns.
    engine_urls: SGLang servers that are already running, one list per version slot (exactly
        ``max_versions`` slots of ``engines_per_slot`` URLs ``http(s)://host:port`` each), e.g.
        ``[["http://10.0.0.5:30000"], ["http://10.0.0.6:30000"]]``; empty = the run starts its own
        engines (local engines, or SGLang servers that the Ray launcher starts). Each server's
        rank count in the weight-sync group is its ``tp_size`` (asked from ``/server_info``).
    weight_sync_master_address: the address of each sending trainer rank that the engines connect
        to for the weight-sync group; "" = the address this host routes to the first engine from
        (right for one network; set it when the engines reach the trainers by another interface).
    engine_api_key_env / engine_admin_api_key_env: names of environment variables holding the
        servers' ``--api-key`` and ``--admin-api-key`` (unset or empty: no key); keys stay out of
        config files and logs.
    sglang_server_args: more flags of the SGLang servers that the Ray launcher starts, SGLang's flag names without
        dashes to values, e.g. ``{mem_fraction_static: 0.8, context_length: 32768, max_running_requests: 64}``;
        checked at load against the pinned SGLang's own flags (a misspelt one is refused naming the nearest;
        :mod:`rollout_sglang.engines.sglang_server_args`). The flags the run sets itself (model, port, TP size,
        dtype, keys, LoRA) are refused with the setting that owns them.

    Who plays the episodes (``rollout_sglang.gateway``, docs/training.md):
    agent: "builtin" (the agent loop) or "gateway" (``agent_fn`` per sample, through the gateway).
    agent_fn: with "gateway", "package.module:function" naming an async function
        ``fn(client: openai.AsyncOpenAI, sample: dict) -> float | None``; loaded and checked at load
        (a module that is not importable is also looked for under the working directory).

    capture_routing: mixture-of-experts models: the engines return the experts they chose for every
        token (SGLang: ``return_routed_experts``, servers started with ``--enable-return-routed-experts``),
        carried with the trajectory for ``train.moe_routing_replay`` and ``routing/flip_rate``: "auto" = on for
        MoE models, "on" (a dense model is refused), "off".
    """

    KEY: ClassVar[str] = "rollout"
    CHOICE_HINTS: ClassVar[dict[str, str]] = {"cross_policy": "latest = on-policy, cross-policy sampling off"}

    prompts_per_step: int = 8
    samples_per_prompt: int = 4
    temperature: float = 1.0
    top_p: float = 1.0
    max_new_tokens: int = 48
    max_versions: int = 1
    engines_per_slot: int = 1
    cross_policy: Literal["latest", "uniform", "recency"] = "latest"
    recency_decay: float = 0.5
    weight_update_mode: Literal["drain", "retract", "in_place"] = "drain"
    engine_timeout_s: float = 600.0
    engine_startup_timeout_s: float = 900.0
    engine_health_interval_s: float = 5.0
    engine_health_timeout_s: float = 30.0
    engine_unavailable_timeout_s: float = 600.0
    weight_sync_max_failures: int = 3
    weight_sync_checksum: bool = False
    engine_urls: list[list[str]] = field(default_factory=list)
    weight_sync_master_address: str = ""
    engine_api_key_env: str = "SGLANG_API_KEY"
    engine_admin_api_key_env: str = "SGLANG_ADMIN_API_KEY"
    sglang_server_args: dict[str, Any] = field(default_factory=dict)
    capture_routing: Literal["auto", "on", "off"] = "auto"
    agent: Literal["builtin", "gateway"] = "builtin"
    agent_fn: str | None = None

    def check(self) -> None:
        """See :class:`Options`; the fields of the component classes check themselves first."""
        super().check()
        self._check_agent()
        self.require_positive_int("prompts_per_step", "samples_per_prompt", "max_new_tokens")
        self.require(self.max_new_tokens < self.max_total_tokens, "max_new_tokens",
                     f"must be below rollout.max_total_tokens={self.max_total_tokens} (one turn cannot outgrow "
                     "the whole episode, prompt included); lower it or raise max_total_tokens")
        self.require(self.temperature > 0, "temperature", "must be > 0 (use a small value such as 0.01 for "
                     "near-greedy)")
        self.require(0 < self.top_p <= 1, "top_p", "must be in (0, 1]")
        self.require_positive_int("max_versions", "engines_per_slot", "weight_sync_max_failures")
        self.require(0 < self.recency_decay <= 1, "recency_decay", "must be in (0, 1]")
        self.require(self.cross_policy == "latest" or self.max_versions >= 2, "cross_policy",
                     "needs rollout.max_versions >= 2 (one slot holds only the latest version); raise "
                     "max_versions or use cross_policy=latest")
        self.require_above_zero("engine_timeout_s", "engine_startup_timeout_s", "engine_health_interval_s",
                                "engine_health_timeout_s", "engine_unavailable_timeout_s", unit="seconds")
        self._check_engine_urls()
        try:
            server_args_argv(self.sglang_server_args, f"{self.KEY}.sglang_server_args")
        except ValueError as e:
            raise ConfigError(str(e)) from None
        self.require(is_host(self.weight_sync_master_address), "weight_sync_master_address",
                     "must be a host name or IP address such as 10.0.0.4 (no scheme, port or path), or '' to "
                     "pick the address that routes to the engines")

    def _check_agent(self) -> None:
        if self.agent == "builtin":
            self.require(self.agent_fn is None, "agent_fn", "is set but rollout.agent=builtin runs the built-in "
                         "agent loop; set rollout.agent=gateway to train your agent function")
            return
        self.require(self.agent_fn is not None, "agent_fn", "is required with rollout.agent=gateway: name your "
                     "agent as 'package.module:function' (an async fn(client, sample) -> float | None)")
        module, _, func = str(self.agent_fn).partition(":")
        self.require(bool(module) and func.isidentifier() and all(p.isidentifier() for p in module.split(".")),
                     "agent_fn", "must be 'package.module:function'")
        load_agent_fn(str(self.agent_fn), f"{self.KEY}.agent_fn")

    def slot_count(self, adapters: bool) -> int:
        """Version slots of the pool: ``max_versions``, or one with versions as adapters (a LoRA run: every live
        version is an adapter on the same engines)."""
        return 1 if adapters else self.max_versions

    def engine_count(self, adapters: bool) -> int:
        """Engines of the pool: :meth:`slot_count` slots of ``engines_per_slot``."""
        return self.engines_per_slot * self.slot_count(adapters)

    def check_engine_slots(self, adapters: bool) -> None:
        """``engine_urls`` has the pool's shape (:meth:`engine_count`); FieldError naming it and the fix."""
        if not self.engine_urls:
            return
        shape = [len(slot) for slot in self.engine_urls]
        slots = self.slot_count(adapters)
        need = ("1 slot (a LoRA run: every live version is an adapter on the same engines)" if adapters else
                f"rollout.max_versions={self.max_versions} slots")
        self.require(len(shape) == slots and all(n == self.engines_per_slot for n in shape),
                     "engine_urls", f"has {len(shape)} slot(s) of {shape} URL(s), but {need} of "
                     f"rollout.engines_per_slot={self.engines_per_slot} URL(s) each are needed; give one list of "
                     "SGLang server URLs per version slot, or [] to start the engines here")

    def _check_engine_urls(self) -> None:
        for i, slot in enumerate(self.engine_urls):
            for j, url in enumerate(slot):
                if not _is_host_port_url(url):
                    raise FieldError(self.KEY, f"engine_urls[{i}][{j}]", url, "is not an http(s)://host:port URL "
                                      "such as http://10.0.0.5:30000")


#: The ``gateway`` section: the gateway's own options (``rollout_sglang.gateway.options``), fields documented and
#: checked there.
GatewayConfig = GatewayOptions


@dataclass
class EvalConfig(Options):
    """Per-task success measured before and after RL on held-out samples (0 samples = off).

    samples_per_task: held-out indices per task (taken from the end of each task's index list,
    never trained on); temperature: sampling temperature of the evaluation.
    interval: also evaluate every ``interval`` RL steps (with the newest weights; in async mode
        without stalling the rollout); 0 = before and after RL only.
    """

    KEY: ClassVar[str] = "eval"

    samples_per_task: int = 32
    temperature: float = 1.0
    interval: int = 0

    def check(self) -> None:
        """See :class:`Options`."""
        super().check()
        self.require_non_negative("samples_per_task", why="0 disables evaluation")
        self.require_non_negative("interval", why="0 = before and after RL only")
        self.require_above_zero("temperature")


@dataclass
class AlgoConfig(DynamicSamplingOptions):
    """Advantages and the shaping of the batch: sample advantages per group, then per-task normalization of
    token advantages over the global batch; ``eps`` (> 0) is added to every standard deviation that divides.
    The draw budget of dynamic sampling, ``dynamic_sampling_max_groups``, is declared and checked by
    :class:`~rollout_sglang.rollout.dynamic_sampling.DynamicSamplingOptions`.

    estimator: "grpo" (reward minus the group mean, divided by the group std when ``group_std_norm``;
        without it, Dr. GRPO), "rloo" (reward minus the mean of the other samples of its group), or
        "reinforce_pp" (REINFORCE++: reward minus the group mean, normalised by the mean and std over
        the batch's policy tokens; with ``normalize_per_task`` the per-task normalization replaces
        that). ``group_std_norm`` applies to "grpo" only.
    dynamic_sampling: DAPO's dynamic sampling: a group whose rewards are all equal carries no signal; it
        is dropped (counted per task) and more prompts are drawn until the step's batch is full, at most
        ``dynamic_sampling_max_groups`` times ``rollout.prompts_per_step`` groups per step.
    overlong_buffer: DAPO's overlong shaping: an episode whose length comes within this many tokens of
        ``rollout.max_total_tokens`` loses up to ``overlong_penalty`` of its reward, linearly over the
        buffer; 0 = off.
    """

    KEY: ClassVar[str] = "algo"
    MOVED: ClassVar[dict[str, str]] = {"loss_agg": "loss.agg"}

    group_std_norm: bool = True
    normalize_per_task: bool = True
    eps: float = 1e-6
    estimator: Literal["grpo", "rloo", "reinforce_pp"] = "grpo"
    dynamic_sampling: bool = False
    overlong_buffer: int = 0
    overlong_penalty: float = 1.0

    def check(self) -> None:
        """See :class:`DynamicSamplingOptions`."""
        super().check()
        self.require(self.eps > 0, "eps", "must be > 0: it keeps the division by a zero standard deviation "
                     "finite (1e-6 is usual)")
        self.require_non_negative("overlong_buffer", why="0 turns overlong shaping off")
        self.require_non_negative("overlong_penalty")


@dataclass
class LoggingConfig(Options):
    """Where a run's metrics go besides ``metrics.jsonl`` (always written).

    tensorboard: TensorBoard event files under ``output_dir/tensorboard``.
    wandb: Weights & Biases, the same metrics and the config, files under ``output_dir/wandb``;
    wandb_project / wandb_run_name (empty: the output directory's name); wandb_mode: "offline" (no
    network; ``wandb sync`` uploads later) or "online".
    """

    KEY: ClassVar[str] = "logging"

    tensorboard: bool = True
    wandb: bool = False
    wandb_project: str = "megatron-agentrl"
    wandb_run_name: str = ""
    wandb_mode: Literal["offline", "online"] = "offline"

    def check(self) -> None:
        """See :class:`Options`."""
        super().check()
        self.require(bool(self.wandb_project), "wandb_project", "is empty; give a W&B project name")


@dataclass
class PipelineConfig(DropLimitOptions):
    """How rollout and training are scheduled (``megatron_agentrl.pipeline``).

    mode: "sync" (generate a step's groups, then train on them, then push weights) or "async"
        (rollout keeps groups in flight while the trainer trains; a bounded queue between them).
        Both run the same rollout manager and training step.
    staleness: eta, async only: a new group starts only while
        (version + eta + 1) * prompts_per_step > accepted + running groups, and no trained sample
        has a token more than eta weight versions older than the trained policy (sync: 0).
    queue_size: most finished groups waiting for the trainer plus groups in flight; 0 = auto
        ((staleness + 1) * prompts_per_step); at least prompts_per_step (checked by
        :class:`~rollout_sglang.rollout.admission.AdmissionOptions`, see :meth:`Config.admission_options`).
    cohort_groups: groups that run their turns in lockstep in one agent-loop call; 0 = auto (the
        whole step in sync mode, 1 in async mode).
    batch_timeout_s: limit on the trainer waiting for one batch (and on a checkpoint's drain), s.
    env_timeout_s: limit on every environment call of the agent loop, seconds.
    max_dropped_groups_in_row: declared and checked by :class:`~rollout_sglang.rollout.retries.DropLimitOptions`.
    sim_env_latency_s: > 0 adds simulated environment latency to every env call of the training
        rollouts: Pareto(alpha) seconds with scale (minimum) sim_env_latency_s, capped at
        sim_env_latency_max_s (0 = 100 x the scale). For benchmarks and tests; 0 = off.
    sim_env_latency_alpha: Pareto shape (smaller = heavier tail; 1.5 has a finite mean 3 x scale
        and infinite variance).
    collapse_window / collapse_drop / collapse_patience: the collapse alarm
        (``megatron_agentrl.pipeline.collapse``): a task whose training reward stays below
        (1 - collapse_drop) x its recent level (the mean of its last collapse_window steps, and at
        least 0.2 lower) for collapse_patience steps in a row gets a console warning and
        ``collapse/<task>`` = 1 in the metrics; collapse_window 0 = off.
    """

    KEY: ClassVar[str] = "pipeline"

    mode: Literal["sync", "async"] = "sync"
    staleness: int = 1
    queue_size: int = 0
    cohort_groups: int = 0
    batch_timeout_s: float = 1800.0
    env_timeout_s: float = 120.0
    sim_env_latency_s: float = 0.0
    sim_env_latency_alpha: float = 1.5
    sim_env_latency_max_s: float = 0.0
    collapse_window: int = 10
    collapse_drop: float = 0.5
    collapse_patience: int = 3

    def check(self) -> None:
        """See :class:`Options`."""
        super().check()
        self.require_non_negative("staleness", why="0 = every sample from the newest weights")
        self.require_non_negative("collapse_window", why="0 = no collapse alarm")
        self.require(0 < self.collapse_drop <= 1, "collapse_drop", "must be in (0, 1] (0.5: half the recent level)")
        self.require_positive_int("collapse_patience")
        self.require_non_negative("cohort_groups", why="0 = auto")
        self.require_above_zero("batch_timeout_s", "env_timeout_s", unit="seconds")
        self.require_non_negative("sim_env_latency_s", "sim_env_latency_max_s", why="0 = off / auto")
        self.require_above_zero("sim_env_latency_alpha")


@dataclass
class CheckpointConfig(Options):
    """Checkpoints (megatron distributed checkpoint of model + optimizer, plus the pipeline state).

    interval: save every this many RL steps (and after the last step); 0 = never.
    dir: where checkpoints go (None: ``<output_dir>/checkpoints``); one ``step_<k>`` folder each
        and a ``latest`` file naming the newest.
    resume: None (start fresh), "latest" (the newest checkpoint under ``dir``, fresh start when
        there is none) or the path of one ``step_<k>`` folder. A resumed run skips the SFT
        warm-up and the first evaluation and trains step k+1 on the batch the uninterrupted run
        would have trained on.
    keep: how many newest checkpoints to keep (older ones are deleted); 0 = keep all.
    after_warmup: also save ``step_000000`` once the SFT warm-up and the evaluation before RL are done
        (whatever ``interval``): resuming from it runs RL from that warm-up, so RL settings can be
        compared from one warm-up without repeating it (``checkpoint.resume=<dir>/step_000000``).
    """

    KEY: ClassVar[str] = "checkpoint"

    interval: int = 0
    dir: str | None = None
    resume: str | None = None
    keep: int = 2
    after_warmup: bool = False

    def check(self) -> None:
        """See :class:`Options`."""
        super().check()
        self.require_non_negative("interval", why="0 = no checkpoints")
        self.require_non_negative("keep", why="0 = keep all")
        self.require(self.resume is None or self.resume == "latest" or Path(self.resume).is_dir(), "resume",
                     "is not a directory; give 'latest' or the path of a step_<k> checkpoint folder "
                     "(under <output_dir>/checkpoints)")


@dataclass
class TaskSpec(Options):
    """One task: its ``name``, sampling ``weight`` and, for a built-in task, constructor ``params``.

    task: the built-in task class to build when ``name`` is this entry's own name (""; ``name`` is the
        class): several entries of one class, e.g. ``{name: term_files, task: terminal, params: {demo:
        files}}``; ``name`` is then what the env controller's worker announces (``agentrl worker --task
        terminal --name term_files``).

    weight: the task's share of RL prompts (relative to the other tasks' weights).
    sft_weight: its share of the warm-up demonstrations (None: ``weight``); e.g. give the task
        the warm-up leaves weakest more RL rollouts without changing the warm-up mixture.
    params: keyword arguments of the built-in task's class (``env_controller.tasks``); checked
        against it by :meth:`Config.validate` when the task runs in process.
    binary_reward: train on 1.0 for a successful episode (the task's ``success`` metric, else
        reward >= 1) and 0.0 otherwise, instead of the task's own reward.
    timeout_penalty: subtracted from the reward of an episode that ran out of turns or context
        ("task limit reached", "agent context limit") or whose env call timed out (>= 0).
    reward_fn: "package.module:function" called with the finished trajectory, whose return value
        (a float) replaces its reward before any shaping (the place for an LLM judge); None = the
        task's reward.
    """

    KEY: ClassVar[str] = "task"

    name: str = ""
    task: str = ""
    weight: float = 1.0
    sft_weight: float | None = None
    params: dict[str, Any] = field(default_factory=dict)
    binary_reward: bool = False
    timeout_penalty: float = 0.0
    reward_fn: str | None = None

    def check(self) -> None:
        """See :class:`Options`."""
        super().check()
        self.require(bool(self.name), "name", "is empty; give a registered task name")
        self.require(self.weight > 0, "weight", "must be > 0")
        self.require(self.sft_weight is None or self.sft_weight > 0, "sft_weight",
                     "must be > 0 (or left out: the task's weight)")
        self.require(self.timeout_penalty >= 0, "timeout_penalty", "must be >= 0 (it is subtracted from the reward)")
        bad = [k for k in self.params if not isinstance(k, str) or not k.isidentifier()]
        self.require(not bad, "params", f"has the key {bad[0]!r}, which is not a parameter name" if bad else "")
        self.require(not (self.reward_fn and self.binary_reward), "reward_fn",
                     "and binary_reward are both set: binary_reward would replace the function's reward by the task's "
                     "success; drop one")
        if self.reward_fn is not None:
            module, _, func = self.reward_fn.partition(":")
            ok = all(p.isidentifier() for p in [*module.split("."), func])
            self.require(ok, "reward_fn", "must be 'package.module:function'")


@dataclass
class EnvConfig(ControllerAccess):
    """Where the tasks run when they are not built in (``megatron_agentrl.launch``, the GLM-4 recipe).

    ``token`` and ``unavailable_timeout_s`` are the env client's, declared and checked with it
    (:class:`~env_controller.clients.options.ControllerAccess`); an episode whose start waited past
    ``unavailable_timeout_s`` is an infrastructure failure (its group re-run, then dropped).

    controller_url: an env controller (AgentRL task-worker protocol) that serves the tasks, e.g.
        "http://10.0.0.1:5020"; "" = the built-in tasks run in process (or, with ``ray.controller``,
        behind the controller that the Ray launcher starts).
    workers: the task workers expected to register with that controller, ``{task: [worker API URL, ...]}``
        (``agentrl plan --check`` probes them; the workers register by heartbeat themselves).
    """

    KEY: ClassVar[str] = "env"

    controller_url: str = ""
    workers: dict[str, list[str]] = field(default_factory=dict)

    def check(self) -> None:
        """See :class:`~env_controller.clients.options.ControllerAccess`."""
        super().check()
        self.require(not self.controller_url or self.controller_url.startswith(("http://", "https://")),
                     "controller_url", "must start with http:// or https://, e.g. http://127.0.0.1:5020")
        for task, urls in self.workers.items():
            if not isinstance(urls, list) or not all(isinstance(u, str) and u.startswith(("http://", "https://"))
                                                     for u in urls):
                raise FieldError(self.KEY, f"workers.{task}", urls, "must be a list of worker URLs such as "
                                  "['http://10.0.0.2:5021/api']")


@dataclass
class RayConfig(Options):
    """Ray placement of a run (``megatron_agentrl.launch.ray_placement``).

    enabled: run ``agentrl train`` as Ray actors; with ``address`` empty a local Ray is started.
    address: a Ray cluster to join ("auto", "host:6379"); setting it implies enabled.
    namespace: Ray namespace of the run's actors and placement groups.
    num_cpus: CPUs a local Ray offers (0 = all of this machine); ignored when joining a cluster.
    train_workers: trainer ranks, the train pool (0 = the smallest world of the layout: parallel.tp * parallel.pp *
        parallel.cp, data parallel 1; see ``ParallelConfig.model_parallel_size``).
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
    max_restarts: how often the launcher restarts the trainer group after a trainer rank's actor or its node
        died: it starts fresh trainer actors that resume from the latest checkpoint (``checkpoint.resume=latest``;
        the steps since it are redone). 0 = the run stops at the first loss.
    engine_max_restarts: how often each rollout engine is relaunched at its own host:port after its server or
        actor died (0 = the run stops).
    controller_max_restarts: the same for the env controller actor (at its port; its sessions are lost).
    """

    KEY: ClassVar[str] = "ray"

    enabled: bool = False
    address: str = ""
    namespace: str = "agentrl"
    num_cpus: int = 0
    train_workers: int = 0
    train_gpus_per_worker: float = 0.0
    train_cpus_per_worker: float = 1.0
    train_strategy: RayStrategy = "PACK"
    rollout_gpus_per_engine: int = 0
    rollout_cpus_per_engine: float = 1.0
    rollout_strategy: RayStrategy = "PACK"
    engine_server_module: str = "sglang.launch_server"
    controller: bool = False
    controller_cpus: float = 1.0
    controller_port: int = 5020
    placement_timeout_s: float = 300.0
    health_check_interval_s: float = 5.0
    max_restarts: int = 3
    engine_max_restarts: int = 3
    controller_max_restarts: int = 3

    @property
    def active(self) -> bool:
        """Whether ``agentrl train`` runs on Ray (``enabled`` or an ``address`` given)."""
        return self.enabled or bool(self.address)

    def check(self) -> None:
        """See :class:`Options`; ``train_workers`` against the parallel layout: :meth:`Config.validate`."""
        super().check()
        self.require_non_negative("train_workers", "train_gpus_per_worker", "rollout_gpus_per_engine", "num_cpus")
        self.require(self.controller_port < 65536, "controller_port", "must be a TCP port (1-65535) or 0 (a free port)")
        self.require_non_negative("controller_port")
        self.require_non_negative("max_restarts", "engine_max_restarts", "controller_max_restarts",
                                  why="0 = no restart: the run stops at the first loss")
        self.require_above_zero("train_cpus_per_worker", "rollout_cpus_per_engine", "controller_cpus",
                                "placement_timeout_s", "health_check_interval_s")
        g = self.train_gpus_per_worker
        self.require(g <= 1 or g == int(g), "train_gpus_per_worker", "above 1 only whole GPUs are possible")
        self.require(not self.address or self.address == "auto"
                     or re.fullmatch(r"(ray://)?[\w.\-\[\]:]+:\d+", self.address) is not None, "address",
                     "is not 'auto' or host:port (e.g. 10.0.0.1:6379); leave it empty to start a local Ray")
        self.require(bool(self.engine_server_module), "engine_server_module",
                     "is empty; give the module of the engine server, e.g. sglang.launch_server")


@dataclass
class SlurmConfig(Options):
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

    KEY: ClassVar[str] = "slurm"

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

    def check(self) -> None:
        """See :class:`Options`."""
        super().check()
        self.require_positive_int("nodes")
        self.require_non_negative("gpus_per_node", "cpus_per_node")
        self.require(0 < self.ray_port < 65536, "ray_port", "must be a TCP port (1-65535)")
        self.require_above_zero("ray_start_timeout_s", unit="seconds")
        self.require(not isinstance(self.time, int), "time", "was read as a number (YAML reads an unquoted "
                     "04:00:00 in base 60); quote it: time: \"04:00:00\" (on the command line: --time 04:00:00)")
        self.require(not self.time or re.fullmatch(r"(\d+-)?\d+(:\d{2}){0,2}", str(self.time)) is not None, "time",
                     "is not a SLURM time limit such as 04:00:00 or 1-12:00:00")


@dataclass
class Config:
    """The whole run. Everything a run writes goes under ``output_dir``.

    Built empty (``Config()``) it is not yet a run: :meth:`validate` (which :func:`load_config`
    calls) checks that it is complete and that its sections agree with each other.
    """

    output_dir: str = "outputs/run"
    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    loss: LossConfig = field(default_factory=LossConfig)
    sft: SFTConfig = field(default_factory=SFTConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    algo: AlgoConfig = field(default_factory=AlgoConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    pipeline: PipelineConfig = field(default_factory=PipelineConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    tasks: list[TaskSpec] = field(default_factory=list)
    log_every: int = 1
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    env: EnvConfig = field(default_factory=EnvConfig)
    gateway: GatewayConfig = field(default_factory=GatewayConfig)
    lora: LoraOptions = field(default_factory=LoraOptions)
    distill: DistillOptions = field(default_factory=DistillOptions)
    ray: RayConfig = field(default_factory=RayConfig)
    slurm: SlurmConfig = field(default_factory=SlurmConfig)

    def validate(self) -> None:
        """Check every section again (a field may have been set after it was built), then what
        spans sections; raises ConfigError naming the key."""
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if isinstance(value, Options):
                value.check()
        for i, spec in enumerate(self.tasks):
            placed(f"tasks[{i}]", spec.check)
        if self.log_every < 1:
            raise ConfigError(f"log_every={self.log_every!r} must be a positive integer (log every this many steps)")
        self.rollout.check_engine_slots(self.lora.enabled)
        if self.lora.enabled and self.rollout.weight_update_mode != "drain":
            raise FieldError("rollout", "weight_update_mode", self.rollout.weight_update_mode,
                             "has nothing to do in a LoRA run (lora.rank > 0): its versions are adapters, published "
                             "without a pause; leave it at 'drain'")
        if self.model.hf_config is None and not self.model.arch and not self.model.megatron_checkpoint:
            raise ConfigError("model: set model.hf_config (a Hugging Face config dir) or model.arch (inline config "
                              "fields)")
        self._validate_tasks()
        self._validate_distill()
        t, r, p = self.train, self.rollout, self.pipeline
        if 0 < t.micro_batch_tokens < r.max_total_tokens:
            raise ConfigError(f"train.micro_batch_tokens={t.micro_batch_tokens} is smaller than one episode can be "
                              f"(rollout.max_total_tokens={r.max_total_tokens}), so a micro-batch could not hold "
                              "the longest trajectory; raise it to at least that")
        if p.cohort_groups > r.prompts_per_step:
            raise ConfigError(f"pipeline.cohort_groups={p.cohort_groups} exceeds rollout.prompts_per_step="
                              f"{r.prompts_per_step}; use at most that (or 0 = auto)")
        eta = p.staleness if p.mode == "async" else 0
        if r.cross_policy != "latest" and r.max_versions - 1 > eta:
            raise ConfigError(
                f"rollout.max_versions={r.max_versions} keeps weights up to {r.max_versions - 1} "
                f"versions old for cross-policy sampling, but pipeline.staleness allows {eta} "
                f"(mode {p.mode}); use pipeline.mode=async with pipeline.staleness >= {r.max_versions - 1}, "
                "or lower rollout.max_versions"
            )
        placed(PipelineConfig.KEY, self.admission_options)
        if self.parallel.rank0_timeout_s <= p.batch_timeout_s:
            raise ConfigError(f"parallel.rank0_timeout_s={self.parallel.rank0_timeout_s:g} must exceed "
                              f"pipeline.batch_timeout_s={p.batch_timeout_s:g}: the other ranks wait that long for "
                              "rank 0, which may itself wait pipeline.batch_timeout_s for a batch or a checkpoint's "
                              "drain; "
                              f"raise parallel.rank0_timeout_s above {p.batch_timeout_s:g}")
        self._validate_layers()
        if self.algo.dynamic_sampling and self.rollout.samples_per_prompt < 2:
            raise ConfigError("algo.dynamic_sampling=true drops groups whose rewards are all equal, and a group of "
                              f"rollout.samples_per_prompt={self.rollout.samples_per_prompt} sample always is; set "
                              "rollout.samples_per_prompt >= 2 or algo.dynamic_sampling=false")
        if self.eval.interval and not self.eval.samples_per_task:
            raise ConfigError(f"eval.interval={self.eval.interval} evaluates on held-out samples, but "
                              "eval.samples_per_task=0 keeps none; set eval.samples_per_task > 0 or eval.interval=0")
        if self.train.moe_routing_replay and self.rollout.capture_routing == "off":
            raise ConfigError("train.moe_routing_replay=true replays the engines' routed experts, but "
                              "rollout.capture_routing=off asks the engines for none; set rollout.capture_routing "
                              "to auto (or on), or train.moe_routing_replay=false")
        context = server_arg(self.rollout.sglang_server_args, "context_length")
        if isinstance(context, int) and not isinstance(context, bool) and context < self.rollout.max_total_tokens:
            raise ConfigError(f"rollout.sglang_server_args.context_length={context} is shorter than an episode may "
                              f"grow (rollout.max_total_tokens={self.rollout.max_total_tokens}): SGLang would refuse "
                              "its last turns; raise it to at least that, or lower rollout.max_total_tokens")
        if self.rollout.sglang_server_args and not self.ray.rollout_gpus_per_engine:
            raise ConfigError("rollout.sglang_server_args sets flags of SGLang servers, but ray.rollout_gpus_per_engine"
                              "=0 runs the local engine in trainer rank 0; set ray.rollout_gpus_per_engine (SGLang "
                              "engines placed by Ray) or remove rollout.sglang_server_args")
        if self.ray.train_workers:
            ranks = self.parallel.model_parallel_size
            self.parallel.check_world(self.ray.train_workers, "ray.train_workers",
                                      fix=f"set ray.train_workers to a multiple of {ranks}, or to 0 (the smallest "
                                      f"world of the layout, {ranks})")

    def _validate_distill(self) -> None:
        """A teacher for every task, and a student sampled untempered (the teachers' log-probs are)."""
        d = self.distill
        if not d.enabled:
            return
        try:
            d.teacher_of([s.name for s in self.tasks])
        except ValueError as e:
            raise ConfigError(str(e)) from None
        if self.rollout.temperature != 1.0:
            raise ConfigError(f"rollout.temperature={self.rollout.temperature} with distill.teachers: the teachers' "
                              "log-probs are untempered (SGLang's input log-probs are), so the student must sample at "
                              "temperature 1 for log p_teacher - log p_behavior to compare like with like; set "
                              "rollout.temperature=1.0")
        if self.algo.dynamic_sampling and d.reward_coef == 0:
            raise ConfigError("algo.dynamic_sampling=true drops groups whose rewards are all equal, but with "
                              "distill.reward_coef=0 the teacher's signal trains every group; set "
                              "algo.dynamic_sampling=false (or distill.reward_coef > 0)")

    def engine_placement_problem(self, on_ray: bool) -> str | None:
        """What is wrong with where this run's engines come from when it runs ``on_ray`` (or not), with the fix;
        None when nothing is. Only the Ray launcher places SGLang engines on GPUs (``ray.rollout_gpus_per_engine``);
        without it a run uses the local engine in trainer rank 0 or the servers of ``rollout.engine_urls``."""
        gpus, r = self.ray.rollout_gpus_per_engine, self.rollout
        if on_ray or not gpus or r.engine_urls:
            return None
        return (f"ray.rollout_gpus_per_engine={gpus} asks for SGLang engines on GPUs, which only the Ray launcher "
                "places, and this run is not on Ray: on one node add ray.enabled=true (a local Ray starts); on a "
                "cluster submit with `agentrl slurm submit` and slurm.ray=true; to use SGLang servers you started, "
                "give rollout.engine_urls; for the local engine in trainer rank 0 (small models only) set "
                "ray.rollout_gpus_per_engine=0")

    def admission_options(self) -> AdmissionOptions:
        """When the rollout manager starts a group (:class:`~rollout_sglang.rollout.admission.AdmissionOptions`,
        which checks the queue bound): ``rollout.prompts_per_step`` groups per batch; in sync mode staleness 0 and
        a step's groups in lockstep, in async mode ``pipeline.staleness`` and groups one by one
        (``pipeline.cohort_groups`` replaces either); cross-policy sampling lags ``rollout.max_versions - 1``
        versions; ``train.steps`` batches."""
        r, p = self.rollout, self.pipeline
        sync = p.mode == "sync"
        return AdmissionOptions(
            batch_groups=r.prompts_per_step, staleness=0 if sync else p.staleness, queue_size=p.queue_size,
            cohort_groups=p.cohort_groups or (r.prompts_per_step if sync else 1),
            version_lag=0 if sync or r.cross_policy == "latest" else r.max_versions - 1,
            total_groups=self.train.steps * r.prompts_per_step,
        )

    def _validate_layers(self) -> None:
        """The pipeline stages split the layers evenly; recomputation asks for no more layers than a stage has."""
        layers = self.model.num_layers()
        if layers is not None:
            self.train.check_recompute_layers(layers, self.parallel)

    def check_world_size(self, world: int, source: str = "the world size") -> None:
        """Refuse a number of trainer processes that the layout's smallest world
        (:attr:`ParallelConfig.model_parallel_size`) does not divide (``source`` names where the number
        came from, e.g. "--nproc 3")."""
        self.parallel.check_world(world, source)

    def builds_task_here(self, spec: TaskSpec) -> bool:
        """Whether the trainer builds ``spec``'s built-in task in process: it runs the task's episodes
        (no ``env.controller_url``) or its demonstrations (``sft.steps`` > 0)."""
        from env_controller.tasks import TASKS

        return (spec.task or spec.name) in TASKS and (not self.env.controller_url or self.sft.steps > 0)

    def _validate_tasks(self) -> None:
        """A non-empty list of distinct tasks; the params of each task built here fit its class."""
        from env_controller.tasks import TASKS, task_options

        if not self.tasks:
            raise ConfigError("tasks: the list is empty; add at least one entry such as {name: lookup}")
        names = [s.name for s in self.tasks]
        dup = next((n for n in names if names.count(n) > 1), None)
        if dup is not None:
            raise ConfigError(f"tasks: '{dup}' is listed twice; list each task once (use its weight to sample it more)")
        for i, spec in enumerate(self.tasks):
            if spec.reward_fn is not None:
                load_reward_fn(spec.reward_fn, f"tasks[{i}].reward_fn")
            if not self.builds_task_here(spec):
                continue  # served by the env controller, which owns its parameters
            name = spec.task or spec.name
            try:
                TASKS[name](task_options(name, spec.params, f"tasks[{i}].params"))  # type: ignore[call-arg]
            except ConfigError:
                raise
            except (TypeError, ValueError) as e:
                raise ConfigError(f"tasks[{i}].params={spec.params!r} do not fit task '{spec.name}': {e}") from None


def load_reward_fn(path: str, key: str = "reward_fn") -> typing.Callable[..., Any]:
    """The callable ``"package.module:function"`` names; ConfigError naming ``key`` when it cannot be imported
    or is not callable."""
    import importlib

    module_name, _, func_name = path.partition(":")
    try:
        module = importlib.import_module(module_name)
    except Exception as e:  # noqa: BLE001 - any import failure of user code is the user's to fix
        raise ConfigError(f"{key}={path!r}: module '{module_name}' does not import ({type(e).__name__}: {e}); "
                          "put it on PYTHONPATH or fix it") from None
    func = getattr(module, func_name, None)
    if not callable(func):
        raise ConfigError(f"{key}={path!r}: module '{module_name}' has no function '{func_name}'")
    return func


def load_agent_fn(path: str, key: str = "rollout.agent_fn") -> typing.Callable[..., Any]:
    """The async function ``"package.module:function"`` names (:func:`load_reward_fn`); a module that does not
    import is looked for under the working directory too (as ``uvicorn module:app`` does), so
    ``examples.agents.openai_tool_agent:run_agent`` works from the repository root. ConfigError naming
    ``key`` when it cannot be found or is not an async function."""
    import importlib.util
    import inspect
    import os
    import sys

    top = path.partition(":")[0].split(".")[0]
    cwd = os.getcwd()
    if top and importlib.util.find_spec(top) is None and cwd not in sys.path and Path(cwd, top).exists():
        sys.path.append(cwd)  # appended: installed packages keep precedence
    fn = load_reward_fn(path, key)
    if not inspect.iscoroutinefunction(fn):
        raise ConfigError(f"{key}={path!r} is not an async function; define it as 'async def "
                          f"{path.partition(':')[2]}(client, sample)' returning a reward or None")
    return fn


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


def read_mapping_file(path: str | Path, fmt: Literal["yaml", "json"], what: str) -> dict[str, Any]:
    """The mapping (a YAML mapping, a JSON object) that the file at ``path`` holds.

    ``what`` names the file in messages (e.g. "config file 'run.yaml'"). Raises ConfigError for
    a missing or unreadable file, text that is not UTF-8, bad syntax, or a top level that is not
    a mapping; an empty YAML file is an empty mapping.
    """
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"{what} does not exist or is not a file")
    try:
        text = p.read_bytes().decode("utf-8")
    except UnicodeDecodeError as e:
        raise ConfigError(f"{what} is not UTF-8 text (byte {e.object[e.start]:#04x} at offset {e.start}); "
                          "save it as UTF-8") from None
    except OSError as e:
        raise ConfigError(f"{what} cannot be read: {e.strerror}") from None
    kind = "a JSON object" if fmt == "json" else "a mapping"
    try:
        loaded = json.loads(text) if fmt == "json" else yaml.safe_load(text)
    except (json.JSONDecodeError, yaml.YAMLError) as e:
        raise ConfigError(f"{what} is not valid {fmt.upper()}: {_syntax_error_text(e)}") from None
    if loaded is None and fmt == "yaml":
        return {}
    if not isinstance(loaded, dict):
        raise ConfigError(f"{what} must hold {kind} at the top level, got {type(loaded).__name__}")
    return loaded


def _syntax_error_text(e: Exception) -> str:
    """One line for a JSON or YAML syntax error: what is wrong and where (line, column)."""
    mark = getattr(e, "problem_mark", None)
    if isinstance(e, yaml.MarkedYAMLError) and mark is not None:
        context = f" ({e.context})" if e.context else ""
        return f"{e.problem}{context} at line {mark.line + 1}, column {mark.column + 1}"
    return " ".join(str(e).split())


def _parse_override(ov: str) -> tuple[str, Any]:
    """``key=value`` -> (key, value parsed as YAML); ConfigError when there is no ``=``."""
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
    return key.strip(), value


def load_config(path: str | Path | None = None, overrides: list[str] | None = None) -> Config:
    """Load a YAML config, apply ``key=value`` overrides (values parsed as YAML), validate.

    Raises ConfigError for a missing/unreadable file, bad YAML, an unknown key or a bad value.
    """
    data: dict[str, Any] = {}
    if path is not None:
        if not Path(path).is_file():
            raise ConfigError(f"config file '{path}' does not exist or is not a file; pass a YAML file such as "
                              "examples/configs/tiny_cpu.yaml")
        data = read_mapping_file(path, "yaml", f"config file '{path}'")
    for ov in overrides or []:
        _set_dotted(data, *_parse_override(ov))
    cfg = build_options(Config, data, "")
    cfg.validate()
    return cfg


def config_to_dict(cfg: Config) -> dict[str, Any]:
    """Plain-dict form of the config (for saving next to the run's outputs)."""
    return dataclasses.asdict(cfg)
