from __future__ import annotations

import pytest

from airflow_spot.policy.ledger import LedgerRow, summarize
from airflow_spot.storage.ledger_store import LEDGER_PREFIX, LedgerStore
from airflow_spot.storage.object_store import open_store


def row(attempt_id, start, outcome="completed"):
    return LedgerRow(attempt_id=attempt_id, instance_id="i-1", instance_type="p3.2xlarge", zone="usw2-az1",
                     market="spot", price_per_hour=1.0, on_demand_price_per_hour=3.06, started_at=start,
                     ended_at=start + 600, steps_done=5, outcome=outcome)


def test_rows_round_trip_one_key_per_attempt(tmp_path):
    store = LedgerStore(open_store(str(tmp_path)))
    store.write(row("dag.run.seg0.try1", 100.0, "preempted"))
    store.write(row("dag.run.seg0.try2", 800.0))
    store.write(row("dag.run.seg0.try2", 800.0))  # a retried write of the same attempt: still one row
    keys = store.store.list(LEDGER_PREFIX)
    assert len(keys) == 2 and all(k.startswith("control/ledger/") and k.endswith(".json") for k in keys)
    rows = store.rows()
    assert [r.attempt_id for r in rows] == ["dag.run.seg0.try1", "dag.run.seg0.try2"]
    assert store.read("dag.run.seg0.try1") == rows[0]
    assert store.read("missing") is None
    assert summarize(rows).preemptions == 1


def test_a_corrupt_row_names_its_key(tmp_path):
    s = open_store(str(tmp_path))
    s.put_bytes(LEDGER_PREFIX + "bad.json", b'{"attempt_id": "x"}')
    with pytest.raises(ValueError, match="control/ledger/bad.json"):
        LedgerStore(s).rows()
