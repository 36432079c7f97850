"""Benchmark: the train/rollout mismatch of a MoE policy with and without rollout routing replay (R3).

A tiny Qwen3-MoE (``--hidden`` 128, ``--layers`` 4, ``--experts`` 16 experts, ``--topk`` 4 per token, random
weights) samples ``--episodes`` two-turn episodes on the local engine with routing capture (each turn asks for
the positions the earlier one did not cover; random prompt and "environment" tokens between the turns), at
temperature 1. The Megatron actor in fp32 holding the same weights then takes one gradient pass over them
(``compute_grads``, the training path) twice: routing by its own top-k, and replaying the engine's experts
(``train.moe_routing_replay``). Reported per engine, as the trainer logs them in training (lag 0: the engine
ran the trained weights): ``routing/flip_rate`` (the share of (token, MoE layer) pairs whose trainer top-k set
differs from the engine's), ``mismatch/abs_lag0`` (mean ``|log p_train - log p_engine|`` over the sampled
tokens) and ``mismatch/kl_lag0`` (k3 estimate of KL(engine || trainer)).

Engines: **bf16** (the headline: engines serve in bf16 while the trainer's log-probs are fp32; experts flip
near ties, and every other op differs by bf16 rounding) and **fp32** (the control: the same arithmetic up to
kernel order, so replay should change nothing). The last line is ``routing_replay_abs_mismatch_ratio: <bf16
engine's mismatch/abs_lag0 with replay / without>`` (lower is better; the rest is bf16 numerics).

Usage: ``python bench/routing_replay.py [--episodes 32] [--new-tokens 48] [--smoke] [--out PATH]``
"""
from __future__ import annotations

import asyncio
import platform
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench._common import bench_parser, git_commit, parse_bench_args, write_record  # noqa: E402


def tiny_moe(args):
    """The bench's Qwen3-MoE config."""
    from transformers import Qwen3MoeConfig

    return Qwen3MoeConfig(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=2 * args.hidden,
                          num_hidden_layers=args.layers, num_attention_heads=4, num_key_value_heads=2,
                          head_dim=args.hidden // 4, max_position_embeddings=1024, tie_word_embeddings=False,
                          num_experts=args.experts, moe_intermediate_size=args.hidden // 2,
                          num_experts_per_tok=args.topk, norm_topk_prob=True, pad_token_id=0, eos_token_id=1,
                          rope_parameters={"rope_type": "default", "rope_theta": 10000.0})


def sample(engine, args, gen: torch.Generator):
    """Two-turn episodes with routing capture: ``(tokens, loss_mask, engine log-probs, routed experts)`` per episode."""
    from rollout_sglang.engines.protocol import SamplingParams

    def rand(n: int) -> list[int]:
        return torch.randint(2, args.vocab, (n,), generator=gen).tolist()

    seqs = [rand(int(torch.randint(16, 48, (1,), generator=gen))) for _ in range(args.episodes)]
    masks = [[0] * len(s) for s in seqs]
    lps = [[0.0] * len(s) for s in seqs]
    routing: list[list] = [[] for _ in seqs]
    covered = [0] * len(seqs)
    for turn in range(2):
        params = SamplingParams(max_new_tokens=args.new_tokens, temperature=1.0, seed=args.seed + turn)
        outs = asyncio.run(engine.generate(seqs, params, routing_from=list(covered)))
        for i, o in enumerate(outs):
            routing[i].append(o.routed_experts)
            covered[i] = len(seqs[i]) + len(o.token_ids) - 1
            seqs[i] += o.token_ids
            masks[i] += [1] * len(o.token_ids)
            lps[i] += o.logprobs
            if turn == 0:
                env = rand(8)
                seqs[i] += env
                masks[i] += [0] * len(env)
                lps[i] += [0.0] * len(env)
    return seqs, masks, lps, routing


def measure(hf_config, state, episodes, replay: bool) -> dict[str, float]:
    """One gradient pass of a fresh fp32 actor over ``episodes``: its routing and mismatch metrics."""
    import numpy as np

    from megatron_agentrl.config import LossConfig, TrainConfig
    from megatron_agentrl.megatron.actor import MegatronActor, TrainBatch
    from megatron_agentrl.pipeline.batch import pad_right

    seqs, masks, lps, routing = episodes
    tokens, mask, behavior = pad_right(seqs, torch.long), pad_right(masks, torch.float32), pad_right(lps, torch.float32)
    record = [np.concatenate(r) for r in routing]
    routed = torch.full((*tokens.shape, *record[0].shape[1:]), -1, dtype=torch.int16)
    for i, r in enumerate(record):
        routed[i, :len(r)] = torch.from_numpy(r.astype(np.int16))
    actor = MegatronActor(hf_config, TrainConfig(moe_routing_replay=replay, micro_batch_size=8), LossConfig())
    actor.load_hf_state_dict(state)
    lag = torch.where(mask > 0, 0, -1)
    stats = actor.compute_grads(TrainBatch(tokens=tokens, loss_mask=mask, behavior_logprobs=behavior,
                                           advantages=0.1 * mask, version_lag=lag, routed_experts=routed))
    return {k: stats[k] for k in ("routing/flip_rate", "mismatch/abs_lag0", "mismatch/kl_lag0", "mismatch/tokens_lag0")}


def main(argv: list[str] | None = None) -> int:
    parser = bench_parser("routing_replay", __doc__)
    parser.add_argument("--episodes", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=48)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--experts", type=int, default=16)
    parser.add_argument("--topk", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=512)
    parser.add_argument("--seed", type=int, default=1234)
    args = parse_bench_args(parser, argv, dict(episodes=4, new_tokens=8, hidden=64, layers=2, experts=8, topk=2))

    from megatron_agentrl.config import TrainConfig
    from megatron_agentrl.megatron.actor import MegatronActor
    from megatron_agentrl.megatron.parallel import destroy_parallel, initialize_parallel
    from rollout_sglang.engines.local import LocalEngine

    initialize_parallel(1, 1, seed=args.seed)
    hf_config = tiny_moe(args)
    torch.manual_seed(args.seed)
    state = MegatronActor(hf_config, TrainConfig()).export_hf_state_dict()
    results: dict[str, dict] = {}
    t0 = time.perf_counter()
    for name, dtype in (("bf16", torch.bfloat16), ("fp32", torch.float32)):
        engine = LocalEngine(hf_config, dtype=dtype, seed=args.seed)
        engine.load_state_dict(1, state)
        episodes = sample(engine, args, torch.Generator().manual_seed(args.seed))
        results[name] = {"own": measure(hf_config, state, episodes, replay=False),
                         "replay": measure(hf_config, state, episodes, replay=True)}
    destroy_parallel()
    wall = time.perf_counter() - t0

    print(f"{'engine':<8}{'flip_rate':>11}{'abs (own)':>12}{'abs (R3)':>12}{'kl (own)':>12}{'kl (R3)':>12}"
          f"{'tokens':>8}")
    for name, r in results.items():
        own, rep = r["own"], r["replay"]
        print(f"{name:<8}{own['routing/flip_rate']:>11.4f}{own['mismatch/abs_lag0']:>12.3e}"
              f"{rep['mismatch/abs_lag0']:>12.3e}{own['mismatch/kl_lag0']:>12.3e}{rep['mismatch/kl_lag0']:>12.3e}"
              f"{int(own['mismatch/tokens_lag0']):>8}")
    bf16 = results["bf16"]
    ratio = bf16["replay"]["mismatch/abs_lag0"] / max(bf16["own"]["mismatch/abs_lag0"], 1e-30)
    record = {"bench": "routing_replay", "commit": git_commit(), "host": platform.node(), "smoke": args.smoke,
              "args": {k: v for k, v in vars(args).items() if k != "out"}, "results": results, "wall_s": wall,
              "routing_replay_abs_mismatch_ratio": ratio}
    out = write_record(args.out, record)
    print(f"results: {out}")
    print(f"routing_replay_abs_mismatch_ratio: {ratio:.4f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
