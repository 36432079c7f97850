"""SLURM submission against a real single-node SLURM started by the test.

The fixture starts munged, slurmctld and slurmd (Debian ``slurm-wlm`` and ``munge``) in a temp
directory with a generated slurm.conf (NodeName=localhost with this machine's CPUs and memory),
and stops them afterwards, with any job step daemons they left. The tests submit a tiny CPU
training run through ``tools/submit_slurm.py`` and follow and cancel jobs through
``agentrl slurm``. They skip only when the SLURM or munge binaries are not installed.
"""
from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from megatron_agentrl.config import load_config
from megatron_agentrl.launch.slurm import build_job, render_sbatch

ROOT = Path(__file__).resolve().parents[2]
BINARIES = ("munged", "slurmctld", "slurmd", "sbatch", "scontrol", "scancel", "sinfo")
MISSING = [b for b in BINARIES if shutil.which(b) is None and not Path(f"/usr/sbin/{b}").exists()]
TINY = ["model.arch.hidden_size=32", "model.arch.intermediate_size=64", "model.arch.num_hidden_layers=2",
        "sft.steps=1", "sft.batch_size=4", "train.steps=2", "train.micro_batch_size=4", "eval.samples_per_task=2",
        "rollout.prompts_per_step=2", "rollout.samples_per_prompt=2", "rollout.max_turns=2"]


def _which(binary: str) -> str:
    return shutil.which(binary) or f"/usr/sbin/{binary}"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _mem_mb() -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemTotal:"):
            return int(line.split()[1]) // 1024
    return 1024


class LocalSlurm:
    """munged + slurmctld + slurmd of one node, all under ``root``; ``env`` points clients at it."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.procs: dict[str, subprocess.Popen] = {}
        self.conf = root / "slurm.conf"
        self.env = {**os.environ, "SLURM_CONF": str(self.conf)}
        self.started_at = time.time()

    def start(self, timeout_s: float = 60.0) -> None:
        r = self.root
        user = subprocess.run(["id", "-un"], capture_output=True, text=True, check=True).stdout.strip()
        for d in ("munge", "state", "spool", "log"):
            (r / d).mkdir(mode=0o700)
        key = r / "munge" / "munge.key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o600)
        (r / "plugstack.conf").write_text("")
        sock = r / "munge" / "munge.socket"
        self._spawn("munged", [_which("munged"), "-F", "--force", f"--key-file={key}", f"--socket={sock}",
                               f"--pid-file={r / 'munge' / 'munged.pid'}", f"--log-file={r / 'log' / 'munged.log'}",
                               f"--seed-file={r / 'munge' / 'munged.seed'}"])
        self._wait(lambda: sock.exists(), timeout_s, "munged did not create its socket")
        self.conf.write_text("\n".join([
            "ClusterName=agentrltest",
            "SlurmctldHost=localhost(127.0.0.1)",
            f"SlurmctldPort={_free_port()}",
            f"SlurmdPort={_free_port()}",
            f"SlurmUser={user}",
            f"SlurmdUser={user}",
            "AuthType=auth/munge",
            "CredType=cred/munge",
            f"AuthInfo=socket={sock}",
            f"StateSaveLocation={r / 'state'}",
            f"SlurmdSpoolDir={r / 'spool'}",
            f"SlurmctldPidFile={r / 'slurmctld.pid'}",
            f"SlurmdPidFile={r / 'slurmd.pid'}",
            f"SlurmctldLogFile={r / 'log' / 'slurmctld.log'}",
            f"SlurmdLogFile={r / 'log' / 'slurmd.log'}",
            f"PlugStackConfig={r / 'plugstack.conf'}",
            "ProctrackType=proctrack/linuxproc",
            "TaskPlugin=task/none",
            "MpiDefault=none",
            "SwitchType=switch/none",
            "SchedulerType=sched/builtin",
            "SelectType=select/cons_tres",
            "SelectTypeParameters=CR_Core",
            "JobAcctGatherType=jobacct_gather/none",
            "AccountingStorageType=accounting_storage/none",
            "ReturnToService=2",
            "MinJobAge=600",
            "KillWait=5",
            f"NodeName=localhost NodeAddr=127.0.0.1 CPUs={os.cpu_count()} RealMemory={int(_mem_mb() * 0.8)} "
            "State=UNKNOWN",
            "PartitionName=debug Nodes=localhost Default=YES MaxTime=INFINITE State=UP",
        ]) + "\n")
        self._spawn("slurmctld", [_which("slurmctld"), "-D", "-i"])
        self._spawn("slurmd", [_which("slurmd"), "-D", "-N", "localhost"])
        self._wait(self._node_idle, timeout_s, "the node did not become idle")

    def _spawn(self, name: str, cmd: list[str]) -> None:
        log = open(self.root / "log" / f"{name}.out", "wb")  # noqa: SIM115 - closed with the process
        self.procs[name] = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=self.env,
                                            start_new_session=True)
        log.close()

    def _node_idle(self) -> bool:
        for name, p in self.procs.items():
            if p.poll() is not None:
                raise RuntimeError(f"{name} exited with {p.returncode}:\n{self.logs()}")
        out = subprocess.run(["sinfo", "-h", "-o", "%t"], capture_output=True, text=True, env=self.env, timeout=30)
        return out.stdout.strip() == "idle"

    def _wait(self, ready, timeout_s: float, what: str) -> None:
        deadline = time.monotonic() + timeout_s
        while not ready():
            if time.monotonic() > deadline:
                raise RuntimeError(f"{what} within {timeout_s:g}s:\n{self.logs()}")
            time.sleep(0.5)

    def logs(self) -> str:
        """The tail of every daemon log (for failure messages)."""
        parts = []
        for f in sorted((self.root / "log").glob("*")):
            parts.append(f"== {f.name}\n" + "\n".join(f.read_text(errors="replace").splitlines()[-15:]))
        return "\n".join(parts)

    def _stepds(self) -> list[int]:
        """slurmstepd processes of this cluster (their environment names our slurm.conf)."""
        pids = []
        for d in Path("/proc").iterdir():
            if not d.name.isdigit():
                continue
            try:
                if not (d / "comm").read_text().startswith("slurmstepd"):
                    continue
                if f"SLURM_CONF={self.conf}".encode() in (d / "environ").read_bytes():
                    pids.append(int(d.name))
            except OSError:
                continue
        return pids

    def stop(self) -> None:
        """Cancel every job, stop the daemons (TERM, then KILL), reap leftover step daemons."""
        if "slurmctld" in self.procs and self.procs["slurmctld"].poll() is None:
            subprocess.run(["scancel", "--full", "--user", str(os.getuid())], env=self.env, capture_output=True,
                           timeout=30)
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline:
                q = subprocess.run(["squeue", "-h"], capture_output=True, text=True, env=self.env, timeout=30)
                if not q.stdout.strip() and not self._stepds():
                    break
                time.sleep(0.5)
        for name in ("slurmd", "slurmctld", "munged"):
            p = self.procs.get(name)
            if p is None or p.poll() is not None:
                continue
            p.send_signal(signal.SIGTERM)
            try:
                p.wait(timeout=20)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(timeout=10)
        for pid in self._stepds():
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


@pytest.fixture(scope="module")
def slurm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalSlurm]:
    if MISSING:
        pytest.skip(f"SLURM / munge binaries not installed ({', '.join(MISSING)}): apt-get install slurm-wlm munge")
    cluster = LocalSlurm(tmp_path_factory.mktemp("slurm"))
    try:
        cluster.start()
        yield cluster
    finally:
        cluster.stop()
    leftovers = [n for n, p in cluster.procs.items() if p.poll() is None] + [str(p) for p in cluster._stepds()]
    assert not leftovers, f"daemons left running: {leftovers}"


def _agentrl(slurm: LocalSlurm, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "megatron_agentrl.cli", *args], cwd=ROOT, env=slurm.env,
                          capture_output=True, text=True, timeout=timeout)


def test_submit_tiny_training_runs_to_completion(slurm: LocalSlurm, tmp_path: Path) -> None:
    out = tmp_path / "run"
    overrides = [f"output_dir={out}", *TINY, "checkpoint.interval=1"]
    t0 = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "tools/submit_slurm.py", "--config", "tests/configs/tiny_test.yaml", "--no-ray",
         "--time", "00:15:00", "--job-name", "agentrl-tiny", "--wait", "--wait-timeout", "600", *overrides],
        cwd=ROOT, env=slurm.env, capture_output=True, text=True, timeout=700)
    logs = sorted((out / "slurm").glob("slurm-*.out"))
    job_log = logs[0].read_text() if logs else "(no job log)"
    assert proc.returncode == 0, f"{proc.stdout}\n{proc.stderr}\n--- job log\n{job_log}\n--- daemons\n{slurm.logs()}"
    job_id = proc.stdout.split("submitted job ")[1].split()[0]
    assert f"job {job_id} COMPLETED" in proc.stdout
    # the run's outputs: the megatron checkpoint of the last step and the trained model in HF format
    ckpts = out / "checkpoints"
    assert (ckpts / "latest").is_file(), f"no checkpoint under {ckpts}:\n{job_log}"
    last = ckpts / (ckpts / "latest").read_text().strip()
    assert last.name == "step_000002" and (last / "meta.json").is_file() and (last / "model_optim").is_dir(), job_log
    assert (out / "hf_export" / "config.json").is_file(), job_log
    assert list((out / "hf_export").glob("*.safetensors")), job_log
    assert (out / "summary.json").is_file()
    assert "training finished" in job_log and "job ends with exit code 0" in job_log
    # the script it ran is kept next to the log, and agentrl slurm status reports the job
    assert list((out / "slurm").glob("agentrl-tiny_*.sbatch"))
    status = _agentrl(slurm, "slurm", "status", job_id)
    assert status.returncode == 0 and f"{job_id} COMPLETED exit=0:0" in status.stdout, status.stdout + status.stderr
    print(f"tiny SLURM training job {job_id}: {time.monotonic() - t0:.1f}s submit-to-done")


def test_cancel_and_unknown_job(slurm: LocalSlurm, tmp_path: Path) -> None:
    out = tmp_path / "run"
    proc = subprocess.run(
        [sys.executable, "tools/submit_slurm.py", "--config", "tests/configs/tiny_test.yaml", "--no-ray",
         f"output_dir={out}", *TINY, "train.steps=1000"],
        cwd=ROOT, env=slurm.env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    job_id = proc.stdout.split("submitted job ")[1].split()[0]
    cancel = _agentrl(slurm, "slurm", "cancel", job_id)
    assert cancel.returncode == 0, cancel.stderr
    deadline = time.monotonic() + 60
    while True:
        status = _agentrl(slurm, "slurm", "status", job_id)
        if "CANCELLED" in status.stdout:
            break
        assert time.monotonic() < deadline, status.stdout + status.stderr
        time.sleep(1)
    bad = _agentrl(slurm, "slurm", "status", "999999")
    assert bad.returncode == 1 and "SLURM does not know job 999999" in bad.stderr


def test_dry_run_prints_the_ray_script_without_slurm(tmp_path: Path) -> None:
    """--dry-run needs no SLURM: head on the first node, workers on the rest, wait, train, cleanup."""
    proc = subprocess.run(
        [sys.executable, "tools/submit_slurm.py", "--config", "tests/configs/tiny_test.yaml", "--dry-run",
         "--nodes", "3", "--gpus-per-node", "8", "--partition", "gpu", "--account", "proj", "--time", "02:00:00",
         "--container-image", "nvcr.io/nvidia/pytorch:25.01-py3", f"output_dir={tmp_path}", "train.steps=7"],
        cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    script = proc.stdout
    for line in ("#SBATCH --nodes=3", "#SBATCH --gpus-per-node=8", "#SBATCH --partition=gpu", "#SBATCH --account=proj",
                 "#SBATCH --time=02:00:00", "--container-image=nvcr.io/nvidia/pytorch:25.01-py3",
                 "start --head --block", 'for node in "${NODES[@]:1}"; do', "start --address=",
                 "ray_placement wait", "ray.enabled=true", "trap cleanup EXIT", "OVERRIDES=(", "train.steps=7"):
        assert line in script, f"{line!r} missing from:\n{script}"
    assert not list(tmp_path.glob("slurm/*.sbatch")), "--dry-run wrote a script"
    assert subprocess.run(["bash", "-n"], input=script, text=True).returncode == 0


def test_flags_are_validated(tmp_path: Path) -> None:
    cfg = load_config(ROOT / "tests/configs/tiny_test.yaml", [f"output_dir={tmp_path}"])
    with pytest.raises(ValueError, match="slurm.time='soon'"):
        build_job(cfg, ROOT / "tests/configs/tiny_test.yaml", [], time="soon")
    with pytest.raises(ValueError, match="slurm.nodes=0"):
        build_job(cfg, ROOT / "tests/configs/tiny_test.yaml", [], nodes=0)
    with pytest.raises(ValueError, match="--partition 'gpu normal' has a space"):
        build_job(cfg, ROOT / "tests/configs/tiny_test.yaml", [], partition="gpu normal")
    job = build_job(cfg, ROOT / "tests/configs/tiny_test.yaml", ["train.steps=3"], ray=False)
    script = render_sbatch(job)
    assert "ray start" not in script and "torch.distributed.run" in script and "train.steps=3" in script


def test_ray_path_runs_in_slurm(slurm: LocalSlurm, tmp_path: Path) -> None:
    """The default path: Ray head started by the job with srun, agentrl train joins it, cleanup after."""
    out = tmp_path / "run"
    proc = subprocess.run(
        [sys.executable, "tools/submit_slurm.py", "--config", "tests/configs/tiny_test.yaml", "--ray",
         "--cpus-per-node", str(os.cpu_count()), "--time", "00:15:00", "--wait", "--wait-timeout", "600",
         f"output_dir={out}", *TINY, "ray.num_cpus=0", "ray.health_check_interval_s=2"],
        cwd=ROOT, env=slurm.env, capture_output=True, text=True, timeout=700)
    logs = sorted((out / "slurm").glob("slurm-*.out"))
    job_log = logs[0].read_text() if logs else "(no job log)"
    assert proc.returncode == 0, f"{proc.stdout}\n{proc.stderr}\n--- job log\n{job_log}\n--- daemons\n{slurm.logs()}"
    assert "Ray cluster up: 1 node(s)" in job_log and "stopping 1 background step(s)" in job_log, job_log
    assert (out / "hf_export" / "config.json").is_file(), job_log
