"""Helpers shared by the trainer tests: an HF state dict and a random batch for the Megatron actor, a tiny training
run on a spawned rank (``run_distributed``) with its per-step records, the tiny agent tokenizer's chat template,
three-turn episodes sampled by an engine, and a reward that varies within a group
(``tasks[].reward_fn: "tests.trainer.support:varied_reward"``)."""
from __future__ import annotations

import json
from pathlib import Path

import torch


def hf_state(model) -> dict[str, torch.Tensor]:
    """HF state dict as a trainer would get it (tied models: no lm_head.weight)."""
    sd = {k: v.clone() for k, v in model.state_dict().items()}
    if model.config.tie_word_embeddings:
        sd.pop("lm_head.weight", None)
    return sd


def make_batch(vocab: int, B: int = 6, T: int = 12, seed: int = 1):
    from megatron_agentrl.megatron.actor import TrainBatch

    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(1, vocab, (B, T), generator=g)
    lengths = torch.tensor([T, T - 3, T - 1, T - 5, T, T - 2][:B])
    mask = torch.zeros(B, T)
    for b in range(B):
        tokens[b, lengths[b]:] = 0
        mask[b, 4:lengths[b]] = 1.0
    behavior = -torch.rand(B, T, generator=g) * mask
    adv = torch.randn(B, T, generator=g) * mask
    return TrainBatch(tokens=tokens, loss_mask=mask, behavior_logprobs=behavior, advantages=adv)


# a tiny model on tests/configs/tiny_test.yaml (fp32, CPU): RL only, two short samples per prompt, no evaluation
TINY_RL = [
    "model.arch.hidden_size=32", "model.arch.intermediate_size=64", "model.arch.num_hidden_layers=2",
    "sft.steps=0", "train.micro_batch_size=4", "rollout.samples_per_prompt=2", "rollout.max_new_tokens=12",
    "eval.samples_per_task=0", "loss.tis_cap=2.0",
]
# a tiny run of it that checkpoints every 2 steps
TINY = TINY_RL + ["rollout.prompts_per_step=2", "loss.kl_coef=0.05", "loss.entropy_coef=0.01", "train.lr=1e-3",
                  "checkpoint.interval=2"]


def train_tiny(rank: int, world: int, overrides: list[str]) -> dict:
    """Child entry point (``run_distributed``): ``run_training`` on tests/configs/tiny_test.yaml with ``overrides``."""
    from megatron_agentrl.config import load_config
    from megatron_agentrl.pipeline.loop import run_training
    from megatron_agentrl.train_rank import setup_logging

    setup_logging(rank)
    return run_training(load_config("tests/configs/tiny_test.yaml", overrides))


def read_steps(out: Path) -> dict[int, dict]:
    """The rows of a run's batches.jsonl, by step."""
    return {r["step"]: r for r in map(json.loads, (out / "batches.jsonl").read_text().splitlines())}


def tiny_agent_template():
    """Qwen2.5's chat format on the repo's tiny agent tokenizer (examples/tokenizer/tiny_agent)."""
    from rollout_sglang.chat_template import ChatTemplate
    from rollout_sglang.tokenizer import load_tokenizer

    return ChatTemplate(load_tokenizer("examples/tokenizer/tiny_agent"))


def varied_reward(traj) -> float:
    """A reward that differs between the samples of a group (the tiny random policy earns nothing yet)."""
    return float(sum(traj.token_ids) % 5)


def three_turn_episodes(engine, template, temperature: float = 1.0, capture_routing: bool = False):
    """Three-turn episodes of three tasks (different prompt lengths, so the engine left-pads) sampled by ``engine``,
    with a fixed env reply between turns: ``(tokens, loss masks, engine log-probs, routing)`` per episode; with
    ``capture_routing`` each turn asks for the positions earlier turns did not cover and ``routing`` holds each
    episode's whole record (else None)."""
    import asyncio

    import numpy as np

    from env_controller.tasks import build_task
    from rollout_sglang.engines.protocol import SamplingParams

    seqs = []
    for name, index in (("lookup", 1), ("calc", 7), ("guess", 3)):
        reply = asyncio.run(build_task(name).start(index))[1]
        seqs.append(list(template.encode_prompt(reply.messages, reply.tools)))
    masks = [[0] * len(p) for p in seqs]
    lps = [[0.0] * len(p) for p in seqs]
    routing: list[list] = [[] for _ in seqs]
    covered = [0] * len(seqs)
    env_reply = template.encode_env_reply([{"role": "tool", "tool_call_id": "call_0", "content": "higher"}])
    for turn in range(3):
        params = SamplingParams(max_new_tokens=12, temperature=temperature, stop_token_ids=template.stop_token_ids,
                                seed=turn)
        ask = {"routing_from": list(covered)} if capture_routing else {}
        outs = asyncio.run(engine.generate(seqs, params, **ask))
        for i, o in enumerate(outs):
            if capture_routing:
                end = len(seqs[i]) + len(o.token_ids) - 1
                assert o.routed_experts.shape[0] == end - covered[i]
                routing[i].append(o.routed_experts)
                covered[i] = end
            seqs[i] += o.token_ids
            masks[i] += [1] * len(o.token_ids)
            lps[i] += o.logprobs
            if turn < 2:
                if o.token_ids[-1] not in template.stop_token_ids:
                    seqs[i].append(template.im_end_id)
                    masks[i].append(0)
                    lps[i].append(0.0)
                seqs[i] += env_reply
                masks[i] += [0] * len(env_reply)
                lps[i] += [0.0] * len(env_reply)
    return seqs, masks, lps, ([np.concatenate(r) for r in routing] if capture_routing else None)
