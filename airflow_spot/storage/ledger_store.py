"""Ledger rows in the job's store: one JSON object per attempt under ``control/ledger/<attempt_id>.json``.

One key per attempt makes writing idempotent (a retried ``execute_complete`` rewrites the same row) and
lets concurrent writers never clash. Only moves rows; the maths is in :mod:`airflow_spot.policy.ledger`.
"""
from __future__ import annotations

import json
import logging

from airflow_spot.policy.ledger import LedgerRow
from airflow_spot.storage.object_store import ObjectNotFound, ObjectStore
from airflow_spot.storage.protocol import JobLayout

log = logging.getLogger(__name__)

LEDGER_PREFIX = JobLayout.LEDGER_PREFIX


class LedgerStore:
    """:param store: the job's store (its root, not the checkpoints child)."""

    def __init__(self, store: ObjectStore) -> None:
        self.store = store

    @staticmethod
    def key(attempt_id: str) -> str:
        return JobLayout.ledger_key(attempt_id)

    def write(self, row: LedgerRow) -> str:
        key = self.key(row.attempt_id)
        self.store.put_bytes(key, json.dumps(row.to_dict(), sort_keys=True).encode())
        return key

    def read(self, attempt_id: str) -> LedgerRow | None:
        try:
            raw = self.store.get_bytes(self.key(attempt_id))
        except ObjectNotFound:
            return None
        return self._decode(self.key(attempt_id), raw)

    def rows(self) -> list[LedgerRow]:
        """Every row, ordered by start time (then attempt id)."""
        keys = [k for k in self.store.list(LEDGER_PREFIX) if k.endswith(".json")]
        # a row deleted between the listing and the read (retention) is left out: nothing to count
        out = [self._decode(key, raw) for key, raw in self.store.get_many(keys).items()]
        return sorted(out, key=lambda r: (r.started_at, r.attempt_id))

    def write_probe(self, row: LedgerRow) -> str:
        """A probe's bill: a spot instance launched to learn whether its pool has capacity and terminated at
        once (the billing minimum). Kept apart from the attempts' rows, which the budgets and the page's
        attempts read; the job's cost adds it (``JobView.totals``)."""
        key = JobLayout.probe_key(row.attempt_id)
        self.store.put_bytes(key, json.dumps(row.to_dict(), sort_keys=True).encode())
        return key

    def write_idle(self, row: LedgerRow) -> str | None:
        """A warm instance's bill from its last attempt's end to its termination (``row.instance_id``: one
        per instance, never rewritten, so a second termination call bills nothing twice). Kept apart from
        the attempts' rows, as probes are; None when the instance was billed already."""
        key = JobLayout.idle_key(row.instance_id)
        try:
            self.store.get_bytes(key)
            return None
        except ObjectNotFound:
            pass
        self.store.put_bytes(key, json.dumps(row.to_dict(), sort_keys=True).encode())
        return key

    def probe_rows(self) -> tuple[list[LedgerRow], list[tuple[str, str]]]:
        """Every probe's row, and ``(key, error)`` of each that does not decode (left out: a probe's bill
        is never a budget's input, so a torn one is shown as unreadable rather than stop a reader)."""
        return self._extra_rows(JobLayout.PROBES_PREFIX)

    def idle_rows(self) -> tuple[list[LedgerRow], list[tuple[str, str]]]:
        """Every warm instance's idle bill (:meth:`write_idle`), as :meth:`probe_rows`."""
        return self._extra_rows(JobLayout.IDLE_PREFIX)

    def _extra_rows(self, prefix: str) -> tuple[list[LedgerRow], list[tuple[str, str]]]:
        keys = [k for k in self.store.list(prefix) if k.endswith(".json")]
        rows, bad = [], []
        for key, raw in self.store.get_many(keys).items():
            try:
                rows.append(self._decode(key, raw))
            except Exception as exc:  # noqa: BLE001 - JSON that is no object fails as AttributeError too
                bad.append((key, str(exc)))
        return sorted(rows, key=lambda r: (r.started_at, r.attempt_id)), bad

    def _decode(self, key: str, raw: bytes) -> LedgerRow:
        try:
            return LedgerRow.from_dict(json.loads(raw))
        except (ValueError, TypeError) as exc:
            raise ValueError(f"ledger row {self.store.uri}/{key} is not a valid ledger row: {exc}") from exc
