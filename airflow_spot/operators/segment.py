"""``SpotSegmentOperator``: one checkpoint-bounded segment of a spot training job, as one Airflow task.

``execute`` (worker): skip when the store already holds a checkpoint at or past the segment's end; choose
an offer (market + policies); reuse the job's warm instance when it is alive and still a good offer, else
launch one with an idempotency token from dag/run/task/try; write the segment request; defer to
:class:`~airflow_spot.triggers.segment.SegmentTrigger`. The waits (for capacity, for the attempt) and
``on_kill`` are in :mod:`~airflow_spot.operators.segment_waits`.

``execute_complete`` (worker, after the trigger fired; :mod:`~airflow_spot.operators.segment_outcome`):
validate the event, write the attempt's ledger row, then succeed (completed), raise a retryable
:class:`SegmentPreempted` (preempted or lost: the next try resumes from the last committed step on a fresh
instance) or fail (user code). Preemptions and user-code failures have separate budgets counted from the
ledger rows in the store, and an exhausted budget raises :class:`AirflowFailException` so Airflow stops
retrying.

Nothing is carried from ``execute`` to ``execute_complete`` in memory or in defer kwargs: both sides read
the attempt back from the store (see :mod:`airflow_spot.operators.attempt_record`).
"""
from __future__ import annotations

import json
import os
import time
from collections.abc import Sequence
from datetime import timedelta
from typing import TYPE_CHECKING, Any

from airflow.sdk import BaseOperator
from airflow.sdk.exceptions import AirflowFailException

from airflow_spot.backends.base import LaunchError
from airflow_spot.backends.ec2_errors import configuration_problem
from airflow_spot.hooks.spot import SpotHook
from airflow_spot.links.attempt import SpotAttemptLink, SpotJobLink
from airflow_spot.operators import accounting, planning
from airflow_spot.operators.attempt_record import AttemptLaunch, read_job, write_job
from airflow_spot.operators.instance_tags import TAG_DAG, TAG_JOB, TAG_RUN, TAG_STORE, TAG_TASK, job_tags
from airflow_spot.operators.retry import segment_retry_policy
from airflow_spot.operators.segment_errors import NoCapacityNow, SegmentCodeFailure, SegmentPreempted
from airflow_spot.operators.segment_instances import SegmentInstances
from airflow_spot.operators.segment_outcome import SegmentOutcome, newest_usable_checkpoint, newest_usable_step
from airflow_spot.operators.segment_reattach import SegmentReattach
from airflow_spot.operators.segment_request import SegmentRequestParts
from airflow_spot.operators.segment_waits import SegmentWaits
from airflow_spot.operators.validation import (
    validate_gpus, validate_option_names, validate_places, validate_step_profile,
)
from airflow_spot.policy.offers import GpuRequest
from airflow_spot.storage.object_store import ObjectNotFound, ObjectStore, StoreConfigError, store_uri
from airflow_spot.storage.protocol import JobLayout, safe_id
from airflow_spot.triggers.segment import DEFAULT_STALL_TIMEOUT

if TYPE_CHECKING:
    from airflow.sdk import Context

__all__ = [  # the names DAGs, the finish task and the tests import from here
    "NoCapacityNow", "SegmentCodeFailure", "SegmentPreempted", "SpotSegmentOperator", "TAG_DAG", "TAG_JOB",
    "TAG_RUN", "TAG_STORE", "TAG_TASK", "default_deferrable", "job_tags", "newest_usable_checkpoint",
    "newest_usable_step",
]


def default_deferrable() -> bool:
    """Defer unless the deployment's environment sets ``AIRFLOW__OPERATORS__DEFAULT_DEFERRABLE``.

    Airflow ships ``[operators] default_deferrable`` as False, which suits short tasks; a segment waits for
    hours. The option in ``airflow.cfg`` cannot tell a choice from that default: Airflow writes every
    option, ``default_deferrable = false`` included, into the ``airflow.cfg`` it generates on first start,
    so a process started after that file exists read it as "explicitly False" (an e2e worker restarted
    mid-suite stopped deferring). The environment variable is only ever set on purpose, so it is honoured.
    """
    value = os.environ.get("AIRFLOW__OPERATORS__DEFAULT_DEFERRABLE")
    if value is None:
        return True
    return value.strip().lower() in ("true", "t", "1", "yes", "y", "on")


class SpotSegmentOperator(SegmentInstances, SegmentReattach, SegmentOutcome, SegmentRequestParts, SegmentWaits,
                          BaseOperator):
    """Train steps ``[start_step, end_step)`` of a job on the cheapest suitable instance.

    Usually built by :func:`airflow_spot.operators.training.SpotTraining`, which also validates the
    arguments at parse time.

    :param command: the training command (argv list); templated.
    :param checkpoint_uri: the job's root in the store (``file:///...`` or ``s3://bucket/prefix``);
        templated, and must render the same in every task of a run (e.g. use ``{{ run_id }}``).
    :param start_step: first step of this segment.
    :param end_step: exclusive end of this segment.
    :param total_steps: length of the whole job (for the deadline policy).
    :param segment_index: position of the segment in the job.
    :param job_name: name of the job within the DAG (instance tags, ledger).
    :param gpus: what each instance needs.
    :param backend: backend name; ``backend_options`` its JSON kwargs; ``market_options`` the market's.
    :param env: extra environment for the command; templated.
    :param cwd: working directory of the command on the instance; templated.
    :param warm_start_uri: another job's root whose newest checkpoint seeds this one; templated.
    :param deadline: time from the job's start by which it must finish; ``None`` means spot only.
    :param max_preemptions: preempted or lost attempts the whole job may suffer.
    :param code_retries: user-code failures each segment may retry.
    :param stall_timeout: seconds an attempt may heartbeat without its step advancing before it is called
        lost and its instance let go (a hung NCCL collective or data loader keeps the heartbeat going, and
        would otherwise bill until ``max_attempt_seconds``); stretched to 20 steps and 3 saves of the
        attempt's own pace. ``None`` turns it off (a script that spends longer than this inside one step).
    :param warm_process: let the instance keep the training process alive across segment boundaries
        (default True): the process commits its end checkpoint, the attempt is reported completed at once,
        and the next segment on the same warm instance continues in it without restarting python, torch
        or restoring (see :mod:`airflow_spot.training.handoff`). Set False (e.g.
        ``SpotTraining(segment_options={"warm_process": False})``) for a script that does per-segment work
        after its ``for step in spot.steps()`` loop: with a warm process that code runs once per process.
    :param availability_uri: the deployment's availability log (launch outcomes, capacity refusals and
        preemptions of every job, read by the offer plan); default: ``AIRFLOW_SPOT_AVAILABILITY_URI``, else
        ``_availability`` beside the job's root (:mod:`airflow_spot.storage.availability`).
    :param probe_spot: while the job runs on on-demand and its knowledge of the spot pools is stale, or on
        spot while a move to a cheaper pool waits for it to settle, probe them (launch and terminate at once,
        billed the minimum) so it can tell when a pool has settled. False: a move is tried at once.
    :param deferrable: wait in the triggerer (True) or in a worker slot (False); ``None`` (default) means
        True unless ``AIRFLOW__OPERATORS__DEFAULT_DEFERRABLE`` says otherwise (see :func:`default_deferrable`).
    :param restart_overhead_seconds: what a new instance costs before it trains, as the deadline rule
        budgets it (its floor, the restart of a switch, a move's cost). None (default): measured — the
        median of the job's recent fresh starts (launch to the end of the first training step), else the
        deployment's jobs' figure, else 600 s
        (``operators/restart_budget.py``); the plan's log line says which. A number pins it: ``simulate``'s
        ``--restart-overhead-hours`` is the same figure.
    :param capacity_recheck_seconds: when no offer of the plan can be launched (every pool refuses and the
        plan is to wait for spot), decide again after this long: a timer (deferred, or in the worker when
        not deferrable), not an Airflow try, so an outage spends no retries. The simulator's replay of
        ``ours`` rechecks a waiting job as often (``ObservedController.recheck_seconds``).
    :param max_capacity_wait_seconds: fail the segment, saying why, once the job has found no capacity
        this long (its own capacity refusals since it last held an instance); its checkpoints stay.
    :param step_profile: seconds per training step the job was measured at, per GPU model (e.g.
        ``{"T4": 0.42}``, from ``airflow-spot estimate --profile-command``); the UI's ranking of instance
        types before the job starts scales it by the catalog's relative throughputs; until a heartbeat has
        measured a step time it also feeds the deadline rule, and with a ``deadline`` ``SpotTraining``
        refuses at parse time a deadline the profile says cannot be met (optional).
    :param checkpoint_region: the region of the store ``checkpoint_uri`` names, or ``"auto"``: the ``s3://``
        bucket's own region, asked of S3 at each try (``s3:GetBucketLocation``; a ``file://`` store has no
        region, so nothing is priced). An attempt in another region restores the checkpoint and saves back
        across regions; the offer plan prices that against the cheaper offers elsewhere and in the
        deadline's slack (``simulate --store-region`` replays the same). Per new instance there: a flat
        ``transfer_seconds`` (extra start-up) and ``transfer_dollars`` (egress), plus, from the size of the
        job's newest checkpoint, ``transfer_seconds_per_gib`` of restore per GiB and
        ``transfer_dollars_per_gib`` (the inter-region rate, e.g. 0.02) per GiB restored; per hour any
        instance runs there, that rate for the checkpoint saved back at each segment boundary
        (:mod:`airflow_spot.policy.transfer`). Each ledger row carries what its attempt paid. Default: not
        priced.
    """

    # ``spot_job`` is a template field so that it is in the serialized DAG: the UI plugin ranks offers for a
    # job from it before the job's first attempt (airflow_spot/ui/prestart.py); it holds no template
    template_fields: Sequence[str] = ("command", "checkpoint_uri", "env", "cwd", "warm_start_uri", "spot_job",
                                      "availability_uri")
    template_fields_renderers = {"command": "json", "env": "json"}
    ui_color = "#fde8c8"
    operator_extra_links = (SpotAttemptLink(), SpotJobLink())

    def __init__(
        self,
        *,
        command: list[str],
        checkpoint_uri: str,
        start_step: int,
        end_step: int,
        total_steps: int,
        segment_index: int = 0,
        job_name: str = "train",
        gpus: GpuRequest | dict | None = None,
        backend: str = "local",
        backend_options: dict[str, Any] | None = None,
        market_options: dict[str, Any] | None = None,
        env: dict[str, str] | None = None,
        cwd: str | None = None,
        warm_start_uri: str | None = None,
        deadline: timedelta | None = None,
        max_preemptions: int = 10,
        code_retries: int = 1,
        idle_timeout_seconds: float = 300.0,
        poll_interval: float = 5.0,
        startup_timeout: float = 900.0,
        heartbeat_timeout: float = 300.0,
        max_attempt_seconds: float = 7 * 24 * 3600.0,
        stall_timeout: float | None = DEFAULT_STALL_TIMEOUT,
        checkpoint_min_interval: float | None = None,
        checkpoint_max_interval: float | None = None,
        keep_checkpoints: int = 3,
        notice_window_seconds: float | None = None,
        aws_conn_id: str | None = "aws_default",
        deferrable: bool | None = None,
        warm_process: bool = True,
        availability_uri: str | None = None,
        probe_spot: bool = True,
        step_profile: dict[str, float] | None = None,
        capacity_recheck_seconds: float = 60.0,
        max_capacity_wait_seconds: float = 24 * 3600.0,
        restart_overhead_seconds: float | None = None,
        checkpoint_region: str | None = None,
        transfer_seconds: float = 0.0,
        transfer_dollars: float = 0.0,
        transfer_seconds_per_gib: float = 0.0,
        transfer_dollars_per_gib: float = 0.0,
        **kwargs: Any,
    ) -> None:
        # Airflow's own retry policy decides how each failure is retried (operators/retry.py); a policy
        # the user gives is asked first, never replaced.
        kwargs["retry_policy"] = segment_retry_policy(kwargs.get("retry_policy"), SegmentPreempted, SegmentCodeFailure)
        super().__init__(**kwargs)
        self.command = command
        self.checkpoint_uri = checkpoint_uri
        self.start_step = int(start_step)
        self.end_step = int(end_step)
        self.total_steps = int(total_steps)
        self.segment_index = int(segment_index)
        self.job_name = job_name
        self.gpus = validate_gpus(gpus)
        self.backend = backend
        self.backend_options = dict(backend_options or {})
        self.market_options = dict(market_options or {})
        # here, not in SpotTraining: every segment is built through this, and a segment may be used alone
        validate_option_names(backend, self.backend_options, self.market_options)
        if self.gpus.regions or self.gpus.zones:
            validate_places(self.gpus, backend, self.market_options)
        self.env = dict(env or {})
        self.cwd = cwd
        self.warm_start_uri = warm_start_uri
        self.deadline = deadline
        self.max_preemptions = int(max_preemptions)
        self.code_retries = int(code_retries)
        self.idle_timeout_seconds = float(idle_timeout_seconds)
        self.restart_overhead_seconds = None if restart_overhead_seconds is None else float(restart_overhead_seconds)
        self.poll_interval = float(poll_interval)
        self.startup_timeout = float(startup_timeout)
        self.heartbeat_timeout = float(heartbeat_timeout)
        self.max_attempt_seconds = float(max_attempt_seconds)
        self.stall_timeout = None if stall_timeout is None else float(stall_timeout)
        self.checkpoint_min_interval = checkpoint_min_interval
        self.checkpoint_max_interval = checkpoint_max_interval
        self.keep_checkpoints = int(keep_checkpoints)
        # None: the backend's own window (the local backend kills after its option, EC2 after 120 s)
        self.notice_window_seconds = None if notice_window_seconds is None else float(notice_window_seconds)
        self.aws_conn_id = aws_conn_id
        self.deferrable = default_deferrable() if deferrable is None else bool(deferrable)
        self.warm_process = bool(warm_process)
        self.availability_uri = availability_uri
        self.probe_spot = bool(probe_spot)
        self.capacity_recheck_seconds = float(capacity_recheck_seconds)
        self.max_capacity_wait_seconds = float(max_capacity_wait_seconds)
        self.checkpoint_region = checkpoint_region
        self.transfer_seconds = float(transfer_seconds)
        self.transfer_dollars = float(transfer_dollars)
        self.transfer_seconds_per_gib = float(transfer_seconds_per_gib)
        self.transfer_dollars_per_gib = float(transfer_dollars_per_gib)
        self.spot_job = {  # what the job asks for, readable from the serialized DAG before it starts
            "job_name": job_name, "gpus": self.gpus.to_dict(), "total_steps": self.total_steps,
            "backend": backend, "market_options": self.market_options, "aws_conn_id": aws_conn_id,
            "step_profile": validate_step_profile(step_profile),
        }

    # ------------------------------------------------------------------ helpers
    @property
    def hook(self) -> SpotHook:
        if getattr(self, "_hook", None) is None:
            self._hook = SpotHook(
                backend=self.backend,
                backend_options=self.backend_options,
                market_options=self.market_options,
                aws_conn_id=self.aws_conn_id,
            )
        return self._hook

    def attempt_id(self, context: Context, store: ObjectStore, *, create: bool = False) -> str:
        """This try's attempt id: ``<task_id>.try<n>``, remembered in the store under the try's own id.

        Try numbers restart when a DAG run is deleted and created again with the same run id (and so the
        same job root); the old run's attempt objects must not be mistaken for this try's, so a taken id
        gets a suffix from the task instance's unique id. ``execute_complete`` (maybe on another worker)
        finds the id again through the same key.
        """
        ti = context["ti"]
        base = safe_id(self.task_id, f"try{ti.try_number}")
        ti_id = getattr(ti, "id", None)
        if ti_id is None:
            return base
        key = JobLayout.try_key(ti_id)
        try:
            return json.loads(store.get_bytes(key))["attempt_id"]
        except ObjectNotFound:
            if not create:
                return base
        attempt = base
        if AttemptLaunch.read(store, base) is not None or JobLayout(store).read_status(base) is not None:
            attempt = safe_id(base, str(ti_id).replace("-", "")[-8:])
            self.log.warning("attempt id %s was used by an earlier run of this job root; this try is %s", base, attempt)
            if ti.try_number == 1:  # the run was made again: its budgets start now
                now = time.time()
                write_job(store, {**read_job(store, now), "generation_started_at": now})
        store.put_bytes(key, json.dumps({"attempt_id": attempt, "try_number": ti.try_number}).encode())
        return attempt

    def _tags(self, context: Context) -> dict[str, str]:
        return job_tags(self.dag_id, context["run_id"], self.job_name, store_uri(self.checkpoint_uri))

    def _open_store(self):
        try:
            store = self.hook.get_store(self.checkpoint_uri)
            store.check_writable()
        except StoreConfigError as exc:
            raise AirflowFailException(str(exc)) from exc
        return store

    # ------------------------------------------------------------------ execute
    def execute(self, context: Context) -> dict[str, Any] | None:
        while True:  # bounded: _capacity_wait fails the task past max_capacity_wait_seconds
            try:
                return self._run_segment(context)
            except NoCapacityNow as exc:
                delay = self._capacity_wait(context, exc)
            if self.deferrable:  # no worker slot held while waiting; the tries stay for preemptions
                from airflow.providers.standard.triggers.temporal import TimeDeltaTrigger

                self.defer(trigger=TimeDeltaTrigger(timedelta(seconds=delay)),
                           method_name="execute_after_capacity_wait")
            time.sleep(delay)

    def _run_segment(self, context: Context) -> dict[str, Any] | None:
        """Plan, launch (or reattach) and wait; a configuration AWS refuses fails the task at once (every try
        would meet it: a missing connection or permission), with what to fix."""
        try:
            return self._start_segment(context)
        except LaunchError as exc:  # listing or reusing the job's instances, before any launch
            if exc.capacity or exc.transient:
                raise
            raise AirflowFailException(f"segment {self.segment_index}: {exc}") from exc
        except Exception as exc:
            problem = configuration_problem(exc)
            if problem is None:
                raise
            raise AirflowFailException(f"segment {self.segment_index}: {problem}") from exc

    def _start_segment(self, context: Context) -> dict[str, Any] | None:
        store = self._open_store()
        rows = accounting.read_rows(store)  # the one read of the ledger a segment start makes
        resumed = self._reattach(context, store, rows)
        if resumed is not None:
            return self._wait(context, resumed)
        newest = newest_usable_checkpoint(store)
        latest = None if newest is None else newest.step
        if latest is not None and latest >= self.end_step:
            self.log.info(
                "segment %d [%d, %d) is already done: the job's newest checkpoint is at step %d; nothing to run",
                self.segment_index, self.start_step, self.end_step, latest,
            )
            return {"segment": self.segment_index, "outcome": "skipped", "latest_step": latest}
        if latest is None and self.start_step > 0:
            # the segments before this one ended only with a checkpoint at >= start_step: none at all means the
            # store lost them (root deleted or moved, or a different checkpoint_uri); starting at step 0 would
            # silently throw that work away
            raise AirflowFailException(
                f"segment {self.segment_index} starts at step {self.start_step}, but the job's store {store.uri} "
                "holds no checkpoint at all: the earlier segments' checkpoints are gone (the store's root deleted "
                "or moved, or checkpoint_uri changed). Restore the checkpoints there, or clear the run from its "
                "first segment to really start again from step 0."
            )
        self._check_command()
        now = time.time()
        job = read_job(store, now)
        if "gpus" not in job:  # what the job asks for, for the UI's "cheapest offers now" (storage/job_view.py)
            job = {**job, "gpus": self.gpus.to_dict(), "total_steps": self.total_steps, "backend": self.backend}
            write_job(store, job)
        alive = self._warm_instances(context, store, rows)
        recorder = self._availability(store)
        market = self.hook.get_market().with_availability_log(recorder.deployment_log)
        # warm instances that timed out idle since: in the cost so far
        accounting.bill_idle_exits(store, rows, market)
        beat = planning.measured_step(JobLayout(store), rows)
        step_seconds = beat.step_time_ewma if beat is not None else None
        restart = self._restart_budget(store, rows)
        home, transfer = self._checkpoint_transfer(store, newest, step_seconds)
        plan_inputs = dict(
            done_steps=latest or 0,
            total_steps=self.total_steps,
            job_started_at=float(job["started_at"]),
            deadline=self.deadline,
            ledger_rows=rows,
            step_seconds=step_seconds,
            running=alive[0].offer.market if alive else None,
            running_pool=alive[0].offer.pool if alive else None,
            committed=bool(job.get("deadline_committed")),
            checkpoint_region=home,
            transfer_seconds=transfer.seconds,
            transfer_dollars=transfer.dollars,
            remote_dollars_per_hour=transfer.dollars_per_hour,
            restart_overhead_seconds=restart.seconds,
            step_throughput=self._throughput_of(store, beat.attempt_id) if beat is not None else None,
            **self._step_profile(store, measured=step_seconds is not None),
        )

        def replan() -> planning.Plan:  # after capacity refusals: the same decision, with them observed
            return planning.plan(market, self.gpus, now=time.time(), job_events=recorder.job_events(), **plan_inputs)

        try:
            plan = planning.plan(market, self.gpus, now=now, job_events=recorder.job_events(), **plan_inputs)
        except planning.NoOfferError as exc:
            raise AirflowFailException(str(exc)) from exc
        if plan.probe and self.probe_spot and alive:
            spot_offers = [o for o in market.offers(self.gpus) if o.is_spot and self.gpus.matches(o)]
            answered = self._probe_pools(context, store, spot_offers, recorder, now)
            self.log.info("probed %d spot pools while on on-demand", answered)
            plan = replan()
        if plan.settle_probe and alive:
            plan = self._settle_probe(context, store, plan, recorder, now, replan)
        self.log.info("offer plan: %s; %s", plan.reason, restart.describe())
        advice = planning.segment_length_advice(self.end_step - self.start_step, plan_inputs["step_seconds"],
                                                self.deadline)
        if advice:
            self.log.warning("%s", advice)
        if plan.committed and not job.get("deadline_committed"):
            write_job(store, {**job, "deadline_committed": True})
        attempt_id = self.attempt_id(context, store, create=True)
        instance, reused = self._get_instance(context, store, plan, alive, recorder=recorder, replan=replan,
                                              rows=rows)
        self._instance_id = instance.instance_id  # for on_kill while waiting in the worker
        requested_at = time.time()
        launch = AttemptLaunch(
            attempt_id=attempt_id,
            segment_index=self.segment_index,
            start_step=self.start_step,
            end_step=self.end_step,
            instance_id=instance.instance_id,
            offer=instance.offer.to_dict(),
            requested_at=requested_at,
            billed_from=self._billed_from(instance, reused, rows, requested_at),
            reused_instance=reused,
            try_number=context["ti"].try_number,
            task_id=self.task_id,
            # where the session resumes: the newest committed step, which is short of start_step when a
            # segment before was marked success by hand or the run's segments changed (it trains the gap too)
            resume_step=latest or 0,
            transfer_dollars=0.0 if reused or home in (None, instance.offer.region) else transfer.dollars,
            remote_dollars_per_hour=0.0 if home in (None, instance.offer.region) else transfer.dollars_per_hour,
            run_id=context["run_id"],
        )
        launch.write(store)
        self._killable = (store.uri, attempt_id)  # a kill from here on is recorded (on_kill): it has a launch
        JobLayout(store).write_request(instance.instance_id, self._request(attempt_id, requested_at, plan))
        offer = instance.offer
        self.log.info(
            "attempt %s of segment %d [%d, %d) resumes from step %s on %s instance %s: %s in %s, %s at $%.4f/h",
            attempt_id, self.segment_index, self.start_step, self.end_step, latest or self.start_step,
            "warm" if reused else "new", instance.instance_id, offer.instance_type, offer.zone,
            offer.market.value if hasattr(offer.market, "value") else offer.market, offer.price_per_hour,
        )
        self._remember_attempt(context, launch)
        SpotAttemptLink.persist(context, store.uri, attempt_id, self.aws_conn_id)
        return self._wait(context, launch, store_uri=store.uri)
