"""``terminal``: terminal-agent tasks that bring their own image and are judged by a verifier run in the container.

Each instance (:mod:`env_controller.tasks.terminal_format`: a Harbor / Terminal-Bench task directory, a
manifest of many, or the demo's generated families, :mod:`env_controller.tasks.terminal_demo`) names its
image; a session gets a container of that image (root filesystem writable, no network, a non-root user,
the image's working directory), runs the instance's setup commands, and gives the agent a bash tool. When
the agent calls ``finish_action``, the agent's processes are killed, the verifier's files are put in ``/tests``
and its script runs in the same container as a user of its own (``verifier_user``), from a home of its own, under
its own time limit (:meth:`TerminalSession.verify`); its result is the reward:

* ``/logs/verifier/reward.json`` (``{"reward": x, ...}``; other numbers become metrics ``verifier/<key>``)
  or ``/logs/verifier/reward.txt`` (a number), when the verifier writes one (Harbor's contract);
* else its exit code: 0 is reward 1, anything else 0.

A verifier that runs past its timeout (or breaks another limit: output, processes, memory) fails the episode,
reward 0 with an ``error`` saying which limit (``verifier_limit: failure``): the verifier exercised the agent's work,
and a program that hangs its tests fails them, as a judge's time limit does; were it left out instead, an agent
could escape every 0 by leaving work that hangs its tests. ``verifier_limit: error`` makes it ``task error``, an
infrastructure failure left out of training (Harbor's reading), for verifiers whose time depends more on the machine
than on the agent. A verifier that cannot be set up or started is ``task error`` either way.

Containers come from one :class:`~env_controller.sandbox.pool.SandboxPool` per image (and per working
directory and limits), all under one :class:`~env_controller.sandbox.pool.PoolBudget` (``max_containers``):
warm containers per image by demand (``warm_containers``), started ahead of sessions; images are built on
their own threads (:class:`~env_controller.sandbox.task_images.ImageCache`), and a session awaits its own
image's build only, never another's.
"""
from __future__ import annotations

import asyncio
import json
import logging
import shlex
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass, replace
from typing import Any, Literal

from env_controller.protocol import SampleStatus, TaskReply
from env_controller.sandbox import SandboxError
from env_controller.sandbox.docker import DockerBackend
from env_controller.sandbox.options import ContainerOptions, DockerOptions, parse_user
from env_controller.sandbox.pool import PoolBudget, SandboxPool
from env_controller.sandbox.task_images import ImageCache, ImageSource
from env_controller.tasks.base import (
    DemonstrationUnavailable,
    Expert,
    Message,
    ToolResult,
    ToolSchema,
    function_schema,
)
from env_controller.tasks.blocking import BlockingToolTask, BlockingToolTaskSession
from env_controller.tasks.options import BlockingTaskOptions
from env_controller.tasks.terminal_demo import FAMILIES, demo_instances  # also registers the demo's images
from env_controller.tasks.terminal_format import TaskFormatError, TerminalInstance, load_tasks

logger = logging.getLogger(__name__)

#: where the verifier's files go, and where it may write its reward (Harbor's paths)
TESTS_DIR = "/tests"
LOGS_DIR = "/logs/verifier"
#: the metric of an episode whose verifier broke a limit (``verifier_limit``)
VERIFIER_LIMIT_METRIC = "verifier_limit_hit"
#: the verifier's home, working directory and (``tmp/``) temporary files: its own, made for each verification
VERIFIER_HOME = "/verifier"
#: what the verifier made, removed before a container is reused (and what an agent may have planted there, before
#: the verifier runs)
VERIFIER_PATHS = (TESTS_DIR, LOGS_DIR.rsplit("/", 1)[0], VERIFIER_HOME)
#: the largest reward file read
MAX_REWARD_BYTES = 65536
#: plays of a demonstration before its infrastructure failure is final, and the pause after the first (then 2x, ...)
DEMO_ATTEMPTS = 3
DEMO_RETRY_PAUSE_S = 5.0
_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"


class TerminalSession(BlockingToolTaskSession):
    """One episode in its own container (see the module docstring)."""

    def __init__(self, task: "TerminalTask", instance: TerminalInstance, pool: SandboxPool, box: Any) -> None:
        super().__init__(task.TOOLS, task.max_turns, task.executor)
        self.instance = instance
        self.pool = pool
        self.sandbox = box
        self.max_output_chars = task.options.max_output_chars
        self.verifier_user = task.options.verifier_user
        self.verifier_limit = task.options.verifier_limit
        self.commands = 0
        self.limit_hits = 0

    def call_tool(self, name: str, arguments: dict[str, Any]) -> ToolResult:
        """``bash_action`` runs the script; ``finish_action`` runs the verifier."""
        if name == "bash_action":
            return ToolResult(self._bash(arguments["script"]))
        return self.verify()

    def _bash(self, script: str) -> str:
        self.commands += 1
        if not script.strip():
            return "error: the script is empty; pass bash commands in 'script'"
        result = self.sandbox.run(script)
        if result.limit is not None:
            self.limit_hits += 1
        return result.reply(self.max_output_chars)

    def verify(self) -> ToolResult:
        """Run the verifier as its own user, after the agent's last process; its reward, or ``task error`` when it
        could not judge (its timeout, another limit, the files not copied).

        The agent's processes are killed first. What it may have planted where the verifier's files go is
        removed, then the tests are copied in (root's, read-only to all), the reward directory and the
        verifier's home are made (the verifier's alone), and the verifier runs as :attr:`TerminalTask.verifier_user`
        from its home, with a fixed environment: nothing the agent wrote is on its PATH, in its HOME or in its
        working directory. It reads the agent's work by absolute path (docs/environments.md)."""
        v = self.instance.verifier
        box = self.sandbox
        user = self.verifier_user
        vuid, vgid = parse_user(user)
        try:
            box.reset()  # the agent's processes end
            # an image that lets the agent write there lets it plant a reward, tests or a home before the verifier
            # runs: what it made is removed as the agent (root here has no capability to override its modes), then
            # anything left as root; SandboxError (not judged) when something remains
            paths = " ".join(VERIFIER_PATHS)
            box.run(f"chmod -R u+rwx {paths} 2>/dev/null; rm -rf {paths}", timeout_s=30.0)
            box.remove_as_root(list(VERIFIER_PATHS))
            box.put_files(TESTS_DIR, v.files, owner=(0, 0), dir_mode=0o755)
            box.put_files(LOGS_DIR, {}, owner=(vuid, vgid), dir_mode=0o755)
            box.put_files(VERIFIER_HOME, {}, owner=(vuid, vgid), dir_mode=0o700)
        except SandboxError as exc:
            return self._task_error(f"the verifier of {self.instance.id} could not be set up: {exc}")
        tmp = f"{VERIFIER_HOME}/tmp"
        env = {"HOME": VERIFIER_HOME, "USER": "verifier", "LOGNAME": "verifier", "SHELL": "/bin/bash",
               "PATH": _PATH, "LANG": "C.UTF-8", "TMPDIR": tmp, "TEST_DIR": TESTS_DIR,
               "T_BENCH_TEST_DIR": TESTS_DIR, "T_BENCH_CONTAINER_LOGS_PATH": "/logs", **v.env}
        assigns = " ".join(f"{k}={shlex.quote(val)}" for k, val in env.items())
        script = f"cd {VERIFIER_HOME} && mkdir -p {tmp} && env -i {assigns} {v.command}"
        try:
            result = box.run_as(user, script, env, VERIFIER_HOME, timeout_s=v.timeout_s)
        except SandboxError as exc:
            return self._task_error(f"the verifier of {self.instance.id} could not start: {exc}")
        metrics = {"verifier_s": round(result.duration_s, 3)}
        if result.limit is not None:
            why = (f"ran past its timeout of {v.timeout_s:g} s and was stopped" if result.limit == "timeout"
                   else f"was stopped: {result.error}")
            return self._limit_hit(f"the verifier of {self.instance.id} {why}", metrics)
        metrics["verifier_exit_code"] = float(result.exit_code if result.exit_code is not None else -1)
        reward, extra, error = self._reward_file()
        if error:
            return self._task_error(f"the verifier of {self.instance.id} wrote a bad reward: {error}", metrics)
        if reward is None:
            reward = 1.0 if result.exit_code == 0 else 0.0
        metrics.update(extra)
        success = reward >= 1.0
        text = "the tests passed" if success else f"the tests failed (reward {reward:g})"
        return ToolResult(text, finish=True, success=success, reward=reward, metrics=metrics)

    def _reward_file(self) -> tuple[float | None, dict[str, float], str]:
        """``(reward, metrics, error)`` from ``reward.json`` / ``reward.txt`` in :data:`LOGS_DIR`, if written."""
        for first in (f"{LOGS_DIR}/reward.json", f"{LOGS_DIR}/reward.txt"):
            try:
                data = self.sandbox.read_file(first, MAX_REWARD_BYTES)
            except SandboxError as exc:
                return None, {}, f"reading it failed: {exc}"
            if data is not None:
                break
        else:
            return None, {}, ""
        body = data.decode(errors="replace")
        try:
            if first.endswith(".json"):
                doc = json.loads(body)
                if not isinstance(doc, dict) or not isinstance(doc.get("reward"), (int, float)):
                    return None, {}, "reward.json must be an object with a number 'reward'"
                extra = {f"verifier/{k}": float(val) for k, val in doc.items()
                         if k != "reward" and isinstance(val, (int, float)) and not isinstance(val, bool)}
                return float(doc["reward"]), extra, ""
            return float(body.strip()), {}, ""
        except ValueError as e:
            return None, {}, f"{first}: {e}"

    def _limit_hit(self, why: str, metrics: dict[str, float]) -> ToolResult:
        """The verifier broke a limit: a failed episode (reward 0), or a task error, by ``verifier_limit``."""
        metrics[VERIFIER_LIMIT_METRIC] = 1.0
        if self.verifier_limit == "error":
            return self._task_error(f"{why}; the episode was not judged (verifier_limit: error)", metrics)
        logger.info("terminal: %s; the episode fails (verifier_limit: failure)", why)
        return ToolResult(f"the tests failed: {why}", finish=True, success=False, reward=0.0, error=why,
                          metrics=metrics)

    def _task_error(self, why: str, metrics: dict[str, float] | None = None) -> ToolResult:
        logger.warning("terminal: %s", why)
        return ToolResult(f"error: {why}", finish=True, success=False, reward=0.0, status=SampleStatus.TASK_ERROR,
                          error=why, metrics=metrics)

    def extra_metrics(self) -> dict[str, float]:
        """``commands`` and ``limit_hits``."""
        return {"commands": float(self.commands), "limit_hits": float(self.limit_hits)}

    def release(self) -> None:
        """Back to the pool: wiped and kept when the instance allows reuse (the wipe verified), else removed."""
        reusable = True
        if self.pool.reuse and not self.sandbox.closed:
            # what the verifier brought and made is not the session's change: gone before the wipe compares the
            # layer (its own files first, as itself: root without capabilities cannot remove them)
            try:
                self.sandbox.empty_as(self.verifier_user, [VERIFIER_HOME, LOGS_DIR])
                self.sandbox.remove_as_root(list(VERIFIER_PATHS))
            except SandboxError as exc:
                logger.warning("terminal: %s; the container is not reused", exc)
                reusable = False
        self.pool.release(self.sandbox, reusable=reusable)


class TerminalPools:
    """The task's pools, one per image, seen as one by the worker (``sandbox_pool`` of the worker's status and
    metrics): the states and counters summed, ``max`` the budget, and ``images`` per image."""

    _SUMMED = ("live", "leased", "idle", "starting", "resetting", "removing", "waiting", "warm_target", "created",
               "removed", "create_failures", "acquired", "served_warm", "served_cold", "reused", "wipe_failures",
               "waited", "timeouts", "swept")

    def __init__(self, task: "TerminalTask") -> None:
        self.task = task

    def stats(self) -> dict[str, Any]:
        """See the class docstring."""
        pools = self.task.pools()
        per = {key: pool.stats() for key, pool in pools.items()}
        options = self.task.options
        warm_min, warm_max = options.warm_bounds
        out: dict[str, Any] = {"backend": "docker", "max": options.max_containers, "warm_min": warm_min,
                               "warm_max": warm_max, "reuse": options.reuse_containers}
        for k in self._SUMMED:
            out[k] = sum(s[k] for s in per.values())
        budget = self.task.budget
        out["peak_live"] = budget.stats()["peak"] if budget is not None else sum(s["peak_live"] for s in per.values())
        out["budget"] = budget.stats() if budget is not None else None
        builds = self.task.images.build_s if self.task.has_images else {}
        out["images"] = {self._label(key): {
            "image": key[0], "build_s": builds.get(key[0]), "live": s["live"], "idle": s["idle"],
            "leased": s["leased"], "peak_live": s["peak_live"], "served_warm": s["served_warm"],
            "served_cold": s["served_cold"], "reused": s["reused"], "wipe_failures": s["wipe_failures"],
            "start_s": s["start_s"], "acquire_s": s["acquire_s"]} for key, s in per.items()}
        return out

    def _label(self, key: tuple[Any, ...]) -> str:
        """A pool's name in ``images``: ``tag@workdir`` and what differs from the task's defaults."""
        tag, workdir, scratch, cpus, memory, disk, reuse = key
        own = (self.task.options.cpus, self.task.options.memory_mb, self.task.options.disk_mb)
        limits = f" cpus={cpus:g} memory_mb={memory} disk_mb={disk}" if (cpus, memory, disk) != own else ""
        return f"{tag}@{workdir}{' scratch' if scratch else ''}{limits}{' reuse' if reuse else ''}"

    def close(self) -> None:
        """Close the task's pools."""
        self.task.close_pools()


@dataclass
class TerminalOptions(BlockingTaskOptions, ContainerOptions):
    """The terminal task's params: its instances, its verifier's user, its images' builds and its containers
    (:class:`~env_controller.sandbox.options.ContainerOptions`, per container; an instance's ``cpus`` /
    ``memory_mb`` / ``storage_mb`` win)."""

    KEY = "terminal"

    #: a task directory, a directory of task directories, a manifest, or a list of these
    #: (:func:`~env_controller.tasks.terminal_format.load_tasks`); or ``demo``
    tasks: str | list[str] | None = None
    #: a family of the demo's generated instances (:mod:`env_controller.tasks.terminal_demo`)
    demo: str | None = None
    #: keep only the instances of this family
    family: str | None = None
    #: instances kept: the first ``num_samples`` of the set (None: all; 256 of a demo family)
    num_samples: int | None = None
    max_turns: int = 6
    acquire_timeout_s: float = 60.0
    #: ``uid:gid`` the verifier runs as: neither root nor the agent's uid or gid, and owning no file of the image
    verifier_user: str = "1001:1001"
    #: the cap on a container's own files (its writable layer), MB: an engine quota where its storage driver has
    #: one, else the backend's own check
    disk_mb: int = 10240
    #: limit on one image's build or import, seconds
    build_timeout_s: float = 600.0
    #: start every image's build when the pools start, not at an instance's first session
    prebuild: bool = True
    #: demonstrations played at once (each takes a container)
    demo_threads: int = 6
    #: a verifier that breaks its limits (its timeout, output, processes, memory) while judging: ``failure``, the
    #: episode is judged failed (reward 0; the verifier ran the agent's work, which an agent could otherwise make
    #: hang to escape every 0), or ``error``, a task error left out of training (Harbor's reading)
    verifier_limit: Literal["failure", "error"] = "failure"

    def check(self) -> None:
        """See :class:`ContainerOptions`; what depends on the instances' files is checked where they are read
        (:meth:`load_instances`)."""
        super().check()
        self.require((self.tasks is None) != (self.demo is None), "tasks", "give exactly one of tasks (a task "
                     "directory, a directory of them, or a manifest) and demo (a demo family)")
        if self.tasks is not None:
            self.require(isinstance(self.tasks, str) or (isinstance(self.tasks, list) and bool(self.tasks) and all(
                isinstance(t, str) for t in self.tasks)), "tasks", "must be a path or a list of paths")
        if self.demo is not None:
            self.require(self.demo in FAMILIES, "demo", f"must be one of {', '.join(FAMILIES)}")
        self.require_string("family", optional=True)
        try:
            verifier = parse_user(self.verifier_user, "verifier_user")
        except ValueError:
            raise self.bad("verifier_user", "must be 'uid:gid' of a user other than root, e.g. '1001:1001'") from None
        self.require(not any(v == a for v, a in zip(verifier, parse_user(self.user))), "verifier_user",
                     f"must differ from user {self.user!r} in uid and gid: an agent that shares the verifier's user "
                     "or group could write its own reward")
        self.require_int("disk_mb", low=16)
        self.require_seconds("build_timeout_s")
        self.require_bool("prebuild")
        self.require_positive_int("demo_threads")

    def check_samples(self) -> None:
        """``num_samples``: None (all) or a positive integer; its bound is the set's size (:meth:`load_instances`)."""
        if self.num_samples is not None:
            self.require_positive_int("num_samples")

    def load_instances(self) -> list[TerminalInstance]:
        """The instances these options name (the files read, ``family`` and ``num_samples`` applied); FieldError
        naming ``tasks``, ``family`` or ``num_samples`` when they do not fit."""
        if self.demo is not None:
            return demo_instances(self.demo, self.seed, 256 if self.num_samples is None else self.num_samples)
        assert self.tasks is not None
        try:
            instances = load_tasks(self.tasks)
        except (TaskFormatError, OSError) as e:
            raise self.bad("tasks", f"cannot be read: {e}") from None
        if self.family is not None:
            instances = [i for i in instances if i.family == self.family]
            self.require(bool(instances), "family", "names no instance of the task set")
        if self.num_samples is not None:
            self.require(self.num_samples <= len(instances), "num_samples",
                         f"must be an integer in 1..{len(instances)} (the instances of the set)")
            instances = instances[:self.num_samples]
        return instances


class TerminalTask(BlockingToolTask):
    """``terminal``: instances with their own image and verifier (see the module docstring).

    tasks: a task directory, a directory of task directories, a manifest, or a list of these
    (:func:`~env_controller.tasks.terminal_format.load_tasks`); or demo: a family of the demo's generated
    instances (:mod:`env_controller.tasks.terminal_demo`), with seed and num_samples. family: keep only the
    instances of this family. Tools: ``bash_action(script)`` and ``finish_action()`` (runs the verifier).
    Expert: the instance's solution script, then ``finish_action``; careless player: ``finish_action`` at
    once (or the instance's careless script first). Reward: the verifier's (module docstring); 0 on the turn
    limit (default 6 tool calls) or a message without tool calls. Metrics: ``success``, ``turns``,
    ``commands``, ``limit_hits``, ``verifier_s``, ``verifier_exit_code`` and the verifier's own.

    Containers: docker_host (the engine's URL; default ``$DOCKER_HOST``, else the local socket), user
    (``uid:gid`` the agent's commands and the setup run as; not root), verifier_user (``uid:gid`` the verifier
    runs as: neither root nor the agent's uid or gid, and owning no file of the image), command_timeout_s / memory_mb /
    max_processes / cpus / disk_mb (per container, an instance's ``cpus`` / ``memory_mb`` / ``storage_mb`` win;
    disk_mb caps the container's own files: an engine quota where its storage driver has one, else the backend's
    own check), max_containers (live
    at once over all images; the worker's ``--max-containers``), warm_containers (per image: ``N`` or
    ``MIN:MAX`` by the last ``warm_window_s`` of demand; ``--warm-containers``), reuse_containers (default
    for instances that do not say: a finished session's container serves another after a verified wipe),
    acquire_timeout_s, build_timeout_s (one image's build or import), prebuild (start every image's build
    when the pools start, not at the first session), demo_threads (demonstrations played at once).
    """

    name = "terminal"
    Options = TerminalOptions
    options: TerminalOptions
    TOOLS = [
        function_schema(
            "bash_action",
            "Run a bash script in the task's Linux container and get its output (stdout and stderr) and exit code. "
            "The shell keeps its working directory and variables between calls; there is no network.",
            {"script": "string"},
        ),
        function_schema("finish_action", "Say that the task is done; its tests then run and decide the reward.", {}),
    ]

    def __init__(self, options: TerminalOptions) -> None:
        """Load the instances (a FieldError naming ``tasks``, ``family`` or ``num_samples`` when they do not fit);
        nothing starts yet."""
        self.instances = options.load_instances()
        super().__init__(replace(options, num_samples=len(self.instances)))
        #: the most containers live at once over every image (the worker's view: ``PooledTask``)
        self.max_containers = options.max_containers
        #: one cap over every image's pool
        self.budget = PoolBudget(options.max_containers) if options.max_containers is not None else None
        self._lock = threading.RLock()
        self._client: Any = None
        self._images: ImageCache | None = None
        self._pools: dict[tuple[Any, ...], SandboxPool] = {}
        self._backends: list[Any] = []
        self._demos: dict[tuple[str, int], Future[tuple[list[Message], list[ToolSchema]]]] = {}
        self._demo_executor: Any = None
        self._view = TerminalPools(self)
        self._prebuilt = False

    # -- the engine, images and pools ------------------------------------------------------------

    @property
    def has_images(self) -> bool:
        """Whether the image cache exists (the engine was reached)."""
        return self._images is not None

    @property
    def images(self) -> ImageCache:
        """The image cache on the task's engine (connected on first use; SandboxUnavailableError when not)."""
        with self._lock:
            if self._images is None:
                from env_controller.sandbox.base import SandboxUnavailableError

                try:
                    import docker
                except ImportError as exc:
                    raise SandboxUnavailableError("the terminal task needs the docker SDK: pip install docker") from exc
                try:
                    if self.options.docker_host:
                        client = docker.DockerClient(base_url=self.options.docker_host, timeout=120,
                                                     max_pool_size=max(10, self.max_workers))
                    else:
                        client = docker.from_env(timeout=120, max_pool_size=max(10, self.max_workers))
                    client.ping()
                except docker.errors.DockerException as exc:
                    raise SandboxUnavailableError(f"terminal: cannot reach a Docker engine "
                                                  f"({self.options.docker_host or '$DOCKER_HOST'}): {exc}") from exc
                self._client = client
                self._images = ImageCache(client, build_timeout_s=self.options.build_timeout_s)
            return self._images

    def pools(self) -> dict[tuple[Any, ...], SandboxPool]:
        """The pools made so far, by (image tag, working directory, scratch workdir, cpus, memory, disk, reuse)."""
        with self._lock:
            return dict(self._pools)

    def _workdir_of(self, tag: str, instance: TerminalInstance) -> str:
        if instance.workdir:
            return instance.workdir
        try:
            workdir = (self._client.images.get(tag).attrs.get("Config") or {}).get("WorkingDir") or ""
        except Exception:  # noqa: BLE001 - the default below serves
            workdir = ""
        return workdir if workdir not in ("", "/") else "/app"

    def pool_for(self, tag: str, instance: TerminalInstance) -> SandboxPool:
        """The pool of ``instance``'s containers (made on first use, with its backend)."""
        reuse = self.options.reuse_containers if instance.reuse_containers is None else instance.reuse_containers
        cpus = instance.cpus or self.options.cpus
        memory = instance.memory_mb or self.options.memory_mb
        disk = instance.storage_mb or self.options.disk_mb
        with self._lock:
            workdir = self._workdir_of(tag, instance)
            key = (tag, workdir, instance.scratch_workdir, cpus, memory, disk, reuse)
            pool = self._pools.get(key)
            if pool is not None:
                return pool
            limits = self.options.limits(memory_mb=memory, cpus=cpus)
            # the first backend removes the containers of dead workers (in the background); one is enough
            docker = DockerOptions(image=tag, user=self.options.user, workdir=workdir, writable_root=True,
                                   scratch_workdir=instance.scratch_workdir, disk_mb=disk,
                                   reap="background" if not self._backends else False)
            backend = DockerBackend(limits, docker, client=self._client)
            self._backends.append(backend)
            pool = SandboxPool(backend, replace(self.options, reuse_containers=reuse), limits=limits,
                               labels={"agentrl.task": self.name, "agentrl.image": tag}, budget=self.budget,
                               limit_hint="max_containers (the worker's --max-containers)")
            self._pools[key] = pool
            logger.info("terminal: a container pool for %s (workdir %s, reuse %s)", tag, workdir, reuse)
            return pool

    def sandbox_pool(self) -> TerminalPools:
        """The pools as one (for the worker); connects to the engine and, with ``prebuild``, starts every image's
        build, each image's pool made (and its warm containers started) once its image is ready."""
        images = self.images
        with self._lock:
            first_call, self._prebuilt = not self._prebuilt, True
        if self.options.prebuild and first_call:
            first: dict[ImageSource, TerminalInstance] = {}
            for inst in self.instances:
                first.setdefault(inst.image, inst)
            for source, inst in first.items():
                images.submit(source).add_done_callback(lambda f, inst=inst: self._image_ready(f, inst))
        return self._view

    def _image_ready(self, future: "Future[str]", instance: TerminalInstance) -> None:
        if future.cancelled() or future.exception() is not None:
            logger.error("terminal: the image of %s is not available: %s", instance.id,
                         "cancelled" if future.cancelled() else future.exception())
            return
        with self._lock:
            if self._images is None:
                return  # closed meanwhile
        try:
            self.pool_for(future.result(), instance)
        except Exception:  # noqa: BLE001 - the first session of the image tries again and reports it
            logger.exception("terminal: starting the pool of %s failed", future.result())

    # -- sessions ------------------------------------------------------------------------------

    def instance(self, index: int) -> TerminalInstance:
        """The instance at ``index``."""
        self.check_index(index)
        return self.instances[index]

    async def start(self, index: int) -> tuple[BlockingToolTaskSession, TaskReply]:
        """See :meth:`Task.start`: awaits this instance's image (a build of another image never holds it up),
        then opens the session on the executor."""
        inst = self.instance(index)
        await asyncio.wrap_future(self.images.submit(inst.image))
        return await super().start(index)

    def new_session(self, index: int) -> tuple[TerminalSession, list[Message]]:
        """A container of the instance's image, its setup run, and the prompt (blocking)."""
        inst = self.instance(index)
        tag = self.images.ensure(inst.image)
        pool = self.pool_for(tag, inst)
        box = pool.acquire(labels={"agentrl.index": str(index)})
        try:
            for command in inst.setup:
                result = box.run(command, timeout_s=max(60.0, self.options.command_timeout_s))
                if not result.ok:
                    raise SandboxError(f"terminal {inst.id}: the setup command {command!r} failed: "
                                       f"{result.error or result.output.strip()[-500:]}")
        except BaseException:
            pool.release(box, reusable=False)
            raise
        prompt = (
            f"You are in a Linux bash shell in {box.workdir} (no network). Run commands with bash_action; the shell "
            "keeps its working directory and variables between calls. When the task is done, call finish_action: "
            f"tests then check your work. You have {self.max_turns} tool calls.\n\nTask: {inst.instruction.strip()}"
        )
        return TerminalSession(self, inst, pool, box), [{"role": "user", "content": prompt}]

    def expert(self, index: int) -> Expert:
        """The instance's solution script, then ``finish_action``."""
        inst = self.instance(index)
        if inst.solution is None:
            raise RuntimeError(f"terminal: instance {inst.id} has no solution (solution/solve.sh), so no "
                               "demonstration; set sft.steps=0 or add one")
        yield "bash_action", {"script": inst.solution}
        yield "finish_action", {}

    def careless(self, index: int) -> Expert:
        """``finish_action`` at once (after the instance's careless script, if it has one)."""
        inst = self.instance(index)
        if inst.careless:
            yield "bash_action", {"script": inst.careless}
        yield "finish_action", {}

    def _demo(self, kind: str, index: int) -> tuple[list[Message], list[ToolSchema]]:
        """A demonstration of ``kind`` (expert | careless), played once per index, then cached; the first call
        of a kind plays every index's in the background too (``demo_threads`` at once), since each takes a
        container. A play that failed for the infrastructure's reasons is not cached: the next call plays again."""
        self.check_index(index)
        with self._lock:
            if self._demo_executor is None:
                from concurrent.futures import ThreadPoolExecutor

                self._demo_executor = ThreadPoolExecutor(self.options.demo_threads,
                                                         thread_name_prefix="agentrl-terminal-demo")
            first = not any(k[0] == kind for k in self._demos)
            future = self._demos.get((kind, index))
            if future is None or (future.done() and future.exception() is not None):
                future = self._demos[(kind, index)] = self._demo_executor.submit(self._play, kind, index)
            if first:
                for i in range(self.num_samples):
                    if (kind, i) not in self._demos:
                        self._demos[(kind, i)] = self._demo_executor.submit(self._play, kind, i)
        return future.result()

    def demonstration(self, index: int) -> tuple[list[Message], list[ToolSchema]]:
        """See :meth:`Task.demonstration`; played once per index in a container (checked to pass), then cached."""
        return self._demo("expert", index)

    def careless_demonstration(self, index: int) -> tuple[list[Message], list[ToolSchema]] | None:
        """The careless player's conversation (it may fail), played once per index in a container, then cached."""
        return self._demo("careless", index)

    def _play(self, kind: str, index: int) -> tuple[list[Message], list[ToolSchema]]:
        """Play a demonstration, again (up to :data:`DEMO_ATTEMPTS` in all, a pause between) when the container,
        its shell or the verifier failed (``SandboxError``, ``task error``): a busy machine is not the player's
        fault, and a conversation that ends in an infrastructure error is no demonstration; then
        :class:`DemonstrationUnavailable`. RuntimeError when
        the expert's script fails its verifier (the task set's fault: nothing to retry)."""
        for attempt in range(1, DEMO_ATTEMPTS + 1):
            try:
                return self._play_once(kind, index)
            except SandboxError as e:
                if attempt == DEMO_ATTEMPTS:
                    raise DemonstrationUnavailable(
                        f"terminal: the {kind} demonstration of {self.instance(index).id} failed {attempt} times for "
                        f"the infrastructure's reasons, last: {e}") from e
                logger.warning("terminal: the %s demonstration of %s failed (%s); playing it again", kind,
                               self.instance(index).id, e)
                time.sleep(DEMO_RETRY_PAUSE_S * attempt)
        raise AssertionError("unreachable")

    def _play_once(self, kind: str, index: int) -> tuple[list[Message], list[ToolSchema]]:
        player = self.expert(index) if kind == "expert" else self.careless(index)
        conversation, reply, session = self.play(index, player)
        if reply.status is SampleStatus.TASK_ERROR or (reply.metrics or {}).get(VERIFIER_LIMIT_METRIC):
            raise SandboxError(reply.error or "task error")  # a scripted player's verifier cut short: a busy machine
        if kind == "expert" and reply.reward < 1.0 and session.limit_hits:
            raise SandboxError(f"a command of the expert's hit a limit of the container: {reply}")
        if kind == "expert" and reply.reward < 1.0:
            raise RuntimeError(f"{self.name}: the scripted expert failed on {self.instance(index).id} "
                               f"(reward {reply.reward:g}): check its solution and verifier")
        return conversation, self.tools()

    def close_pools(self) -> None:
        """Remove every container of the task's pools and close their backends."""
        with self._lock:
            pools, self._pools = list(self._pools.values()), {}
            backends, self._backends = self._backends, []
        for pool in pools:
            pool.close()
        for backend in backends:
            backend.close()

    def close(self) -> None:
        """Remove every container of this task (warm ones included), stop the builds and the threads."""
        with self._lock:
            demos, self._demo_executor = self._demo_executor, None
        if demos is not None:
            demos.shutdown(wait=True, cancel_futures=True)
        super().close()
        with self._lock:
            images, self._images = self._images, None
        if images is not None:
            images.close()
        self.close_pools()
        with self._lock:
            client, self._client = self._client, None
        if client is not None:
            try:
                client.close()
            except Exception:  # noqa: BLE001 - closing a connection pool is best effort
                logger.debug("closing the docker client failed", exc_info=True)
