"""Gloo transports for a bucket of tensors: one flat broadcast vs a broadcast per tensor vs a send per tensor.

Two processes join one gloo group (the weight sync's own ``init_weight_group``, loopback). Rank 0
moves ``--tensors`` tensors of ``--tensor-mb`` each to rank 1 in three ways, interleaved in one run:

* **flat**: one broadcast of one buffer of all the bytes (the bandwidth ceiling);
* **broadcast**: one broadcast per tensor, all started at once (what SGLang receives); gloo runs
  them one at a time on the group's worker thread;
* **send_recv**: one point-to-point send per tensor (rank 1 posts the matching receives), all
  posted at once (the SGLang stand-in's ``send_recv`` transport, ``rollout_sglang.testing.transport``).

Defaults: 42 tensors of 8.3 MiB, Qwen2.5-0.5B's MLP matrices (896 x 4864, bf16). ``--model``: instead,
the wire tensors of a whole Qwen2.5-0.5B sync (the model of ``bench/weight_sync.py``): every tensor
of at least ``--small-mb`` MiB (default: SGLang's transport's threshold) as it is, the smaller ones as
one packed tensor, so that ``broadcast`` / ``flat`` is the ceiling gloo itself sets for SGLang's
one-broadcast-per-tensor transport on that model, with no HTTP request, engine or load around it.
Best and median of ``--repeats`` rounds after two warm-up rounds, and the median of the per-round
ratios flat s / mode s; prints a table, writes ``bench/results/gloo_transport.json`` (``--out``) and
ends with ``send_recv_vs_broadcast_speedup: <best broadcast s / best send_recv s>``. ``--smoke``:
``--model`` on the tiny layout of ``bench/weight_sync.py --smoke`` (2 layers, hidden 64; tensors under
16 KiB packed), 2 rounds, in seconds (checks that every mode runs; the figures mean nothing then).

Usage: ``python bench/gloo_transport.py [--tensors 42] [--tensor-mb 8.3125] [--model [--small-mb M]] [--repeats 12]
[--smoke] [--out PATH]``
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


def model_wire_sizes(small_bytes: int, smoke: bool) -> list[int]:
    """Bytes of each wire tensor of a Qwen2.5-0.5B sync (bf16, tied embedding sent once), as the weight
    sync's own planner splits them in one bucket: the tensors of at least ``small_bytes`` apart, then one
    packed tensor of all smaller ones."""
    from transformers import Qwen2ForCausalLM

    from bench.weight_sync import qwen25_05b_config
    from rollout_sglang.weight_update.buckets import iter_split_buckets

    with torch.device("meta"):
        model = Qwen2ForCausalLM(qwen25_05b_config(2 if smoke else 24, smoke)).to(torch.bfloat16)
    named = ((n, t) for n, t in model.state_dict().items() if n != "lm_head.weight")
    sizes: list[int] = []
    for meta, tensors, packed in iter_split_buckets(named, 1 << 60, small_bytes):
        sizes += [meta.nbytes] if packed else [t.numel() * t.element_size() for t in tensors]
    return sizes


def rank_main(rank: int, world: int, port: int, sizes: list[int], repeats: int) -> dict:
    """One rank: join the group, run the interleaved rounds; returns {mode: [seconds]}."""
    from rollout_sglang.weight_update.group import init_weight_group

    group = init_weight_group("127.0.0.1", port, rank, 2, "gloo-transport", "gloo", timeout_s=120)
    parts = [torch.full((n,), rank, dtype=torch.uint8) for n in sizes]
    flat = torch.full((sum(sizes),), rank, dtype=torch.uint8)
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
    ap.add_argument("--model", action="store_true", help="the wire tensors of a Qwen2.5-0.5B sync instead")
    ap.add_argument("--small-mb", type=float, default=None,
                    help="with --model: tensors under this many MiB travel packed (default: SGLang's transport's)")
    ap.add_argument("--repeats", type=int, default=12)
    # smoke: the tiny model's layout (its matrices above 16 KiB apart), 2 rounds: seconds
    args = parse_bench_args(ap, argv, {"model": True, "small_mb": 1 / 64, "repeats": 2})
    if args.small_mb is not None and not args.model:
        ap.error("--small-mb applies to --model only")
    if args.model:
        from rollout_sglang.weight_update.transport import SGLangBroadcast

        small = SGLangBroadcast().small_tensor_bytes if args.small_mb is None else int(args.small_mb * 2**20)
        sizes = model_wire_sizes(small, args.smoke)
        what = (f"Qwen2.5-0.5B's wire tensors{' (smoke layout)' if args.smoke else ''}: {len(sizes)} tensors, "
                f"those under {small / 2**20:g} MiB packed")
    else:
        sizes = [int(args.tensor_mb * 2**20)] * args.tensors
        what = f"{args.tensors} tensors of {sizes[0] / 2**20:.2f} MiB"
    times = run_ranks(rank_main, 2, (sizes, args.repeats), 900.0, "gloo transport")[0]
    total = sum(sizes)
    ratios = {m: statistics.median(f / t for f, t in zip(times["flat"], times[m])) for m in MODES if m != "flat"}
    print(f"{what} ({total / 1e6:.4g} MB), gloo over loopback, 2 processes")
    print(f"{'mode':<10} {'best ms':>8} {'median ms':>10} {'GB/s best':>10} {'flat/mode':>10}")
    for m in MODES:
        ratio = f"{ratios[m]:>10.3f}" if m in ratios else f"{'':>10}"
        print(f"{m:<10} {1e3 * min(times[m]):>8.1f} {1e3 * statistics.median(times[m]):>10.1f} "
              f"{total / min(times[m]) / 1e9:>10.2f} {ratio}")
    print("flat/mode: median of the per-round ratios")
    speedup = min(times["broadcast"]) / min(times["send_recv"])
    result = {"bench": "gloo_transport", "smoke": args.smoke, "model": args.model, "tensors": len(sizes),
              "tensor_bytes": sizes, "repeats": args.repeats,
              "seconds": times, "gb_per_s_best": {m: total / min(times[m]) / 1e9 for m in MODES},
              "median_round_ratio_to_flat": ratios,
              "send_recv_vs_broadcast_speedup": speedup, "torch": torch.__version__,
              "commit": git_commit(), "time": time.strftime("%Y-%m-%dT%H:%M:%S")}
    out = write_record(args.out, result)
    print(f"results: {out}")
    print(f"send_recv_vs_broadcast_speedup: {speedup:.3f}")
    return result


if __name__ == "__main__":
    main()
