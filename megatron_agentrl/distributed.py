"""The two torch.distributed helpers of the trainer's ranks: which rank leads, and sending rank 0's objects."""
from __future__ import annotations

from typing import Any

import torch.distributed as dist


def is_rank0() -> bool:
    """Global rank 0 (or no torch.distributed)."""
    return not dist.is_initialized() or dist.get_rank() == 0


def broadcast_object(obj: Any) -> Any:
    """Send a picklable object from rank 0 to every rank (identity on one process)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]
