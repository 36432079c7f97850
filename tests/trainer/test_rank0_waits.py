"""The other ranks wait for rank 0's own work (a batch, an evaluation, a checkpoint's drain, an export) longer than a
collective's timeout allows, and no longer than ``parallel.rank0_timeout_s``; a rank 0 that dies ends their wait at
once. Two real processes on gloo."""
from __future__ import annotations

import os
import re
import signal
import time

import pytest

from tests.support.dist_utils import run_distributed

COLLECTIVE_S = 2.0  # the training collectives' timeout in these runs


def _slow_rank0(rank: int, world: int, work_s: float, rank0_timeout_s: float) -> dict:
    """Rank 0 works alone for ``work_s`` seconds, then every rank meets and runs a training collective."""
    import torch
    import torch.distributed as dist

    from megatron_agentrl.distributed import broadcast_object, wait_for_rank0
    from megatron_agentrl.megatron.parallel import destroy_parallel, initialize_parallel

    initialize_parallel(1, 1, seed=0, timeout_s=COLLECTIVE_S, rank0_timeout_s=rank0_timeout_s)
    try:
        t0 = time.monotonic()
        if rank == 0:
            time.sleep(work_s)
        wait_for_rank0()
        got = broadcast_object({"batch": 7} if rank == 0 else None)
        waited = time.monotonic() - t0
        x = torch.ones(1)
        dist.all_reduce(x)  # the collectives still work, on their own timeout
        return {"got": got, "waited_s": waited, "sum": float(x)}
    except Exception as e:
        return {"error": f"{type(e).__name__}: {e}", "waited_s": time.monotonic() - t0}
    finally:
        destroy_parallel()


def test_the_other_ranks_wait_for_rank0_beyond_a_collectives_timeout() -> None:
    r = run_distributed(_slow_rank0, 2, 3 * COLLECTIVE_S, 60.0, timeout_s=120)
    assert r[1]["got"] == {"batch": 7} and r[1]["sum"] == 2.0, r[1]
    assert r[1]["waited_s"] >= 3 * COLLECTIVE_S - 0.5


def test_a_collective_alone_would_have_timed_out() -> None:
    """The same wait in a training collective fails: what the rank-0 group is for."""
    r = run_distributed(_slow_collective, 2, 3 * COLLECTIVE_S, timeout_s=120)
    assert "error" in r[1] and r[1]["waited_s"] < 3 * COLLECTIVE_S, r[1]


def _slow_collective(rank: int, world: int, work_s: float) -> dict:
    import torch
    import torch.distributed as dist

    from megatron_agentrl.megatron.parallel import destroy_parallel, initialize_parallel

    initialize_parallel(1, 1, seed=0, timeout_s=COLLECTIVE_S)
    t0 = time.monotonic()
    try:
        if rank == 0:
            time.sleep(work_s)
        dist.all_reduce(torch.ones(1))
        return {"waited_s": time.monotonic() - t0}
    except Exception as e:
        return {"error": f"{type(e).__name__}: {e}", "waited_s": time.monotonic() - t0}
    finally:
        if rank == 1:
            time.sleep(work_s)  # let rank 0 finish its sleep before the group goes
        destroy_parallel()


def test_a_wait_longer_than_rank0_timeout_fails_naming_the_setting() -> None:
    r = run_distributed(_slow_rank0, 2, 3 * COLLECTIVE_S + 4.0, 3 * COLLECTIVE_S, timeout_s=120)
    assert r[1]["error"].startswith("TimeoutError: rank 1 waited parallel.rank0_timeout_s=6s for rank 0"), r[1]
    assert "raise parallel.rank0_timeout_s" in r[1]["error"]


def _rank0_dies(rank: int, world: int) -> None:
    from megatron_agentrl.distributed import wait_for_rank0
    from megatron_agentrl.megatron.parallel import initialize_parallel

    initialize_parallel(1, 1, seed=0, timeout_s=COLLECTIVE_S, rank0_timeout_s=600.0)
    if rank == 0:
        time.sleep(1.0)
        os.kill(os.getpid(), signal.SIGKILL)
    t0 = time.monotonic()
    try:
        wait_for_rank0()
    except Exception as e:
        raise RuntimeError(f"rank 0 gone after {time.monotonic() - t0:.1f} s: {e}") from None


def test_a_rank0_killed_ends_the_others_wait_at_once() -> None:
    with pytest.raises(AssertionError, match="rank 1 failed") as info:
        run_distributed(_rank0_dies, 2, timeout_s=60)
    waited = float(re.search(r"rank 0 gone after ([\d.]+) s", str(info.value)).group(1))
    assert waited < 10.0, str(info.value)
