"""A new try of a segment finds the attempt an earlier try left running, instead of launching a second instance.

A mixin of :class:`~airflow_spot.operators.segment.SpotSegmentOperator` (it uses the operator's ``hook``,
``log``, ``task_id``, ``segment_index`` and ``_budget_start``); :meth:`SegmentReattach._reattach` says
which mechanisms keep a job to one instance per segment.
"""
from __future__ import annotations

import json
import time
from typing import TYPE_CHECKING

from airflow_spot.backends.base import InstanceInfo, InstanceState
from airflow_spot.operators import accounting
from airflow_spot.operators.attempt_record import AttemptLaunch
from airflow_spot.operators.instance_tags import TAG_STORE
from airflow_spot.policy.ledger import LedgerRow
from airflow_spot.storage.object_store import ObjectStore
from airflow_spot.storage.protocol import JobLayout, SchemaError, safe_id

if TYPE_CHECKING:
    from airflow.sdk import Context


class SegmentReattach:
    """Reattach to, or end and bill, an earlier try's attempt."""

    #: task_state_store key of the attempt this task instance launched last
    ATTEMPT_STATE_KEY = "airflow_spot_attempt"

    def _remember_attempt(self, context: Context, launch: AttemptLaunch) -> None:
        """Record the launched attempt in Airflow's task state store (kept across tries of this task).

        Written after the segment request, so a recorded attempt is one its instance was asked to run.
        """
        state = context.get("task_state_store")
        if state is None:  # Airflow without a task state store: the next try finds it in the store
            return
        state.set(self.ATTEMPT_STATE_KEY, {"attempt_id": launch.attempt_id, "instance_id": launch.instance_id,
                                           "try_number": launch.try_number})

    def _reattach(self, context: Context, store: ObjectStore, rows: list | None = None) -> AttemptLaunch | None:
        """The attempt a crashed worker left running (or ended unaccounted), to wait for instead of launching.

        A worker killed between launch and defer (or while waiting in the worker) leaves an instance that
        runs the attempt on; the scheduler fails that try, and the next try would launch a second instance
        training the same job into the same store. Two mechanisms keep it to one:

        * the backend's launch is idempotent by a token from dag/run/task/try: a re-run of the *same* try
          (a redelivered Celery message) gets the same instance back, even when the crash came before
          anything was recorded here;
        * this record, in Airflow's task state store, covers a *new* try (whose token differs): while the
          recorded attempt has no ledger row (nobody accounted for it) and its instance still runs or it
          left a status, this try waits for that attempt, and the trigger classifies it as usual;
        * without a record (the worker died between the request and the record, the record's write
          failed, or Airflow keeps no task state) the store's own launch and request records name the
          earlier try's unaccounted attempt (:meth:`_unrecorded_attempt`), and the same rule applies.
        """
        state = context.get("task_state_store")
        recorded = state.get(self.ATTEMPT_STATE_KEY) if state is not None else None
        rows = accounting.read_rows(store) if rows is None else rows  # the caller's read; a row billed here joins it
        accounted = {r.attempt_id for r in rows}
        launch = None
        if isinstance(recorded, dict) and recorded.get("attempt_id"):
            launch = AttemptLaunch.read(store, recorded["attempt_id"])
            if launch is None or launch.instance_id != recorded.get("instance_id"):
                return None  # the store was replaced or the job root reused: nothing of ours to reattach to
            since = self._budget_start(context, store)
            if since is not None and launch.requested_at < since:
                # from before the task was cleared: its trigger's on_kill ends and bills it, and the agent's
                # "preempted" is the kill's; waiting for it would spend a preemption (as _unrecorded_attempt)
                launch = None
        if launch is None or launch.attempt_id in accounted:
            # Nothing recorded, or an older try's attempt that was accounted for: a later try may have asked
            # its instance and died before its record (the worker went, the record's write failed, or
            # Airflow keeps no task state). The store still knows that attempt.
            launch = self._unrecorded_attempt(context, store, accounted,
                                              after=launch.try_number if launch is not None else 0)
            if launch is None:
                return None  # accounted for (or nothing launched): a new attempt is due
            recorded = {"try_number": launch.try_number}
        info = self.hook.get_backend().describe([launch.instance_id]).get(launch.instance_id)
        if info is not None and not self._serves(info, store):
            self.log.warning("the store's record of attempt %s names instance %s, which does not serve this job's store "
                             "(its %s tag is %r): not waited for, not ended", launch.attempt_id, launch.instance_id,
                             TAG_STORE, info.tags.get(TAG_STORE))
            return None
        status = JobLayout(store).read_status(launch.attempt_id)
        killed_at = JobLayout(store).read_kill(launch.attempt_id)
        if killed_at is not None and (status is None or not status.before_kill(killed_at, launch.end_step)):
            # its task was killed (an execution_timeout, a worker's shutdown: on_kill, then a retry without a
            # clear): the status its instance's termination brings about is the kill's, no preemption to wait for
            self._end_killed_attempt(store, launch, rows, info)
            return None
        ended = status is not None
        if not ended and (info is None or InstanceState(info.state).is_terminal()):
            self.log.info("attempt %s of an earlier try left no status and its instance %s is gone; launching anew",
                          launch.attempt_id, launch.instance_id)
            self._bill_abandoned(store, launch, rows)  # to its last heartbeat: why its instance went is not known
            return None
        ti = context["ti"]
        ti_id = getattr(ti, "id", None)
        if ti_id is None:
            return None
        # execute_complete (maybe on another worker) finds the attempt of this try through this key
        store.put_bytes(f"control/tries/{safe_id(ti_id)}.json",
                        json.dumps({"attempt_id": launch.attempt_id, "try_number": ti.try_number,
                                    "reattached": True}).encode())
        self.log.warning(
            "try %d reattaches to attempt %s on instance %s, launched by try %s whose worker went away; "
            "no second instance is launched", ti.try_number, launch.attempt_id, launch.instance_id,
            recorded.get("try_number"),
        )
        return launch

    @staticmethod
    def _serves(info: InstanceInfo, store: ObjectStore) -> bool:
        """The instance's own tags say it serves ``store``. An instance id read from the store is waited for or
        ended only then: whoever may write the store (the instances' role, the training code) must not steer
        this deployment's terminations to other instances of the account. An instance without the tag (a
        backend that keeps none) is taken at the record's word."""
        return TAG_STORE not in info.tags or info.tags[TAG_STORE] == store.uri

    def _end_killed_attempt(self, store: ObjectStore, launch: AttemptLaunch, rows: list,
                            info: InstanceInfo | None) -> None:
        """An earlier try's attempt whose task was killed: its instance ended again where the kill's
        termination failed (it would train on beside this try's attempt), and its time billed up to the kill
        (``Outcome.ABANDONED``). Best effort: the finish task bills what is left. Not billed while its
        instance may still run it: unaccounted, that instance stays out of the warm ones (``_busy``)."""
        self.log.info("attempt %s of an earlier try was killed; not waiting for it, launching anew", launch.attempt_id)
        try:
            backend = self.hook.get_backend()
            if info is not None and not InstanceState(info.state).is_terminal():
                self.log.warning("instance %s of killed attempt %s still runs: terminating it", launch.instance_id,
                                 launch.attempt_id)
                backend.terminate([launch.instance_id])
                accounting.wait_for_statuses(store, [launch.attempt_id])  # its emergency save, in the shutdown
        except Exception as exc:  # noqa: BLE001 - the finish task and reap end it then
            self.log.warning("instance %s of killed attempt %s not checked (%s: %s); billed later",
                             launch.instance_id, launch.attempt_id, type(exc).__name__, exc)
            return
        self._bill_abandoned(store, launch, rows)

    def _bill_abandoned(self, store: ObjectStore, launch: AttemptLaunch, rows: list) -> None:
        """An earlier try's attempt nobody waits for, billed as ``abandoned`` (``account_abandoned``) and added
        to ``rows``, the caller's read of the ledger. Best effort: the finish task bills it otherwise."""
        try:
            row = accounting.account_abandoned(store, launch, now=time.time(),
                                               market=accounting.billing_market(self.hook))
            if row is not None:
                rows.append(LedgerRow.from_dict(row))
        except Exception as exc:  # noqa: BLE001 - the finish task bills it then
            self.log.warning("attempt %s not billed here (%s: %s)", launch.attempt_id, type(exc).__name__, exc)

    def _unrecorded_attempt(self, context: Context, store: ObjectStore, accounted: set[str],
                            after: int = 0) -> AttemptLaunch | None:
        """This segment's newest attempt of an earlier try (than this one, later than try ``after``) that was
        asked of its instance (a request written) and that nobody accounted for (no ledger row): what a lost
        task state record pointed to. Reads at most one launch record per earlier try (their ids are
        ``<task_id>.try<n>``); attempts from before this run's budget started (a deleted run whose id and job
        root came back, a cleared task's earlier tries) are not this try's to wait for."""
        ti = context.get("ti")
        if ti is None or ti.try_number <= after + 1:
            return None
        since = self._budget_start(context, store)
        layout = JobLayout(store)
        for n in range(ti.try_number - 1, after, -1):
            attempt_id = safe_id(self.task_id, f"try{n}")
            if attempt_id in accounted:
                continue
            try:
                launch = AttemptLaunch.read(store, attempt_id)
            except (SchemaError, TypeError, ValueError):  # a torn record names no instance to wait for
                continue
            if (launch is None or launch.segment_index != self.segment_index
                    or (since is not None and launch.requested_at < since)):
                continue
            if store.exists(layout.request_key(launch.instance_id, launch.attempt_id)):
                return launch
        return None
