"""Running a recipe script's ``--check`` and reading its report (shared by the recipe tests)."""
from __future__ import annotations

import os
import subprocess
from collections.abc import Iterable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def clean_env(drop: Iterable[str], **extra: str) -> dict[str, str]:
    """This process's environment without the variables ``drop`` (a recipe reads them), plus ``extra``."""
    dropped = set(drop)
    return {**{k: v for k, v in os.environ.items() if k not in dropped}, **extra}


def run_check(script: Path, env: dict[str, str], *overrides: str) -> subprocess.CompletedProcess:
    """``bash script --check overrides...`` from the repository root (3 minutes at most)."""
    return subprocess.run(["bash", str(script), "--check", *overrides], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=180)


def report_lines(out: str, status: str) -> dict[str, str]:
    """The check's lines of one status ("ok", "not verified here", "FAIL"), by item."""
    prefix = f"[{status:>17}] "
    return {line[len(prefix):].split("  ", 1)[0].strip(): line for line in out.splitlines() if line.startswith(prefix)}
