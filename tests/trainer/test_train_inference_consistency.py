"""Train/inference consistency: the engine's log-probs of the tokens it sampled over a multi-turn
episode equal the Megatron actor's recomputed log-probs for the same weights (fp32, atol 1e-4).

Weights go actor -> export (HF names) -> engine, exactly as in training; at TP=2 the actor's
vocabulary is sharded and log-probs are computed vocab-parallel.
"""
from __future__ import annotations

import pytest
import torch

from tests.support.dist_utils import run_distributed

TOKENIZER = "examples/tokenizer/tiny_agent"


def _check(rank: int, world: int, tp: int, temperature: float) -> float:
    import torch.distributed as dist

    from megatron_agentrl.config import ModelConfig, TrainConfig
    from megatron_agentrl.hf_io import load_hf_config
    from megatron_agentrl.megatron.actor import MegatronActor
    from megatron_agentrl.megatron.parallel import destroy_parallel, initialize_parallel
    from megatron_agentrl.pipeline.batch import pad_right
    from rollout_sglang.chat_template import ChatTemplate
    from rollout_sglang.engines.local import LocalEngine
    from rollout_sglang.tokenizer import load_tokenizer
    from tests.trainer.support import three_turn_episodes

    initialize_parallel(tp, 1, seed=7)
    tok = load_tokenizer(TOKENIZER)
    arch = dict(model_type="qwen2", hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024, tie_word_embeddings=False)
    hf_config = load_hf_config(ModelConfig(arch=arch, tokenizer=TOKENIZER), tok)
    actor = MegatronActor(hf_config, TrainConfig())
    state = actor.export_hf_state_dict()  # collective
    box: list = [None]
    if rank == 0:
        engine = LocalEngine(hf_config)
        engine.load_state_dict(1, state)
        box = [three_turn_episodes(engine, ChatTemplate(tok), temperature)[:3]]
    dist.broadcast_object_list(box, src=0)
    seqs, masks, lps = box[0]
    recomputed = actor.compute_logprobs(pad_right(seqs, torch.long), temperature=temperature, micro_batch_size=2)
    mask = pad_right(masks, torch.float32)
    assert mask.sum() > 20, "the episodes should contain generated tokens"
    diff = ((recomputed - pad_right(lps, torch.float32)).abs() * mask).max().item()
    destroy_parallel()
    return diff


@pytest.mark.parametrize("tp,temperature", [(1, 1.0), (2, 0.7)])
def test_engine_logprobs_equal_actor_logprobs(tp: int, temperature: float):
    diffs = run_distributed(_check, tp, tp, temperature, timeout_s=90)
    assert max(diffs) < 1e-4, diffs
