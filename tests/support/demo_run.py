"""``agentrl train`` on the demo's config (examples/configs/tiny_cpu.yaml) shrunk to seconds, in a subprocess."""
from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

DEMO = "examples/configs/tiny_cpu.yaml"
# SFT (2 steps, 1 of them short-format) and 2 RL steps of 2 prompts x 2 samples of at most 2 turns, evaluation on
# 2 samples per task
SHRUNK = ["sft.steps=2", "sft.short_format_steps=1", "sft.batch_size=4", "train.steps=2", "train.micro_batch_size=4",
          "rollout.prompts_per_step=2", "rollout.samples_per_prompt=2", "rollout.max_turns=2",
          "rollout.max_new_tokens=8", "eval.samples_per_task=2"]
TINY_MODEL = ["model.arch.hidden_size=32", "model.arch.intermediate_size=64", "model.arch.num_hidden_layers=2"]


def train_demo(out: Path, nproc: int, *overrides: str) -> subprocess.CompletedProcess:
    """``agentrl train --config DEMO --nproc nproc`` shrunk (``SHRUNK``), writing to ``out``, with ``overrides``
    (5 minutes at most); checks that it succeeded."""
    cmd = [sys.executable, "-m", "megatron_agentrl.cli", "train", "--config", DEMO, "--nproc", str(nproc),
           f"output_dir={out}", *SHRUNK, *overrides]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


def trained_rl_rows(out: Path) -> list[dict]:
    """The RL rows of the run's metrics.jsonl, once checked: two RL steps, and every SFT and RL step with a finite loss
    and grad norm over some tokens."""
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    rl = [r for r in rows if r["phase"] == "rl"]
    assert [r["step"] for r in rl] == [1, 2]
    assert all(math.isfinite(r["loss"]) and math.isfinite(r["grad_norm"]) and r["num_tokens"] > 0
               for r in rows if r["phase"] in ("sft", "rl"))
    return rl
