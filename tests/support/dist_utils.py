"""Run a function on N local processes (torchrun-style env, gloo-ready) with a hard timeout.

``run_distributed(fn, world_size, *args, timeout_s=60)`` starts ``world_size`` fresh Python
processes, each with ``MASTER_ADDR``/``MASTER_PORT`` (a free local
port), ``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE`` set, calls ``fn(rank, world_size, *args)`` in
each and returns the per-rank return values (pickled back; tensors are copied). If any rank
raises, the others are killed and an AssertionError carries that rank's traceback; if the
deadline passes, stragglers are killed and the error names them. ``fn`` must be importable
(defined at the top level of a module).

The ranks are forked from multiprocessing's fork server, which imported torch, megatron-core, transformers and the
training path once (``PRELOAD``), where a spawned rank paid all those imports again. A rank still starts from a
process that ran nothing but imports, in this process's current directory and environment, with one OpenMP thread.

``wait_for_file(path, timeout_s)`` lets one of those processes wait for a file that another writes
(a URL, a "done" marker).
"""
from __future__ import annotations

import multiprocessing as mp
import multiprocessing.forkserver
import os
import pickle
import queue
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any
from unittest import mock

from env_controller.http.net import free_port

PRELOAD = ["torch", "megatron.core", "transformers", "megatron_agentrl.megatron.actor",
           "megatron_agentrl.pipeline.loop"]
# read when torch loads, so the fork server must start with it: a rank's own setting would come too late
SERVER_ENV = {"OMP_NUM_THREADS": "1"}


def _worker(rank: int, world_size: int, port: int, fn: Callable[..., Any], args: tuple[Any, ...],
            results: Any, env: dict[str, str]) -> None:
    os.environ.clear()  # the caller's environment now, not the fork server's from its start
    os.environ.update(env)
    os.environ.update({
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
        "RANK": str(rank),
        "LOCAL_RANK": str(rank),
        "WORLD_SIZE": str(world_size),
        "LOCAL_WORLD_SIZE": str(world_size),
    })
    try:
        out = fn(rank, world_size, *args)
        payload = pickle.dumps(out)
        results.put(("ok", rank, payload))
    except BaseException:  # noqa: BLE001 - report everything to the parent
        results.put(("err", rank, traceback.format_exc()))


def _kill(procs: list[Any]) -> None:
    for p in procs:
        if p.is_alive():
            p.kill()
    for p in procs:
        p.join(timeout=5)


def run_distributed(fn: Callable[..., Any], world_size: int, *args: Any, timeout_s: float = 60.0,
                    env: dict[str, str] | None = None) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` processes; return results by rank.

    Raises AssertionError with the failing rank's traceback, or naming the ranks that did
    not finish within ``timeout_s`` seconds (they are killed).
    """
    ctx = _context()
    results = ctx.Queue()
    port = free_port()
    child_env = {**os.environ, **SERVER_ENV, **(env or {})}
    procs = [ctx.Process(target=_worker, args=(r, world_size, port, fn, args, results, child_env), daemon=True)
             for r in range(world_size)]
    for p in procs:
        p.start()
    deadline = time.monotonic() + timeout_s
    done: dict[int, Any] = {}
    try:
        while len(done) < world_size:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                missing = sorted(set(range(world_size)) - set(done))
                raise AssertionError(f"ranks {missing} did not finish within {timeout_s:.0f} s (killed)")
            try:
                status, rank, payload = results.get(timeout=min(0.5, remaining))
            except queue.Empty:
                for r, p in enumerate(procs):
                    if r not in done and p.exitcode is not None:
                        # Give a just-written message a moment to arrive before declaring it lost.
                        try:
                            status, rank, payload = results.get(timeout=2.0)
                            break
                        except queue.Empty:
                            raise AssertionError(f"rank {r} exited with code {p.exitcode} without a result") from None
                else:
                    continue
            if status == "err":
                raise AssertionError(f"rank {rank} failed:\n{payload}")
            done[rank] = pickle.loads(payload)
        for p in procs:
            p.join(timeout=max(1.0, deadline - time.monotonic()))
    finally:
        _kill(procs)
        results.close()
    return [done[r] for r in range(world_size)]


def _context() -> Any:
    """The fork-server context, its server started (once per process) with ``PRELOAD`` imported."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    with mock.patch.dict(os.environ, SERVER_ENV):
        multiprocessing.forkserver.ensure_running()
    return ctx


def wait_for_file(path: Path, timeout_s: float) -> None:
    """Return once ``path`` exists (polled every 0.1 s); TimeoutError after ``timeout_s`` seconds."""
    deadline = time.monotonic() + timeout_s
    while not path.exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{path} did not appear within {timeout_s}s")
        time.sleep(0.1)
