"""``agentrl doctor`` (megatron_agentrl/launch/doctor.py) on a CPU-only machine: it names what a GPU run lacks, each
with its fix, and exits 1; the SGLang item is checked in the engines' interpreter (fake interpreters here)."""
from __future__ import annotations

import json
import re
import subprocess
import sys
import warnings
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from megatron_agentrl.launch import doctor
from megatron_agentrl.launch.check import FAIL, OK, UNVERIFIED, CheckReport
from rollout_sglang.testing.sglang_contract import SGLANG_PIN, find_wheel
from rollout_sglang.testing.sglang_pins import dist_requirements

ROOT = Path(__file__).resolve().parents[2]
CPU_ONLY = torch.version.cuda is None
HAVE_SGLANG = doctor.dist_version("sglang") is not None
cpu_machine = pytest.mark.skipif(not CPU_ONLY or HAVE_SGLANG,
                                 reason="checks what doctor says on a CPU-only machine without SGLang")


def _items(report: CheckReport) -> dict[str, tuple[str, str]]:
    return {item: (status, detail) for status, item, detail in report.items}


def _fake_python(tmp_path: Path, body: str, name: str = "python") -> str:
    """An executable that stands in for an engine interpreter: ``body`` is its shell script."""
    path = tmp_path / name
    path.write_text("#!/bin/sh\n" + body + "\n")
    path.chmod(0o755)
    return str(path)


@pytest.fixture(scope="module")
def report() -> CheckReport:
    return doctor.run_doctor(timeout_s=60)


@cpu_machine
def test_a_cpu_machine_fails_naming_each_gap_with_its_fix(report):
    items = _items(report)
    failed = {item for _, item, _ in report.failed}
    assert {"torch", "CUDA devices", "NCCL", "SGLang"} <= failed
    status, detail = items["torch"]
    assert f"CPU-only torch {torch.__version__}" in detail and "make install-gpu" in detail
    assert f"--index-url {doctor.TORCH_INDEX}" in detail and f"torch=={doctor.GPU_TORCH}" in detail
    status, detail = items["CUDA devices"]
    assert detail.startswith("none") and "CUDA_VISIBLE_DEVICES" in detail and "fix:" in detail
    status, detail = items["SGLang"]
    assert "not importable in this interpreter" in detail and sys.executable in detail
    assert "No module named 'sglang'" in detail and "pip install -e '.[sglang]'" in detail
    assert "make install-gpu" in detail
    # present here, and pinned: ok
    assert items["python"][0] == OK and items["megatron-core"][0] == OK
    # the optional parts of the gpu extra: reported, not failed (without --strict)
    if doctor.dist_version("transformer-engine") is None:
        assert items["Transformer Engine"][0] == UNVERIFIED and "local layers" in items["Transformer Engine"][1]
    text = report.format()
    assert text.splitlines()[-1].startswith("check FAILED: ")
    assert all(re.match(r"\[ *(ok|not verified here|FAIL)\] ", ln) for ln in text.splitlines()[1:len(report.items) + 1])


@cpu_machine
def test_the_command_exits_1_and_prints_one_line_per_item(tmp_path):
    no_sglang = _fake_python(tmp_path, "echo \"ModuleNotFoundError: No module named 'sglang'\" >&2; exit 1")
    for argv, engine in (([], sys.executable), (["--engine-python", no_sglang], no_sglang)):
        proc = subprocess.run([sys.executable, "-m", "megatron_agentrl.cli", "doctor", *argv], capture_output=True,
                              text=True, timeout=120, cwd=ROOT)
        assert proc.returncode == 1, proc.stdout + proc.stderr
        lines = proc.stdout.strip().splitlines()
        assert lines[-1].startswith("check FAILED: ") and "SGLang" in lines[-1]
        by_item = {ln.split("]", 1)[1].split()[0]: ln for ln in lines if ln.startswith("[")}
        assert "FAIL" in by_item["torch"] and "make install-gpu" in by_item["torch"]
        assert "FAIL" in by_item["CUDA"]
        assert "FAIL" in by_item["SGLang"] and engine in by_item["SGLang"]
    assert f"{no_sglang} -m pip install 'sglang=={SGLANG_PIN}'" in by_item["SGLang"]

    proc = subprocess.run([sys.executable, "-m", "megatron_agentrl.cli", "doctor", "--json"], capture_output=True,
                          text=True, timeout=120, cwd=ROOT)
    assert proc.returncode == 1
    out = json.loads(proc.stdout)
    assert out["ok"] is False
    assert {i["item"] for i in out["items"] if i["status"] == FAIL} >= {"torch", "CUDA devices", "SGLang"}


@cpu_machine
def test_a_real_interpreter_without_sglang_as_the_engines(tmp_path):
    base = getattr(sys, "_base_executable", None)
    if not base or Path(base) == Path(sys.executable):
        pytest.skip("no base interpreter apart from this one")
    report = CheckReport()
    doctor.check_sglang(report, doctor.project_requirements(), base, timeout_s=60)
    ((status, item, detail),) = report.items
    if status == OK:
        pytest.skip(f"{base} has sglang")
    assert status == FAIL and f"not importable in the engine interpreter {base}" in detail
    assert "No module named 'sglang'" in detail and f"{base} -m pip install 'sglang=={SGLANG_PIN}'" in detail


def test_an_engine_interpreter_with_the_pinned_sglang_is_ok(tmp_path):
    py = _fake_python(tmp_path, f"echo {SGLANG_PIN}")
    report = CheckReport()
    doctor.check_sglang(report, doctor.project_requirements(), py, timeout_s=30)
    assert report.items == [(OK, "SGLang", f"sglang {SGLANG_PIN} in the engine interpreter {py} (pinned {SGLANG_PIN})")]


def test_an_engine_interpreter_with_another_sglang_fails_naming_the_pin(tmp_path):
    py = _fake_python(tmp_path, "echo 0.5.22; echo 2.14.1")
    report = CheckReport()
    doctor.check_sglang(report, doctor.project_requirements(), py, timeout_s=30)
    ((status, item, detail),) = report.items
    assert status == FAIL and "sglang 0.5.22" in detail and f"sglang=={SGLANG_PIN}" in detail
    assert f"{py} -m pip install 'sglang=={SGLANG_PIN}'" in detail


def test_an_engine_interpreter_that_is_missing_or_hangs_fails(tmp_path):
    report = CheckReport()
    reqs = doctor.project_requirements()
    doctor.check_sglang(report, reqs, str(tmp_path / "nowhere" / "python"), timeout_s=30)
    doctor.check_sglang(report, reqs, _fake_python(tmp_path, "exec sleep 30", "slow"), timeout_s=0.5)
    (s1, _, d1), (s2, _, d2) = report.items
    assert s1 == FAIL and "cannot run" in d1
    assert s2 == FAIL and "did not finish in 0.5 s" in d2


def test_python_other_than_3_11_fails():
    report = CheckReport()
    doctor.check_python(report, (3, 12, 1))
    ((status, _, detail),) = report.items
    assert status == FAIL and "3.12.1" in detail and "needs 3.11" in detail


@pytest.mark.skipif(doctor.dist_version("transformer-engine") is not None, reason="Transformer Engine is installed")
def test_strict_fails_on_the_optional_gpu_extra():
    report = CheckReport()
    reqs = doctor.project_requirements()
    doctor.check_transformer_engine(report, reqs, strict=True)
    assert report.items[0][0] == FAIL and report.items[0][1] == "Transformer Engine"


def test_the_pins_agree_with_setup_the_makefile_and_the_sglang_wheel():
    reqs = doctor.project_requirements()
    assert doctor.exact_pin(reqs.get("sglang")) == SGLANG_PIN
    assert doctor.exact_pin(reqs.get("megatron-core")) == "0.16.1"
    makefile = (ROOT / "Makefile").read_text()
    assert re.search(rf"^TORCH_INDEX \?= {re.escape(doctor.TORCH_INDEX)}$", makefile, re.M)
    assert re.search(rf"^GPU_TORCH \?= {re.escape(doctor.GPU_TORCH)}$", makefile, re.M)
    wheel = find_wheel()
    if wheel is None:
        pytest.skip("the pinned SGLang wheel is not in the cache (.ci/run downloads it)")
    torch_pins = [r for r in dist_requirements(wheel) if r.name == "torch"]
    assert [doctor.exact_pin(r) for r in torch_pins] == [doctor.GPU_TORCH]


def _fake_torch(gpus: int, warning: str | None = None):
    """A stand-in for a CUDA build of torch that sees ``gpus`` H200s (no GPU here to see a real one)."""
    def is_available():
        if warning:
            warnings.warn(warning, UserWarning, stacklevel=1)
        return gpus > 0

    props = SimpleNamespace(name="NVIDIA H200", total_memory=140 * 1024**3, major=9, minor=0)
    cuda = SimpleNamespace(is_available=is_available, device_count=lambda: gpus,
                           get_device_properties=lambda i: props, nccl=SimpleNamespace(version=lambda: (2, 30, 7)))
    dist = SimpleNamespace(is_available=lambda: True, is_nccl_available=lambda: True)
    return SimpleNamespace(__version__="2.14.1+cu130", version=SimpleNamespace(cuda="13.0"), cuda=cuda,
                           distributed=dist)


def test_the_gpu_items_of_a_cuda_torch(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")
    report = CheckReport()
    doctor.check_cuda(report, _fake_torch(2))
    doctor.check_nccl(report, _fake_torch(2))
    assert report.items == [
        (OK, "CUDA devices", "2 GPU(s): 2 x NVIDIA H200 (140.0 GiB, compute capability 9.0) [0,1] "
                             "(CUDA_VISIBLE_DEVICES '0,1')"),
        (OK, "NCCL", "2.30.7 (torch's); engines in another interpreter need the same major version")]
    report = CheckReport()
    doctor.check_cuda(report, _fake_torch(0, "CUDA initialization: The NVIDIA driver on your system is too old"))
    ((status, _, detail),) = report.items
    assert status == FAIL and "sees no GPU" in detail and "driver on your system is too old" in detail
    assert "nvidia-smi" in detail and "CUDA_VISIBLE_DEVICES '0,1'" in detail
