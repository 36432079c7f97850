"""Running a recipe script's ``--check`` and reading its report, and its submit mode with a stand-in for ``agentrl``
(shared by the recipe tests)."""
from __future__ import annotations

import os
import shutil
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
    real = os.path.realpath(ROOT / ".venv" / "bin" / "python") if (ROOT / ".venv").is_dir() else shutil.which("python3")
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
