"""The evaluation's interval: a success rate is reported with the range it is known to."""
from __future__ import annotations

import pytest

from megatron_agentrl.pipeline.evaluation import final_table, format_success, wilson_interval


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
