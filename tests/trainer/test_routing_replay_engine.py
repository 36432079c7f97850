"""Rollout routing replay end to end: the local engine records the experts it chose over a multi-turn episode
(each turn asking only for its new positions), and the Megatron actor replaying them computes the engine's
log-probs of the sampled tokens to the dense model's bound (fp32, atol 1e-4), at EP=1, EP=2, TP=2 and PP=2,
padded and packed. An engine whose router picks its top-k in bf16 (experts flip near ties, nothing else
changes) shows a flip rate and a log-prob mismatch without replay; replay removes the mismatch."""
from __future__ import annotations

import numpy as np
import torch

from tests.support.dist_utils import run_distributed

TOKENIZER = "examples/tokenizer/tiny_agent"
# a tiny Qwen3-MoE: 8 experts of width 32, 2 per token, 4 layers
ARCH = dict(model_type="qwen3_moe", hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, max_position_embeddings=1024, tie_word_embeddings=False,
            num_experts=8, moe_intermediate_size=32, num_experts_per_tok=2, norm_topk_prob=True)
LAYOUTS = [(1, 1, 1), (1, 1, 2), (2, 1, 1), (1, 2, 1)]  # (tp, pp, ep) on 2 processes (the rest data-parallel)


def _mismatch(actor, batch, routed) -> float:
    """Largest |trainer - engine| log-prob over the sampled tokens, with ``routed`` replayed (None: own routing)."""
    lp = actor.compute_logprobs(batch.tokens, 1.0, 2, loss_mask=batch.loss_mask, routed_experts=routed)
    return ((lp - batch.behavior_logprobs).abs() * batch.loss_mask).max().item()


def _check(rank: int, world: int) -> dict:
    import torch.distributed as dist

    from megatron_agentrl.config import LossConfig, ModelConfig, TrainConfig
    from megatron_agentrl.hf_io import load_hf_config
    from megatron_agentrl.megatron.actor import MegatronActor, TrainBatch
    from megatron_agentrl.megatron.parallel import destroy_parallel
    from megatron_agentrl.pipeline.batch import pad_right
    from rollout_sglang.chat_template import ChatTemplate
    from rollout_sglang.engines.local import LocalEngine
    from rollout_sglang.tokenizer import load_tokenizer
    from tests.support.routing import pick_experts_in_bf16
    from tests.support.tiny_models import reinit_parallel
    from tests.trainer.support import three_turn_episodes

    tok = load_tokenizer(TOKENIZER)
    hf_config = load_hf_config(ModelConfig(arch=ARCH, tokenizer=TOKENIZER), tok)
    reinit_parallel(1, 1, seed=7)
    torch.manual_seed(3)
    state = MegatronActor(hf_config, TrainConfig()).export_hf_state_dict()
    box: list = [None]
    if rank == 0:
        episodes = {}
        for perturbed in (False, True):
            engine = LocalEngine(hf_config)
            engine.load_state_dict(1, state)
            if perturbed:
                assert pick_experts_in_bf16(engine.model) == 4
            episodes[perturbed] = three_turn_episodes(engine, ChatTemplate(tok), capture_routing=True)
        box = [episodes]
    dist.broadcast_object_list(box, src=0)
    out: dict = {}
    for perturbed, (seqs, masks, lps, routing) in box[0].items():
        tokens, mask = pad_right(seqs, torch.long), pad_right(masks, torch.float32)
        behavior = pad_right(lps, torch.float32)
        assert mask.sum() > 20, "the episodes should contain generated tokens"
        routed = torch.full((*tokens.shape, 4, 2), -1, dtype=torch.int16)
        for i, r in enumerate(routing):
            routed[i, :len(r)] = torch.from_numpy(r.astype(np.int16))
        # the bf16-picking engine on one layout: the flips and what replay removes do not depend on it
        for tp, pp, ep in (LAYOUTS if not perturbed else LAYOUTS[:1]):
            for packed in (False, True):
                reinit_parallel(tp, pp, ep=ep, seed=7)
                actor = MegatronActor(hf_config, TrainConfig(moe_routing_replay=True, sequence_packing=packed,
                                                             micro_batch_size=2), LossConfig())
                actor.load_hf_state_dict(state)

                batch = TrainBatch(tokens=tokens, loss_mask=mask, behavior_logprobs=behavior,
                                   advantages=0.1 * mask, routed_experts=routed)
                flip = actor.compute_grads(actor.dp_slice(batch))["routing/flip_rate"]
                out[(perturbed, tp, pp, ep, packed)] = (_mismatch(actor, batch, routed), _mismatch(actor, batch, None),
                                                        flip)
    destroy_parallel()
    return out


def test_replayed_routing_gives_the_engines_logprobs_and_removes_flips():
    results = run_distributed(_check, 2, timeout_s=400)
    for key, (replayed, own, flip) in results[0].items():
        perturbed = key[0]
        assert replayed < 1e-4, (key, replayed)
        if not perturbed:
            assert own < 1e-4 and flip == 0.0, (key, own, flip)
    perturbed = [v for k, v in results[0].items() if k[0]]
    # the bf16 router flips experts on some tokens: the trainer's own routing then scores another network
    assert min(f for _, _, f in perturbed) > 0.0, perturbed
    assert min(own for _, own, _ in perturbed) > 1e-3, perturbed
