"""What :class:`~airflow_spot.operators.segment.SpotSegmentOperator` sends with an attempt and prices it by: the
segment request the instance reads, the command's checks before anything is launched, where the checkpoint
store is and what a transfer from it costs, when the attempt's bill starts, the restart the deadline rule
budgets and the step time it takes before the job has measured its own. A mixin of the operator (it uses its
arguments and ``hook``)."""
from __future__ import annotations

import os
from typing import Any

from airflow.sdk.exceptions import AirflowFailException

from airflow_spot.backends.base import InstanceInfo, backend_class
from airflow_spot.operators import planning
from airflow_spot.operators.attempt_record import AttemptLaunch
from airflow_spot.operators.restart_budget import RestartBudget, read_fresh_start_beats, restart_budget
from airflow_spot.policy.transfer import TransferCost, saves_per_hour, transfer_cost
from airflow_spot.storage.checkpoint import DIGEST_ENV, digest_setting
from airflow_spot.storage.manifest import Manifest
from airflow_spot.storage.object_store import ObjectStore, error_code, store_errors
from airflow_spot.storage.protocol import SchemaError, SegmentRequest

#: the restart the deadline rule budgets before the job or its deployment has measured one
DEFAULT_RESTART_SECONDS = 600.0


class SegmentRequestParts:
    """The segment request, its checks and the costs the plan prices (see the module doc)."""

    def _checkpoint_transfer(self, store: ObjectStore, newest: Manifest | None,
                             step_seconds: float | None) -> tuple[str | None, TransferCost]:
        """The store's region and what an instance outside it pays: a new one its restore, any one its saves
        written back, one a segment at the measured step time. The plan prices both; the launch's ledger row
        carries them, as the replay charges them."""
        region = self.checkpoint_region
        if region == "auto":
            try:
                region = store.region()
            except store_errors() as exc:
                if error_code(exc) not in ("AccessDenied", "403"):
                    raise  # a store that does not answer: this try fails and is retried
                raise AirflowFailException(
                    f"checkpoint_region='auto' needs the region of {store.uri}, and S3 refused to say ({exc}): "
                    "allow s3:GetBucketLocation on the bucket to the connection's role, or give the region "
                    "itself, e.g. segment_options={'checkpoint_region': 'us-east-1'}") from exc
            if region is None:
                self.log.info("checkpoint_region='auto': the store %s has no region; transfers are not priced",
                              store.uri)
        if region is None:
            return None, TransferCost()
        cost = transfer_cost(newest.size if newest else None, seconds=self.transfer_seconds,
                             dollars=self.transfer_dollars, seconds_per_gib=self.transfer_seconds_per_gib,
                             dollars_per_gib=self.transfer_dollars_per_gib,
                             saves_per_hour=saves_per_hour(self.end_step - self.start_step, step_seconds))
        self.log.info("checkpoint store in %s: a new instance elsewhere pays %.0f s and $%.4f of restore, and "
                      "$%.4f an hour of saves back (newest checkpoint %s)", region, cost.seconds, cost.dollars,
                      cost.dollars_per_hour, f"{newest.size / 2**30:.2f} GiB" if newest else "none yet")
        return region, cost

    @staticmethod
    def _billed_from(instance: InstanceInfo, reused: bool, rows: list, requested_at: float) -> float:
        """A new instance is billed from its launch; a warm one continues its bill where its last attempt's
        ledger row ended, so the idle time between segments is paid by the next attempt. (Within the launch's
        60 s minimum, which its first attempt paid, that bills a few seconds twice; starting the bill after
        the minimum instead would bill, and so credit against on-demand, none of that attempt's work.)"""
        if not reused:
            return instance.launched_at or requested_at
        ends = [r.ended_at for r in rows if r.instance_id == instance.instance_id]
        return min(max(ends), requested_at) if ends else requested_at

    def _check_command(self) -> None:
        if isinstance(self.command, (list, tuple)):  # a DAG rendering native objects makes "{{ params.n }}" a number
            self.command = [str(a) if isinstance(a, (int, float)) and not isinstance(a, bool) else a
                            for a in self.command]
        if not self.command or not all(isinstance(a, str) and a for a in self.command):
            raise AirflowFailException(f"command must be a non-empty list of strings (as rendered), got "
                                       f"{self.command!r}")
        for where, value in (("this Airflow worker's environment", os.environ.get(DIGEST_ENV)),
                             ("the operator's env=", self.env.get(DIGEST_ENV))):
            try:  # before an attempt is recorded or an instance launched with it, as _request sends it
                digest_setting(None if value is None else str(value))
            except ValueError as exc:
                raise AirflowFailException(f"{exc} (set in {where})") from None
        # What the backend can check before an instance starts (local: the program is on PATH here).
        problem = backend_class(self.backend).command_problem(self.command)
        if problem:
            raise AirflowFailException(problem)

    def _request(self, attempt_id: str, requested_at: float, plan: planning.Plan) -> SegmentRequest:
        env = {str(k): str(v) for k, v in self.env.items()}
        env.update(self.hook.instance_env(self.checkpoint_uri))
        if DIGEST_ENV in self.env:  # a task's own setting wins over the workers'
            env[DIGEST_ENV] = digest_setting(str(self.env[DIGEST_ENV]))
        return SegmentRequest(
            attempt_id=attempt_id,
            job_uri=self.hook.get_store(self.checkpoint_uri).uri,
            segment_index=self.segment_index,
            start_step=self.start_step,
            end_step=self.end_step,
            command=list(self.command),
            env=env,
            cwd=self.cwd,
            created_at=requested_at,
            mtbf_seconds=plan.mtbf_seconds,
            min_interval_seconds=self.checkpoint_min_interval,
            max_interval_seconds=self.checkpoint_max_interval,
            keep_checkpoints=self.keep_checkpoints,
            notice_window_seconds=(self.notice_window_seconds if self.notice_window_seconds is not None
                                   else getattr(self.hook.get_backend(), "notice_window_seconds", None)),
            warm_start_uri=self.warm_start_uri or None,
            total_steps=self.total_steps,
            warm_process=self.warm_process,
        )

    @staticmethod
    def _throughput_of(store, attempt_id: str) -> float | None:
        """The relative throughput of the instance an attempt ran on (its launch record's offer)."""
        try:
            launch = AttemptLaunch.read(store, attempt_id)
        except (SchemaError, ValueError, TypeError, KeyError):  # an unreadable record: the pace counts as measured
            return None
        return launch.offer_obj.relative_throughput if launch is not None else None

    def _restart_budget(self, store, rows) -> RestartBudget:
        """The restart the deadline rule budgets: the DAG's figure, else the job's measured start-up
        (``operators/restart_budget.py``)."""
        from airflow_spot.storage.overhead_history import job_name, prior_for

        if self.restart_overhead_seconds is not None:
            return restart_budget((), {}, declared=self.restart_overhead_seconds, default=DEFAULT_RESTART_SECONDS)
        return restart_budget(rows, read_fresh_start_beats(store, rows), declared=None, default=DEFAULT_RESTART_SECONDS,
                              prior=lambda: prior_for(store, exclude_job=job_name(store.uri)))

    def _step_profile(self, store, measured: bool) -> dict[str, Any]:
        """The step time per GPU model the deadline rule takes before the job has measured its own: the
        declared ``step_profile``, else what this DAG's last finished run of the job measured."""
        declared = self.spot_job.get("step_profile") or None
        if declared or measured:
            return {"step_profile": declared}
        from airflow_spot.storage.overhead_history import earlier_pace
        from airflow_spot.market.throughput import RELATIVE_THROUGHPUT_PER_GPU

        earlier = {gpu: s for gpu, s in earlier_pace(store, self.dag_id, self.job_name).items()
                   if gpu in RELATIVE_THROUGHPUT_PER_GPU}
        if not earlier:
            return {"step_profile": None}
        return {"step_profile": earlier, "profile_source": "this DAG's earlier run"}
