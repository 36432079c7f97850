"""normalize_per_task: equals a plain per-task loop on random inputs with uneven task sizes and
masks, and gives the same result on 2 data-parallel (gloo) ranks as on one."""
from __future__ import annotations

import torch

from dist_utils import run_distributed
from megatron_agentrl.algo.advantages import normalize_per_task

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
