"""normalize_per_task: equals a plain per-task loop on random inputs with uneven task sizes and
masks, and gives the same result on 2 data-parallel (gloo) ranks as on one."""
from __future__ import annotations

import torch

from megatron_agentrl.algo.advantages import normalize_per_task
from tests.support.dist_utils import run_distributed

EPS = 1e-6


def _reference(adv: torch.Tensor, mask: torch.Tensor, task_ids: torch.Tensor, eps: float) -> torch.Tensor:
    """Plain per-task normalization: one Python loop over tasks, mean and population std of the
    masked tokens of the task's samples."""
    out = torch.zeros_like(adv, dtype=torch.float64)
    for k in sorted(set(task_ids.tolist())):
        rows = task_ids == k
        vals = [float(a) for r in torch.nonzero(rows).flatten().tolist()
                for a, m in zip(adv[r].tolist(), mask[r].tolist()) if m > 0]
        if not vals:
            continue
        mean = sum(vals) / len(vals)
        std = (sum((v - mean) ** 2 for v in vals) / len(vals)) ** 0.5
        for r in torch.nonzero(rows).flatten().tolist():
            for t in range(adv.shape[1]):
                if mask[r, t] > 0:
                    out[r, t] = (float(adv[r, t]) - mean) / (std + eps)
    return out.float()


def _inputs(seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    B, T = 29, 17
    # group advantages spread over tokens, plus token noise; ragged masks with some empty rows
    adv = torch.randn(B, 1, generator=g) * 2 + torch.randn(B, T, generator=g) * 0.5 + 0.3
    start = torch.randint(0, T // 2, (B,), generator=g)
    length = torch.randint(0, T, (B,), generator=g)
    pos = torch.arange(T)[None, :]
    mask = ((pos >= start[:, None]) & (pos < (start + length)[:, None])).float()
    mask[3] = 0.0  # a sample with no policy tokens
    task_ids = torch.tensor([0] * 15 + [1] * 2 + [3] * 11 + [4])[torch.randperm(B, generator=g)]  # task 2 absent
    return adv * mask, mask, task_ids


def test_matches_plain_per_task_reference():
    for seed in range(3):
        adv, mask, task_ids = _inputs(seed)
        out = normalize_per_task(adv, mask, task_ids, eps=EPS)
        ref = _reference(adv, mask, task_ids, EPS)
        assert torch.allclose(out, ref, atol=1e-5), (seed, (out - ref).abs().max())
        assert (out[mask == 0] == 0).all()
        for k in (0, 1, 3, 4):
            vals = out[task_ids == k][mask[task_ids == k] > 0]
            if vals.numel() > 1:
                assert abs(float(vals.mean())) < 1e-4



def test_precise_when_the_mean_dwarfs_the_spread():
    """Float32 advantages around 1e4 with a spread of ~1 (a reward offset the group baseline did not
    remove): the result still matches the float64 reference of the same float32 inputs, where a
    float32 E[A^2] - mean^2 would lose every digit of the variance."""
    adv, mask, task_ids = _inputs(7)
    adv = (adv + 1.0e4 + 37.0 * (task_ids[:, None] == 1)) * mask
    out = normalize_per_task(adv, mask, task_ids, eps=EPS)
    ref = _reference(adv, mask, task_ids, EPS)
    assert torch.allclose(out, ref, atol=2e-4), (out - ref).abs().max()
    assert float(ref.abs().max()) > 1.0  # the spread survived: not all zeros


def _dp_worker(rank: int, world: int, seeds: list[int]) -> list[torch.Tensor]:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method="env://", rank=rank, world_size=world)
    try:
        outs = []
        for seed in seeds:
            adv, mask, task_ids = _inputs(seed)
            # uneven split (rank 0 gets 11 rows, rank 1 the rest): a task may be missing on one rank
            rows = torch.arange(11) if rank == 0 else torch.arange(11, adv.shape[0])
            outs.append(normalize_per_task(adv[rows], mask[rows], task_ids[rows], eps=EPS,
                                           process_group=dist.group.WORLD))
        return outs
    finally:
        dist.destroy_process_group()


def test_two_dp_ranks_equal_one():
    seeds = [0, 1, 2]
    per_rank = run_distributed(_dp_worker, 2, seeds, timeout_s=60)
    for i, seed in enumerate(seeds):
        parts = [per_rank[0][i], per_rank[1][i]]
        adv, mask, task_ids = _inputs(seed)
        whole = normalize_per_task(adv, mask, task_ids, eps=EPS)
        assert torch.allclose(torch.cat(parts), whole, atol=1e-6)
        assert torch.allclose(torch.cat(parts), _reference(adv, mask, task_ids, EPS), atol=1e-5)


def _trainer_step(rank: int, world: int) -> dict[str, float]:
    """The training step (Trainer.step: DP split, per-task normalization over the DP group, one
    optimizer step) on 2 DP ranks and on one DP rank (TP=2) from the same weights and batch."""
    from megatron.core import parallel_state
    from transformers import Qwen2Config

    from megatron_agentrl.config import Config, LossConfig, TrainConfig
    from megatron_agentrl.megatron.actor import MegatronActor, TrainBatch
    from megatron_agentrl.megatron.parallel import initialize_parallel
    from megatron_agentrl.pipeline.batch import RLBatch
    from megatron_agentrl.pipeline.trainer import Trainer

    hf = Qwen2Config(vocab_size=120, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                     num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=True,
                     rope_parameters={"rope_type": "default", "rope_theta": 5000.0})
    adv, mask, task_ids = _inputs(5)
    g = torch.Generator().manual_seed(9)
    tokens = torch.randint(1, 120, adv.shape, generator=g)
    batch = TrainBatch(tokens, mask, -torch.rand(adv.shape, generator=g) * mask, adv)
    rl = RLBatch(batch, task_ids, torch.zeros(adv.shape[0]), torch.zeros(adv.shape[0]))
    cfg = Config()
    cfg.train = TrainConfig(micro_batch_size=4, lr=1e-2)
    cfg.loss = LossConfig(tis_cap=2.0)
    out = {}
    state = None
    for tp in (1, 2):
        if parallel_state.model_parallel_is_initialized():
            parallel_state.destroy_model_parallel()
        initialize_parallel(tp, 1, seed=3, timeout_s=60)
        torch.manual_seed(0)
        actor = MegatronActor(hf, cfg.train, cfg.loss)
        if state is None:
            state = actor.export_hf_state_dict()
        else:
            actor.load_hf_state_dict(state)
        stats = Trainer(actor, cfg, ["t0", "t1", "t2", "t3", "t4"]).step(rl if rank == 0 else None, 1)
        after = actor.export_hf_state_dict()
        out[f"dp{actor.dp}"] = (stats["loss"], stats["grad_norm"], after)
    (l2, n2, w2), (l1, n1, w1) = out["dp2"], out["dp1"]
    return {"loss": abs(l2 - l1), "norm": abs(n2 - n1) / n1,
            "weights": max(float((w2[k] - w1[k]).abs().max()) for k in w1), "grad_norm": n1,
            "moved": max(float((w1[k] - state[k]).abs().max()) for k in w1)}


def test_trainer_step_two_dp_ranks_equal_one():
    out = run_distributed(_trainer_step, 2, timeout_s=90)[0]
    # Adam, lr 1e-2: fp32 reduction order
    assert out["loss"] < 1e-6 and out["norm"] < 1e-5 and out["weights"] < 1e-5, out
    assert out["grad_norm"] > 0 and out["moved"] > 0, out  # a real update, whatever the loss's last bits
