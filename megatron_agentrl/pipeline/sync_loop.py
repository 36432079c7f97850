"""The training entry point (kept under its original name): ``run_training(cfg)``.

The synchronous GRPO loop now shares its code with the asynchronous one; both live in
:mod:`megatron_agentrl.pipeline.loop` and ``pipeline.mode`` (sync | async) chooses. This module
re-exports the public names so existing imports keep working.
"""
from __future__ import annotations

from megatron_agentrl.pipeline.loop import RolloutSide, evaluate, run_training

__all__ = ["RolloutSide", "evaluate", "run_training"]
