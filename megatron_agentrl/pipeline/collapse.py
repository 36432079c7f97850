"""A per-task alarm for collapse: a task's training reward falls far below its recent level and stays there.

Once every group of a task scores the same (all 0 after a collapse), GRPO gives it zero advantages
and nothing brings it back, while the other tasks keep the run's averages looking healthy. The
monitor watches each task's mean env reward per step (``reward/<task>``): a step is *low* when
the reward is below ``(1 - drop)`` times the task's recent level and at least ``min_drop`` below it
in absolute terms; after ``patience`` low steps in a row the task is flagged (one console warning,
``collapse/<task>`` = 1 in the metrics) until a step is back above the line. The recent level is
the mean of the task's last ``window`` non-low steps, so a lasting collapse does not drag it down.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field


@dataclass
class _TaskState:
    history: deque = field(default_factory=deque)  # rewards of recent non-low steps
    low_run: int = 0
    collapsed: bool = False


class CollapseMonitor:
    """Tracks each task's reward over RL steps and reports collapses (see the module doc).

    window: non-low steps the recent level is the mean of (0 turns the monitor off); at least
        ``window // 2`` of them are needed before any step counts as low.
    drop: fraction of the recent level a step must fall below, in (0, 1].
    min_drop: smallest absolute fall that counts (rewards near 0 stay quiet).
    patience: low steps in a row that make a collapse.
    """

    def __init__(self, window: int = 10, drop: float = 0.5, min_drop: float = 0.2, patience: int = 3) -> None:
        if window < 0 or patience < 1 or not 0 < drop <= 1 or min_drop < 0:
            raise ValueError(f"CollapseMonitor(window={window}, drop={drop}, min_drop={min_drop}, "
                             f"patience={patience}): needs window >= 0, 0 < drop <= 1, min_drop >= 0, patience >= 1")
        self.window, self.drop, self.min_drop, self.patience = int(window), float(drop), float(min_drop), int(patience)
        self._tasks: dict[str, _TaskState] = {}

    def update(self, step: int, metrics: dict[str, float]) -> tuple[dict[str, float], list[str]]:
        """Feed one step's metrics (``reward/<task>`` keys); returns ``({"collapse/<task>": 0 or 1}, messages)``
        where the messages (one per change: a collapse found, a collapse over) are for the console."""
        if self.window == 0:
            return {}, []
        flags: dict[str, float] = {}
        messages: list[str] = []
        for key, reward in sorted(metrics.items()):
            if not key.startswith("reward/"):
                continue
            task = key[len("reward/"):]
            st = self._tasks.setdefault(task, _TaskState(history=deque(maxlen=self.window)))
            level = sum(st.history) / len(st.history) if st.history else 0.0
            ready = len(st.history) >= max(1, self.window // 2)
            low = ready and reward < (1 - self.drop) * level and level - reward >= self.min_drop
            if low:
                st.low_run += 1
                if st.low_run >= self.patience and not st.collapsed:
                    st.collapsed = True
                    messages.append(
                        f"task '{task}' may have collapsed: its training reward has been {reward:.3f} or near it for "
                        f"{st.low_run} steps (step {step}), down from a recent level of {level:.3f}. A task whose "
                        "groups all score the same gets no GRPO signal and cannot recover by itself: check its "
                        "samples, lower train.lr, or add a KL anchor (loss.kl_coef)")
            else:
                if st.collapsed:
                    messages.append(f"task '{task}' recovered at step {step}: training reward {reward:.3f} "
                                    f"(recent level {level:.3f})")
                st.low_run, st.collapsed = 0, False
                st.history.append(float(reward))
            flags[f"collapse/{task}"] = 1.0 if st.collapsed else 0.0
        return flags, messages
