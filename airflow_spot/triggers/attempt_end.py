"""How :class:`~airflow_spot.triggers.segment.SegmentTrigger` ends an attempt's costs, as a mixin of it.

Once the wait has a verdict: a preempted or lost attempt's instance is terminated here (``_release``), and
a completed one may be accounted for here so the task ends from the triggerer (``_complete_here``,
:mod:`airflow_spot.triggers.completion`). When the user kills the deferred task, ``on_kill`` releases the
instance and bills the attempt (unless the trigger only moved to another triggerer). Kept apart from the
wait itself; the methods use the trigger's own attributes and its ``_hook``.
"""
from __future__ import annotations

import asyncio
import time
from typing import Any

from airflow_spot.storage.protocol import JobLayout, Outcome

#: threads that account for completed attempts in the triggerer (see SegmentTrigger._complete_here)
ACCOUNTING_THREADS = 4
_ACCOUNTING_POOL = None


def _accounting_pool():
    global _ACCOUNTING_POOL
    if _ACCOUNTING_POOL is None:
        from concurrent.futures import ThreadPoolExecutor

        _ACCOUNTING_POOL = ThreadPoolExecutor(ACCOUNTING_THREADS, thread_name_prefix="airflow-spot-accounting")
    return _ACCOUNTING_POOL


class AttemptEndMixin:
    """Releasing and billing of :class:`~airflow_spot.triggers.segment.SegmentTrigger` (see the module doc)."""

    async def _release(self, backend) -> bool:
        """Terminate a preempted or lost attempt's instance here, with the client the poller already holds.

        The worker would do it in ``execute_complete``, but there it first builds a hook and an EC2 client
        (a connection read and botocore's service model: over a second), and the retry waits for that;
        here the instance stops billing at once and the event says so. A failure only logs: the worker,
        seeing ``terminated: False``, terminates again (terminating is idempotent)."""
        try:
            await asyncio.shield(asyncio.to_thread(backend.terminate, [self.instance_id]))
        except Exception as exc:  # noqa: BLE001 - the worker terminates it instead
            self.log.warning("attempt %s: could not terminate instance %s here (%s); the worker will",
                             self.attempt_id, self.instance_id, exc)
            return False
        return True

    async def _complete_here(self, store, event: dict[str, Any]) -> dict[str, Any] | None:
        """Account for a completed attempt here; None sends the event to the worker instead."""
        if not self.end_from_trigger or self.end_step is None or event["status"] != Outcome.COMPLETED.value:
            return None
        from airflow_spot.triggers.completion import complete_attempt

        hook = self._hook()

        def account() -> dict[str, Any] | None:
            from airflow_spot.operators.accounting import billing_market

            # a trigger serialised before it carried market_options cannot rebuild the job's market: the
            # launch price then (the defaults could be another market's, e.g. API prices for a catalog job)
            market = billing_market(hook) if self.market_options is not None else None
            return complete_attempt(store, self.attempt_id, event, segment_index=self.segment_index,
                                    end_step=self.end_step, now=time.time(), market=market)

        try:
            # its own few threads: a price-history read that EC2 throttles (retried, seconds) must not hold
            # the default pool that every trigger's store reads share
            summary = await asyncio.get_running_loop().run_in_executor(_accounting_pool(), account)
        except Exception as exc:  # noqa: BLE001 - the worker's execute_complete does it again
            self.log.warning("attempt %s: accounting in the triggerer failed (%s); resuming on a worker",
                             self.attempt_id, exc)
            return None
        if summary is not None:
            self.log.info("attempt %s ended: completed (%s); ending the task from the trigger; %s",
                          self.attempt_id, event["message"], summary)
        return summary

    def _still_deferred(self) -> bool:
        """Whether Airflow still has this trigger's task deferred. Airflow 3.3 calls ``on_kill`` for every trigger
        a triggerer stops running while it runs, a trigger moved to another triggerer (its heartbeat came late)
        included, not only for a user's mark or clear; a moved trigger's task is still deferred, a killed one's
        is not. Unknown (no task instance, the API unreachable): not deferred, so a kill still ends its
        instance, what ``on_kill`` is for."""
        ti = self.task_instance
        if ti is None:
            return False
        try:
            from airflow.sdk.execution_time.task_runner import RuntimeTaskInstance

            map_index = getattr(ti, "map_index", -1)
            states = RuntimeTaskInstance.get_task_states(
                dag_id=ti.dag_id, task_ids=[ti.task_id], run_ids=[ti.run_id],
                map_index=map_index if map_index is not None and map_index >= 0 else None)
        except Exception as exc:  # noqa: BLE001 - treated as a kill: the documented reason for on_kill
            self.log.warning("attempt %s: the task's state could not be read (%s: %s); ending it as killed",
                             self.attempt_id, type(exc).__name__, exc)
            return False
        of_run = (states or {}).get(ti.run_id) or {}
        key = ti.task_id if map_index is None or map_index < 0 else f"{ti.task_id}_{map_index}"
        return str(of_run.get(key) or "").lower() == "deferred"

    async def on_kill(self) -> None:
        """The user killed the deferred task (mark failed/success, clear, run marked failed): release its
        instance and bill the attempt up to now. The triggerer may cancel this coroutine again while it runs (it repeats the cancellation
        each time it syncs), so the termination is shielded: once asked, it completes in its thread."""
        hook = self._hook()
        killed_at = time.time()

        def release_and_bill() -> None:
            if self._still_deferred():
                self.log.warning("attempt %s: this triggerer was told to stop watching it, but its task is still "
                                 "deferred (the trigger moved to another triggerer): instance %s is left running",
                                 self.attempt_id, self.instance_id)
                return
            self.log.info("attempt %s was killed: terminating its instance %s", self.attempt_id, self.instance_id)
            try:  # before the termination: a status it brings about is the kill's, for whoever bills it later
                JobLayout(hook.get_store(self.job_uri)).write_kill(self.attempt_id, killed_at)
            except Exception as exc:  # noqa: BLE001 - the instance must go all the same
                self.log.warning("kill of attempt %s not recorded (%s: %s)", self.attempt_id, type(exc).__name__, exc)
            hook.get_backend().terminate([self.instance_id])
            self.log.info("terminated instance %s of killed attempt %s", self.instance_id, self.attempt_id)
            try:  # no execute_complete follows a kill: its time is billed here (Outcome.ABANDONED)
                from airflow_spot.operators import accounting
                from airflow_spot.operators.attempt_record import AttemptLaunch

                store = hook.get_store(self.job_uri)
                launch = AttemptLaunch.read(store, self.attempt_id)
                if launch is not None:
                    # the emergency save lands in the shutdown (EC2's termination returns at once): its status
                    # says what the attempt kept
                    accounting.wait_for_statuses(store, [self.attempt_id])
                    market = accounting.billing_market(hook) if self.market_options is not None else None
                    accounting.account_abandoned(store, launch, now=time.time(), killed_at=killed_at, market=market)
            except Exception as exc:  # noqa: BLE001 - the finish task bills it then
                self.log.warning("killed attempt %s not billed here (%s: %s)", self.attempt_id,
                                 type(exc).__name__, exc)

        await asyncio.shield(asyncio.to_thread(release_and_bill))
