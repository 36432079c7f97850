"""``agentrl plan``: the layout and memory plan of a run, and with ``--check`` a pre-flight check.

::

    agentrl plan --config examples/configs/glm4_9b_multitask.yaml
    agentrl plan --config ... --check [--reference-hf-config DIR] [--strict]

The check validates everything it can on the machine it runs on and says what it could not:

* **ok**: verified here (config, layout, memory estimate per GPU, paths that exist, endpoints
  that answered, the sbatch script renders, the tools import);
* **not verified here**: needs the cluster (GPUs absent, weights not downloaded here, task
  endpoints not reachable from here, no ``sbatch``); reported, not a failure unless ``--strict``;
* **FAIL**: wrong wherever it runs (bad config, a layout that does not divide or does not fit,
  a pool larger than the allocation, a task that nothing serves).

Exit status 0 when nothing failed, 1 otherwise.
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import sys
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from megatron_agentrl.config import Config, ConfigError, load_config
from megatron_agentrl.launch.plan import MemoryPlan, ModelShape, estimate_memory, format_layout, format_plan

logger = logging.getLogger(__name__)

OK, UNVERIFIED, FAIL = "ok", "not verified here", "FAIL"


@dataclass
class CheckReport:
    """The outcome of :func:`check_run`: one ``(status, item, detail)`` per check, and the plan."""

    items: list[tuple[str, str, str]] = field(default_factory=list)
    plan: MemoryPlan | None = None

    def add(self, status: str, item: str, detail: str) -> None:
        """Record one check."""
        self.items.append((status, item, detail))

    @property
    def failed(self) -> list[tuple[str, str, str]]:
        """The checks that failed."""
        return [i for i in self.items if i[0] == FAIL]

    @property
    def unverified(self) -> list[tuple[str, str, str]]:
        """The checks that need the cluster."""
        return [i for i in self.items if i[0] == UNVERIFIED]

    def format(self) -> str:
        """The plan, the checklist and a last summary line."""
        lines = []
        if self.plan is not None:
            lines += ["== plan (per GPU) ==", format_plan(self.plan), ""]
        lines.append("== check ==")
        width = max((len(i[1]) for i in self.items), default=10)
        for status, item, detail in self.items:
            lines.append(f"[{status:>17}] {item:<{width}}  {detail}")
        n_ok = sum(1 for i in self.items if i[0] == OK)
        lines.append("")
        if self.failed:
            lines.append(f"check FAILED: {len(self.failed)} problem(s): " + "; ".join(i[1] for i in self.failed))
        else:
            lines.append(f"check passed: {n_ok} verified, {len(self.unverified)} not verifiable on this machine"
                         + (" (" + ", ".join(i[1] for i in self.unverified) + ")" if self.unverified else ""))
        return "\n".join(lines)


def _read_hf_config(path: str | Path) -> dict[str, Any] | None:
    p = Path(path)
    if p.is_dir():
        p = p / "config.json"
    if not p.is_file():
        return None
    try:
        return json.loads(p.read_text())
    except json.JSONDecodeError as e:
        raise ConfigError(f"'{p}' is not valid JSON: {e}") from None


def probe_http(url: str, timeout_s: float = 3.0, token: str | None = None) -> tuple[bool, str]:
    """GET ``url`` (with ``Authorization: Bearer <token>`` when given): (True, "HTTP <status>") for any HTTP
    answer, (False, why) when nothing answered."""
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    try:
        with urllib.request.urlopen(urllib.request.Request(url, method="GET", headers=headers),
                                    timeout=timeout_s) as resp:
            return True, f"HTTP {resp.status}"
    except urllib.error.HTTPError as e:  # it answered, with an error status: reachable
        return True, f"HTTP {e.code}"
    except (urllib.error.URLError, OSError, ValueError) as e:
        reason = getattr(e, "reason", e)
        return False, str(reason)


def _gpus_here() -> list[tuple[str, float]]:
    """(name, GiB) of each CUDA device visible here; empty without CUDA."""
    try:
        import torch

        if not torch.cuda.is_available():
            return []
        return [(torch.cuda.get_device_name(i), torch.cuda.get_device_properties(i).total_memory / 1024**3)
                for i in range(torch.cuda.device_count())]
    except Exception:  # noqa: BLE001 - no usable CUDA is the same as none here
        return []


def _check_model(cfg: Config, report: CheckReport, reference: str | None, strict: bool) -> dict[str, Any] | None:
    m = cfg.model
    missing = UNVERIFIED if not strict else FAIL
    hf = None
    if m.hf_config is not None:
        hf = _read_hf_config(m.hf_config)
        if hf is not None:
            report.add(OK, "model config", f"{m.hf_config}: {hf.get('model_type')} {hf.get('architectures', [''])[0]}")
        elif reference and (ref := _read_hf_config(reference)) is not None:
            hf = ref
            report.add(missing, "model config", f"model.hf_config='{m.hf_config}' is not on this machine; the plan "
                       f"uses the reference config {reference} ({ref.get('model_type')}, same numbers as the "
                       "published model)")
        else:
            report.add(FAIL if strict or not reference else missing, "model config",
                       f"model.hf_config='{m.hf_config}' does not exist and no reference config was given; "
                       "nothing to plan from")
    elif m.arch:
        hf = dict(m.arch)
        hf.setdefault("vocab_size", 32000)
        report.add(OK, "model config", f"inline model.arch ({hf.get('model_type')})")
    if hf is not None:
        from megatron_agentrl.hf_io import SUPPORTED_MODEL_TYPES

        if hf.get("model_type") not in SUPPORTED_MODEL_TYPES:
            report.add(FAIL, "model family",
                       f"model_type={hf.get('model_type')!r} is not one of {', '.join(SUPPORTED_MODEL_TYPES)}")
    for key, value, want_dir in (("model.checkpoint", m.checkpoint, True), ("model.tokenizer", m.tokenizer, False),
                                 ("model.megatron_checkpoint", m.megatron_checkpoint, True)):
        if value is None:
            continue
        p = Path(value)
        if (p.is_dir() if want_dir else p.exists()):
            has_safetensors = any(p.glob("*.safetensors")) or (p / "model.safetensors.index.json").is_file()
            is_dist_ckpt = (p / "metadata.json").is_file() and (p / ".metadata").is_file()
            if key == "model.checkpoint" and not has_safetensors:
                report.add(FAIL, key, f"'{value}' holds no safetensors weights")
            elif key == "model.megatron_checkpoint" and not is_dist_ckpt:
                report.add(FAIL, key, f"'{value}' is not a megatron distributed checkpoint (no metadata.json and "
                           f".metadata); write it with `agentrl convert hf-to-megatron --out-dir {value}`")
            else:
                report.add(OK, key, f"'{value}' exists")
        elif key == "model.megatron_checkpoint":
            report.add(missing, key, f"'{value}' is not on this machine (write it there with `agentrl convert "
                       f"hf-to-megatron --hf-dir <HF checkpoint> --out-dir {value}`)")
        else:
            report.add(missing, key, f"'{value}' is not on this machine (download the model there first)")
    return hf


def _check_tasks(cfg: Config, report: CheckReport, strict: bool, timeout_s: float) -> None:
    from env_controller.tasks import TASKS

    env = cfg.env
    remote = [t.name for t in cfg.tasks if t.name not in TASKS]
    local = [t.name for t in cfg.tasks if t.name in TASKS]
    if local:
        report.add(OK, "built-in tasks", ", ".join(local) + " (run in process)")
    if remote and not env.controller_url and not cfg.ray.controller:
        report.add(FAIL, "tasks", f"{', '.join(remote)} are not built-in tasks and nothing serves them: set "
                   "env.controller_url to the controller the task workers register with (or ray.controller: true)")
        return
    unreachable = UNVERIFIED if not strict else FAIL
    if env.controller_url:
        from env_controller.clients.http_client import base_api_url
        from env_controller.http.auth import TOKEN_ENV, TRAINER_TOKEN_ENV, pick_token, redact_url, resolve_token

        # the trainer's credential, found as the env client finds it
        bare, token = pick_token(env.token or None, base_api_url(env.controller_url), "plan")
        token = resolve_token(token, TRAINER_TOKEN_ENV, TOKEN_ENV)
        ok, why = probe_http(bare + "/list_workers", timeout_s, token)
        shown = redact_url(env.controller_url)
        if why in ("HTTP 401", "HTTP 403"):
            report.add(FAIL, "env controller",
                       f"{shown} refused the trainer's credential ({why}): set env.token (or "
                       f"${TRAINER_TOKEN_ENV}) to the controller's --trainer-token / --token")
        else:
            report.add(OK if ok else unreachable, "env controller",
                       f"{shown}: " + (f"answers ({why})" if ok else f"not reachable from here ({why})"))
    elif cfg.ray.controller:
        report.add(OK, "env controller", "started by the Ray launcher in its own placement group (ray.controller)")
    for task in remote:
        urls = env.workers.get(task, [])
        if not urls:
            report.add(unreachable, f"task {task}",
                       "no worker endpoint listed in env.workers; its workers must register with the controller")
            continue
        answers = [(u, *probe_http(u.rstrip("/") + "/get_indices", timeout_s)) for u in urls]
        bad = [f"{u} ({why})" for u, ok, why in answers if not ok]
        if bad:
            report.add(unreachable, f"task {task}",
                       f"{len(bad)} of {len(urls)} worker(s) not reachable from here: " + ", ".join(bad))
        else:
            report.add(OK, f"task {task}", f"{len(urls)} worker(s) answer")


def _check_experts(cfg: Config, hf: dict[str, Any], plan: MemoryPlan, report: CheckReport) -> None:
    """A mixture-of-experts run: megatron can express the router, and the layout can train it."""
    from types import SimpleNamespace

    from megatron_agentrl.megatron.moe import moe_options

    t, lay = cfg.train, plan.layout
    try:
        moe_options(SimpleNamespace(**hf), cfg.parallel.ep, t.moe_aux_loss_coeff, t.moe_capacity_factor)
    except ConfigError as e:
        report.add(FAIL, "mixture of experts", str(e))
        return
    aux = "off" if t.moe_aux_loss_coeff == 0 else f"coefficient {t.moe_aux_loss_coeff:g}"
    drop = "dropless" if t.moe_capacity_factor is None else f"capacity factor {t.moe_capacity_factor:g}"
    engines = (f"; each engine holds all experts over TP {lay['gpus_per_engine']}" if lay["gpus_per_engine"]
               else "")
    report.add(OK, "mixture of experts", f"{lay['experts']} experts, top-{lay['experts_per_token']}; EP "
               f"{lay['ep']}: {lay['experts_per_rank']} experts per train rank, expert DP {lay['expert_dp']}; "
               f"load-balancing loss {aux}, {drop}{engines}")


def _check_lora(cfg: Config, hf: dict[str, Any], report: CheckReport) -> None:
    """The adapters' size against the model's, and the LoRA flags the engines get."""
    from rollout_sglang.engines.sglang_options import SGLangLaunchOptions

    shape = ModelShape.from_hf(hf)
    lo = cfg.lora
    adapters = sum(shape.lora_params(i, lo.megatron_modules(), lo.rank) for i in range(shape.num_layers))
    flags = " ".join(SGLangLaunchOptions().with_lora(lo.rank, list(lo.target_modules), cfg.rollout.max_versions)
                     .lora_args())
    report.add(OK, "LoRA", f"rank {lo.rank} on {', '.join(lo.target_modules)}: {adapters / 1e6:.1f}M adapter "
               f"parameters ({100 * adapters / shape.total_params():.2f} % of the model) train, the base is frozen; "
               f"{cfg.rollout.max_versions} live versions as adapters on each engine ({flags})")


def check_run(cfg: Config, config_path: str, overrides: list[str], *, reference_hf_config: str | None = None,
              gpu_memory_gib: float = 80.0, strict: bool = False, probe_timeout_s: float = 3.0) -> CheckReport:
    """Check the run ``cfg`` on this machine (see the module doc); never raises for what it checks."""
    report = CheckReport()
    report.add(OK, "config", f"{config_path} loads and validates ({len(overrides)} override(s))")
    hf = _check_model(cfg, report, reference_hf_config, strict)

    s = cfg.slurm
    total = s.nodes * s.gpus_per_node if s.gpus_per_node else None
    if hf is not None:
        try:
            plan = estimate_memory(hf, cfg, gpu_memory_gib=gpu_memory_gib, total_gpus=total)
        except ConfigError as e:
            report.add(FAIL, "layout", str(e))
        else:
            report.plan = plan
            lay = plan.layout
            report.add(OK, "layout", f"{format_layout(lay, show_ep=True)}: {lay['train_workers']} train ranks; "
                       f"{lay['rollout_slots']} version slots x {lay['engines_per_slot']} engines x "
                       f"{lay['gpus_per_engine']} GPUs"
                       + (f"; {total} GPUs in {s.nodes} node(s)" if total else ""))
            if lay["experts"]:
                _check_experts(cfg, hf, plan, report)
            if cfg.lora.enabled:
                _check_lora(cfg, hf, report)
            for p in plan.layout_problems:
                report.add(FAIL, "pools vs allocation", p)
            for p in plan.memory_problems():
                report.add(FAIL, "memory", p)
            if not plan.memory_problems():
                detail = f"train ~{plan.train_total_gib:.1f} GiB per GPU"
                if plan.rollout:
                    detail += f", rollout ~{plan.rollout_total_gib:.1f} GiB per GPU"
                report.add(OK, "memory estimate", detail + f" (of {gpu_memory_gib:.0f} GiB)")
            if s.gpus_per_node and cfg.parallel.tp > s.gpus_per_node:
                report.add(FAIL, "tensor parallel", f"parallel.tp={cfg.parallel.tp} spans more than one node of "
                           f"{s.gpus_per_node} GPUs; keep TP within a node")

    gpus = _gpus_here()
    need = (f"{s.nodes} node(s) x {s.gpus_per_node} GPU(s) of >= {gpu_memory_gib:.0f} GiB" if s.gpus_per_node
            else "no GPU")
    if not gpus:
        report.add(UNVERIFIED if s.gpus_per_node else OK, "GPUs",
                   f"no CUDA GPU on this machine; the run needs {need}" if s.gpus_per_node else "the run needs no GPU")
    else:
        small = [g for g in gpus if g[1] < 0.95 * gpu_memory_gib]
        report.add(FAIL if small else OK, "GPUs",
                   f"{len(gpus)} here ({gpus[0][0]}, {gpus[0][1]:.0f} GiB); the run needs {need}")

    on_ray = cfg.ray.active or bool(s.ray)  # the SLURM script starts Ray and adds ray.enabled=true when slurm.ray
    problem = cfg.engine_placement_problem(on_ray)
    report.add(FAIL if problem else OK, "engine placement", problem or (
        f"SGLang engines of {cfg.ray.rollout_gpus_per_engine} GPU(s) placed by Ray" if cfg.ray.rollout_gpus_per_engine
        and not cfg.rollout.engine_urls else "the servers of rollout.engine_urls" if cfg.rollout.engine_urls
        else "the local engine in trainer rank 0"))
    if cfg.rollout.cross_policy != "latest":
        report.add(OK, "cross-policy sampling",
                   f"{cfg.rollout.cross_policy} over {cfg.rollout.max_versions} "
                   + ("live versions as LoRA adapters on one engine pool" if cfg.lora.enabled else "version slots"))
    if cfg.algo.normalize_per_task:
        report.add(OK, "per-task normalization", f"on, over {len(cfg.tasks)} task(s)")

    _check_tasks(cfg, report, strict, probe_timeout_s)

    out = Path(cfg.output_dir).resolve()
    parent = next((p for p in [out, *out.parents] if p.exists()), None)
    if parent is not None and os.access(parent, os.W_OK):
        report.add(OK, "output_dir", f"{out} can be created here")
    else:
        report.add(UNVERIFIED, "output_dir", f"{out} cannot be created on this machine (a cluster path?)")

    from megatron_agentrl.launch.slurm import build_job, render_sbatch

    try:
        script = render_sbatch(build_job(cfg, config_path, overrides))
        report.add(OK, "sbatch script",
                   f"renders ({len(script.splitlines())} lines; agentrl slurm submit --dry-run prints it)")
    except ConfigError as e:
        report.add(FAIL, "sbatch script", str(e))
    if shutil.which("sbatch") is None:
        report.add(UNVERIFIED, "SLURM", "no sbatch on this machine; submission is checked on the cluster's login node")
    else:
        report.add(OK, "SLURM", f"sbatch at {shutil.which('sbatch')}")

    import importlib.util

    for module, what in (("ray", "Ray"), ("megatron_agentrl.convert.cli", "agentrl convert")):
        found = importlib.util.find_spec(module) is not None
        report.add(OK if found else FAIL, what,
                   "importable" if found else f"'{module}' is missing: reinstall (make install)")
    return report


def run_plan(args: argparse.Namespace) -> int:
    """``agentrl plan``: print the plan; with ``--check`` the checklist too (exit 1 on a failure)."""
    try:
        cfg = load_config(args.config, args.overrides)
    except ConfigError as e:
        sys.stdout.write(f"[FAIL] config: {e}\ncheck FAILED: config\n")
        return 1
    if args.check:
        report = check_run(cfg, args.config, args.overrides, reference_hf_config=args.reference_hf_config,
                           gpu_memory_gib=args.gpu_memory_gib, strict=args.strict, probe_timeout_s=args.probe_timeout)
        sys.stdout.write(report.format() + "\n")
        return 1 if report.failed else 0
    hf = _read_hf_config(cfg.model.hf_config) if cfg.model.hf_config else dict(cfg.model.arch)
    if hf is None and args.reference_hf_config:
        hf = _read_hf_config(args.reference_hf_config)
    if not hf:
        raise ConfigError(f"model.hf_config='{cfg.model.hf_config}' does not exist; pass --reference-hf-config "
                          "with a config.json of the same model")
    s = cfg.slurm
    plan = estimate_memory(hf, cfg, gpu_memory_gib=args.gpu_memory_gib,
                           total_gpus=s.nodes * s.gpus_per_node if s.gpus_per_node else None)
    sys.stdout.write(format_plan(plan) + "\n")
    for p in plan.problems():
        sys.stdout.write(f"problem: {p}\n")
    return 1 if plan.problems() else 0


def add_plan_arguments(p: argparse.ArgumentParser) -> None:
    """The options of ``agentrl plan``."""
    p.add_argument("--config", required=True, help="run config YAML")
    p.add_argument("--check", action="store_true",
                   help="check config, paths, endpoints, GPUs, memory; report what cannot be verified here")
    p.add_argument("--strict", action="store_true",
                   help="with --check: what cannot be verified here fails too (run it on the cluster)")
    p.add_argument("--reference-hf-config", default=None,
                   help="config.json (or its directory) to plan from when model.hf_config is not here")
    p.add_argument("--gpu-memory-gib", type=float, default=80.0, help="memory of one GPU, GiB (default 80: H100 80GB)")
    p.add_argument("--probe-timeout", type=float, default=3.0, help="seconds to wait for each endpoint")
    p.add_argument("overrides", nargs="*", help="key=value overrides of the run config")
