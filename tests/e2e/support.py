"""Running a recipe script's ``--check`` and reading its report, and its submit mode with a stand-in for ``agentrl``
(shared by the recipe tests); starting a process, reading a server's JSON and checking a finished run (the fault
tests)."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import urllib.request
from collections.abc import Iterable
from pathlib import Path

from env_controller.servers.process import start_process

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


def check_passed(proc: subprocess.CompletedProcess, verified: Iterable[str]) -> tuple[dict[str, str], dict[str, str]]:
    """The check passed, with no FAIL line and each of ``verified`` reported ok; returns its "ok" and its "not
    verified here" lines, by item."""
    out = proc.stdout
    assert proc.returncode == 0, out + proc.stderr
    assert "check passed" in out.splitlines()[-1]
    ok, unverified = report_lines(out, "ok"), report_lines(out, "not verified here")
    assert not report_lines(out, "FAIL")
    for item in verified:
        assert item in ok, f"{item} not verified:\n{out}"
    return ok, unverified


def check_failed(proc: subprocess.CompletedProcess, item: str, needle: str) -> None:
    """The check failed on ``item``, with ``needle`` in its FAIL line, and said so last."""
    assert proc.returncode == 1, proc.stdout + proc.stderr
    failed = report_lines(proc.stdout, "FAIL")
    assert item in failed and needle in failed[item], proc.stdout
    assert proc.stdout.splitlines()[-1].startswith("check FAILED")


def agentrl_stub(tmp_path: Path) -> tuple[Path, Path]:
    """A stand-in for ``AGENTRL_PYTHON``: it writes the arguments of each ``-m megatron_agentrl.cli`` call as a line
    of a log, and runs anything else with the real python; returns the stub and the log."""
    log = tmp_path / "agentrl.log"
    stub = tmp_path / "python"
    # the venv's own python path, not its symlink's target: the target alone runs outside the venv
    real = str(ROOT / ".venv" / "bin" / "python") if (ROOT / ".venv").is_dir() else shutil.which("python3")
    stub.write_text(f'#!/usr/bin/env bash\nif [ "$1" = -m ] && [ "$2" = megatron_agentrl.cli ]; then\n'
                    f'  shift 2; printf "%s\\n" "$*" >> "{log}"; exit 0\nfi\nexec "{real}" "$@"\n')
    stub.chmod(0o755)
    return stub, log


def converted_then_trained(log: Path, checkpoint: str) -> str:
    """The stub's log holds a conversion, a pre-flight check and a submission, the last two given
    ``model.megatron_checkpoint=checkpoint`` (and no other); returns the conversion's arguments."""
    convert, check, submit = log.read_text().splitlines()
    assert check.startswith("plan --check") and submit.startswith("slurm submit")
    for line in (check, submit):
        given = [a.split("=", 1)[1] for a in line.split() if a.startswith("model.megatron_checkpoint=")]
        assert given and set(given) == {checkpoint}, line
    return convert


def get_json(url: str) -> dict:
    """``GET url`` (5 s at most), its JSON body."""
    with urllib.request.urlopen(url, timeout=5) as r:
        return json.loads(r.read())


def start_python(processes: list[subprocess.Popen[bytes]], log: Path, *args: str) -> subprocess.Popen[bytes]:
    """``python args...`` from the repository root (on PYTHONPATH), its output appended to ``log``; added to
    ``processes`` (the fixture that kills them at teardown)."""
    proc = start_process([sys.executable, *args], log, env={**os.environ, "PYTHONPATH": str(ROOT)}, cwd=ROOT)
    processes.append(proc)
    return proc


def finished_without_training_infra(train: subprocess.Popen, log_path: Path, out: Path, steps: int,
                                    timeout_s: float) -> tuple[str, list[dict]]:
    """Wait for the training run ``train``; assert it succeeded, recorded RL steps 1..``steps`` once each in
    ``out/batches.jsonl`` and trained no sample that an infrastructure failure ended. Returns its log and the rows."""
    from rollout_sglang.trajectory import INFRA_STATUSES

    train.wait(timeout_s)
    log = log_path.read_text(errors="replace")
    assert train.returncode == 0, log[-4000:]
    rows = [json.loads(x) for x in (out / "batches.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, steps + 1))
    statuses = [s for r in rows for s in r["statuses"]]
    assert statuses and not INFRA_STATUSES & set(statuses), statuses
    return log, rows
