"""The waits of a segment: for capacity on a timer, and for its attempt to end; and a kill during the latter.

A mixin of :class:`~airflow_spot.operators.segment.SpotSegmentOperator` (it uses the operator's ``hook``,
``log``, ``deferrable``, ``defer``, ``execute``, ``execute_complete``, ``_open_store``, ``attempt_id``, the
``_instance_id`` and ``_killable`` its ``_start_segment`` sets, and its options: the capacity wait's, and
those the :class:`~airflow_spot.triggers.segment.SegmentTrigger` is built from). A deferral names the
method it resumes in (``execute_after_capacity_wait``, ``execute_complete``), which Airflow looks up by
name on the operator: it is found through this mixin.
"""
from __future__ import annotations

import asyncio
import json
import time
from typing import TYPE_CHECKING, Any

from airflow.sdk.exceptions import AirflowException, AirflowFailException

from airflow_spot.operators.attempt_record import AttemptLaunch
from airflow_spot.operators.segment_errors import NoCapacityNow
from airflow_spot.storage.object_store import ObjectNotFound
from airflow_spot.storage.protocol import JobLayout
from airflow_spot.triggers.segment import SegmentTrigger

if TYPE_CHECKING:
    from airflow.sdk import Context


class SegmentWaits:
    """Wait for capacity (then decide again), or for the attempt (deferred or in the worker); end it if killed."""

    def execute_after_capacity_wait(self, context: Context, event: Any = None) -> dict[str, Any] | None:
        """Back from waiting for capacity: plan and launch again (the plan sees the refusals)."""
        self.log.info("back from waiting for capacity on a timer in the triggerer: deciding again")
        return self.execute(context)

    def _capacity_wait(self, context: Context, exc: NoCapacityNow) -> float:
        """Seconds to wait before deciding again; fails the task once this try has waited too long.

        The wait's start is kept in the job's store under the try's attempt id: a deferred wait resumes in
        a new process (maybe on another worker), and the job's refusal events alone do not bound it (an
        on-demand refusal is not a spot pool's event)."""
        store = self._open_store()
        key = f"control/capacity_wait/{self.attempt_id(context, store)}.json"
        now = time.time()
        try:
            since = float(json.loads(store.get_bytes(key))["since"])
        except ObjectNotFound:
            since = now
            store.put_bytes(key, json.dumps({"since": now}).encode())
        waited = now - since
        if waited >= self.max_capacity_wait_seconds:
            raise AirflowFailException(
                f"segment {self.segment_index}: no capacity in any of the job's offers for {waited / 3600:.2f} h "
                f"(max_capacity_wait_seconds={self.max_capacity_wait_seconds:g}); {exc}. The checkpoints are "
                "kept: clear the task to wait again, give the job a deadline so it may use on-demand, allow more "
                "instance types or regions (gpus=...), or raise segment_options['max_capacity_wait_seconds']"
            )
        delay = min(self.capacity_recheck_seconds, max(1.0, self.max_capacity_wait_seconds - waited))
        self.log.info("%s; the plan is to wait for capacity: deciding again in %.0f s (no capacity for %.0f s, "
                      "at most %.0f s)", exc, delay, waited, self.max_capacity_wait_seconds)
        return delay

    def _wait(self, context: Context, launch: AttemptLaunch, store_uri: str | None = None) -> dict[str, Any] | None:
        """Wait for the attempt to end: defer to the triggerer, or poll in this worker."""
        store_uri = store_uri or self.hook.get_store(self.checkpoint_uri).uri
        self._instance_id = launch.instance_id  # for on_kill while waiting in the worker
        self._killable = (store_uri, launch.attempt_id)
        trigger = SegmentTrigger(
            job_uri=store_uri,
            attempt_id=launch.attempt_id,
            instance_id=launch.instance_id,
            requested_at=launch.requested_at,
            backend=self.backend,
            backend_options=self.backend_options,
            aws_conn_id=self.aws_conn_id,
            market_options=self.market_options,
            poll_interval=self.poll_interval,
            startup_timeout=self.startup_timeout,
            heartbeat_timeout=self.heartbeat_timeout,
            max_attempt_seconds=self.max_attempt_seconds,
            stall_timeout=self.stall_timeout,
            # A completed attempt ends the task from the triggerer: no worker round trip per boundary.
            end_from_trigger=self.deferrable,
            segment_index=self.segment_index,
            end_step=self.end_step,
        )
        if self.deferrable:
            self.defer(trigger=trigger, method_name="execute_complete")
        event = asyncio.run(_first_event(trigger))
        return self.execute_complete(context, event)

    def on_kill(self) -> None:
        """Terminate the instance of the attempt this worker is waiting for.

        A deferred task is not in a worker; :meth:`SegmentTrigger.on_kill` covers that case.
        """
        instance_id = getattr(self, "_instance_id", None)
        if instance_id:
            killable = getattr(self, "_killable", None)
            if killable is not None:  # before the termination: the status it brings about is the kill's
                try:
                    JobLayout(self.hook.get_store(killable[0])).write_kill(killable[1], time.time())
                except Exception as exc:  # noqa: BLE001 - the instance must go all the same
                    self.log.warning("kill of attempt %s not recorded (%s: %s); its instance's last status may be "
                                     "billed as a preemption", killable[1], type(exc).__name__, exc)
            self.log.info("task killed: terminating instance %s", instance_id)
            self.hook.get_backend().terminate([instance_id])



async def _first_event(trigger: SegmentTrigger) -> dict[str, Any]:
    async for event in trigger.run():
        return event.payload
    raise AirflowException(f"trigger for attempt {trigger.attempt_id} ended without an event")
