"""Megatron actor on CPU/gloo: equality with transformers, TP/PP invariance, export round trip, SFT.

Multi-process cases run in spawned processes (``dist_utils.run_distributed``) so that the CPU
bridge and torch.distributed never touch the pytest process.
"""
from __future__ import annotations

import logging

import pytest
import torch

from megatron_agentrl.config import LossConfig, TrainConfig
from tests.support.dist_utils import run_distributed
from tests.support.tiny_models import reinit_parallel, tiny_model
from tests.trainer.support import hf_state, make_batch

ATOL = 1e-5


# ---------------------------------------------------------------- helpers (run in children)
def hf_logprobs(model, tokens: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    with torch.no_grad():
        logits = model(tokens).logits.float() / temperature
    lp = torch.log_softmax(logits[:, :-1], dim=-1).gather(-1, tokens[:, 1:, None])[..., 0]
    return torch.cat([torch.zeros(tokens.shape[0], 1), lp], dim=1)


# -------------------------------------------------------------- child entry points
def _single_process_checks(rank: int, world: int) -> dict[str, float]:
    """(1) logits / logprobs equal transformers for untied and tied; error messages."""
    from megatron_agentrl.config import ConfigError
    from megatron_agentrl.megatron.actor import MegatronActor
    from megatron_agentrl.megatron.parallel import destroy_parallel, initialize_parallel

    try:
        initialize_parallel(2, 1, seed=0)
    except ConfigError as e:
        assert "the world size = 1 trainer processes is not a multiple of parallel.tp" in str(e), e
        assert "launch a multiple of 2 processes" in str(e), e
    else:
        raise AssertionError("tp=2 on one process should raise ConfigError")
    from megatron.core import parallel_state
    parallel_state.destroy_model_parallel()
    initialize_parallel(1, 1, seed=0)
    out = {}
    tokens = torch.randint(0, 200, (5, 14), generator=torch.Generator().manual_seed(3))
    for tied in (False, True):
        cfg, hf = tiny_model("qwen2", tied, vocab=200)
        actor = MegatronActor(cfg, TrainConfig(micro_batch_size=2))
        actor.load_hf_state_dict(hf_state(hf))
        pos = torch.arange(14).unsqueeze(0).expand(5, -1)
        with torch.no_grad():
            logits = actor.model(tokens, pos, None)[..., :200]
            ref = hf(tokens).logits
        out[f"logits_{tied}"] = float((logits - ref).abs().max())
        for temp in (1.0, 0.7):
            lp = actor.compute_logprobs(tokens, temperature=temp, micro_batch_size=2)
            out[f"lp_{tied}_{temp}"] = float((lp - hf_logprobs(hf, tokens, temp)).abs().max())
        bad = dict(hf_state(hf))
        bad.pop("model.layers.1.mlp.up_proj.weight")
        bad["model.layers.9.foo"] = torch.zeros(1)
        try:
            actor.load_hf_state_dict(bad)
        except ValueError as e:
            assert "model.layers.1.mlp.up_proj.weight" in str(e) and "model.layers.9.foo" in str(e), str(e)
        else:
            raise AssertionError("load_hf_state_dict should reject missing/unexpected names")
    destroy_parallel()
    return out


def _tp_logprobs(rank: int, world: int) -> list[float]:
    """(2) compute_logprobs at TP=2 equals TP=1 (vocab 300: padded to 384 at TP=1, 512 at TP=2)."""
    from megatron_agentrl.megatron.actor import MegatronActor

    tokens = torch.randint(0, 300, (3, 10), generator=torch.Generator().manual_seed(5))
    diffs = []
    for tied in (False, True):
        cfg, hf = tiny_model("qwen2", tied, vocab=300)
        results = {}
        for tp in (1, 2):
            reinit_parallel(tp, 1)
            actor = MegatronActor(cfg, TrainConfig())
            assert actor.config.sequence_parallel == (tp > 1)  # as megatron's recipes run TP
            actor.load_hf_state_dict(hf_state(hf))
            results[tp] = actor.compute_logprobs(tokens, temperature=0.9, micro_batch_size=2)
        diffs.append(float((results[1] - results[2]).abs().max()))
        diffs.append(float((results[2] - hf_logprobs(hf, tokens, 0.9)).abs().max()))
    return diffs


def hf_reference_grads(model, batch, cfg: LossConfig) -> dict[str, torch.Tensor]:
    """Grads of the token-averaged GRPO loss computed with transformers' autograd."""
    from megatron_agentrl.algo.losses import LossInputs, clipped_policy_loss

    model.zero_grad()
    logits = model(batch.tokens).logits.float()
    lp = torch.log_softmax(logits[:, :-1], dim=-1).gather(-1, batch.tokens[:, 1:, None])[..., 0]
    lp = torch.cat([torch.zeros(lp.shape[0], 1), lp], dim=1)
    loss, _ = clipped_policy_loss(LossInputs(lp, batch.behavior_logprobs, batch.advantages, batch.loss_mask),
                                  LossConfig(clip_eps_low=cfg.clip_eps_low, clip_eps_high=cfg.clip_eps_high))
    (loss / batch.loss_mask.sum()).backward()
    return {n: p.grad.detach().clone() for n, p in model.named_parameters()}


def _pp_grads(rank: int, world: int) -> dict[str, float]:
    """(3) HF-named grads of one step's loss at PP=2 equal PP=1 (run as DP=2 on batch slices), TP=2
    and transformers' autograd; grad norms and losses agree too."""
    from megatron_agentrl.megatron.actor import MegatronActor

    out = {}
    tcfg = TrainConfig(micro_batch_size=2)
    for tied in (False, True):
        cfg, hf = tiny_model("qwen2", tied, vocab=200, layers=4)
        batch = make_batch(cfg.vocab_size)
        grads = {"hf": hf_reference_grads(hf, batch, LossConfig())}
        stats, norms = {}, {}
        for tp, pp in ((1, 1), (1, 2), (2, 1)):
            reinit_parallel(tp, pp)
            actor = MegatronActor(cfg, tcfg)
            actor.load_hf_state_dict(hf_state(hf))
            stats[tp, pp] = actor.compute_grads(actor.dp_slice(batch), "grpo", temperature=1.0)
            grads[tp, pp] = actor.export_hf_grads()
            norms[tp, pp] = actor._grad_norm()
        ref = grads[1, 1]
        scale = max(float(g.abs().max()) for g in ref.values())
        for key in ("hf", (1, 2), (2, 1)):
            assert set(grads[key]) == set(ref), (key, sorted(grads[key]), sorted(ref))
            out[f"grad_{key}_{tied}"] = max(float((grads[key][k] - ref[k]).abs().max()) for k in ref) / scale
        out[f"grad_scale_{tied}"] = scale
        out[f"norm_{tied}"] = max(abs(norms[k] - norms[1, 1]) for k in norms) / norms[1, 1]
        out[f"loss_{tied}"] = max(abs(stats[k]["loss"] - stats[1, 1]["loss"]) for k in stats)
        out[f"ntok_{tied}"] = max(abs(s["num_tokens"] - float(batch.loss_mask.sum())) for s in stats.values())
    return out


def _export_roundtrip(rank: int, world: int) -> dict[str, bool]:
    """(4) export_hf_state_dict(load_hf_state_dict(sd)) == sd exactly at TP=1, TP=2, PP=2."""
    from megatron_agentrl.megatron.actor import MegatronActor

    out = {}
    for tied in (False, True):
        cfg, hf = tiny_model("qwen2", tied, vocab=300, layers=2)
        sd = hf_state(hf)
        sd.pop("model.rotary_emb.inv_freq", None)
        for tp, pp in ((1, 1), (2, 1), (1, 2)):
            reinit_parallel(tp, pp)
            actor = MegatronActor(cfg, TrainConfig())
            actor.load_hf_state_dict(sd)
            exported = actor.export_hf_state_dict()
            ok = set(exported) == set(sd) and all(torch.equal(exported[k], sd[k]) for k in sd)
            out[f"tied={tied} tp={tp} pp={pp}"] = ok
    return out


def _sft_lowers_loss(rank: int, world: int) -> list[float]:
    """(5) repeated SFT train_step on one batch lowers the loss."""
    from megatron_agentrl.megatron.actor import MegatronActor
    from megatron_agentrl.megatron.parallel import destroy_parallel, initialize_parallel

    initialize_parallel(1, 1, seed=0)
    cfg, hf = tiny_model("qwen2", True, vocab=200)
    actor = MegatronActor(cfg, TrainConfig(lr=3e-3, micro_batch_size=2))
    actor.load_hf_state_dict(hf_state(hf))
    batch = make_batch(cfg.vocab_size)
    losses = []
    for _ in range(6):
        stats = actor.train_step(batch, loss_type="sft")
        assert stats["grad_norm"] > 0 and stats["num_tokens"] == float(batch.loss_mask.sum())
        losses.append(stats["loss"])
    destroy_parallel()
    return losses


# ----------------------------------------------------------------------------- tests
def test_mapping_layouts_roundtrip():
    """QKV interleave / fc1 gate-up / TP shards and vocab padding invert exactly (pure tensors)."""
    from megatron_agentrl.convert import get_mapping
    from megatron_agentrl.parallel_layout import padded_vocab_size

    cfg, hf = tiny_model("qwen2", False, vocab=300)
    mp = get_mapping(cfg)
    sd = hf_state(hf)
    assert padded_vocab_size(300, 128, 2) == 512 and padded_vocab_size(256, 128, 2) == 256
    for name in mp.megatron_names():
        full = mp.to_megatron(name, sd)
        for tp in (1, 2):
            pv = padded_vocab_size(300, 128, tp)
            shards = [mp.shard(name, full, r, tp, pv) for r in range(tp)]
            back = mp.unshard(name, shards)
            assert torch.equal(back, full), name
        for k, v in mp.to_hf(name, full).items():
            assert torch.equal(v, sd[k]), k
    # megatron's qkv layout: group g holds [q heads of g, k_g, v_g]
    qkv = mp.to_megatron("decoder.layers.0.self_attention.linear_qkv.weight", sd)
    d, per = mp.head_dim, mp.num_heads // mp.num_kv_heads
    q = sd["model.layers.0.self_attn.q_proj.weight"]
    k = sd["model.layers.0.self_attn.k_proj.weight"]
    g1 = qkv[(per + 2) * d: 2 * (per + 2) * d]
    assert torch.equal(g1[: per * d], q[per * d: 2 * per * d]) and torch.equal(g1[per * d: (per + 1) * d], k[d: 2 * d])
    # each TP shard of fc1 is [gate_r; up_r]
    fc1 = mp.to_megatron("decoder.layers.0.mlp.linear_fc1.weight", sd)
    s1 = mp.shard("decoder.layers.0.mlp.linear_fc1.weight", fc1, 1, 2)
    gate = sd["model.layers.0.mlp.gate_proj.weight"]
    assert torch.equal(s1[: gate.shape[0] // 2], gate[gate.shape[0] // 2:])
    with pytest.raises(ValueError, match="model_type"):
        get_mapping(type("C", (), {"model_type": "gpt_neox"})())


def test_logits_match_transformers():
    out = run_distributed(_single_process_checks, 1, timeout_s=60)[0]
    logging.getLogger(__name__).info("max abs diffs: %s", out)
    assert all(v < ATOL for v in out.values()), out


def test_tp2_logprobs_equal_tp1():
    for diffs in run_distributed(_tp_logprobs, 2, timeout_s=60):
        assert all(d < ATOL for d in diffs), diffs


def test_pp2_tp2_grads_equal_pp1():
    for out in run_distributed(_pp_grads, 2, timeout_s=60):
        logging.getLogger(__name__).info("relative grad diffs: %s", out)
        for tied in (False, True):
            assert out[f"grad_scale_{tied}"] > 1e-3, out  # grads are not trivially small
            assert out[f"ntok_{tied}"] == 0, out
            assert out[f"loss_{tied}"] < ATOL and out[f"norm_{tied}"] < 1e-4, out
            # max |g - g_ref| / max |g_ref|: PP=2, TP=2 and transformers' autograd vs PP=1 (DP=2)
            for key in ("hf", (1, 2), (2, 1)):
                assert out[f"grad_{key}_{tied}"] < 1e-4, out


def test_export_roundtrip_tp_pp():
    for out in run_distributed(_export_roundtrip, 2, timeout_s=60):
        assert all(out.values()), out


def test_sft_lowers_loss():
    losses = run_distributed(_sft_lowers_loss, 1, timeout_s=60)[0]
    assert losses[-1] < losses[0] - 0.05, losses
    assert all(b < a for a, b in zip(losses, losses[1:])), losses
