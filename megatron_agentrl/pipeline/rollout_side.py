"""What rank 0 samples with: the environments, the engines in one version pool, the chat template,
the task splits, and the rollout manager built from them.

The engines always form a :class:`~rollout_sglang.engines.version_pool.VersionPool` of
``rollout.max_versions`` slots of ``rollout.engines_per_slot`` engines (one slot of one engine is
the simple case): local PyTorch engines, or the SGLang servers ``rollout.engine_urls`` lists. Each
engine sits behind a :class:`~rollout_sglang.engines.batching.BatchingEngine` that merges concurrent calls.
"""
from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import random
import urllib.parse
from dataclasses import dataclass, field
from typing import Any

import torch

from env_controller.clients.local import LocalEnvClient
from env_controller.http.net import address_towards
from env_controller.tasks import build_task
from megatron_agentrl.config import Config, ConfigError
from megatron_agentrl.megatron.moe import routing_capture
from megatron_agentrl.pipeline.rewards import RewardShaper
from megatron_agentrl.pipeline.teachers import build_teacher_scorer
from rollout_sglang.chat_template import AnyChatTemplate, build_chat_template
from rollout_sglang.engines.batching import BatchingEngine
from rollout_sglang.engines.local import LocalEngine
from rollout_sglang.engines.protocol import SamplingParams
from rollout_sglang.engines.sglang_client import SGLangEngine
from rollout_sglang.engines.sglang_options import SGLangClientOptions
from rollout_sglang.engines.version_pool import VersionPool
from rollout_sglang.episode_options import EpisodeOptions
from rollout_sglang.gateway.options import GatewayOptions
from rollout_sglang.rollout.manager import PromptSampler, RolloutManager, RolloutOptions
from rollout_sglang.rollout.sim_env import LatencyEnvClient
from rollout_sglang.routing import RoutingLayout

logger = logging.getLogger(__name__)


@dataclass
class RolloutSide:
    """What rank 0 holds for sampling.

    pool: the VersionPool the training rollouts use. engines: its BatchingEngines (for the
    busy-time counters). env: the env client (in-process, or the env controller over HTTP);
    train_env: the same, behind simulated latency when ``pipeline.sim_env_latency_s > 0``.
    template; tasks: the built-in Task objects (demonstrations for SFT); task_names (config
    order), train/eval index splits, rng (SFT demonstrations), task weights (RL prompts), SFT
    weights (demonstrations) and the reward shaper (the tasks' settings, ``pipeline/rewards.py``).
    routing: the routed-experts layout the engines capture in (``rollout.capture_routing``), None = no capture.
    scorer: on-policy distillation's teachers (``distill``), run on every cohort's episodes; None without.
    """

    pool: VersionPool
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
    shaper: RewardShaper = field(default_factory=RewardShaper)
    routing: RoutingLayout | None = None
    scorer: Any = None

    def close(self) -> None:
        """Close the built-in tasks held here (their containers, servers and threads); each failure is logged,
        the others still close."""
        for name, task in self.tasks.items():
            close = getattr(task, "close", None)
            if callable(close):
                try:
                    close()
                except Exception:  # noqa: BLE001 - the run is ending: the next task still gets closed
                    logger.exception("closing task %s failed", name)

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


def build_env(cfg: Config) -> tuple[Any, dict[str, Any], dict[str, list[int]]]:
    """The env client (in-process, or the env controller over HTTP when ``env.controller_url`` is set),
    the built-in Task objects (for demonstrations), and every task's sample indices."""
    from env_controller.tasks import TASKS

    names = [s.name for s in cfg.tasks]
    if len(set(names)) != len(names):
        dup = next(n for n in names if names.count(n) > 1)
        raise ConfigError(f"tasks: '{dup}' is listed twice; list each task once (use its weight to sample it more)")
    tasks: dict[str, Any] = {}
    for spec in cfg.tasks:
        if (spec.task or spec.name) in TASKS and (not cfg.env.controller_url or cfg.sft.steps):
            tasks[spec.name] = build_task(spec.task or spec.name, **spec.params)
    if cfg.env.controller_url:
        from env_controller.clients.http_client import HttpEnvClient
        from env_controller.clients.options import EnvClientOptions

        if cfg.sft.steps and len(tasks) < len(names):
            remote = [n for n in names if n not in tasks]
            raise ConfigError(f"sft.steps={cfg.sft.steps}: the tasks {remote} run behind the env controller and have "
                              "no scripted demonstrations here; set sft.steps=0 or list only built-in tasks")
        client = HttpEnvClient(cfg.env.controller_url, EnvClientOptions(
            token=cfg.env.token or None, timeout_s=cfg.pipeline.env_timeout_s,
            unavailable_timeout_s=cfg.env.unavailable_timeout_s))
        indices = _controller_indices(client, names, cfg.pipeline.env_timeout_s)
        logger.info("environments: env controller %s", client.url)
        return client, tasks, indices
    unknown = [n for n in names if n not in tasks]
    if unknown:
        raise ConfigError(f"tasks {unknown} are not built-in tasks (built-in: {', '.join(sorted(TASKS))}); set "
                          "env.controller_url to the env controller that serves them")
    return LocalEnvClient(tasks, timeout_s=cfg.pipeline.env_timeout_s), tasks, \
        {n: list(t.indices()) for n, t in tasks.items()}


def remote_engines(cfg: Config, hf_config: Any) -> list[list[SGLangEngine]] | None:
    """SGLang engine clients per version slot for the servers ``rollout.engine_urls`` lists; None when
    the rollout runs on local engines (the list is empty). Built on every rank (each is a small HTTP
    client: the weight sync needs them everywhere). With routing capture (``rollout.capture_routing``) they
    ask for and check the routed experts of ``hf_config``'s MoE layers."""
    r = cfg.rollout
    if not r.engine_urls:
        return None
    options = SGLangClientOptions(request_timeout_s=r.engine_timeout_s, update_timeout_s=r.weight_sync_bucket_timeout_s,
                                  api_key=os.environ.get(r.engine_api_key_env) or None,
                                  admin_api_key=os.environ.get(r.engine_admin_api_key_env) or None)
    layout = routing_capture(r.capture_routing, cfg.train.moe_routing_replay, hf_config)
    return [[SGLangEngine(u, options, routing_layout=layout) for u in slot] for slot in r.engine_urls]


def _take_over(remote: list[list[SGLangEngine]], startup_timeout_s: float) -> None:
    """Wait until every running server answers, then take it over: one that an earlier run left paused or
    mid-update serves again (:meth:`SGLangEngine.take_over`)."""
    for c in (c for slot in remote for c in slot):
        c.wait_healthy(startup_timeout_s)
        c.take_over()


def weight_sync_master_address(cfg: Config) -> str:
    """The address the engines reach this rank by for the weight-sync group: ``rollout.weight_sync_master_address``,
    else the address this host routes to the first engine from (so each node answers for itself)."""
    r = cfg.rollout
    if r.weight_sync_master_address or not r.engine_urls:
        return r.weight_sync_master_address or "127.0.0.1"
    host = urllib.parse.urlparse(r.engine_urls[0][0]).hostname or "127.0.0.1"
    try:
        return address_towards(host)
    except OSError as e:
        raise ConfigError(f"rollout.engine_urls: no route from this host to {host} ({e}); check the URL, or set "
                          "rollout.weight_sync_master_address to this host's address on the engines' network") from e


def build_rollout_side(cfg: Config, hf_config: Any, dtype: torch.dtype, template: AnyChatTemplate,
                       remote: list[list[SGLangEngine]] | None = None) -> RolloutSide:
    """Rank 0's rollout side: env, task splits (the last ``eval.samples_per_task`` indices of each task
    are held out), engines (``remote`` SGLang clients, or local engines of ``hf_config`` in ``dtype``)
    in one version pool."""
    routing = routing_capture(cfg.rollout.capture_routing, cfg.train.moe_routing_replay, hf_config)
    env, tasks, indices = build_env(cfg)
    train_idx, eval_idx = {}, {}
    for name, idx in indices.items():
        n_eval = cfg.eval.samples_per_task
        if n_eval >= len(idx):
            raise ConfigError(f"eval.samples_per_task={n_eval} leaves no training samples for task '{name}' "
                              f"({len(idx)} samples); lower it")
        train_idx[name], eval_idx[name] = (idx[:-n_eval], idx[-n_eval:]) if n_eval else (idx, [])
    r = cfg.rollout
    if remote is not None:
        _take_over(remote, r.engine_startup_timeout_s)
        engines = [BatchingEngine(c, resume_timeout_s=r.engine_timeout_s) for slot in remote for c in slot]
        logger.info("rollout engines: %s", [[c.base_url for c in slot] for slot in remote])
    else:
        device = "cuda" if torch.cuda.is_available() else "cpu"
        engines = [BatchingEngine(LocalEngine(hf_config, dtype=dtype, device=device, seed=cfg.train.seed + i,
                                              resume_timeout_s=r.engine_timeout_s),
                                  resume_timeout_s=r.engine_timeout_s)
                   for i in range(r.engine_count(adapters=cfg.lora.enabled))]
    pool = VersionPool.from_engines(engines, r.max_versions, r.engines_per_slot, policy=r.cross_policy,
                                    recency_decay=r.recency_decay, seed=cfg.train.seed,
                                    drain_timeout_s=r.engine_timeout_s, live_timeout_s=r.engine_unavailable_timeout_s,
                                    live_adapters=r.max_versions if cfg.lora.enabled else None,
                                    update_mode=r.weight_update_mode)
    if remote is not None:  # servers in other processes fail apart from us: probe them
        pool.start_health_checks(r.engine_health_interval_s, r.engine_health_timeout_s)
    p = cfg.pipeline
    train_env: Any = env
    if p.sim_env_latency_s > 0:
        train_env = LatencyEnvClient(env, p.sim_env_latency_s, p.sim_env_latency_alpha, p.sim_env_latency_max_s,
                                     seed=cfg.train.seed)
    return RolloutSide(
        pool=pool, engines=engines, env=env, train_env=train_env, template=template, tasks=tasks,
        task_names=[s.name for s in cfg.tasks], train_indices=train_idx, eval_indices=eval_idx,
        rng=random.Random(cfg.train.seed), weights=[s.weight for s in cfg.tasks],
        sft_weights=[s.weight if s.sft_weight is None else s.sft_weight for s in cfg.tasks],
        shaper=RewardShaper(cfg.tasks, cfg.algo, r.max_total_tokens),
        routing=routing, scorer=build_teacher_scorer(cfg, dtype, template.tokenizer),
    )


def chat_template(cfg: Config, tokenizer: Any, hf_config: Any) -> AnyChatTemplate:
    """The chat format ``model.chat_template`` names (auto: the default of the model's family, from the
    family registry ``megatron_agentrl.convert``), on ``tokenizer``, with ``model.enable_thinking`` (refused, as a
    ConfigError, for a format without the switch)."""
    from megatron_agentrl.convert import resolve_chat_template

    name, model_type = cfg.model.chat_template, getattr(hf_config, "model_type", None)
    try:
        resolved = resolve_chat_template(name, model_type)
        thinking = cfg.model.enable_thinking
        logger.info("chat template: %s%s%s", resolved, f" (auto, model_type={model_type})" if name == "auto" else "",
                    "" if thinking is None else f", enable_thinking={thinking}")
        return build_chat_template(resolved, tokenizer, enable_thinking=thinking)
    except ValueError as e:
        thinking = cfg.model.enable_thinking
        thinking = "" if thinking is None else f" and model.enable_thinking={thinking}"
        raise ConfigError(f"model.chat_template={cfg.model.chat_template!r}{thinking} with model.tokenizer="
                          f"'{cfg.model.tokenizer}': {e}") from None


def sampling_params(cfg: Config, template: AnyChatTemplate, temperature: float, seed: int | None) -> SamplingParams:
    """The sampling settings of a rollout turn (``rollout.*`` caps, the template's stop tokens)."""
    return SamplingParams(
        max_new_tokens=cfg.rollout.max_new_tokens,
        temperature=temperature,
        top_p=cfg.rollout.top_p,
        stop_token_ids=list(template.stop_token_ids),
        seed=seed,
    )


def gateway_token(cfg: Config) -> str | None:
    """The gateway's bearer token from ``$<gateway.token_env>`` (None when unset); ConfigError when
    ``gateway.host`` is not loopback and there is none."""
    from env_controller.http.auth import is_loopback

    token = os.environ.get(cfg.gateway.token_env) or None
    if token is None and not is_loopback(cfg.gateway.host):
        raise ConfigError(f"gateway.host={cfg.gateway.host!r} is not loopback: the gateway then needs a bearer "
                          f"token; set ${cfg.gateway.token_env} (gateway.token_env), or bind gateway.host=127.0.0.1")
    return token


def episode_options(cfg: Config, capture_routing: bool = False) -> EpisodeOptions:
    """How the run plays an episode: the limits of the ``rollout`` section (which is an
    :class:`~rollout_sglang.episode_options.EpisodeLimits`), ``pipeline.env_timeout_s``, and whether the engines
    capture routing."""
    return EpisodeOptions(cfg.rollout, env_timeout_s=cfg.pipeline.env_timeout_s, capture_routing=capture_routing)


def build_gateway(cfg: Config, engine: Any, template: AnyChatTemplate, env: Any, *, training: bool,
                  temperature: float | None = None, gateway: GatewayOptions | None = None,
                  capture_routing: bool = False) -> Any:
    """A :class:`~rollout_sglang.gateway.Gateway` over ``engine`` (a pool or an engine) and ``env`` with the
    run's sampling settings and limits (``temperature`` replaces ``rollout.temperature``, ``gateway`` the
    ``gateway`` section); ``training`` refuses a temperature or top_p other than the run's;
    ``capture_routing``: its trajectories carry the engines' routed experts (MoE)."""
    from rollout_sglang.gateway import Gateway

    t = cfg.rollout.temperature if temperature is None else temperature
    return Gateway(engine, template, sampling_params(cfg, template, t, None),
                   episode_options(cfg, capture_routing), gateway or cfg.gateway, env=env, enforce_sampling=training)


def standalone_pool(cfg: Config, hf_config: Any, dtype: torch.dtype) -> VersionPool:
    """The engines ``agentrl gateway`` serves alone (no trainer): the SGLang servers of ``rollout.engine_urls``
    as their version slots, else one local engine with the weights of ``model.checkpoint`` (random weights
    without one, for trying the API)."""
    r = cfg.rollout
    remote = remote_engines(cfg, hf_config)
    if remote is not None:
        _take_over(remote, r.engine_startup_timeout_s)
        slots = [[BatchingEngine(c, resume_timeout_s=r.engine_timeout_s) for c in slot] for slot in remote]
    else:
        if cfg.model.megatron_checkpoint and not cfg.model.checkpoint:
            raise ConfigError(f"model.megatron_checkpoint='{cfg.model.megatron_checkpoint}': the gateway serves "
                              "Hugging Face weights; convert it (agentrl convert megatron-to-hf) and set "
                              "model.checkpoint")
        device = "cuda" if torch.cuda.is_available() else "cpu"
        if cfg.model.checkpoint:
            local = LocalEngine.from_pretrained(cfg.model.checkpoint, dtype=dtype, device=device, seed=cfg.train.seed)
        else:
            logger.warning("no model.checkpoint: the gateway serves a randomly initialised model (for trying the API)")
            local = LocalEngine(hf_config, dtype=dtype, device=device, seed=cfg.train.seed,
                                init_seed=cfg.train.seed)
        slots = [[BatchingEngine(local, resume_timeout_s=r.engine_timeout_s)]]
    return VersionPool(slots, policy=r.cross_policy if len(slots) > 1 else "latest",
                       recency_decay=r.recency_decay, seed=cfg.train.seed, drain_timeout_s=r.engine_timeout_s)


def build_agent_runner(cfg: Config, rollout_side: RolloutSide) -> Any:
    """The :class:`~rollout_sglang.gateway.AgentRunner` of ``rollout.agent: gateway``: ``rollout.agent_fn`` per
    sample against a gateway over the pool and the training env, served on ``gateway.host:port``."""
    g = cfg.gateway
    in_flight = cfg.admission_options().queue_limit * cfg.rollout.samples_per_prompt
    if g.max_sessions < in_flight:
        raise ConfigError(f"gateway.max_sessions={g.max_sessions} is below the {in_flight} episodes the rollout may "
                          "run at once (pipeline.queue_size groups of rollout.samples_per_prompt); raise it")
    gateway = build_gateway(cfg, rollout_side.pool, rollout_side.template, rollout_side.train_env,
                            training=True, capture_routing=rollout_side.routing is not None)
    return _agent_runner(cfg, gateway)


def build_eval_agent_runner(cfg: Config, rollout_side: RolloutSide, engine: Any, episodes: int) -> Any:
    """The :class:`~rollout_sglang.gateway.AgentRunner` that plays ``episodes`` held-out episodes with
    ``rollout.agent_fn``: a gateway of its own over ``engine`` and the evaluation env, ``eval.temperature``
    by default (an agent may ask for another: nothing is trained on these tokens), on ``gateway.host`` at a
    port the system picks (the training runner keeps ``gateway.port``)."""
    g = cfg.gateway
    options = dataclasses.replace(g, port=0, max_sessions=max(g.max_sessions, episodes))
    gateway = build_gateway(cfg, engine, rollout_side.template, rollout_side.env, training=False,
                            temperature=cfg.eval.temperature, gateway=options)
    return _agent_runner(cfg, gateway)


def _agent_runner(cfg: Config, gateway: Any) -> Any:
    """``rollout.agent_fn`` on ``gateway``, served where its options say, with the run's time limits."""
    from megatron_agentrl.config import load_agent_fn
    from rollout_sglang.gateway import AgentRunner

    r = cfg.rollout
    return AgentRunner(gateway, load_agent_fn(str(r.agent_fn)), r, token=gateway_token(cfg),
                       client_timeout_s=r.engine_timeout_s + cfg.pipeline.env_timeout_s)


def make_manager(cfg: Config, rollout_side: RolloutSide, version: int) -> RolloutManager:
    """The rollout manager of ``pipeline.mode`` (sync: staleness 0, a step's groups in lockstep;
    async: ``pipeline.staleness``, groups one by one) over the pool, at weight version ``version``; with
    ``rollout.agent: gateway`` its episodes are played by ``rollout.agent_fn`` through the gateway; with
    ``algo.dynamic_sampling`` groups whose shaped rewards are all equal are dropped and more are drawn."""
    r = cfg.rollout
    sampler = PromptSampler(rollout_side.task_names, rollout_side.weights, rollout_side.train_indices,
                            r.samples_per_prompt, seed=cfg.train.seed)
    options = RolloutOptions(
        cfg.admission_options(), episode=episode_options(cfg, rollout_side.routing is not None),
        sampling=sampling_params(cfg, rollout_side.template, r.temperature, None), retry=r,
        dynamic_sampling=cfg.algo, drop_limit=cfg.pipeline, seed=cfg.train.seed,
    )
    # groups of one sample under dynamic sampling are refused by Config.validate
    manager = RolloutManager(rollout_side.pool, rollout_side.train_env, rollout_side.template, sampler, options,
                             agent=build_agent_runner(cfg, rollout_side) if r.agent == "gateway" else None,
                             reward=rollout_side.shaper if cfg.algo.dynamic_sampling else None,
                             score=rollout_side.scorer)
    manager.set_version(version)
    return manager
