"""Run metrics: TensorBoard scalars and histograms, a JSONL file, GPU use, and the per-task reward plot.

Everything lands under the run's ``output_dir``: ``tensorboard/`` (event files),
``metrics.jsonl`` (one JSON object per step) and ``reward_by_task.png``.
"""
from __future__ import annotations

import json
import logging
from pathlib import Path

logger = logging.getLogger(__name__)


class MetricsLogger:
    """Writes one record per step to TensorBoard and to ``metrics.jsonl``."""

    def __init__(self, output_dir: str | Path, tensorboard: bool = True):
        self.dir = Path(output_dir)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.jsonl_path = self.dir / "metrics.jsonl"
        self._jsonl = self.jsonl_path.open("a")
        self._tb = None
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(str(self.dir / "tensorboard"))

    def log(self, step: int, metrics: dict[str, float], phase: str = "rl") -> None:
        """Record ``metrics`` (name -> number) for ``step``; names like ``reward/lookup`` group in TensorBoard."""
        record = {"phase": phase, "step": step, **{k: float(v) for k, v in metrics.items()}}
        self._jsonl.write(json.dumps(record) + "\n")
        self._jsonl.flush()
        if self._tb is not None:
            for k, v in metrics.items():
                self._tb.add_scalar(f"{phase}/{k}", float(v), step)
            self._tb.flush()

    def histogram(self, step: int, name: str, values: list[float], phase: str = "rl") -> None:
        """A TensorBoard histogram (e.g. the staleness of the step's samples); not written to the JSONL."""
        if self._tb is not None and values:
            import numpy as np

            self._tb.add_histogram(f"{phase}/{name}", np.asarray(values, dtype=np.float64), step)

    def close(self) -> None:
        """Flush and close the files."""
        self._jsonl.close()
        if self._tb is not None:
            self._tb.close()


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
