"""The terminal demo at the scale of its config (``slow``): one seed of examples/configs/tiny_cpu_terminal.yaml
through the controller and a worker per family on a private dockerd, at least 256 containers live at once during
RL and none left after. (The smoke run, a few containers, is in tests/e2e/test_bench_scripts.py.)"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_terminal_demo_one_seed_at_scale(tmp_path: Path) -> None:
    out = tmp_path / "terminal_demo.json"
    proc = subprocess.run([sys.executable, "bench/terminal_demo.py", "--seeds", "1", "--out", str(out)], cwd=REPO,
                          capture_output=True, text=True, timeout=4 * 3600, env={**os.environ})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rec = json.loads(out.read_text())
    if "skipped" in rec:
        pytest.skip(rec["skipped"])
    assert rec["peak_during_rl"]["live"] >= 256 and rec["leaked_containers"] == 0, rec
