#!/usr/bin/env python
"""The large-scale training path on CPU: the distributed optimizer's state per rank, and sequence packing.

Part 1, ``dist_opt``: a Qwen2-shaped model (``--hidden``, ``--layers``, ``--vocab``; fp32 on CPU, gloo)
is trained by the Megatron actor for ``--steps`` GRPO steps on a fixed random batch, twice in the
same run:

* ``dp1``: one process, megatron's optimizer without sharding (every rank would hold all state);
* ``dp2``: two data-parallel processes with ``train.use_distributed_optimizer`` (Adam moments
  and fp32 main weights sharded over the two ranks).

Per layout: the optimizer state bytes on each rank (Adam moments, plus fp32 main weights where
they are copies), the median step time and the final loss. The ratio ``dist_opt_state_ratio_dp2``
is the larger DP=2 rank's state over the DP=1 state (ideal 0.5; megatron pads buckets to a
multiple of the DP size).

Part 2, ``packing``: the CPU demo's policy shape (``--pack-hidden``, ``--pack-layers``, the demo
tokenizer's vocabulary) trains on a batch of ``--pack-batch`` trajectories whose lengths follow the
demo's multi-turn spread: the built-in tasks' demonstrations (lookup, calc twice as often, guess;
expert and careless players alike) rendered in the full chat format by the demo's tokenizer.
Steps alternate between micro-batch layouts in one process: right-padded rows vs packed (THD)
sequences, with ``--micro-batch`` samples per micro-batch and with a ``--pack-budget`` token budget.
Per layout: trained tokens/s (policy-relevant tokens, median step), the padding fraction (computed
tokens that are padding) and the micro-batches per step. ``packing_speedup`` is the packed layout's
tokens/s over the padded one's at ``--micro-batch`` samples (the switch ``train.sequence_packing``
flips in the demo's config).

Prints both tables, writes ``bench/results/train_scale.json`` (``--out``); the last two lines are
``dist_opt_state_ratio_dp2: <ratio>`` and ``packing_speedup: <ratio>``. ``--smoke``: tiny sizes, 2 steps.

Usage: ``python bench/train_scale.py [--hidden 512] [--layers 8] [--steps 4] [--pack-steps 5] [--smoke]``
"""
from __future__ import annotations

import os
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench._common import bench_parser, git_commit, parse_bench_args, run_ranks, write_record  # noqa: E402


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


def _qwen2(vocab: int, hidden: int, layers: int, head_dim: int, max_pos: int) -> Any:
    """A tied-embedding Qwen2 config with ``head_dim``-wide heads and two query heads per KV head."""
    from transformers import Qwen2Config

    return Qwen2Config(vocab_size=vocab, hidden_size=hidden, intermediate_size=3 * hidden, num_hidden_layers=layers,
                       num_attention_heads=max(1, hidden // head_dim),
                       num_key_value_heads=max(1, hidden // (2 * head_dim)),
                       max_position_embeddings=max_pos, tie_word_embeddings=True)


def _dist_opt_rank(args: dict, dist_opt: bool) -> dict:
    """One rank of the ``dist_opt`` part: train ``args["steps"]`` steps, report state bytes and times."""
    import torch

    from megatron_agentrl.config import TrainConfig
    from megatron_agentrl.megatron.actor import MegatronActor, TrainBatch

    h = args["hidden"]
    cfg = _qwen2(args["vocab"], h, args["layers"], 64, 4 * args["seq"])
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
    return {"state_bytes": _state_bytes(actor), "step_s": statistics.median(times), "loss": loss,
            "params": sum(p.numel() for _, p in actor.named_params), "adam_steps": actor.optimizer_step_count}


def demo_length_batch(n: int, seed: int = 0) -> tuple[list[list[int]], list[list[int]]]:
    """``n`` demonstrations of the demo's tasks (lookup : calc : guess = 1 : 2 : 1, expert or careless
    player at random) as ``(token_ids, loss_mask)`` lists, in the full chat format of RL."""
    import random

    from env_controller.tasks import build_task
    from rollout_sglang.chat_template import build_chat_template
    from rollout_sglang.tokenizer import load_tokenizer

    tok = load_tokenizer(REPO / "examples" / "tokenizer" / "tiny_agent")
    template = build_chat_template("qwen2", tok)
    tasks = {name: build_task(name) for name in ("lookup", "calc", "guess")}
    rng = random.Random(seed)
    ids, masks = [], []
    while len(ids) < n:
        task = tasks[rng.choices(list(tasks), weights=[1, 2, 1])[0]]
        index = rng.randrange(512)
        demo = task.careless_demonstration(index) if rng.random() < 0.5 else None
        t, m = template.encode_conversation(*(demo or task.demonstration(index)))
        ids.append(t)
        masks.append(m)
    return ids, masks


def _packing_rank(args: dict) -> dict:
    """The ``packing`` part: one process, steps alternating between the micro-batch layouts."""
    import torch

    from megatron_agentrl.config import TrainConfig
    from megatron_agentrl.megatron.actor import MegatronActor, TrainBatch
    from megatron_agentrl.megatron.packing import effective_lengths, plan_micro_batches

    ids, masks = demo_length_batch(args["pack_batch"])
    if args["pack_max_len"]:
        ids, masks = [t[: args["pack_max_len"]] for t in ids], [m[: args["pack_max_len"]] for m in masks]
    B, T = len(ids), max(len(t) for t in ids)
    tokens = torch.zeros(B, T, dtype=torch.long)
    mask = torch.zeros(B, T)
    for i, (t, m) in enumerate(zip(ids, masks)):
        tokens[i, : len(t)] = torch.tensor(t)
        mask[i, : len(m)] = torch.tensor(m, dtype=torch.float)
    g = torch.Generator().manual_seed(2)
    batch = TrainBatch(tokens=tokens, loss_mask=mask, behavior_logprobs=-torch.rand(B, T, generator=g) * mask,
                       advantages=torch.randn(B, T, generator=g) * mask)
    from rollout_sglang.tokenizer import load_tokenizer

    vocab = len(load_tokenizer(REPO / "examples" / "tokenizer" / "tiny_agent"))
    cfg = _qwen2(vocab, args["pack_hidden"], args["pack_layers"], 32, 4096)  # the demo's 4 heads of 32
    mbs, budget = args["micro_batch_pack"], args["pack_budget"]
    layouts = {"padded": (False, 0), "packed": (True, 0), "padded_budget": (False, budget),
               "packed_budget": (True, budget)}
    tcfg = TrainConfig(lr=1e-4, micro_batch_size=mbs)
    actor = MegatronActor(cfg, tcfg)
    lengths = effective_lengths(mask).tolist()
    trained = sum(lengths)
    out: dict[str, dict] = {}
    times: dict[str, list[float]] = {k: [] for k in layouts}
    for step in range(args["pack_steps"] + 1):  # the first round warms up
        for name, (packed, tokens_budget) in layouts.items():
            tcfg.sequence_packing, tcfg.micro_batch_tokens = packed, tokens_budget
            t0 = time.perf_counter()
            actor.train_step(batch)
            if step:
                times[name].append(time.perf_counter() - t0)
    for name, (packed, tokens_budget) in layouts.items():
        plan = plan_micro_batches(lengths, mbs, tokens_budget, packed=packed)
        computed = sum(sum(lengths[i] for i in ix) if packed else len(ix) * max(lengths[i] for i in ix)
                       for ix in plan)
        step_s = statistics.median(times[name])
        out[name] = {"step_s": step_s, "tokens_per_s": trained / step_s, "micro_batches": len(plan),
                     "pad_fraction": 1 - trained / computed, "computed_tokens": computed}
    return {"layouts": out, "trained_tokens": trained, "lengths": {"min": min(lengths), "max": max(lengths),
            "mean": trained / len(lengths)}, "params": sum(p.numel() for _, p in actor.named_params)}


def _rank_main(rank: int, world: int, port: int, job: str, args: dict, dist_opt: bool) -> dict:
    """One rank of a part (``job``: "dist_opt" or "packing"), one thread."""
    os.environ.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": str(rank),
                        "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank), "OMP_NUM_THREADS": "1"})
    import torch

    from megatron_agentrl.megatron.parallel import destroy_parallel, initialize_parallel

    torch.set_num_threads(1)
    initialize_parallel(1, 1, seed=0)
    result = _packing_rank(args) if job == "packing" else _dist_opt_rank(args, dist_opt)
    destroy_parallel()
    return result


def _run(world: int, job: str, args: dict, dist_opt: bool, timeout_s: float) -> list[dict]:
    return run_ranks(_rank_main, world, (job, args, dist_opt), timeout_s, job)


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
    ap.add_argument("--pack-hidden", type=int, default=128, help="packing part: hidden size (the demo's)")
    ap.add_argument("--pack-layers", type=int, default=4, help="packing part: layers (the demo's)")
    ap.add_argument("--pack-batch", type=int, default=48, help="packing part: trajectories per step (the demo's)")
    ap.add_argument("--micro-batch-pack", type=int, default=16, help="packing part: samples per micro-batch")
    ap.add_argument("--pack-budget", type=int, default=4096, help="packing part: micro_batch_tokens of the "
                    "budget layouts")
    ap.add_argument("--pack-steps", type=int, default=5, help="packing part: timed steps per layout")
    ap.add_argument("--pack-max-len", type=int, default=0, help="packing part: cut trajectories to this many "
                    "tokens (0 = keep)")
    ap.add_argument("--timeout", type=float, default=1200.0, help="limit on one part's run, seconds")
    args = parse_bench_args(ap, argv, {"hidden": 64, "layers": 2, "vocab": 512, "seq": 32, "batch": 4, "steps": 2,
                                       "pack_hidden": 32, "pack_layers": 1, "pack_batch": 8, "micro_batch_pack": 4,
                                       "pack_budget": 800, "pack_steps": 1, "pack_max_len": 200})
    spec = {k: getattr(args, k) for k in ("hidden", "layers", "vocab", "seq", "batch", "micro_batch", "steps",
                                          "pack_hidden", "pack_layers", "pack_batch", "micro_batch_pack",
                                          "pack_budget", "pack_steps", "pack_max_len")}
    dp1 = _run(1, "dist_opt", spec, False, args.timeout)
    dp2 = _run(2, "dist_opt", spec, True, args.timeout)
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

    pk = _run(1, "packing", spec, False, args.timeout)[0]
    lay = pk["layouts"]
    speedup = lay["packed"]["tokens_per_s"] / lay["padded"]["tokens_per_s"]
    ln = pk["lengths"]
    print(f"\npacking: {pk['params'] / 1e6:.2f}M params (hidden {args.pack_hidden}, {args.pack_layers} layers), "
          f"{args.pack_batch} demo trajectories of {ln['min']}-{ln['max']} tokens (mean {ln['mean']:.0f}), "
          f"{args.pack_steps} timed steps per layout, 1 thread")
    print(f"{'layout':<34} {'trained tok/s':>14} {'step s':>8} {'padding':>8} {'micro-batches':>14}")
    names = {"padded": f"padded, {args.micro_batch_pack} rows", "packed": f"packed, {args.micro_batch_pack} samples",
             "padded_budget": f"padded, budget {args.pack_budget} tok", "packed_budget": f"packed, budget "
             f"{args.pack_budget} tok"}
    for key, label in names.items():
        r = lay[key]
        print(f"{label:<34} {r['tokens_per_s']:>14.0f} {r['step_s']:>8.3f} {r['pad_fraction']:>8.1%} "
              f"{r['micro_batches']:>14d}")
    record = {"bench": "train_scale", "smoke": args.smoke, "spec": spec, "dp1": dp1[0], "dp2": dp2,
              "dist_opt_state_ratio_dp2": ratio, "packing": pk, "packing_speedup": speedup,
              "commit": git_commit(), "machine": platform.machine(), "cpus": os.cpu_count(),
              "time": time.strftime("%Y-%m-%dT%H:%M:%S")}
    out = write_record(args.out, record)
    print(f"results: {out}")
    print(f"dist_opt_state_ratio_dp2: {ratio:.3f}")
    print(f"packing_speedup: {speedup:.3f}")
    return record


if __name__ == "__main__":
    main()
