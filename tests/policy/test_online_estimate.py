"""Online remaining-time estimate and offline offer ranking (pure maths of policy/estimate.py)."""
from __future__ import annotations

import math
from dataclasses import replace

import pytest

from airflow_spot.policy.estimate import (
    BEAT_AGE_CAP_SECONDS,
    PRIOR_RELATIVE_ERROR,
    AttemptPace,
    StepTimeModel,
    estimate_remaining,
    measure_overheads,
    rank_offers_for_job,
    robust_step_seconds,
    start_seconds,
    steady_step_seconds,
    warmup_excess,
)
from airflow_spot.policy.offers import Market, Offer


def test_step_time_ignores_attempts_still_in_their_warm_up():
    # a fresh restart's EWMA is dominated by its slow first steps: it must not move the estimate
    paces = [AttemptPace(200, 0.10, 25), AttemptPace(180, 0.11, 25), AttemptPace(5, 0.90, 8, finished=False)]
    assert robust_step_seconds(paces, warmup_steps=20) == pytest.approx(0.105)


def test_step_time_is_the_median_so_one_odd_attempt_does_not_swing_it():
    paces = [AttemptPace(100, t, 10) for t in (0.10, 0.11, 0.50, 0.10, 0.12)]
    assert robust_step_seconds(paces) == pytest.approx(0.11)


def test_a_running_attempt_past_its_warm_up_gives_the_present_pace():
    # the machine got slower: once the running process has shown it over MIN_PACE_WINDOW_STEPS (100) steps,
    # its own pace, not the median of the older attempts (0.105 s)
    paces = [AttemptPace(200, 0.10, 25), AttemptPace(180, 0.11, 25), AttemptPace(150, 0.15, 25, finished=False)]
    assert robust_step_seconds(paces, warmup_steps=20) == pytest.approx(0.15)
    # over 50 steps only: the job's last 100 steps, 50 at 0.15 s and 50 at the older 0.105 s
    paces[-1] = AttemptPace(50, 0.15, 9, finished=False)
    assert robust_step_seconds(paces, warmup_steps=20) == pytest.approx((50 * 0.15 + 50 * 0.105) / 100)


def test_an_attempts_measured_mean_pace_beats_its_ewma():
    # 300 steps took 0.05 s each from the first step to the last heartbeat; the EWMA caught a save stall
    paces = [AttemptPace(300, 0.106, 18.2, pace_seconds=0.05), AttemptPace(300, 0.053, 28.0, pace_seconds=0.089)]
    assert robust_step_seconds(paces) == pytest.approx((0.05 + 0.089) / 2)
    running = paces + [AttemptPace(100, 0.2, 8.0, finished=False, pace_seconds=0.06)]
    assert robust_step_seconds(running) == pytest.approx(0.06)


def test_step_time_falls_back_to_the_newest_ewma_before_any_warm_attempt():
    assert robust_step_seconds([AttemptPace(3, 0.4, 2, finished=False)]) == 0.4
    assert robust_step_seconds([]) is None


# A job's history, oldest first (0.1 s per step everywhere):
#   A fresh instance, completed 100 steps in 14 s                     -> start-up 14 - 10 = 4 s
#   B warm instance 2 s later, completed 100 steps in 11 s            -> warm boundary 2 + (11 - 10) = 3 s
#   C fresh instance 1 s later, notice at 10 s after 50 steps, ended at 12 s, 3 steps lost
#                                                                      -> start-up 10 - 5 = 5 s, tail 2 s
#   D fresh instance 3 s later, notice at 2 s before any step, ended at 4 s -> start-up > 2 s (below the
#                                                                      median: ignored), tail 2 s
#   E fresh instance 3 s later, running: 20 steps in 6 s               -> start-up 6 - 2 = 4 s
HISTORY = [
    AttemptPace(100, 0.1, 14.0),
    AttemptPace(100, 0.1, 11.0, new_instance=False, gap_before=2.0),
    AttemptPace(50, 0.1, 12.0, preempted=True, notice_seconds=10.0, steps_lost=3, gap_before=1.0),
    AttemptPace(0, None, 4.0, preempted=True, notice_seconds=2.0, gap_before=3.0),
    AttemptPace(20, 0.1, 6.0, finished=False, gap_before=3.0),
]


def test_overheads_are_measured_from_the_jobs_own_attempts():
    o = measure_overheads(HISTORY, 0.1)
    assert o.startup == pytest.approx(4.0)  # median of 4, 5, 4
    assert o.tail == pytest.approx(2.0)
    assert o.gap_after_preemption == pytest.approx(3.0) and o.gap_after_boundary == pytest.approx(1.5)
    assert o.warm_boundary == pytest.approx(3.0)
    assert o.new_instance_share == pytest.approx(0.5)  # A->B stayed warm, B->C moved
    assert o.lost_per_preemption == pytest.approx(0.15)  # (3 steps x 0.1 s + 0) / 2 preemptions
    assert o.samples == 3


def test_each_attempt_s_start_up_is_its_time_less_its_steps_at_its_own_pace():
    # the machine slowed from 0.1 to 0.13 s/step: A's 300 steps took 30 s of its 38 s, so 8 s start-up
    # (at today's pace they would "take" 39 s and the start-up would vanish)
    paces = [AttemptPace(300, 0.10, 38.0), AttemptPace(100, 0.13, 13.0, new_instance=False, finished=False,
                                                         gap_before=0.0)]
    assert measure_overheads(paces, 0.13).startup == pytest.approx(8.0)


def test_a_recorded_first_step_gives_the_start_up_itself():
    # A's heartbeat says its first step ended 9 s after its start (its EWMA would have said 4 s); the warm
    # attempt B's first step came 0.5 s after its start, 2 s after A ended
    paces = [AttemptPace(100, 0.1, 14.0, startup_seconds=9.0),
             AttemptPace(100, 0.1, 11.0, new_instance=False, gap_before=2.0, startup_seconds=0.5),
             AttemptPace(30, 0.1, 12.0, finished=False, gap_before=3.0, startup_seconds=7.0)]
    o = measure_overheads(paces, 0.1)
    assert o.startup == pytest.approx(8.0) and o.samples == 2  # median of 9 and 7
    assert o.warm_boundary == pytest.approx(2.5)


def test_before_any_boundary_the_next_segment_is_assumed_to_stay_on_the_warm_instance():
    # the operator reuses the running instance while its offer stays within tolerance
    o = measure_overheads([AttemptPace(0, None, 3.0, preempted=True, notice_seconds=2.0),
                           AttemptPace(50, 0.1, 9.0, finished=False, gap_before=4.0)], 0.1)
    assert o.new_instance_share == 0.0 and o.startup == pytest.approx(4.0)
    assert o.warm_boundary == pytest.approx(4.0)  # no boundary gap seen: the gaps seen so far


def test_a_start_up_longer_than_seen_is_taken_from_attempts_that_never_trained():
    # two fresh attempts trained after 4 s of start-up; three later ones were preempted at 9, 10 and 12 s
    # without a step: the machine got slower, start-up is longer than those
    paces = [AttemptPace(100, 0.1, 14.0), AttemptPace(100, 0.1, 14.0)] + [
        AttemptPace(0, None, t + 1, preempted=True, notice_seconds=t) for t in (9.0, 10.0, 12.0)]
    assert measure_overheads(paces, 0.1).startup == pytest.approx(9.0)  # median of 4, 4, 9, 10, 12


def test_a_fresh_start_costs_the_expected_time_to_an_uninterrupted_start_up():
    # no gap, no tail: the textbook (e^(s/M) - 1) M for s seconds without a preemption at rate 1/M
    start, failures = start_seconds(20.0, 0.0, 0.0, 10.0)
    assert start == pytest.approx((math.exp(2.0) - 1) * 10.0)
    assert failures == pytest.approx(math.exp(2.0) - 1)
    # each failed start also pays its tail and a gap: s=4, gap 3, tail 2, M=40
    p = math.exp(-0.1)
    start, failures = start_seconds(4.0, 3.0, 2.0, 40.0)
    assert start == pytest.approx(3 + 4 + (1 - p) / p * ((40 - 4 * p / (1 - p)) + 2 + 3))
    assert start == pytest.approx(7.7327, abs=1e-3)
    assert start_seconds(4.0, 3.0, 2.0, None) == (7.0, 0.0)  # on demand


def test_on_demand_remaining_time_is_steps_plus_the_measured_boundaries():
    est = estimate_remaining(HISTORY, done_steps=300, total_steps=500, segments_left=1, mtbf_seconds=None,
                             price_per_hour=3.6)
    # 200 steps x 0.1 s + one boundary: half warm (3 s), half a fresh start (gap 1.5 + start-up 4)
    assert est.remaining_seconds == pytest.approx(20.0 + 0.5 * 3.0 + 0.5 * 5.5)
    assert est.remaining_seconds == pytest.approx(24.25)
    assert est.expected_preemptions == 0 and est.remaining_cost == pytest.approx(24.25 / 3600 * 3.6)


def test_each_attempt_s_finish_is_counted_at_every_boundary_and_at_the_end():
    # A and B each spent 1 s after their last step (final save, status): A's start-up is 14 - 10 - 1 = 3 s,
    # B's warm boundary 2 + (11 - 10 - 1) = 2 s; with C (5 s) and E (4 s) the start-up median stays 4 s
    history = [replace(HISTORY[0], end_seconds=1.0), replace(HISTORY[1], end_seconds=1.0)] + HISTORY[2:]
    o = measure_overheads(history, 0.1)
    assert (o.finish, o.startup, o.warm_boundary) == (pytest.approx(1.0), pytest.approx(4.0), pytest.approx(2.0))
    est = estimate_remaining(history, done_steps=300, total_steps=500, segments_left=1, mtbf_seconds=None,
                             price_per_hour=None)
    # 200 steps + one boundary (finish 1 s, then half warm 2 s, half fresh 1.5 + 4 s) + the last finish 1 s
    assert est.remaining_seconds == pytest.approx(20.0 + 1.0 + 0.5 * 2.0 + 0.5 * 5.5 + 1.0)


def test_the_jobs_last_attempt_exits_its_process_as_a_preempted_one_did():
    # C's process exited 3 s after its last heartbeat; warm handoffs finish in 0.5 s: the job's end costs 3 s
    history = ([replace(HISTORY[0], end_seconds=0.5), replace(HISTORY[1], end_seconds=0.5),
                replace(HISTORY[2], exit_seconds=3.0)] + HISTORY[3:])
    o = measure_overheads(history, 0.1)
    assert (o.finish, o.last_finish) == (pytest.approx(0.5), pytest.approx(3.0))
    est = estimate_remaining(history, done_steps=300, total_steps=500, segments_left=1, mtbf_seconds=None,
                             price_per_hour=None)
    # one boundary: finish 0.5 s, then half warm (2 + (11 - 10 - 0.5) = 2.5 s), half fresh (1.5 + 4 s); the end 3 s
    assert est.remaining_seconds == pytest.approx(20.0 + (0.5 * 2.5 + 0.5 * 5.5 + 0.5) + 3.0)


def test_before_the_first_preemption_its_tail_is_the_notice_window():
    est = estimate_remaining([AttemptPace(50, 0.1, 9.0, finished=False)], done_steps=50, total_steps=100,
                             segments_left=0, mtbf_seconds=100.0, price_per_hour=None, notice_window_seconds=5.0)
    assert est.overheads["tail"] == 5.0


def test_spot_remaining_time_adds_the_expected_preemptions_at_their_measured_cost():
    m = 40.0
    est = estimate_remaining(HISTORY, done_steps=300, total_steps=500, segments_left=1, mtbf_seconds=m,
                             price_per_hour=None)
    s, tail, lost = 4.0, 2.0, 0.15
    start_p, fails_p = start_seconds(s, 3.0, tail, m)
    start_b, fails_b = start_seconds(s, 1.5, tail, m)
    hits = 20.0 / (m - lost)  # preemptions while training the 200 steps left (and the work they lose)
    expected = 20.0 + 0.5 * 3.0 + 0.5 * start_b + hits * (lost + tail + start_p)
    assert est.remaining_seconds == pytest.approx(expected)
    assert est.expected_preemptions == pytest.approx(hits * (1 + fails_p) + 0.5 * fails_b)
    # what a preemption adds, on average: the estimate's extra time over an instance never preempted
    plain = 20.0 + 0.5 * 3.0 + 0.5 * (1.5 + s)
    assert est.per_preemption_seconds == pytest.approx((expected - plain) / est.expected_preemptions)
    # the pool's luck: a Poisson count of preemptions, one standard deviation either side
    assert est.spread_seconds == pytest.approx(math.sqrt(est.expected_preemptions) * est.per_preemption_seconds)
    assert est.remaining_seconds > 24.25


def test_an_attempt_still_starting_owes_the_rest_of_its_start_up():
    paces = HISTORY[:4] + [AttemptPace(0, None, 1.0, finished=False, gap_before=3.0)]
    on_demand = estimate_remaining(paces, done_steps=280, total_steps=500, segments_left=0, mtbf_seconds=None,
                                   price_per_hour=None)
    # start-up: median of A (4 s) and C (5 s); 1 s of it gone
    assert on_demand.current_seconds == pytest.approx(3.5)
    assert on_demand.remaining_seconds == pytest.approx(22.0 + 3.5)
    m = 40.0
    spot = estimate_remaining(paces, done_steps=280, total_steps=500, segments_left=0, mtbf_seconds=m,
                              price_per_hour=None)
    q = 1 - math.exp(-3.5 / m)
    start_p, _ = start_seconds(4.5, 3.0, 2.0, m)
    assert spot.current_seconds == pytest.approx(m * q + q * (2.0 + start_p))


def test_between_attempts_a_whole_start_is_due_less_the_gap_already_waited():
    paces = HISTORY[:4]  # D was preempted; nothing running yet, 1 s since it ended
    est = estimate_remaining(paces, done_steps=250, total_steps=500, segments_left=0, mtbf_seconds=None,
                             price_per_hour=None, idle_seconds=1.0)
    # start-up: median of A (4 s) and C (5 s); gap after a preemption 3 s, 1 s of it waited
    assert est.current_seconds == pytest.approx(3.0 - 1.0 + 4.5)
    assert est.remaining_seconds == pytest.approx(25.0 + 6.5)


def test_a_finished_job_has_nothing_left_and_no_step_time_means_no_estimate():
    done = estimate_remaining(HISTORY, done_steps=500, total_steps=500, segments_left=0, mtbf_seconds=50.0,
                              price_per_hour=1.0)
    assert done.remaining_seconds == 0.0
    none = estimate_remaining([AttemptPace(0, None, 3.0, finished=False)], done_steps=0, total_steps=10,
                              segments_left=0, mtbf_seconds=50.0, price_per_hour=1.0)
    assert none.remaining_seconds is None and none.basis == "no step time measured yet"


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


# ------------------------------------------------------------------ warm-up, steady pace, renewal, beat age
def test_a_mean_since_the_first_step_sheds_the_warm_up_the_job_measured():
    # 70 steps since the first took 3.5 s (0.05 s each); the job's fresh attempts showed their warm-up cost
    # 0.84 s beyond the steady pace: the steady pace is (3.5 - 0.84) / 70 = 0.038 s
    measured = AttemptPace(300, 0.04, 20.0, new_instance=True, warmup_seconds=0.84, steady_seconds=0.038)
    running = AttemptPace(71, 0.06, 8.0, finished=False, pace_seconds=0.05, pace_steps=70)
    assert steady_step_seconds(running, 0.84) == pytest.approx(0.038)
    assert warmup_excess([measured, running]) == pytest.approx(0.84)
    assert robust_step_seconds([measured, running]) == pytest.approx(0.038)
    # no warm-up measured anywhere: the means are all there is; the running one spans 70 steps, so the last
    # 100 steps are its 70 at 0.05 s and 30 at the older attempt's 0.04 s
    assert robust_step_seconds([replace(measured, warmup_seconds=None, steady_seconds=None, pace_seconds=0.04,
                                        pace_steps=299), running]) == pytest.approx((70 * 0.05 + 30 * 0.04) / 100)
    # a warm attempt (same process) is corrected only by what warm attempts measured (none here)
    assert steady_step_seconds(replace(running, new_instance=False), warmup_excess([measured], fresh=False)) == 0.05


def test_a_running_attempts_steady_pace_beats_its_mean_and_the_older_attempts():
    paces = [AttemptPace(300, 0.04, 20.0, pace_seconds=0.045, pace_steps=299),
             AttemptPace(190, 0.06, 8.0, finished=False, pace_seconds=0.05, pace_steps=189, steady_seconds=0.041,
                         steady_steps=120, warmup_seconds=0.6)]
    assert robust_step_seconds(paces) == pytest.approx(0.041)
    # a 40-step window: pooled with the older attempt's pace (its mean less the warm-up the running one showed)
    older = (0.045 * 299 - 0.6) / 299
    assert robust_step_seconds(paces[:1] + [replace(paces[1], steady_steps=40)]) == pytest.approx(
        (40 * 0.041 + 60 * older) / 100)
    # the finished attempt's mean loses the warm-up the running one measured: (0.045 x 299 - 0.6) / 299
    assert robust_step_seconds(paces[:1] + [replace(paces[1], steps=10)]) == pytest.approx(
        (0.045 * 299 - 0.6) / 299)


def test_a_fresh_start_up_includes_the_warm_up_beyond_the_steady_pace():
    # A: first step 4 s after its launch, then 0.8 s of warm-up beyond its steady pace -> 4.8 s;
    # B: first step after 5 s, its warm-up not measured -> the median of A's and C's, 0.5 s -> 5.5 s;
    # C (running): first step after 5.6 s, warm-up 0.2 s -> 5.8 s
    paces = [AttemptPace(100, 0.1, 15.0, startup_seconds=4.0, warmup_seconds=0.8, steady_seconds=0.1),
             AttemptPace(50, 0.1, 11.0, preempted=True, notice_seconds=10.0, gap_before=1.0, startup_seconds=5.0),
             AttemptPace(30, 0.1, 9.0, finished=False, gap_before=2.0, startup_seconds=5.6, warmup_seconds=0.2,
                         steady_seconds=0.1)]
    o = measure_overheads(paces, 0.1)
    assert o.startup == pytest.approx(5.5)  # median of 4.8, 5.5, 5.8
    assert o.samples == 3


def test_an_attempt_still_in_its_warm_up_owes_what_it_has_not_spent_yet():
    # the job's fresh attempts warm up 1 s beyond a steady 0.1 s/step; the running one had its first step
    # 3.2 s after its launch and is 10 steps in, 4.5 s after it: it owes 3.2 + 1 + 10 x 0.1 - 4.5 = 0.7 s
    done = AttemptPace(200, 0.1, 26.0, startup_seconds=4.0, warmup_seconds=1.0, steady_seconds=0.1)
    running = AttemptPace(10, 0.3, 4.5, finished=False, gap_before=0.0, startup_seconds=3.2)
    est = estimate_remaining([done, running], done_steps=210, total_steps=300, segments_left=0,
                             mtbf_seconds=None, price_per_hour=None)
    assert est.current_seconds == pytest.approx(3.2 + 1.0 + 10 * 0.1 - 4.5)
    assert est.remaining_seconds == pytest.approx(90 * 0.1 + 0.7)
    # past its warm-up (a steady pace of its own): nothing more is owed
    est = estimate_remaining([done, replace(running, steps=60, seconds=10.0, steady_seconds=0.1)], done_steps=260,
                             total_steps=300, segments_left=0, mtbf_seconds=None, price_per_hour=None)
    assert est.current_seconds == 0.0 and est.remaining_seconds == pytest.approx(4.0)


def test_steps_trained_since_the_last_heartbeat_are_done():
    paces = [AttemptPace(50, 0.1, 9.0, finished=False, steady_seconds=0.1)]
    fresh = estimate_remaining(paces, done_steps=50, total_steps=100, segments_left=0, mtbf_seconds=None,
                               price_per_hour=None)
    assert fresh.remaining_seconds == pytest.approx(5.0)
    aged = estimate_remaining(paces, done_steps=50, total_steps=100, segments_left=0, mtbf_seconds=None,
                              price_per_hour=None, beat_age_seconds=1.5)
    assert aged.remaining_seconds == pytest.approx(3.5)
    # a beat older than the cap says the process stalled: only the cap is counted
    stale = estimate_remaining(paces, done_steps=50, total_steps=100, segments_left=0, mtbf_seconds=None,
                               price_per_hour=None, beat_age_seconds=30.0)
    assert stale.remaining_seconds == pytest.approx(5.0 - BEAT_AGE_CAP_SECONDS)


def test_preemptions_are_counted_over_the_training_and_start_ups_not_over_the_overheads():
    # the same 200 steps left (20 s of training) on two jobs whose boundaries cost 1 s or 50 s: the same
    # number of preemptions is expected (renewal over the exposed time), 20 / (M - lost) x (1 + failed starts)
    m = 40.0
    cheap = [replace(p, end_seconds=0.0) for p in HISTORY[:2]] + HISTORY[2:]
    dear = [replace(HISTORY[0], end_seconds=0.0), replace(HISTORY[1], end_seconds=0.0, gap_before=40.0)] + HISTORY[2:]
    a = estimate_remaining(cheap, done_steps=300, total_steps=500, segments_left=2, mtbf_seconds=m, price_per_hour=None)
    b = estimate_remaining(dear, done_steps=300, total_steps=500, segments_left=2, mtbf_seconds=m, price_per_hour=None)
    assert b.boundary_seconds > a.boundary_seconds + 10
    o = measure_overheads(cheap, 0.1)
    start_p, fails_p = start_seconds(o.startup, o.gap_after_preemption, o.tail, m)
    _, fails_b = start_seconds(o.startup, o.gap_after_boundary, o.tail, m)
    hits = 20.0 / (m - o.lost_per_preemption)
    assert a.expected_preemptions == pytest.approx(hits * (1 + fails_p) + 2 * o.new_instance_share * fails_b)
    assert a.preemption_seconds == pytest.approx(hits * (o.lost_per_preemption + o.tail + start_p))
    assert a.mtbf_seconds == m


def test_a_training_attempts_tail_and_a_start_ups_tail_are_measured_apart():
    # B trained 80 steps, was told at 10 s and left 1.2 s later (save, exit); C was told 1.5 s after its
    # launch, before its first step (at 4 s), and ran 3.4 s more (its process was not up to leave early)
    paces = [AttemptPace(100, 0.1, 14.0, startup_seconds=4.0),
             AttemptPace(80, 0.1, 11.2, preempted=True, notice_seconds=10.0, gap_before=0.0, new_instance=False),
             AttemptPace(0, None, 4.9, preempted=True, notice_seconds=1.5, gap_before=1.0),
             AttemptPace(30, 0.1, 8.0, finished=False, gap_before=1.0, startup_seconds=4.0)]
    o = measure_overheads(paces, 0.1, default_tail=9.0)
    assert (o.tail, o.start_tail) == (pytest.approx(1.2), pytest.approx(3.4))


def test_before_any_preemption_a_training_attempts_tail_is_its_emergency_save():
    # nothing preempted yet; the running attempt's saves take 0.3 s; the notice window is 5 s: a training
    # attempt told to go saves (0.3 s) and leaves; a start-up preempted may run the window out (5 s)
    m, window = 40.0, 5.0
    paces = [AttemptPace(50, 0.1, 9.0, finished=False, startup_seconds=4.0, steady_seconds=0.1, save_seconds=0.3)]
    est = estimate_remaining(paces, done_steps=50, total_steps=250, segments_left=0, mtbf_seconds=m,
                             price_per_hour=None, notice_window_seconds=window)
    assert (est.overheads["tail"], est.overheads["start_tail"]) == (0.3, 5.0)
    start_p, fails_p = start_seconds(4.0, 0.0, window, m)  # a restart's failed start-ups pay the window
    hits = 20.0 / m
    assert est.remaining_seconds == pytest.approx(20.0 + hits * (0.3 + start_p))
    assert est.expected_preemptions == pytest.approx(hits * (1 + fails_p))
    # no save measured: the notice window bounds both
    est = estimate_remaining([replace(paces[0], save_seconds=None)], done_steps=50, total_steps=250,
                             segments_left=0, mtbf_seconds=m, price_per_hour=None, notice_window_seconds=window)
    assert est.overheads["tail"] == 5.0


def test_an_attempt_told_to_go_owes_the_rest_of_its_tail_and_a_restart_not_a_chance_of_one():
    # HISTORY's tails are 2 s (C trained) and its restarts: start-up 4 s, gap 3 s after a preemption. The
    # running attempt E got its notice 0.5 s ago: 1.5 s of its tail and a whole restart are due, for sure
    m = 40.0
    told = HISTORY[:4] + [replace(HISTORY[4], notice_seconds=5.5)]
    est = estimate_remaining(told, done_steps=300, total_steps=500, segments_left=0, mtbf_seconds=m,
                             price_per_hour=None, beat_age_seconds=1.0)
    o = measure_overheads(told, 0.1)
    start_p, fails_p = start_seconds(o.startup, o.gap_after_preemption, o.start_tail, m)
    assert est.current_seconds == pytest.approx(1.5 + start_p)
    hits = 20.0 / (m - o.lost_per_preemption)  # the beat's age is not training: the process stopped
    assert est.remaining_seconds == pytest.approx(20.0 + o.last_finish + hits * (o.lost_per_preemption + o.tail + start_p)
                                                  + 1.5 + start_p)
    assert est.expected_preemptions == pytest.approx(hits * (1 + fails_p))  # the one under way is not luck
    on_demand = estimate_remaining(told, done_steps=300, total_steps=500, segments_left=0, mtbf_seconds=None,
                                   price_per_hour=None)
    assert on_demand.current_seconds == pytest.approx(1.5 + o.gap_after_preemption + o.startup)


def test_what_the_job_has_not_met_yet_comes_from_the_deployments_earlier_jobs():
    # the first segment of a job, running on a fresh instance that measured its own start-up (4 s), no
    # boundary crossed, no process exit seen: without a prior both count nothing
    first = [AttemptPace(100, 0.1, 14.0, finished=False, startup_seconds=4.0)]
    prior = {"warm_boundary": 0.8, "last_finish": 0.6, "startup": 30.0, "gap_after_boundary": 0.1}
    bare, primed = measure_overheads(first, 0.1), measure_overheads(first, 0.1, prior=prior)
    assert (bare.warm_boundary, bare.last_finish) == (0.0, 0.0)
    assert (primed.warm_boundary, primed.last_finish, primed.gap_after_boundary) == (0.8, 0.6, 0.1)
    assert primed.startup == pytest.approx(4.0)  # the job's own figure beats the deployment's
    assert primed.measured == ("startup",) and primed.measured_fields() == {"startup": pytest.approx(4.0)}
    kwargs = dict(done_steps=100, total_steps=400, segments_left=2, mtbf_seconds=None, price_per_hour=None)
    gained = (estimate_remaining(first, prior=prior, **kwargs).remaining_seconds
              - estimate_remaining(first, **kwargs).remaining_seconds)
    assert gained == pytest.approx(2 * 0.8 + 0.6)  # two boundaries left and the job's end
    basis = estimate_remaining(first, prior=prior, **kwargs).basis
    assert basis.endswith("from the deployment's earlier jobs: gap_after_boundary, warm_boundary, last_finish")


def test_a_boundary_the_job_crossed_itself_beats_the_deployments_figure():
    # A completed its segment; B continued on the warm instance 2 s later and took 1 s to its first step
    crossed = [AttemptPace(100, 0.1, 14.0, startup_seconds=4.0, end_seconds=0.0),
               AttemptPace(50, 0.1, 6.0, finished=False, new_instance=False, gap_before=2.0, startup_seconds=1.0)]
    o = measure_overheads(crossed, 0.1, prior={"warm_boundary": 9.0, "gap_after_boundary": 9.0, "finish": 9.0})
    assert (o.warm_boundary, o.gap_after_boundary, o.finish) == (pytest.approx(3.0), 2.0, 0.0)
    assert {"warm_boundary", "gap_after_boundary", "finish", "new_instance_share"} <= set(o.measured)
