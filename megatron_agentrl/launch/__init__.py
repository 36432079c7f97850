"""Cluster launch: Ray placement (``ray_placement``), SLURM submission (``slurm``), the memory
plan of a layout (``plan``) and the pre-flight check of a run (``check``).

Importing this package imports neither Ray nor torch; :func:`register` adds the ``agentrl slurm``
and ``agentrl plan`` subcommands.
"""
from __future__ import annotations

import argparse


def register(sub: argparse._SubParsersAction) -> None:
    """Add ``slurm submit | status | cancel`` and ``plan`` to the ``agentrl`` subparsers ``sub``."""
    from megatron_agentrl.launch import check, slurm

    slurm.register(sub)
    check.register(sub)
