"""Online remaining-time estimate and offline offer ranking (pure maths of policy/estimate.py)."""
from __future__ import annotations

import math

import pytest

from airflow_spot.policy.estimate import (
    PRIOR_RELATIVE_ERROR,
    AttemptPace,
    StepTimeModel,
    estimate_remaining,
    rank_offers_for_job,
    robust_step_seconds,
)
from airflow_spot.policy.offers import Market, Offer


def test_step_time_ignores_attempts_still_in_their_warm_up():
    # a fresh restart's EWMA is dominated by its slow first steps: it must not move the estimate
    paces = [AttemptPace(200, 0.10, 25), AttemptPace(180, 0.11, 25), AttemptPace(5, 0.90, 8, finished=False)]
    assert robust_step_seconds(paces, warmup_steps=20) == pytest.approx(0.105)


def test_step_time_is_the_median_so_one_odd_attempt_does_not_swing_it():
    paces = [AttemptPace(100, t, 10) for t in (0.10, 0.11, 0.50, 0.10, 0.12)]
    assert robust_step_seconds(paces) == pytest.approx(0.11)


def test_step_time_falls_back_to_the_newest_ewma_before_any_warm_attempt():
    assert robust_step_seconds([AttemptPace(3, 0.4, 2, finished=False)]) == 0.4
    assert robust_step_seconds([]) is None


def test_remaining_time_adds_boundaries_and_expected_preemptions():
    # finished: a clean segment of 100 steps at 0.1 s that took 12 s (2 s overhead), and a preempted one
    # that kept 50 steps in 9 s (4 s overhead: lost steps and the notice)
    paces = [AttemptPace(100, 0.1, 12.0), AttemptPace(50, 0.1, 9.0, preempted=True),
             AttemptPace(30, 0.1, 4.0, finished=False)]
    est = estimate_remaining(paces, done_steps=180, total_steps=400, segments_left=2, mtbf_seconds=100.0,
                             price_per_hour=3.6)
    compute, boundary, per_preemption = 220 * 0.1, 2.0, 4.0
    base = compute + 2 * boundary
    expected = base / (100.0 - per_preemption)
    assert est.remaining_steps == 220
    assert est.expected_preemptions == pytest.approx(expected)
    assert est.remaining_seconds == pytest.approx(base + expected * per_preemption)
    assert est.remaining_cost == pytest.approx(est.remaining_seconds / 3600 * 3.6)


def test_a_fresh_start_is_priced_from_the_running_attempts_start_up_before_any_clean_attempt():
    # only a preempted attempt so far; the running one has trained 50 steps at 0.1 s in 8 s: 3 s start-up
    paces = [AttemptPace(0, 0.1, 5.0, preempted=True), AttemptPace(50, 0.1, 8.0, finished=False)]
    est = estimate_remaining(paces, done_steps=50, total_steps=150, segments_left=1, mtbf_seconds=None,
                             price_per_hour=1.0, warmup_steps=0)
    assert est.boundary_seconds == pytest.approx(3.0)  # not the 60 s preset
    assert est.remaining_seconds == pytest.approx(100 * 0.1 + 3.0)


def test_on_demand_expects_no_preemption_and_a_finished_job_nothing():
    paces = [AttemptPace(100, 0.1, 10.0)]
    on_demand = estimate_remaining(paces, done_steps=0, total_steps=100, segments_left=0, mtbf_seconds=None,
                                   price_per_hour=None)
    assert on_demand.expected_preemptions == 0 and on_demand.remaining_seconds == pytest.approx(10.0)
    assert on_demand.remaining_cost is None
    done = estimate_remaining(paces, done_steps=100, total_steps=100, segments_left=0, mtbf_seconds=50.0,
                              price_per_hour=1.0)
    assert done.remaining_seconds == 0.0


def test_bad_estimate_arguments_say_what_is_wrong():
    with pytest.raises(ValueError, match="total_steps > 0"):
        estimate_remaining([], done_steps=0, total_steps=0, segments_left=0, mtbf_seconds=None, price_per_hour=None)
    with pytest.raises(ValueError, match="mtbf_seconds"):
        estimate_remaining([], done_steps=0, total_steps=5, segments_left=0, mtbf_seconds=0, price_per_hour=None)


def _offer(name: str, gpu: str, x: float, price: float, rate: float = 0.0) -> Offer:
    return Offer(name, "us-east-1", "us-east-1a", Market.SPOT, price, price * 3, gpu, 1, 16.0,
                 relative_throughput=x, preemption_rate_per_hour=rate)


def test_offline_ranking_scales_a_measured_step_time_by_relative_throughput():
    slow, fast = _offer("t4", "T4", 0.4, 0.20), _offer("a100", "A100", 2.2, 1.00)
    model = StepTimeModel(a=math.log(0.5 * 0.4), b=1.0)  # 0.5 s/step measured on the T4
    ranked = rank_offers_for_job([fast, slow], 36_000, model, measured_throughputs=[0.4], overhead_seconds=0)
    by_name = {e.offer.instance_type: e for e in ranked}
    assert by_name["t4"].hours == pytest.approx(5.0) and by_name["t4"].expected_cost == pytest.approx(1.0)
    assert by_name["a100"].hours == pytest.approx(5.0 * 0.4 / 2.2)
    assert [e.offer.instance_type for e in ranked] == ["a100", "t4"]  # 0.91 $ < 1.00 $
    assert by_name["t4"].uncertainty == pytest.approx(0.05)
    assert by_name["a100"].uncertainty == pytest.approx(math.hypot(0.05, PRIOR_RELATIVE_ERROR))


def test_offline_ranking_rejects_a_job_without_steps():
    with pytest.raises(ValueError, match="steps must be positive"):
        rank_offers_for_job([], 0, StepTimeModel(0.0, 1.0))
