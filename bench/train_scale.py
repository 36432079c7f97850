#!/usr/bin/env python
"""The large-scale training path on CPU: optimizer state per rank with megatron's distributed optimizer.

A Qwen2-shaped model (``--hidden``, ``--layers``, ``--vocab``; fp32 on CPU, gloo) is trained by
the Megatron actor for ``--steps`` GRPO steps on a fixed random batch, twice in the same run:

* ``dp1``: one process, megatron's optimizer without sharding (every rank would hold all state);
* ``dp2``: two data-parallel processes with ``train.use_distributed_optimizer`` (Adam moments
  and fp32 main weights sharded over the two ranks).

Per layout: the optimizer state bytes on each rank (Adam moments, plus fp32 main weights where
they are copies), the median step time and the final loss. The ratio ``dist_opt_state_ratio_dp2``
is the larger DP=2 rank's state over the DP=1 state (ideal 0.5; megatron pads buckets to a
multiple of the DP size). Prints a table, writes ``bench/results/train_scale.json`` (``--out``),
last line ``dist_opt_state_ratio_dp2: <ratio>``. ``--smoke``: a tiny model, 2 steps.

Usage: ``python bench/train_scale.py [--hidden 512] [--layers 8] [--steps 4] [--smoke] [--out PATH]``
"""
from __future__ import annotations

import multiprocessing as mp
import os
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench._common import bench_parser, git_commit, parse_bench_args, write_record  # noqa: E402


def _state_bytes(actor: Any) -> int:
    """Bytes of optimizer state this rank holds: every tensor of the torch optimizers' state and,
    where the optimizer keeps them apart from the model, its fp32 main weights."""
    total = 0
    model_storage = {p.untyped_storage().data_ptr() for _, p in actor.named_params}
    for opt in actor.optimizer.chained_optimizers:
        for group in opt.optimizer.param_groups:
            for p in group["params"]:
                if p.untyped_storage().data_ptr() not in model_storage:
                    total += p.numel() * p.element_size()  # a main-weight copy (or its shard)
                for k, v in opt.optimizer.state.get(p, {}).items():
                    if k != "step":
                        total += v.numel() * v.element_size()
    return total


def _rank_main(rank: int, world: int, port: int, args: dict, dist_opt: bool, q: Any) -> None:
    os.environ.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": str(rank),
                       "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank), "OMP_NUM_THREADS": "1"})
    try:
        import torch
        from transformers import Qwen2Config

        from megatron_agentrl.config import TrainConfig
        from megatron_agentrl.megatron.actor import MegatronActor, TrainBatch
        from megatron_agentrl.megatron.parallel import destroy_parallel, initialize_parallel

        torch.set_num_threads(1)
        initialize_parallel(1, 1, seed=0)
        h = args["hidden"]
        cfg = Qwen2Config(vocab_size=args["vocab"], hidden_size=h, intermediate_size=3 * h,
                          num_hidden_layers=args["layers"], num_attention_heads=max(1, h // 64),
                          num_key_value_heads=max(1, h // 128), max_position_embeddings=4 * args["seq"],
                          tie_word_embeddings=True)
        actor = MegatronActor(cfg, TrainConfig(lr=1e-4, micro_batch_size=args["micro_batch"],
                                               use_distributed_optimizer=dist_opt))
        g = torch.Generator().manual_seed(1)
        B, T = args["batch"], args["seq"]
        tokens = torch.randint(1, args["vocab"], (B, T), generator=g)
        mask = torch.zeros(B, T)
        mask[:, T // 4:] = 1.0
        batch = TrainBatch(tokens=tokens, loss_mask=mask, behavior_logprobs=-torch.rand(B, T, generator=g) * mask,
                           advantages=torch.randn(B, T, generator=g) * mask)
        times, loss = [], 0.0
        for _ in range(args["steps"]):
            t0 = time.perf_counter()
            loss = actor.train_step(actor.dp_slice(batch))["loss"]
            times.append(time.perf_counter() - t0)
        q.put((rank, {"state_bytes": _state_bytes(actor), "step_s": statistics.median(times), "loss": loss,
                      "params": sum(p.numel() for _, p in actor.named_params),
                      "adam_steps": actor.optimizer_step_count}))
        destroy_parallel()
    except BaseException as e:  # noqa: BLE001 - reported to the parent
        import traceback

        q.put((rank, {"error": f"{e!r}\n{traceback.format_exc()}"}))


def _run(world: int, args: dict, dist_opt: bool, timeout_s: float) -> list[dict]:
    from env_controller.net import free_port

    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_rank_main, args=(r, world, port, args, dist_opt, q), daemon=True)
             for r in range(world)]
    for p in procs:
        p.start()
    out: dict[int, dict] = {}
    try:
        deadline = time.monotonic() + timeout_s
        while len(out) < world:
            rank, rec = q.get(timeout=max(1.0, deadline - time.monotonic()))
            if "error" in rec:
                raise SystemExit(f"rank {rank} of the {'dp2' if world == 2 else 'dp1'} run failed:\n{rec['error']}")
            out[rank] = rec
    finally:
        for p in procs:
            p.join(10)
            if p.is_alive():
                p.kill()
    return [out[r] for r in range(world)]


def main(argv: list[str] | None = None) -> dict:
    """Run both layouts, print the table, write the JSON, print the last line."""
    ap = bench_parser("train_scale", __doc__)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--batch", type=int, default=8, help="rows of the global batch")
    ap.add_argument("--micro-batch", type=int, default=2)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--timeout", type=float, default=1200.0, help="limit on one layout's run, seconds")
    args = parse_bench_args(ap, argv, {"hidden": 64, "layers": 2, "vocab": 512, "seq": 32, "batch": 4, "steps": 2})
    spec = {k: getattr(args, k) for k in ("hidden", "layers", "vocab", "seq", "batch", "micro_batch", "steps")}
    dp1 = _run(1, spec, False, args.timeout)
    dp2 = _run(2, spec, True, args.timeout)
    ratio = max(r["state_bytes"] for r in dp2) / dp1[0]["state_bytes"]
    print(f"model: {dp1[0]['params'] / 1e6:.2f}M params (hidden {args.hidden}, {args.layers} layers, vocab "
          f"{args.vocab}), fp32, batch {args.batch} x {args.seq} tokens, {args.steps} steps, CPU gloo, "
          "1 thread per rank")
    print(f"{'layout':<26} {'opt. state MiB/rank':>20} {'step s (median)':>16} {'final loss':>12}")
    print(f"{'dp1 (not sharded)':<26} {dp1[0]['state_bytes'] / 2**20:>20.2f} {dp1[0]['step_s']:>16.3f} "
          f"{dp1[0]['loss']:>12.5f}")
    for r, rec in enumerate(dp2):
        print(f"{f'dp2 rank {r} (distributed)':<26} {rec['state_bytes'] / 2**20:>20.2f} {rec['step_s']:>16.3f} "
              f"{rec['loss']:>12.5f}")
    record = {"bench": "train_scale", "smoke": args.smoke, "spec": spec, "dp1": dp1[0], "dp2": dp2,
              "dist_opt_state_ratio_dp2": ratio, "commit": git_commit(), "machine": platform.machine(),
              "cpus": os.cpu_count(), "time": time.strftime("%Y-%m-%dT%H:%M:%S")}
    out = write_record(args.out, record)
    print(f"results: {out}")
    print(f"dist_opt_state_ratio_dp2: {ratio:.3f}")
    return record


if __name__ == "__main__":
    main()
