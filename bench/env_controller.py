"""Benchmark: thousands of concurrent env sessions through the controller, one worker killed mid-run.

Starts the controller and task workers as separate processes (``python -m env_controller.cli``,
real HTTP on loopback, uvloop), then drives ``--sessions`` episodes from this process with the
trainer-side :class:`~env_controller.clients.http_client.HttpEnvClient`. Each episode replays the task's
scripted demonstration (so a completed episode must earn reward 1), with a simulated model
"think time" between turns and a simulated worker latency on every call. All sessions are
started first (over ``--ramp-s``) and held open, so the full number is open at once; then the
turns run, and ``--kill-after-s`` later one worker process gets SIGKILL.

Outcomes per session: completed (status completed, reward 1), failed (any other final reply;
grouped by the reason the controller gives), not started (no worker could take it), lost (no
final reply: an exception, a hang past the deadline, or a wrong reward on a completed episode);
lost must be 0.

Controller overhead per interact = the controller's handler wall time minus the worker's own
time (the worker reports it in ``x-worker-time``; the controller returns the difference in
``x-controller-overhead-ms``). It covers parsing and validating the request, the session table,
choosing and calling the worker (the HTTP client, connection pool, the controller side of the
socket I/O), re-encoding the reply and any event-loop queueing inside the controller; it leaves
out the worker's handler time and the controller's HTTP server parsing before the handler starts.
The table also shows the end-to-end view from the client (round trip minus worker time), which
adds the network stack both ways and this driver's own event-loop delays.

    .venv/bin/python bench/env_controller.py                    # 4000 sessions, 4 workers
    .venv/bin/python bench/env_controller.py --sessions 500     # quicker
    .venv/bin/python bench/env_controller.py --smoke            # seconds: 24 sessions, 2 workers
    .venv/bin/python bench/env_controller.py --sessions 10000 --pin-controller   # the controller on a CPU of its own

The controller's CPU per request (user + system seconds of its process over the run, from
``/proc/<pid>/stat``, divided by the trainer's requests) is in the table and the JSON, and beside it,
counted apart, that of the fake workers (which run in a process group of their own; the killed one
counted up to its kill) and that of this driver (its own process time): all share the machine's cores.
How long the controller waited on a run queue for a CPU (``/proc/<pid>/schedstat``) is reported over the run
and per 2 s window beside that window's interact overhead: a tail that comes with such waits is the
machine's contention (the driver and the workers on the same two cores), not the controller's own work;
``--pin-controller`` gives the controller a CPU of its own (the others run the workers and the driver), as a
deployment on separate machines would. The CPU per request falls as the request rate rises (fewer sessions, fewer
requests a second: compare ``--sessions 1000`` with ``10000``): a request that arrives after a pause finds the
caches cold, for a bare relay as much as for the controller (``bench/controller_front.py --gap-ms``).

Prints a table, writes ``bench/results/env_controller.json`` (``--out``; with ``--smoke``
``env_controller_smoke.json``); the last line is ``env_lost_sessions: <n>``.
"""
from __future__ import annotations

import argparse
import asyncio
import logging
import math
import os
import platform
import random
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench._common import bench_parser, git_commit, parse_bench_args, write_record  # noqa: E402
from env_controller.clients.http_client import EnvControllerError, HttpEnvClient  # noqa: E402
from env_controller.clients.options import EnvClientOptions  # noqa: E402
from env_controller.http.net import free_port  # noqa: E402
from env_controller.http.service import install_uvloop, raise_nofile_limit  # noqa: E402
from env_controller.protocol import SampleStatus  # noqa: E402
from env_controller.servers.process import ProcessGroup  # noqa: E402
from env_controller.tasks import build_task  # noqa: E402

logger = logging.getLogger("bench.env_controller")

#: --smoke: one task on two workers (one is killed), short think and heartbeat times
SMOKE = {"sessions": 24, "workers": 2, "tasks": "guess", "latency_ms": 5.0, "think_s": 0.1, "ramp_s": 0.5,
         "kill_after_s": 0.3, "heartbeat_interval": 0.2, "suspect_after": 0.6, "heartbeat_timeout": 1.2,
         "max_connections": 64, "deadline_s": 60.0}


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process (Linux /proc), 0.0 when unavailable."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError):
        return 0.0


def run_delay_s(pid: int) -> float:
    """Seconds a process's main thread has waited on a run queue for a CPU (Linux ``/proc/<pid>/schedstat``),
    nan when unavailable: the part of a request's time that is the machine's contention, not the process's work."""
    try:
        return int(Path(f"/proc/{pid}/schedstat").read_text().split()[1]) / 1e9
    except (OSError, IndexError, ValueError):
        return float("nan")


def pinning(pin: bool) -> tuple[set[int] | None, set[int] | None]:
    """(the controller's CPUs, everyone else's): with ``pin``, the controller alone on the first CPU this process
    may use and the workers and the driver on the others, as on separate machines; else (None, None)."""
    if not pin:
        return None, None
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        raise SystemExit(f"--pin-controller needs 2 CPUs or more; this process may use {len(cpus)}")
    return {cpus[0]}, set(cpus[1:])


def loadavg() -> float:
    """The 1-minute load average (other work on the machine shows up here)."""
    try:
        return float(Path("/proc/loadavg").read_text().split()[0])
    except (OSError, ValueError):
        return float("nan")


def cpu_pressure() -> float:
    """Linux PSI: % of the last 60 s in which some runnable task waited for a CPU (nan if unknown)."""
    try:
        line = Path("/proc/pressure/cpu").read_text().splitlines()[0]
        return float(dict(kv.split("=") for kv in line.split()[1:])["avg60"])
    except (OSError, ValueError, KeyError, IndexError):
        return float("nan")


def pct(values: list[float], q: float) -> float:
    """The q-quantile (0..1) by nearest rank; nan for no values."""
    if not values:
        return float("nan")
    s = sorted(values)
    return s[min(len(s) - 1, max(0, math.ceil(q * len(s)) - 1))]


def reason_kind(reason: str) -> str:
    """Group failure reasons: drop ids, addresses and numbers."""
    r = re.sub(r"worker \d+ \([^)]*\)", "worker", reason)
    r = re.sub(r"\[Errno \d+\] ", "", r)
    r = re.sub(r"\d+(\.\d+)?", "N", r)
    return r[:140]


@dataclass
class Outcome:
    """What happened to one session."""

    task: str
    index: int
    session_id: str | None = None
    status: str = ""
    reward: float = 0.0
    reason: str = ""
    lost: str = ""
    turns: int = 0
    on_killed_worker: bool = False
    fail_wait_s: float | None = None


@dataclass
class Stats:
    """Per-call numbers collected by the client's observer."""

    overhead_ms: dict[str, list[float]] = field(default_factory=lambda: {"start_sample": [], "interact": []})
    outside_call_ms: dict[str, list[float]] = field(default_factory=lambda: {"start_sample": [], "interact": []})
    client_ms: dict[str, list[float]] = field(default_factory=lambda: {"start_sample": [], "interact": []})
    rtt_ms: dict[str, list[float]] = field(default_factory=lambda: {"start_sample": [], "interact": []})
    status_codes: Counter[str] = field(default_factory=Counter)
    timeline: list[tuple[float, float]] = field(default_factory=list)  # (monotonic time, interact overhead ms)

    def observe(self, endpoint: str, seconds: float, status: int, headers: Any) -> None:
        self.status_codes[f"{endpoint} {status}"] += 1
        if endpoint not in self.overhead_ms or status != 200:
            return
        o = headers.get("x-controller-overhead-ms")
        w = headers.get("x-worker-time-ms")
        rtt = headers.get("x-worker-rtt-ms")
        if o is None or w is None or rtt is None:
            return  # a reply the controller made up (task error), not a worker call
        self.overhead_ms[endpoint].append(float(o))
        self.outside_call_ms[endpoint].append(float(o) + float(w) - float(rtt))
        if endpoint == "interact":
            self.timeline.append((time.monotonic(), float(o)))
        self.rtt_ms[endpoint].append(seconds * 1000)
        self.client_ms[endpoint].append(seconds * 1000 - float(w))


def start_cli(procs: ProcessGroup, name: str, args: list[str], group: int | None = None,
              cpus: set[int] | None = None) -> subprocess.Popen[bytes]:
    """Start ``env_controller.cli args`` as ``name``; ``group``: None for the bench's process group, 0 for a new
    one, a group id to join one; ``cpus``: the CPUs it may run on (None: any)."""
    proc = procs.start(name, [sys.executable, "-m", "env_controller.cli", *args], group=group)
    if cpus is not None:  # before its interpreter starts any thread (threads inherit the mask)
        os.sched_setaffinity(proc.pid, cpus)
    return proc


async def wait_ready(env: HttpEnvClient, n_workers: int, procs: ProcessGroup, limit_s: float = 60) -> dict[str, Any]:
    deadline = time.monotonic() + limit_s
    last: Any = None
    while time.monotonic() < deadline:
        for p in procs.exited():
            raise RuntimeError(f"a bench process exited early with {p.returncode}; see {procs.log_dir}")
        try:
            last = await env.list_workers()
            if sum(len(t["workers"]) for t in last.values()) >= n_workers:
                return last
        except EnvControllerError:
            pass
        await asyncio.sleep(0.2)
    raise RuntimeError(f"{n_workers} workers did not register within {limit_s} s (last view: {last})")


async def fetch_overhead_histogram(env: HttpEnvClient) -> dict[str, float]:
    """From /metrics: how many interact overheads the controller recorded, and the share <= 10 ms."""
    text = await env.metrics()
    count = le10 = 0.0
    for line in text.splitlines():
        if line.startswith('agentrl_controller_overhead_seconds_count{endpoint="interact"}'):
            count = float(line.split()[-1])
        if line.startswith('agentrl_controller_overhead_seconds_bucket{endpoint="interact",le="0.01"}'):
            le10 = float(line.split()[-1])
    return {"interact_count": count, "interact_share_le_10ms": le10 / count if count else float("nan")}


async def drive(args: argparse.Namespace, procs: ProcessGroup) -> dict[str, Any]:
    tasks = args.tasks.split(",")
    cport = free_port()
    url = f"http://127.0.0.1:{cport}/api"
    own, rest = pinning(args.pin_controller)
    if rest is not None:
        os.sched_setaffinity(0, rest)  # this driver, and through inheritance nothing else, off the controller's CPU
    start_cli(procs, "controller", [
        "controller", "--port", str(cport), "--suspect-after", str(args.suspect_after),
        "--heartbeat-timeout", str(args.heartbeat_timeout), "--log-level", "WARNING",
    ], cpus=own)
    per_task = Counter(tasks[i % len(tasks)] for i in range(args.workers))
    sessions_per_task = Counter(tasks[i % len(tasks)] for i in range(args.sessions))
    worker_task: list[str] = []
    worker_procs: list[subprocess.Popen[bytes]] = []
    worker_ports: list[int] = []
    worker_group = 0  # the workers get a process group of their own (the first worker's pid), apart
    for i in range(args.workers):
        task = tasks[i % len(tasks)]
        concurrency = math.ceil(sessions_per_task[task] / per_task[task] * 1.25) + 8
        port = free_port()
        worker_procs.append(start_cli(procs, f"worker{i}_{task}", [
            "worker", "--task", task, "--controller", url, "--port", str(port), "--concurrency", str(concurrency),
            "--heartbeat-interval", str(args.heartbeat_interval), "--latency-ms", str(args.latency_ms),
            "--log-level", "WARNING",
        ], group=worker_group, cpus=rest))
        worker_group = worker_group or worker_procs[0].pid
        worker_task.append(task)
        worker_ports.append(port)
    victim = next(i for i, t in enumerate(worker_task) if per_task[t] >= 2)  # its task has a survivor
    stats = Stats()
    env = HttpEnvClient(url, EnvClientOptions(retries=args.retries, backoff_s=0.2, timeout_s=args.call_timeout,
                                              max_connections=args.max_connections), observer=stats.observe)
    await wait_ready(env, args.workers, procs)
    victim_address = f"http://127.0.0.1:{worker_ports[victim]}/api"
    victim_id: int | None = None
    for t in (await env.list_workers()).values():
        for w in t["workers"].values():
            if w["address"] == victim_address:
                victim_id = w["id"]

    built = {t: build_task(t) for t in tasks}
    demos: dict[tuple[str, int], list[dict[str, Any]]] = {}
    rng = random.Random(0)
    plan: list[tuple[str, int]] = []
    for i in range(args.sessions):
        task = tasks[i % len(tasks)]
        index = rng.randrange(len(built[task].indices()))
        plan.append((task, index))
        if (task, index) not in demos:
            demo, _ = built[task].demonstration(index)
            demos[(task, index)] = [m for m in demo if m["role"] == "assistant"]

    outcomes = [Outcome(task, index) for task, index in plan]
    all_started = asyncio.Event()
    started = 0
    open_now = 0
    peak_open = 0
    kill_time: list[float] = []
    victim_cpu: list[float] = []  # the killed worker's CPU seconds just before the kill
    t_origin = time.monotonic()

    def note_start() -> None:
        nonlocal started
        started += 1
        if started == args.sessions:
            all_started.set()

    async def episode(i: int) -> None:
        nonlocal open_now, peak_open
        out = outcomes[i]
        await asyncio.sleep(args.ramp_s * i / args.sessions)
        try:
            sid, reply = await env.start_sample(out.task, out.index)
        except (EnvControllerError, ValueError) as e:
            out.status, out.reason = "not started", str(e)
            note_start()
            return
        out.session_id = sid
        open_now += 1
        peak_open = max(peak_open, open_now)
        note_start()
        try:
            await asyncio.wait_for(all_started.wait(), args.ramp_s + 120)
            await asyncio.sleep(random.uniform(0, args.think_s))
            t_send = time.monotonic()
            for message in demos[(out.task, out.index)]:
                if reply.finish:
                    break
                t_send = time.monotonic()
                reply = await env.interact(sid, [message])
                out.turns += 1
                if not reply.finish:
                    await asyncio.sleep(args.think_s * random.uniform(0.5, 1.5))
            else:
                if not reply.finish:
                    out.lost = "demonstration ran out before the episode finished"
                    return
            out.status, out.reward, out.reason = reply.status.value, reply.reward, reply.error
            if reply.status is SampleStatus.COMPLETED and reply.reward != 1.0:
                out.lost = f"completed with reward {reply.reward}, expected 1"
            if reply.status is not SampleStatus.COMPLETED and kill_time:
                out.fail_wait_s = time.monotonic() - max(kill_time[0], t_send)
        except asyncio.CancelledError:
            out.lost = "no final reply before the deadline"
            raise
        except Exception as e:  # noqa: BLE001 - every other exception is a lost session
            out.lost = f"{type(e).__name__}: {e}"
        finally:
            open_now -= 1

    async def killer() -> None:
        await asyncio.wait_for(all_started.wait(), args.ramp_s + 120)
        await asyncio.sleep(args.kill_after_s)
        victim_cpu.append(cpu_seconds(worker_procs[victim].pid))
        worker_procs[victim].send_signal(signal.SIGKILL)
        kill_time.append(time.monotonic())
        logger.info("killed worker %d (%s) at t=%.1f s", victim, worker_task[victim], kill_time[0] - t_origin)

    controller_pid = procs["controller"].pid
    cpu0, load0, psi0 = cpu_seconds(controller_pid), loadavg(), cpu_pressure()
    workers_cpu0 = [cpu_seconds(p.pid) for p in worker_procs]
    driver_cpu0 = time.process_time()
    waits: list[tuple[float, float]] = []  # (monotonic time, the controller's run-queue wait so far, s)

    async def sample_waits() -> None:
        while True:
            waits.append((time.monotonic(), run_delay_s(controller_pid)))
            await asyncio.sleep(0.5)

    runs = [asyncio.ensure_future(episode(i)) for i in range(args.sessions)]
    kill_task = asyncio.ensure_future(killer())
    wait_task = asyncio.ensure_future(sample_waits())
    done, pending = await asyncio.wait(runs, timeout=args.deadline_s)
    for t in pending:
        t.cancel()
    if pending:
        await asyncio.wait(pending, timeout=10)
    kill_task.cancel()
    wait_task.cancel()
    wall = time.monotonic() - t_origin
    controller_cpu, load1, psi1 = cpu_seconds(controller_pid) - cpu0, loadavg(), cpu_pressure()
    driver_cpu = time.process_time() - driver_cpu0
    workers_cpu = sum(
        (victim_cpu[0] if i == victim and victim_cpu else cpu_seconds(p.pid)) - c0
        for i, (p, c0) in enumerate(zip(worker_procs, workers_cpu0))
    )

    # which sessions were on the killed worker: the controller's ended table is not exposed, so ask
    # the surviving workers' view instead: a failed session whose reason names the victim's address
    for out in outcomes:
        if out.reason and victim_address in out.reason:
            out.on_killed_worker = True
    await asyncio.sleep(1.0)  # background cancels settle
    leftover_controller = len(await env.list_sessions())
    histogram = await fetch_overhead_histogram(env)
    workers_view = await env.list_workers()
    await env.aclose()

    completed = [o for o in outcomes if o.status == SampleStatus.COMPLETED.value and not o.lost]
    not_started = [o for o in outcomes if o.status == "not started"]
    lost = [o for o in outcomes if o.lost]
    failed = [o for o in outcomes if o.session_id and not o.lost and o.status != SampleStatus.COMPLETED.value]
    reasons = Counter(f"{o.status}: {reason_kind(o.reason)}" for o in failed)
    fail_waits = [o.fail_wait_s for o in failed if o.fail_wait_s is not None]
    victim_state = next(
        (w["state"] for t in workers_view.values() for w in t["workers"].values() if w["id"] == victim_id), "forgotten"
    )
    ov = stats.overhead_ms
    cl = stats.client_ms
    interacts = len(ov["interact"])
    requests = max(1, sum(stats.status_codes.values()))
    return {
        "config": {k: v for k, v in vars(args).items()},
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version(), "platform": platform.platform(),
                    "loadavg_1m_before": load0, "loadavg_1m_after": load1,
                    "cpu_pressure_avg60_pct_before": psi0, "cpu_pressure_avg60_pct_after": psi1},
        "controller_cpu": {"seconds": round(controller_cpu, 2), "share_of_one_core": round(controller_cpu / wall, 3),
                           "requests": sum(stats.status_codes.values()),
                           "us_per_request": round(1e6 * controller_cpu / requests, 1),
                           # on a run queue, ready but without a CPU (the other processes had both cores)
                           "waited_for_cpu_s": round(waits[-1][1] - waits[0][1], 3) if len(waits) > 1 else None},
        # the fake workers (their own process group) and this driver, counted apart from the controller
        "workers_cpu": {"seconds": round(workers_cpu, 2), "share_of_one_core": round(workers_cpu / wall, 3),
                        "us_per_request": round(1e6 * workers_cpu / requests, 1), "process_group": worker_group},
        "driver_cpu": {"seconds": round(driver_cpu, 2), "share_of_one_core": round(driver_cpu / wall, 3),
                       "us_per_request": round(1e6 * driver_cpu / requests, 1)},
        "wall_s": round(wall, 2),
        "sessions": {
            "planned": args.sessions,
            "started": sum(1 for o in outcomes if o.session_id),
            "peak_open_at_once": peak_open,
            "completed": len(completed),
            "failed": len(failed),
            "failed_on_killed_worker": sum(1 for o in failed if o.on_killed_worker),
            "not_started": len(not_started),
            "lost": len(lost),
            "lost_examples": [o.lost for o in lost[:5]],
            "not_started_reasons": dict(Counter(reason_kind(o.reason) for o in not_started).most_common()),
            "failed_reasons": dict(reasons.most_common()),
            "failure_reply_wait_s_max": round(max(fail_waits), 4) if fail_waits else None,
            "left_open_on_controller": leftover_controller,
        },
        "killed_worker": {"index": victim, "task": worker_task[victim], "controller_id": victim_id,
                          "state_at_end": victim_state,
                          "killed_at_s": round(kill_time[0] - t_origin, 2) if kill_time else None},
        "interacts": interacts,
        "interact_rate_per_s": round(interacts / wall, 1) if wall else 0.0,
        "controller_overhead_ms": {
            ep: {"n": len(v), "p50": round(pct(v, 0.5), 3), "p90": round(pct(v, 0.9), 3),
                 "p99": round(pct(v, 0.99), 3), "max": round(max(v), 3) if v else None}
            for ep, v in ov.items()
        },
        "controller_outside_worker_call_ms": {
            ep: {"n": len(v), "p50": round(pct(v, 0.5), 3), "p99": round(pct(v, 0.99), 3)}
            for ep, v in stats.outside_call_ms.items()
        },
        "client_view_ms": {
            ep: {"rtt_p50": round(pct(stats.rtt_ms[ep], 0.5), 3), "rtt_p99": round(pct(stats.rtt_ms[ep], 0.99), 3),
                 "minus_worker_p50": round(pct(v, 0.5), 3), "minus_worker_p99": round(pct(v, 0.99), 3)}
            for ep, v in cl.items()
        },
        "prometheus_overhead": histogram,
        "interact_overhead_by_second": windows(stats.timeline, t_origin, kill_time[0] if kill_time else None,
                                               waits=waits),
        "http_status_counts": dict(stats.status_codes),
    }


def windows(
    timeline: list[tuple[float, float]], t0: float, t_kill: float | None, width_s: float = 2.0,
    waits: Sequence[tuple[float, float]] = (),
) -> list[dict[str, Any]]:
    """Interact overhead per time window (seconds since the start; the kill marked), with the milliseconds per
    second the controller waited for a CPU in it (``waits``: (time, cumulative run-queue wait) samples)."""
    buckets: dict[int, list[float]] = {}
    for t, v in timeline:
        buckets.setdefault(int((t - t0) // width_s), []).append(v)
    waited: dict[int, float] = {}
    for (ta, a), (tb, b) in zip(waits, waits[1:]):  # each interval's wait goes to the window it ends in
        if tb > ta and not math.isnan(a + b):
            k = int((tb - t0) // width_s)
            waited[k] = waited.get(k, 0.0) + (b - a)
    kill_bucket = int((t_kill - t0) // width_s) if t_kill is not None else None
    return [
        {"from_s": k * width_s, "n": len(v), "p50_ms": round(pct(v, 0.5), 3), "p99_ms": round(pct(v, 0.99), 3),
         "max_ms": round(max(v), 3), "kill": k == kill_bucket,
         "controller_cpu_wait_ms_per_s": round(1000 * waited[k] / width_s, 1) if k in waited else None}
        for k, v in sorted(buckets.items())
    ]


def print_table(r: dict[str, Any]) -> None:
    s = r["sessions"]
    c = r["config"]
    rows = [
        ("sessions planned", s["planned"]),
        ("sessions started", s["started"]),
        ("  peak open at once", s["peak_open_at_once"]),
        ("sessions completed (reward 1)", s["completed"]),
        ("sessions failed (with reason)", s["failed"]),
        ("  of them on the killed worker", s["failed_on_killed_worker"]),
        ("sessions not started", s["not_started"]),
        ("sessions lost", s["lost"]),
        ("sessions left open on controller", s["left_open_on_controller"]),
        ("longest wait for a failure reply, s", s["failure_reply_wait_s_max"]),
        (
            "killed worker",
            f"#{r['killed_worker']['index']} ({r['killed_worker']['task']}) "
            f"at t={r['killed_worker']['killed_at_s']} s, state at end: {r['killed_worker']['state_at_end']}",
        ),
        ("wall time, s", r["wall_s"]),
        (
            "machine load average (1 min) before / after",
            f"{r['machine']['loadavg_1m_before']} / {r['machine']['loadavg_1m_after']}",
        ),
        (
            "CPU pressure (PSI some avg60, %) before / after",
            f"{r['machine']['cpu_pressure_avg60_pct_before']} / {r['machine']['cpu_pressure_avg60_pct_after']}",
        ),
        (
            "controller CPU: share of a core, us per request",
            f"{r['controller_cpu']['share_of_one_core']}, {r['controller_cpu']['us_per_request']}",
        ),
        (
            "fake workers' CPU (own process group), share, us per request",
            f"{r['workers_cpu']['share_of_one_core']}, {r['workers_cpu']['us_per_request']}",
        ),
        (
            "driver's CPU (this process), share, us per request",
            f"{r['driver_cpu']['share_of_one_core']}, {r['driver_cpu']['us_per_request']}",
        ),
        ("interacts (rate/s)", f"{r['interacts']} ({r['interact_rate_per_s']})"),
        ("worker latency (simulated), ms", f"{c['latency_ms']} x U(0.5, 1.5)"),
    ]
    for ep in ("interact", "start_sample"):
        o = r["controller_overhead_ms"][ep]
        rows.append(
            (f"controller overhead {ep} p50 / p99 / max, ms", f"{o['p50']} / {o['p99']} / {o['max']}  (n={o['n']})")
        )
    for ep in ("interact", "start_sample"):
        o = r["controller_outside_worker_call_ms"][ep]
        rows.append((f"  of it outside the worker call, {ep} p50 / p99, ms", f"{o['p50']} / {o['p99']}"))
    for ep in ("interact",):
        v = r["client_view_ms"][ep]
        rows.append((f"client view {ep}: rtt p50 / p99, ms", f"{v['rtt_p50']} / {v['rtt_p99']}"))
        rows.append(
            (f"client view {ep}: rtt - worker p50 / p99, ms", f"{v['minus_worker_p50']} / {v['minus_worker_p99']}")
        )
    worst = max(r["interact_overhead_by_second"], key=lambda w: w["p99_ms"], default=None)
    if worst is not None:
        rows.append(("  worst 2 s window: from s, p99 ms, controller's wait for a CPU ms/s",
                     f"{worst['from_s']:g}, {worst['p99_ms']}, {worst['controller_cpu_wait_ms_per_s']}"))
    waited = r["controller_cpu"]["waited_for_cpu_s"]
    rows.append(("controller's wait for a CPU over the run, s",
                 f"{waited} (on a CPU of its own)" if c.get("pin_controller") else waited))
    p = r["prometheus_overhead"]
    rows.append(
        ("/metrics: interact overheads <= 10 ms", f"{p['interact_share_le_10ms']:.4f} of {int(p['interact_count'])}")
    )
    width = max(len(k) for k, _ in rows)
    print(f"\nenv controller bench: {c['sessions']} sessions, {c['workers']} workers ({c['tasks']}), "
          f"{r['machine']['cpus']} CPUs")
    print("-" * (width + 40))
    for k, v in rows:
        print(f"{k:<{width}}  {v}")
    print("failure reasons:")
    for reason, n in s["failed_reasons"].items():
        print(f"  {n:>6}  {reason}")
    for reason, n in s["not_started_reasons"].items():
        print(f"  {n:>6}  not started: {reason}")
    for ex in s["lost_examples"]:
        print(f"  lost: {ex}")


def main(argv: list[str] | None = None) -> int:
    parser = bench_parser("env_controller", __doc__)
    parser.add_argument("--sessions", type=int, default=4000)
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--tasks", default="guess,calc", help="tasks, assigned to workers and sessions round robin")
    parser.add_argument("--latency-ms", type=float, default=50.0, help="simulated worker latency per call (mean)")
    parser.add_argument("--think-s", type=float, default=5.0, help="simulated model time between turns (mean)")
    parser.add_argument("--ramp-s", type=float, default=8.0, help="starts are spread over this long")
    parser.add_argument("--kill-after-s", type=float, default=2.0,
                        help="kill a worker this long after all sessions are open")
    parser.add_argument("--heartbeat-interval", type=float, default=1.0)
    parser.add_argument("--suspect-after", type=float, default=3.0)
    parser.add_argument("--heartbeat-timeout", type=float, default=6.0)
    parser.add_argument("--retries", type=int, default=3)
    parser.add_argument("--call-timeout", type=float, default=60.0)
    parser.add_argument("--max-connections", type=int, default=1024)
    parser.add_argument("--pin-controller", action="store_true",
                        help="the controller alone on one CPU, the workers and this driver on the others (as on "
                             "separate machines: their bursts cannot delay the controller's requests)")
    parser.add_argument("--deadline-s", type=float, default=300.0,
                        help="sessions without a final reply by then are lost")
    args = parse_bench_args(parser, argv, SMOKE)
    tasks = args.tasks.split(",")
    if not any(sum(1 for i in range(args.workers) if tasks[i % len(tasks)] == t) >= 2 for t in tasks):
        parser.error(f"--workers {args.workers} with --tasks {args.tasks}: the killed worker's task needs a "
                     f"second worker; give --workers >= {len(tasks) + 1}")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", datefmt="%H:%M:%S")
    logging.getLogger("env_controller.clients.http_client").setLevel(logging.ERROR)
    install_uvloop()
    raise_nofile_limit()
    log_dir = Path(tempfile.mkdtemp(prefix="agentrl-bench-env-"))
    procs = ProcessGroup(log_dir, cwd=REPO)
    try:
        result = asyncio.run(drive(args, procs))
    except BaseException:
        logger.error("bench failed; process logs kept in %s", log_dir)
        raise
    finally:
        procs.close(15.0)
    shutil.rmtree(log_dir, ignore_errors=True)
    out = write_record(args.out, {"bench": "env_controller", "commit": git_commit(), **result})
    print_table(result)
    print(f"results: {out}")
    print(f"env_lost_sessions: {result['sessions']['lost']}")
    return 0 if result["sessions"]["lost"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
