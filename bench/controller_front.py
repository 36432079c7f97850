"""Benchmark: the controller's CPU per forwarded request, its fast front against aiohttp's server, side by side.

One run starts, in turn and in rounds (fast, aiohttp, aiohttp, fast, ...), a controller process with
``ControllerConfig(fast_front=True)`` and one with ``fast_front=False`` (aiohttp serves every request),
each against the same stand-in worker process (a raw asyncio server with
canned replies, so the worker's own cost stays out of it), and drives it from this process with raw
keep-alive connections: ``--sessions`` starts, then ``--rounds-per-session`` interacts on each, over
``--connections`` connections. The controller's CPU (user + system, ``/proc/<pid>/stat``) over each
phase, divided by its requests, is the figure; the machine's load average is recorded beside it.
A third server, ``relay``, is the floor: a bare uvloop proxy that reads each request, writes it to the worker
on a kept-alive connection and writes the reply back with a session header, with no JSON, sessions, validation
or metrics: what the same sockets and event loop cost with no controller logic (system time is reported apart).
It isolates the controller's own cost (closed loop, the driver and worker as light as they can be);
``bench/env_controller.py`` measures the whole system at scale.

    .venv/bin/python bench/controller_front.py                 # 4000 sessions, 3 interacts each, 2 rounds
    .venv/bin/python bench/controller_front.py --smoke         # seconds
    .venv/bin/python bench/controller_front.py --instructions  # + user-space instructions per request (valgrind)
    .venv/bin/python bench/controller_front.py --connections 1 --gap-ms 2 [--awake]   # sparse arrivals

``--gap-ms`` paces the driver (a pause before each request on each connection), as requests arrive at a controller
whose sessions spend most of their time in the model and the task: a request after a pause costs more than one
right after another (the CPU may have gone idle, the caches have cooled), for the bare relay as much as for the
controller. ``--awake`` keeps every CPU busy with a spinning process of the lowest scheduling class (``SCHED_IDLE``:
it runs only when nothing else wants the CPU, so it takes no time from the servers), which tells the cost of waking
idle CPUs apart from the rest (on the development machine it did not remove the rise: docs/BENCHMARKS.md).

``--instructions`` also runs each server once under valgrind's callgrind, its counting switched on only while
one connection sends ``--instruction-requests`` starts and then as many interacts: the instructions per request,
a figure that other jobs on the machine do not move (CPU time under load varies by a fifth between runs). It
leaves out the kernel's share (the ``system`` column) and cache misses.

Prints a table, writes ``bench/results/controller_front.json`` (``--out``); the last line is
``controller_front_cpu_ratio: <fast / aiohttp CPU per interact>``.
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import multiprocessing as mp
import os
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench._common import bench_parser, git_commit, parse_bench_args, write_record  # noqa: E402
from env_controller.http.net import free_port  # noqa: E402
from env_controller.servers.process import start_process, stop_process  # noqa: E402

SMOKE = {"sessions": 200, "rounds_per_session": 2, "connections": 16, "rounds": 1, "gap_ms": 0.2, "awake": True}

_INTERACT = json.dumps({"session_id": 1, "env_out": {
    "messages": [{"role": "tool", "tool_call_id": "c0", "content": "too low; " * 20}],
    "tools": [], "status": "running", "finish": False, "reward": 0.0, "metric": {}}}).encode()
_START = json.dumps({
    "messages": [{"role": "system", "content": "s" * 300}, {"role": "user", "content": "u" * 200}],
    "tools": [{"type": "function", "function": {"name": "guess", "parameters": {"type": "object"}}}],
    "status": "running", "finish": False, "reward": 0.0, "metric": {}}).encode()
_MESSAGE = json.dumps({"messages": [{"role": "assistant", "content": "", "tool_calls": [
    {"id": "c0", "type": "function", "function": {"name": "guess", "arguments": "{\"n\": 5}"}}]}]}).encode()


def cpu_split(pid: int) -> tuple[float, float]:
    """(user, system) CPU seconds of a process (Linux /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    tick = os.sysconf("SC_CLK_TCK")
    return int(fields[11]) / tick, int(fields[12]) / tick


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of a process (Linux /proc)."""
    return sum(cpu_split(pid))


def run_controller(port: int, fast: bool) -> None:
    """A controller process (``fast_front`` as given) until SIGTERM."""
    from env_controller.controller.server import ControllerConfig, serve_controller
    from env_controller.http.service import install_uvloop

    install_uvloop()
    asyncio.run(serve_controller(ControllerConfig(port=port, fast_front=fast)))


def run_relay(port: int, worker_port: int) -> None:
    """The floor: a proxy that does only what every forwarded request needs at the socket level (read the
    request, write it to the worker on a kept-alive connection, read the reply, write it back with the
    session header added), with no JSON, sessions, validation or metrics, on the same event loop (uvloop)."""
    from env_controller.http.service import install_uvloop

    class Up(asyncio.Protocol):
        def __init__(self, down: Any) -> None:
            self.down, self.buf = down, b""

        def connection_made(self, transport: Any) -> None:
            self.transport = transport

        def data_received(self, data: bytes) -> None:
            self.buf += data
            end = self.buf.find(b"\r\n\r\n")
            if end < 0:
                return
            i = self.buf.find(b"Content-Length: ", 0, end)
            n = int(self.buf[i + 16:self.buf.index(b"\r\n", i)])
            if len(self.buf) < end + 4 + n:
                return
            reply, self.buf = self.buf[:end + 4 + n], self.buf[end + 4 + n:]
            self.down.transport.write(reply[:end + 2] + self.down.extra + reply[end + 2:])

    class Down(asyncio.Protocol):
        sessions = 0

        def connection_made(self, transport: Any) -> None:
            self.transport, self.buf, self.up, self.extra = transport, b"", None, b""
            asyncio.get_running_loop().create_task(self._connect())

        async def _connect(self) -> None:
            try:
                _, self.up = await asyncio.get_running_loop().create_connection(lambda: Up(self), "127.0.0.1",
                                                                                worker_port)
            except OSError:  # the worker is not up yet: the client's come-up probe tries again
                self.transport.close()
                return
            self._next()

        def data_received(self, data: bytes) -> None:
            self.buf += data
            if self.up is not None:
                self._next()

        def _next(self) -> None:
            end = self.buf.find(b"\r\n\r\n")
            if end < 0:
                return
            head = self.buf[:end].lower()
            i = head.find(b"content-length: ")
            n = int(head[i + 16:].split(b"\r\n")[0]) if i >= 0 else 0
            if len(self.buf) < end + 4 + n:
                return
            request, self.buf = self.buf[:end + 4 + n], self.buf[end + 4 + n:]
            if head.startswith(b"post /api/start_sample"):
                Down.sessions += 1
                self.extra = b"session_id: %d\r\n" % Down.sessions
            else:
                self.extra = b"x-controller-overhead-ms: 0.0\r\n"
            self.up.transport.write(request)

    async def main() -> None:
        await asyncio.get_running_loop().create_server(Down, "127.0.0.1", port)
        await asyncio.Event().wait()

    install_uvloop()
    asyncio.run(main())


def run_worker(port: int, controller_port: int) -> None:
    """The stand-in worker: canned replies, a heartbeat a second."""
    from env_controller.http.service import install_uvloop

    class Worker(asyncio.Protocol):
        def connection_made(self, transport: Any) -> None:
            self.transport, self.buf = transport, b""

        def data_received(self, data: bytes) -> None:
            self.buf += data
            while (end := self.buf.find(b"\r\n\r\n")) >= 0:
                head = self.buf[:end].lower()
                i = head.find(b"content-length: ")
                length = int(head[i + 16:].split(b"\r\n")[0]) if i >= 0 else 0
                if len(self.buf) < end + 4 + length:
                    return
                self.buf = self.buf[end + 4 + length:]
                body = _START if head.startswith(b"post /api/start_sample") else (
                    _INTERACT if head.startswith(b"post /api/interact") else b"{}")
                self.transport.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nx-worker-time: 0.0001\r\n"
                                     b"Content-Length: %d\r\n\r\n%s" % (len(body), body))

    async def main() -> None:
        await asyncio.get_running_loop().create_server(Worker, "127.0.0.1", port)
        beat = json.dumps({"name": "guess", "address": f"http://127.0.0.1:{port}/api", "concurrency": 1_000_000,
                           "indices": list(range(100))}).encode()
        while True:
            try:
                reader, writer = await asyncio.open_connection("127.0.0.1", controller_port)
                writer.write(b"POST /api/receive_heartbeat HTTP/1.1\r\nHost: c\r\nContent-Type: application/json\r\n"
                             b"Connection: close\r\nContent-Length: %d\r\n\r\n%s" % (len(beat), beat))
                await asyncio.wait_for(reader.read(), 10)
                writer.close()
            except OSError:
                pass
            await asyncio.sleep(1.0)

    install_uvloop()
    asyncio.run(main())


async def call(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, path: bytes, body: bytes,
               sid: int | None = None) -> tuple[bytes, bytes]:
    extra = b"session_id: %d\r\n" % sid if sid is not None else b""
    writer.write(b"POST %s HTTP/1.1\r\nHost: c\r\n%sContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s"
                 % (path, extra, len(body), body))
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 60)
    low = head.lower()
    i = low.find(b"content-length: ")
    data = await asyncio.wait_for(reader.readexactly(int(low[i + 16:].split(b"\r\n")[0])), 60)
    if not head.startswith(b"HTTP/1.1 200"):
        raise RuntimeError(f"{path!r}: {head[:60]!r} {data[:200]!r}")
    return low, data


async def measure(front: str, args: Any) -> dict[str, Any]:
    cport, wport = free_port(), free_port()
    ctx = mp.get_context("spawn")
    if front == "relay":
        controller = ctx.Process(target=run_relay, args=(cport, wport), daemon=True)
    else:
        controller = ctx.Process(target=run_controller, args=(cport, front == "fast"), daemon=True)
    worker = ctx.Process(target=run_worker, args=(wport, cport), daemon=True)
    controller.start()
    worker.start()
    try:
        deadline = time.monotonic() + 60
        while True:  # the worker has registered once a start succeeds
            try:
                conn = await asyncio.open_connection("127.0.0.1", cport)
                await call(*conn, b"/api/start_sample", b'{"name":"guess","index":0}')
                conn[1].close()
                break
            except (OSError, RuntimeError, asyncio.IncompleteReadError):
                if time.monotonic() > deadline:
                    raise RuntimeError("the controller or the stand-in worker did not come up within 60 s") from None
                await asyncio.sleep(0.2)
        conns = [await asyncio.open_connection("127.0.0.1", cport) for _ in range(args.connections)]
        sids: list[int] = []
        overheads: list[float] = []

        gap_s = args.gap_ms / 1000

        async def starts(k: int) -> None:
            for i in range(k, args.sessions, args.connections):
                if gap_s:
                    await asyncio.sleep(gap_s)
                low, _ = await call(*conns[k], b"/api/start_sample", b'{"name":"guess","index":%d}' % (i % 100))
                sids.append(_session_id(low))

        async def interacts(k: int) -> None:
            for _ in range(args.rounds_per_session):
                for j in range(k, len(sids), args.connections):
                    if gap_s:
                        await asyncio.sleep(gap_s)
                    low, _ = await call(*conns[k], b"/api/interact", _MESSAGE, sids[j])
                    o = low.find(b"x-controller-overhead-ms: ")
                    overheads.append(float(low[o + 26:].split(b"\r\n")[0]))

        load0 = os.getloadavg()[0]
        c0 = cpu_seconds(controller.pid)
        await asyncio.gather(*(starts(k) for k in range(args.connections)))
        (u1, s1), t1 = cpu_split(controller.pid), time.monotonic()
        c1 = u1 + s1
        await asyncio.gather(*(interacts(k) for k in range(args.connections)))
        (u2, s2), t2 = cpu_split(controller.pid), time.monotonic()
        c2 = u2 + s2
        for _, w in conns:
            w.close()
        overheads.sort()
        n = len(overheads)
        return {
            "front": front,
            "start_us_per_request": round(1e6 * (c1 - c0) / args.sessions, 1),
            "interact_us_per_request": round(1e6 * (c2 - c1) / n, 1),
            "interact_system_us_per_request": round(1e6 * (s2 - s1) / n, 1),
            "interacts_per_s": round(n / (t2 - t1), 1),
            "interact_overhead_ms_p50": overheads[n // 2],
            "interact_overhead_ms_p99": overheads[min(n - 1, int(n * 0.99))],
            "loadavg_1m": [load0, os.getloadavg()[0]],
        }
    finally:
        for p in (controller, worker):
            p.terminate()
            p.join(10)
            if p.is_alive():
                p.kill()
                p.join(10)


_UNDER_VALGRIND = ("import sys; sys.path.insert(0, {repo!r})\n"
                   "from bench.controller_front import {target}; {target}({args})\n")


async def _callgrind(pid: int, *args: str) -> None:
    """``callgrind_control <args> <pid>`` (it returns once valgrind has done it)."""
    proc = await asyncio.create_subprocess_exec("callgrind_control", *args, str(pid),
                                                stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.DEVNULL)
    if await asyncio.wait_for(proc.wait(), 120) != 0:
        raise RuntimeError(f"callgrind_control {' '.join(args)} {pid} failed")


def _session_id(head: bytes) -> int:
    """The ``session_id`` header of a start reply's head (lower-cased)."""
    j = head.find(b"session_id: ")
    return int(head[j + 12:].split(b"\r\n")[0])


def _callgrind_total(out: Path) -> int:
    """Instructions counted in a callgrind dump (``totals:`` / ``summary:`` line)."""
    for line in out.read_text(errors="replace").splitlines():
        if line.startswith(("totals:", "summary:")):
            return int(line.split()[1])
    raise RuntimeError(f"{out}: no totals line")


async def count_instructions(front: str, n: int, workdir: Path) -> dict[str, Any]:
    """User-space instructions per start and per interact of one server (``fast`` or ``relay``) under callgrind,
    one request at a time on one connection."""
    cport, wport = free_port(), free_port()
    target, call_args = ("run_relay", f"{cport}, {wport}") if front == "relay" else (
        "run_controller", f"{cport}, {front == 'fast'}")
    worker = mp.get_context("spawn").Process(target=run_worker, args=(wport, cport), daemon=True)
    worker.start()
    dump = workdir / f"callgrind.{front}"
    server = start_process(
        ["valgrind", "--tool=callgrind", "--instr-atstart=no", f"--callgrind-out-file={dump}.%p", sys.executable,
         "-c", _UNDER_VALGRIND.format(repo=str(REPO), target=target, args=call_args)],
        os.devnull, cwd=REPO, group=None)
    counts: dict[str, Any] = {"front": front, "requests": n}
    try:
        deadline = time.monotonic() + 300  # a server starts tens of times slower under valgrind
        while True:
            try:
                reader, writer = await asyncio.open_connection("127.0.0.1", cport)
                low, _ = await call(reader, writer, b"/api/start_sample", b'{"name":"guess","index":0}')
                break
            except (OSError, RuntimeError, asyncio.IncompleteReadError):
                if time.monotonic() > deadline or server.poll() is not None:
                    raise RuntimeError(f"{front} under valgrind did not come up within 300 s") from None
                await asyncio.sleep(0.5)
        first = _session_id(low)
        for _ in range(50):  # warm: first calls build caches and connections
            await call(reader, writer, b"/api/interact", _MESSAGE, first)
        sids: list[int] = []
        await _callgrind(server.pid, "-i", "on")
        for phase in ("start", "interact"):
            await _callgrind(server.pid, "-z")  # count from here
            for i in range(n):
                if phase == "start":
                    body = b'{"name":"guess","index":%d}' % (i % 100)
                    low, _ = await call(reader, writer, b"/api/start_sample", body)
                    sids.append(_session_id(low))
                else:
                    await call(reader, writer, b"/api/interact", _MESSAGE, sids[i])
            before = set(workdir.glob(f"callgrind.{front}.*"))
            await _callgrind(server.pid, "-d")  # to here
            (dumped,) = set(workdir.glob(f"callgrind.{front}.*")) - before
            counts[f"{phase}_instructions_per_request"] = round(_callgrind_total(dumped) / n)
        writer.close()
    finally:
        stop_process(server, grace_s=60.0)
        worker.terminate()
        worker.join(10)
    return counts


FRONTS = ("fast", "aiohttp", "relay")


def _spin() -> None:
    """Busy-loop at the lowest scheduling class (``SCHED_IDLE``) until terminated."""
    os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
    while True:
        pass


@contextlib.contextmanager
def cpus_kept_awake(on: bool) -> Iterator[None]:
    """While open (with ``on``), one ``SCHED_IDLE`` spinning process per CPU: no CPU goes idle, yet any other
    process that wants a CPU preempts the spinner at once: what the servers' requests cost without the CPUs'
    wake-ups from idle states (a virtual machine's halt among them)."""
    spinners = [mp.get_context("spawn").Process(target=_spin, daemon=True) for _ in range(os.cpu_count() or 1)
                if on]
    for p in spinners:
        p.start()
    try:
        yield
    finally:
        for p in spinners:
            p.terminate()
            p.join(10)


async def drive(args: Any) -> dict[str, Any]:
    fronts = [f for f in args.fronts.split(",") if f]
    if not {"fast", "aiohttp"} <= set(fronts) or not set(fronts) <= set(FRONTS):
        raise SystemExit(f"--fronts {args.fronts!r}: give fast and aiohttp, and relay if wanted ({','.join(FRONTS)})")
    runs = []
    with cpus_kept_awake(args.awake):
        for r in range(args.rounds):
            for front in (fronts if r % 2 == 0 else fronts[::-1]):
                runs.append(await measure(front, args))
    per = {}
    for front in fronts:
        mine = [x for x in runs if x["front"] == front]
        per[front] = {k: round(sum(x[k] for x in mine) / len(mine), 1)
                      for k in ("start_us_per_request", "interact_us_per_request", "interact_system_us_per_request",
                                "interacts_per_s")}
    out = {"config": vars(args), "cpus": os.cpu_count(), "runs": runs, "mean": per,
           "cpu_ratio": round(per["fast"]["interact_us_per_request"] / per["aiohttp"]["interact_us_per_request"], 3)}
    if "relay" in per:  # None when the relay's CPU stayed below one clock tick (a smoke run)
        floor = per["relay"]["interact_us_per_request"]
        out["fast_over_relay"] = round(per["fast"]["interact_us_per_request"] / floor, 3) if floor > 0 else None
    if args.instructions:
        import shutil
        import tempfile

        if shutil.which("valgrind") is None or shutil.which("callgrind_control") is None:
            raise SystemExit("--instructions needs valgrind (apt-get install valgrind)")
        with tempfile.TemporaryDirectory(prefix="agentrl-callgrind-") as tmp:
            out["instructions"] = [await count_instructions(front, args.instruction_requests, Path(tmp))
                                   for front in ("fast", "relay")]
    return out


def main(argv: list[str] | None = None) -> int:
    parser = bench_parser("controller_front", __doc__)
    parser.add_argument("--sessions", type=int, default=4000)
    parser.add_argument("--rounds-per-session", type=int, default=3, help="interacts per session")
    parser.add_argument("--connections", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=2, help="rounds of the fronts, order alternating")
    parser.add_argument("--fronts", default="fast,aiohttp,relay", help="fast and aiohttp (the controller's two "
                        "servers), and relay: the floor, a bare byte relay with no controller logic")
    parser.add_argument("--gap-ms", type=float, default=0.0, help="pause before each request on each connection "
                        "(sparse arrivals: the CPUs idle between requests)")
    parser.add_argument("--awake", action="store_true", help="keep every CPU from idling with SCHED_IDLE spinners "
                        "(they yield to any other process)")
    parser.add_argument("--instructions", action="store_true", help="also count user-space instructions per "
                        "request of the fast front and the relay under valgrind's callgrind (load-independent)")
    parser.add_argument("--instruction-requests", type=int, default=500, help="requests counted per phase")
    args = parse_bench_args(parser, argv, SMOKE)
    if not args.gap_ms >= 0:
        raise SystemExit(f"--gap-ms {args.gap_ms}: give a pause of 0 ms or more")
    from env_controller.http.service import install_uvloop

    install_uvloop()
    result = asyncio.run(drive(args))
    out = write_record(args.out, {"bench": "controller_front", "commit": git_commit(), **result})
    print(f"\ncontroller CPU per forwarded request, fast front vs aiohttp's server ({result['cpus']} CPUs)")
    print(f"{'front':<8} {'start us':>9} {'interact us':>12} {'of it system':>13} {'interacts/s':>12} {'p50 ms':>8} "
          f"{'p99 ms':>8}  load")
    for x in result["runs"]:
        print(f"{x['front']:<8} {x['start_us_per_request']:>9} {x['interact_us_per_request']:>12} "
              f"{x['interact_system_us_per_request']:>13} {x['interacts_per_s']:>12} "
              f"{x['interact_overhead_ms_p50']:>8} {x['interact_overhead_ms_p99']:>8}  "
              f"{x['loadavg_1m'][0]:.2f} -> {x['loadavg_1m'][1]:.2f}")
    if result.get("fast_over_relay") is not None:
        print(f"fast front / bare relay (a Python proxy's floor here), CPU per interact: {result['fast_over_relay']}")
    for x in result.get("instructions", []):
        print(f"user-space instructions per request ({x['front']}, callgrind, {x['requests']} of each): "
              f"start {x['start_instructions_per_request']:,}, interact {x['interact_instructions_per_request']:,}")
    print(f"results: {out}")
    print(f"controller_front_cpu_ratio: {result['cpu_ratio']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
