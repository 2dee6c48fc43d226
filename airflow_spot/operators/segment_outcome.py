"""How a segment's attempt is accounted for once it ended: ``execute_complete`` and what only it needs.

A mixin of :class:`~airflow_spot.operators.segment.SpotSegmentOperator` (it uses the operator's ``hook``,
``log``, ``task_id``, ``retries``, the segment's steps and budgets, ``attempt_id``, ``_open_store`` and
``_availability``): kept apart so the operator's module holds how a segment starts (plan, launch or reattach,
defer) and this one how its attempt is judged when the trigger fired: the event checked against the store,
a status the task's kill brought about, the ledger row, and the budgets (counted from the try that started
them, :meth:`SegmentOutcome._budget_start`) that turn the outcome into a success, a retry or a failure.
Airflow resumes the deferred task by this method's name (``method_name="execute_complete"``), which the
operator inherits from here; the job's newest usable checkpoint, which decides whether a segment is done,
is here too, and the operator's module re-exports it.
"""
from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

from airflow.sdk.exceptions import AirflowException, AirflowFailException

from airflow_spot.operators import accounting
from airflow_spot.operators.attempt_record import AttemptLaunch, read_job
from airflow_spot.operators.segment_errors import SegmentCodeFailure, SegmentPreempted
from airflow_spot.storage.checkpoint import NoUsableCheckpointError
from airflow_spot.storage.manifest import Manifest
from airflow_spot.storage.object_store import ObjectStore, store_errors
from airflow_spot.storage.protocol import JobLayout, Outcome, SchemaError, safe_id
from airflow_spot.triggers.completion import summarize
from airflow_spot.triggers.segment import EVENT_KEYS

if TYPE_CHECKING:
    from airflow.sdk import Context


def newest_usable_checkpoint(store: ObjectStore) -> Manifest | None:
    """The manifest of the job's newest checkpoint; a store whose checkpoints are all broken fails the task
    without retries (a retry would find the same store), with the error that says how to recover."""
    try:
        return JobLayout(store).checkpoint_store().latest()
    except NoUsableCheckpointError as exc:
        raise AirflowFailException(str(exc)) from None


def newest_usable_step(store: ObjectStore) -> int | None:
    """The step of :func:`newest_usable_checkpoint`."""
    newest = newest_usable_checkpoint(store)
    return None if newest is None else newest.step


class SegmentOutcome:
    """Account for an ended attempt: its ledger row, then success, a retry or a failure by the budgets."""

    def execute_complete(self, context: Context, event: dict[str, Any] | None = None) -> dict[str, Any]:
        store = self._open_store()
        attempt_id = self.attempt_id(context, store)
        if event == "success":
            # The trigger ended the task (TaskSuccessEvent); only dag.test() still resumes it, with the
            # state as the payload: do the same accounting from the store (the same ledger row again).
            event = self._event_from_store(store, attempt_id)
        event = self._validate_event(event, attempt_id)
        outcome = Outcome(event["status"])
        launch = AttemptLaunch.read(store, attempt_id)
        if launch is None:
            raise AirflowException(f"attempt {attempt_id} has no launch record in {store.uri}; cannot account for it")
        killed_at = JobLayout(store).read_kill(attempt_id)
        if killed_at is not None and outcome is not Outcome.COMPLETED and self._the_kills(store, attempt_id, event,
                                                                                         killed_at):
            # the task was killed (on_kill recorded it before ending the instance) and this is the status
            # the termination brought about: no preemption and no code failure, billed as the kill's
            try:
                accounting.account_abandoned(store, launch, now=time.time(),
                                             market=accounting.billing_market(self.hook))
            except Exception as exc:  # noqa: BLE001 - the finish task bills it then
                self.log.warning("killed attempt %s not billed here (%s: %s)", attempt_id, type(exc).__name__, exc)
            raise AirflowException(
                f"segment {self.segment_index} attempt {attempt_id} was killed (its task, at {killed_at:.0f}); its "
                f"instance's {outcome.value} status is the kill's: billed as abandoned, no preemption counted")
        latest = newest_usable_step(store)
        if outcome is Outcome.COMPLETED and (latest is None or latest < self.end_step):
            outcome = Outcome.FAILED
            event["error_tail"] = (
                f"the command exited 0 but the job's newest checkpoint is at step {latest}, not >= {self.end_step}: "
                "does the script train through SpotSession.steps() to SPOT_END_STEP?\n"
                + (event.get("error_tail") or "")
            )
        summary = summarize(store, launch, outcome, event, segment_index=self.segment_index, latest=latest,
                            now=time.time(), market=accounting.billing_market(self.hook))
        self.log.info("attempt %s ended: %s (%s); %s", attempt_id, outcome.value, event.get("message"), summary)
        context["ti"].xcom_push(key="attempt", value=summary)
        if outcome is Outcome.COMPLETED:
            return summary
        if outcome.is_retryable():
            if not event.get("terminated"):  # the trigger releases it itself when it can
                try:
                    self.hook.get_backend().terminate([launch.instance_id])
                except Exception as exc:  # noqa: BLE001 - the retry's let-go, the finish task and reap end it
                    # a failed termination must not turn the preemption into a backend error (its retry
                    # rule, the deployment's log and the "done all the same" check below still apply)
                    self.log.warning("could not terminate instance %s of attempt %s (%s: %s); the next try "
                                     "terminates it again", launch.instance_id, attempt_id, type(exc).__name__, exc)
            offer = launch.offer_obj
            # the deployment learns of the market's reclaim (the job's own ledger row has it already); a lost
            # attempt (an agent that never started, a silent instance) says nothing of the pool's capacity
            if offer.is_spot and outcome is Outcome.PREEMPTED:
                recorder = self._availability(store)
                if recorder.deployment_log is not None:
                    try:
                        from airflow_spot.policy.observations import PoolEvent

                        ended = float(event.get("ended_at") or time.time())
                        recorder.deployment_log.append(PoolEvent(offer.pool, "preempted", ended, recorder.job))
                    except Exception as exc:  # noqa: BLE001 - a hint for other jobs, never fatal here
                        self.log.warning("could not log the preemption for the deployment: %s", exc)
            if latest is not None and latest >= self.end_step:
                # Taken after its last checkpoint was committed (a reclaim between the end's commit and the
                # status, or an agent that could not write its status): the segment's work is all saved.
                self.log.info("segment %d is done all the same: the job's newest checkpoint is at step %d >= %d; "
                              "no retry needed", self.segment_index, latest, self.end_step)
                return summary
            # The budgets stay ours: Airflow's retries count the tries of one task instance, while
            # max_preemptions is the whole job's (all segments), and preemptions must not use up the
            # code-failure budget. Exhausted budgets raise AirflowFailException (never a retry policy's).
            since = self._budget_start(context, store)
            preemptions = accounting.count(store, outcomes=(Outcome.PREEMPTED, Outcome.LOST), since=since)
            resume = latest if latest is not None else self.start_step
            if outcome is Outcome.LOST:
                self._fail_if_instances_never_reach_the_store(store, event, since)
            if preemptions > self.max_preemptions:
                raise AirflowFailException(
                    f"segment {self.segment_index} {outcome.value} on {launch.instance_id} ({event.get('message')}); "
                    f"the job's preemption budget is exhausted ({preemptions} > max_preemptions={self.max_preemptions})"
                )
            raise SegmentPreempted(
                f"segment {self.segment_index} attempt {attempt_id} {outcome.value} on {launch.instance_id} "
                f"({launch.offer['instance_type']} in {launch.offer['zone']}, {launch.offer['market']}): "
                f"{event.get('message')}; preemption {preemptions} of {self.max_preemptions}; "
                f"the next try resumes from step {resume}"
            )
        failures = accounting.count(
            store, outcomes=(Outcome.FAILED,), segment_index=self.segment_index,
            since=self._budget_start(context, store),
        )
        tail = (event.get("error_tail") or "").strip()[-4000:]
        message = (
            f"segment {self.segment_index} attempt {attempt_id}: the training command failed "
            f"(exit code {event.get('exit_code')}); failure {failures} of {self.code_retries + 1} allowed"
            + (f"\n--- error tail ---\n{tail}" if tail else "")
        )
        if failures > self.code_retries:
            raise AirflowFailException(message + "\nuser-code retry budget exhausted")
        raise SegmentCodeFailure(message)

    def _budget_start(self, context: Context, store) -> float | None:
        """When the budgets of this try started counting: the DAG run's start, or the first try since the
        task was last cleared, whichever is later.

        Clearing a failed segment gives it ``retries`` more tries (``max_tries`` grows by ``retries``); the
        budgets start again with them, so a user who cleared a job that ran out of preemptions gets a
        fresh budget instead of an immediate failure. Attempts of a deleted run whose run id (and job
        root) is used again do not count either.
        """
        ti = context["ti"]
        generation = read_job(store, time.time()).get("generation_started_at")
        starts = [float(generation)] if generation else []
        dag_run = context.get("dag_run")
        if getattr(dag_run, "start_date", None) is not None:  # a run created again starts afresh
            starts.append(dag_run.start_date.timestamp())
        first_try = max(1, int(ti.max_tries) - int(self.retries) + 1)
        if first_try > 1:
            launch = AttemptLaunch.read(store, safe_id(self.task_id, f"try{first_try}"))
            if launch is not None:
                starts.append(launch.requested_at)
        return max(starts, default=None)

    @staticmethod
    def _event_from_store(store: ObjectStore, attempt_id: str) -> dict[str, Any]:
        """The trigger's event of an attempt it ended itself, rebuilt from its status and heartbeat."""
        layout = JobLayout(store)
        status, hb = layout.read_status(attempt_id), layout.read_heartbeat(attempt_id)
        if status is None:
            raise AirflowException(f"the trigger ended attempt {attempt_id}, but it has no status in {store.uri}")
        return {
            "status": status.outcome, "attempt_id": attempt_id, "instance_id": status.instance_id,
            "message": f"agent reported {status.outcome} (exit code {status.exit_code})",
            "exit_code": status.exit_code, "error_tail": status.error_tail,
            "last_step": hb.step if hb else None, "step_time_ewma": hb.step_time_ewma if hb else None,
            "last_committed_step": status.last_committed_step, "started_at": status.started_at,
            "ended_at": status.ended_at,
        }

    @staticmethod
    def _validate_event(event: Any, attempt_id: str) -> dict[str, Any]:
        if not isinstance(event, dict) or any(k not in event for k in EVENT_KEYS):
            raise AirflowException(f"invalid trigger event for attempt {attempt_id}: {event!r}")
        if event["status"] not in {o.value for o in Outcome}:
            raise AirflowException(f"trigger event has unknown status {event['status']!r}: {event!r}")
        if event["attempt_id"] != attempt_id:
            raise AirflowException(
                f"trigger event is for attempt {event['attempt_id']!r}, but this try is {attempt_id!r}"
            )
        return dict(event)

    @staticmethod
    def _the_kills(store: ObjectStore, attempt_id: str, event: dict, killed_at: float) -> bool:
        """Whether the attempt's status is its recorded kill's doing: as its agent says (``kill_seen``),
        else by the times (the trigger's event has the status's end, or a lost attempt's last sign)."""
        try:
            status = JobLayout(store).read_status(attempt_id)
        except (SchemaError, *store_errors()):
            status = None
        if status is not None:
            return not status.before_kill(killed_at)
        return float(event.get("ended_at") or time.time()) >= killed_at

    #: lost attempts in a row whose instances' agents never wrote to the store before the segment gives up
    NEVER_REACHED_STORE_LIMIT = 2

    def _fail_if_instances_never_reach_the_store(self, store, event: dict[str, Any],
                                                 since: float | None = None) -> None:
        """Fail now when the job's latest lost attempts all ran on instances whose agent never wrote its
        liveness to the store: the image does not start the agent (no python or airflow-spot's training
        extra, a failing setup line) or the instance cannot reach the store (its profile, the network). Each
        further try would boot one more instance into the same silence, through the whole preemption budget.
        Only losses since ``since`` (the budgets' start) count: a user who fixed the image and cleared the
        task gets the same tries again, not a failure at the first new loss."""
        try:
            lost = sorted((r for r in accounting.read_rows(store) if r.outcome == Outcome.LOST.value
                           and (since is None or r.ended_at >= since)),
                          key=lambda r: r.ended_at)[-self.NEVER_REACHED_STORE_LIMIT:]
            if len(lost) < self.NEVER_REACHED_STORE_LIMIT:
                return
            layout = JobLayout(store)
            keys = [layout.agent_key(r.instance_id) for r in lost]
            if store.get_many(keys):
                return  # some agent did reach the store: an ordinary loss
        except Exception as exc:  # noqa: BLE001 - an ordinary retry then
            self.log.warning("could not check whether the lost instances reached the store (%s)", exc)
            return
        raise AirflowFailException(
            f"segment {self.segment_index}: the last {len(lost)} instances ({', '.join(r.instance_id for r in lost)}) "
            f"were lost without their agent ever writing to the job's store {store.uri} "
            f"({event.get('message')}). The agent does not start on them, or cannot reach the store: check that "
            "the image has python and airflow-spot's training extra (and that backend_options setup lines "
            "succeed), that the instance profile grants the store, and the instances' console output; if they "
            "only boot slowly, raise segment_options startup_timeout. The checkpoints are kept: fix it and clear "
            "the task")
