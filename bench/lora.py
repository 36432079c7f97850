#!/usr/bin/env python
"""LoRA against full-parameter training, side by side in one run: an update's bytes and wall time, the optimizer and
gradient memory, the step time, and cross-policy sampling with live versions as adapters on one engine against one
engine of full weights per version.

Trainer side (one rank, TP=1, megatron-core on this machine's device): a ``MegatronActor`` of Qwen2.5-0.5B's
shapes (``--layers`` deep; ``--smoke``: a tiny model of the same layout), trained every parameter (``full``) or
through adapters of ``--rank`` on every linear layer (``lora``), each pushing its weights to a pool of one local
engine as a run does (:class:`~megatron_agentrl.weight_sync.publisher.WeightPublisher`):

* ``update_bytes``: the payload of one weight push after a step (full: every weight; lora: the adapters);
* ``update_s``: that push's wall time (export, hand-over, load);
* ``optimizer_grad_bytes``: the gradient buffers plus the optimizer's state (Adam's moments) after a step;
* ``step_s``: the median wall time of ``--steps`` GRPO steps on one fixed batch.

Rollout side: ``--versions`` live weight versions, each an adapter on ONE local engine (``VersionPool(...,
live_adapters=N)``), against N local engines of full weights (one slot each), under uniform cross-policy
sampling: ``tokens_per_s`` generating ``--prompts`` prompts of ``--new-tokens`` tokens, and ``weight_bytes``, the
parameters the engines hold (plus the adapters loaded).

Each ratio is lora / full measured in this run. Writes ``bench/results/lora.json``; the last line is
``lora_update_bytes_ratio: <x>``.
"""
from __future__ import annotations

import asyncio
import copy
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench._common import bench_parser, git_commit, parse_bench_args, write_record  # noqa: E402
from bench.gpu_train import make_batch  # noqa: E402
from bench.weight_sync import qwen25_05b_config  # noqa: E402

SMOKE = {"layers": 2, "steps": 1, "prompts": 6, "new_tokens": 4, "rows": 2, "row_len": 16}


def _tensor_bytes(tensors: Any) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if isinstance(t, torch.Tensor))


def optimizer_grad_bytes(actor: Any) -> int:
    """Bytes of the actor's gradient buffers and of its optimizer's state tensors (Adam's moments)."""
    grads = sum(b.grad_data.numel() * b.grad_data.element_size() for b in actor.ddp.buffers)
    state = 0
    for opt in getattr(actor.optimizer, "chained_optimizers", [actor.optimizer]):
        for st in opt.optimizer.state.values():
            state += _tensor_bytes(st.values())
    return grads + state


def trainer_side(hf_cfg: Any, lora: bool, args: Any) -> dict[str, Any]:
    """One variant's figures (see the module doc)."""
    from megatron_agentrl.config import TrainConfig
    from megatron_agentrl.lora.options import LoraOptions
    from megatron_agentrl.megatron.actor import MegatronActor, TrainBatch
    from megatron_agentrl.weight_sync.publisher import WeightPublisher
    from rollout_sglang.engines.local import LocalEngine
    from rollout_sglang.engines.version_pool import VersionPool

    options = LoraOptions(rank=args.rank, alpha=2.0 * args.rank) if lora else None
    actor = MegatronActor(hf_cfg, TrainConfig(lr=1e-4, micro_batch_size=args.rows), lora=options)
    batch = make_batch(args.rows, args.row_len, hf_cfg.vocab_size, args.row_len // 2)
    behavior = actor.compute_logprobs(batch.tokens, micro_batch_size=args.rows, loss_mask=batch.loss_mask)
    batch = TrainBatch(batch.tokens, batch.loss_mask, behavior * batch.loss_mask, batch.advantages)
    engine = LocalEngine(hf_cfg, init_seed=0)
    pool = VersionPool([[engine]], live_adapters=1 if lora else None)
    publisher = WeightPublisher(actor, pool)
    publisher.push(0, all_slots=True)  # the base (and with LoRA the first adapter), as a run starts
    steps = []
    for _ in range(args.steps):
        t0 = time.perf_counter()
        actor.train_step(batch)
        steps.append(time.perf_counter() - t0)
    memory = optimizer_grad_bytes(actor)
    update_s = publisher.push(1)
    out = {"update_bytes": publisher.last_bytes, "update_s": update_s, "optimizer_grad_bytes": memory,
           "step_s": statistics.median(steps),
           "trainable_params": sum(p.numel() for p in actor.model.parameters() if p.requires_grad),
           "engine_version": engine.version if not lora else pool.latest_version}
    del actor, engine, pool, publisher
    return out


def rollout_side(hf_cfg: Any, args: Any) -> dict[str, Any]:
    """Cross-policy sampling over ``--versions`` live versions: adapters on one engine, or an engine per version."""
    from peft import LoraConfig, get_peft_model, get_peft_model_state_dict

    from rollout_sglang.engines.adapter import Adapter
    from rollout_sglang.engines.batching import BatchingEngine
    from rollout_sglang.engines.local import LocalEngine
    from rollout_sglang.engines.protocol import SamplingParams
    from rollout_sglang.engines.version_pool import VersionPool

    base = LocalEngine(hf_cfg, init_seed=0)
    adapters = []
    for v in range(1, args.versions + 1):
        peft = get_peft_model(copy.deepcopy(base.model), LoraConfig(r=args.rank, lora_alpha=2 * args.rank,
                                                                    target_modules="all-linear"))
        g = torch.Generator().manual_seed(v)
        with torch.no_grad():
            for name, p in peft.named_parameters():
                if "lora_B" in name:
                    p.copy_(torch.randn(p.shape, generator=g) * 1e-3)
        config = {"r": args.rank, "lora_alpha": 2 * args.rank, "target_modules": sorted(peft.peft_config[
            "default"].target_modules)}
        adapters.append(Adapter(v, config, {k: t.clone() for k, t in get_peft_model_state_dict(peft).items()}))
        del peft
    shared = VersionPool([[BatchingEngine(base)]], policy="uniform", seed=0, live_adapters=args.versions)
    for a in adapters:
        shared.publish_adapter(a)
    full_engines = []
    for a in adapters:  # the same versions as full weights: the adapter merged into a copy of the base
        e = LocalEngine(copy.deepcopy(base.model), version=a.version)
        with torch.no_grad():
            for module, (lora_a, lora_b) in a.modules().items():
                e.model.get_submodule(module).weight.add_(lora_b @ lora_a, alpha=a.scaling)
        full_engines.append([BatchingEngine(e)])
    separate = VersionPool(full_engines, policy="uniform", seed=0)
    prompts = [[1 + (i * 7 + j) % (hf_cfg.vocab_size - 1) for j in range(16)] for i in range(args.prompts)]
    params = SamplingParams(max_new_tokens=args.new_tokens, temperature=1.0, seed=0)
    out: dict[str, Any] = {}
    for name, pool in (("adapters", shared), ("full", separate)):
        asyncio.run(pool.generate(prompts[:2], params))  # warm
        t0 = time.perf_counter()
        outs = asyncio.run(pool.generate(prompts, params, keys=list(range(len(prompts)))))
        wall = time.perf_counter() - t0
        engines = {id(getattr(e, "engine", e)): getattr(e, "engine", e) for e in pool.engines}
        weight = sum(_tensor_bytes(m.model.parameters()) for m in engines.values())
        if name == "adapters":
            weight += sum(a.nbytes for a in adapters)
        out[name] = {"tokens_per_s": sum(len(o.token_ids) for o in outs) / wall, "weight_bytes": weight,
                     "versions_sampled": sorted({o.version for o in outs})}
    return out


def main(argv: list[str] | None = None) -> dict:
    p = bench_parser("lora", __doc__)
    p.add_argument("--layers", type=int, default=24, help="transformer layers of the Qwen2.5-0.5B shape")
    p.add_argument("--rank", type=int, default=16, help="the adapters' rank")
    p.add_argument("--steps", type=int, default=3, help="timed training steps per variant")
    p.add_argument("--rows", type=int, default=2, help="rows of the training batch")
    p.add_argument("--row-len", type=int, default=128, help="tokens per row of the training batch")
    p.add_argument("--versions", type=int, default=3, help="live weight versions of the sampling comparison")
    p.add_argument("--prompts", type=int, default=12, help="prompts generated per sampling measurement")
    p.add_argument("--new-tokens", type=int, default=16, help="tokens generated per prompt")
    args = parse_bench_args(p, argv, SMOKE)
    from megatron_agentrl.megatron.parallel import destroy_parallel, initialize_parallel

    hf_cfg = qwen25_05b_config(args.layers, smoke=args.smoke)
    initialize_parallel(1, 1, seed=1234)
    try:
        trainer = {variant: trainer_side(hf_cfg, variant == "lora", args) for variant in ("full", "lora")}
    finally:
        destroy_parallel()
    sampling = rollout_side(hf_cfg, args)
    f, lo = trainer["full"], trainer["lora"]
    ratios = {"update_bytes": lo["update_bytes"] / f["update_bytes"], "update_s": lo["update_s"] / f["update_s"],
              "optimizer_grad_bytes": lo["optimizer_grad_bytes"] / f["optimizer_grad_bytes"],
              "step_s": lo["step_s"] / f["step_s"],
              "sampling_tokens_per_s": sampling["adapters"]["tokens_per_s"] / sampling["full"]["tokens_per_s"],
              "engine_weight_bytes": sampling["adapters"]["weight_bytes"] / sampling["full"]["weight_bytes"]}
    print(f"{'':24s}{'full':>16s}{'lora':>16s}{'lora/full':>12s}")
    for key in ("update_bytes", "update_s", "optimizer_grad_bytes", "step_s"):
        print(f"{key:24s}{f[key]:16.4g}{lo[key]:16.4g}{ratios[key]:12.4f}")
    print(f"{'sampling (tokens/s)':24s}{sampling['full']['tokens_per_s']:16.4g}"
          f"{sampling['adapters']['tokens_per_s']:16.4g}{ratios['sampling_tokens_per_s']:12.4f}")
    print(f"{'engine weight bytes':24s}{sampling['full']['weight_bytes']:16.4g}"
          f"{sampling['adapters']['weight_bytes']:16.4g}{ratios['engine_weight_bytes']:12.4f}")
    record = {"bench": "lora", "commit": git_commit(), "smoke": args.smoke, "layers": args.layers, "rank": args.rank,
              "device": "cpu", "threads": torch.get_num_threads(), "trainer": trainer, "sampling": sampling,
              "ratios": ratios}
    write_record(args.out, record)
    print(f"lora_update_bytes_ratio: {ratios['update_bytes']:.5f}")
    return record


if __name__ == "__main__":
    main()
