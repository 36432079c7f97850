"""Helpers shared by the bench scripts: the ``--smoke`` / ``--out`` options, the JSON record, the commit."""
from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import subprocess
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "bench" / "results"


def git_commit() -> str:
    """The short commit hash of the repository the benchmark ran from ("unknown" outside git)."""
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True,
                              timeout=10).stdout.strip() or "unknown"
    except Exception:  # noqa: BLE001 - informational
        return "unknown"


def bench_parser(name: str, doc: str | None) -> argparse.ArgumentParser:
    """An argument parser for bench ``name`` with the options every bench has: ``--smoke`` and ``--out``.

    The description is the first paragraph of ``doc`` (the script's docstring). ``--out`` defaults
    to ``bench/results/<name>.json``, or ``bench/results/<name>_smoke.json`` with ``--smoke`` (see
    ``parse_bench_args``), so that a smoke run never overwrites a measurement.
    """
    p = argparse.ArgumentParser(description=(doc or name).split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--smoke", action="store_true",
                   help="tiny sizes on the CPU, seconds: checks that the script runs (its figures mean nothing)")
    p.add_argument("--out", default=str(RESULTS / f"{name}.json"), help="where the JSON record goes")
    p.set_defaults(_bench_name=name)
    return p


def parse_bench_args(parser: argparse.ArgumentParser, argv: list[str] | None,
                     smoke: dict[str, Any]) -> argparse.Namespace:
    """Parse ``argv``; with ``--smoke`` the values in ``smoke`` (keyed by ``dest``) replace the defaults.

    Options given explicitly still win over the smoke values, so ``--smoke --steps 3`` runs the
    smoke sizes with three steps.
    """
    known, _ = parser.parse_known_args(argv)
    if known.smoke:
        unknown = sorted(k for k in smoke if not hasattr(known, k))
        if unknown:
            raise ValueError(f"smoke values for options the parser lacks: {unknown}")
        parser.set_defaults(**smoke, out=str(RESULTS / f"{known._bench_name}_smoke.json"))
    args = parser.parse_args(argv)
    del args._bench_name
    return args


def write_record(path: str | Path, record: dict[str, Any]) -> Path:
    """Write ``record`` as indented JSON to ``path`` (parents created); returns the path."""
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(record, indent=2, default=str) + "\n")
    return out


def skip_smoke(args: argparse.Namespace, name: str, why: Exception, last_lines: list[str]) -> int:
    """A bench that cannot run on this machine (``why``: no Docker engine, say): SystemExit naming it, except in a
    smoke run, which runs everywhere: then the record says skipped, each of ``last_lines`` prints as
    ``<line>: 0`` and the exit status is 0."""
    if not args.smoke:
        raise SystemExit(f"{name} bench: {why}")
    write_record(args.out, {"bench": name, "commit": git_commit(), "skipped": str(why)})
    print(f"skipped: {why}")
    for line in last_lines:
        print(f"{line}: 0")
    return 0


def _rank_entry(target: Callable[..., dict], rank: int, world: int, port: int, args: tuple, q: Any) -> None:
    """Run ``target(rank, world, port, *args)`` in a spawned process; put ``(rank, result)`` on ``q``,
    or ``(rank, {"error": traceback})`` when it raises."""
    try:
        q.put((rank, target(rank, world, port, *args)))
    except BaseException as e:  # noqa: BLE001 - reported to the parent
        q.put((rank, {"error": f"{e!r}\n{traceback.format_exc()}"}))


def run_ranks(target: Callable[..., dict], world: int, args: tuple, timeout_s: float, what: str) -> list[dict]:
    """Run ``target(rank, world, port, *args) -> dict`` on ``world`` spawned processes (``port``: a free
    loopback port for their rendezvous) and return the ranks' dicts in rank order.

    ``target`` must be a module-level function. A rank that raises, or a run past ``timeout_s``
    seconds, ends the bench with SystemExit naming ``what`` (and the rank's traceback); every process
    is joined or killed before this returns.
    """
    from env_controller.http.net import free_port

    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_rank_entry, args=(target, r, world, port, args, q), daemon=True)
             for r in range(world)]
    for p in procs:
        p.start()
    out: dict[int, dict] = {}
    try:
        deadline = time.monotonic() + timeout_s
        while len(out) < world:
            try:
                rank, rec = q.get(timeout=max(1.0, deadline - time.monotonic()))
            except Exception:  # queue.Empty
                raise SystemExit(f"the {what} run did not finish within {timeout_s:.0f} s") from None
            if "error" in rec:
                raise SystemExit(f"rank {rank} of the {what} run (world {world}) failed:\n{rec['error']}")
            out[rank] = rec
    finally:
        for p in procs:
            p.join(10)
            if p.is_alive():
                p.kill()
    return [out[r] for r in range(world)]
