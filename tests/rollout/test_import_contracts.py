"""The import contract that keeps test support apart names every module users import."""
from __future__ import annotations

import configparser
import pkgutil
from pathlib import Path

import rollout_sglang

ROOT = Path(__file__).resolve().parents[2]


def test_test_support_contract_lists_every_rollout_module():
    """A new module of rollout_sglang must join the contract, or it could import the SGLang stand-in unseen."""
    contracts = configparser.ConfigParser()
    contracts.read(ROOT / ".importlinter")
    sources = set(contracts["importlinter:contract:test-support-apart"]["source_modules"].split())
    modules = {f"rollout_sglang.{m.name}" for m in pkgutil.iter_modules(rollout_sglang.__path__)} - {
        "rollout_sglang.testing"}
    assert modules <= sources, f"add {sorted(modules - sources)} to the test-support-apart contract in .importlinter"
    assert {"megatron_agentrl", "env_controller"} <= sources
