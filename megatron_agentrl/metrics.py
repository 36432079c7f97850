"""Run metrics: TensorBoard scalars and histograms, Weights & Biases, a JSONL file, GPU use, and the per-task
reward plot.

Everything lands under the run's ``output_dir``: ``metrics.jsonl`` (one JSON object per record, always),
``tensorboard/<phase>/`` (event files of ``sft``, ``rl`` and ``eval``, ``logging.tensorboard``), ``wandb/``
(the W&B run, ``logging.wandb``; offline by default, ``wandb sync`` uploads it later) and
``reward_by_task.png``. ``wandb`` is imported only when W&B logging is on.
"""
from __future__ import annotations

import importlib.util
import json
import logging
from pathlib import Path
from typing import Any

from megatron_agentrl.config import ConfigError, LoggingConfig

logger = logging.getLogger(__name__)

WANDB_FIX = "install it (.venv/bin/pip install 'wandb>=0.31,<0.32') or set logging.wandb=false"


def require_wandb() -> None:
    """ConfigError naming ``logging.wandb`` and the fix when the ``wandb`` package is not installed
    (a cheap check that imports nothing, for every rank before a run starts)."""
    try:
        found = importlib.util.find_spec("wandb") is not None
    except (ImportError, ValueError):
        found = False
    if not found:
        raise ConfigError(f"logging.wandb=true but the wandb package is not installed; {WANDB_FIX}")


class MetricsLogger:
    """Writes one record per step to ``metrics.jsonl``, TensorBoard and Weights & Biases.

    output_dir: the run's folder. tensorboard: write TensorBoard events. wandb: the run's ``logging``
    section when W&B logging is on (``logging.wandb``), else None. run_config: the config W&B records
    (``config_to_dict(cfg)``). Each phase (``sft``, ``rl``, ``eval``) gets its own W&B step axis
    (``<phase>/step``), since SFT and RL steps both count from 1.
    """

    def __init__(self, output_dir: str | Path, tensorboard: bool = True, wandb: LoggingConfig | None = None,
                 run_config: dict[str, Any] | None = None) -> None:
        self.dir = Path(output_dir)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.jsonl_path = self.dir / "metrics.jsonl"
        self._jsonl = self.jsonl_path.open("a")
        self._tensorboard = tensorboard
        self._tb: dict[str, Any] = {}  # phase -> its SummaryWriter, made on first use
        self._purge_after: int | None = None
        self._wandb: Any = None  # the W&B run
        self._wandb_phases: set[str] = set()
        self._closed = False
        if wandb is not None and wandb.wandb:
            self._wandb = _start_wandb(self.dir, wandb, run_config or {})

    def _writer(self, phase: str) -> Any:
        """The phase's TensorBoard writer (None without TensorBoard). Each phase has its own folder, so that a
        resumed run can drop its RL and evaluation points past the checkpoint without touching the warm-up's."""
        if not self._tensorboard:
            return None
        if phase not in self._tb:
            from torch.utils.tensorboard import SummaryWriter

            purge = self._purge_after + 1 if self._purge_after is not None and phase != "sft" else None
            self._tb[phase] = SummaryWriter(str(self.dir / "tensorboard" / phase), purge_step=purge)
        return self._tb[phase]

    def resume_at(self, step: int) -> None:
        """A run resumed from the checkpoint of RL step ``step``: drop what an earlier run of this output
        directory recorded past it (``metrics.jsonl`` rows of the ``rl`` and ``eval`` phases, their TensorBoard
        points), so that each step is recorded once. The warm-up's records stay. Call before logging."""
        self._purge_after = int(step)
        self._jsonl.close()
        truncate_jsonl(self.jsonl_path, lambda r: r.get("phase") == "sft" or int(r.get("step", 0)) <= step)
        self._jsonl = self.jsonl_path.open("a")

    @property
    def wandb_dir(self) -> Path | None:
        """The W&B run's folder (under ``output_dir/wandb``), or None without W&B."""
        return Path(self._wandb.dir).parent if self._wandb is not None else None

    def _wandb_axis(self, phase: str) -> None:
        """Give ``phase`` its own W&B step axis the first time it logs."""
        if phase not in self._wandb_phases:
            self._wandb_phases.add(phase)
            self._wandb.define_metric(f"{phase}/step")
            self._wandb.define_metric(f"{phase}/*", step_metric=f"{phase}/step")

    def log(self, step: int, metrics: dict[str, float], phase: str = "rl") -> None:
        """Record ``metrics`` (name -> number) for ``step``; names like ``reward/lookup`` group in TensorBoard."""
        record = {"phase": phase, "step": step, **{k: float(v) for k, v in metrics.items()}}
        self._jsonl.write(json.dumps(record) + "\n")
        self._jsonl.flush()
        tb = self._writer(phase)
        if tb is not None:
            for k, v in metrics.items():
                tb.add_scalar(f"{phase}/{k}", float(v), step)
            tb.flush()
        if self._wandb is not None:
            self._wandb_axis(phase)
            self._wandb.log({f"{phase}/step": step, **{f"{phase}/{k}": float(v) for k, v in metrics.items()}})

    def histogram(self, step: int, name: str, values: list[float], phase: str = "rl") -> None:
        """A histogram (e.g. the staleness of the step's samples) for TensorBoard and W&B; not written to the
        JSONL."""
        if not values:
            return
        tb = self._writer(phase)
        if tb is not None:
            import numpy as np

            tb.add_histogram(f"{phase}/{name}", np.asarray(values, dtype=np.float64), step)
        if self._wandb is not None:
            import wandb

            self._wandb_axis(phase)
            self._wandb.log({f"{phase}/step": step, f"{phase}/{name}": wandb.Histogram(values)})

    def close(self, failed: bool = False) -> None:
        """Flush and close the files; the W&B run ends (``failed``: with exit code 1). Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._jsonl.close()
        for tb in self._tb.values():
            tb.close()
        if self._wandb is not None:
            self._wandb.finish(exit_code=1 if failed else 0)


def truncate_jsonl(path: Path, keep: Any) -> int:
    """Rewrite the JSONL file ``path`` with the records for which ``keep(record)`` holds (a line that does not
    parse, e.g. torn by a killed process, is dropped too); returns how many records were dropped. The file is
    replaced at once (written beside it, then renamed), so a crash meanwhile leaves the old one."""
    if not path.exists():
        return 0
    kept, dropped = [], 0
    for line in path.read_text().splitlines():
        try:
            ok = bool(line.strip()) and keep(json.loads(line))
        except (ValueError, TypeError, AttributeError):
            ok = False
        if ok:
            kept.append(line)
        else:
            dropped += bool(line.strip())
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("".join(f"{line}\n" for line in kept))
    tmp.replace(path)
    if dropped:
        logger.info("%s: dropped %d record(s) past the resumed checkpoint", path, dropped)
    return dropped


def _start_wandb(output_dir: Path, settings: LoggingConfig, run_config: dict[str, Any]) -> Any:
    """A W&B run writing under ``output_dir/wandb`` (project, name and mode from ``settings``)."""
    try:
        import wandb
    except ImportError as e:
        raise ConfigError(f"logging.wandb=true but the wandb package does not import ({e}); {WANDB_FIX}") from None
    name = settings.wandb_run_name or output_dir.resolve().name
    try:
        # console capture off: it would wrap stdout under the rich progress bars; no git probe, no system stats
        return wandb.init(project=settings.wandb_project, name=name, dir=str(output_dir), mode=settings.wandb_mode,
                          config=run_config, settings=wandb.Settings(console="off", disable_git=True,
                                                                     x_disable_stats=True, silent=True))
    except Exception as e:  # noqa: BLE001 - e.g. online mode without credentials or network
        hint = ("log in (wandb login, or WANDB_API_KEY) and check the network, or use logging.wandb_mode=offline"
                if settings.wandb_mode == "online" else "see output_dir/wandb/debug.log")
        raise ConfigError(f"logging.wandb=true (logging.wandb_mode={settings.wandb_mode}): W&B could not start a "
                          f"run ({type(e).__name__}: {e}); {hint}") from e


def read_metrics(jsonl_path: str | Path, phase: str = "rl") -> list[dict]:
    """The records of ``phase`` from a ``metrics.jsonl`` file, in step order."""
    rows = [json.loads(line) for line in Path(jsonl_path).read_text().splitlines() if line.strip()]
    return sorted((r for r in rows if r.get("phase") == phase), key=lambda r: r["step"])


def plot_task_rewards(jsonl_path: str | Path, png_path: str | Path, prefix: str = "reward/") -> Path:
    """Plot every ``reward/<task>`` series of the RL phase against step into a PNG; returns its path."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = read_metrics(jsonl_path)
    tasks = sorted({k[len(prefix):] for r in rows for k in r if k.startswith(prefix)})
    fig, ax = plt.subplots(figsize=(7, 4))
    for task in tasks:
        pts = [(r["step"], r[prefix + task]) for r in rows if prefix + task in r]
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", markersize=3, label=task)
    ax.set_xlabel("RL step")
    ax.set_ylabel("mean reward")
    ax.set_title("Per-task reward by step")
    ax.grid(alpha=0.3)
    if tasks:
        ax.legend()
    fig.tight_layout()
    png_path = Path(png_path)
    fig.savefig(png_path, dpi=100)
    plt.close(fig)
    return png_path


_NVML: object | None = None


def gpu_stats() -> dict[str, float]:
    """GPU use through ``nvidia-ml-py`` (``pynvml``): ``gpu/util`` (mean utilisation %, over the
    visible GPUs) and ``gpu/mem_gb`` (memory used, GB, summed); ``{}`` without the package or a GPU."""
    global _NVML
    try:
        import pynvml  # type: ignore[import-not-found]
    except Exception:  # noqa: BLE001 - optional
        return {}
    try:
        if _NVML is None:
            pynvml.nvmlInit()
            _NVML = pynvml
        n = pynvml.nvmlDeviceGetCount()
        if n == 0:
            return {}
        util, mem = 0.0, 0.0
        for i in range(n):
            h = pynvml.nvmlDeviceGetHandleByIndex(i)
            util += float(pynvml.nvmlDeviceGetUtilizationRates(h).gpu)
            mem += float(pynvml.nvmlDeviceGetMemoryInfo(h).used) / 1e9
        return {"gpu/util": util / n, "gpu/mem_gb": mem}
    except Exception:  # noqa: BLE001 - no driver / no device
        return {}
