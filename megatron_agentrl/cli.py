"""The ``agentrl`` command line: ``agentrl train --config run.yaml [key=value ...]``."""
from __future__ import annotations

import argparse
import logging
import os
import sys

from megatron_agentrl.config import ConfigError, load_config

logger = logging.getLogger("agentrl")


def _setup_logging(rank: int) -> None:
    """INFO on rank 0, WARNING elsewhere; one plain line per record; third-party noise muted."""
    import warnings

    level = logging.INFO if rank == 0 else logging.WARNING
    fmt = "%(asctime)s " + (f"[rank {rank}] " if rank else "") + "%(message)s"
    logging.basicConfig(level=level, format=fmt, datefmt="%H:%M:%S", stream=sys.stdout, force=True)
    for noisy in ("megatron", "torch.distributed", "matplotlib", "PIL"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    # megatron-core warns on every CPU run about optional CUDA-only extras (Apex, CUDA graphs)
    warnings.filterwarnings("ignore", message=".*Apex is not installed.*")
    warnings.filterwarnings("ignore", message=".*cuda_graph_scope.*|.*full scope is deprecated.*")


def _train_worker(rank: int, world: int, port: int, config: str, overrides: list[str]) -> None:
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    _train(config, overrides)


def _train(config: str, overrides: list[str]) -> None:
    from megatron_agentrl.pipeline.loop import run_training

    _setup_logging(int(os.environ.get("RANK", 0)))
    run_training(load_config(config, overrides))


def cmd_train(args: argparse.Namespace) -> int:
    """Validate the config, then train on this process or on ``--nproc`` local processes."""
    from megatron_agentrl.hf_io import check_model_paths

    cfg = load_config(args.config, args.overrides)  # fail fast, before spawning anything
    check_model_paths(cfg.model)
    if cfg.ray.active and "WORLD_SIZE" not in os.environ:  # ray.enabled / ray.address: the trainer ranks are Ray actors
        from megatron_agentrl.launch.ray_placement import run_on_ray

        _setup_logging(0)
        run_on_ray(cfg, args.config, args.overrides)
        return 0
    nproc = args.nproc or cfg.parallel.tp * cfg.parallel.pp
    if "WORLD_SIZE" in os.environ or nproc == 1:  # under torchrun/srun, or one process
        _train(args.config, args.overrides)
        return 0
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.start_processes(_train_worker, args=(nproc, port, args.config, args.overrides), nprocs=nproc, start_method="spawn")
    return 0


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``agentrl`` console script."""
    parser = argparse.ArgumentParser(prog="agentrl", description="Agentic RL on megatron-core (AgentRL).")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("train", help="train a policy from a YAML config")
    p.add_argument("--config", required=True, help="YAML config, e.g. examples/configs/tiny_cpu.yaml")
    p.add_argument("--nproc", type=int, default=0, help="local processes to spawn (default: parallel.tp * parallel.pp)")
    p.add_argument("overrides", nargs="*", help="key=value overrides, e.g. train.steps=5 parallel.tp=2")
    p.set_defaults(func=cmd_train)
    from env_controller.cli import register as register_env_commands

    register_env_commands(sub)  # agentrl controller / agentrl worker
    from megatron_agentrl.convert.cli import register as register_convert_commands

    register_convert_commands(sub)  # agentrl convert hf-to-megatron | megatron-to-hf
    from megatron_agentrl.launch import register as register_launch_commands

    register_launch_commands(sub)  # agentrl slurm submit | status | cancel, agentrl plan
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except (ConfigError, FileNotFoundError) as e:
        print(f"agentrl: error: {e}", file=sys.stderr)
        return 2
    except RuntimeError as e:  # a launch failure (Ray placement, a lost node, SLURM): one clear line
        from megatron_agentrl.launch.ray_placement import RayLaunchError
        from megatron_agentrl.launch.slurm import SlurmError

        if not isinstance(e, (RayLaunchError, SlurmError)):
            raise
        print(f"agentrl: error: {e}", file=sys.stderr)
        return 3


if __name__ == "__main__":
    sys.exit(main())
