"""torch.distributed + megatron-core model-parallel setup for the trainer.

``initialize_parallel(tp, pp, seed)`` works in three situations:

* under ``torchrun`` / any launcher that sets ``RANK`` and ``WORLD_SIZE`` (+ ``MASTER_ADDR``,
  ``MASTER_PORT``): ``env://`` rendezvous;
* in a plain single process: a one-process group on a free local TCP port;
* when torch.distributed is already initialized by the caller: it is reused.

Backend: ``nccl`` when CUDA is available, else ``gloo`` (with the CPU bridge installed).
World size = tp * pp * cp * dp; megatron's rank order is ``tp-cp-ep-dp-pp`` (TP fastest). Expert
parallelism (``ep``) splits the experts of MoE layers over ``ep`` ranks carved out of each stage's
``tp * cp * dp`` ranks; experts are not split by TP (expert tensor parallel size 1).
"""
from __future__ import annotations

import datetime
import logging
import math
import os
import random

import torch
import torch.distributed as dist

from env_controller.http.net import free_port
from megatron_agentrl.config import ConfigError, ParallelConfig
from megatron_agentrl.distributed import destroy_rank0_group, init_rank0_group
from megatron_agentrl.megatron import cpu_bridge

logger = logging.getLogger(__name__)

_OWNS_PROCESS_GROUP = False


def _init_torch_distributed(timeout_s: float) -> None:
    global _OWNS_PROCESS_GROUP
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    timeout = datetime.timedelta(seconds=timeout_s)
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        if torch.cuda.is_available():
            local_rank = int(os.environ.get("LOCAL_RANK", rank % max(1, torch.cuda.device_count())))
            torch.cuda.set_device(local_rank)
        for var in ("MASTER_ADDR", "MASTER_PORT"):
            if var not in os.environ:
                raise ConfigError(
                    f"RANK/WORLD_SIZE are set but {var} is not; launch with torchrun or set {var}"
                )
        dist.init_process_group(backend, init_method="env://", rank=rank, world_size=world, timeout=timeout)
    else:
        if torch.cuda.is_available():
            torch.cuda.set_device(0)
        port = free_port()
        dist.init_process_group(
            backend, init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1, timeout=timeout
        )
    _OWNS_PROCESS_GROUP = True
    logger.info("torch.distributed initialised: backend=%s rank=%d world=%d", backend, dist.get_rank(),
                dist.get_world_size())


def initialize_parallel(tp: int, pp: int, seed: int, timeout_s: float = 600, cp: int = 1, ep: int = 1,
                        rank0_timeout_s: float = 7200) -> None:
    """Initialise torch.distributed (if needed) and megatron's TP/PP/CP/EP/DP groups, then seed.

    Args:
        tp: tensor-parallel size; pp: pipeline-parallel size; cp: context-parallel size (each
            sequence split over ``cp`` ranks); ep: expert-parallel size (MoE models). The world size must
            be a multiple of the layout's smallest world (``ParallelLayout.check_world``);
            data-parallel size = world / (tp * pp * cp).
        seed: base seed. Python/torch RNGs get ``seed + 100 * pp_rank`` (as megatron's
            training loop does, so stages do not init layers identically); megatron's
            model-parallel RNG tracker is seeded with ``seed`` (offset per TP rank by megatron).
        timeout_s: timeout of the process group's collectives, seconds (``parallel.collective_timeout_s``).
        rank0_timeout_s: how long the other ranks wait for rank 0's own work, seconds
            (``parallel.rank0_timeout_s``; :mod:`megatron_agentrl.distributed`).

    Raises:
        ConfigError (a ValueError) when a size is not a positive integer, the layout does not divide the world
        size, or megatron was already initialised with different sizes.
    """
    from megatron.core import parallel_state, tensor_parallel

    layout = ParallelConfig(tp=tp, pp=pp, cp=cp, ep=ep)
    cpu_bridge.install()
    if not dist.is_initialized():
        _init_torch_distributed(timeout_s)
        init_rank0_group(rank0_timeout_s)
    world = dist.get_world_size()
    layout.check_world(world, "the world size")
    if parallel_state.model_parallel_is_initialized():
        cur = (
            parallel_state.get_tensor_model_parallel_world_size(),
            parallel_state.get_pipeline_model_parallel_world_size(),
            parallel_state.get_context_parallel_world_size(),
            parallel_state.get_expert_model_parallel_world_size(),
        )
        if cur != (tp, pp, cp, ep):
            raise ConfigError(
                f"megatron is already initialised with tp={cur[0]}, pp={cur[1]}, cp={cur[2]}, ep={cur[3]}, "
                f"not tp={tp}, pp={pp}, cp={cp}, ep={ep}; call destroy_parallel() first"
            )
    else:
        parallel_state.initialize_model_parallel(
            tensor_model_parallel_size=tp,
            pipeline_model_parallel_size=pp,
            context_parallel_size=cp,
            expert_model_parallel_size=ep,
            expert_tensor_parallel_size=1,
            distributed_timeout_minutes=max(1, math.ceil(timeout_s / 60)),
            create_gloo_process_groups=torch.cuda.is_available(),
        )
    pp_rank = parallel_state.get_pipeline_model_parallel_rank()
    random.seed(seed + 100 * pp_rank)
    torch.manual_seed(seed + 100 * pp_rank)
    tensor_parallel.model_parallel_cuda_manual_seed(seed)
    logger.info(
        "megatron parallel: tp=%d pp=%d cp=%d ep=%d dp=%d (rank %d: tp_rank=%d pp_rank=%d cp_rank=%d ep_rank=%d "
        "dp_rank=%d)",
        tp, pp, cp, ep, world // (tp * pp * cp), dist.get_rank(),
        parallel_state.get_tensor_model_parallel_rank(), pp_rank,
        parallel_state.get_context_parallel_rank(), parallel_state.get_expert_model_parallel_rank(),
        parallel_state.get_data_parallel_rank(),
    )


def destroy_parallel() -> None:
    """Tear down megatron's groups and, if :func:`initialize_parallel` created it, the process group."""
    global _OWNS_PROCESS_GROUP
    from megatron.core import parallel_state

    parallel_state.destroy_model_parallel()
    if _OWNS_PROCESS_GROUP and dist.is_initialized():
        destroy_rank0_group()
        dist.destroy_process_group()
    _OWNS_PROCESS_GROUP = False
