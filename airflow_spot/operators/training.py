"""``SpotTraining``: declare one spot training job in a DAG; get a chain of segment tasks and a final task.

    train = SpotTraining(
        task_id="train", command=["python", "train.py"], total_steps=20_000, steps_per_segment=2_000,
        gpus=GpuRequest(count=1, min_memory_gib=16),
        checkpoint_uri="s3://bucket/{{ dag.dag_id }}/{{ run_id }}", backend="local",
        deadline=timedelta(hours=10), max_preemptions=15, retries=2,
    )

builds a :class:`TaskGroup` ``train`` holding ``segment_000 >> segment_001 >> ... >> finish``. ``finish``
runs whatever happened (trigger rule ALL_DONE): it terminates the job's instances, writes the job summary
(ledger totals) to the store, the log and XCom, and fails when the job did not reach ``total_steps`` so
the DAG run's state tells the truth.
"""
from __future__ import annotations

import json
import time
from datetime import timedelta
from typing import TYPE_CHECKING, Any

from airflow.sdk import BaseOperator, TaskGroup, TriggerRule
from airflow.sdk.exceptions import AirflowFailException

from airflow_spot.backends.base import InstanceState
from airflow_spot.backends.reap import stopped_leftovers
from airflow_spot.hooks.spot import SpotHook
from airflow_spot.operators import accounting
from airflow_spot.operators.job_summary_format import deadline_figures, format_summary  # demo.py, tests use these
from airflow_spot.operators.segment import SpotSegmentOperator, job_tags, newest_usable_step
from airflow_spot.operators.training_checks import _SET_BY_SPOT_TRAINING, _check_segment_options
from airflow_spot.operators.validation import (
    SpotTrainingConfigError,
    normalize_command,
    segment_bounds,
    validate_backend,
    validate_budget,
    validate_checkpoint_uri,
    validate_deadline,
    validate_deadline_feasible,
    validate_env,
    validate_gpus,
    validate_gpus_offered,
    validate_places,
    validate_json_options,
    validate_market_regions,
    validate_optional_str,
    validate_retry_delay,
    validate_steps,
    validate_task_id,
)
from airflow_spot.policy.offers import GpuRequest
from airflow_spot.storage.object_store import StoreConfigError, store_uri
from airflow_spot.storage.protocol import JobLayout

if TYPE_CHECKING:
    from airflow.sdk import Context

SUMMARY_KEY = JobLayout.SUMMARY_KEY


class SpotJobSummaryOperator(BaseOperator):
    """Release the job's instances and report what the job did and cost.

    :param checkpoint_uri: the job's root in the store; templated.
    :param job_name: the job whose instances (tags) and ledger to sum.
    :param total_steps: the job is complete when a checkpoint at this step is committed.
    :param availability_uri: the deployment's availability log, as the segments' (default: theirs, see
        :func:`~airflow_spot.storage.availability.deployment_availability_uri`); the task compacts it.
    :param market_options: the segments' market options: the attempts and idle time this task bills are
        priced by the job's own market, as the segments price theirs.
    :param deadline: the job's deadline (SpotTraining's): the summary says whether it was met.
    """

    template_fields = ("checkpoint_uri", "availability_uri")
    ui_color = "#d9f2d9"

    def __init__(
        self,
        *,
        checkpoint_uri: str,
        job_name: str,
        total_steps: int,
        segments: int,
        backend: str = "local",
        backend_options: dict[str, Any] | None = None,
        aws_conn_id: str | None = "aws_default",
        availability_uri: str | None = None,
        market_options: dict[str, Any] | None = None,
        deadline: timedelta | None = None,
        **kwargs: Any,
    ) -> None:
        kwargs.setdefault("trigger_rule", TriggerRule.ALL_DONE)
        super().__init__(**kwargs)
        self.deadline = deadline
        self.availability_uri = availability_uri
        self.market_options = dict(market_options or {})
        self.checkpoint_uri = checkpoint_uri
        self.job_name = job_name
        self.total_steps = int(total_steps)
        self.segments = int(segments)
        self.backend = backend
        self.backend_options = dict(backend_options or {})
        self.aws_conn_id = aws_conn_id

    def execute(self, context: Context) -> dict[str, Any]:
        hook = SpotHook(backend=self.backend, backend_options=self.backend_options,
                        market_options=self.market_options, aws_conn_id=self.aws_conn_id)
        backend = hook.get_backend()
        # the store's name, not the store: opening it may fail, and the instances' end comes first
        tags = job_tags(self.dag_id, context["run_id"], self.job_name, store_uri(self.checkpoint_uri))
        instances = backend.list_instances(tags=tags)
        running = [i.instance_id for i in instances if not InstanceState(i.state).is_terminal()]
        # stopped instances serve nothing (reported terminated) but their volumes bill until terminated
        stopped = stopped_leftovers(backend, tags, older_than=0.0, now=time.time())
        leftover = running + [i.instance_id for i in stopped]
        dag_run = context.get("dag_run")
        # when the run was due (run_after, kept when a task is cleared; start_date is reset then)
        run_started = next((getattr(getattr(dag_run, name, None), "timestamp", None)
                            for name in ("run_after", "start_date") if getattr(dag_run, name, None) is not None), None)
        store, unaccounted = None, []
        try:
            store = hook.get_store(self.checkpoint_uri)
            since = run_started() if run_started is not None else None
            # this run's: a store shared by runs holds others' (one may still be running)
            unaccounted = accounting.unaccounted_launches(store, lambda launch: (
                not (launch.run_id and launch.run_id != context["run_id"])
                and (since is None or launch.requested_at >= since)))
        except Exception as exc:  # noqa: BLE001 - billing is best effort: the summary and the instances' end come first
            self.log.warning("attempts not checked for missing ledger rows (%s: %s)", type(exc).__name__, exc)
        terminated_at = time.time()  # a status written after this is the termination's, not the attempt's
        if store is not None:
            accounting.record_kills(store, [a for a in unaccounted if a.instance_id in leftover], terminated_at)
        if leftover:
            self.log.info("terminating the job's instances: %s", leftover)
            backend.terminate(leftover)
        store = store or hook.get_store(self.checkpoint_uri)  # it failed above: the task fails on it, after the end
        market = accounting.billing_market(hook)  # the job's own: its market_options price what is billed here
        if unaccounted:
            accounting.bill_abandoned(store, unaccounted, set(leftover), terminated_at, market)
        try:  # a warm instance nobody reused ran from its last attempt's end until now, or until it timed out
            rows = accounting.read_rows(store)
            if running:
                accounting.bill_idle(store, running, rows, terminated_at, market)
            accounting.bill_idle_exits(store, rows, market)
            accounting.bill_unrecorded(store, instances + stopped, rows, unaccounted, set(running), terminated_at,
                                       market)
        except Exception as exc:  # noqa: BLE001 - the same: best effort
            self.log.warning("warm instances' idle time not billed (%s: %s)", type(exc).__name__, exc)
        try:
            latest, broken = newest_usable_step(store), None
        except AirflowFailException as exc:  # every checkpoint broken: the cost is still published, then it fails
            latest, broken = None, str(exc)
        summary = accounting.summarize(store, now=time.time())
        summary.update(
            # the UI finds a job through this field of the XCom summary (see airflow_spot/ui/jobs.py)
            job_uri=store.uri,
            dag_id=self.dag_id,
            run_id=context["run_id"],
            job=self.job_name,
            segments=self.segments,
            total_steps=self.total_steps,
            latest_step=latest,
            completed=latest is not None and latest >= self.total_steps,
            terminated_at_end=leftover,
        )
        if broken:
            summary["checkpoint_error"] = broken
        if self.deadline is not None:
            summary.update(deadline_figures(store, summary, self.deadline.total_seconds(), time.time()))
        if run_started is not None:
            # a store shared by several runs (a checkpoint_uri without {{ run_id }}) sums every run's attempts
            summary["attempts_this_run"] = self._attempts_of_run(store, summary.get("rows", []), context["run_id"],
                                                                 run_started())
            if summary["attempts_this_run"] == 0 and summary.get("attempts"):
                self.log.warning(
                    "this run trained nothing: the store %s already held the job's checkpoints, and the figures "
                    "below are the earlier runs' (put {{ run_id }} in checkpoint_uri for one job per run)", store.uri)
        # dated: a run cleared after it trains on, and the page then reads the store again (job_figures.summary_stands)
        summary["written_at"] = time.time()
        try:
            store.check_writable()
            store.put_bytes(SUMMARY_KEY, json.dumps(summary, sort_keys=True, indent=2).encode())
        except StoreConfigError as exc:  # the segments failed on it already; the summary still goes to XCom
            self.log.warning("job summary not written to the store: %s", exc)
        self._record_overheads(store)
        self.log.info("job summary:\n%s", format_summary(summary))
        context["ti"].xcom_push(key="summary", value=summary)
        self._compact_availability(hook, store)  # after the summary is out: the UI finds the job by it
        if broken:
            raise AirflowFailException(f"job {self.job_name}: {broken}")
        if not summary["completed"]:
            raise AirflowFailException(self._unfinished_message(latest))
        return summary

    @staticmethod
    def _attempts_of_run(store, rows: list[dict[str, Any]], run_id: str, run_started: float) -> int:
        """The attempts this DAG run launched: by the run its launch record names; by the run's start only for
        a record that names none (written before launch records carried it). A catchup or backfill run is
        due long before it runs, so by time alone it counted the earlier runs' attempts as its own."""
        from airflow_spot.storage.job_view import JobView

        try:
            launches = JobView(store).launches()
        except Exception:  # noqa: BLE001 - the time alone, then
            launches = {}
        count = 0
        for row in rows:
            named = (launches.get(row["attempt_id"]) or {}).get("run_id")
            count += (named == run_id) if named else (row["started_at"] >= run_started)
        return count

    def _unfinished_message(self, latest: int | None) -> str:
        """Why the job stopped short, naming the segment that owes the rest: it failed (its log says why), or
        it was marked success or skipped by hand, or the run's segments changed while it was in flight."""
        where = "no checkpoint was committed" if latest is None else f"the newest checkpoint is at step {latest}"
        step = latest or 0
        try:
            tasks = self.dag.tasks
        except RuntimeError:  # not in a DAG (built by hand): no segments to name
            tasks = []
        segments = sorted((t for t in tasks if isinstance(t, SpotSegmentOperator) and t.job_name == self.job_name),
                          key=lambda t: t.start_step)
        owing = next((t for t in segments if t.start_step <= step < t.end_step), None)
        if owing is None:
            return (f"job {self.job_name} did not finish: {where} of {self.total_steps} steps; clear the job's "
                    "segments to train the rest")
        return (f"job {self.job_name} did not finish: {where} of {self.total_steps} steps, inside {owing.task_id} "
                f"(steps [{owing.start_step}, {owing.end_step})), which ended without its end checkpoint. If it "
                f"failed, its log says why; if it was marked success or skipped by hand, or the DAG's segments "
                f"changed while this run was in flight, clear {owing.task_id} and the tasks after it to train "
                "the rest")

    def _compact_availability(self, hook: SpotHook, store) -> None:
        """Delete the deployment log's events no decision reads (``AvailabilityLog.compact``), so that the
        read every decision makes stays small. Best effort: a log left as it is only costs reading."""
        from airflow_spot.storage.availability import (
            COMPACT_AFTER_HOURS, AvailabilityLog, deployment_availability_uri,
        )

        uri = deployment_availability_uri(store.uri, self.availability_uri)
        try:
            n = AvailabilityLog(hook.get_store(uri)).compact(before=time.time() - COMPACT_AFTER_HOURS * 3600)
        except Exception as exc:  # noqa: BLE001 - the summary does not depend on it
            self.log.warning("availability log %s not compacted (%s: %s)", uri, type(exc).__name__, exc)
            return
        if n:
            self.log.info("availability log %s: deleted %d events no decision reads", uri, n)

    def _record_overheads(self, store) -> None:
        """What this job's overheads were, for the estimates of the deployment's later jobs (the next runs of
        this DAG above all; ``storage/overhead_history.py``). Best effort: the summary does not depend on it."""
        from airflow_spot.storage.job_view import JobView
        from airflow_spot.storage.overhead_history import job_name, record, record_pace

        now = time.time()
        try:
            record(store, job_name(store.uri), now, JobView(store).measured_overheads(now))
        except Exception as exc:  # noqa: BLE001 - a later job then estimates from its own figures alone
            self.log.warning("overheads not recorded for later jobs' estimates (%s: %s)", type(exc).__name__, exc)
        try:  # the next run's first segment decides on this step time until it has measured its own
            record_pace(store, self.dag_id, self.job_name, JobView(store).measured_step_profile(), now)
        except Exception as exc:  # noqa: BLE001 - the next run then starts on the declared profile, or none
            self.log.warning("step times not recorded for the next runs (%s: %s)", type(exc).__name__, exc)


def _check_task_kwargs(task_kwargs: dict[str, Any]) -> None:
    """An argument SpotTraining does not know fails here, named as SpotTraining's, not later as the first
    segment operator's TypeError."""
    import inspect

    from airflow.sdk import BaseOperator as SdkBaseOperator

    base = set(inspect.signature(SdkBaseOperator.__init__).parameters) - {"self", "kwargs"}
    unknown = sorted(set(task_kwargs) - base)
    if not unknown:
        return
    own = sorted(set(inspect.signature(SpotTraining).parameters) - {"task_kwargs"})
    segment = sorted(set(inspect.signature(SpotSegmentOperator.__init__).parameters) - base - _SET_BY_SPOT_TRAINING
                     - {"self", "kwargs"})
    hint = [name for name in unknown if name in segment]
    raise SpotTrainingConfigError(
        f"SpotTraining got unknown arguments {unknown}; its own are {', '.join(own)}, and every task takes "
        "Airflow's BaseOperator arguments (pool, queue, ...)"
        + (f"; {hint} are segment operator arguments: pass them in segment_options" if hint else ""))


def SpotTraining(  # noqa: N802 - reads like a class in a DAG file, as TaskGroup does
    *,
    task_id: str,
    command: list[str] | str,
    total_steps: int,
    steps_per_segment: int,
    checkpoint_uri: str,
    gpus: GpuRequest | dict | None = None,
    backend: str = "local",
    backend_options: dict[str, Any] | None = None,
    market_options: dict[str, Any] | None = None,
    env: dict[str, str] | None = None,
    cwd: str | None = None,
    warm_start_uri: str | None = None,
    deadline: timedelta | None = None,
    max_preemptions: int = 10,
    retries: int = 1,
    retry_delay: timedelta = timedelta(seconds=10),
    aws_conn_id: str | None = "aws_default",
    segment_options: dict[str, Any] | None = None,
    **task_kwargs: Any,
) -> TaskGroup:
    """Build the task group of one spot training job (validated now, at DAG parse time).

    :param task_id: id of the task group; its full id (with any enclosing groups' ids) is the job's name in
        tags, the ledger and the histories.
    :param command: training command, argv list (a string is shell-split); templated.
    :param total_steps: length of the job in training steps.
    :param steps_per_segment: steps per segment task; the last segment may be shorter.
    :param checkpoint_uri: ``file:///abs/path`` or ``s3://bucket/prefix``; templated, e.g.
        ``s3://bucket/{{ dag.dag_id }}/{{ run_id }}`` (one job root per DAG run).
    :param gpus: what each instance needs.
    :param backend: ``local`` (this machine) or another registered backend; ``backend_options`` its kwargs.
    :param deadline: finish within this time of the job's start; switches to on-demand when needed.
    :param max_preemptions: preempted or lost attempts the whole job may survive.
    :param retries: failures of the user's code each segment may retry (separate from preemptions).
        Each segment task gets Airflow ``retries = max_preemptions + retries``; the operator stops
        retrying early (``AirflowFailException``) when either budget is spent.
    :param segment_options: further :class:`SpotSegmentOperator` arguments (timeouts, poll interval,
        checkpoint interval bounds, ``deferrable``...).
    :param task_kwargs: further BaseOperator arguments for every task (pool, queue, ...).
    """
    validate_task_id(task_id)
    validate_steps(total_steps, steps_per_segment)
    validate_backend(backend)
    argv = normalize_command(command, backend)
    validate_checkpoint_uri(checkpoint_uri)
    if warm_start_uri is not None:
        validate_checkpoint_uri(warm_start_uri)
    validate_deadline(deadline)
    validate_budget("max_preemptions", max_preemptions)
    validate_budget("retries", retries)
    gpu_request = validate_gpus(gpus)
    validate_json_options("backend_options", backend_options)
    validate_json_options("market_options", market_options)
    validate_json_options("segment_options", segment_options)
    validate_gpus_offered(gpu_request, market_options)
    validate_places(gpu_request, backend, market_options)
    validate_market_regions(backend, backend_options, market_options)
    validate_env(env)
    validate_optional_str("cwd", cwd, "/home/ubuntu/project")
    validate_optional_str("aws_conn_id", aws_conn_id, "aws_default")
    validate_retry_delay(retry_delay)
    options = dict(segment_options or {})
    _check_task_kwargs(task_kwargs)
    _check_segment_options(options, task_kwargs)
    validate_deadline_feasible(total_steps, deadline, gpu_request, options.get("step_profile"), market_options)
    bounds = segment_bounds(total_steps, steps_per_segment)
    group_kwargs = {"dag": task_kwargs["dag"]} if task_kwargs.get("dag") is not None else {}
    with TaskGroup(group_id=task_id, **group_kwargs) as group:
        # the job's name in tags, the ledger and the histories: the group's full id, so two jobs named alike
        # in two task groups of one DAG never take (or end) each other's instances
        job_name = group.group_id
        previous = None
        for index, (start, end) in enumerate(bounds):
            segment = SpotSegmentOperator(
                task_id=f"segment_{index:03d}",
                command=argv,
                checkpoint_uri=checkpoint_uri,
                start_step=start,
                end_step=end,
                total_steps=total_steps,
                segment_index=index,
                job_name=job_name,
                gpus=gpu_request,
                backend=backend,
                backend_options=backend_options,
                market_options=market_options,
                env=env,
                cwd=cwd,
                warm_start_uri=warm_start_uri,
                deadline=deadline,
                max_preemptions=max_preemptions,
                code_retries=retries,
                retries=max_preemptions + retries,
                retry_delay=retry_delay,
                aws_conn_id=aws_conn_id,
                **options,
                **task_kwargs,
            )
            if previous is not None:
                previous >> segment
            previous = segment
        finish = SpotJobSummaryOperator(
            task_id="finish",
            checkpoint_uri=checkpoint_uri,
            job_name=job_name,
            total_steps=total_steps,
            segments=len(bounds),
            backend=backend,
            backend_options=backend_options,
            aws_conn_id=aws_conn_id,
            availability_uri=options.get("availability_uri"),
            market_options=market_options,
            deadline=deadline,
            **task_kwargs,
        )
        previous >> finish
    _check_own_job_root(finish)
    return group


def _check_own_job_root(finish: SpotJobSummaryOperator) -> None:
    """Refuse a second job of one DAG on the same ``checkpoint_uri``: its segments would skip or resume on
    the other job's checkpoints, and each finish task would bill both jobs' attempts."""
    try:
        tasks = finish.dag.tasks
    except RuntimeError:  # outside a DAG there is nothing to compare with
        return
    for task in tasks:
        if isinstance(task, SpotJobSummaryOperator) and task is not finish \
                and task.checkpoint_uri == finish.checkpoint_uri:
            raise SpotTrainingConfigError(
                f"checkpoint_uri {finish.checkpoint_uri!r} is also the root of job {task.job_name!r} in this DAG: "
                "two jobs in one store would train on each other's checkpoints and bill each other's attempts; "
                f"give each its own root, e.g. {finish.checkpoint_uri.rstrip('/')}/{finish.job_name}")
