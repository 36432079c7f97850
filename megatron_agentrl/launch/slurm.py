"""SLURM submission: render an ``sbatch`` script from the config and flags, submit it, follow it.

::

    agentrl slurm submit --config run.yaml --nodes 2 --gpus-per-node 8 --partition gpu --time 12:00:00
    agentrl slurm submit --config run.yaml --dry-run          # print the script, submit nothing
    agentrl slurm status 1234
    agentrl slurm cancel 1234
    # the same: python tools/submit_slurm.py --config run.yaml ...

The script (see :func:`render_sbatch`) runs on the first node of the allocation. With Ray (the
default, ``slurm.ray``) it starts the Ray head there and a Ray worker on every other node with
``srun``, waits until all nodes joined (``slurm.ray_start_timeout_s``), runs ``agentrl train`` with
``ray.address`` set to the head, and on exit (success, failure, ``scancel``, time limit) stops the
Ray steps. Without Ray it runs ``agentrl train`` on the first node (one node) or ``torchrun`` on
every node (several nodes). With ``--container-image`` every step runs in that image (pyxis).
Flags override the config's ``slurm`` section; ``key=value`` arguments override the run config.
"""
from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import re
import shlex
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from megatron_agentrl.config import Config, ConfigError, SlurmConfig, load_config

logger = logging.getLogger(__name__)

#: Job states after which a job does not run again.
FINAL_STATES = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "PREEMPTED",
                "BOOT_FAIL", "DEADLINE", "SPECIAL_EXIT", "REVOKED")


class SlurmError(RuntimeError):
    """A SLURM command is missing or failed; the message says which and why."""


@dataclass
class SlurmJob:
    """Everything the sbatch script depends on: the ``slurm`` section after flags, plus paths.

    config_path: the run's YAML (absolute); overrides: its ``key=value`` overrides.
    workdir: directory the job runs in (``--chdir``); script_dir: where the script and its log go.
    python: interpreter on the nodes (the submitting one by default; ``python3`` in a container).
    """

    slurm: SlurmConfig
    config_path: str
    overrides: list[str]
    workdir: str
    script_dir: str
    python: str
    extra_env: dict[str, str] = field(default_factory=dict)

    @property
    def log_path(self) -> str:
        """The job's output file (``%j`` = job id)."""
        return str(Path(self.script_dir) / "slurm-%j.out")


def _require(binary: str) -> str:
    path = shutil.which(binary)
    if path is None:
        raise SlurmError(f"'{binary}' is not on PATH: run this on a SLURM login node (or install slurm-wlm), "
                         "or use --dry-run to only print the script")
    return path


def build_job(cfg: Config, config_path: str | os.PathLike, overrides: list[str], *, python: str | None = None,
              workdir: str | os.PathLike | None = None, **flags: object) -> SlurmJob:
    """The job of ``cfg``: its ``slurm`` section with ``flags`` (non-None values) on top.

    flags: any :class:`~megatron_agentrl.config.SlurmConfig` field, e.g. ``nodes=2, partition="gpu"``.
    Raises ConfigError for an unknown flag or a bad value.
    """
    names = {f.name for f in dataclasses.fields(SlurmConfig)}
    unknown = set(flags) - names
    if unknown:
        raise ConfigError(f"unknown slurm option(s) {sorted(unknown)}; valid: {sorted(names)}")
    slurm = dataclasses.replace(cfg.slurm, **{k: v for k, v in flags.items() if v is not None})
    check = dataclasses.replace(cfg, slurm=slurm)
    check.validate()
    workdir = str(Path(workdir or os.getcwd()).resolve())
    out = Path(cfg.output_dir)
    script_dir = str((out if out.is_absolute() else Path(workdir) / out) / "slurm")
    if python is None:
        python = "python3" if slurm.container_image else sys.executable
    # #SBATCH lines are not parsed by a shell: their values must be plain words
    for what, value in (("--job-name", slurm.job_name), ("--partition", slurm.partition),
                        ("--account", slurm.account), ("the working directory", workdir),
                        ("output_dir", script_dir)):
        if re.search(r"[\s'\"#$`\\]", value):
            raise ConfigError(f"{what} {value!r} has a space, quote or shell character, which an #SBATCH line cannot "
                              "carry; use a plain name or path")
    return SlurmJob(slurm=slurm, config_path=str(Path(config_path).resolve()), overrides=list(overrides),
                    workdir=workdir, script_dir=script_dir, python=python)


def _q(value: object) -> str:
    return shlex.quote(str(value))


def render_sbatch(job: SlurmJob) -> str:
    """The sbatch script of ``job`` (bash). Pure: reads nothing, runs nothing."""
    s = job.slurm
    head = ["#!/bin/bash", f"#SBATCH --job-name={s.job_name}", f"#SBATCH --nodes={s.nodes}",
            "#SBATCH --ntasks-per-node=1"]
    if s.gpus_per_node:
        head.append(f"#SBATCH --gpus-per-node={s.gpus_per_node}")
    if s.cpus_per_node:
        head.append(f"#SBATCH --cpus-per-task={s.cpus_per_node}")
    if s.partition:
        head.append(f"#SBATCH --partition={s.partition}")
    if s.account:
        head.append(f"#SBATCH --account={s.account}")
    if s.time:
        head.append(f"#SBATCH --time={s.time}")
    if s.exclusive:
        head.append("#SBATCH --exclusive")
    head += [f"#SBATCH --output={job.log_path}", f"#SBATCH --chdir={job.workdir}"]
    head += [f"#SBATCH {arg}" for arg in s.sbatch_args]
    container = []
    if s.container_image:
        container = [f"--container-image={s.container_image}", f"--container-workdir={job.workdir}"]
        if s.container_mounts:
            container.append(f"--container-mounts={s.container_mounts}")
    body = [
        "# Generated by `agentrl slurm submit` (megatron_agentrl/launch/slurm.py).",
        "set -euo pipefail",
        *s.setup,
        *(f"export {k}={_q(v)}" for k, v in job.extra_env.items()),
        f"PY={_q(job.python)}",
        'AGENTRL=("$PY" -m megatron_agentrl.cli)',
        f"CONFIG={_q(job.config_path)}",
        "OVERRIDES=(" + " ".join(_q(o) for o in job.overrides) + ")",
        "CONTAINER=(" + " ".join(_q(c) for c in container) + ")",
        f"GPUS_PER_NODE={s.gpus_per_node}",
        'CPUS_PER_NODE="${SLURM_CPUS_ON_NODE:-1}"',
        'mapfile -t NODES < <(scontrol show hostnames "$SLURM_JOB_NODELIST")',
        'HEAD="${NODES[0]}"',
        'NNODES="${#NODES[@]}"',
        'HEAD_IP="$(getent ahostsv4 "$HEAD" | awk \'{print $1; exit}\')"',
        'HEAD_IP="${HEAD_IP:-$(hostname -I | awk \'{print $1}\')}"',
        # One task per node, with every CPU and GPU of the node; --overlap lets steps share them.
        'STEP=(srun --overlap --nodes=1 --ntasks=1 --cpus-per-task="$CPUS_PER_NODE")',
        'if [ "$GPUS_PER_NODE" -gt 0 ]; then STEP+=(--gpus-per-task="$GPUS_PER_NODE"); fi',
        'log() { echo "[agentrl-slurm $(date +%H:%M:%S)] $*"; }',
        # The batch step runs on the head node already; a container needs a step of its own there.
        ('on_head() { if [ "${#CONTAINER[@]}" -gt 0 ]; then "${STEP[@]}" -w "$HEAD" "${CONTAINER[@]}" "$@"; '
         'else "$@"; fi; }'),
        "STEP_PIDS=()",
        "cleanup() {",
        "  local rc=$?",
        "  trap - EXIT INT TERM",
        '  if [ "${#STEP_PIDS[@]}" -gt 0 ]; then',
        '    log "stopping ${#STEP_PIDS[@]} background step(s)"',
        '    kill -TERM "${STEP_PIDS[@]}" 2>/dev/null || true',
        "    for _ in $(seq 30); do",
        '      alive=0; for p in "${STEP_PIDS[@]}"; do kill -0 "$p" 2>/dev/null && alive=1; done',
        '      [ "$alive" = 0 ] && break; sleep 1',
        "    done",
        '    kill -KILL "${STEP_PIDS[@]}" 2>/dev/null || true',
        "  fi",
        '  log "job ends with exit code $rc"',
        '  exit "$rc"',
        "}",
        "trap cleanup EXIT",
        "trap 'exit 143' INT TERM",
        ('log "job $SLURM_JOB_ID: $NNODES node(s) ${NODES[*]}, head $HEAD ($HEAD_IP), $GPUS_PER_NODE GPU(s) and '
         '$CPUS_PER_NODE CPU(s) per node"'),
    ]
    if s.ray:
        body += [
            f"RAY_PORT={s.ray_port}",
            'RAY_ADDRESS_ARG="$HEAD_IP:$RAY_PORT"',
            'RAY=("$PY" -m ray.scripts.scripts)  # the ray CLI of the interpreter that trains',
            # A per-job token: every node and the driver share it through the environment srun passes on.
            "export RAY_AUTH_MODE=token",
            'export RAY_AUTH_TOKEN="$(od -An -N32 -tx1 /dev/urandom | tr -d \' \\n\')"',
            'log "starting the Ray head on $HEAD ($RAY_ADDRESS_ARG)"',
            '"${STEP[@]}" -w "$HEAD" "${CONTAINER[@]}" "${RAY[@]}" start --head --block --disable-usage-stats \\',
            ('  --node-ip-address="$HEAD_IP" --port="$RAY_PORT" --num-cpus="$CPUS_PER_NODE" '
             '--num-gpus="$GPUS_PER_NODE" \\'),
            '  --temp-dir="/tmp/ray_agentrl_${SLURM_JOB_ID}" &',
            "STEP_PIDS+=($!)",
            'on_head "$PY" -m megatron_agentrl.launch.ray_placement wait --address "$RAY_ADDRESS_ARG" --nodes 1 '
            f'--timeout {s.ray_start_timeout_s:g}',
            'for node in "${NODES[@]:1}"; do',
            '  log "starting a Ray worker on $node"',
            '  "${STEP[@]}" -w "$node" "${CONTAINER[@]}" "${RAY[@]}" start --address="$RAY_ADDRESS_ARG" --block \\',
            '    --disable-usage-stats --num-cpus="$CPUS_PER_NODE" --num-gpus="$GPUS_PER_NODE" &',
            "  STEP_PIDS+=($!)",
            "done",
            'on_head "$PY" -m megatron_agentrl.launch.ray_placement wait --address "$RAY_ADDRESS_ARG" '
            f'--nodes "$NNODES" --timeout {s.ray_start_timeout_s:g}',
            'log "Ray cluster up: $NNODES node(s); training"',
            ('on_head "${AGENTRL[@]}" train --config "$CONFIG" "${OVERRIDES[@]}" ray.enabled=true '
             'ray.address="$RAY_ADDRESS_ARG"'),
        ]
    else:
        body += [
            'if [ "$NNODES" -eq 1 ]; then',
            '  log "training on $HEAD"',
            '  on_head "${AGENTRL[@]}" train --config "$CONFIG" "${OVERRIDES[@]}"',
            "else",
            '  log "training with torchrun on $NNODES nodes"',
            ('  srun --overlap --nodes="$NNODES" --ntasks-per-node=1 --cpus-per-task="$CPUS_PER_NODE" '
             '"${CONTAINER[@]}" \\'),
            ('    "$PY" -m torch.distributed.run --nnodes="$NNODES" '
             '--nproc-per-node="$(( GPUS_PER_NODE > 0 ? GPUS_PER_NODE : 1 ))" \\'),
            '    --rdzv-backend=c10d --rdzv-endpoint="$HEAD_IP:29500" --rdzv-id="$SLURM_JOB_ID" \\',
            '    -m megatron_agentrl.cli train --config "$CONFIG" "${OVERRIDES[@]}"',
            "fi",
        ]
    body.append('log "training finished"')
    return "\n".join(head + [""] + body) + "\n"


def write_script(job: SlurmJob) -> Path:
    """Write the rendered script under ``job.script_dir`` (timestamped name) and return its path."""
    d = Path(job.script_dir)
    d.mkdir(parents=True, exist_ok=True)
    path = d / f"{job.slurm.job_name}_{time.strftime('%Y%m%d_%H%M%S')}_{os.getpid()}.sbatch"
    path.write_text(render_sbatch(job))
    path.chmod(0o755)
    return path


def _run(cmd: list[str], timeout_s: float = 60.0) -> subprocess.CompletedProcess:
    try:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        raise SlurmError(f"'{' '.join(cmd)}' did not answer within {timeout_s:g}s; is slurmctld up? "
                         "(scontrol ping)") from None


def submit(script: str | os.PathLike) -> str:
    """``sbatch --parsable script``; returns the job id. Raises SlurmError with sbatch's message."""
    proc = _run([_require("sbatch"), "--parsable", str(script)])
    if proc.returncode != 0:
        raise SlurmError(f"sbatch rejected {script}: {proc.stderr.strip() or proc.stdout.strip()}")
    job_id = proc.stdout.strip().split(";")[0]
    if not job_id.isdigit():
        raise SlurmError(f"sbatch answered {proc.stdout.strip()!r}, not a job id")
    return job_id


def job_state(job_id: str) -> dict[str, str]:
    """``{"state", "exit_code", "reason", "nodes"}`` of a job, from ``scontrol`` or, once purged, ``sacct``.

    Raises SlurmError when SLURM does not know the job.
    """
    proc = _run([_require("scontrol"), "show", "job", "-o", str(job_id)])
    if proc.returncode == 0 and "JobState=" in proc.stdout:
        fields = dict(re.findall(r"(\w+)=(\S*)", proc.stdout))
        return {"state": fields.get("JobState", "UNKNOWN"), "exit_code": fields.get("ExitCode", ""),
                "reason": fields.get("Reason", ""), "nodes": fields.get("NodeList", "")}
    if shutil.which("sacct"):
        acct = _run(["sacct", "-j", str(job_id), "-X", "-n", "-P", "-o", "State,ExitCode,NodeList"])
        line = acct.stdout.strip().splitlines()[:1]
        if acct.returncode == 0 and line:
            state, exit_code, nodes = (line[0].split("|") + ["", "", ""])[:3]
            return {"state": state.split()[0], "exit_code": exit_code, "reason": "", "nodes": nodes}
    raise SlurmError(f"SLURM does not know job {job_id}: {(proc.stderr or proc.stdout).strip() or 'no record'}")


def cancel(job_id: str) -> None:
    """``scancel job_id``; raises SlurmError with scancel's message."""
    proc = _run([_require("scancel"), str(job_id)])
    if proc.returncode != 0:
        raise SlurmError(f"scancel {job_id} failed: {proc.stderr.strip() or proc.stdout.strip()}")


def wait(job_id: str, timeout_s: float, poll_s: float = 2.0) -> dict[str, str]:
    """Poll until the job reaches a final state; returns :func:`job_state`. SlurmError after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    last = ""
    while True:
        info = job_state(job_id)
        if info["state"] != last:
            logger.info("job %s: %s", job_id, info["state"])
            last = info["state"]
        if info["state"] in FINAL_STATES:
            return info
        if time.monotonic() > deadline:
            raise SlurmError(f"job {job_id} is still {info['state']} after {timeout_s:g}s "
                             f"(reason: {info['reason'] or '-'}); cancel it with: agentrl slurm cancel {job_id}")
        time.sleep(poll_s)


# ---------------------------------------------------------------------------------------- CLI
def add_submit_arguments(p: argparse.ArgumentParser) -> None:
    """Options of ``agentrl slurm submit`` / ``tools/submit_slurm.py``."""
    p.add_argument("--config", required=True, help="run config YAML")
    p.add_argument("--nodes", type=int, help="nodes (default: slurm.nodes)")
    p.add_argument("--gpus-per-node", type=int, help="GPUs per node (default: slurm.gpus_per_node)")
    p.add_argument("--cpus-per-node", type=int, help="CPUs per node (default: slurm.cpus_per_node; 0 = SLURM's)")
    p.add_argument("--partition", help="partition (default: slurm.partition)")
    p.add_argument("--account", help="account (default: slurm.account)")
    p.add_argument("--time", help="time limit, e.g. 04:00:00 (default: slurm.time)")
    p.add_argument("--job-name", help="job name (default: slurm.job_name)")
    p.add_argument("--container-image", help="run the steps in this image (pyxis); default: slurm.container_image")
    p.add_argument("--container-mounts", help="--container-mounts of those steps")
    ray = p.add_mutually_exclusive_group()
    ray.add_argument("--ray", dest="ray", action="store_true", default=None,
                     help="start Ray in the allocation (default: slurm.ray)")
    ray.add_argument("--no-ray", dest="ray", action="store_false", help="train without Ray (torchrun on several nodes)")
    p.add_argument("--exclusive", action="store_true", default=None, help="whole nodes")
    p.add_argument("--python", help="interpreter on the nodes (default: this one; python3 in a container)")
    p.add_argument("--dry-run", action="store_true", help="print the script and submit nothing")
    p.add_argument("--wait", action="store_true", help="wait for the job to end; exit 0 only if it COMPLETED")
    p.add_argument("--wait-timeout", type=float, default=24 * 3600.0, help="limit on --wait, seconds")
    p.add_argument("overrides", nargs="*", help="key=value overrides of the run config")


def run_submit(args: argparse.Namespace) -> int:
    """``agentrl slurm submit``: render, then print (``--dry-run``) or submit (and ``--wait``)."""
    cfg = load_config(args.config, args.overrides)
    job = build_job(cfg, args.config, args.overrides, python=args.python, nodes=args.nodes,
                    gpus_per_node=args.gpus_per_node, cpus_per_node=args.cpus_per_node, partition=args.partition,
                    account=args.account, time=args.time, job_name=args.job_name,
                    container_image=args.container_image, container_mounts=args.container_mounts, ray=args.ray,
                    exclusive=args.exclusive)
    if args.dry_run:
        sys.stdout.write(render_sbatch(job))
        return 0
    _require("sbatch")
    script = write_script(job)
    job_id = submit(script)
    log = job.log_path.replace("%j", job_id)
    sys.stdout.write(f"submitted job {job_id}\nscript: {script}\nlog: {log}\n"
                     f"status: agentrl slurm status {job_id} | cancel: agentrl slurm cancel {job_id}\n")
    sys.stdout.flush()
    if not args.wait:
        return 0
    info = wait(job_id, args.wait_timeout)
    sys.stdout.write(f"job {job_id} {info['state']} (exit code {info['exit_code']}); log: {log}\n")
    return 0 if info["state"] == "COMPLETED" else 1


def run_status(args: argparse.Namespace) -> int:
    """``agentrl slurm status JOBID...``: one line per job."""
    rc = 0
    for job_id in args.job_ids:
        try:
            info = job_state(job_id)
        except SlurmError as e:
            sys.stderr.write(f"agentrl: error: {e}\n")
            rc = 1
            continue
        sys.stdout.write(f"{job_id} {info['state']} exit={info['exit_code'] or '-'} nodes={info['nodes'] or '-'} "
                         f"reason={info['reason'] or '-'}\n")
    return rc


def run_cancel(args: argparse.Namespace) -> int:
    """``agentrl slurm cancel JOBID...``."""
    for job_id in args.job_ids:
        cancel(job_id)
        sys.stdout.write(f"cancelled {job_id}\n")
    return 0


def _add_job_ids(p: argparse.ArgumentParser) -> None:
    """The options of ``slurm status`` and ``slurm cancel``: one or more job ids."""
    p.add_argument("job_ids", nargs="+")


# the subcommands of ``agentrl slurm``: name, help, the function that adds its options, the one that runs it
COMMANDS = (
    ("submit", "render the sbatch script from the config and flags, and submit it", add_submit_arguments, run_submit),
    ("status", "state of jobs", _add_job_ids, run_status),
    ("cancel", "cancel jobs (scancel)", _add_job_ids, run_cancel),
)


def main_submit(argv: list[str] | None = None) -> int:
    """``tools/submit_slurm.py``: the options of ``agentrl slurm submit``."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", datefmt="%H:%M:%S")
    p = argparse.ArgumentParser(prog="submit_slurm.py", description="Submit an agentrl training run to SLURM.")
    add_submit_arguments(p)
    args = p.parse_args(argv)
    try:
        return run_submit(args)
    except (ConfigError, SlurmError, FileNotFoundError) as e:
        sys.stderr.write(f"submit_slurm.py: error: {e}\n")
        return 2
