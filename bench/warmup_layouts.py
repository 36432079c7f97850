#!/usr/bin/env python
"""Does a seed fix the warm-up? The demo's first warm-up steps under several heap layouts, bit for bit.

Runs ``agentrl train --config examples/configs/tiny_cpu.yaml`` (the command behind ``make demo``, seed and thread
count unchanged) once per heap layout: glibc's defaults, and glibc told to pad its heap or to map its large blocks
apart (``MALLOC_TOP_PAD_`` / ``MALLOC_MMAP_THRESHOLD_``), which moves where tensors land in memory and nothing else.
Each run stops after ``--steps`` warm-up steps (its ``metrics.jsonl`` read as it grows). The CPU math library (MKL)
may round a product differently by where its operands lie: runs of one seed once split into two warm-ups that way
(docs/training.md). Every layout runs with MKL's strict reproducible mode (``MKL_CBWR=AUTO,STRICT``, independent of
memory alignment; what ``agentrl train`` sets unless ``MKL_CBWR`` is set) and, with ``--mode both``, also with MKL's
own default (``MKL_CBWR`` set empty, which ``agentrl train`` keeps and MKL ignores).

Prints, per mode, each layout's step-by-step agreement with the first; writes ``bench/results/warmup_layouts.json``
(``--out``); the last line is ``warmup_layout_divergent_runs: <runs in the strict mode whose losses differ from
the first layout's>``. ``--smoke``: 3 steps, two layouts, the strict mode, seconds.
"""
from __future__ import annotations

import json
import os
import signal
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench._common import bench_parser, git_commit, parse_bench_args, write_record  # noqa: E402
from env_controller.servers.process import start_process, stop_process  # noqa: E402

#: name -> the environment that sets the heap's layout (glibc's tunables, read when a process starts)
LAYOUTS = {
    "default": {},
    "padded": {"MALLOC_TOP_PAD_": "12345", "MALLOC_MMAP_THRESHOLD_": "100000000"},
    "mmap": {"MALLOC_MMAP_THRESHOLD_": "4096"},
}
#: MKL_CBWR per mode (empty: MKL's own default, which agentrl train keeps)
MODES = {"strict": "AUTO,STRICT", "default": ""}
SMOKE = {"steps": 3, "layouts": "default,padded", "mode": "strict"}


def warm_up_losses(out: Path, steps: int, env: dict[str, str], timeout_s: float) -> list[float]:
    """The first ``steps`` warm-up losses of the demo config in a process with ``env`` added; stops it then."""
    cmd = [sys.executable, "-m", "megatron_agentrl.cli", "train", "--config", "examples/configs/tiny_cpu.yaml",
           f"output_dir={out}"]
    log_path = out.with_suffix(".log")
    proc = start_process(cmd, log_path, env={**os.environ, **env}, cwd=ROOT)
    metrics, losses = out / "metrics.jsonl", []
    deadline = time.monotonic() + timeout_s
    try:
        while len(losses) < steps:
            if time.monotonic() > deadline:
                raise RuntimeError(f"{steps} warm-up steps did not come within {timeout_s:g} s (log: {log_path})")
            if proc.poll() is not None:
                raise RuntimeError(f"the run ended with status {proc.returncode} before {steps} warm-up steps "
                                   f"(log: {log_path})")
            if metrics.exists():
                rows = [json.loads(line) for line in metrics.read_text().splitlines() if line.endswith("}")]
                losses = [r["loss"] for r in rows if r.get("phase") == "sft"]
            time.sleep(0.5)
    finally:
        stop_process(proc, grace_s=0.0, first_signal=signal.SIGKILL)
    return losses[:steps]


def first_difference(a: list[float], b: list[float]) -> int | None:
    """The first step (1-based) where two loss lists differ, None when equal."""
    return next((i + 1 for i, (x, y) in enumerate(zip(a, b)) if x != y), None)


def main(argv: list[str] | None = None) -> int:
    parser = bench_parser("warmup_layouts", __doc__)
    parser.add_argument("--steps", type=int, default=100, help="warm-up steps compared")
    parser.add_argument("--layouts", default=",".join(LAYOUTS), help=f"heap layouts, of {','.join(LAYOUTS)}")
    parser.add_argument("--mode", choices=("strict", "both"), default="both",
                        help="strict: MKL_CBWR=AUTO,STRICT (agentrl train's default); both: also MKL's own default")
    parser.add_argument("--timeout-s", type=float, default=900.0, help="per run")
    args = parse_bench_args(parser, argv, SMOKE)
    layouts = [x for x in args.layouts.split(",") if x]
    unknown = sorted(set(layouts) - set(LAYOUTS))
    if len(layouts) < 2 or unknown:
        parser.error(f"--layouts {args.layouts!r}: give two or more of {','.join(LAYOUTS)}")
    if args.steps < 2:
        parser.error(f"--steps {args.steps}: give 2 or more (the first step comes before any update)")
    modes = ["strict"] if args.mode == "strict" else ["strict", "default"]
    result: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="agentrl-warmup-layouts-") as tmp:
        for mode in modes:
            runs = {}
            for layout in layouts:
                env = {**LAYOUTS[layout], "MKL_CBWR": MODES[mode]}
                out = Path(tmp) / f"{mode}-{layout}"
                t0 = time.monotonic()
                losses = warm_up_losses(out, args.steps, env, args.timeout_s)
                runs[layout] = {"losses": losses, "wall_s": round(time.monotonic() - t0, 1)}
            first = runs[layouts[0]]["losses"]
            for layout in layouts:
                runs[layout]["first_difference_step"] = first_difference(first, runs[layout]["losses"])
            result[mode] = runs
    divergent = sum(1 for r in result["strict"].values() if r["first_difference_step"] is not None)
    out = write_record(args.out, {"bench": "warmup_layouts", "commit": git_commit(), "config": vars(args),
                                  "cpus": os.cpu_count(), "results": result})
    for mode, runs in result.items():
        print(f"\n{'MKL_CBWR=AUTO,STRICT' if mode == 'strict' else 'MKL default'}: {args.steps} warm-up steps")
        for layout, r in runs.items():
            d = r["first_difference_step"]
            print(f"  {layout:<8} loss at step {len(r['losses'])} {r['losses'][-1]!r}  "
                  f"{'equal to ' + layouts[0] if d is None else f'differs from {layouts[0]} from step {d}'}")
    print(f"results: {out}")
    print(f"warmup_layout_divergent_runs: {divergent}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
