"""``agentrl doctor``: is this node's GPU stack what a GPU run needs?

::

    agentrl doctor [--engine-python PATH] [--strict] [--json] [--timeout S]

Run it on a compute node, in the environment the run will use (``make install-gpu`` builds it). One line
per item, then a summary, in the format of ``agentrl plan --check``
(:class:`~megatron_agentrl.launch.check.CheckReport`):

* **python**: 3.11 (setup.py's ``python_requires``);
* **torch**: its version against setup.py's range, and that it is a CUDA build; when SGLang is installed in
  this interpreter, the torch version SGLang pins;
* **CUDA devices**: what torch sees: count, name, memory and compute capability of each GPU;
* **NCCL**: in this torch build (the trainer ranks and the weight sync to the engines use it), its version;
* **SGLang**: importable in the interpreter the engines run (``--engine-python``; by default this one:
  under Ray the engine actors run ``python -m sglang.launch_server`` with the driver's interpreter), at
  the version the ``sglang`` extra pins;
* **megatron-core**: installed, at setup.py's pin;
* **Transformer Engine** and **nvidia-ml-py** (the ``gpu`` extra).

Each FAIL names its fix. The two items of the ``gpu`` extra are optional for a run: without Transformer
Engine the trainer builds megatron-core's local layers (:func:`megatron_agentrl.megatron.model.have_te`),
without nvidia-ml-py the ``gpu/*`` metrics are missing. ``CheckReport`` has no warning status, so their
absence (or a Transformer Engine that does not import) is reported as ``not verified here``, and fails only
with ``--strict``.

The pins come from this package's installed metadata (setup.py's requirements and extras). Nothing here uses
the network; every subprocess has a timeout. Exit status 0 when nothing failed, 1 otherwise.
"""
from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import json
import os
import subprocess
import sys
import warnings
from typing import Any

from packaging.requirements import InvalidRequirement, Requirement
from packaging.utils import canonicalize_name
from packaging.version import InvalidVersion, Version

from megatron_agentrl.launch.check import FAIL, OK, UNVERIFIED, CheckReport

#: the torch that ``make install-gpu`` installs: SGLang 0.5.23's pin (setup.py admits >=2.13.0,<2.15;
#: constraints.txt's 2.13.0 is the CPU build of the dev environment). The Makefile's GPU_TORCH
GPU_TORCH = "2.14.1"
#: where ``make install-gpu`` takes torch's CUDA build from (the Makefile's TORCH_INDEX default)
TORCH_INDEX = "https://download.pytorch.org/whl/cu130"
#: the distribution whose metadata holds the pins
PROJECT = "megatron-agentrl"
INSTALL_GPU = "make install-gpu"

_SGLANG_PROBE = (
    "import importlib.metadata as m\n"
    "import sglang\n"
    "print(sglang.__version__)\n"
    "try:\n"
    "    print(m.version('torch'))\n"
    "except Exception:\n"
    "    print('')\n"
)
_TE_PROBE = "import transformer_engine, transformer_engine.pytorch"


# ----------------------------------------------------------------------------------------------- pins
def project_requirements(dist: str = PROJECT) -> dict[str, Requirement]:
    """The requirements of the installed ``dist`` (base and every extra), by canonical name; empty when it is
    not installed."""
    try:
        raw = importlib.metadata.requires(dist) or []
    except importlib.metadata.PackageNotFoundError:
        return {}
    out = {}
    for line in raw:
        try:
            req = Requirement(line)
        except InvalidRequirement:
            continue
        out.setdefault(canonicalize_name(req.name), req)
    return out


def exact_pin(req: Requirement | None) -> str | None:
    """The version of ``req`` when it is ``name==version``, else None."""
    if req is None:
        return None
    specs = list(req.specifier)
    if len(specs) == 1 and specs[0].operator == "==" and not specs[0].version.endswith("*"):
        return specs[0].version
    return None


def dist_version(name: str) -> str | None:
    """The installed version of the distribution ``name`` in this interpreter, or None."""
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def _public(version: str) -> Version | None:
    """``2.14.1+cu130`` -> ``2.14.1``; None when not a version."""
    try:
        return Version(Version(version).public)
    except InvalidVersion:
        return None


def _torch_fix() -> str:
    return f"run `{INSTALL_GPU}` (or pip install torch=={GPU_TORCH} --index-url {TORCH_INDEX})"


# ---------------------------------------------------------------------------------------------- items
def check_python(report: CheckReport, version_info: tuple[int, ...] | None = None) -> None:
    """Python 3.11, as setup.py requires."""
    v = tuple(version_info or sys.version_info[:3])
    shown = ".".join(map(str, v[:3]))
    if v[:2] == (3, 11):
        report.add(OK, "python", f"{shown} ({sys.executable})")
    else:
        report.add(FAIL, "python", f"{shown} ({sys.executable}); setup.py needs 3.11; fix: rebuild the venv with "
                   f"Python 3.11 (`rm -rf .venv && make install-gpu BASE_PYTHON=/path/to/python3.11`)")


def check_torch(report: CheckReport, reqs: dict[str, Requirement]) -> Any:
    """torch imports, is a CUDA build, in setup.py's range (and at SGLang's pin when SGLang is installed here).
    Returns the torch module, or None when it does not import."""
    try:
        import torch
    except Exception as e:  # noqa: BLE001 - a broken install is what this reports
        report.add(FAIL, "torch", f"does not import ({type(e).__name__}: {e}); fix: {_torch_fix()}")
        return None
    version = torch.__version__
    cuda = torch.version.cuda
    if cuda is None:
        report.add(FAIL, "torch", f"CPU-only torch {version}: a GPU run needs the CUDA build; fix: {_torch_fix()}")
        return torch
    req = reqs.get("torch")
    public = _public(version)
    if req is not None and public is not None and not req.specifier.contains(public, prereleases=True):
        report.add(FAIL, "torch", f"{version} (CUDA {cuda}) is outside setup.py's torch{req.specifier}; "
                   f"fix: {_torch_fix()}")
        return torch
    sglang_torch = None
    if dist_version("sglang") is not None:
        sglang_torch = exact_pin(project_requirements("sglang").get("torch"))
    if sglang_torch and public is not None and public != Version(sglang_torch):
        report.add(FAIL, "torch", f"{version} (CUDA {cuda}), but sglang {dist_version('sglang')} in this interpreter "
                   f"needs torch=={sglang_torch}; fix: pip install torch=={sglang_torch} --index-url {TORCH_INDEX} "
                   f"(or `{INSTALL_GPU}`)")
        return torch
    admits = f"setup.py admits torch{req.specifier}" if req is not None else "no pin found (package not installed?)"
    report.add(OK, "torch", f"{version}, CUDA {cuda} build ({admits}"
               + (f"; sglang needs {sglang_torch})" if sglang_torch else ")"))
    return torch


def check_cuda(report: CheckReport, torch: Any) -> None:
    """The CUDA devices torch sees: count, names, memory, compute capability."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    shown_visible = "unset" if visible is None else repr(visible)
    if torch is None or torch.version.cuda is None:
        what = "torch does not import" if torch is None else f"torch {torch.__version__} is a CPU-only build"
        report.add(FAIL, "CUDA devices", f"none: {what} (CUDA_VISIBLE_DEVICES {shown_visible}); fix: the CUDA "
                   f"build of torch (`{INSTALL_GPU}`), on a GPU node")
        return
    messages: list[str] = []  # why CUDA did not initialize (torch warns: an old driver, no device)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            available = torch.cuda.is_available()
            count = torch.cuda.device_count() if available else 0
        except Exception as e:  # noqa: BLE001
            available, count = False, 0
            messages.append(f"{type(e).__name__}: {e}")
    messages += [str(w.message) for w in caught]
    if not available or count == 0:
        why = "; ".join(m.strip().splitlines()[0] for m in messages if m.strip())
        report.add(FAIL, "CUDA devices", f"torch (CUDA {torch.version.cuda}) sees no GPU (CUDA_VISIBLE_DEVICES "
                   f"{shown_visible}" + (f"; {why}" if why else "") + "); fix: run on a GPU node (under SLURM, "
                   "inside an allocation: srun --gpus-per-node=N agentrl doctor), check `nvidia-smi` (the driver "
                   f"loaded and new enough for CUDA {torch.version.cuda}), unset or correct CUDA_VISIBLE_DEVICES")
        return
    groups: dict[str, list[int]] = {}
    for i in range(count):
        p = torch.cuda.get_device_properties(i)
        key = f"{p.name} ({p.total_memory / 1024**3:.1f} GiB, compute capability {p.major}.{p.minor})"
        groups.setdefault(key, []).append(i)
    report.add(OK, "CUDA devices", f"{count} GPU(s): " + "; ".join(
        f"{len(ids)} x {key} [{','.join(map(str, ids))}]" for key, ids in groups.items())
        + f" (CUDA_VISIBLE_DEVICES {shown_visible})")


def check_nccl(report: CheckReport, torch: Any) -> None:
    """NCCL in this torch build, and its version."""
    if torch is None:
        report.add(FAIL, "NCCL", f"torch does not import; fix: {_torch_fix()}")
        return
    available = False
    try:
        available = torch.distributed.is_available() and torch.distributed.is_nccl_available()
    except Exception:  # noqa: BLE001
        available = False
    if not available:
        report.add(FAIL, "NCCL", f"not in torch {torch.__version__} (gloo only); the trainer ranks and the weight "
                   f"sync to the engines need it; fix: the CUDA build of torch, which ships it: {_torch_fix()}")
        return
    try:
        v = torch.cuda.nccl.version()
        shown = ".".join(map(str, v)) if isinstance(v, tuple) else str(v)
    except Exception as e:  # noqa: BLE001
        report.add(FAIL, "NCCL", f"available in torch, but its version cannot be read ({type(e).__name__}: {e}); "
                   f"fix: reinstall torch ({_torch_fix()})")
        return
    report.add(OK, "NCCL", f"{shown} (torch's); engines in another interpreter need the same major version")


def check_sglang(report: CheckReport, reqs: dict[str, Requirement], engine_python: str | None = None,
                 timeout_s: float = 60.0) -> None:
    """``import sglang`` in the interpreter the engines run, in a subprocess; its version against the pin."""
    py = engine_python or sys.executable
    # not realpath: a venv's python is a link to the base interpreter, which lacks the venv's packages
    same = os.path.abspath(py) == os.path.abspath(sys.executable)
    where = f"this interpreter ({py})" if same else f"the engine interpreter {py}"
    pin = exact_pin(reqs.get("sglang"))
    pinned = f"sglang=={pin}" if pin else "sglang"
    fix = (f"pip install -e '.[sglang]' (or `{INSTALL_GPU}`)" if same
           else f"{py} -m pip install '{pinned}' (or run the engines with the trainer's interpreter, where "
                f"`{INSTALL_GPU}` installs it)")
    try:
        proc = subprocess.run([py, "-c", _SGLANG_PROBE], capture_output=True, text=True, timeout=timeout_s,
                              stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired:
        report.add(FAIL, "SGLang", f"`import sglang` in {where} did not finish in {timeout_s:g} s; fix: check that "
                   f"interpreter by hand: {py} -c 'import sglang'")
        return
    except OSError as e:
        report.add(FAIL, "SGLang", f"cannot run {py} ({e}); fix: give --engine-python an interpreter that exists, "
                   "or leave it out (the trainer's)")
        return
    if proc.returncode != 0:
        lines = [ln for ln in (proc.stderr or proc.stdout).strip().splitlines() if ln.strip()]
        why = lines[-1].strip() if lines else f"exit status {proc.returncode}"
        report.add(FAIL, "SGLang", f"not importable in {where}: {why}; the engines run `python -m "
                   f"sglang.launch_server` with it (under Ray: the trainer's interpreter); fix: {fix}")
        return
    out = proc.stdout.strip().splitlines()
    version = out[0].strip() if out else ""
    engine_torch = out[1].strip() if len(out) > 1 else ""
    if pin and version != pin:
        report.add(FAIL, "SGLang", f"sglang {version or '(no version)'} in {where}, but the project is pinned to "
                   f"{pinned} (its request contract is read from that version); fix: "
                   + (f"pip install '{pinned}'" if same else f"{py} -m pip install '{pinned}'"))
        return
    detail = f"sglang {version} in {where}" + (f" (pinned {pin})" if pin else " (no pin found)")
    if not same and engine_torch:
        trainer_torch = dist_version("torch")
        detail += (f"; its torch {engine_torch}, the trainer's {trainer_torch}: the weight sync needs the same NCCL "
                   "major version on both sides")
    report.add(OK, "SGLang", detail)


def check_megatron_core(report: CheckReport, reqs: dict[str, Requirement]) -> None:
    """megatron-core installed, at setup.py's pin."""
    version = dist_version("megatron-core")
    pin = exact_pin(reqs.get("megatron-core"))
    if version is None:
        report.add(FAIL, "megatron-core", f"not installed; fix: pip install -e . (or `{INSTALL_GPU}`)")
    elif pin and version != pin:
        report.add(FAIL, "megatron-core", f"{version}, but setup.py pins {pin}; fix: pip install megatron-core=={pin}")
    else:
        report.add(OK, "megatron-core", version + (f" (pinned {pin})" if pin else ""))


def check_transformer_engine(report: CheckReport, reqs: dict[str, Requirement], strict: bool = False,
                             timeout_s: float = 60.0) -> None:
    """Transformer Engine (the ``gpu`` extra) installed and importing with its PyTorch part, in a subprocess as
    :func:`~megatron_agentrl.megatron.model.have_te` imports it. Optional: not a failure unless ``strict``."""
    missing = FAIL if strict else UNVERIFIED
    pin = exact_pin(reqs.get("transformer-engine"))
    fix = f"`{INSTALL_GPU}` (pip install --no-build-isolation -e '.[gpu]', against the CUDA torch)"
    fallback = "the trainer runs without it, on megatron-core's local layers"
    if importlib.util.find_spec("transformer_engine") is None:
        report.add(missing, "Transformer Engine", f"not installed; {fallback}; to install: {fix}")
        return
    version = dist_version("transformer-engine") or dist_version("transformer-engine-torch") or "(version unknown)"
    try:
        proc = subprocess.run([sys.executable, "-c", _TE_PROBE], capture_output=True, text=True, timeout=timeout_s,
                              stdin=subprocess.DEVNULL)
        lines = [ln for ln in (proc.stderr or proc.stdout).strip().splitlines() if ln.strip()]
        why = None if proc.returncode == 0 else (lines[-1].strip() if lines else f"exit status {proc.returncode}")
    except subprocess.TimeoutExpired:
        why = f"`{_TE_PROBE}` did not finish in {timeout_s:g} s"
    if why is not None:
        report.add(missing, "Transformer Engine", f"{version} is installed but does not import ({why}); {fallback}; "
                   f"fix: rebuild it against this torch: {fix}")
        return
    pinned = f" (setup.py pins {pin})" if pin and pin != version else (f" (pinned {pin})" if pin else "")
    report.add(OK, "Transformer Engine", f"{version} imports with its PyTorch part{pinned}")


def check_nvml(report: CheckReport, reqs: dict[str, Requirement], strict: bool = False) -> None:
    """nvidia-ml-py (the ``gpu`` extra; the ``gpu/*`` metrics) and, when it loads, the driver's version."""
    missing = FAIL if strict else UNVERIFIED
    version = dist_version("nvidia-ml-py")
    if version is None or importlib.util.find_spec("pynvml") is None:
        report.add(missing, "nvidia-ml-py", f"not installed: no gpu/util and gpu/mem metrics; to install: "
                   f"pip install -e '.[gpu]' (or `{INSTALL_GPU}`)")
        return
    driver = ""
    try:
        import pynvml  # type: ignore[import-not-found]

        pynvml.nvmlInit()
        try:
            d = pynvml.nvmlSystemGetDriverVersion()
            driver = f"; NVIDIA driver {d.decode() if isinstance(d, bytes) else d}"
        finally:
            pynvml.nvmlShutdown()
    except Exception as e:  # noqa: BLE001 - NVML without a driver: the CUDA item says why
        driver = f"; NVML does not load ({type(e).__name__})"
    report.add(OK, "nvidia-ml-py", f"{version}{driver}")


# ------------------------------------------------------------------------------------------ the command
def run_doctor(engine_python: str | None = None, strict: bool = False, timeout_s: float = 60.0) -> CheckReport:
    """Every item of this node's GPU stack (see the module doc); never raises for what it checks."""
    report = CheckReport()
    reqs = project_requirements()
    check_python(report)
    torch = check_torch(report, reqs)
    check_cuda(report, torch)
    check_nccl(report, torch)
    check_sglang(report, reqs, engine_python, timeout_s)
    check_megatron_core(report, reqs)
    check_transformer_engine(report, reqs, strict, timeout_s)
    check_nvml(report, reqs, strict)
    return report


def add_doctor_arguments(p: argparse.ArgumentParser) -> None:
    """The options of ``agentrl doctor``."""
    p.add_argument("--engine-python", default=None,
                   help="the interpreter the SGLang engines run (default: this one, as under Ray)")
    p.add_argument("--strict", action="store_true",
                   help="the optional parts of the gpu extra (Transformer Engine, nvidia-ml-py) fail too")
    p.add_argument("--json", action="store_true", help="print the items as JSON")
    p.add_argument("--timeout", type=float, default=60.0, help="seconds for each subprocess (import sglang, ...)")


def cmd_doctor(args: argparse.Namespace) -> int:
    """``agentrl doctor``: print the checklist; exit 1 when an item failed."""
    report = run_doctor(args.engine_python, args.strict, args.timeout)
    if args.json:
        items = [{"status": s, "item": i, "detail": d} for s, i, d in report.items]
        sys.stdout.write(json.dumps({"ok": not report.failed, "items": items}, indent=2) + "\n")
    else:
        sys.stdout.write(report.format() + "\n")
    return 1 if report.failed else 0
