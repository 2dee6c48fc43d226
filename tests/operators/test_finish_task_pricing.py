"""The finish task bills as the job does: an attempt's end by its agent's word on the kill, never by the
instance's clock when the agent answered; idle time and abandoned attempts by the job's own market (a
review of the billing paths, 2026-11-27)."""
from __future__ import annotations

import time
from datetime import datetime, timezone
from types import SimpleNamespace

import pytest

from airflow_spot.backends.base import InstanceInfo, InstanceState
from airflow_spot.hooks.spot import SpotHook
from airflow_spot.operators.attempt_record import AttemptLaunch
from airflow_spot.operators.training import SpotJobSummaryOperator
from airflow_spot.policy.ledger import LedgerRow
from airflow_spot.policy.offers import Market, Offer
from airflow_spot.storage.job_view import JobView
from airflow_spot.storage.ledger_store import LedgerStore
from airflow_spot.storage.object_store import open_store
from airflow_spot.storage.protocol import AttemptStatus, JobLayout

OFFER = Offer("g5.xlarge", "us-east-1", "us-east-1a", Market.SPOT, 0.5, 1.0, "A10G", 1, 24.0)


class FakeBackend:
    """What the finish task asks of a backend: the listed instances, and who it terminated."""

    def __init__(self, running=("i-running",)):
        self.running = list(running)
        self.terminated: list[str] = []

    def list_instances(self, tags=None):
        return [InstanceInfo(i, InstanceState.RUNNING, OFFER, "file:///job") for i in self.running]

    def stopped_instances(self, tags=None):
        return []

    def terminate(self, ids):
        self.terminated += list(ids)


def finish_context(now: float, pushed: dict) -> dict:
    return {"run_id": "r", "ti": SimpleNamespace(xcom_push=lambda key, value: pushed.update({key: value})),
            "dag_run": SimpleNamespace(start_date=datetime.fromtimestamp(now - 3600, timezone.utc))}


def plain_finish(tmp_path, monkeypatch, backend: FakeBackend) -> SpotJobSummaryOperator:
    monkeypatch.setattr(SpotHook, "get_backend", lambda self: backend)
    monkeypatch.setattr(SpotJobSummaryOperator, "dag_id", property(lambda self: "d"))
    op = SpotJobSummaryOperator(task_id="finish", checkpoint_uri=f"file://{tmp_path}/job", job_name="train",
                                total_steps=10, segments=1)
    op._compact_availability = lambda hook, store: None
    return op


def test_a_preemption_before_the_finish_tasks_kill_is_not_billed_abandoned_by_a_clock_ahead(tmp_path, monkeypatch):
    """Mechanism: a spot attempt nobody accounted for (its segment task marked failed, its worker gone) got
    its 2-minute reclaim notice, saved and exited 75; the agent wrote ``preempted`` with
    ``kill_seen=False`` (no kill record existed). The instance still runs in the notice window when the
    finish task comes: ``_record_kills`` writes the kill, the instance is terminated, and
    ``account_abandoned(killed_at=terminated_at)`` is called. ``account_abandoned`` then requires BOTH
    ``status.ended_at < killed_at`` (the instance's clock against the worker's) AND ``status.before_kill``
    (the agent's word), so an instance clock 60 s ahead turns the agent's own preemption into
    ``abandoned`` (ended at the kill, no preemption in the summary).

    Why wrong: the README (Reliability) promises that when the agent says whether it saw the kill record
    "no clock of the instance's is compared with the killer's; only a status of an older agent is placed by
    the two clocks", and the code's own comment says the clock test is for "no record: only the clocks
    tell". Here the record exists and the agent answered. Expected: billed ``preempted`` at its own end;
    one preemption in the summary (the mirror of the clock-behind case the finish task was fixed for)."""
    now = time.time()
    uri = f"file://{tmp_path}/job"
    store = open_store(uri)
    layout = JobLayout(store)
    layout.checkpoint_store().save(10, lambda f: f.write(b"state"))
    AttemptLaunch("s.try1", 0, 0, 10, "i-running", OFFER.to_dict(), now - 1200, now - 1200, False, 1, "s",
                  run_id="r").write(store)
    # preempted 10 s before the finish task, stamped by an instance clock 60 s ahead; no kill record then
    layout.write_status(AttemptStatus("s.try1", "preempted", 75, now - 1200, now - 10 + 60,
                                      last_committed_step=10, kill_seen=False))
    backend = FakeBackend()
    op = plain_finish(tmp_path, monkeypatch, backend)
    pushed: dict = {}
    summary = op.execute(finish_context(now, pushed))
    assert "i-running" in backend.terminated and layout.read_kill("s.try1") is not None
    (row,) = LedgerStore(store).rows()
    assert row.outcome == "preempted", (
        f"the agent said its preemption came before any kill (kill_seen=False), yet the row is {row.outcome!r}")
    assert summary["preemptions"] == 1


def test_the_finish_task_prices_idle_time_with_the_jobs_market_options(tmp_path, monkeypatch):
    """Mechanism: ``SpotTraining`` hands ``market_options`` to every segment (their hook prices each
    attempt with ``accounting.billing_market(self.hook)``) but not to the finish task:
    ``SpotJobSummaryOperator`` has no ``market_options`` and builds ``SpotHook(backend=..., backend_options=...,
    aws_conn_id=...)``. Its ``billing_market`` is therefore the backend's DEFAULT market, and it prices
    the idle bills (``bill_idle``, ``bill_idle_exits``) and the abandoned attempts (``account_abandoned``)
    it writes. On ``ec2`` with ``market_options={"spot_prices": "catalog"}`` (or ``price_overrides``, or
    ``kind``) the job's market bills the launch price, while the finish task's default ``Ec2Market``
    (``spot_prices="api"``) bills the live spot-price history: the same job's ledger mixes two price sources.

    Why wrong: the README says idle time is priced "at its pool's price over that time where the market
    keeps a price history, as an attempt is"; the job's market (the one its attempts are priced by) keeps
    none here. Expected: the idle bill at the price the job's own market gives (the launch price, $0.50/h),
    not the default market's history ($2.00/h)."""
    from airflow.sdk import DAG

    from airflow_spot.market.ec2 import Ec2Market
    from airflow_spot.operators.training import SpotTraining
    from airflow_spot.policy.offers import GpuRequest

    now = time.time()
    uri = f"file://{tmp_path}/job"
    market_options = {"spot_prices": "catalog", "regions": ["us-east-1"]}
    with DAG("d", schedule=None, start_date=datetime(2024, 1, 1)) as dag:
        SpotTraining(task_id="train", command=["python", "train.py"], total_steps=10, steps_per_segment=10,
                     checkpoint_uri=uri, backend="ec2", gpus=GpuRequest(count=1, min_memory_gib=16),
                     market_options=market_options)
    segment, finish = dag.get_task("train.segment_000"), dag.get_task("train.finish")
    finish._compact_availability = lambda hook, store: None
    # the live history says $2/h for the pool; the job asked for catalog prices (no history)
    monkeypatch.setattr(Ec2Market, "price_changes", lambda self, offer, start, end: [(start - 1, 2.0)])
    job_price = segment.hook.get_market().billed_price(OFFER, now - 600, now)
    assert job_price == OFFER.price_per_hour  # how the job's own attempts are priced

    store = open_store(uri)
    JobLayout(store).checkpoint_store().save(10, lambda f: f.write(b"state"))
    AttemptLaunch("s.try1", 0, 0, 10, "i-running", OFFER.to_dict(), now - 1000, now - 1000, False, 1, "s",
                  run_id="r").write(store)
    LedgerStore(store).write(LedgerRow(
        attempt_id="s.try1", instance_id="i-running", instance_type="g5.xlarge", zone="us-east-1a",
        market="spot", price_per_hour=0.5, on_demand_price_per_hour=1.0, started_at=now - 1000,
        ended_at=now - 600, steps_done=10, outcome="completed", segment_index=0))
    backend = FakeBackend()
    monkeypatch.setattr(SpotHook, "get_backend", lambda self: backend)
    pushed: dict = {}
    finish.execute(finish_context(now, pushed))
    (idle,), _ = LedgerStore(store).idle_rows()
    assert idle.price_per_hour == pytest.approx(job_price), (
        f"the finish task priced the warm instance's idle time at ${idle.price_per_hour}/h; the job's market "
        f"({market_options}) prices it at ${job_price}/h")


def test_an_attempt_that_completed_its_segment_is_completed_whatever_kill_came_after(tmp_path):
    """A review of the kill paths: a kill recorded between the command's exit 0 and the agent's status
    (the agent reads the kill record after listing the checkpoints) made ``kill_seen`` True, and the
    attempt that had committed its segment's end was billed ``abandoned`` by ``account_abandoned`` and
    ended as killed by a retry's reattach, while ``execute_complete`` counted it completed. The work was
    done: a completed status through the segment's end is the attempt's own end wherever it is read."""
    from airflow_spot.operators import accounting

    now = time.time()
    store = open_store(f"file://{tmp_path}/job")
    layout = JobLayout(store)
    launch = AttemptLaunch("s.try1", 0, 0, 10, "i-1", OFFER.to_dict(), now - 600, now - 600, False, 1, "s")
    launch.write(store)
    layout.write_kill("s.try1", now - 5)
    layout.write_status(AttemptStatus("s.try1", "completed", 0, now - 600, now - 4, last_committed_step=10,
                                      kill_seen=True))
    row = accounting.account_abandoned(store, launch, now=now, killed_at=now - 5)
    assert row["outcome"] == "completed" and row["steps_done"] == 10
    # one that did not reach its segment's end is the kill's, as the agent says
    other = open_store(f"file://{tmp_path}/other")
    launch.write(other)
    JobLayout(other).write_kill("s.try1", now - 5)
    JobLayout(other).write_status(AttemptStatus("s.try1", "completed", 0, now - 600, now - 4,
                                                last_committed_step=6, kill_seen=True))
    assert accounting.account_abandoned(other, launch, now=now, killed_at=now - 5)["outcome"] == "abandoned"


class ListedBackend(FakeBackend):
    """A backend whose instances carry their launch times (and the ended ones their ends), as EC2's describe
    and the local backend's state do."""

    def __init__(self, infos):
        super().__init__(running=())
        self.infos = infos

    def list_instances(self, tags=None):
        return list(self.infos)


def test_an_instance_whose_launch_record_was_never_written_is_billed_from_its_launch(tmp_path, monkeypatch):
    """Mechanism: a segment's worker died between ``backend.launch`` and the launch record's write (the
    window is the store's PUT). No attempt names the instance, so ``bill_abandoned`` (launch records) and
    ``bill_idle`` (ledger rows) both passed it by: the finish task terminated it and nobody billed the time
    it ran, idling under its agent. Now it is billed as idle from its launch (the 60 s minimum included) to
    its termination; an instance an attempt names is not billed twice, and one that had already ended is
    billed to its own end."""
    now = time.time()
    uri = f"file://{tmp_path}/job"
    store = open_store(uri)
    JobLayout(store).checkpoint_store().save(10, lambda f: f.write(b"state"))
    named = InstanceInfo("i-named", InstanceState.RUNNING, OFFER, uri, launched_at=now - 900)
    AttemptLaunch("s.try1", 0, 0, 10, "i-named", OFFER.to_dict(), now - 900, now - 900, False, 1, "s",
                  run_id="r").write(store)
    LedgerStore(store).write(LedgerRow(
        attempt_id="s.try1", instance_id="i-named", instance_type="g5.xlarge", zone="us-east-1a", market="spot",
        price_per_hour=0.5, on_demand_price_per_hour=1.0, started_at=now - 900, ended_at=now - 300, steps_done=10,
        outcome="completed"))
    orphan = InstanceInfo("i-orphan", InstanceState.RUNNING, OFFER, uri, launched_at=now - 600)
    gone = InstanceInfo("i-gone", InstanceState.TERMINATED, OFFER, uri, launched_at=now - 2000,
                        terminated_at=now - 1970)
    backend = ListedBackend([named, orphan, gone])
    op = plain_finish(tmp_path, monkeypatch, backend)
    pushed: dict = {}
    op.execute(finish_context(now, pushed))
    assert set(backend.terminated) == {"i-named", "i-orphan"}
    idle = {r.instance_id: r for r in JobView(store).idle_rows()}
    assert set(idle) == {"i-named", "i-orphan", "i-gone"}, idle
    assert idle["i-orphan"].started_at == pytest.approx(now - 600) and idle["i-orphan"].ended_at >= now
    assert idle["i-gone"].ended_at == pytest.approx(now - 1970) and idle["i-gone"].billed_seconds == 60
    assert idle["i-named"].started_at == pytest.approx(now - 300)  # after its attempt, as before
    assert pushed["summary"]["idle_dollars"] == pytest.approx(sum(r.cost for r in idle.values()), abs=1e-6)
