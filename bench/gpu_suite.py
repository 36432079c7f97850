#!/usr/bin/env python
"""Every GPU measurement in one command, within a time budget, with its logs and records in one folder.

A GPU machine is often lent for minutes, bare, without network: the suite runs the GPU tests and the
GPU benchmarks as parts, one after another, each with its own timeout and never past ``--budget-s``
(the parts left when time runs out are recorded as not run), writes every part's log and JSON next
to its own record, and prints one summary table. The parts:

* ``env``: torch, CUDA, the device's name and memory, the versions of the packages the project
  imports there, and ``agentrl doctor``'s items (always first; it fails when megatron-core or transformers
  cannot be imported);
* ``tests``: ``pytest -m gpu tests/e2e/test_gpu.py`` (actor numerics in bf16, packed vs padded, the
  distributed optimizer, local engine vs actor log-probs, weight sync between two processes on the
  one GPU, an async run with a checkpoint and a resume);
* ``advantages``: ``bench/gpu_advantages.py`` at 1M, 10M and 100M tokens, eager and compiled;
* ``logprobs``: ``bench/logprob_memory.py``, the chunked log-probs and entropy against the plain fp32
  path at 8k tokens of a 152k vocabulary (memory and time);
* ``train``: ``bench/gpu_train.py``, GRPO step throughput and MFU of the Megatron actor against
  transformers + AdamW at 0.5B, 1.5B, 3B and 7B (a size whose state cannot fit is recorded as
  skipped, with the reason);
* ``recipe``: the one-node recipe's first step, ``examples/run_qwen3_8b_one_node.sh --check``, with this
  machine's GPU and interpreter (what ``agentrl plan --check`` says of it; not in the default ``--parts``).

Packages the GPU machine lacks travel as wheels (Python 3.12, manylinux x86_64): ``fetch`` downloads
megatron-core and transformers at the versions constraints.txt pins into a folder, and ``--wheels``
installs that folder into a private site directory that the parts import first.

Writes ``<out>`` (default ``bench/results/gpu_suite.json``) and, beside it, ``<out stem>_<part>.log``
and the benchmarks' ``gpu_train.json`` / ``gpu_advantages.json`` (``*_smoke.json`` with ``--smoke``); ends with
``gpu_suite_parts_passed: <passed>/<run>``. ``--smoke``: every part in its CPU smoke form (the GPU
tests skip; seconds).

Usage:
  ``python bench/gpu_suite.py fetch --wheels .whl``   (where PyPI is reachable)
  ``python3 bench/gpu_suite.py --wheels .whl --out $OUT/suite_a.json --parts env,tests,advantages,logprobs``
  ``python3 bench/gpu_suite.py --wheels .whl --out $OUT/suite_b.json --parts env,train``
"""
from __future__ import annotations

import json
import os
import platform
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench._common import bench_parser, git_commit, parse_bench_args, write_record  # noqa: E402
from env_controller.servers.process import start_process, stop_process  # noqa: E402

CARRIED = ("megatron-core", "transformers")  # what the GPU machine's image lacks, or holds at another version
WHEEL_PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_24_x86_64",
                   "manylinux_2_17_x86_64", "manylinux2014_x86_64", "manylinux1_x86_64", "any")
ENV_PROBE = r"""
import importlib.metadata as md, json, platform, torch
info = {"python": platform.python_version(), "torch": torch.__version__, "cuda": torch.version.cuda,
        "cuda_available": torch.cuda.is_available()}
if torch.cuda.is_available():
    p = torch.cuda.get_device_properties(0)
    info.update(device=p.name, memory_gb=round(p.total_memory / 2**30, 1), sms=p.multi_processor_count)
import megatron.core, transformers  # the parts cannot run without them
for d in ("megatron-core", "transformers", "tokenizers", "safetensors", "huggingface-hub", "aiohttp", "numpy"):
    try:
        info[d] = md.version(d)
    except md.PackageNotFoundError:
        info[d] = None
try:  # what `agentrl doctor` says of this machine's GPU stack, item by item
    from megatron_agentrl.launch.doctor import run_doctor
    info["doctor"] = [list(item) for item in run_doctor(timeout_s=30).items]
except Exception as e:  # noqa: BLE001 - recorded, the suite goes on
    info["doctor"] = f"{type(e).__name__}: {e}"
print(json.dumps(info))
"""


@dataclass(frozen=True)
class Part:
    """One step of the suite: its command (``{out}`` = the output folder) for the GPU and for ``--smoke``."""

    name: str
    argv: tuple[str, ...]
    smoke_argv: tuple[str, ...]
    timeout_s: int


def parts(py: str) -> dict[str, Part]:
    """The suite's parts in the order they run, for interpreter ``py``."""
    tests = (py, "-m", "pytest", "-q", "-m", "gpu", "tests/e2e/test_gpu.py", "-p", "no:cacheprovider")
    adv, train = (py, "bench/gpu_advantages.py", "--out"), (py, "bench/gpu_train.py", "--out")
    lpm = (py, "bench/logprob_memory.py", "--out")
    recipe = ("bash", "examples/run_qwen3_8b_one_node.sh", "--check")  # its first step, with this machine's GPU
    return {p.name: p for p in (
        Part("env", (py, "-c", ENV_PROBE), (py, "-c", ENV_PROBE), 120),
        Part("tests", tests, tests, 480),
        Part("advantages", adv + ("{out}/gpu_advantages.json", "--tokens", "1e6,1e7,1e8", "--compile"),
             adv + ("{out}/gpu_advantages_smoke.json", "--smoke"), 300),
        Part("logprobs", lpm + ("{out}/logprob_memory.json", "--device", "cuda", "--tokens", "8192"),
             lpm + ("{out}/logprob_memory_smoke.json", "--smoke"), 180),
        Part("train", train + ("{out}/gpu_train.json", "--sizes", "0.5b,1.5b,3b,7b", "--seq-len", "2048",
                               "--batch", "8", "--micro-batch", "1"),
             train + ("{out}/gpu_train_smoke.json", "--smoke"), 540),
        Part("recipe", recipe, recipe, 120),
    )}


def fetch_wheels(dest: Path) -> list[Path]:
    """Download the ``CARRIED`` packages at the versions constraints.txt pins, as Python 3.12 manylinux
    x86_64 wheels without their dependencies, into ``dest``; returns the wheel files there."""
    pins = {}
    for line in (REPO / "constraints.txt").read_text().splitlines():
        m = re.fullmatch(r"([A-Za-z0-9_.-]+)==(\S+)", line.strip())
        if m:
            pins[m.group(1).lower().replace("_", "-")] = m.group(2)
    missing = [name for name in CARRIED if name not in pins]
    if missing:
        raise SystemExit(f"constraints.txt pins no version of {missing}; add `name==version` lines for them")
    dest.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--python-version", "3.12",
           "--implementation", "cp", "-d", str(dest)]
    for plat in WHEEL_PLATFORMS:
        cmd += ["--platform", plat]
    subprocess.run(cmd + [f"{name}=={pins[name]}" for name in CARRIED], check=True, timeout=600)
    wheels = sorted(dest.glob("*.whl"))
    for w in wheels:
        print(f"{w.name}  {w.stat().st_size / 2**20:.1f} MiB")
    return wheels


def install_wheels(folder: Path) -> str:
    """Install every wheel in ``folder`` (no index, no dependencies) into a fresh site directory;
    returns that directory, for the parts' ``PYTHONPATH``."""
    wheels = sorted(folder.glob("*.whl"))
    if not wheels:
        raise SystemExit(f"--wheels {folder}: no .whl files there; make them with `python bench/gpu_suite.py fetch "
                         f"--wheels {folder}` where PyPI is reachable")
    site = tempfile.mkdtemp(prefix="agentrl-site-")
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
                    "--no-cache-dir", "--target", site, *map(str, wheels)], check=True, timeout=300)
    return site


def run_part(part: Part, argv: tuple[str, ...], log: Path, env: dict[str, str], timeout_s: float) -> dict:
    """Run one part with its output going to ``log``; returns its row. A part that outlives
    ``timeout_s`` is killed with every process it started (its own process group), so that no
    worker keeps holding the GPU for the next part."""
    cmd = [a.replace("{out}", str(log.parent)) for a in argv]
    t0 = time.monotonic()
    log.write_text("$ " + " ".join(cmd) + "\n")
    proc = start_process(cmd, log, env=env, cwd=REPO)
    try:
        rc = proc.wait(timeout=timeout_s)
        status = "passed" if rc == 0 else f"failed (exit {rc})"
    except subprocess.TimeoutExpired:
        rc, status = None, f"timed out after {timeout_s:.0f} s"
    finally:  # SIGKILL to its group: the part's leftovers (spawned ranks, compile workers)
        stop_process(proc, grace_s=0.0, first_signal=signal.SIGKILL)
    lines = [ln for ln in log.read_text(errors="replace").splitlines() if ln.strip()]
    row = {"status": status, "exit": rc, "seconds": round(time.monotonic() - t0, 1), "log": log.name,
           "last_line": lines[-1] if len(lines) > 1 else ""}
    if part.name == "env" and rc == 0:
        row["env"] = json.loads(lines[-1])
    return row


def run_parts(table: dict[str, Part], names: list[str], args: Any, out: Path, out_file: Path,
              env: dict[str, str], start: float) -> dict[str, dict]:
    """Run the parts ``names`` in order within ``args.budget_s`` of ``start``; their rows."""
    rows: dict[str, dict] = {}
    for name in names:
        part = table[name]
        left = args.budget_s - (time.monotonic() - start)
        if left < 10:
            rows[name] = {"status": f"not run: {args.budget_s:.0f} s budget spent"}
            continue
        log = out / f"{out_file.stem}_{name}.log"
        rows[name] = run_part(part, part.smoke_argv if args.smoke else part.argv, log, env, min(part.timeout_s, left))
        print(f"{name:>10}  {rows[name]['status']:<24} {rows[name]['seconds']:>7.1f} s  {rows[name]['last_line'][:80]}",
              flush=True)
        if name == "env" and rows[name]["exit"] != 0:
            break  # nothing else can import what it needs
    for name in names:
        rows.setdefault(name, {"status": "not run: the env part failed"})
    return rows


def main(argv: list[str] | None = None) -> dict:
    raw = sys.argv[1:] if argv is None else list(argv)
    if raw[:1] == ["fetch"]:
        ap = bench_parser("gpu_suite", __doc__)
        ap.add_argument("--wheels", default=".whl", help="folder the wheels go to")
        fetch_wheels(Path(ap.parse_args(raw[1:]).wheels))
        return {}
    ap = bench_parser("gpu_suite", __doc__)
    ap.add_argument("--parts", default="env,tests,advantages,logprobs,train", help="comma-separated, in this order")
    ap.add_argument("--budget-s", type=float, default=560.0,
                    help="wall-clock seconds for the whole suite (a part gets at most what is left)")
    ap.add_argument("--wheels", default=None, help="a folder of wheels to install first (see `fetch`)")
    args = parse_bench_args(ap, raw, {})
    table = parts(sys.executable)
    names = [n.strip() for n in args.parts.split(",") if n.strip()]
    bad = [n for n in names if n not in table]
    if bad or not names:
        raise SystemExit(f"--parts {args.parts!r}: unknown {bad}; choose from {list(table)}")
    out_file = Path(args.out).resolve()
    out = out_file.parent
    out.mkdir(parents=True, exist_ok=True)
    start = time.monotonic()  # the budget covers the wheel install too
    env = dict(os.environ, PYTHONUNBUFFERED="1", AGENTRL_PYTHON=sys.executable)
    paths = [str(REPO)]
    site = install_wheels(Path(args.wheels)) if args.wheels else None
    if site:
        paths.insert(0, site)
    env["PYTHONPATH"] = os.pathsep.join(paths + [p for p in [os.environ.get("PYTHONPATH")] if p])
    try:
        rows = run_parts(table, names, args, out, out_file, env, start)
    finally:
        if site:
            shutil.rmtree(site, ignore_errors=True)
    ran = [r for r in rows.values() if "exit" in r]
    passed = sum(r["exit"] == 0 for r in ran)
    record = {"benchmark": "gpu_suite", "time": time.strftime("%Y-%m-%dT%H:%M:%S"), "commit": git_commit(),
              "platform": platform.platform(), "smoke": args.smoke, "budget_s": args.budget_s, "parts": rows,
              "wheels": sorted(p.name for p in Path(args.wheels).glob("*.whl")) if args.wheels else []}
    write_record(str(out_file), record)
    print(f"results: {out_file}")
    print(f"gpu_suite_parts_passed: {passed}/{len(ran)}")
    return record


if __name__ == "__main__":
    main()
