#!/usr/bin/env python
"""Per-task advantage normalization on one device: the vectorized implementation vs an unfused loop,
as a fraction of the bandwidth of a device-to-device copy measured in the same run.

For each size N (tokens, ``--tokens``, e.g. ``1e6,1e7,1e8``) the input is ``B = N / T`` rows of
``T = --seq-len`` tokens: float32 advantages ``[B, T]`` (a per-sample value plus token noise), a
float32 loss mask (a prompt prefix and a ragged tail masked out, about 60 % of the tokens count),
and a task id per row drawn from ``--tasks`` tasks. Timed variants (each the median of
``--repeats`` runs after ``--warmup``, with device synchronization around each run):

* ``fused``: ``megatron_agentrl.algo.advantages.normalize_per_task`` (``num_tasks`` given, so no
  host sync), the library path;
* ``fused_compiled`` (``--compile``): the same function through ``torch.compile`` (Inductor may
  merge the elementwise and reduction kernels), measured side by side;
* ``previous``: a one-pass float64 variant (count, sum and sum of squares in three row
  reductions, variance as E[a^2] - mean^2), beside the library's two-pass statistics, unless
  ``--no-previous``;
* ``unfused``: what a user would write: a Python loop over the tasks present (``unique`` syncs),
  boolean-mask indexing, masked mean / std per task, writes per task;
* ``copy``: ``dst.copy_(src)`` of a float32 buffer of ``S`` bytes, where ``2 S`` equals the minimal
  traffic below, so that a copy and a perfect normalization move the same number of bytes.

Minimal traffic of the algorithm (stated, not measured): the statistics depend on every token
before any output can be written, so at least two passes: pass 1 reads A and mask (8 B/token),
pass 2 reads A and mask again and writes the output (12 B/token): ``20 B/token`` for float32 inputs
(``--mask-dtype float32``; 14 B/token with a 1-byte bool/uint8 mask is not what the trainer passes).
Effective bandwidth of a variant = minimal bytes / its time; ``fraction = bandwidth / copy
bandwidth`` (equivalently ``t_copy / t_variant``). A variant that moves more bytes than the minimum,
or pays launch and sync latency, gets a lower fraction.

Correctness is checked too: every variant's output must equal the unfused reference within
``1e-4`` (float32) on the smallest size; a mismatch aborts the run.

Prints a table, writes ``bench/results/gpu_advantages.json`` (``--out``) and ends with
``fused_norm_copy_bw_fraction_<size>: <fraction>`` for the largest size measured (``100m`` for
1e8 tokens). ``--smoke``: CPU, 2e4 and 1e5 tokens in rows of 500, 2 repeats, in seconds (CPU
figures say nothing about a GPU).

Usage: ``python bench/gpu_advantages.py [--device cuda] [--tokens 1e6,1e7,1e8] [--compile] [--smoke] [--out PATH]``
"""
from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench._common import bench_parser, git_commit, parse_bench_args, write_record  # noqa: E402
from megatron_agentrl.algo.advantages import normalize_per_task, segment_sum  # noqa: E402

MIN_BYTES_PER_TOKEN_FP32 = 20  # pass 1: read A, mask (4 + 4); pass 2: read A, mask, write out (4 + 4 + 4)
SMOKE = {"device": "cpu", "tokens": "2e4,1e5", "seq_len": 500, "warmup": 1, "repeats": 2}


def size_label(n: int) -> str:
    """``1000000 -> "1m"``, ``100000000 -> "100m"``, ``123456 -> "123456"``."""
    for unit, div in (("g", 10**9), ("m", 10**6), ("k", 10**3)):
        if n % div == 0 and n >= div:
            return f"{n // div}{unit}"
    return str(n)


def make_inputs(tokens: int, seq_len: int, tasks: int, device: torch.device,
                seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Random ``(advantages [rows, row_len] fp32, mask [rows, row_len] fp32, task_ids [rows] long)`` with
    ``rows * row_len >= tokens`` (``row_len``: ``seq_len``, or fewer when ``tokens`` is smaller)."""
    row_len = min(seq_len, tokens)
    rows = max(1, -(-tokens // row_len))
    g = torch.Generator(device=device)
    g.manual_seed(seed)
    adv = (torch.randn(rows, 1, device=device, generator=g)
           + 0.25 * torch.randn(rows, row_len, device=device, generator=g))
    pos = torch.arange(row_len, device=device).unsqueeze(0)
    start = torch.randint(0, max(1, row_len // 5), (rows, 1), device=device, generator=g)
    end = torch.randint(max(1, row_len // 2), row_len + 1, (rows, 1), device=device, generator=g)
    mask = ((pos >= start) & (pos < end)).float()
    task_ids = torch.randint(0, tasks, (rows,), device=device, generator=g)
    return adv, mask, task_ids


def unfused_normalize(adv: torch.Tensor, mask: torch.Tensor, task_ids: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """The straightforward version: a Python loop over the tasks present, masked mean / std per task."""
    out = torch.zeros_like(adv)
    for k in task_ids.unique().tolist():
        rows = task_ids == k
        a, m = adv[rows], mask[rows]
        vals = a[m > 0]
        if vals.numel() == 0:
            continue
        mean, std = vals.mean(), vals.std(unbiased=False)
        out[rows] = (a - mean) / (std + eps) * m
    return out


def previous_normalize(advantages: torch.Tensor, mask: torch.Tensor, task_ids: torch.Tensor, eps: float = 1e-6,
                       num_tasks: int | None = None) -> torch.Tensor:
    """One-pass float64 per-task normalization (no process group), for the side-by-side figure."""
    task_ids = task_ids.to(device=advantages.device, dtype=torch.long)
    if num_tasks is None:
        num_tasks = int(task_ids.max().item()) + 1
    m = mask.to(torch.float64)
    a = advantages.to(torch.float64) * m
    per_sample = torch.stack([m.sum(1), a.sum(1), (a * a).sum(1)], dim=1)
    stats = segment_sum(per_sample, task_ids, num_tasks).T.contiguous()
    count = stats[0].clamp_min(1.0)
    mean = stats[1] / count
    std = (stats[2] / count - mean * mean).clamp_min(0.0).sqrt()
    mean_t = mean[task_ids].unsqueeze(1).to(advantages.dtype)
    std_t = std[task_ids].unsqueeze(1).to(advantages.dtype)
    return (advantages - mean_t) / (std_t + eps) * mask.to(advantages.dtype)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_fn(fn: Callable[[], object], device: torch.device, warmup: int, repeats: int) -> list[float]:
    """Seconds of each of ``repeats`` calls of ``fn`` (after ``warmup`` untimed calls), synchronized."""
    for _ in range(warmup):
        fn()
    _sync(device)
    times = []
    for _ in range(repeats):
        _sync(device)
        t0 = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - t0)
    return times


def time_copy(nbytes: int, device: torch.device, warmup: int, repeats: int) -> list[float]:
    """Seconds of each ``dst.copy_(src)`` of a float32 buffer of ``nbytes / 2`` bytes (``nbytes`` moved)."""
    src = torch.empty(nbytes // 8, dtype=torch.float32, device=device).normal_()
    dst = torch.empty_like(src)
    return time_fn(lambda: dst.copy_(src), device, warmup, repeats)


def check_against_loop(variants: dict[str, Callable[[], torch.Tensor]], reference: torch.Tensor, label: str,
                       row: dict) -> None:
    """Record each variant's largest difference from the unfused loop in ``row``; abort on one >= 1e-4."""
    for name, fn in variants.items():
        err = float((fn() - reference).abs().max())
        row[f"max_abs_err_{name}"] = err
        if not err < 1e-4:
            raise SystemExit(f"{name} differs from the unfused reference by {err:.3g} at {label} tokens")


def measure_size(n: int, args: argparse.Namespace, device: torch.device, compiled: Callable | None,
                 check: bool) -> dict:
    """Time the copy and every variant on ``n`` tokens; ``check``: first compare each with the loop."""
    label = size_label(n)
    row: dict = {"tokens_requested": n}
    try:
        adv, mask, tids = make_inputs(n, args.seq_len, args.tasks, device)
    except torch.OutOfMemoryError as e:
        return {**row, "skipped": f"out of memory building the inputs: {str(e).splitlines()[0]}"}
    rows, row_len = adv.shape
    tokens = rows * row_len
    min_bytes = MIN_BYTES_PER_TOKEN_FP32 * tokens
    row.update(tokens=tokens, rows=rows, seq_len=row_len, masked_frac=float(mask.mean()), min_bytes=min_bytes)
    num_tasks = args.tasks
    variants: dict[str, Callable[[], torch.Tensor]] = {
        "fused": lambda: normalize_per_task(adv, mask, tids, num_tasks=num_tasks),
    }
    if compiled is not None:
        variants["fused_compiled"] = lambda: compiled(adv, mask, tids, num_tasks=num_tasks)
    if not args.no_previous:
        variants["previous"] = lambda: previous_normalize(adv, mask, tids, num_tasks=num_tasks)
    if tokens <= args.unfused_max_tokens:
        variants["unfused"] = lambda: unfused_normalize(adv, mask, tids)
    if check:
        check_against_loop(variants, unfused_normalize(adv, mask, tids), label, row)
    timings = {"copy": time_copy(min_bytes, device, args.warmup, args.repeats)}
    for name, fn in variants.items():
        try:
            timings[name] = time_fn(fn, device, args.warmup, args.repeats)
        except torch.OutOfMemoryError as e:
            row[f"{name}_skipped"] = f"out of memory: {str(e).splitlines()[0]}"
        if device.type == "cuda":
            torch.cuda.empty_cache()
    t_copy = statistics.median(timings["copy"])
    row["copy_gb_s"] = min_bytes / t_copy / 1e9
    for name, ts in timings.items():
        t = statistics.median(ts)
        row[f"{name}_ms"] = t * 1e3
        row[f"{name}_ms_min"] = min(ts) * 1e3
        row[f"{name}_gb_s"] = min_bytes / t / 1e9
        row[f"{name}_copy_fraction"] = t_copy / t
    return row


def _device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    cpu = platform.processor() or platform.machine()
    return f"cpu ({cpu}, {os.cpu_count()} cores, {torch.get_num_threads()} threads)"


def parse_tokens(text: str) -> list[int]:
    """``"1e6,1e7"`` -> ``[1000000, 10000000]``."""
    out = [int(float(x)) for x in text.split(",") if x.strip()]
    if not out or min(out) < 1:
        raise SystemExit(f"--tokens {text!r}: give positive token counts, e.g. 1e6,1e7,1e8")
    return out


def main(argv: list[str] | None = None) -> dict:
    ap = bench_parser("gpu_advantages", __doc__)
    ap.add_argument("--device", default="cuda", help="cuda (default), cuda:N or cpu")
    ap.add_argument("--tokens", default="1e6,1e7,1e8", help="comma-separated token counts (B*T)")
    ap.add_argument("--seq-len", type=int, default=4096, help="T, tokens per row")
    ap.add_argument("--tasks", type=int, default=5, help="number of tasks (task ids drawn uniformly)")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--compile", action="store_true", help="also time torch.compile(normalize_per_task)")
    ap.add_argument("--no-previous", action="store_true", help="skip the one-pass float64 variant")
    ap.add_argument("--unfused-max-tokens", type=float, default=1e8,
                    help="skip the unfused loop above this many tokens (it needs several times the memory)")
    args = parse_bench_args(ap, argv, SMOKE)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit(f"--device {args.device}: CUDA is not available here; use --device cpu, or --smoke")
    sizes = parse_tokens(args.tokens)

    compiled = torch.compile(normalize_per_task) if args.compile else None
    results: dict[str, dict] = {}
    for i, n in enumerate(sorted(sizes)):
        results[size_label(n)] = measure_size(n, args, device, compiled, check=i == 0)
        if device.type == "cuda":
            torch.cuda.empty_cache()

    names = ["copy", "fused", "fused_compiled", "previous", "unfused"]
    print(f"device: {_device_name(device)} | minimal traffic {MIN_BYTES_PER_TOKEN_FP32} B/token (fp32 A and mask)")
    print(f"{'tokens':>8} {'variant':>15} {'median ms':>11} {'GB/s (min bytes)':>17} {'x copy bw':>10}")
    for label, row in results.items():
        if "skipped" in row:
            print(f"{label:>8} skipped: {row['skipped']}")
            continue
        for name in names:
            if f"{name}_ms" in row:
                print(f"{label:>8} {name:>15} {row[name + '_ms']:>11.3f} {row[name + '_gb_s']:>17.1f} "
                      f"{row[name + '_copy_fraction']:>10.3f}")
            elif f"{name}_skipped" in row:
                print(f"{label:>8} {name:>15} skipped: {row[name + '_skipped']}")
    measured = [lab for lab, r in results.items() if "fused_copy_fraction" in r]
    record = {
        "benchmark": "gpu_advantages", "time": time.strftime("%Y-%m-%dT%H:%M:%S"), "commit": git_commit(),
        "device": _device_name(device), "torch": torch.__version__, "args": vars(args),
        "min_bytes_per_token": MIN_BYTES_PER_TOKEN_FP32, "results": results,
    }
    write_record(args.out, record)
    print(f"results: {args.out}")
    if not measured:
        print("fused_norm_copy_bw_fraction: nan")
        return record
    last = measured[-1]
    print(f"fused_norm_copy_bw_fraction_{last}: {results[last]['fused_copy_fraction']:.3f}")
    return record


if __name__ == "__main__":
    main()
