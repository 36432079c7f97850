"""GPU validation: the Megatron actor, the local engine, the weight sync and the async pipeline on
one CUDA device.

``-m gpu`` tests skip without CUDA. Each GPU test runs a helper whose device is an argument, so
the same helper bodies and assertions also run on the CPU, in the ``slow`` CPU variants at the end
(``pytest -m slow tests/test_gpu.py``, 1-3 minutes on 2 shared cores); the default run
(``-m "not gpu and not slow"``) runs none of them (the benchmark scripts' CPU smoke runs are in
test_bench_scripts.py).

* actor numerics: bf16 actor log-probs vs an fp32 transformers reference on the same
  (bf16-rounded) weights; fp32 actor vs fp32 reference (tight); packed sequences (THD, our core
  attention) give the log-probs of padded rows; GRPO and SFT losses decrease over a few steps of
  megatron-core's distributed optimizer (fp32 main weights) on a fixed batch; parameters live on
  the device in the chosen dtype;
* local engine: log-probs the engine reports for tokens it sampled equal the actor's
  recomputed ones (same weights, same dtype);
* weight sync between two processes on one device (trainer: Megatron actor; engine: the SGLang
  stand-in over a local engine), over a gloo group (NCCL refuses two ranks on one GPU): after the
  sync the engine's tensors equal the actor's export bit for bit and its logits match the actor's;
* a short asynchronous GRPO run end to end (bf16 on the GPU) completes its steps with finite
  metrics, a checkpoint and an HF export; resumed from its step-2 checkpoint, step 3 trains on the
  same samples with the same loss.

Run: ``.venv/bin/python -m pytest -m gpu tests/test_gpu.py`` on the GPU machine.
"""
from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.support.dist_utils import run_distributed, wait_for_file

CUDA = torch.cuda.is_available()
needs_cuda = pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU (torch.cuda.is_available() is False); "
                                                 "run `pytest -m gpu tests/test_gpu.py` on the GPU machine")

# model shapes: "tiny" for the CPU smoke runs, "small" for the GPU (bigger matmuls, 4 layers)
SHAPES = {
    "tiny": dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2),
    "small": dict(vocab_size=2048, hidden_size=256, intermediate_size=704, num_hidden_layers=4,
                  num_attention_heads=8, num_key_value_heads=2),
}
# bf16 vs fp32 log-prob tolerances (nats). bf16 keeps 8 bits of mantissa: with the weights of peaky_state
# the models' errors stay well inside these bounds (docs/BENCHMARKS.md), while a wrong weight or layout gives
# errors of nats.
BF16_MEAN_TOL, BF16_MAX_TOL = 0.1, 1.0
# fp32 actor vs fp32 transformers: rounding alone on the CPU; on CUDA, cuBLAS / TransformerEngine may
# use TF32 for fp32 GEMMs (10-bit mantissa), hence the looser bound there
FP32_TOL = {"cpu": 1e-4, "cuda": 2e-2}


# ------------------------------------------------------------------------ helpers (also on CPU)
def qwen2_config(shape: str, tied: bool = True):
    """A Qwen2 config of ``SHAPES[shape]`` (rope theta 10000, eps 1e-6)."""
    from transformers import Qwen2Config

    return Qwen2Config(**SHAPES[shape], max_position_embeddings=256, rms_norm_eps=1e-6, tie_word_embeddings=tied,
                       rope_parameters={"rope_type": "default", "rope_theta": 10000.0})


def peaky_state(cfg: Any, seed: int = 0) -> dict[str, torch.Tensor]:
    """An fp32 HF state dict with weights large enough that next-token distributions are far from
    uniform (log-prob spread of nats), so that log-prob comparisons are not vacuous."""
    from transformers import Qwen2ForCausalLM

    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(cfg)
    sd = {}
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                sd[name] = 1.0 + 0.1 * torch.randn_like(p)
            else:
                if "embed" in name:
                    std = 2.4 / cfg.hidden_size ** 0.5
                else:
                    std = 1.0 / p.shape[-1] ** 0.5 if p.dim() == 2 else 0.05
                sd[name] = torch.randn_like(p) * std
    if cfg.tie_word_embeddings:
        sd.pop("lm_head.weight", None)
    return sd


def hf_logprobs(cfg: Any, state: dict[str, torch.Tensor], tokens: torch.Tensor, device: str) -> torch.Tensor:
    """fp32 transformers log-probs ``[B, T]`` (column 0 = 0) of ``tokens`` with ``state``, on ``device``; CPU result."""
    from transformers import Qwen2ForCausalLM

    model = Qwen2ForCausalLM(cfg).eval()
    model.load_state_dict({k: v.float() for k, v in state.items()}, strict=False)
    model.tie_weights()
    model.to(device)
    with torch.no_grad():
        logits = model(tokens.to(device)).logits.float()
    lp = torch.log_softmax(logits[:, :-1], dim=-1).gather(-1, tokens.to(device)[:, 1:, None])[..., 0]
    return torch.cat([torch.zeros(tokens.shape[0], 1), lp.cpu()], dim=1)


def fixed_batch(vocab: int, B: int = 8, T: int = 48, seed: int = 1):
    """A GRPO TrainBatch: random tokens, loss mask after a 12-token prompt (ragged ends), one
    advantage of +-1 per row; behavior log-probs zero (callers fill them in)."""
    from megatron_agentrl.megatron.actor import TrainBatch

    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(1, vocab, (B, T), generator=g)
    mask = torch.zeros(B, T)
    for b in range(B):
        end = T - (b % 4) * 3
        mask[b, 12:end] = 1.0
        tokens[b, end:] = 0
    adv = torch.tensor([1.0 if b % 2 == 0 else -1.0 for b in range(B)])[:, None] * mask
    return TrainBatch(tokens=tokens, loss_mask=mask, behavior_logprobs=torch.zeros(B, T), advantages=adv)


def engine_vs_actor(actor: Any, cfg: Any, device: str, dtype: torch.dtype,
                    temperature: float = 1.0) -> dict[str, float]:
    """Load the actor's weights into a LocalEngine on ``device``/``dtype``, sample 4 x 16 tokens,
    and compare the engine's log-probs of its tokens with the actor's recomputed ones.

    Returns ``max``/``mean`` absolute differences over the generated tokens and their number.
    """
    import asyncio

    from rollout_sglang.engines.local import LocalEngine
    from rollout_sglang.engines.protocol import SamplingParams

    state = actor.export_hf_state_dict()
    engine = LocalEngine(cfg, device=device, dtype=dtype, init_seed=0)
    engine.load_state_dict(1, state)
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(1, cfg.vocab_size, (n,), generator=g).tolist() for n in (5, 9, 12, 7)]
    outs = asyncio.run(engine.generate(prompts, SamplingParams(max_new_tokens=16, temperature=temperature, seed=11)))
    width = max(len(p) + len(o.token_ids) for p, o in zip(prompts, outs))
    tokens = torch.zeros(len(prompts), width, dtype=torch.long)
    mask = torch.zeros(len(prompts), width)
    engine_lp = torch.zeros(len(prompts), width)
    for i, (p, o) in enumerate(zip(prompts, outs)):
        seq = p + o.token_ids
        tokens[i, : len(seq)] = torch.tensor(seq)
        mask[i, len(p): len(seq)] = 1.0
        engine_lp[i, len(p): len(seq)] = torch.tensor(o.logprobs)
    actor_lp = actor.compute_logprobs(tokens, temperature=temperature, micro_batch_size=2)
    diff = (actor_lp - engine_lp).abs() * mask
    del engine
    return {"max": float(diff.max()), "mean": float(diff.sum() / mask.sum()), "tokens": float(mask.sum()),
            "spread": float(engine_lp[mask > 0].std())}


def packed_vs_padded(actor: Any, tokens: torch.Tensor, packed_lp: torch.Tensor) -> float:
    """Largest difference between ``packed_lp`` (the actor's log-probs with ``train.sequence_packing``,
    the default) and the same actor's log-probs of ``tokens`` as padded rows."""
    import dataclasses

    assert actor.train_cfg.sequence_packing
    packed_cfg = actor.train_cfg
    actor.train_cfg = dataclasses.replace(packed_cfg, sequence_packing=False)
    try:
        padded = actor.compute_logprobs(tokens, micro_batch_size=4)
    finally:
        actor.train_cfg = packed_cfg
    return float((padded - packed_lp).abs().max())


def actor_numerics(rank: int, world: int, device: str, shape: str, steps: int = 5) -> dict[str, Any]:
    """Child entry point (one process): the actor numerics on ``device`` ("cuda" or "cpu").

    Returns: where the bf16 actor's parameters live and their dtype; bf16 and fp32 log-prob errors
    against the fp32 transformers reference; GRPO and SFT losses over ``steps`` optimizer steps on
    a fixed batch; engine-vs-actor log-prob errors in fp32 and bf16.
    """
    from megatron_agentrl.config import TrainConfig
    from megatron_agentrl.megatron.actor import MegatronActor, TrainBatch
    from megatron_agentrl.megatron.parallel import destroy_parallel, initialize_parallel

    initialize_parallel(1, 1, seed=5)
    cfg = qwen2_config(shape)
    state = peaky_state(cfg)
    batch = fixed_batch(cfg.vocab_size)
    out: dict[str, Any] = {}
    try:
        # fp32 actor == fp32 reference (the device path itself)
        actor32 = MegatronActor(cfg, TrainConfig(micro_batch_size=4))
        actor32.load_hf_state_dict(state)
        ref32 = hf_logprobs(cfg, state, batch.tokens, device)
        lp32 = actor32.compute_logprobs(batch.tokens, micro_batch_size=4)
        out["fp32_lp_err"] = float((lp32 - ref32).abs().max())
        out["fp32_packed_vs_padded"] = packed_vs_padded(actor32, batch.tokens, lp32)
        out["engine_fp32"] = engine_vs_actor(actor32, cfg, device, torch.float32)
        del actor32

        # bf16 actor vs fp32 reference on the same bf16-rounded weights
        rounded = {k: v.bfloat16().float() for k, v in state.items()}
        train = TrainConfig(micro_batch_size=4, lr=3e-3, grad_clip=1.0)
        actor = MegatronActor(cfg, train, dtype=torch.bfloat16)
        actor.load_hf_state_dict(state)
        p = actor.named_params[0][1]
        out["param_device"], out["param_dtype"] = p.device.type, str(p.dtype)
        ref = hf_logprobs(cfg, rounded, batch.tokens, device)
        lp = actor.compute_logprobs(batch.tokens, micro_batch_size=4)
        m = batch.loss_mask > 0
        err = (lp - ref).abs()[:, 1:]
        out["bf16_lp_err_max"], out["bf16_lp_err_mean"] = float(err.max()), float(err.mean())
        out["ref_lp_spread"] = float(ref[m].std())
        out["bf16_packed_vs_padded"] = packed_vs_padded(actor, batch.tokens, lp)
        opt = actor.optimizer
        out["optimizers"] = [type(o).__name__ for o in getattr(opt, "chained_optimizers", [opt])]
        out["engine_bf16"] = engine_vs_actor(actor, cfg, device, torch.bfloat16)

        # GRPO on a fixed batch, behavior = the starting policy (ratio 1 at step 1)
        grpo = TrainBatch(batch.tokens, batch.loss_mask, lp * batch.loss_mask, batch.advantages)
        out["grpo_losses"], out["grad_norms"] = [], []
        for _ in range(steps):
            s = actor.train_step(grpo)
            out["grpo_losses"].append(s["loss"])
            out["grad_norms"].append(s["grad_norm"])
        del actor
        actor = MegatronActor(cfg, train, dtype=torch.bfloat16)
        actor.load_hf_state_dict(state)
        out["sft_losses"] = [actor.train_step(batch, loss_type="sft")["loss"] for _ in range(steps)]
        del actor
        if device == "cuda":
            out["max_mem_gb"] = torch.cuda.max_memory_allocated() / 1e9
        return out
    finally:
        destroy_parallel()


def check_actor_numerics(out: dict[str, Any], device: str) -> None:
    """The assertions on :func:`actor_numerics`' result (shared by the GPU test and the CPU smoke test)."""
    assert out["param_device"] == device and out["param_dtype"] == "torch.bfloat16", out
    assert out["ref_lp_spread"] > 1.0, f"reference log-probs nearly uniform ({out['ref_lp_spread']:.3f}): vacuous test"
    assert out["fp32_lp_err"] < FP32_TOL[device], out
    assert out["fp32_packed_vs_padded"] < FP32_TOL[device], out
    assert out["bf16_packed_vs_padded"] < BF16_MAX_TOL / 10, out  # same weights and dtype: kernel shapes differ
    assert out["optimizers"] == ["DistributedOptimizer"], out
    assert out["bf16_lp_err_mean"] < BF16_MEAN_TOL and out["bf16_lp_err_max"] < BF16_MAX_TOL, out
    e32, e16 = out["engine_fp32"], out["engine_bf16"]
    assert e32["tokens"] >= 40 and e16["tokens"] >= 40, out
    assert e32["spread"] > 0.5, f"engine log-probs nearly constant: {e32}"
    assert e32["max"] < FP32_TOL[device] * 10, e32  # KV-cache decoding vs full-sequence recompute, fp32
    assert e16["mean"] < BF16_MEAN_TOL and e16["max"] < BF16_MAX_TOL, e16
    g, s = out["grpo_losses"], out["sft_losses"]
    assert all(math.isfinite(x) for x in g + s + out["grad_norms"]), out
    assert g[-1] < g[0] - 0.1, f"GRPO loss did not decrease on a fixed batch: {g}"
    assert s[-1] < s[0] - 0.1 and s == sorted(s, reverse=True), f"SFT loss did not decrease monotonically: {s}"


def _probe_tokens(vocab: int) -> torch.Tensor:
    return torch.randint(0, vocab, (2, 24), generator=torch.Generator().manual_seed(7))


def weight_sync_two_processes(rank: int, world: int, tmp: str, device: str, shape: str) -> dict[str, Any]:
    """Child entry point, 2 processes on one device: rank 1 hosts the SGLang stand-in over a bf16
    LocalEngine on ``device``; rank 0 trains one bf16 actor step (so the weights differ from the
    engine's start) and syncs version 1 to it over a gloo weight-sync group. Returns (rank 0) the
    actor's HF export and logits, (rank 1) the engine's tensors, logits before/after and version."""
    tmpdir = Path(tmp)
    cfg = qwen2_config(shape)
    if rank == 1:
        from rollout_sglang.engines.local import LocalEngine
        from rollout_sglang.testing.sglang_standin import StandInServer
        from rollout_sglang.testing.standin_options import StandInOptions

        engine = LocalEngine(cfg, device=device, dtype=torch.bfloat16, init_seed=0)
        server = StandInServer(engine, StandInOptions(group_timeout_s=120))
        url = server.start()
        probe = _probe_tokens(cfg.vocab_size).to(device)
        with torch.no_grad():
            before = engine.model(probe).logits.float().cpu()
        (tmpdir / "url.tmp").write_text(url)
        os.replace(tmpdir / "url.tmp", tmpdir / "url")
        wait_for_file(tmpdir / "done", 240)
        with torch.no_grad():
            after = engine.model(probe).logits.float().cpu()
        state = {k: v.detach().cpu().clone() for k, v in engine.model.state_dict().items()}
        out = {"before": before, "after": after, "state": state, "version": engine.version,
               "log": list(server.update_log), "param_device": next(engine.model.parameters()).device.type}
        server.stop()
        return out

    os.environ.update({"WORLD_SIZE": "1", "RANK": "0", "LOCAL_RANK": "0"})  # the trainer's own world
    from megatron_agentrl.config import TrainConfig
    from megatron_agentrl.megatron.actor import MegatronActor, TrainBatch
    from megatron_agentrl.megatron.parallel import destroy_parallel, initialize_parallel
    from megatron_agentrl.weight_sync import SenderOptions, WeightSender
    from rollout_sglang.engines.sglang_client import SGLangEngine
    from rollout_sglang.engines.sglang_options import SGLangClientOptions
    from rollout_sglang.testing.transport import StandInTransport

    try:
        initialize_parallel(1, 1, seed=21)
        actor = MegatronActor(cfg, TrainConfig(micro_batch_size=4, lr=1e-3), dtype=torch.bfloat16)
        b = fixed_batch(cfg.vocab_size)
        lp = actor.compute_logprobs(b.tokens, micro_batch_size=4)
        actor.train_step(TrainBatch(b.tokens, b.loss_mask, lp * b.loss_mask, b.advantages))
        wait_for_file(tmpdir / "url", 120)
        client = SGLangEngine((tmpdir / "url").read_text(), SGLangClientOptions(request_timeout_s=120,
                                                                                update_timeout_s=120))
        # the stand-in's transport: SGLang's broadcasts carry no checksum to verify the buckets by
        options = SenderOptions(weight_sync_bucket_mb=0.25, weight_sync_init_timeout_s=120,
                                weight_sync_bucket_timeout_s=120, checksum=True, backend="gloo",
                                small_tensor_bytes=4096)
        sender = WeightSender(actor, options, transport=StandInTransport())
        client.pause()
        client.begin_weight_update(1)  # SGLang takes weights only inside its update session
        stats = sender.sync(1, slot_key=0, targets=[client])
        client.end_weight_update()
        client.resume()
        sender.close()
        actor.ddp.eval()
        with torch.no_grad():
            probe = _probe_tokens(cfg.vocab_size).to(actor.device)
            pos = torch.arange(probe.shape[1], device=actor.device).unsqueeze(0).expand_as(probe)
            logits = actor.model(probe, pos, None)[..., : cfg.vocab_size].float().cpu()
        state = actor.export_hf_state_dict()
        return {"state": state, "logits": logits, "bytes": stats.bytes, "buckets": stats.buckets,
                "actor_device": actor.device.type}
    finally:
        (tmpdir / "done").write_text("ok")
        destroy_parallel()


def check_weight_sync(trainer: dict[str, Any], host: dict[str, Any], device: str) -> None:
    """Assertions on :func:`weight_sync_two_processes`: bitwise-equal tensors, matching logits, version 1."""
    assert trainer["actor_device"] == device and host["param_device"] == device
    assert host["version"] == 1 and trainer["buckets"] > 1 and trainer["bytes"] > 0
    names = set(trainer["state"])
    assert names <= set(host["state"]), sorted(names - set(host["state"]))
    for name in names:
        a, e = trainer["state"][name], host["state"][name]
        assert a.dtype == e.dtype == torch.bfloat16 and torch.equal(a, e), name
    actor_logits, after, before = trainer["logits"], host["after"], host["before"]
    scale = actor_logits.abs().mean()
    assert (after - actor_logits).abs().mean() < 0.02 * scale + 1e-3, "engine logits differ from the actor's"
    assert (before - actor_logits).abs().mean() > 10 * (after - actor_logits).abs().mean(), "sync changed nothing"


TINY_RUN = [
    "model.arch.hidden_size=64", "model.arch.intermediate_size=128", "model.arch.num_hidden_layers=2",
    "sft.steps=2", "sft.batch_size=4", "train.micro_batch_size=4",
    "rollout.prompts_per_step=2", "rollout.samples_per_prompt=2", "rollout.max_new_tokens=16",
    "eval.samples_per_task=2", "pipeline.mode=async", "pipeline.staleness=1",
    "checkpoint.interval=2",
]


def async_run(rank: int, world: int, overrides: list[str]) -> dict[str, Any]:
    """Child entry point: ``run_training`` on tests/configs/tiny_test.yaml with ``overrides``; returns the summary
    plus whether (and how much) CUDA memory the run used."""
    from megatron_agentrl.config import load_config
    from megatron_agentrl.pipeline.loop import run_training
    from megatron_agentrl.train_rank import setup_logging

    setup_logging(rank)
    summary = run_training(load_config("tests/configs/tiny_test.yaml", overrides))
    summary["cuda_max_mem_gb"] = torch.cuda.max_memory_allocated() / 1e9 if torch.cuda.is_available() else 0.0
    return summary


def check_async_run(summary: dict[str, Any], out: Path, steps: int, device: str) -> None:
    """Assertions on an :func:`async_run`: every step trained with finite loss and grad norm, a
    checkpoint of the last step, an HF export, and (on CUDA) GPU memory actually used."""
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    rl = [r for r in rows if r["phase"] == "rl"]
    assert [r["step"] for r in rl] == list(range(1, steps + 1))
    batches = [json.loads(line) for line in (out / "batches.jsonl").read_text().splitlines()]
    assert [b["step"] for b in batches] == list(range(1, steps + 1))
    for b in batches:
        assert math.isfinite(b["loss"]) and b["grad_norm"] is not None and math.isfinite(b["grad_norm"]), b
        assert max(b["staleness"]) <= 1, b
    for r in rl:
        assert r["train_tokens_per_s"] > 0 and r["step_time_s"] > 0
    assert summary["mode"] == "async" and summary["trained_samples"] == steps * 4
    ckpt = Path(summary["last_checkpoint"])
    assert ckpt.name.startswith("step_") and int(ckpt.name[5:]) == steps and any(ckpt.iterdir()), ckpt
    assert (out / "hf_export" / "config.json").is_file()
    if device == "cuda":
        assert summary["cuda_max_mem_gb"] > 0


def resume_step3(overrides: list[str], full: Path, resumed: Path, timeout_s: int) -> None:
    """Resume the run in ``full`` from its step-2 checkpoint into ``resumed`` for one step and check
    that step 3 trains on the samples of the uninterrupted run's step 3 with its loss and grad norm
    (the same weights, batch and kernels; the bound leaves room for non-deterministic reductions)."""
    ckpt = full / "checkpoints" / "step_000002"
    run_distributed(async_run, 1, overrides + [f"output_dir={resumed}", "train.steps=3", f"checkpoint.resume={ckpt}"],
                    timeout_s=timeout_s)
    steps = {d: {r["step"]: r for r in map(json.loads, (d / "batches.jsonl").read_text().splitlines())}
             for d in (full, resumed)}
    assert sorted(steps[resumed]) == [3], steps[resumed]
    a, b = steps[full][3], steps[resumed][3]
    assert a["sample_ids"] == b["sample_ids"] and a["min_versions"] == b["min_versions"], (a, b)
    for key in ("loss", "grad_norm"):
        assert abs(a[key] - b[key]) <= 1e-3 * max(1.0, abs(a[key])), (key, a[key], b[key])


# ------------------------------------------------------------------------------ GPU tests
@pytest.mark.gpu
@needs_cuda
def test_gpu_actor_bf16_numerics_training_and_engine_logprobs():
    out = run_distributed(actor_numerics, 1, "cuda", "small", timeout_s=300)[0]
    check_actor_numerics(out, "cuda")


@pytest.mark.gpu
@needs_cuda
def test_gpu_weight_sync_between_two_processes_on_one_gpu(tmp_path):
    trainer, host = run_distributed(weight_sync_two_processes, 2, str(tmp_path), "cuda", "small", timeout_s=300)
    check_weight_sync(trainer, host, "cuda")


@pytest.mark.gpu
@needs_cuda
def test_gpu_async_run_end_to_end(tmp_path):
    out = tmp_path / "run"
    steps = 4
    run = TINY_RUN + ["model.dtype=bfloat16"]
    summary = run_distributed(async_run, 1, run + [f"output_dir={out}", f"train.steps={steps}"], timeout_s=540)[0]
    check_async_run(summary, out, steps, "cuda")
    resume_step3(run, out, tmp_path / "resumed", timeout_s=300)


# ----------------------------------------------------------------- the same helpers on CPU
@pytest.mark.slow
def test_cpu_actor_numerics_helper():
    """The GPU actor/engine helper on the CPU (tiny model, bf16 there too); slow: a whole model's numerics."""
    out = run_distributed(actor_numerics, 1, "cpu", "tiny", timeout_s=120)[0]
    check_actor_numerics(out, "cpu")


@pytest.mark.slow
def test_cpu_weight_sync_helper(tmp_path):
    trainer, host = run_distributed(weight_sync_two_processes, 2, str(tmp_path), "cpu", "tiny", timeout_s=180)
    check_weight_sync(trainer, host, "cpu")


@pytest.mark.slow
def test_cpu_async_run_helper(tmp_path):
    out = tmp_path / "run"
    summary = run_distributed(async_run, 1, TINY_RUN + [f"output_dir={out}", "train.steps=4"], timeout_s=300)[0]
    check_async_run(summary, out, 4, "cpu")
    resume_step3(TINY_RUN, out, tmp_path / "resumed", timeout_s=240)
