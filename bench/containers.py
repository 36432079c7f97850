"""Benchmark: containers at scale: N concurrent OS-task sessions through the controller, each in a container
of its own, one worker killed with SIGKILL mid-run and restarted.

Starts a private Docker engine (``env_controller.sandbox.dockerd.DockerEngine``; or uses ``--docker-host``),
builds the OS task's image (``ensure_image``), then the controller and ``--workers`` task workers as processes
(``agentrl worker --task os_shell --param backend=docker --max-containers M --warm-containers MIN:MAX``), and
drives sessions from this process with the trainer's :class:`~env_controller.clients.http_client.HttpEnvClient`:

1. light load (``--light-rounds``): each round waits until the workers' warm pools are full, then starts as
   many sessions at once as there are warm containers plus one per worker, so that both warm and cold
   starts are timed without a queue in front of them;
2. scale: ``--sessions`` sessions started over ``--ramp-s`` and held open until all have started (so that
   all their containers live at once), then each runs its commands and ends; ``--kill-after-s`` into the
   commands one worker gets SIGKILL, and ``--restart-after-s`` later a new worker takes its place (its
   start removes the dead worker's containers).

A session runs three shell commands (a probe of its container's age, ``ls -la ~``, the sample's solution)
with a simulated model time between them (``--think-s``), then answers. The probe says whether the container
was started before the session was asked for (warm, from the pool) or for it (cold), so each start latency
(the client's round trip of ``start_sample``) is counted under its kind. Exec latency: the client's round
trip of each ``bash_action`` interact (controller, worker, ``docker exec``).

Outcomes: a session is lost when it got no final reply by the deadline, failed when it was not on the killed
worker, or ended on the killed worker with anything but ``task error``. Containers are counted through the
engine (one list call every ``--sample-s``): the peak live at once, the count after the sessions (which must
equal what the workers' pools hold) and, after the workers stop, the leaked ones (``docker ps -a`` with the
sandbox label). Memory per container: the drop of MemAvailable from before the scale phase to its peak,
divided by the containers added; the shims' share from their PSS. CPU seconds of dockerd, containerd and the
controller come from ``/proc/<pid>/stat``.

    .venv/bin/python bench/containers.py                          # 1000 sessions, 4 workers
    .venv/bin/python bench/containers.py --sessions 200           # quicker
    .venv/bin/python bench/containers.py --smoke                  # seconds: 6 sessions, 2 workers

Needs root and ``docker.io`` for the private engine. Prints a table, writes ``bench/results/containers.json``
(``--out``); the last lines are ``containers_peak: <n>`` and ``containers_leaked: <n>``.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import logging
import math
import os
import platform
import random
import shutil
import signal
import sys
import tempfile
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench._common import bench_parser, git_commit, parse_bench_args, skip_smoke, write_record  # noqa: E402
from bench.env_controller import cpu_pressure, cpu_seconds, loadavg, pct, reason_kind, start_cli  # noqa: E402
from env_controller.clients.http_client import EnvControllerError, HttpEnvClient  # noqa: E402
from env_controller.clients.options import EnvClientOptions  # noqa: E402
from env_controller.http.net import free_port  # noqa: E402
from env_controller.http.service import install_uvloop, raise_nofile_limit  # noqa: E402
from env_controller.protocol import SampleStatus  # noqa: E402
from env_controller.sandbox.docker import LABEL, OWNER_LABEL, owner_id  # noqa: E402
from env_controller.servers.process import ProcessGroup, stop_processes  # noqa: E402
from env_controller.tasks.os_shell import OsShellTask  # noqa: E402

logger = logging.getLogger("bench.containers")

#: --smoke: two workers (one is killed), a few sessions, short waits
SMOKE = {"sessions": 6, "workers": 2, "warm": "1:2", "light_rounds": 1, "ramp_s": 0.5, "think_s": 0.2,
         "kill_after_s": 0.2, "restart_after_s": 0.3, "sample_s": 0.2, "deadline_s": 180.0}
#: the container's age in centiseconds: host uptime minus the start time of its pid 1 (bash builtins only)
PROBE = 'read -r up _ < /proc/uptime; read -r -a st < /proc/1/stat; echo "age_cs $(( ${up/./} - ${st[21]} ))"'


def call(name: str, arguments: dict[str, Any], n: int) -> dict[str, Any]:
    """An assistant message with one tool call."""
    return {"role": "assistant", "content": "", "tool_calls": [
        {"id": f"call_{n}", "type": "function", "function": {"name": name, "arguments": json.dumps(arguments)}}]}


def meminfo_kb(key: str = "MemAvailable") -> int:
    """A field of /proc/meminfo, in kB."""
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1])
    return 0


def threads_total() -> int:
    """Scheduling entities (threads) on the machine, from /proc/loadavg."""
    try:
        return int(Path("/proc/loadavg").read_text().split()[3].split("/")[1])
    except (OSError, ValueError, IndexError):
        return 0


def proc_children(pid: int) -> list[tuple[int, str]]:
    """``(pid, comm)`` of the direct children of ``pid``."""
    out = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            stat = (d / "stat").read_text()
        except OSError:
            continue
        comm = stat[stat.index("(") + 1:stat.rindex(")")]
        if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
            out.append((int(d.name), comm))
    return out


def cpu_with_children(pid: int) -> float:
    """User + system seconds of ``pid`` and of its children it has waited for."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return sum(int(f) for f in fields[11:15]) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return 0.0


def shims_of(exec_root: str | None) -> list[int]:
    """Pids of the containerd shims serving our engine (their command line names its exec root)."""
    pids = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            if not (d / "comm").read_text().startswith("containerd-shim"):
                continue
            cmdline = (d / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if exec_root is None or exec_root in cmdline:
            pids.append(int(d.name))
    return pids


def pss_kb(pid: int) -> int:
    """Proportional set size of ``pid`` (kB), 0 when unknown."""
    try:
        for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
            if line.startswith("Pss:"):
                return int(line.split()[1])
    except OSError:
        pass
    return 0


def rss_kb(pid: int) -> int:
    """Resident set size of ``pid`` (kB), 0 when unknown."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    except OSError:
        pass
    return 0


def summary(values: list[float]) -> dict[str, Any]:
    """``n``, ``p50``, ``p99``, ``max`` in ms of ``values`` (seconds)."""
    return {"n": len(values), "p50_ms": round(pct(values, 0.5) * 1000, 1) if values else None,
            "p99_ms": round(pct(values, 0.99) * 1000, 1) if values else None,
            "max_ms": round(max(values) * 1000, 1) if values else None}


class Sampler:
    """Counts the engine's sandbox containers (and the machine's load, threads, free memory) every ``every_s``."""

    def __init__(self, client: Any, every_s: float) -> None:
        self.client = client
        self.every_s = every_s
        self.peak = 0
        self.peak_at = 0.0
        self.last = 0
        self.load_max = 0.0
        self.threads_max = 0
        self.mem_available_min_kb = meminfo_kb()
        self.errors = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="bench-sampler", daemon=True)

    def count(self) -> int:
        """Sandbox containers on the engine now, in one API call."""
        return len(self.client.api.containers(all=True, quiet=True, filters={"label": f"{LABEL}=1"}))

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                n = self.count()
            except Exception:  # noqa: BLE001 - a busy engine may time out a list; the next sample counts
                self.errors += 1
                n = self.last
            self.last = n
            if n > self.peak:
                self.peak, self.peak_at = n, time.monotonic()
            self.load_max = max(self.load_max, loadavg())
            self.threads_max = max(self.threads_max, threads_total())
            self.mem_available_min_kb = min(self.mem_available_min_kb, meminfo_kb())
            self._stop.wait(self.every_s)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=60)


@dataclass
class Outcome:
    """What happened to one session."""

    phase: str
    index: int
    session_id: str | None = None
    start_s: float | None = None
    kind: str = ""  # warm / cold (from the probe)
    status: str = ""
    reward: float = 0.0
    reason: str = ""
    lost: str = ""
    on_killed_worker: bool = False
    exec_s: list[float] = field(default_factory=list)


class Bench:
    """The processes and the sessions of one run."""

    def __init__(self, args: argparse.Namespace, docker_url: str, image: str, client: Any, procs: ProcessGroup) -> None:
        self.args = args
        self.docker_url = docker_url
        self.image = image
        self.client = client
        self.procs = procs
        self.task = OsShellTask()  # the samples (generators only: no sandbox is made here)
        self.controller_url = ""
        self.workers: list[tuple[Any, str]] = []  # (process, its API URL)
        warm_max = int(str(args.warm).split(":")[-1])
        self.per_worker_max = math.ceil(args.sessions / args.workers) + warm_max + 8
        self.env: HttpEnvClient | None = None
        self.load_at_start = 0.0
        self.planned = self.started = 0

    def spawn_worker(self, name: str) -> tuple[Any, str]:
        port = free_port()
        a = self.args
        proc = start_cli(self.procs, name, [
            "worker", "--task", "os_shell", "--param", "backend=docker", "--param", f"image={self.image}",
            "--param", f"docker_host={self.docker_url}", "--param", f"max_workers={a.threads}",
            "--param", "acquire_timeout_s=600", "--max-containers", str(self.per_worker_max),
            "--warm-containers", str(a.warm), "--port", str(port), "--controller", self.controller_url,
            "--heartbeat-interval", "1", "--timeout", str(a.worker_timeout), "--log-level", "WARNING"])
        return proc, f"http://127.0.0.1:{port}/api"

    @staticmethod
    async def worker_status(url: str) -> dict[str, Any] | None:
        """``GET <worker>/worker_status``; None from a dead or starting worker."""
        try:
            async with aiohttp.ClientSession() as http, http.get(url + "/worker_status") as r:
                return await r.json() if r.status == 200 else None
        except Exception:  # noqa: BLE001 - a dead or starting worker
            return None

    async def wait_registered(self, urls: list[str], limit_s: float = 300) -> None:
        assert self.env is not None
        deadline = time.monotonic() + limit_s
        while time.monotonic() < deadline:
            for p in self.procs.exited():
                if p.returncode != -signal.SIGKILL:
                    raise RuntimeError(f"a bench process exited with {p.returncode}; see {self.procs.log_dir}")
            try:
                view = await self.env.list_workers()
                alive = {w["address"] for w in view.get("os_shell", {}).get("workers", {}).values()
                         if w["state"] == "alive"}
                if set(urls) <= alive:
                    return
            except EnvControllerError:
                pass
            await asyncio.sleep(0.2)
        raise RuntimeError(f"workers {urls} did not register within {limit_s:g} s; see {self.procs.log_dir}")

    async def session(self, out: Outcome, barrier: asyncio.Event | None, rng: random.Random) -> None:
        """One episode: start, (wait for the barrier), probe, two commands, the answer."""
        assert self.env is not None
        env, think = self.env, self.args.think_s
        sample = self.task.sample(out.index)
        t0 = time.monotonic()
        try:
            sid, reply = await env.start_sample("os_shell", out.index)
        except (EnvControllerError, ValueError) as e:
            out.status, out.reason, out.lost = "not started", str(e), f"not started: {e}"
            return
        out.session_id, out.start_s = sid, time.monotonic() - t0
        if reply.finish:
            out.status, out.reason = reply.status.value, reply.error or "the start failed on the worker"
            return
        try:
            if barrier is not None:
                self.started += 1
                if self.started == self.planned:
                    barrier.set()
                await barrier.wait()
            steps = [("bash_action", {"script": PROBE}), ("bash_action", {"script": "ls -la ~ | wc -l"}),
                     ("bash_action", {"script": sample.solution})]
            output = ""
            for n, (name, arguments) in enumerate(steps):
                await asyncio.sleep(think * rng.uniform(0.5, 1.5))
                t1 = time.monotonic()
                reply = await env.interact(sid, [call(name, arguments, n)])
                if reply.finish:
                    out.status, out.reward, out.reason = reply.status.value, reply.reward, reply.error
                    return
                out.exec_s.append(time.monotonic() - t1)
                output = reply.messages[0]["content"] if reply.messages else ""
                if n == 0:
                    age_cs = int(output.split()[-1]) if output.startswith("age_cs ") else -1
                    out.kind = "warm" if age_cs / 100 > time.monotonic() - t0 else "cold"
            await asyncio.sleep(think * rng.uniform(0.5, 1.5))
            final = (call("answer_action", {"answer": output.strip()}, 9) if sample.answer is not None
                     else call("finish_action", {}, 9))
            reply = await env.interact(sid, [final])
            out.status, out.reward, out.reason = reply.status.value, reply.reward, reply.error
            if not reply.finish:
                out.lost = "the answer did not end the episode"
            elif reply.status is SampleStatus.COMPLETED and reply.reward != 1.0:
                out.lost = f"completed with reward {reply.reward}, expected 1 (a broken container?)"
        except asyncio.CancelledError:
            out.lost = "no final reply before the deadline"
            raise
        except Exception as e:  # noqa: BLE001 - every other exception is a lost session
            out.lost = f"{type(e).__name__}: {e}"

    async def light(self, rng: random.Random) -> list[Outcome]:
        """Rounds of warm and cold starts without a queue (see the module docstring)."""
        outcomes: list[Outcome] = []
        for _ in range(self.args.light_rounds):
            deadline = time.monotonic() + 120
            while True:  # the warm pools full
                stats = [await self.worker_status(url) for _, url in self.workers]
                pools = [s["sandbox_pool"] for s in stats if s]
                if len(pools) == len(self.workers) and all(p["idle"] >= p["warm_target"] and not p["starting"]
                                                             and not p["removing"] for p in pools):
                    break
                if time.monotonic() > deadline:
                    raise RuntimeError(f"the warm pools did not fill within 120 s: {pools}")
                await asyncio.sleep(0.2)
            burst = sum(p["idle"] for p in pools) + len(self.workers)
            round_out = [Outcome("light", rng.randrange(len(self.task.indices()))) for _ in range(burst)]
            await asyncio.gather(*(self.session(o, None, rng) for o in round_out))
            outcomes += round_out
        return outcomes

    async def run(self) -> dict[str, Any]:
        try:
            return await self._run()
        finally:
            if self.env is not None:
                await self.env.aclose()

    async def _run(self) -> dict[str, Any]:
        a = self.args
        cport = free_port()
        self.controller_url = f"http://127.0.0.1:{cport}/api"
        controller = start_cli(self.procs, "controller", [
            "controller", "--port", str(cport), "--suspect-after", "3", "--heartbeat-timeout", "6",
            "--start-timeout", str(a.worker_timeout + 30), "--interact-timeout", "120", "--log-level", "WARNING"])
        t_boot = time.monotonic()
        self.load_at_start = loadavg()
        self.workers = [self.spawn_worker(f"worker{i}") for i in range(a.workers)]
        self.env = HttpEnvClient(self.controller_url, EnvClientOptions(retries=3, backoff_s=0.5,
                                                                       timeout_s=a.worker_timeout + 60,
                                                                       max_connections=2048))
        await self.wait_registered([url for _, url in self.workers])
        boot_s = time.monotonic() - t_boot
        sampler = Sampler(self.client, a.sample_s)
        sampler.start()
        rng = random.Random(0)
        t_light = time.monotonic()
        light = await self.light(rng)
        light_s = time.monotonic() - t_light

        # -- scale ----------------------------------------------------------------------------------
        before = {"containers": sampler.count(), "mem_available_kb": meminfo_kb(), "load": loadavg(),
                  "psi": cpu_pressure(), "threads": threads_total()}
        dockerd_pid = self.args.dockerd_pid
        containerd_pid = next((p for p, c in proc_children(dockerd_pid) if c == "containerd"), None) \
            if dockerd_pid else None
        cpu0 = {"dockerd": cpu_with_children(dockerd_pid) if dockerd_pid else None,
                "containerd": cpu_with_children(containerd_pid) if containerd_pid else None,
                "controller": cpu_seconds(controller.pid),
                "workers": sum(cpu_seconds(p.pid) for p, _ in self.workers)}
        sampler.mem_available_min_kb = before["mem_available_kb"]
        sampler.peak = 0
        self.planned, self.started = a.sessions, 0
        barrier = asyncio.Event()
        outcomes = [Outcome("scale", rng.randrange(len(self.task.indices()))) for _ in range(a.sessions)]
        t0 = time.monotonic()

        async def ramped(i: int, out: Outcome) -> None:
            await asyncio.sleep(a.ramp_s * i / a.sessions)
            await self.session(out, barrier, rng)

        runs = [asyncio.ensure_future(ramped(i, o)) for i, o in enumerate(outcomes)]
        at_peak: dict[str, Any] = {}
        kill: dict[str, Any] = {}

        async def killer() -> None:
            await barrier.wait()
            t_all = time.monotonic()
            at_peak.update(self.at_peak(sampler, dockerd_pid, containerd_pid))
            at_peak["all_started_after_s"] = round(t_all - t0, 1)
            await asyncio.sleep(a.kill_after_s)
            victim, victim_url = self.workers[0]
            owner = owner_id(victim.pid)
            kill["worker_cpu_s"] = cpu_seconds(victim.pid)
            victim.send_signal(signal.SIGKILL)
            t_kill = time.monotonic()
            kill.update(address=victim_url, owner=owner, killed_at_s=round(t_kill - t0, 1),
                        containers_at_kill=len(self.owned(owner)))
            logger.info("killed worker 0 (%s) holding %d containers", victim_url, kill["containers_at_kill"])
            await asyncio.sleep(a.restart_after_s)
            proc, url = self.spawn_worker("worker0-restarted")
            self.workers[0] = (proc, url)
            t_restart = time.monotonic()
            try:
                await self.wait_registered([url], limit_s=600)
            except RuntimeError as e:  # recorded: the sessions still end, and the leak count tells the rest
                kill["restart_error"] = str(e)
            kill["restarted_registered_after_s"] = round(time.monotonic() - t_restart, 1)
            kill["dead_owner_containers_at_registration"] = len(self.owned(owner))
            # the new worker serves at once and removes its predecessor's containers in the background
            reap_deadline = time.monotonic() + 600
            while self.owned(owner) and time.monotonic() < reap_deadline:
                await asyncio.sleep(0.5)
            kill["dead_owner_reaped_after_s"] = round(time.monotonic() - t_restart, 1)
            kill["dead_owner_containers_after_restart"] = len(self.owned(owner))
            logger.info("worker restarted: registered after %.1f s with %d containers of the dead one left, "
                        "%d left after %.1f s", kill["restarted_registered_after_s"],
                        kill["dead_owner_containers_at_registration"], kill["dead_owner_containers_after_restart"],
                        kill["dead_owner_reaped_after_s"])

        kill_task = asyncio.ensure_future(killer())
        done, pending = await asyncio.wait(runs, timeout=a.deadline_s)
        for t in pending:
            t.cancel()
        if pending:
            await asyncio.wait(pending, timeout=10)
        try:
            await asyncio.wait_for(kill_task, timeout=max(1.0, a.deadline_s - (time.monotonic() - t0)))
        except (asyncio.TimeoutError, TimeoutError):
            kill_task.cancel()
        scale_s = time.monotonic() - t0
        cpu1 = {"dockerd": cpu_with_children(dockerd_pid) if dockerd_pid else None,
                "containerd": cpu_with_children(containerd_pid) if containerd_pid else None,
                "controller": cpu_seconds(controller.pid),
                "workers": sum(cpu_seconds(p.pid) for p, _ in self.workers) + kill.get("worker_cpu_s", 0.0)}
        after = {"load": loadavg(), "psi": cpu_pressure()}

        # -- the end: what the pools hold, then the workers stop and nothing may be left -------------------
        await asyncio.sleep(1.0)
        statuses = [await self.worker_status(url) for _, url in self.workers]
        pools = [s["sandbox_pool"] for s in statuses if s and "sandbox_pool" in s]
        containers_after = sampler.count()
        sampler.stop()
        leftover_sessions = len(await self.env.list_sessions())
        await self.env.aclose()
        t_stop = time.monotonic()
        stop_processes([proc for proc, _ in self.workers], grace_s=300.0)  # the leak count shows what they left
        workers_stop_s = time.monotonic() - t_stop
        leaked = sampler.count()

        for out in light + outcomes:
            out.on_killed_worker = bool(kill) and kill["address"] in (out.reason or "")
            if out.lost:
                continue
            if out.status != SampleStatus.COMPLETED.value:
                if not out.on_killed_worker:
                    out.lost = f"{out.status}: {out.reason}"
                elif out.status != SampleStatus.TASK_ERROR.value:
                    out.lost = f"on the killed worker, ended {out.status!r}, not 'task error'"
        return self.record(light, outcomes, sampler, before, after, at_peak, kill, cpu0, cpu1, pools,
                           containers_after, leaked, leftover_sessions,
                           {"boot_s": round(boot_s, 1), "light_s": round(light_s, 1), "scale_s": round(scale_s, 1),
                            "workers_stop_s": round(workers_stop_s, 1)})

    def owned(self, owner: str) -> list[str]:
        """Containers of ``owner`` on the engine."""
        return self.client.api.containers(all=True, quiet=True, filters={"label": [f"{LABEL}=1",
                                                                                    f"{OWNER_LABEL}={owner}"]})

    def at_peak(self, sampler: Sampler, dockerd_pid: int | None, containerd_pid: int | None) -> dict[str, Any]:
        """Memory of the engine's parts once every session has started (all containers live)."""
        shims = shims_of(self.args.exec_root)
        return {"containers": sampler.count(), "mem_available_kb": meminfo_kb(), "shims": len(shims),
                "shim_pss_kb_total": sum(pss_kb(p) for p in shims), "shim_rss_kb_total": sum(rss_kb(p) for p in shims),
                "dockerd_rss_kb": rss_kb(dockerd_pid) if dockerd_pid else None,
                "containerd_rss_kb": rss_kb(containerd_pid) if containerd_pid else None,
                "workers_rss_kb": sum(rss_kb(p.pid) for p, _ in self.workers), "threads": threads_total(),
                "load": loadavg()}

    def record(self, light: list[Outcome], outcomes: list[Outcome], sampler: Sampler, before: dict[str, Any],
               after: dict[str, Any], at_peak: dict[str, Any], kill: dict[str, Any], cpu0: dict[str, Any],
               cpu1: dict[str, Any], pools: list[dict[str, Any]], containers_after: int, leaked: int,
               leftover_sessions: int, timings: dict[str, float]) -> dict[str, Any]:
        a = self.args
        everything = light + outcomes
        lost = [o for o in everything if o.lost]
        added = (at_peak.get("containers") or 0) - before["containers"]
        mem_drop_kb = before["mem_available_kb"] - (at_peak.get("mem_available_kb") or before["mem_available_kb"])
        starts = {f"{phase}_{kind}": summary([o.start_s for o in everything if o.phase == phase and o.kind == kind
                                              and o.start_s is not None])
                  for phase in ("light", "scale") for kind in ("warm", "cold")}
        starts["all_warm"] = summary([o.start_s for o in everything if o.kind == "warm" and o.start_s is not None])
        starts["all_cold"] = summary([o.start_s for o in everything if o.kind == "cold" and o.start_s is not None])
        return {
            "config": {k: v for k, v in vars(a).items()},
            "machine": {"cpus": os.cpu_count(), "mem_total_gb": round(meminfo_kb("MemTotal") / 2**20, 1),
                        "loadavg_1m_at_start": self.load_at_start,
                        "python": platform.python_version(), "platform": platform.platform(),
                        "loadavg_1m_before": before["load"], "loadavg_1m_after": after["load"],
                        "loadavg_1m_max": sampler.load_max, "cpu_pressure_avg60_pct_before": before["psi"],
                        "cpu_pressure_avg60_pct_after": after["psi"], "threads_before": before["threads"],
                        "threads_max": sampler.threads_max},
            "per_worker_max_containers": self.per_worker_max,
            "timings_s": timings,
            "containers": {
                "peak_live": sampler.peak, "started": sum(p["created"] for p in pools),
                "before_scale": before["containers"], "at_all_started": at_peak.get("containers"),
                "after_sessions": containers_after, "pools_live_after_sessions": sum(p["live"] for p in pools),
                "leaked": leaked, "engine_list_errors": sampler.errors,
            },
            "memory": {
                "per_container_mb": round(mem_drop_kb / added / 1024, 2) if added > 0 else None,
                "mem_available_drop_gb": round(mem_drop_kb / 2**20, 2),
                "mem_available_min_gb": round(sampler.mem_available_min_kb / 2**20, 2),
                "shim_pss_per_container_mb": round(at_peak["shim_pss_kb_total"] / at_peak["shims"] / 1024, 2)
                if at_peak.get("shims") else None,
                "shim_rss_per_container_mb": round(at_peak["shim_rss_kb_total"] / at_peak["shims"] / 1024, 2)
                if at_peak.get("shims") else None,
                "at_peak": at_peak,
            },
            "cpu_s": {k: (round(cpu1[k] - cpu0[k], 1) if cpu0.get(k) is not None and cpu1.get(k) is not None
                          else None) for k in cpu0},
            "start_latency": starts,
            "exec_latency": summary([s for o in everything for s in o.exec_s]),
            "pool_acquire_s_survivors": [p["acquire_s"] for p in pools],
            "sessions": {
                "light": len(light), "scale": len(outcomes),
                "completed": sum(1 for o in everything if o.status == SampleStatus.COMPLETED.value and not o.lost),
                "failed_on_killed_worker": sum(1 for o in everything if o.on_killed_worker and not o.lost),
                "lost": len(lost), "lost_examples": [o.lost for o in lost[:5]],
                "failed_reasons": dict(Counter(f"{o.status}: {reason_kind(o.reason)}" for o in everything
                                               if o.status != SampleStatus.COMPLETED.value).most_common(8)),
                "warm": sum(1 for o in everything if o.kind == "warm"),
                "cold": sum(1 for o in everything if o.kind == "cold"),
                "left_open_on_controller": leftover_sessions,
            },
            "killed_worker": kill,
        }


def print_table(r: dict[str, Any]) -> None:
    c, m, s, k, mem = r["containers"], r["machine"], r["sessions"], r["killed_worker"], r["memory"]

    def lat(x: dict[str, Any]) -> str:
        return f"{x['p50_ms']} / {x['p99_ms']} ms (n={x['n']})" if x["n"] else "-"

    rows = [
        ("sessions (light + scale)", f"{s['light']} + {s['scale']}"),
        ("  completed / on the killed worker (task error) / lost",
         f"{s['completed']} / {s['failed_on_killed_worker']} / {s['lost']}"),
        ("  served warm / cold", f"{s['warm']} / {s['cold']}"),
        ("containers started (surviving workers' pools)", c["started"]),
        ("containers live at once, peak (engine)", c["peak_live"]),
        ("containers after the sessions: engine / pools", f"{c['after_sessions']} / {c['pools_live_after_sessions']}"),
        ("containers leaked (after the workers stopped)", c["leaked"]),
        ("killed worker: containers at kill / left after restart",
         f"{k.get('containers_at_kill')} / {k.get('dead_owner_containers_after_restart')}"),
        ("restarted worker: registered after / dead one's containers gone after (s)",
         f"{k.get('restarted_registered_after_s')} / {k.get('dead_owner_reaped_after_s')}"),
        ("start latency warm, light load p50 / p99", lat(r["start_latency"]["light_warm"])),
        ("start latency cold, light load p50 / p99", lat(r["start_latency"]["light_cold"])),
        ("start latency warm, scale p50 / p99", lat(r["start_latency"]["scale_warm"])),
        ("start latency cold, scale p50 / p99", lat(r["start_latency"]["scale_cold"])),
        ("exec latency (bash_action round trip) p50 / p99", lat(r["exec_latency"])),
        ("memory per container (MemAvailable drop)", f"{mem['per_container_mb']} MB"),
        ("  of it containerd-shim PSS / RSS",
         f"{mem['shim_pss_per_container_mb']} / {mem['shim_rss_per_container_mb']} MB"),
        ("  MemAvailable lowest", f"{mem['mem_available_min_gb']} GB of {m['mem_total_gb']} GB"),
        ("CPU s: dockerd / containerd / controller / workers",
         " / ".join(str(r["cpu_s"][x]) for x in ("dockerd", "containerd", "controller", "workers"))),
        ("load average 1 min: at start / before scale / max / after",
         f"{m['loadavg_1m_at_start']} / {m['loadavg_1m_before']} / {m['loadavg_1m_max']} / {m['loadavg_1m_after']}"),
        ("threads on the machine: before / max", f"{m['threads_before']} / {m['threads_max']}"),
        ("wall: boot / light / scale / workers' stop, s", " / ".join(str(v) for v in r["timings_s"].values())),
    ]
    width = max(len(a) for a, _ in rows)
    cfg = r["config"]
    print(f"\ncontainers bench: {cfg['sessions']} sessions, {cfg['workers']} workers, warm {cfg['warm']}, "
          f"{m['cpus']} CPUs")
    print("-" * (width + 40))
    for a, b in rows:
        print(f"{a:<{width}}  {b}")
    for reason, n in s["failed_reasons"].items():
        print(f"  {n:>6}  {reason}")
    for ex in s["lost_examples"]:
        print(f"  lost: {ex}")


def main(argv: list[str] | None = None) -> int:
    parser = bench_parser("containers", __doc__)
    parser.add_argument("--sessions", type=int, default=1000, help="sessions open at once in the scale phase")
    parser.add_argument("--workers", type=int, default=4, help="task workers (one is killed; at least 2)")
    parser.add_argument("--warm", default="2:16", help="each worker's --warm-containers (N or MIN:MAX)")
    parser.add_argument("--light-rounds", type=int, default=3, help="rounds of the light-load phase")
    parser.add_argument("--ramp-s", type=float, default=None, help="starts spread over this long (default "
                        "sessions / 5: about what 2 cores start per second)")
    parser.add_argument("--think-s", type=float, default=5.0, help="simulated model time between turns (mean)")
    parser.add_argument("--kill-after-s", type=float, default=3.0, help="SIGKILL a worker this long after all "
                        "sessions started")
    parser.add_argument("--restart-after-s", type=float, default=2.0, help="start its replacement this long after")
    parser.add_argument("--threads", type=int, default=64, help="each worker's threads for blocking calls")
    parser.add_argument("--worker-timeout", type=float, default=900.0, help="workers' --timeout (a start queued "
                        "behind hundreds of others takes long)")
    parser.add_argument("--sample-s", type=float, default=1.0, help="seconds between two container counts")
    parser.add_argument("--deadline-s", type=float, default=3600.0, help="sessions without a final reply by then "
                        "are lost")
    parser.add_argument("--docker-host", default=None, help="an engine to use (default: start a private one)")
    parser.add_argument("--image", default=None, help="the sandbox image (default: build the OS task's image)")
    parser.add_argument("--keep-logs", action="store_true", help="keep the processes' logs (kept anyway on failure)")
    args = parse_bench_args(parser, argv, SMOKE)
    if args.workers < 2:
        parser.error("--workers must be at least 2 (one is killed)")
    if args.ramp_s is None:
        args.ramp_s = args.sessions / 5
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", datefmt="%H:%M:%S")
    logging.getLogger("env_controller.clients.http_client").setLevel(logging.ERROR)
    install_uvloop()
    raise_nofile_limit()

    from env_controller.sandbox.docker_image import ensure_image
    from env_controller.sandbox.dockerd import DockerEngine, DockerUnavailableError

    engine = None
    work = Path(tempfile.mkdtemp(prefix="agentrl-bench-containers-"))
    procs = ProcessGroup(work, cwd=REPO)
    try:
        if args.docker_host:
            docker_url = args.docker_host
            args.dockerd_pid = args.exec_root = None
        else:
            try:
                engine = DockerEngine().start()
            except DockerUnavailableError as e:  # without an engine there is nothing to measure
                return skip_smoke(args, "containers", e, ["containers_peak", "containers_leaked"])
            docker_url = engine.url
            args.dockerd_pid = engine.proc.pid if engine.proc else None
            args.exec_root = str(engine.dir / "exec") if engine.dir else None
        import docker

        client = docker.DockerClient(base_url=docker_url, timeout=300)
        image = args.image or ensure_image(client, work)
        result = asyncio.run(Bench(args, docker_url, image, client, procs).run())
        client.close()
    except BaseException:
        logger.error("bench failed; process logs kept in %s", work)
        raise
    finally:
        procs.close()
        if engine is not None:
            engine.stop()
    if args.keep_logs:
        print(f"process logs: {work}")
    else:
        shutil.rmtree(work, ignore_errors=True)
    out = write_record(args.out, {"bench": "containers", "commit": git_commit(), **result})
    print_table(result)
    print(f"results: {out}")
    print(f"containers_peak: {result['containers']['peak_live']}")
    print(f"containers_leaked: {result['containers']['leaked']}")
    ok = result["sessions"]["lost"] == 0 and result["containers"]["leaked"] == 0
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
