"""The restart the operators' deadline rule budgets: declared, or measured from the job's own starts."""
from __future__ import annotations

import time
from datetime import timedelta
from types import SimpleNamespace

import pytest

from airflow_spot.operators import planning
from airflow_spot.operators.restart_budget import RESTART_SAMPLES, restart_budget, startup_samples
from airflow_spot.policy.ledger import LedgerRow
from airflow_spot.policy.offers import GpuRequest
from airflow_spot.storage.protocol import Heartbeat

T0 = 1_700_000_000.0
GPUS = GpuRequest(count=1, names=("V100",), regions=("us-west-2",))


def _row(i, start, end, outcome="completed", new_instance=True):
    return LedgerRow(attempt_id=f"a{i}", instance_id=f"i-{i}", instance_type="p3.2xlarge", zone="us-west-2a",
                     market="spot", price_per_hour=1.0, on_demand_price_per_hour=3.06, started_at=start,
                     ended_at=end, steps_done=10, outcome=outcome, new_instance=new_instance)


def _beat(i, first_step_at):
    return Heartbeat(attempt_id=f"a{i}", step=20, time=first_step_at + 60, first_step_at=first_step_at, first_step=11)


def test_a_declared_restart_is_used_as_given_and_nothing_is_read():
    def prior():
        raise AssertionError("the deployment's history read for a declared restart")

    b = restart_budget([_row(1, T0, T0 + 900)], {"a1": _beat(1, T0 + 100)}, declared=720.0, default=600.0, prior=prior)
    assert (b.seconds, b.source) == (720.0, "declared")


def test_the_measured_restart_is_the_median_start_up_of_the_fresh_starts():
    # three fresh starts took 300, 500 and 900 s to their first step; a warm continuation tells nothing
    rows = [_row(1, T0, T0 + 3600, "preempted"),
            _row(2, T0 + 3640, T0 + 7200, "preempted"),
            _row(3, T0 + 7260, T0 + 9000),
            _row(4, T0 + 9010, T0 + 9900, new_instance=False)]
    beats = {"a1": _beat(1, T0 + 300), "a2": _beat(2, T0 + 3640 + 500), "a3": _beat(3, T0 + 7260 + 900),
             "a4": _beat(4, T0 + 9010 + 5)}
    assert sorted(startup_samples(rows, beats)) == [300.0, 500.0, 900.0]
    b = restart_budget(rows, beats, declared=None, default=600.0)
    assert (b.source, b.samples, b.seconds) == ("measured", 3, 500.0)
    assert "median start-up of 3" in b.describe()


def test_only_the_most_recent_starts_count():
    rows = [_row(i, T0 + i * 1000, T0 + i * 1000 + 900) for i in range(RESTART_SAMPLES + 4)]
    # the oldest four booted in 2000 s (an older image); the recent ones in 100 s
    beats = {f"a{i}": _beat(i, T0 + i * 1000 + (2000 if i < 4 else 100)) for i in range(len(rows))}
    assert startup_samples(rows, beats) == [100.0] * RESTART_SAMPLES


def test_a_job_without_its_own_start_takes_the_deployments_then_the_default():
    rows = [_row(1, T0, T0 + 600)]
    beats = {"a1": Heartbeat(attempt_id="a1", step=0, time=T0 + 50)}  # not trained yet: no first step
    b = restart_budget(rows, beats, declared=None, default=600.0,
                       prior=lambda: {"startup": 410.0, "gap_after_preemption": 30.0})
    assert (b.seconds, b.source) == (410.0, "deployment")
    assert restart_budget(rows, beats, declared=None, default=600.0, prior=dict).source == "default"
    assert restart_budget(rows, beats, declared=None, default=600.0, prior=dict).seconds == 600.0


def _operator(tmp_path, **kwargs):
    from airflow_spot.operators.segment import SpotSegmentOperator
    from airflow_spot.storage.object_store import open_store

    op = SpotSegmentOperator(
        task_id="segment_001", command=["python", "train.py"], checkpoint_uri=f"file://{tmp_path}/job",
        start_step=10, end_step=20, total_steps=1000, gpus=GPUS, backend_options={"state_dir": str(tmp_path / "state")},
        **kwargs)
    store = open_store(f"file://{tmp_path}/job")
    return op, store, planning.AvailabilityRecorder(store, None, "dag.train")


def test_the_operator_budgets_the_restart_its_job_measured(tmp_path):
    """The operator reads its fresh starts' heartbeats from the store."""
    from airflow_spot.storage.ledger_store import LedgerStore
    from airflow_spot.storage.protocol import JobLayout

    op, store, _recorder = _operator(tmp_path)
    assert op.restart_overhead_seconds is None
    assert op._restart_budget(store, []).source == "default"
    rows = [_row(1, T0, T0 + 3600, "preempted"), _row(2, T0 + 3630, T0 + 7200)]
    layout, ledger = JobLayout(store), LedgerStore(store)
    for r in rows:
        ledger.write(r)
    layout.write_heartbeat(_beat(1, T0 + 700))
    layout.write_heartbeat(_beat(2, T0 + 3630 + 740))
    b = op._restart_budget(store, rows)
    assert (b.source, b.seconds) == ("measured", pytest.approx(720.0))
    # a DAG that says its restart keeps it
    pinned, _, _ = _operator(tmp_path / "pinned", restart_overhead_seconds=300.0)
    assert pinned._restart_budget(store, rows).seconds == 300.0


def test_a_measured_restart_decides_as_the_replay_of_the_same_restart(tmp_path):
    """Replayed with a 720 s restart, an idle job with 1650 s of slack starts on on-demand
    (1650 - 720 < 1.5 x 720); the operators, having measured 720 s, decide the same; with the 600 s
    they budget before the job or its deployment has measured anything, they would start on spot (the
    replay models a job that knows its restart: declared, from the deployment, or after its first start)."""
    from airflow_spot.simulate.engine import JobSpec, SimPool, View
    from airflow_spot.market.traces import SpotTrace
    from airflow_spot.simulate.observed import ObservedController

    op, store, recorder = _operator(tmp_path)
    market = op.hook.get_market()
    offers = [o for o in market.offers(GPUS) if GPUS.matches(o)]
    spot = sorted((o for o in offers if o.is_spot), key=lambda o: o.pool)
    (od,) = [o for o in offers if not o.is_spot]
    slack = 1650.0
    spec = JobSpec(work_hours=1.0, deadline_hours=1.0 + slack / 3600.0, save_cost_seconds=0.0, restart_overhead_hours=0.2)
    pools = [SimPool(SpotTrace(o.zone, o.zone, 60.0, (1,) * 10), o) for o in spot]
    target = ObservedController().decide(View(0.0, spec, pools, od, [True] * len(spot), {}, {}, {}, {}, 0.0, None))
    assert target is not None and target[0] == "on-demand"

    rows = [_row(1, T0, T0 + 900)]
    beats = {"a1": _beat(1, T0 + 720)}
    now = time.time()

    def plan(restart):
        return planning.plan(market, GPUS, now=now, done_steps=0, total_steps=3600, job_started_at=now,
                             deadline=timedelta(seconds=3600 + slack), ledger_rows=[], step_seconds=1.0,
                             restart_overhead_seconds=restart)

    measured = restart_budget(rows, beats, declared=op.restart_overhead_seconds, default=600.0, prior=dict)
    assert measured.seconds == 720.0
    assert plan(measured.seconds).market.value == "on-demand"
    assert plan(restart_budget((), {}, declared=None, default=600.0, prior=dict).seconds).market.value == "spot"
