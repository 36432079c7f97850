"""The evaluation's interval: a success rate is reported with the range it is known to."""
from __future__ import annotations

import pytest

from megatron_agentrl.pipeline.evaluation import final_table, format_success, no_signal_warnings, wilson_interval


@pytest.mark.parametrize("k, n, low, high", [(5, 10, 0.2366, 0.7634), (0, 10, 0.0, 0.2775), (10, 10, 0.7225, 1.0),
                                             (24, 48, 0.3639, 0.6361), (100, 200, 0.4314, 0.5686)])
def test_wilson_interval_matches_the_textbook_values(k, n, low, high):
    lo, hi = wilson_interval(k, n)
    assert lo == pytest.approx(low, abs=1e-4) and hi == pytest.approx(high, abs=1e-4)


def test_more_episodes_give_a_narrower_interval_and_none_gives_no_knowledge():
    widths = [wilson_interval(n // 2, n)[1] - wilson_interval(n // 2, n)[0] for n in (48, 128, 200)]
    assert widths == sorted(widths, reverse=True) and widths[0] > 0.27 and widths[-1] < 0.14
    assert wilson_interval(0, 0) == (0.0, 1.0)


def test_the_console_shows_each_task_with_its_interval():
    before = {"success/calc": 0.25, "success_low/calc": 0.2, "success_high/calc": 0.3, "episodes/calc": 200.0}
    after = {"success/calc": 0.5, "success_low/calc": 0.43, "success_high/calc": 0.57, "episodes/calc": 200.0}
    assert format_success(after) == "calc 50.0% (43-57)"
    table = final_table(before, after, ["calc"])
    assert "25.0% (20-30)" in table and "50.0% (43-57)" in table and "+25.0" in table and "200" in table


def test_a_task_that_surely_almost_never_succeeds_before_rl_is_warned_of():
    """1 of 128 successes is surely under 5 %: warned of, naming the task and the ways forward; 2 of 128 may not be,
    nor 0 of 2 (too few episodes to know)."""
    def evaluation(task: str, k: int, n: int) -> dict[str, float]:
        low, high = wilson_interval(k, n)
        return {f"success/{task}": k / n, f"success_low/{task}": low, f"success_high/{task}": high,
                f"episodes/{task}": float(n)}

    m = {**evaluation("lookup", 1, 128), **evaluation("calc", 2, 128), **evaluation("guess", 0, 2)}
    (warning,) = no_signal_warnings(m)
    assert warning.startswith("task lookup succeeds in 1 of 128 held-out episodes before RL (at most 4.3 %")
    assert "train.seed" in warning and "rollout.samples_per_prompt" in warning
