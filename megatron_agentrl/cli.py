"""The ``agentrl`` command line: ``agentrl train --config run.yaml [key=value ...]`` and the other subcommands.

``agentrl gateway --config run.yaml --port 8300`` serves the run's policy (``model.checkpoint``, or the SGLang
servers of ``rollout.engine_urls``) behind the OpenAI-compatible gateway, with the run's tasks as its
environment, until SIGINT or SIGTERM.

``agentrl eval --config run.yaml checkpoint.resume=latest`` (or ``model.checkpoint=<run>/hf_export``) plays the
held-out samples of the run's tasks on those weights and writes ``<output_dir>/eval/eval.json``, the same way.

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
from collections.abc import Callable, Sequence

from env_controller.cli import register as register_env_commands
from megatron_agentrl.config import Config, ConfigError, load_config
from megatron_agentrl.convert import cli as convert_cli
from megatron_agentrl.launch import check, doctor, slurm
from megatron_agentrl.launch.ray_placement import RayLaunchError, run_on_ray
from megatron_agentrl.launch.slurm import SlurmError
from megatron_agentrl.train_rank import reproducible_cpu_math, setup_logging, train_rank

logger = logging.getLogger("agentrl")

# a subcommand: its name, its help, the function that adds its options, the function that runs it (exit status)
Command = tuple[str, str, Callable[[argparse.ArgumentParser], None], Callable[[argparse.Namespace], int]]


def _train_spawned(rank: int, world: int, port: int, config: str, overrides: list[str],
                   evaluate_only: bool = False) -> None:
    """One of the local processes of ``agentrl train|eval --nproc N``: rank ``rank`` of ``world``."""
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    train_rank(config, overrides, evaluate_only)


def cmd_train(args: argparse.Namespace, evaluate_only: bool = False) -> int:
    """Validate the config, then train (``evaluate_only``: evaluate) on this process or on ``--nproc`` local
    processes."""
    reproducible_cpu_math()  # before torch loads, here and in the processes spawned below
    from megatron_agentrl.hf_io import check_model_paths

    cfg = load_config(args.config, args.overrides)  # fail fast, before spawning anything
    check_model_paths(cfg.model)
    if evaluate_only:
        from megatron_agentrl.pipeline.loop import evaluation_config

        cfg = evaluation_config(cfg)  # refuses a config without weights to evaluate
    if cfg.logging.wandb:
        from megatron_agentrl.metrics import require_wandb

        require_wandb()
    # ray.enabled / ray.address: the trainer ranks are Ray actors
    if cfg.ray.active and "WORLD_SIZE" not in os.environ:
        if evaluate_only:
            raise ConfigError("agentrl eval runs in local processes or under torchrun, not on Ray: set "
                              "ray.enabled=false (and leave ray.address empty)")
        setup_logging(0)
        run_on_ray(cfg, args.config, args.overrides)
        return 0
    problem = None if evaluate_only else cfg.engine_placement_problem(on_ray=False)
    if problem:
        raise ConfigError(problem)
    nproc = args.nproc or cfg.parallel.model_parallel_size
    if "WORLD_SIZE" in os.environ:
        cfg.check_world_size(int(os.environ["WORLD_SIZE"]), "WORLD_SIZE")
    else:
        cfg.check_world_size(nproc, f"--nproc {nproc}")
    if "WORLD_SIZE" in os.environ or nproc == 1:  # under torchrun/srun, or one process
        train_rank(args.config, args.overrides, evaluate_only)
        return 0
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.start_processes(_train_spawned, args=(nproc, port, args.config, args.overrides, evaluate_only), nprocs=nproc,
                       start_method="spawn")
    return 0


def cmd_eval(args: argparse.Namespace) -> int:
    """Evaluate a policy's weights on the held-out samples of the config's tasks, without training."""
    return cmd_train(args, evaluate_only=True)


def add_train_arguments(p: argparse.ArgumentParser) -> None:
    """The options of ``agentrl train``."""
    p.add_argument("--config", required=True, help="YAML config, e.g. examples/configs/tiny_cpu.yaml")
    p.add_argument("--nproc", type=int, default=0,
                   help="local processes to spawn (default: the smallest world of the layout, "
                        "parallel.tp * parallel.pp * parallel.cp; with parallel.ep, lcm(tp * cp, ep) * pp)")
    p.add_argument("overrides", nargs="*", help="key=value overrides, e.g. train.steps=5 parallel.tp=2")


def add_gateway_arguments(p: argparse.ArgumentParser) -> None:
    """The options of ``agentrl gateway``."""
    p.add_argument("--config", required=True, help="YAML config of a run: its model, engines, tasks, limits")
    p.add_argument("--host", default=None, help="address to bind (default gateway.host, 127.0.0.1; elsewhere needs "
                                                "a token)")
    p.add_argument("--port", type=int, default=None, help="port to bind (default gateway.port; 0 picks a free one)")
    p.add_argument("--token", default=None, help="bearer token every request must carry, the OpenAI api key of the "
                                                 "agents (default $<gateway.token_env>, AGENTRL_GATEWAY_TOKEN)")
    p.add_argument("overrides", nargs="*", help="key=value overrides, e.g. rollout.max_turns=8")


def cmd_gateway(args: argparse.Namespace) -> int:
    """Serve the gateway until SIGINT or SIGTERM."""
    import asyncio

    from megatron_agentrl.hf_io import check_model_paths

    overrides = list(args.overrides)
    overrides += [f"gateway.host={args.host}"] if args.host is not None else []
    overrides += [f"gateway.port={args.port}"] if args.port is not None else []
    cfg = load_config(args.config, overrides)
    check_model_paths(cfg.model)
    setup_logging(0)
    if args.token is not None:
        os.environ[cfg.gateway.token_env] = args.token  # one place decides: gateway_token below
    asyncio.run(_serve_gateway(cfg))
    return 0


async def _serve_gateway(cfg: Config) -> None:
    from env_controller.http.service import wait_for_signal
    from megatron_agentrl.hf_io import load_hf_config
    from megatron_agentrl.pipeline.rollout_side import (
        build_env,
        build_gateway,
        chat_template,
        gateway_token,
        standalone_pool,
    )
    from rollout_sglang.gateway import GatewayServer
    from rollout_sglang.tokenizer import load_tokenizer
    from rollout_sglang.weight_update.buckets import dtype_from_name

    token = gateway_token(cfg)
    tokenizer = load_tokenizer(cfg.model.tokenizer)
    hf_config = load_hf_config(cfg.model, tokenizer)
    template = chat_template(cfg, tokenizer, hf_config)
    env, _, _ = build_env(cfg)
    pool = standalone_pool(cfg, hf_config, dtype_from_name(cfg.model.dtype))
    gateway = build_gateway(cfg, pool, template, env, training=False)
    server = GatewayServer(gateway, token=token)
    try:
        await server.start()
    except (OSError, ValueError) as e:
        raise ConfigError(f"gateway: cannot serve on {cfg.gateway.host}:{cfg.gateway.port}: {e}") from None
    logger.info("gateway: POST %s/sessions opens a session (tasks: %s); SIGINT or SIGTERM stops it", server.url,
                ", ".join(s.name for s in cfg.tasks))
    try:
        await wait_for_signal()
    finally:
        await gateway.aclose()
        await server.stop()
        aclose = getattr(env, "aclose", None)
        if callable(aclose):
            await aclose()


def add_commands(sub: argparse._SubParsersAction, commands: Sequence[Command]) -> None:
    """Add one subcommand per ``(name, help, function adding its options, function running it)`` of
    ``commands`` to the argparse subparsers ``sub``."""
    for name, help_text, add_arguments, run in commands:
        p = sub.add_parser(name, help=help_text)
        add_arguments(p)
        p.set_defaults(func=run)


def build_parser() -> argparse.ArgumentParser:
    """The ``agentrl`` parser with every subcommand."""
    parser = argparse.ArgumentParser(prog="agentrl", description="Agentic RL on megatron-core (AgentRL).")
    sub = parser.add_subparsers(dest="command", required=True)
    add_commands(sub, [("train", "train a policy from a YAML config", add_train_arguments, cmd_train),
                       ("eval", "evaluate a policy on the tasks' held-out samples without training (a run's "
                                "checkpoint, HF or megatron weights)", add_train_arguments, cmd_eval),
                       ("gateway", "serve a run's policy behind the OpenAI-compatible gateway (any agent's "
                                   "completions become trajectories)", add_gateway_arguments, cmd_gateway)])
    register_env_commands(sub)  # agentrl controller / agentrl worker
    convert = sub.add_parser("convert", help="convert weights between Hugging Face and megatron checkpoints")
    add_commands(convert.add_subparsers(dest="convert_command", required=True), convert_cli.COMMANDS)
    submit = sub.add_parser("slurm", help="submit a training run to SLURM (Ray head + workers), follow or cancel it")
    add_commands(submit.add_subparsers(dest="slurm_command", required=True), slurm.COMMANDS)
    add_commands(sub, [("plan", "layout and per-GPU memory plan of a run; --check: pre-flight check",
                        check.add_plan_arguments, check.run_plan),
                       ("doctor", "check this node's GPU stack: CUDA torch, GPUs, NCCL, SGLang in the engines' "
                                  "interpreter, megatron-core, Transformer Engine", doctor.add_doctor_arguments,
                        doctor.cmd_doctor)])
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``agentrl`` console script."""
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (ConfigError, FileNotFoundError) as e:
        print(f"agentrl: error: {e}", file=sys.stderr)
        return 2
    except (RayLaunchError, SlurmError) as e:  # a launch failure (Ray placement, a lost node, SLURM): one clear line
        print(f"agentrl: error: {e}", file=sys.stderr)
        return 3


if __name__ == "__main__":
    sys.exit(main())
