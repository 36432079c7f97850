"""Helpers shared by the bench scripts."""
from __future__ import annotations

import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def git_commit() -> str:
    """The short commit hash of the repository the benchmark ran from ("unknown" outside git)."""
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True,
                              timeout=10).stdout.strip() or "unknown"
    except Exception:  # noqa: BLE001 - informational
        return "unknown"
