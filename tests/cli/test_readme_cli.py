"""What the README says of the commands and the job summary, held against the code it describes."""
from __future__ import annotations

from pathlib import Path

import pytest

from airflow_spot.policy.ledger import LedgerRow, summarize

README = Path(__file__).resolve().parents[2] / "README.md"


def _text() -> str:
    return " ".join(README.read_text().split())


def _row(attempt: int, *, start: float, end: float, done: int, outcome: str, step_seconds: float | None,
         lost: int = 0) -> LedgerRow:
    return LedgerRow(attempt_id=f"train.segment_000.try{attempt}", instance_id=f"i-{attempt}",
                     instance_type="g5.xlarge", zone="use1-az1", market="spot", price_per_hour=1.0,
                     on_demand_price_per_hour=3.0, started_at=start, ended_at=end, steps_done=done,
                     steps_lost=lost, outcome=outcome, step_seconds=step_seconds)


def test_the_savings_paragraph_states_the_rule_for_a_completed_restart():
    text = _text()
    assert ("A completed attempt that restarted its segment after a preemption (an attempt of the same segment "
            "that was preempted or lost and ended before it started) is credited like a preempted one, its kept "
            "steps only: its steps done times its measured step time, at most its billed time") in text
    assert "a row without a measured step time is credited its whole billed time" in text


@pytest.mark.parametrize("earlier", ["preempted", "lost"])
def test_the_rule_the_readme_states_is_what_the_ledger_does(earlier):
    first = _row(1, start=0.0, end=300.0, done=10, lost=5, outcome=earlier, step_seconds=10.0)
    # the restart: 200 s billed, 12 steps of 10 s kept; credited 120 s, not its whole 200 s
    retry = _row(2, start=400.0, end=600.0, done=12, outcome="completed", step_seconds=10.0)
    alone = summarize([retry])
    assert alone.on_demand_cost == pytest.approx(200 * 3.0 / 3600)  # no preemption before it: its whole bill
    both = summarize([first, retry])
    assert both.on_demand_cost == pytest.approx((100 + 120) * 3.0 / 3600)
    # kept steps never credit more than the bill
    fast = _row(2, start=400.0, end=500.0, done=20, outcome="completed", step_seconds=10.0)
    assert summarize([first, fast]).on_demand_cost == pytest.approx((100 + 100) * 3.0 / 3600)
    # no measured step time: the completed restart is credited its whole bill
    blind = _row(2, start=400.0, end=600.0, done=12, outcome="completed", step_seconds=None)
    assert summarize([first, blind]).on_demand_cost == pytest.approx((100 + 200) * 3.0 / 3600)
