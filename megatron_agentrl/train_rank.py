"""Train one rank of a run: the training entry point that every launcher calls.

``agentrl train`` (in its own process, or in each local process it spawns), the Ray trainer actors
(``megatron_agentrl.launch.ray_placement.TrainWorker``) and ``torchrun``/``srun`` (``torchrun
--nproc-per-node N -m megatron_agentrl.cli train --config run.yaml [key=value ...]``) all end in
:func:`train_rank`. The rank and the torch.distributed rendezvous come from the environment
(``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``, ``MASTER_PORT``); everything else,
the URLs of engines and controller started elsewhere included, comes in the config and overrides.

This module sits above the pipeline and below every launcher: the pipeline never imports it.
"""
from __future__ import annotations

import logging
import os
import sys
import warnings
from typing import Any

from megatron_agentrl.config import load_config
from megatron_agentrl.sigterm import sigterm_raises

#: MKL's conditional bitwise reproducibility, strict mode: the CPU math library's results stop depending on where
#: the allocator placed the tensors. Without it one config and seed gave two different warm-ups on one machine,
#: decided by the heap's layout (docs/training.md, the warm-up); a user's own MKL_CBWR (even empty) is kept.
MKL_CBWR = "AUTO,STRICT"


def reproducible_cpu_math() -> None:
    """``MKL_CBWR=AUTO,STRICT`` unless already set: call before torch loads (MKL reads it once, at its start)."""
    os.environ.setdefault("MKL_CBWR", MKL_CBWR)


def setup_logging(rank: int) -> None:
    """Log INFO on rank 0 and WARNING on the other ranks, one plain line per record on stdout;
    mute third-party noise."""
    level = logging.INFO if rank == 0 else logging.WARNING
    fmt = "%(asctime)s " + (f"[rank {rank}] " if rank else "") + "%(message)s"
    logging.basicConfig(level=level, format=fmt, datefmt="%H:%M:%S", stream=sys.stdout, force=True)
    for noisy in ("megatron", "torch.distributed", "matplotlib", "PIL"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    # megatron-core warns on every CPU run, at import, about optional CUDA-only extras
    # (TransformerEngine, Apex, CUDA graphs): set before the pipeline imports it
    warnings.filterwarnings("ignore", message=".*Apex (is|are) not installed.*")
    warnings.filterwarnings("ignore", message=".*cuda_graph_scope.*|.*full scope is deprecated.*")
    # torch 2.13 renamed the flat-tensor collectives; megatron-core still calls them by their old names
    warnings.filterwarnings("ignore", category=FutureWarning,
                            message=r".*distributed\.(reduce_scatter_tensor|all_gather_into_tensor)` is deprecated.*")
    # and its distributed checkpoints are ShardedTensors, which torch's checkpoint loader warns about on every load
    warnings.filterwarnings("ignore", category=FutureWarning, message=r".*Please use DTensor instead.*")


def train_rank(config: str, overrides: list[str], evaluate_only: bool = False) -> dict[str, Any]:
    """Train this process's rank of the run of YAML ``config`` with ``key=value`` ``overrides`` (with
    ``evaluate_only``: evaluate its weights without training, ``agentrl eval``).

    Returns the run's summary (the evaluation's record) on rank 0, ``{}`` on the other ranks. Raises ConfigError
    for a bad config or override.
    """
    # torch and megatron-core load only here, when a rank trains: `agentrl --help` and the Ray
    # driver, which import this module, stay light
    reproducible_cpu_math()
    setup_logging(int(os.environ.get("RANK", 0)))
    from megatron_agentrl.pipeline.loop import run_evaluation, run_training

    with sigterm_raises(_stop_on_sigterm):  # Ray actors run outside the main thread and handle it themselves
        return (run_evaluation if evaluate_only else run_training)(load_config(config, overrides))


def _stop_on_sigterm(signum: int) -> SystemExit:
    """SIGTERM (a scheduler's preemption or time limit, ``kill``) ends the run through its cleanup (env sessions
    ended, the tasks' containers removed, the metrics flushed) instead of at once; exit status 143. A rank
    blocked inside a collective sees it only when the call returns: the sender's SIGKILL that follows ends it."""
    logging.getLogger(__name__).warning("SIGTERM: stopping the run (its cleanup runs; SIGKILL ends it at once)")
    return SystemExit(128 + signum)
