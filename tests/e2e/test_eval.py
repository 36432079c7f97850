"""``agentrl eval``: a run's weights evaluated without training give the run's own evaluations, whichever form
they come in (its checkpoints, its HF export), and a config without weights is refused."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from tests.support.demo_run import DEMO, SHRUNK, TINY_MODEL, train_demo

# 4 held-out samples per task: the split must be the run's, so the run and its evaluations share it
COMMON = [*TINY_MODEL, "eval.samples_per_task=4"]


def _eval(out: Path, *source: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "megatron_agentrl.cli", "eval", "--config", DEMO, f"output_dir={out}", *SHRUNK,
           *COMMON, *source]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=300)


def _record(out: Path, *source: str, log: list[str] | None = None) -> dict:
    proc = _eval(out, *source)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    if log is not None:
        log.append(proc.stdout + proc.stderr)
    return json.loads((out / "eval" / "eval.json").read_text())


def test_eval_of_a_runs_weights_gives_the_runs_own_evaluation(tmp_path: Path) -> None:
    out = tmp_path / "run"
    train_demo(out, 1, "checkpoint.interval=2", "checkpoint.after_warmup=true", *COMMON)
    summary = json.loads((out / "summary.json").read_text())

    # the warm-up's checkpoint: the run's evaluation before RL to the last digit (there, as here, every slot of
    # the version pool held the weights evaluated, so every episode sampled on the same engine stream)
    warm = _record(out, f"checkpoint.resume={out / 'checkpoints' / 'step_000000'}")
    assert warm["step"] == 0 and warm["weight_version"] == 0 and "step_000000" in warm["weights"]
    assert warm["results"] == summary["before_rl"]
    # the last checkpoint and the HF export hold the same weights: the same figures
    final = _record(out, "checkpoint.resume=latest")
    assert final["step"] == 2 and final["weight_version"] == 2 and "step_000002" in final["weights"]
    assert _record(out, f"model.checkpoint={out / 'hf_export'}")["results"] == final["results"]
    # more held-out samples than the run's reach into its training samples: said
    log: list[str] = []
    wider = _record(out, "checkpoint.resume=latest", "eval.samples_per_task=5", log=log)
    assert wider["results"]["episodes/calc"] == 5.0
    assert "eval.samples_per_task=5 is more than the 4 the run held out" in log[0], log[0][-2000:]
    assert set(final["results"]) == set(summary["after_rl"])
    rows = [json.loads(line) for line in (out / "eval" / "metrics.jsonl").read_text().splitlines()]
    assert rows and all(r["phase"] == "eval" for r in rows)
    assert json.loads((out / "summary.json").read_text()) == summary  # the run's own files are untouched

    proc = _eval(out)  # no weights named
    assert proc.returncode == 2 and "agentrl eval: no weights to evaluate" in proc.stderr, proc.stderr[-2000:]
    proc = _eval(tmp_path / "empty", "checkpoint.resume=latest")  # nothing to resume
    assert proc.returncode == 2 and "checkpoint.resume=latest: no checkpoint under" in proc.stderr, proc.stderr[-2000:]
    proc = _eval(out, f"checkpoint.resume={out / 'hf_export'}")  # not a checkpoint folder
    assert proc.returncode == 2 and "not a checkpoint folder (no meta.json)" in proc.stderr, proc.stderr[-2000:]
