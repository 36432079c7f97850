"""Ray placement of a run: the train pool, one rollout pool per version slot, the env controller.

``agentrl train`` comes here when ``ray.enabled`` (a local Ray) or ``ray.address`` (a cluster to
join) is set. :func:`run_on_ray`:

1. connects to Ray (:func:`connect`);
2. reserves every pool up front as a placement group (:func:`plan_pools`,
   :func:`create_placement_groups`): ``train`` (one bundle per trainer rank, ``ray.train_*``),
   ``rollout_slot{i}`` for each version slot ``i < rollout.max_versions`` (one bundle per engine of
   ``ray.rollout_gpus_per_engine`` GPUs) and ``env_controller``; a layout the cluster cannot hold
   fails within ``ray.placement_timeout_s`` with what was asked and what is there;
3. starts the actors in their bundles: the env controller with a worker for each built-in task
   of the run (:class:`EnvControllerActor`; other task workers register with it), one
   engine server per rollout bundle (:class:`RolloutEngineActor`, ``python -m
   ray.engine_server_module``: SGLang's server), then the trainer ranks (:class:`TrainWorker`),
   which rendezvous through torch.distributed (rank 0's node and a free port) and each run the
   same training entry point as ``agentrl train`` does (``megatron_agentrl.train_rank``);
4. watches them every ``ray.health_check_interval_s`` and restarts what died, logging each restart
   with its reason: a trainer rank's actor or a node that held only trainer ranks: every trainer
   actor is replaced and the training runs again with ``checkpoint.resume=latest`` (up to
   ``ray.max_restarts`` times for the run); an engine whose server or actor died: relaunched in
   its bundle at its own host:port, so that the trainer's clients find it at the URL they know
   (``ray.engine_max_restarts`` per engine); the env controller likewise
   (``ray.controller_max_restarts``). What cannot come back (restarts used up, a lost node that
   held an engine or the controller: their URL is gone) ends the run with :class:`RunLostError`,
   whose message names what was lost, where the last checkpoint is and how to resume from it.
   Everything the run created (actors, placement groups, a local Ray) is released on every way out.

Hand-off to the training code (which runs in the trainer actors), as config overrides: the
controller URL in ``env.controller_url`` (its token in ``$AGENTRL_CONTROLLER_TOKEN``), the engine
URLs, one list per version slot, in ``rollout.engine_urls`` (JSON); the engine URLs are also
written to ``{output_dir}/ray/engines.json``.
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import socket
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from megatron_agentrl.config import Config, ConfigError

logger = logging.getLogger(__name__)


class RayLaunchError(RuntimeError):
    """The run could not be placed on Ray, or it failed there; the message says what and the fix."""


class PlacementError(RayLaunchError):
    """The placement groups did not become ready in time (the cluster lacks the resources)."""


class RunLostError(RayLaunchError):
    """A node, a trainer rank, an engine or the controller was lost mid-run; the run was stopped."""


@dataclass
class PoolSpec:
    """One placement group: its ``name``, resource ``bundles`` and Ray ``strategy``."""

    name: str
    bundles: list[dict[str, float]]
    strategy: str


def _bundle(cpus: float, gpus: float) -> dict[str, float]:
    return {"CPU": float(cpus), **({"GPU": float(gpus)} if gpus else {})}


def plan_pools(cfg: Config) -> list[PoolSpec]:
    """The placement groups of ``cfg``: train, one per rollout version slot (when the rollout runs in
    engines of its own, ``ray.rollout_gpus_per_engine > 0``) and the env controller (``ray.controller``).
    ConfigError when the config also names running engines (``rollout.engine_urls``)."""
    r = cfg.ray
    if r.rollout_gpus_per_engine and cfg.rollout.engine_urls:
        raise ConfigError(f"rollout.engine_urls={cfg.rollout.engine_urls} names running engines, but "
                          f"ray.rollout_gpus_per_engine={r.rollout_gpus_per_engine} asks Ray to start its own; "
                          "clear one of the two")
    workers = r.train_workers or cfg.parallel.model_parallel_size
    pools = [PoolSpec("train", [_bundle(r.train_cpus_per_worker, r.train_gpus_per_worker)] * workers, r.train_strategy)]
    if r.rollout_gpus_per_engine:
        engine = _bundle(r.rollout_cpus_per_engine, r.rollout_gpus_per_engine)
        for slot in range(cfg.rollout.slot_count(cfg.lora.enabled)):
            pools.append(PoolSpec(f"rollout_slot{slot}", [engine] * cfg.rollout.engines_per_slot, r.rollout_strategy))
    if r.controller:
        pools.append(PoolSpec("env_controller", [_bundle(r.controller_cpus, 0)], "PACK"))
    return pools


def gcs_reachable(address: str, timeout_s: float, poll_s: float = 1.0) -> bool:
    """Whether a TCP connection to ``address`` (``host:port``, ``ray://host:port``) opens within ``timeout_s``.

    ``ray.init`` retries an address where nothing listens for minutes; this answers first.
    """
    host, _, port = address.removeprefix("ray://").rpartition(":")
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            with socket.create_connection((host.strip("[]"), int(port)), timeout=min(5.0, max(0.1, timeout_s))):
                return True
        except (OSError, ValueError):
            if time.monotonic() + poll_s > deadline:
                return False
            time.sleep(poll_s)


def connect(cfg: Config) -> bool:
    """Connect to Ray: the cluster at ``ray.address``, else a new local Ray (``ray.num_cpus`` CPUs).

    Reuses a connection the caller already made. Returns True when this call started the
    connection (the caller then shuts it down). RayLaunchError when the cluster cannot be reached.
    """
    import ray

    if ray.is_initialized():
        return False
    kwargs: dict[str, Any] = {"namespace": cfg.ray.namespace, "include_dashboard": False,
                              "configure_logging": False, "log_to_driver": True}
    try:
        if cfg.ray.address:
            logger.info("joining the Ray cluster at %s", cfg.ray.address)
            if cfg.ray.address != "auto" and not gcs_reachable(cfg.ray.address, min(30.0, cfg.ray.placement_timeout_s)):
                raise ConnectionError("nothing listens there")
            ray.init(address=cfg.ray.address, **kwargs)
        else:
            logger.info("starting a local Ray (%s CPUs)", cfg.ray.num_cpus or "all")
            ray.init(num_cpus=cfg.ray.num_cpus or None, **kwargs)
    except (ConnectionError, RuntimeError, ValueError) as e:
        raise RayLaunchError(f"cannot connect to Ray at ray.address={cfg.ray.address!r}: {e}; start the cluster "
                             "first (ray start --head) or leave ray.address empty for a local Ray") from None
    return True


def create_placement_groups(pools: list[PoolSpec], timeout_s: float, prefix: str = "agentrl") -> dict[str, Any]:
    """Create one placement group per pool and wait until all are ready.

    Returns ``{pool name: PlacementGroup}``. On timeout removes them and raises PlacementError
    naming each pool that is not ready, what it asked for and what the cluster has.
    """
    import ray
    from ray.util.placement_group import placement_group, remove_placement_group

    pgs = {p.name: placement_group(p.bundles, strategy=p.strategy, name=f"{prefix}_{p.name}") for p in pools}
    ready = {pg.ready(): name for name, pg in pgs.items()}
    done, pending = ray.wait(list(ready), num_returns=len(ready), timeout=timeout_s)
    if pending:
        missing = [ready[ref] for ref in pending]
        asked = "; ".join(f"{p.name}: {len(p.bundles)} x {p.bundles[0]} ({p.strategy})"
                          for p in pools if p.name in missing)
        have = {k: v for k, v in ray.cluster_resources().items() if k in ("CPU", "GPU")}
        free = {k: v for k, v in ray.available_resources().items() if k in ("CPU", "GPU")}
        for pg in pgs.values():
            remove_placement_group(pg)
        raise PlacementError(
            f"placement groups not ready after {timeout_s:g}s: {asked}. The cluster has {have} (free {free}) on "
            f"{len([n for n in ray.nodes() if n['Alive']])} node(s). Add nodes, or shrink the pools "
            "(ray.train_workers, ray.*_gpus_*, rollout.max_versions, rollout.engines_per_slot), or raise "
            "ray.placement_timeout_s")
    logger.info("placement groups ready: %s", ", ".join(f"{p.name} ({len(p.bundles)} x {p.bundles[0]})" for p in pools))
    return pgs


def remove_placement_groups(pgs: dict[str, Any]) -> None:
    """Remove placement groups (ignores ones already gone)."""
    from ray.util.placement_group import remove_placement_group

    for pg in pgs.values():
        try:
            remove_placement_group(pg)
        except Exception as e:  # noqa: BLE001 - best effort on the way out
            logger.debug("placement group removal: %s", e)


def checkpoint_root(cfg: Config) -> Path:
    """Where the pipeline writes checkpoints: ``checkpoint.dir``, else ``output_dir/checkpoints``."""
    return Path(cfg.checkpoint.dir) if cfg.checkpoint.dir else Path(cfg.output_dir) / "checkpoints"


def latest_checkpoint(cfg: Config) -> str | None:
    """The newest complete checkpoint of the run (what ``checkpoint.resume=latest`` loads), or None."""
    from megatron_agentrl.pipeline.checkpoint import find_latest

    path = find_latest(checkpoint_root(cfg))
    return str(path) if path is not None else None


def resume_hint(cfg: Config) -> str:
    """What a user does to continue a stopped run, for error messages."""
    ckpt = latest_checkpoint(cfg)
    ck = cfg.checkpoint
    if ckpt is None:
        return (f"no checkpoint was written yet under {checkpoint_root(cfg)}"
                + (" (set checkpoint.interval to save every N steps)" if not ck.interval else "")
                + "; a new run starts from the beginning")
    if ck.resume == "latest":
        return f"the last checkpoint is {ckpt}; the same command resumes from it (checkpoint.resume: latest)"
    return f"the last checkpoint is {ckpt}; resume from it with the same command plus checkpoint.resume=latest"


# ------------------------------------------------------------------------------------- actors
def _node_ip() -> str:
    import ray

    return ray.util.get_node_ip_address()


class _Placed:
    """Base of the run's actors: where am I."""

    def node(self) -> tuple[str, str, int]:
        """(node id, node IP, process id) of this actor."""
        import ray

        return ray.get_runtime_context().get_node_id(), _node_ip(), os.getpid()


class TrainWorker(_Placed):
    """One trainer rank (a Ray actor): runs the training entry point of ``agentrl train``."""

    def free_port(self) -> int:
        """A free TCP port on this node (rank 0 offers it for the torch.distributed rendezvous)."""
        with socket.socket() as s:
            s.bind(("", 0))
            return int(s.getsockname()[1])

    def run(self, config_path: str, overrides: list[str], env: dict[str, str], cwd: str) -> None:
        """Train as one rank: ``env`` holds RANK, WORLD_SIZE, MASTER_ADDR/PORT and the hand-offs."""
        import ray

        os.chdir(cwd)
        os.environ.update(env)
        if len(ray.get_gpu_ids()) == 1:
            os.environ["LOCAL_RANK"] = "0"  # Ray shows this actor its one GPU only
        from megatron_agentrl.train_rank import train_rank

        train_rank(config_path, overrides)


class EnvControllerActor(_Placed):
    """The env controller (``env_controller.controller.server.Controller``) served from a Ray actor, with a
    task worker (``env_controller.worker.server.WorkerServer``) for each built-in task of the run;
    other tasks' workers (AgentBench-FC's, say) register with it themselves."""

    def __init__(self) -> None:
        import asyncio

        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="env-controller", daemon=True)
        self._thread.start()
        self._controller: Any = None
        self._workers: list[Any] = []

    def _run(self, coro: Any, timeout_s: float) -> Any:
        import asyncio

        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout=timeout_s)

    def start(self, port: int, token: str, builtin_tasks: list[tuple[str, str, dict[str, Any]]],
              timeout_s: float = 120.0) -> str:
        """Serve on all interfaces at ``port`` (0 = free), every request needing ``token``; start a
        worker for each ``(task name, built-in task class, params)`` and wait until the controller accepted its
        heartbeat.
        Returns the controller's API URL."""
        import asyncio

        from env_controller.controller.server import Controller, ControllerConfig
        from env_controller.tasks import build_task
        from env_controller.worker.options import WorkerOptions
        from env_controller.worker.server import WorkerServer

        self._controller = Controller(ControllerConfig(host="0.0.0.0", port=port, token=token))
        try:
            self._run(self._controller.start(), timeout_s)
        except Exception as e:  # noqa: BLE001 - reported to the launcher
            raise RayLaunchError(f"the env controller did not start on port {port}: {e}") from None
        local = f"http://127.0.0.1:{self._controller.port}/api"
        for name, cls, params in builtin_tasks:
            worker = WorkerServer(build_task(cls, **params), WorkerOptions(name=name, controller_url=local,
                                                                           host="127.0.0.1", port=0, token=token))
            self._run(worker.start(), timeout_s)
            self._workers.append(worker)
            try:
                self._run(asyncio.wait_for(worker.heartbeat_ok.wait(), timeout_s), timeout_s + 5)
            except Exception:  # noqa: BLE001
                raise RayLaunchError(f"the worker of task '{name}' did not register with the env controller "
                                     f"within {timeout_s:g}s") from None
        return f"http://{_node_ip()}:{self._controller.port}/api"

    def ping(self) -> bool:
        """True while the controller's event loop runs."""
        return self._thread.is_alive()

    def stop(self) -> None:
        """Stop the workers, then the controller, then the loop."""
        for worker in self._workers:
            self._run(worker.stop(), 30)
        if self._controller is not None and self._controller.port is not None:
            self._run(self._controller.stop(), 30)
        self._loop.call_soon_threadsafe(self._loop.stop)


@dataclass(frozen=True)
class EngineLaunch:
    """What every (re)launch of a rollout engine's server is given: the run's model and server settings."""

    #: the HF weights (or config) the server loads: ``model.checkpoint`` or ``model.hf_config``
    model_path: str
    #: the server's module (``ray.engine_server_module``)
    server_module: str
    #: ``model.dtype``
    dtype: str
    #: ``rollout.engine_startup_timeout_s``
    startup_timeout_s: float
    #: where the server's log goes
    log_dir: str
    #: ``rollout.capture_routing``: "auto"/"on" start a MoE model's server with routed-experts capture (a dense
    #: model gets none: "on" was refused for it by the config check)
    capture_routing: str = "off"
    #: the server's API and admin keys (it listens on every interface: without them anyone on the network could
    #: push weights)
    keys: tuple[str, str] | None = None
    #: a LoRA run: ``(lora.rank, lora.target_modules, rollout.max_versions)``, from which the server gets its LoRA
    #: flags (every live version an adapter on it); None: no LoRA
    lora: tuple[int, tuple[str, ...], int] | None = None
    #: the driver's working directory, where the actor starts the server (as a trainer rank runs there): a relative
    #: path in the server's own flags means what it meant on the driver ("": the actor's own)
    workdir: str = ""
    #: ``rollout.sglang_server_args``: more server flags (checked at config load)
    server_args: dict[str, Any] = field(default_factory=dict)


def engine_launch(cfg: Config, keys: tuple[str, str] | None) -> EngineLaunch:
    """The :class:`EngineLaunch` of ``cfg``'s engines, its paths resolved on the driver: a ``model.checkpoint`` (or
    ``model.hf_config``) that is a directory here becomes absolute, so that an engine actor, whatever its working
    directory, loads the same one (a name that is no local path, such as a hub id, is passed as given)."""
    model = Path(str(cfg.model.checkpoint or cfg.model.hf_config)).expanduser()
    lora = cfg.lora
    return EngineLaunch(str(model.resolve()) if model.exists() else str(cfg.model.checkpoint or cfg.model.hf_config),
                        cfg.ray.engine_server_module, cfg.model.dtype, cfg.rollout.engine_startup_timeout_s,
                        str(Path(cfg.output_dir).resolve() / "ray" / "engine_logs"), cfg.rollout.capture_routing, keys,
                        (lora.rank, tuple(lora.target_modules), cfg.rollout.max_versions) if lora.enabled else None,
                        os.getcwd(), dict(cfg.rollout.sglang_server_args))


class RolloutEngineActor(_Placed):
    """One rollout engine: an SGLang server (or a module with its command line) on this bundle's GPUs."""

    def __init__(self) -> None:
        self._engine = None

    def start(self, run: EngineLaunch, port: int = 0, stale_pid: int = 0) -> tuple[str, int]:
        """Launch the server (``run``: the run's model and server settings) on the GPUs Ray gave this actor at
        ``port`` (0 = a free one); return its URL, once healthy, and its process id. ``stale_pid``: the server an
        earlier actor of this bundle left (its own session outlives a SIGKILLed actor): stopped first, so that the
        port is free for the relaunch."""
        import ray

        from rollout_sglang.engines.router_capture import routing_layout_from_config
        from rollout_sglang.engines.sglang_client import SGLangEngine
        from rollout_sglang.engines.sglang_options import SGLangClientOptions, SGLangLaunchOptions

        if self._engine is not None:  # relaunch in this actor: the old server exited (ping said so)
            self._engine.shutdown()
        if run.workdir:
            os.chdir(run.workdir)
        if stale_pid:
            _stop_stale_server(stale_pid, port, timeout_s=30.0)
        gpus = [int(g) for g in ray.get_gpu_ids()]
        capture = run.capture_routing != "off" and routing_layout_from_config(run.model_path) is not None
        api_key, admin_api_key = run.keys or (None, None)
        launch = SGLangLaunchOptions(host="0.0.0.0", port=port or None, dtype=run.dtype,
                                     startup_timeout_s=run.startup_timeout_s, log_dir=run.log_dir,
                                     server_module=run.server_module, capture_routing=capture,
                                     server_args=dict(run.server_args))
        if run.lora is not None:
            launch = launch.with_lora(*run.lora)
        self._engine = SGLangEngine.launch(run.model_path, launch, SGLangClientOptions(api_key=api_key,
                                                                                   admin_api_key=admin_api_key),
                                           gpus=gpus)
        port = self._engine.base_url.rsplit(":", 1)[1]
        return f"http://{_node_ip()}:{port}", int(self._engine.process.pid)

    def ping(self) -> bool:
        """True while the server process runs."""
        proc = self._engine.process if self._engine else None
        return proc is not None and proc.poll() is None

    def stop(self) -> None:
        """Stop the server process."""
        if self._engine is not None:
            self._engine.shutdown()


def _stop_stale_server(pid: int, port: int, timeout_s: float) -> None:
    """SIGKILL the process group of the engine server ``pid`` if it still runs and is the server of ``port`` (its
    command line says so: a recycled pid is left alone), and wait up to ``timeout_s`` until it is gone."""
    import signal

    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return  # gone already
    if b"--port" not in cmdline or cmdline[cmdline.index(b"--port") + 1:][:1] != [str(port).encode()]:
        return
    logger.warning("stopping the engine server left by the lost actor (pid %d, port %d)", pid, port)
    try:
        os.killpg(pid, signal.SIGKILL)  # launched in a session of its own: its group is the server and its children
    except ProcessLookupError:
        return
    deadline = time.monotonic() + timeout_s
    while _running(pid) and time.monotonic() < deadline:
        time.sleep(0.1)


def _running(pid: int) -> bool:
    """Whether process ``pid`` exists and is not a zombie (a dead one whose parent has not reaped it holds no port)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


_REMOTE: dict[str, Any] = {}


def _remote(cls: type) -> Any:
    """The Ray actor class of ``cls`` (made once; ray is imported only when Ray is used)."""
    import ray

    if cls.__name__ not in _REMOTE:
        # no restart by Ray: a restarted actor would only re-run __init__; RayRun restarts its actors itself, which
        # knows what each must do again (resume the training, relaunch the server at its port)
        _REMOTE[cls.__name__] = ray.remote(max_restarts=0, max_task_retries=0)(cls)
    return _REMOTE[cls.__name__]


# ----------------------------------------------------------------------------------- the run
@dataclass
class _Member:
    """An actor of the run: its kind (trainer, engine, controller), its name in messages, where it lives."""

    kind: str
    what: str
    actor: Any
    node_id: str = ""
    node_ip: str = ""
    pid: int = 0
    pool: str = ""  # its placement group and bundle: a restarted actor takes the same one (the same node)
    index: int = 0
    url: str = ""  # an engine's or the controller's: a restart brings it back there
    server_pid: int = 0  # an engine's server process
    restarts: int = 0
    starting: Any = None  # the start() call of a restart still running
    start_deadline: float = 0.0


class _TrainerLost(Exception):
    """A trainer rank's actor or its node died (the training can go on from the last checkpoint)."""

    def __init__(self, what: str, detail: str) -> None:
        super().__init__(f"{what}: {detail}")
        self.what, self.detail = what, detail


class RayRun:
    """One run on Ray: placement groups, actors, the watch loop, restarts and cleanup (see the module doc)."""

    def __init__(self, cfg: Config, config_path: str, overrides: list[str]) -> None:
        """``cfg``: the loaded config; ``config_path`` / ``overrides``: what each trainer rank loads."""
        self.cfg = cfg
        self.config_path = str(Path(config_path).resolve())
        self.overrides = list(overrides)
        self.pools = plan_pools(cfg)
        self.pgs: dict[str, Any] = {}
        self.members: list[_Member] = []
        self.prefix = f"agentrl_{os.getpid()}_{int(time.time())}"
        self.controller_token = ""
        self.engine_keys: tuple[str, str] | None = None  # the engine servers' API and admin keys
        self.restarts = 0  # of the trainer group
        self._builtin: list[tuple[str, str, dict[str, Any]]] = []

    def _options(self, pool: str, index: int, cpus: float, gpus: float, name: str) -> dict[str, Any]:
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        return {"num_cpus": cpus, "num_gpus": gpus, "name": f"{self.prefix}_{name}",
                "scheduling_strategy": PlacementGroupSchedulingStrategy(self.pgs[pool],
                                                                        placement_group_bundle_index=index)}

    def _add(self, kind: str, what: str, actor: Any, pool: str = "", index: int = 0) -> _Member:
        """Record an actor of the run and the node it was placed on."""
        m = _Member(kind, what, actor, pool=pool, index=index)
        self.members.append(m)
        self._locate(m)
        return m

    def _locate(self, m: _Member) -> None:
        """Where ``m``'s actor runs; RunLostError when it is not placed within ``ray.placement_timeout_s`` (a
        restart whose bundle lost its node waits for Ray to place the bundle again)."""
        import ray

        t = self.cfg.ray.placement_timeout_s
        try:
            m.node_id, m.node_ip, m.pid = ray.get(m.actor.node.remote(), timeout=t)
        except ray.exceptions.GetTimeoutError:
            raise self._lost(m.what, f"its actor was not placed within ray.placement_timeout_s={t:g}s (its "
                             "placement group lacks a node that can hold it)") from None

    # ---------------------------------------------------------------------------- controller
    def start_controller(self) -> str:
        """Start the env controller actor; returns its API URL."""
        import secrets

        import ray

        token = self.cfg.env.token or os.environ.get("AGENTRL_CONTROLLER_TOKEN") or secrets.token_hex(16)
        self.controller_token = token
        from env_controller.tasks import TASKS

        self._builtin = [(t.name, t.task or t.name, t.params) for t in self.cfg.tasks if (t.task or t.name) in TASKS]
        m = self._add("controller", "the env controller", self._controller_actor(), "env_controller")
        m.url = ray.get(m.actor.start.remote(self.cfg.ray.controller_port, token, self._builtin), timeout=300)
        logger.info("env controller: %s, serving the built-in tasks %s; other task workers register there with the "
                    "token in $AGENTRL_CONTROLLER_TOKEN", m.url, [n for n, _, _ in self._builtin] or "none")
        return m.url

    def _controller_actor(self) -> Any:
        return _remote(EnvControllerActor).options(**self._options("env_controller", 0, self.cfg.ray.controller_cpus,
                                                                    0, "env_controller")).remote()

    # ------------------------------------------------------------------------------- engines
    def start_engines(self) -> list[list[str]]:
        """Start one engine per rollout bundle; returns the URLs per version slot."""
        import secrets

        import ray

        rollout = self.cfg.rollout
        if not (self.cfg.model.checkpoint or self.cfg.model.hf_config):
            raise ConfigError("ray.rollout_gpus_per_engine > 0 needs model.checkpoint "
                              "(the HF weights the engines serve)")
        # the servers' keys: the user's (the variables the trainer's clients read), else generated for the run
        self.engine_keys = (os.environ.get(rollout.engine_api_key_env) or secrets.token_hex(16),
                            os.environ.get(rollout.engine_admin_api_key_env) or secrets.token_hex(16))
        started: list[list[tuple[_Member, Any]]] = []
        for slot in range(rollout.slot_count(self.cfg.lora.enabled)):
            started.append([])
            for i in range(rollout.engines_per_slot):
                m = self._add("engine", f"rollout engine {i} of version slot {slot}",
                              self._engine_actor(f"rollout_slot{slot}", i), f"rollout_slot{slot}", i)
                started[-1].append((m, self._engine_start(m, port=0)))
        for slot_started in started:
            for m, ref in slot_started:
                m.url, m.server_pid = ray.get(ref, timeout=rollout.engine_startup_timeout_s + 60)
        urls = [[m.url for m, _ in slot_started] for slot_started in started]
        logger.info("rollout engines: %s", urls)
        return urls

    def _engine_actor(self, pool: str, index: int) -> Any:
        r = self.cfg.ray
        slot = pool.removeprefix("rollout_slot")
        return _remote(RolloutEngineActor).options(**self._options(
            pool, index, r.rollout_cpus_per_engine, r.rollout_gpus_per_engine, f"engine_s{slot}_{index}")).remote()

    def _engine_start(self, m: _Member, port: int, stale_pid: int = 0) -> Any:
        return m.actor.start.remote(engine_launch(self.cfg, self.engine_keys), port, stale_pid)

    # ------------------------------------------------------------------------------ trainers
    def start_trainers(self) -> list[_Member]:
        """Create the trainer rank actors in the train pool (not training yet)."""
        r = self.cfg.ray
        world = len(self.pools[0].bundles)
        members = []
        for rank in range(world):
            actor = _remote(TrainWorker).options(**self._options("train", rank, r.train_cpus_per_worker,
                                                                  r.train_gpus_per_worker, f"train_{rank}")).remote()
            members.append(self._add("trainer", f"trainer rank {rank}", actor, "train", rank))
        return members

    def _launch_trainers(self, overrides: list[str], env: dict[str, str]) -> dict[Any, _Member]:
        """Fresh trainer actors, each training its rank; returns {its run() call: member}."""
        import ray

        trainers = self.start_trainers()
        master_port = ray.get(trainers[0].actor.free_port.remote(), timeout=60)
        world = len(trainers)
        logger.info("train pool: %d rank(s) on %s; rendezvous %s:%d", world,
                    ", ".join(sorted({m.node_ip for m in trainers})), trainers[0].node_ip, master_port)
        refs = {}
        for rank, m in enumerate(trainers):
            rank_env = {**env, "RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank),
                        "MASTER_ADDR": trainers[0].node_ip, "MASTER_PORT": str(master_port)}
            refs[m.actor.run.remote(self.config_path, overrides, rank_env, os.getcwd())] = m
        return refs

    def _drop_trainers(self) -> None:
        """Kill the trainer actors still alive (a rank that lost its peers would wait on them)."""
        import ray

        for m in [m for m in self.members if m.kind == "trainer"]:
            try:
                ray.kill(m.actor, no_restart=True)
            except Exception as e:  # noqa: BLE001 - already gone
                logger.debug("killing %s: %s", m.what, e)
            self.members.remove(m)

    def _set_aside_records(self) -> None:
        """Before a restart from the beginning (no checkpoint yet): move the lost attempt's records (metrics.jsonl,
        batches.jsonl, tensorboard/) to ``output_dir/ray/attempt_<n>/``, so that the new one records each step
        once (a resume truncates them at the checkpoint instead)."""
        out = Path(self.cfg.output_dir)
        dest = out / "ray" / f"attempt_{self.restarts}"
        for name in ("metrics.jsonl", "batches.jsonl", "tensorboard"):
            if (out / name).exists():
                dest.mkdir(parents=True, exist_ok=True)
                (out / name).rename(dest / name)
        if dest.exists():
            logger.warning("no checkpoint to resume from: the lost attempt's records are kept in %s", dest)

    def run(self) -> dict[str, Any]:
        """Place, start, watch, restart the trainer group after a loss (``ray.max_restarts``); returns the run's
        summary.json (empty dict when there is none)."""
        self.pgs = create_placement_groups(self.pools, self.cfg.ray.placement_timeout_s, self.prefix)
        overrides = list(self.overrides)
        env: dict[str, str] = {}
        if self.cfg.ray.controller:
            url = self.start_controller()
            overrides.append(f"env.controller_url={url}")
            env["AGENTRL_CONTROLLER_TOKEN"] = self.controller_token
        if self.cfg.ray.rollout_gpus_per_engine:
            engines = self.start_engines()
            overrides.append(f"rollout.engine_urls={json.dumps(engines)}")
            rollout = self.cfg.rollout
            env[rollout.engine_api_key_env], env[rollout.engine_admin_api_key_env] = self.engine_keys
            out = Path(self.cfg.output_dir) / "ray"
            out.mkdir(parents=True, exist_ok=True)
            (out / "engines.json").write_text(json.dumps(engines, indent=2))
        limit = self.cfg.ray.max_restarts
        while True:
            try:
                self._watch(self._launch_trainers(overrides, env))
                break
            except _TrainerLost as lost:
                if self.restarts >= limit:
                    raise self._lost(lost.what, lost.detail + (f"; the trainer group was restarted {self.restarts} "
                                                               f"time(s), ray.max_restarts={limit}" if limit else
                                                               " (ray.max_restarts=0: no restart)")) from None
                self.restarts += 1
                ckpt = latest_checkpoint(self.cfg)
                logger.warning("trainer group restart %d of %d (ray.max_restarts): lost %s; resuming from %s",
                               self.restarts, limit, lost, ckpt or "the beginning (no checkpoint yet)")
                self._drop_trainers()
                if ckpt is None:
                    self._set_aside_records()
                # the same command with checkpoint.resume=latest, as resume_hint tells a user; the last override wins
                overrides = [o for o in overrides if not o.startswith("checkpoint.resume=")] + \
                    ["checkpoint.resume=latest"]
        summary = Path(self.cfg.output_dir) / "summary.json"
        return json.loads(summary.read_text()) if summary.is_file() else {}

    # --------------------------------------------------------------------------------- watch
    def _watch(self, refs: dict[Any, _Member]) -> None:
        """Wait for the trainer ranks' run() calls; between them check the nodes and the other actors (restarting
        those that died). _TrainerLost when a trainer actor or its node died, RunLostError for what cannot come
        back, the training's own error when it raised."""
        import ray
        from ray.exceptions import RayTaskError

        pending = list(refs)
        while pending:
            done, pending = ray.wait(pending, num_returns=1, timeout=self.cfg.ray.health_check_interval_s)
            for ref in done:
                member = refs[ref]
                try:
                    ray.get(ref)
                except RayTaskError as e:  # the training code raised: re-raise what it raised
                    # ... unless a peer rank died: its collective broke this one, the death is the cause
                    self._raise_if_trainer_died(pending, refs)
                    cause = e.cause if isinstance(e.cause, BaseException) else None
                    if isinstance(cause, (ConfigError, FileNotFoundError)):
                        raise cause from None
                    raise RayLaunchError(f"{member.what} failed: {cause if cause is not None else e}") from None
                except ray.exceptions.RayError as e:  # actor died, worker crashed, node died, object lost
                    self._wait_for_dead_node()  # a dead node is the better message: give Ray a moment to see it
                    raise _TrainerLost(f"{member.what} (node {member.node_ip}, Ray node {member.node_id[:12]})",
                                       f"its actor died ({_first_line(e)})") from None
            if pending:
                self._check_nodes(self.members)
                for m in [m for m in self.members if m.kind != "trainer"]:
                    self._check_service(m)

    def _raise_if_trainer_died(self, pending: list[Any], refs: dict[Any, _Member]) -> None:
        """_TrainerLost when another trainer rank's actor died (seen within a few seconds)."""
        import ray

        if not pending:
            return
        wait_s = min(10.0, 2 * self.cfg.ray.health_check_interval_s)
        done, _ = ray.wait(pending, num_returns=len(pending), timeout=wait_s)
        for ref in done:
            try:
                ray.get(ref)
            except ray.exceptions.RayActorError as e:
                m = refs[ref]
                raise _TrainerLost(f"{m.what} (node {m.node_ip}, Ray node {m.node_id[:12]})",
                                   f"its actor died ({_first_line(e)})") from None
            except ray.exceptions.RayError:
                continue

    def _check_service(self, m: _Member) -> None:
        """One health check of an engine or the controller; one that died is restarted at its URL."""
        import ray

        if m.starting is not None:
            self._check_restart(m)
            return
        try:
            alive = ray.get(m.actor.ping.remote(), timeout=max(10.0, self.cfg.ray.health_check_interval_s))
        except ray.exceptions.GetTimeoutError:
            return  # busy, not dead: the next tick asks again
        except ray.exceptions.RayError as e:
            self._wait_for_dead_node()
            self._restart_service(m, f"its actor died ({_first_line(e)})", new_actor=True)
            return
        if not alive:
            self._restart_service(m, "its process exited", new_actor=False)

    def _restart_service(self, m: _Member, reason: str, new_actor: bool) -> None:
        """Start ``m`` again at its URL (same bundle, so same node; same port), up to ``ray.engine_max_restarts``
        / ``ray.controller_max_restarts`` times; the start runs while the watch goes on (see _check_restart)."""
        import ray

        r = self.cfg.ray
        key = "engine_max_restarts" if m.kind == "engine" else "controller_max_restarts"
        limit = getattr(r, key)
        where = f"{m.what} at {m.url} (node {m.node_ip}, Ray node {m.node_id[:12]})"
        if m.restarts >= limit:
            raise self._lost(where, reason + (f"; it was restarted {m.restarts} time(s), ray.{key}={limit}" if limit
                                              else f" (ray.{key}=0: no restart)"))
        m.restarts += 1
        logger.warning("restart %d of %d (ray.%s) of %s: %s", m.restarts, limit, key, where, reason)
        port = int(m.url.rstrip("/").removesuffix("/api").rsplit(":", 1)[1])
        if new_actor:
            try:
                ray.kill(m.actor, no_restart=True)
            except Exception as e:  # noqa: BLE001 - dead already
                logger.debug("killing %s: %s", m.what, e)
            m.actor = self._engine_actor(m.pool, m.index) if m.kind == "engine" else self._controller_actor()
            self._locate(m)
        if m.kind == "engine":
            m.starting = self._engine_start(m, port=port, stale_pid=m.server_pid if new_actor else 0)
            m.start_deadline = time.monotonic() + self.cfg.rollout.engine_startup_timeout_s + 60
        else:
            m.starting = m.actor.start.remote(port, self.controller_token, self._builtin)
            m.start_deadline = time.monotonic() + 300

    def _check_restart(self, m: _Member) -> None:
        """A restart of ``m`` in progress: done (back at its URL), failed (restart again or stop), or still on."""
        import ray

        done, _ = ray.wait([m.starting], timeout=0)
        if not done:
            if time.monotonic() > m.start_deadline:
                m.starting = None
                self._restart_service(m, "its restart did not come up in time", new_actor=True)
            return
        ref, m.starting = m.starting, None
        try:
            result = ray.get(ref)
        except ray.exceptions.RayError as e:
            self._restart_service(m, f"its restart failed ({_first_line(e)})", new_actor=True)
            return
        url = result[0] if m.kind == "engine" else result
        if m.kind == "engine":
            m.server_pid = result[1]
        if url != m.url:  # the clients know the old URL only; a bundle on the same node cannot move it
            raise self._lost(m.what, f"it came back at {url}, not at {m.url}")
        logger.warning("%s is back at %s (restart %d)", m.what, m.url, m.restarts)

    def _wait_for_dead_node(self) -> None:
        """After an actor died: raise the node's loss if Ray marks its node dead within a few seconds."""
        deadline = time.monotonic() + max(5.0, 2 * self.cfg.ray.health_check_interval_s)
        while time.monotonic() < deadline:
            self._check_nodes(self.members)
            time.sleep(0.5)

    def _check_nodes(self, members: list[_Member]) -> None:
        """Raise when a node that holds a member of the run is dead: _TrainerLost when it held trainer ranks
        only (the group restarts, Ray places the train bundles again), RunLostError when it held an engine or
        the controller (they cannot come back at their URL)."""
        import ray

        alive = {n["NodeID"]: n["Alive"] for n in ray.nodes()}
        for m in members:
            if m.node_id and not alive.get(m.node_id, False):
                lost = [x for x in members if x.node_id == m.node_id]
                what = f"node {m.node_ip} (Ray node {m.node_id[:12]})"
                detail = f"Ray marks it dead; it held {', '.join(x.what for x in lost)}"
                if all(x.kind == "trainer" for x in lost):
                    raise _TrainerLost(what, detail)
                raise self._lost(what, detail)

    def _lost(self, what: str, detail: str) -> RunLostError:
        return RunLostError(f"Ray run lost {what} mid-run: {detail}. The run was stopped; {resume_hint(self.cfg)}. "
                            "Check the cluster (ray status) before resubmitting.")

    def cleanup(self) -> None:
        """Stop the engines and the controller, kill every actor, remove the placement groups."""
        import ray

        for m in self.members:
            if m.kind != "trainer":
                try:
                    ray.get(m.actor.stop.remote(), timeout=30)
                except Exception as e:  # noqa: BLE001 - best effort on the way out
                    logger.debug("stopping %s: %s", m.what, e)
        for m in self.members:
            try:
                ray.kill(m.actor, no_restart=True)
            except Exception as e:  # noqa: BLE001
                logger.debug("killing %s: %s", m.what, e)
        remove_placement_groups(self.pgs)
        self.members, self.pgs = [], {}


def _first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return text[0] if text else type(e).__name__


def run_on_ray(cfg: Config, config_path: str, overrides: list[str]) -> dict[str, Any]:
    """Run ``agentrl train`` on Ray for ``cfg`` (loaded from ``config_path`` + ``overrides``).

    Returns the run's summary. Raises PlacementError when the pools do not fit, RunLostError when
    a node or an actor of the run is lost, RayLaunchError when the training fails on a rank.
    """
    started = connect(cfg)
    run = RayRun(cfg, config_path, overrides)
    try:
        return run.run()
    finally:
        run.cleanup()
        if started:
            import ray

            ray.shutdown()


def wait_for_nodes(address: str, nodes: int, timeout_s: float, poll_s: float = 2.0) -> int:
    """Wait until the Ray cluster at ``address`` has ``nodes`` alive nodes; returns how many it has.

    Raises RayLaunchError naming the nodes that joined when ``timeout_s`` passes first.
    """
    import ray

    deadline = time.monotonic() + timeout_s
    if not gcs_reachable(address, timeout_s):
        raise RayLaunchError(f"no Ray head answers at {address} after {timeout_s:g}s; see the job log for the "
                             "ray start --head output")
    while True:
        try:
            if not ray.is_initialized():
                ray.init(address=address, include_dashboard=False, configure_logging=False, log_to_driver=False)
            alive = [n["NodeManagerAddress"] for n in ray.nodes() if n["Alive"]]
            if len(alive) >= nodes:
                return len(alive)
        except (ConnectionError, RuntimeError) as e:
            alive = []
            logger.debug("Ray at %s not reachable yet: %s", address, e)
        if time.monotonic() > deadline:
            raise RayLaunchError(f"only {len(alive)} of {nodes} Ray node(s) joined {address} within {timeout_s:g}s "
                                 f"(joined: {', '.join(alive) or 'none'}); see the job log for the ray start output")
        time.sleep(poll_s)


def main(argv: list[str] | None = None) -> int:
    """``python -m megatron_agentrl.launch.ray_placement wait --address A --nodes N --timeout S``."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", datefmt="%H:%M:%S")
    p = argparse.ArgumentParser(prog="python -m megatron_agentrl.launch.ray_placement")
    sub = p.add_subparsers(dest="cmd", required=True)
    w = sub.add_parser("wait", help="wait until N nodes joined the Ray cluster")
    w.add_argument("--address", required=True)
    w.add_argument("--nodes", type=int, required=True)
    w.add_argument("--timeout", type=float, default=300.0)
    args = p.parse_args(argv)
    try:
        n = wait_for_nodes(args.address, args.nodes, args.timeout)
    except RayLaunchError as e:
        sys.stderr.write(f"error: {e}\n")
        return 1
    logger.info("Ray cluster at %s: %d node(s) alive", args.address, n)
    return 0


if __name__ == "__main__":
    sys.exit(main())
