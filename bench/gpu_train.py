#!/usr/bin/env python
"""GRPO training-step throughput and MFU of the Megatron actor vs plain PyTorch + transformers, one device.

For each size (``--sizes``, random-init Qwen2.5-shaped models, bf16 by default):

* **megatron**: ``MegatronActor`` (TP=1, PP=1, megatron-core GPTModel with TransformerEngine specs
  when TE imports, else megatron-core's local specs with our SDPA core attention; the actor's
  defaults: packed micro-batches, megatron's distributed optimizer) runs one GRPO step per iteration:
  ``compute_grads`` (megatron's forward-backward schedule over ``--batch / --micro-batch``
  micro-batches, the clipped policy loss, vocab-parallel log-probs) then ``optimizer_step``
  (global-norm clip, AdamW on fp32 master weights, copy back to bf16);
* **transformers**: ``AutoModelForCausalLM.from_config`` (bf16 parameters, SDPA attention) with
  ``torch.optim.AdamW`` on the bf16 parameters, the same batch, the same micro-batches and the
  same loss (``megatron_agentrl.algo.losses.clipped_policy_loss`` on fp32 token log-probs), grad
  clip 1.0 -- what one would write without Megatron. Its optimizer keeps no fp32 master copy,
  so it needs 8 B/parameter of weight+gradient+Adam state where the actor needs 18.

Both run in the same process, one after the other, on the same device and batch (the ratio is
measured side by side); memory is freed between them and between sizes. A size whose weights,
gradients and optimizer state alone cannot fit (18 B/param for the actor, 8 B/param for the
baseline, against the device's memory) is skipped with that reason; an out-of-memory error during
the run is caught and recorded as the reason.

Timing: ``--warmup`` untimed steps, then ``--steps`` timed steps, each bracketed by
``torch.cuda.synchronize`` (wall clock per step; the median is reported). The breakdown per step:
for the baseline, forward (to the loss), backward and optimizer are each synchronized; for the
actor, forward is a separate forward-only pass over the same micro-batches
(``compute_logprobs``, timed on its own), backward = ``compute_grads`` time minus that forward,
optimizer = ``optimizer_step`` time.

FLOPs per token (the PaLM / Megatron convention, causal masking not discounted):
``6 * N + 12 * L * H * S`` with ``N`` the parameters that take part in matmuls (all but the input
embedding; the output projection counted once even when tied), ``L`` layers, ``H`` = heads x head
dim, ``S`` the sequence length. MFU = FLOPs per token x tokens per second / peak dense bf16 FLOP/s
of the device: 989e12 for H100 SXM and H200, 756e12 for H100 PCIe, 312e12 for A100 (by
``torch.cuda.get_device_name``), or ``--peak-tflops``.

Prints a table, writes ``bench/results/gpu_train.json`` (``--out``) and ends with ``gpu_mfu_<size>:
<MFU of the Megatron actor>`` for 1.5b when measured, else the largest size measured. ``--smoke``:
the tiny size on the CPU (32 tokens x 4 samples, one warm-up and one timed step, a nominal peak of
0.05 TFLOP/s so that MFU is a number), in seconds; its MFU means nothing.

Usage: ``python bench/gpu_train.py [--sizes 0.5b,1.5b,3b,7b] [--seq-len 2048] [--batch 8] [--micro-batch 1] [--smoke]
[--out PATH]``
"""
from __future__ import annotations

import argparse
import gc
import logging
import math
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench._common import bench_parser, git_commit, parse_bench_args, write_record  # noqa: E402
from rollout_sglang.dtypes import dtype_from_name  # noqa: E402

logger = logging.getLogger("bench.gpu_train")

# Qwen2.5 shapes (hidden, layers, heads, kv heads, MLP, vocab, tied embeddings)
SIZES: dict[str, dict[str, Any]] = {
    "tiny": dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                 intermediate_size=128, vocab_size=512, tie_word_embeddings=True),
    "0.5b": dict(hidden_size=896, num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
                 intermediate_size=4864, vocab_size=151936, tie_word_embeddings=True),
    "1.5b": dict(hidden_size=1536, num_hidden_layers=28, num_attention_heads=12, num_key_value_heads=2,
                 intermediate_size=8960, vocab_size=151936, tie_word_embeddings=True),
    "7b": dict(hidden_size=3584, num_hidden_layers=28, num_attention_heads=28, num_key_value_heads=4,
               intermediate_size=18944, vocab_size=152064, tie_word_embeddings=False),
}
SMOKE = {"device": "cpu", "sizes": "tiny", "seq_len": 32, "batch": 4, "micro_batch": 2, "prompt_len": 4,
         "steps": 1, "warmup": 1, "peak_tflops": 0.05}
PEAK_BF16_FLOPS = (("H100 PCIe", 756e12), ("H100", 989e12), ("H200", 989e12), ("H800", 989e12), ("A100", 312e12))
ACTOR_BYTES_PER_PARAM = 18  # bf16 weight 2 + fp32 master 4 + fp32 main_grad 4 + Adam moments 8
BASELINE_BYTES_PER_PARAM = 8  # bf16 weight 2 + bf16 grad 2 + bf16 Adam moments 4
MODEL_DTYPES = ("bfloat16", "float32", "float16")  # names of rollout_sglang.dtypes


def qwen2_config(size: str, seq_len: int):
    """A transformers ``Qwen2Config`` with the shapes of ``SIZES[size]`` (rope theta 1e6, eps 1e-6)."""
    from transformers import Qwen2Config

    return Qwen2Config(**SIZES[size], max_position_embeddings=max(seq_len, 4096), rms_norm_eps=1e-6,
                       rope_parameters={"rope_type": "default", "rope_theta": 1000000.0})


def param_counts(cfg: Any) -> dict[str, int]:
    """``total`` parameters and ``matmul`` parameters (all but the input embedding; LM head counted once)."""
    h, L, V = int(cfg.hidden_size), int(cfg.num_hidden_layers), int(cfg.vocab_size)
    nh, nkv = int(cfg.num_attention_heads), int(cfg.num_key_value_heads)
    hd = h // nh
    ff = int(cfg.intermediate_size)
    attn = h * nh * hd + 2 * h * nkv * hd + nh * hd * h  # q, k, v, o weights
    qkv_bias = nh * hd + 2 * nkv * hd
    mlp = 3 * h * ff
    per_layer_matmul = attn + mlp
    per_layer_total = per_layer_matmul + qkv_bias + 2 * h
    embed = V * h
    total = embed + L * per_layer_total + h + (0 if cfg.tie_word_embeddings else V * h)
    return {"total": total, "matmul": L * per_layer_matmul + V * h}


def flops_per_token(cfg: Any, seq_len: int) -> float:
    """Training FLOPs per token: ``6 * N_matmul + 12 * L * H * S`` (forward + backward)."""
    n = param_counts(cfg)["matmul"]
    hd = int(cfg.hidden_size) // int(cfg.num_attention_heads)
    return 6.0 * n + 12.0 * int(cfg.num_hidden_layers) * int(cfg.num_attention_heads) * hd * seq_len


def peak_flops(device: torch.device, override_tflops: float | None) -> tuple[float, str]:
    """(peak dense bf16 FLOP/s, where the figure comes from); NaN when unknown."""
    if override_tflops:
        return float(override_tflops) * 1e12, "--peak-tflops"
    if device.type != "cuda":
        return float("nan"), "unknown (CPU)"
    name = torch.cuda.get_device_name(device)
    for key, value in PEAK_BF16_FLOPS:
        if key.lower() in name.lower():
            return value, f"{key} dense bf16 spec"
    return float("nan"), f"unknown device {name!r}: pass --peak-tflops"


def make_batch(rows: int, row_len: int, vocab: int, prompt_len: int, seed: int = 0):
    """A GRPO ``TrainBatch`` of ``rows`` rows of ``row_len`` tokens: random ids, loss mask after ``prompt_len``,
    advantages one value per row (as GRPO gives), behavior log-probs filled in later."""
    from megatron_agentrl.megatron.actor import TrainBatch

    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(1, vocab, (rows, row_len), generator=g)
    mask = torch.zeros(rows, row_len)
    mask[:, min(prompt_len, row_len - 1):] = 1.0
    adv = torch.randn(rows, 1, generator=g).expand(rows, row_len) * mask
    return TrainBatch(tokens=tokens, loss_mask=mask, behavior_logprobs=torch.zeros(rows, row_len),
                      advantages=adv.contiguous())


class Clock:
    """Wall-clock timer that synchronizes the device before reading the time."""

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def now(self) -> float:
        """Seconds (``perf_counter``) after all queued device work finished."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter()


def _free(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


def _peak_gb(device: torch.device) -> float:
    return torch.cuda.max_memory_allocated(device) / 1e9 if device.type == "cuda" else float("nan")


def _oom_types() -> tuple[type[BaseException], ...]:
    return (torch.OutOfMemoryError,)


def run_megatron(hf_cfg: Any, batch: Any, args: argparse.Namespace, device: torch.device) -> dict[str, Any]:
    """Time ``--steps`` GRPO steps of the Megatron actor; returns median times (s) and peak memory."""
    from megatron_agentrl.config import TrainConfig
    from megatron_agentrl.megatron.actor import MegatronActor, TrainBatch
    from megatron_agentrl.megatron.model import have_te

    clock = Clock(device)
    train_cfg = TrainConfig(lr=1e-6, micro_batch_size=args.micro_batch, grad_clip=1.0)
    actor = MegatronActor(hf_cfg, train_cfg, dtype=dtype_from_name(args.dtype))
    try:
        n_params = sum(p.numel() for _, p in actor.named_params)
        # behavior log-probs = the policy's own (ratio ~ 1, as on-policy GRPO); also warms up the forward
        behavior = actor.compute_logprobs(batch.tokens, micro_batch_size=args.micro_batch, loss_mask=batch.loss_mask)
        b = TrainBatch(batch.tokens, batch.loss_mask, behavior * batch.loss_mask, batch.advantages)
        fwd, fb, opt, step, stats = [], [], [], [], {}
        for i in range(args.warmup + args.steps):
            t0 = clock.now()
            stats = actor.compute_grads(b)
            t1 = clock.now()
            norm = actor.optimizer_step()
            t2 = clock.now()
            if i >= args.warmup:
                fb.append(t1 - t0)
                opt.append(t2 - t1)
                step.append(t2 - t0)
        for _ in range(args.steps):
            t0 = clock.now()
            actor.compute_logprobs(b.tokens, micro_batch_size=args.micro_batch, loss_mask=b.loss_mask)
            fwd.append(clock.now() - t0)
        f, g_, o = statistics.median(fwd), statistics.median(fb), statistics.median(opt)
        return {"params": n_params, "spec": "te" if have_te() else "local",
                "param_dtype": str(actor.named_params[0][1].dtype), "step_s": statistics.median(step),
                "forward_s": f, "backward_s": max(g_ - f, 0.0), "optimizer_s": o, "fwd_bwd_s": g_,
                "loss": stats["loss"], "grad_norm": float(norm), "peak_mem_gb": _peak_gb(device),
                "step_s_all": step}
    finally:
        del actor
        _free(device)


def run_transformers(hf_cfg: Any, batch: Any, args: argparse.Namespace, device: torch.device) -> dict[str, Any]:
    """Time ``--steps`` steps of plain transformers + AdamW on the same batch and loss; median times (s)."""
    import torch.nn.functional as F
    from transformers import AutoModelForCausalLM

    from megatron_agentrl.algo.losses import LossInputs, clipped_policy_loss
    from megatron_agentrl.config import LossConfig

    clip = LossConfig(clip_eps_low=0.2, clip_eps_high=0.28)
    clock = Clock(device)
    dtype = dtype_from_name(args.dtype)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(hf_cfg, dtype=dtype, attn_implementation="sdpa")
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-6, betas=(0.9, 0.999), weight_decay=0.0)
    try:
        n_params = sum(p.numel() for p in model.parameters())
        rows = batch.tokens.shape[0]
        mb = args.micro_batch
        tokens = batch.tokens.to(device)
        mask = batch.loss_mask.to(device)
        adv = batch.advantages.to(device)
        n_tok = float(mask.sum())

        def logprobs(x: torch.Tensor) -> torch.Tensor:
            logits = model(input_ids=x).logits[:, :-1]
            nll = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), x[:, 1:].reshape(-1), reduction="none")
            return torch.cat([nll.new_zeros(x.shape[0], 1), -nll.view(x.shape[0], -1)], dim=1)

        with torch.no_grad():
            behavior = torch.cat([logprobs(tokens[i:i + mb]) for i in range(0, rows, mb)]) * mask
        fwd, bwd, opt_t, step, loss_val, norm = [], [], [], [], 0.0, 0.0
        for it in range(args.warmup + args.steps):
            f = b_ = 0.0
            t_start = clock.now()
            loss_val = 0.0
            for i in range(0, rows, mb):
                t0 = clock.now()
                lp = logprobs(tokens[i:i + mb])
                inputs = LossInputs(lp, behavior[i:i + mb], adv[i:i + mb], mask[i:i + mb])
                loss, _ = clipped_policy_loss(inputs, clip)
                loss = loss / n_tok
                t1 = clock.now()
                loss.backward()
                t2 = clock.now()
                f += t1 - t0
                b_ += t2 - t1
                loss_val += float(loss.detach())
            t0 = clock.now()
            norm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0))
            opt.step()
            opt.zero_grad(set_to_none=True)
            t1 = clock.now()
            if it >= args.warmup:
                fwd.append(f)
                bwd.append(b_)
                opt_t.append(t1 - t0)
                step.append(t1 - t_start)
        return {"params": n_params, "spec": f"attn={model.config._attn_implementation}",
                "param_dtype": str(next(model.parameters()).dtype),
                "step_s": statistics.median(step), "forward_s": statistics.median(fwd),
                "backward_s": statistics.median(bwd), "optimizer_s": statistics.median(opt_t),
                "loss": loss_val, "grad_norm": norm, "peak_mem_gb": _peak_gb(device), "step_s_all": step}
    finally:
        model = opt = None  # drop the references so that _free can release the memory
        _free(device)


def _fits(n_params: int, bytes_per_param: int, device: torch.device) -> str | None:
    """None when the static state fits the device, else the reason it does not."""
    if device.type != "cuda":
        return None
    need = n_params * bytes_per_param
    have = torch.cuda.get_device_properties(device).total_memory
    if need > 0.92 * have:
        return (f"weights + grads + optimizer state alone need {need / 1e9:.0f} GB ({bytes_per_param} B/param x "
                f"{n_params / 1e9:.2f}B params), the device has {have / 1e9:.0f} GB")
    return None


def measure(name: str, fn: Callable[[], dict[str, Any]], need: str | None, device: torch.device) -> dict[str, Any]:
    """Run one side, turning a predicted or actual out-of-memory into a recorded skip reason."""
    if need is not None:
        logger.warning("%s skipped: %s", name, need)
        return {"skipped": need}
    try:
        return fn()
    except _oom_types() as e:
        _free(device)
        reason = f"out of memory: {str(e).splitlines()[0][:300]}"
        logger.warning("%s skipped: %s", name, reason)
        return {"skipped": reason}


def measure_size(size: str, args: argparse.Namespace, device: torch.device, peak: float) -> dict[str, Any]:
    """One size: both sides on the same batch, with tokens/s, TFLOP/s, MFU and their throughput ratio."""
    hf_cfg = qwen2_config(size, args.seq_len)
    counts = param_counts(hf_cfg)
    fpt = flops_per_token(hf_cfg, args.seq_len)
    batch = make_batch(args.batch, args.seq_len, int(hf_cfg.vocab_size), args.prompt_len)
    tokens = args.batch * args.seq_len
    row: dict[str, Any] = {"params": counts["total"], "matmul_params": counts["matmul"],
                           "flops_per_token": fpt, "tokens_per_step": tokens}
    sides = {"megatron": (run_megatron, ACTOR_BYTES_PER_PARAM)}
    if not args.skip_baseline:
        sides["transformers"] = (run_transformers, BASELINE_BYTES_PER_PARAM)
    for name, (run, bpp) in sides.items():
        r = measure(f"{size}/{name}", partial(run, hf_cfg, batch, args, device),
                    _fits(counts["total"], bpp, device), device)
        if "step_s" in r:
            r["tokens_per_s"] = tokens / r["step_s"]
            r["achieved_tflops"] = fpt * r["tokens_per_s"] / 1e12
            r["mfu"] = fpt * r["tokens_per_s"] / peak
        row[name] = r
    m, t = row.get("megatron", {}), row.get("transformers", {})
    if "tokens_per_s" in m and "tokens_per_s" in t:
        row["megatron_over_transformers"] = m["tokens_per_s"] / t["tokens_per_s"]
    return row


def main(argv: list[str] | None = None) -> dict:
    ap = bench_parser("gpu_train", __doc__)
    ap.add_argument("--sizes", default="0.5b,1.5b,3b,7b", help=f"comma-separated, from {list(SIZES)}")
    ap.add_argument("--seq-len", type=int, default=2048, help="tokens per sample")
    ap.add_argument("--batch", type=int, default=8, help="samples per GRPO step (global batch)")
    ap.add_argument("--micro-batch", type=int, default=1, help="samples per forward/backward")
    ap.add_argument("--prompt-len", type=int, default=256, help="leading tokens outside the loss mask")
    ap.add_argument("--steps", type=int, default=5, help="timed steps")
    ap.add_argument("--warmup", type=int, default=2, help="untimed steps first")
    ap.add_argument("--dtype", default="bfloat16", choices=MODEL_DTYPES)
    ap.add_argument("--device", default="cuda", help="cuda (default) or cpu (--smoke runs the tiny size there)")
    ap.add_argument("--peak-tflops", type=float, default=None, help="peak dense FLOP/s of the device, TFLOP/s")
    ap.add_argument("--skip-baseline", action="store_true", help="only the Megatron actor")
    args = parse_bench_args(ap, argv, SMOKE)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    sizes = [s.strip().lower() for s in args.sizes.split(",") if s.strip()]
    bad = [s for s in sizes if s not in SIZES]
    if bad:
        raise SystemExit(f"--sizes: unknown {bad}; choose from {list(SIZES)}")
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit(f"--device {args.device}: CUDA is not available here; use --device cpu, or --smoke")
    if device.type == "cpu" and any(s != "tiny" for s in sizes):
        logger.warning("sizes %s on the CPU will be very slow", [s for s in sizes if s != "tiny"])
    if args.batch % args.micro_batch:
        raise SystemExit(f"--batch {args.batch} must be a multiple of --micro-batch {args.micro_batch}")
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True  # only float32 runs are affected

    from megatron_agentrl.megatron.parallel import destroy_parallel, initialize_parallel

    initialize_parallel(1, 1, seed=1234)
    peak, peak_src = peak_flops(device, args.peak_tflops)
    device_name = torch.cuda.get_device_name(device) if device.type == "cuda" else f"cpu ({os.cpu_count()} cores)"
    results: dict[str, dict[str, Any]] = {}
    try:
        for size in sizes:
            results[size] = measure_size(size, args, device, peak)
    finally:
        destroy_parallel()

    hdr = (f"{'size':>5} {'impl':>12} {'params':>8} {'step ms':>9} {'fwd ms':>8} {'bwd ms':>8} {'opt ms':>8} "
           f"{'tok/s':>10} {'TFLOP/s':>8} {'MFU':>6} {'peak GB':>8}")
    print(f"device: {device_name} | peak {peak / 1e12:.4g} TFLOP/s ({peak_src}) | seq {args.seq_len} x batch "
          f"{args.batch} (micro {args.micro_batch}) | {args.dtype}")
    print(hdr)
    for size, row in results.items():
        for name in ("megatron", "transformers"):
            r = row.get(name)
            if r is None:
                continue
            if "skipped" in r:
                print(f"{size:>5} {name:>12} skipped: {r['skipped']}")
                continue
            print(f"{size:>5} {name:>12} {r['params'] / 1e9:>7.3f}B {r['step_s'] * 1e3:>9.1f} "
                  f"{r['forward_s'] * 1e3:>8.1f} "
                  f"{r['backward_s'] * 1e3:>8.1f} {r['optimizer_s'] * 1e3:>8.1f} {r['tokens_per_s']:>10.0f} "
                  f"{r['achieved_tflops']:>8.2f} {r['mfu']:>6.3f} {r['peak_mem_gb']:>8.1f}")
        if "megatron_over_transformers" in row:
            print(f"{size:>5} megatron / transformers throughput: {row['megatron_over_transformers']:.2f}")
    record = {"benchmark": "gpu_train", "time": time.strftime("%Y-%m-%dT%H:%M:%S"), "commit": git_commit(),
              "device": device_name, "peak_flops": peak, "peak_source": peak_src, "torch": torch.__version__,
              "platform": platform.platform(), "args": vars(args), "results": results}
    write_record(args.out, record)
    print(f"results: {args.out}")
    measured = [s for s, r in results.items() if "mfu" in r.get("megatron", {})]
    key = "1.5b" if "1.5b" in measured else (measured[-1] if measured else (sizes[-1] if sizes else "none"))
    value = results.get(key, {}).get("megatron", {}).get("mfu", float("nan"))
    print(f"gpu_mfu_{key}: {'nan' if math.isnan(value) else f'{value:.4f}'}")
    return record


if __name__ == "__main__":
    main()
