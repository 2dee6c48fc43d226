"""The accounting of a completed attempt is the same whether the trigger or the worker does it."""
from __future__ import annotations

import pytest

from airflow_spot.operators.attempt_record import AttemptLaunch
from airflow_spot.operators.segment import SpotSegmentOperator
from airflow_spot.policy.offers import Market, Offer
from airflow_spot.storage.checkpoint import CheckpointStore
from airflow_spot.storage.ledger_store import LedgerStore
from airflow_spot.storage.object_store import open_store
from airflow_spot.storage.protocol import AttemptStatus, Heartbeat, JobLayout
from airflow_spot.triggers.completion import complete_attempt

OFFER = Offer("g5.xlarge", "us-east-1", "use1-az1", Market.SPOT, 0.4, 1.0, "A10G", 1, 24.0)


@pytest.fixture
def store(tmp_path):
    store = open_store(f"file://{tmp_path}/job")
    AttemptLaunch(
        attempt_id="seg.try1", segment_index=1, start_step=10, end_step=20, instance_id="i-1",
        offer=OFFER.to_dict(), requested_at=100.0, billed_from=100.0, reused_instance=True, try_number=1,
        task_id="seg", resume_step=10,
    ).write(store)
    layout = JobLayout(store)
    layout.write_status(AttemptStatus(attempt_id="seg.try1", outcome="completed", exit_code=0, started_at=100.5,
                                      ended_at=160.0, last_committed_step=20, instance_id="i-1"))
    layout.write_heartbeat(Heartbeat(attempt_id="seg.try1", step=20, time=159.0, step_time_ewma=3.0))
    return store


def test_event_rebuilt_from_the_store_gives_the_triggers_row(store):
    """dag.test() resumes a task the trigger ended with the payload 'success': execute_complete rebuilds
    the event from the store and writes the very row the trigger wrote."""
    CheckpointStore(store.child("checkpoints"), writer="seg.try1").save(20, lambda f: f.write(b"state"))
    event = SpotSegmentOperator._event_from_store(store, "seg.try1")
    assert SpotSegmentOperator._validate_event(event, "seg.try1") == event
    from_worker = complete_attempt(store, "seg.try1", event, segment_index=1, end_step=20, now=999.0)
    rows = LedgerStore(store).rows()
    assert len(rows) == 1 and rows[0].steps_done == 10 and rows[0].ended_at == 160.0
    again = complete_attempt(store, "seg.try1", event, segment_index=1, end_step=20, now=1234.0)
    assert again == from_worker and LedgerStore(store).rows() == rows  # idempotent


def test_short_checkpoint_or_other_outcome_is_left_to_the_worker(store):
    event = SpotSegmentOperator._event_from_store(store, "seg.try1")
    assert complete_attempt(store, "seg.try1", event, segment_index=1, end_step=20, now=999.0) is None  # none yet
    CheckpointStore(store.child("checkpoints"), writer="seg.try1").save(15, lambda f: f.write(b"state"))
    assert complete_attempt(store, "seg.try1", event, segment_index=1, end_step=20, now=999.0) is None
    CheckpointStore(store.child("checkpoints"), writer="seg.try1").save(20, lambda f: f.write(b"state"))
    assert complete_attempt(store, "seg.try1", {**event, "status": "preempted"}, segment_index=1, end_step=20,
                            now=999.0) is None
    assert complete_attempt(store, "other", event, segment_index=1, end_step=20, now=999.0) is None
    assert LedgerStore(store).rows() == []


def test_the_row_pays_the_spot_price_in_effect_over_the_run(store):
    """With a live market, the completed attempt's row takes the pool's price history over its run
    (here: $0.40/h for its first 30 s, then $0.80/h), not the $0.40/h it was launched at."""
    from datetime import UTC, datetime

    import boto3
    from botocore.stub import Stubber

    from airflow_spot.backends.base import Clients
    from airflow_spot.market.ec2 import Ec2Market

    CheckpointStore(store.child("checkpoints"), writer="seg.try1").save(20, lambda f: f.write(b"state"))
    event = SpotSegmentOperator._event_from_store(store, "seg.try1")
    client = boto3.client("ec2", region_name="us-east-1", aws_access_key_id="testing", aws_secret_access_key="testing")
    with Stubber(client) as stub:
        stub.add_response("describe_spot_price_history", {"SpotPriceHistory": [
            {"InstanceType": "g5.xlarge", "AvailabilityZone": "use1-az1", "SpotPrice": "0.80",
             "Timestamp": datetime.fromtimestamp(130.0, UTC)},
        ]}, {"InstanceTypes": ["g5.xlarge"], "ProductDescriptions": ["Linux/UNIX"], "AvailabilityZone": "use1-az1",
             "StartTime": datetime.fromtimestamp(100.0, UTC), "EndTime": datetime.fromtimestamp(160.0, UTC)})
        market = Ec2Market(regions=["us-east-1"], clients=Clients(ec2=lambda region: client), wall_clock=lambda: 999.0)
        summary = complete_attempt(store, "seg.try1", event, segment_index=1, end_step=20, now=999.0, market=market)
        stub.assert_no_pending_responses()
    (row,) = LedgerStore(store).rows()
    assert row.price_per_hour == pytest.approx(0.60) and summary["price_per_hour"] == pytest.approx(0.60)
    assert row.cost == pytest.approx(60 / 3600 * 0.60)  # a reused instance: the 60 s it ran, no minimum


def test_a_second_write_that_cannot_read_the_history_keeps_the_rows_price(store, caplog):
    """The trigger wrote the row from the price history; a later write of the same attempt (a triggerer
    restart, dag.test's resume) whose read fails keeps that price instead of the launch price."""
    class Flaky:
        def __init__(self, answer):
            self.answer = answer

        def billed_price(self, offer, start, end):
            if isinstance(self.answer, Exception):
                raise self.answer
            return self.answer

    CheckpointStore(store.child("checkpoints"), writer="seg.try1").save(20, lambda f: f.write(b"state"))
    event = SpotSegmentOperator._event_from_store(store, "seg.try1")
    first = complete_attempt(store, "seg.try1", event, segment_index=1, end_step=20, now=999.0, market=Flaky(0.6))
    again = complete_attempt(store, "seg.try1", event, segment_index=1, end_step=20, now=999.0,
                             market=Flaky(RuntimeError("RequestLimitExceeded")))
    assert again == first and LedgerStore(store).read("seg.try1").price_per_hour == 0.6
    assert "RequestLimitExceeded" in caplog.text
