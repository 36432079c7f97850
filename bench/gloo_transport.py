"""Gloo transports for a bucket of tensors: one flat broadcast vs a broadcast per tensor vs a send per tensor.

Two processes join one gloo group (the weight sync's own ``init_weight_group``, loopback). Rank 0
moves ``--tensors`` tensors of ``--tensor-mb`` each to rank 1 in three ways, interleaved in one run:

* **flat**: one broadcast of one buffer of all the bytes (the bandwidth ceiling);
* **broadcast**: one broadcast per tensor, all started at once (what SGLang receives); gloo runs
  them one at a time on the group's worker thread;
* **send_recv**: one point-to-point send per tensor (rank 1 posts the matching receives), all
  posted at once (the SGLang stand-in's ``send_recv`` transport, ``rollout_sglang.testing.transport``).

Defaults: 42 tensors of 8.3 MiB, Qwen2.5-0.5B's MLP matrices (896 x 4864, bf16). Best and median
of ``--repeats`` rounds after two warm-up rounds; prints a table, writes
``bench/results/gloo_transport.json`` (``--out``) and ends with ``send_recv_vs_broadcast_speedup:
<best broadcast s / best send_recv s>``. ``--smoke``: 4 tensors of 64 KiB, 2 rounds, in seconds
(checks that every mode runs; the speedup means nothing then).

Usage: ``python bench/gloo_transport.py [--tensors 42] [--tensor-mb 8.3125] [--repeats 12] [--smoke] [--out PATH]``
"""
from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench._common import bench_parser, git_commit, parse_bench_args, run_ranks, write_record  # noqa: E402

MODES = ("flat", "broadcast", "send_recv")


def rank_main(rank: int, world: int, port: int, tensors: int, nbytes: int, repeats: int) -> dict:
    """One rank: join the group, run the interleaved rounds; returns {mode: [seconds]}."""
    from rollout_sglang.weight_update.group import init_weight_group

    group = init_weight_group("127.0.0.1", port, rank, 2, "gloo-transport", "gloo", timeout_s=120)
    parts = [torch.full((nbytes,), rank, dtype=torch.uint8) for _ in range(tensors)]
    flat = torch.full((nbytes * tensors,), rank, dtype=torch.uint8)
    sync = torch.zeros(1)

    def one(mode: str) -> float:
        group.broadcast(sync, src=0, timeout_s=120)  # both ranks start together
        t = time.perf_counter()
        if mode == "flat":
            works = [group.broadcast_async(flat, src=0)]
        elif mode == "broadcast":
            works = [group.broadcast_async(p, src=0) for p in parts]
        elif rank == 0:
            works = [group.send_async(p, 1, i) for i, p in enumerate(parts)]
        else:
            works = [group.recv_async(p, 0, i) for i, p in enumerate(parts)]
        for w in works:
            group.wait(w, 120)
        group.broadcast(sync, src=0, timeout_s=120)  # rank 0 stops once rank 1 has everything
        return time.perf_counter() - t

    times: dict[str, list[float]] = {m: [] for m in MODES}
    for r in range(repeats + 2):
        for i in range(len(MODES)):
            mode = MODES[(r + i) % len(MODES)]
            s = one(mode)
            if r >= 2:
                times[mode].append(s)
    group.close()
    return times


def main(argv: list[str] | None = None) -> dict:
    """Run the benchmark; returns the result dict (also written to bench/results/gloo_transport.json)."""
    ap = bench_parser("gloo_transport", __doc__)
    ap.add_argument("--tensors", type=int, default=42)
    ap.add_argument("--tensor-mb", type=float, default=896 * 4864 * 2 / 2**20, help="MiB per tensor")
    ap.add_argument("--repeats", type=int, default=12)
    # smoke: 4 tensors of 64 KiB, 2 rounds: seconds
    args = parse_bench_args(ap, argv, {"tensors": 4, "tensor_mb": 1 / 16, "repeats": 2})
    nbytes = int(args.tensor_mb * 2**20)
    times = run_ranks(rank_main, 2, (args.tensors, nbytes, args.repeats), 900.0, "gloo transport")[0]
    total = nbytes * args.tensors
    print(f"{args.tensors} tensors of {nbytes / 2**20:.2f} MiB ({total / 1e6:.3g} MB), gloo over loopback, 2 processes")
    print(f"{'mode':<10} {'best ms':>8} {'median ms':>10} {'GB/s best':>10}")
    for m in MODES:
        print(f"{m:<10} {1e3 * min(times[m]):>8.1f} {1e3 * statistics.median(times[m]):>10.1f} "
              f"{total / min(times[m]) / 1e9:>10.2f}")
    speedup = min(times["broadcast"]) / min(times["send_recv"])
    result = {"bench": "gloo_transport", "smoke": args.smoke, "tensors": args.tensors, "tensor_bytes": nbytes,
              "repeats": args.repeats,
              "seconds": times, "gb_per_s_best": {m: total / min(times[m]) / 1e9 for m in MODES},
              "send_recv_vs_broadcast_speedup": speedup, "torch": torch.__version__,
              "commit": git_commit(), "time": time.strftime("%Y-%m-%dT%H:%M:%S")}
    out = write_record(args.out, result)
    print(f"results: {out}")
    print(f"send_recv_vs_broadcast_speedup: {speedup:.3f}")
    return result


if __name__ == "__main__":
    main()
