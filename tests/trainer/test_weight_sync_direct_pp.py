"""``WeightSender.sync(direct_engines=...)`` at PP=2: the in-process engine on rank 0 gets the full model,
and every rank runs matching collectives (no hang); engines given on another rank fail on every rank."""
from __future__ import annotations

import torch

from tests.support.dist_utils import run_distributed

VOCAB = 96


def _cfg():
    from transformers import Qwen2Config

    return Qwen2Config(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32, rms_norm_eps=1e-6,
                       tie_word_embeddings=True)


def _direct_pp_case(rank: int, world: int, wrong_rank: bool) -> dict:
    import torch.distributed as dist

    from megatron_agentrl.config import TrainConfig
    from megatron_agentrl.megatron.actor import MegatronActor
    from megatron_agentrl.megatron.parallel import destroy_parallel, initialize_parallel
    from megatron_agentrl.weight_sync import SenderOptions, WeightSender
    from rollout_sglang.engines.local import LocalEngine
    from rollout_sglang.weight_update import WeightSyncError

    initialize_parallel(1, 2, seed=3)
    actor = MegatronActor(_cfg(), TrainConfig())
    sender = WeightSender(actor, SenderOptions(weight_sync_bucket_mb=0.01))
    holder = 1 if wrong_rank else 0
    engine = LocalEngine.from_config(_cfg(), init_seed=7) if rank == holder else None
    out: dict = {}
    if engine is not None:
        engine.pause()
        engine.begin_weight_update(1, {})
    try:
        stats = sender.sync(1, direct_engines=[engine] if engine is not None else None)
        out["bytes"] = stats.bytes
    except WeightSyncError as e:
        out["error"] = str(e)
    if engine is not None and "error" not in out:
        engine.end_weight_update()
        engine.resume()
        out["engine_state"] = {k: v.clone() for k, v in engine.model.state_dict().items()}
    out["actor_state"] = actor.export_hf_state_dict()  # collective: the stages agree afterwards too
    dist.barrier()
    destroy_parallel()
    return out


def test_direct_engines_at_pp2_get_the_full_model_without_hanging():
    r0, r1 = run_distributed(_direct_pp_case, 2, False, timeout_s=90)
    assert r0["bytes"] > 0 and r1["bytes"] == 0
    engine, actor = r0["engine_state"], r0["actor_state"]
    assert set(actor) <= set(engine)
    for name, t in actor.items():
        assert torch.equal(engine[name].to(t.dtype), t), name


def test_direct_engines_on_a_non_zero_rank_fail_everywhere():
    r0, r1 = run_distributed(_direct_pp_case, 2, True, timeout_s=90)
    assert "global rank 1" in r1["error"] and "rank 0 only" in r1["error"]
    assert "another rank" in r0["error"]
