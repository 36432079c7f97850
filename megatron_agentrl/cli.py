"""The ``agentrl`` command line: ``agentrl train --config run.yaml [key=value ...]`` and the other subcommands.

``agentrl train`` runs the training of :mod:`megatron_agentrl.train_rank` in this process, in
``--nproc`` local processes, or in Ray actors (``ray.enabled`` / ``ray.address``). Under
``torchrun`` or ``srun`` (``WORLD_SIZE`` set) each process trains its own rank::

    torchrun --nproc-per-node 2 -m megatron_agentrl.cli train --config run.yaml parallel.tp=2
"""
from __future__ import annotations

import argparse
import logging
import os
import sys

from megatron_agentrl.config import ConfigError, load_config
from megatron_agentrl.train_rank import setup_logging, train_rank

logger = logging.getLogger("agentrl")


def _train_spawned(rank: int, world: int, port: int, config: str, overrides: list[str]) -> None:
    """One of the local processes of ``agentrl train --nproc N``: rank ``rank`` of ``world``."""
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    train_rank(config, overrides)


def cmd_train(args: argparse.Namespace) -> int:
    """Validate the config, then train on this process or on ``--nproc`` local processes."""
    from megatron_agentrl.hf_io import check_model_paths

    cfg = load_config(args.config, args.overrides)  # fail fast, before spawning anything
    check_model_paths(cfg.model)
    # ray.enabled / ray.address: the trainer ranks are Ray actors
    if cfg.ray.active and "WORLD_SIZE" not in os.environ:
        from megatron_agentrl.launch.ray_placement import run_on_ray

        setup_logging(0)
        run_on_ray(cfg, args.config, args.overrides)
        return 0
    nproc = args.nproc or cfg.parallel.tp * cfg.parallel.pp
    if "WORLD_SIZE" in os.environ or nproc == 1:  # under torchrun/srun, or one process
        train_rank(args.config, args.overrides)
        return 0
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.start_processes(_train_spawned, args=(nproc, port, args.config, args.overrides), nprocs=nproc,
                       start_method="spawn")
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
