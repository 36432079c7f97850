"""``run_distributed``'s ranks fork from a server started once, yet each call's ranks see the caller as it is at
that call: its environment and working directory, one thread each, and their own rank variables."""
from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.support.dist_utils import run_distributed


def _report(rank: int, world: int) -> tuple:
    import torch

    return os.environ.get("AGENTRL_TEST_MARK"), os.getcwd(), torch.get_num_threads(), os.environ["RANK"], world


def test_ranks_see_the_callers_environment_and_directory_of_the_call(monkeypatch: pytest.MonkeyPatch,
                                                                     tmp_path: Path) -> None:
    monkeypatch.delenv("AGENTRL_TEST_MARK", raising=False)
    assert run_distributed(_report, 1)[0][0] is None  # the fork server runs from here on
    monkeypatch.setenv("AGENTRL_TEST_MARK", "set after the server started")
    monkeypatch.chdir(tmp_path)
    assert run_distributed(_report, 2) == [("set after the server started", str(tmp_path), 1, str(r), 2)
                                           for r in range(2)]
