"""The collapse alarm: a task whose training reward falls far below its recent level and stays there."""
from __future__ import annotations

import random

import pytest

from megatron_agentrl.pipeline.collapse import CollapseMonitor


def feed(monitor: CollapseMonitor, series: dict[str, list[float]]) -> tuple[list[dict], list[tuple[int, str]]]:
    flags, messages = [], []
    for step in range(len(next(iter(series.values())))):
        f, msgs = monitor.update(step + 1, {f"reward/{t}": v[step] for t, v in series.items()} | {"loss": 0.1})
        flags.append(f)
        messages += [(step + 1, m) for m in msgs]
    return flags, messages


def test_a_collapsed_task_is_flagged_once_and_the_others_not():
    """The demo's failure: guess sat near 0.9 for a while, then scored 0 from one step to the end."""
    rng = random.Random(0)
    guess = [0.85 + 0.1 * rng.random() for _ in range(12)] + [0.0] * 8
    lookup = [0.3 + 0.02 * i + 0.1 * rng.random() for i in range(20)]  # learning, noisy
    flags, messages = feed(CollapseMonitor(window=10, drop=0.5, patience=3), {"guess": guess, "lookup": lookup})
    assert [(s, m.split(":")[0]) for s, m in messages] == [(15, "task 'guess' may have collapsed")]
    assert "down from a recent level of 0.9" in messages[0][1] and "loss.kl_coef" in messages[0][1]
    assert [f["collapse/guess"] for f in flags] == [0.0] * 14 + [1.0] * 6
    assert all(f["collapse/lookup"] == 0.0 for f in flags)


def test_a_dip_shorter_than_the_patience_and_a_recovery():
    series = [0.8] * 10 + [0.1, 0.1] + [0.8] * 3 + [0.0] * 4 + [0.7]
    flags, messages = feed(CollapseMonitor(window=10, patience=3), {"calc": series})
    assert [s for s, _ in messages] == [18, 20]  # the 2-step dip stays quiet; the 4-step one is caught, then over
    assert "recovered at step 20" in messages[1][1]
    assert flags[-1]["collapse/calc"] == 0.0


def test_low_rewards_and_noise_stay_quiet():
    rng = random.Random(1)
    low = [0.1 * rng.random() for _ in range(40)]  # a task that never learned: nothing to fall from
    noisy = [max(0.0, min(1.0, 0.5 + rng.gauss(0, 0.15))) for _ in range(40)]
    _, messages = feed(CollapseMonitor(), {"low": low, "noisy": noisy})
    assert messages == []
    assert feed(CollapseMonitor(window=0), {"x": [1.0] * 5 + [0.0] * 5}) == ([{}] * 10, [])
    with pytest.raises(ValueError, match="0 < drop <= 1"):
        CollapseMonitor(drop=1.5)
