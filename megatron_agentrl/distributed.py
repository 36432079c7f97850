"""The torch.distributed helpers of the trainer's ranks: which rank leads, and sending rank 0's objects.

Rank 0 alone drives the rollouts, evaluates, drains them for a checkpoint and writes the exports, while the other
ranks wait for it. They wait in :func:`broadcast_object` (or :func:`wait_for_rank0`, when nothing is sent) on a gloo
group of their own whose timeout is ``parallel.rank0_timeout_s`` (:func:`init_rank0_group`), not in the next
training collective, whose timeout (``parallel.collective_timeout_s``) is kept short to find a dead rank soon. A
rank 0 that dies ends their wait at once: its sockets close.
"""
from __future__ import annotations

import datetime
from typing import Any

import torch.distributed as dist

_GROUP: Any = None
_TIMEOUT_S = 0.0


def is_rank0() -> bool:
    """Global rank 0 (or no torch.distributed)."""
    return not dist.is_initialized() or dist.get_rank() == 0


def init_rank0_group(timeout_s: float) -> None:
    """Make the group the ranks wait for rank 0 on, with its own ``timeout_s`` (seconds; collective, once after the
    process group starts)."""
    global _GROUP, _TIMEOUT_S
    if dist.get_world_size() > 1:
        _GROUP = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=timeout_s))
        _TIMEOUT_S = timeout_s


def destroy_rank0_group() -> None:
    """Forget the group (the process group it belongs to is being destroyed)."""
    global _GROUP
    _GROUP = None


def broadcast_object(obj: Any, bulk: bool = False) -> Any:
    """Send a picklable object from rank 0 to every rank (identity on one process); the other ranks wait for it up
    to ``parallel.rank0_timeout_s`` (module doc), then raise a TimeoutError that says so. ``bulk`` (a batch): the
    ranks meet on the rank-0 group first, then the object travels over the training group (NCCL on GPUs: gloo's
    broadcast sends the whole object from rank 0 to each rank in turn)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return obj
    box = [obj]
    if bulk and _GROUP is not None:
        wait_for_rank0()
        dist.broadcast_object_list(box, src=0)
        return box[0]
    try:
        dist.broadcast_object_list(box, src=0, group=_GROUP)
    except RuntimeError as e:
        if _GROUP is None or dist.get_rank() == 0 or "timed out" not in str(e).lower():
            raise
        raise TimeoutError(f"rank {dist.get_rank()} waited parallel.rank0_timeout_s={_TIMEOUT_S:g}s for rank 0, "
                           "which works alone meanwhile (a batch, an evaluation, a checkpoint's drain, an export); "
                           "see rank 0's log for what it was doing, and raise parallel.rank0_timeout_s if that "
                           f"work takes longer ({e})") from e
    return box[0]


def wait_for_rank0() -> None:
    """The other ranks wait here while rank 0 finishes work of its own (rank 0 passes at once when it arrives);
    placed before the next training collective, whose timeout is shorter. Collective."""
    broadcast_object(None)
