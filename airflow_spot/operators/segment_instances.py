"""How a segment gets its instance: the job's warm ones, a move to a cheaper pool, or a launch down the ranked offers.

A mixin of :class:`~airflow_spot.operators.segment.SpotSegmentOperator` (it uses the operator's ``hook``,
``log``, ``task_id``, ``segment_index``, ``_tags`` and launch settings): kept apart so the operator's module
holds the task's flow (execute, defer, execute_complete) and this one what it asks of the backend.
"""
from __future__ import annotations

import time
from dataclasses import replace
from typing import TYPE_CHECKING

from airflow.sdk.exceptions import AirflowFailException

from airflow_spot.backends.base import InstanceInfo, InstanceState, LaunchError, LaunchSpec, launch_token
from airflow_spot.operators import accounting, planning
from airflow_spot.operators.instance_tags import TAG_TASK
from airflow_spot.operators.segment_errors import NoCapacityNow
from airflow_spot.policy.ledger import LedgerRow
from airflow_spot.policy.offers import Market
from airflow_spot.storage.ledger_store import LedgerStore
from airflow_spot.storage.object_store import ObjectStore, StoreConfigError, store_errors
from airflow_spot.storage.protocol import JobLayout, Outcome, SchemaError, safe_id

if TYPE_CHECKING:
    from airflow.sdk import Context

#: pause before asking a launch again after a transient error (throttling, a 5xx, a lost reply)
TRANSIENT_RETRY_SECONDS = 2.0


class SegmentInstances:
    """The instance side of a segment: find, reuse, launch, let go (and bill what is let go)."""

    def _warm_instances(self, context: Context, store: ObjectStore | None = None,
                        rows: list | None = None) -> list[InstanceInfo]:
        """The job's instances that are running, have no preemption notice and are not busy: an instance
        asked to run an attempt that has no status and no ledger row yet still runs it (its try's record
        was lost), and a request given to it now would queue behind that one (``_busy``)."""
        alive = [
            i for i in self.hook.get_backend().list_instances(tags=self._tags(context))
            if not InstanceState(i.state).is_terminal() and i.notice_at is None
        ]
        if store is None or not alive:
            return alive
        rows = accounting.read_rows(store) if rows is None else rows  # the caller's read of the ledger, if any
        try:  # an agent that has exited (idle timeout) serves no request, though its instance still shuts down
            exited = set(JobLayout(store).agent_exits(i.instance_id for i in alive))
        except (SchemaError, *store_errors()) as exc:
            self.log.warning("agents' exits not read (%s); the instances count as warm", exc)
            exited = set()
        if exited:
            self.log.info("instances %s are shutting down (their agent exited): not reused", sorted(exited))
            alive = [i for i in alive if i.instance_id not in exited]
            if not alive:
                return alive
        busy = self._busy(store, [i.instance_id for i in alive], rows)
        killed = self._killed(store, sorted(busy), rows) if busy else set()
        if busy - killed:
            self.log.warning("instances %s still run an attempt nobody has accounted for: not reused, not "
                             "terminated here (the finish task or their idle timeout ends them)", sorted(busy - killed))
        if killed:  # the kill's termination failed: its attempt would train on beside this segment's
            self.log.warning("instances %s still run an attempt whose task was killed: terminating them again",
                             sorted(killed))
            try:
                self.hook.get_backend().terminate(sorted(killed))
            except Exception as exc:  # noqa: BLE001 - never reused either way; reap and the finish task retry
                self.log.warning("could not terminate %s (%s)", sorted(killed), exc)
        # an instance whose attempt was preempted or lost is on its way out (its termination may have failed)
        taken = {r.instance_id for r in rows if r.outcome in (Outcome.PREEMPTED.value, Outcome.LOST.value)}
        taken = {i.instance_id for i in alive} & taken - busy
        if taken:
            self.log.warning("instances %s lost an attempt and still run: terminating them again", sorted(taken))
            try:
                self.hook.get_backend().terminate(sorted(taken))
            except Exception as exc:  # noqa: BLE001 - never reused either way; reap and the finish task retry
                self.log.warning("could not terminate %s (%s)", sorted(taken), exc)
        return [i for i in alive if i.instance_id not in busy | taken]

    @staticmethod
    def _busy(store: ObjectStore, instance_ids: list[str], rows=None) -> set[str]:
        layout = JobLayout(store)
        accounted = {r.attempt_id for r in (accounting.read_rows(store) if rows is None else rows)}
        busy = set()
        for instance_id in instance_ids:
            prefix = layout.request_prefix(instance_id)
            # attempt ids from the request keys' names: only unaccounted ones cost a read (of their status)
            names = [k[len(prefix):-len(".json")] for k in store.list(prefix) if k.endswith(".json")]
            if any(a not in accounted and layout.read_status(a) is None for a in names if "/" not in a):
                busy.add(instance_id)
        return busy

    @staticmethod
    def _killed(store: ObjectStore, instance_ids: list[str], rows) -> set[str]:
        """Of busy instances, those whose every unaccounted attempt without a status had its task killed
        (``JobLayout.write_kill``): nobody waits for them, and their instance should be gone."""
        layout = JobLayout(store)
        accounted = {r.attempt_id for r in rows}
        killed = set()
        for instance_id in instance_ids:
            prefix = layout.request_prefix(instance_id)
            names = [k[len(prefix):-len(".json")] for k in store.list(prefix) if k.endswith(".json")]
            running = [a for a in names if "/" not in a and a not in accounted and layout.read_status(a) is None]
            if running and all(layout.read_kill(a) is not None for a in running):
                killed.add(instance_id)
        return killed

    def _bill_probe(self, store: ObjectStore, offer, info: InstanceInfo, ended_at: float) -> None:
        """A probe that launched bills its minimum (as the simulator charges it): the job's cost holds it."""
        try:  # a malformed launch time or price must not fail the segment: only the bill would be missing
            started = float(info.launched_at if info.launched_at is not None else ended_at)
            LedgerStore(store).write_probe(LedgerRow(
                attempt_id=safe_id(self.task_id, "probe", info.instance_id), instance_id=info.instance_id,
                instance_type=offer.instance_type, zone=offer.zone, market=offer.market,
                price_per_hour=offer.price_per_hour, on_demand_price_per_hour=offer.on_demand_price_per_hour,
                started_at=started, ended_at=max(started, ended_at), steps_done=0, outcome="probe",
                region=offer.region, segment_index=self.segment_index, gpu_count=offer.gpu_count))
        except Exception as exc:  # noqa: BLE001 - the probe's answer still counts; only its bill is missing
            self.log.warning("probe %s of %s not billed in the job's cost (%s: %s)", info.instance_id, offer.pool,
                             type(exc).__name__, exc)

    def _settle_probe(self, context: Context, store, plan: planning.Plan, recorder: planning.AvailabilityRecorder,
                      now: float, replan) -> planning.Plan:
        """Cheaper pools a move waits on until they have been seen up long enough (``Plan.settle_probe``):
        probe them and plan again with what they answered; a job that may not probe (``probe_spot=False``)
        tries them as move targets after ``move_to``, as ``simulate``'s ``ours-no-probe`` does."""
        if not self.probe_spot:
            return replace(plan, move_to=plan.move_to + plan.settle_probe, settle_probe=[])
        answered = self._probe_pools(context, store, plan.settle_probe, recorder, now)
        self.log.info("probed %d cheaper spot pools a move waits on to settle", answered)
        return replan()

    def _probe_pools(self, context: Context, store, offers, recorder: planning.AvailabilityRecorder,
                     now: float) -> int:
        """:func:`planning.probe_spot` with this task's probe requests and bills; how many pools answered."""
        return planning.probe_spot(self.hook.get_backend(), offers,
                                   lambda o, k: self._probe_spec(context, store, o, now, k), recorder, now,
                                   self.log, bill=lambda o, info, ended: self._bill_probe(store, o, info, ended))

    def _probe_spec(self, context: Context, store, offer, now: float, try_number: int = 0) -> LaunchSpec:
        token = launch_token(self.dag_id, context["run_id"], self.task_id, "probe", offer.pool, int(now), try_number)
        return LaunchSpec(
            offer=offer, job_uri=store.uri, idempotency_token=token,
            tags={**self._tags(context), TAG_TASK: self.task_id}, idle_timeout_seconds=60.0,
            env=self.hook.instance_env(self.checkpoint_uri), max_price_per_hour=self.gpus.max_price_per_hour,
        )

    def _availability(self, store) -> planning.AvailabilityRecorder:
        """The job's and the deployment's availability logs (``storage/availability.py``)."""
        from airflow_spot.storage.availability import deployment_availability_uri

        uri = deployment_availability_uri(store.uri, self.availability_uri)
        try:
            deployment = self.hook.get_store(uri)
        except StoreConfigError as exc:
            self.log.warning("no deployment availability log at %s (%s); deciding from this job alone", uri, exc)
            deployment = None
        return planning.AvailabilityRecorder(store, deployment, safe_id(self.dag_id, self.job_name), self.log)

    def _get_instance(
        self, context: Context, store, plan: planning.Plan, alive: list[InstanceInfo],
        recorder: planning.AvailabilityRecorder | None = None, replan=None, rows: list[LedgerRow] = (),
    ) -> tuple[InstanceInfo, bool]:
        warm = planning.pick_warm(alive, plan)
        # make before break: leaving on-demand for spot, the warm on-demand instance stays until a spot pool
        # accepts; if every one refuses, the job stays on it (as the replay of `ours` does) instead of paying
        # a new instance's restart
        keep = next((i for i in alive if not i.offer.is_spot), None) if (
            warm is None and plan.market is Market.SPOT and replan is not None) else None
        extra = [i.instance_id for i in alive if (warm is None or i.instance_id != warm.instance_id) and i is not keep]
        if extra:  # warm instances we will not use only cost money
            self._let_go(store, extra, rows, "no longer a good offer")
        if warm is not None:
            if warm.offer.is_spot and plan.move_to:
                # make before break: the warm instance goes only once a cheaper pool has accepted
                moved, errors, _ = self._launch_first(context, store, plan.move_to, recorder, optional=True)
                if moved is not None:
                    self.log.info("moved from %s to the cheaper %s (%s)", warm.offer.pool, moved.offer.pool, plan.reason)
                    self._let_go(store, [warm.instance_id], rows, f"moved to {moved.offer.pool}")
                    return moved, False
                self.log.info("cheaper pools refused (%s); keeping the warm instance in %s", "; ".join(errors),
                              warm.offer.pool)
            return warm, True  # priced now by pick_warm
        launched, errors, unusable = self._launch_first(context, store, plan.ranked, recorder)
        if launched is not None:
            self._let_go(store, [keep.instance_id] if keep else [], rows, f"left for spot in {launched.offer.pool}")
            return launched, False
        if replan is not None and plan.market is Market.SPOT and errors:
            # every spot offer refused: decide again with those refusals (on-demand, or wait = retry later)
            again = replan()
            self.log.info("every spot offer refused; plan with the refusals: %s", again.reason)
            if again.market is Market.ON_DEMAND:
                return self._get_instance(context, store, again, [keep] if keep else [], recorder=recorder,
                                          rows=rows)
        if unusable:  # no pool refused for capacity: waiting would not help, the configuration must change
            self._let_go(store, [keep.instance_id] if keep else [], rows, "no offer can be launched")
            raise AirflowFailException("no offer of the plan can be launched with this account or configuration: "
                                       + "; ".join(errors))
        self._let_go(store, [keep.instance_id] if keep else [], rows, "no capacity now: the job waits")
        # No capacity anywhere right now: execute waits and decides again (not an Airflow try)
        raise NoCapacityNow("no offer could be launched now; tried: " + "; ".join(errors or ["no offers"]))

    def _let_go(self, store, instance_ids: list[str], rows, why: str) -> None:
        """Terminate warm instances the job will not use, and bill their idle time since their last attempt."""
        if not instance_ids:
            return
        self.log.info("terminating warm instances %s: %s", instance_ids, why)
        self.hook.get_backend().terminate(instance_ids)
        accounting.bill_idle(store, instance_ids, list(rows), time.time(), accounting.billing_market(self.hook))

    def _launch_first(
        self, context: Context, store, offers, recorder: planning.AvailabilityRecorder | None,
        optional: bool = False,
    ) -> tuple[InstanceInfo | None, list[str], bool]:
        """Launch the first of ``offers`` that has capacity; the capacity refusals, recorded as pool events.
        ``optional`` (a move, with a warm instance to fall back on): an offer that cannot be launched for
        another reason than capacity (a region's configuration) is skipped with a warning instead of
        failing the task. An offer this account cannot launch (a quota, no subnet in its zone) is skipped,
        not learnt as a refusal; the third value says every offer tried was such a one."""
        backend = self.hook.get_backend()
        ti = context["ti"]
        errors = []
        unusable = 0
        for offer in offers:
            # hashed: EC2's ClientToken holds 64 characters, dag/run/task ids can be far longer; the market
            # too: a try that falls back to on-demand in a pool whose spot launch it tried asks anew
            token = launch_token(self.dag_id, context["run_id"], self.task_id, f"try{ti.try_number}", offer.pool,
                                 Market(offer.market).value)
            spec = LaunchSpec(
                offer=offer,
                job_uri=store.uri,
                idempotency_token=token,
                tags={**self._tags(context), TAG_TASK: self.task_id},
                idle_timeout_seconds=self.idle_timeout_seconds,
                env=self.hook.instance_env(self.checkpoint_uri),
                max_price_per_hour=self.gpus.max_price_per_hour,
            )
            try:
                try:
                    launched = backend.launch(spec)
                except LaunchError as first:
                    if not getattr(first, "transient", False):
                        raise
                    # once more with the same token, which EC2 answers with the instance a call whose reply
                    # was lost did launch (a describe may not show it yet), or launches it now
                    self.log.warning("%s (%s): %s; asking once more", offer.pool, offer.market, first)
                    time.sleep(TRANSIENT_RETRY_SECONDS)
                    launched = backend.launch(spec)
            except LaunchError as exc:
                if getattr(exc, "transient", False):
                    # throttled, a 5xx, a network error: nothing to fix and no capacity learnt; the next
                    # offer, and when none launches, the capacity wait decides again (not an Airflow try)
                    self.log.warning("%s (%s) could not be launched now: %s; trying the next offer", offer.pool,
                                     offer.market, exc)
                    errors.append(f"{offer.pool} {offer.market}: {exc}")
                    continue
                if getattr(exc, "unusable", False):  # the next offer may launch; no pool is full
                    self.log.warning("cannot launch %s (%s): %s; trying the next offer", offer.pool, offer.market, exc)
                    errors.append(f"{offer.pool} {offer.market}: {exc}")
                    unusable += 1
                    continue
                if not exc.capacity and not optional:
                    raise AirflowFailException(f"cannot launch {offer.instance_type} in {offer.zone}: {exc}") from exc
                if not exc.capacity:
                    self.log.warning("cannot move to %s (%s): %s; fix it to let the job use that pool", offer.pool,
                                     offer.market, exc)
                    errors.append(f"{offer.pool} {offer.market}: {exc}")
                    continue
                self.log.warning("no capacity for %s (%s): %s; trying the next offer", offer.pool, offer.market, exc)
                errors.append(f"{offer.pool} {offer.market}: {exc}")
                if recorder is not None and offer.is_spot:  # a capacity refusal is an observation
                    recorder.record(offer.pool, "refused", time.time())
                continue
            if recorder is not None and offer.is_spot:
                recorder.record(offer.pool, "launched", time.time())
            return launched, errors, False
        return None, errors, bool(errors) and unusable == len(errors)
