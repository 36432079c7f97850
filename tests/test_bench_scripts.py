"""The GPU benchmark scripts run end to end in their CPU smoke modes (tiny sizes), write their JSON
and end with the ``name: value`` line that docs/BENCHMARKS.md quotes."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def _run(args: list[str], timeout_s: float = 120) -> list[str]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    proc = subprocess.run([sys.executable, *args], cwd=REPO, capture_output=True, text=True, timeout=timeout_s, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout.strip().splitlines()


def test_gpu_advantages_cpu_smoke(tmp_path):
    out = tmp_path / "adv.json"
    lines = _run(["bench/gpu_advantages.py", "--device", "cpu", "--tokens", "2e4,1e5", "--seq-len", "500",
                  "--warmup", "1", "--repeats", "2", "--out", str(out)])
    m = re.fullmatch(r"fused_norm_copy_bw_fraction_100k: (\d+\.\d+)", lines[-1])
    assert m and float(m.group(1)) > 0, lines[-3:]
    rec = json.loads(out.read_text())
    row = rec["results"]["100k"]
    assert row["tokens"] == 100_000 and row["rows"] == 200
    for name in ("copy", "fused", "previous", "unfused"):
        assert row[f"{name}_ms"] > 0
    # the correctness check ran against the loop on the smallest size
    assert rec["results"]["20k"]["max_abs_err_fused"] < 1e-4


def test_gpu_train_cpu_smoke(tmp_path):
    out = tmp_path / "train.json"
    lines = _run(["bench/gpu_train.py", "--device", "cpu", "--sizes", "tiny", "--seq-len", "32", "--batch", "4",
                  "--micro-batch", "2", "--prompt-len", "4", "--steps", "1", "--warmup", "1",
                  "--peak-tflops", "0.05", "--out", str(out)])
    m = re.fullmatch(r"gpu_mfu_tiny: (\d+\.\d+)", lines[-1])
    assert m and float(m.group(1)) > 0, lines[-3:]
    row = json.loads(out.read_text())["results"]["tiny"]
    for side in ("megatron", "transformers"):
        r = row[side]
        assert r["params"] == row["params"], (side, r["params"], row["params"])  # the FLOP count's N is the model's
        assert r["step_s"] > 0 and r["optimizer_s"] > 0 and r["forward_s"] > 0 and r["tokens_per_s"] > 0
        assert abs(r["mfu"] - row["flops_per_token"] * r["tokens_per_s"] / 0.05e12) < 1e-9
    assert row["megatron_over_transformers"] > 0
