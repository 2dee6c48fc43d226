"""A read-only view of one job in its store: attempts, ledger rows, checkpoints, heartbeats, summary, totals.

The operators, the trigger, the finish task and the UI plugin all read a job through this class, so each
question ("how many preemptions since the budget started?", "what has the job cost?", "where does it
stand?") has one answer. It never writes. Keys come from :class:`~airflow_spot.storage.protocol.JobLayout`;
the billing maths from :mod:`airflow_spot.policy.ledger`; the online estimate from
:mod:`airflow_spot.policy.estimate`. No Airflow import: the UI plugin and the instance side can both use it.

This module holds the reads of the store; what is computed from the records once read lives beside it: one
attempt and its pace in :mod:`airflow_spot.storage.attempt_view`, the money figures, a finished job's
headline and the log line in :mod:`airflow_spot.storage.job_figures`. Their names are imported here too, so
``from airflow_spot.storage.job_view import ...`` finds them as before.
"""
from __future__ import annotations

import json
import logging
import statistics
from collections.abc import Iterable
from typing import Any

from airflow_spot.policy.estimate import estimate_remaining, measure_overheads, robust_step_seconds
from airflow_spot.policy.ledger import AWS_MINIMUM_BILLED_SECONDS, LedgerRow, summarize
from airflow_spot.storage.attempt_view import (  # noqa: F401 - _not_a_number: re-exported
    AttemptView, _checkpoint_marks, _malformed_launch, _mtbf, _not_a_number, _pace, _paces, _steady_window,
)
from airflow_spot.storage.job_figures import (  # noqa: F401 - those not used here: re-exported
    FINAL_FIELDS, _clock, _dollars, _live_credit, _useful_seconds, final_figures, finished_state, money_figures,
    progress_line, summary_stands,
)
from airflow_spot.storage.ledger_store import LEDGER_PREFIX, LedgerStore
from airflow_spot.storage.object_store import ObjectNotFound, ObjectStore
from airflow_spot.storage.overhead_history import job_name, prior_for
from airflow_spot.storage.protocol import (
    AttemptStatus, Heartbeat, JobLayout, LivePrice, Outcome, SchemaError, SegmentRequest, safe_id,
)

log = logging.getLogger(__name__)


class JobView:
    """Read one job's objects. :param store: the job's root store (the ``checkpoint_uri``)."""

    def __init__(self, store: ObjectStore) -> None:
        self.store = store
        self.layout = JobLayout(store)
        self._prior: dict[str, float] | None = None
        #: objects a read found but could not decode, ``{"key", "error"}`` (they are left out of what it
        #: returns); :meth:`snapshot` starts it afresh and returns it as ``unreadable``
        self.unreadable: list[dict[str, str]] = []

    def _note_unreadable(self, key: str, error: object) -> None:
        entry = {"key": key, "error": str(error)}
        if entry not in self.unreadable:
            self.unreadable.append(entry)

    @property
    def uri(self) -> str:
        return self.store.uri

    # ------------------------------------------------------------------ raw objects
    def _json(self, key: str) -> dict[str, Any] | None:
        try:
            data = json.loads(self.store.get_bytes(key))
        except ObjectNotFound:
            return None
        except ValueError as exc:
            log.warning("%s/%s is not JSON (%s); ignored", self.uri, key, exc)
            self._note_unreadable(key, f"not JSON: {exc}")
            return None
        if not isinstance(data, dict):
            self._note_unreadable(key, f"not a JSON object: {type(data).__name__}")
            return None
        return data

    def job_record(self) -> dict[str, Any] | None:
        """``control/job.json``: the job's start and deadline-policy state (None before the first attempt)."""
        return self._json(JobLayout.JOB_KEY)

    def summary(self) -> dict[str, Any] | None:
        """The finish task's job summary, or None while the job has not finished."""
        return self._json(JobLayout.SUMMARY_KEY)

    def attempt_ids(self) -> list[str]:
        ids = {k[len(JobLayout.ATTEMPTS_PREFIX):].split("/", 1)[0] for k in self.store.list(JobLayout.ATTEMPTS_PREFIX)}
        return sorted(i for i in ids if i)

    def launches(self, listing: list[str] | None = None) -> dict[str, dict[str, Any]]:
        out = {}
        keys = JobLayout.attempt_keys(self.store, JobLayout.LAUNCH_NAME, listing)
        for key, raw in self.store.get_many(keys).items():
            try:
                data = json.loads(raw)
            except ValueError as exc:
                log.warning("%s/%s is not JSON (%s); ignored", self.uri, key, exc)
                self._note_unreadable(key, f"not JSON: {exc}")
                continue
            if not isinstance(data, dict) or not isinstance(data.get("attempt_id"), str) or not data["attempt_id"]:
                self._note_unreadable(key, "not a launch record (no attempt_id)")
                continue
            bad = _malformed_launch(data)
            if bad:
                self._note_unreadable(key, bad)
                continue
            out[data["attempt_id"]] = data
        return out

    def _typed(self, name: str, cls, listing: list[str] | None = None) -> dict[str, Any]:
        out = {}
        for key, raw in self.store.get_many(JobLayout.attempt_keys(self.store, name, listing)).items():
            try:
                obj = cls.from_json(raw)
            except SchemaError as exc:
                self._note_unreadable(key, exc)
                continue
            out[obj.attempt_id] = obj
        return out

    def _kills(self, listing: list[str], attempt_ids: list[str]) -> dict[str, float]:
        """The recorded kills of ``attempt_ids`` (those the listing shows a kill record for)."""
        keys = set(listing)
        layout = JobLayout(self.store)
        out = {}
        for aid in attempt_ids:
            if JobLayout.killed_key(aid) in keys and (at := layout.read_kill(aid)) is not None:
                out[aid] = at
        return out

    def statuses(self, listing: list[str] | None = None) -> dict[str, AttemptStatus]:
        return self._typed(JobLayout.STATUS_NAME, AttemptStatus, listing)

    def heartbeats(self, listing: list[str] | None = None) -> dict[str, Heartbeat]:
        return self._typed(JobLayout.HEARTBEAT_NAME, Heartbeat, listing)

    def live_prices(self, listing: list[str] | None = None) -> dict[str, LivePrice]:
        """Running attempts' prices so far, where their market keeps a price history (the trigger's)."""
        return self._typed(JobLayout.PRICE_NAME, LivePrice, listing)

    def requests(self) -> list[SegmentRequest]:
        """Every segment request of the job (all instances), oldest first."""
        out: list[SegmentRequest] = []
        keys = [k for k in self.store.list("control/instances/") if "/requests/" in k and k.endswith(".json")]
        for key, raw in self.store.get_many(keys).items():
            try:
                out.append(SegmentRequest.from_json(raw))
            except SchemaError as exc:
                self._note_unreadable(key, exc)
                continue
        return sorted(out, key=lambda r: (r.created_at, r.attempt_id))

    def ledger_rows(self) -> list[LedgerRow]:
        """Every ledger row; a row that does not decode raises ``ValueError`` naming its key. What the
        operators count (:meth:`count`, budgets) reads this: a row it cannot read must stop it, not be
        counted as no row."""
        return LedgerStore(self.store).rows()

    def probe_rows(self) -> list[LedgerRow]:
        """The bills of the job's probes (``LedgerStore.write_probe``); one that does not decode is left out
        and noted in :attr:`unreadable` (no budget reads probes)."""
        rows, bad = LedgerStore(self.store).probe_rows()
        for key, error in bad:
            log.warning("probe row %s/%s left out: %s", self.uri, key, error)
            self._note_unreadable(key, error)
        return rows

    def idle_rows(self) -> list[LedgerRow]:
        """The bills of the job's warm instances after their last attempt (``LedgerStore.write_idle``), as
        :meth:`probe_rows`."""
        rows, bad = LedgerStore(self.store).idle_rows()
        for key, error in bad:
            log.warning("idle row %s/%s left out: %s", self.uri, key, error)
            self._note_unreadable(key, error)
        return rows

    def readable_ledger_rows(self) -> list[LedgerRow]:
        """Every ledger row that decodes, ordered as :meth:`ledger_rows` orders them; each one that does not
        is left out and noted in :attr:`unreadable`. For showing a job (:meth:`snapshot` with
        ``skip_unreadable``), never for counting against a budget."""
        ledger = LedgerStore(self.store)
        keys = [k for k in self.store.list(LEDGER_PREFIX) if k.endswith(".json")]
        out = []
        for key, raw in self.store.get_many(keys).items():
            try:
                out.append(ledger._decode(key, raw))
            except Exception as exc:  # noqa: BLE001 - JSON that is no object fails as AttributeError too
                log.warning("ledger row %s/%s left out of the view: %s", self.uri, key, exc)
                self._note_unreadable(key, exc)
        return sorted(out, key=lambda r: (r.started_at, r.attempt_id))

    def checkpoint_statuses(self) -> list[Any]:
        """Every checkpoint directory with a manifest, oldest first, its manifest verified
        (:meth:`CheckpointStore.scan <airflow_spot.storage.checkpoint.CheckpointStore.scan>`)."""
        return self.layout.checkpoint_store().scan()

    def checkpoints(self, statuses: list[Any] | None = None) -> list[dict[str, Any]]:
        """Committed checkpoints, oldest first: step, time, size in bytes, writer, save seconds (those whose
        manifest verifies; ``statuses`` as :meth:`checkpoint_statuses` returns them, read when not given)."""
        if statuses is None:
            committed = self.layout.checkpoint_store().committed()
        else:
            committed = [s.manifest for s in statuses if s.ok]
        return [
            {"step": m.step, "time": m.created_at, "size": m.size, "writer": m.writer,
             "save_seconds": m.save_seconds}
            for m in sorted(committed, key=lambda m: (m.step, m.created_at))
        ]

    @staticmethod
    def broken_checkpoints(statuses: list[Any]) -> list[dict[str, Any]]:
        """The checkpoints of ``statuses`` whose manifest does not verify (``airflow-spot checkpoints list``
        shows them ``BROKEN``): step, directory, what is wrong. A resume skips them."""
        return [{"step": s.step, "directory": s.directory, "problem": s.problem or "its manifest does not verify"}
                for s in statuses if not s.ok]

    def latest_step(self) -> int | None:
        return self.layout.latest_step()

    # ------------------------------------------------------------------ ledger questions
    def count(self, outcomes: Iterable[Outcome], segment_index: int | None = None, since: float | None = None) -> int:
        """Ledger rows with one of ``outcomes`` (of one segment, if given) that ended at or after ``since``."""
        wanted = {Outcome(o).value for o in outcomes}
        return sum(
            1 for r in self.ledger_rows()
            if r.outcome in wanted
            and (segment_index is None or r.segment_index == segment_index)
            and (since is None or r.ended_at >= since)
        )

    def totals(self, now: float, rows: list[LedgerRow] | None = None, probes: list[LedgerRow] | None = None,
               idle: list[LedgerRow] | None = None) -> dict[str, Any]:
        """Ledger totals plus the counts and times the finish task, the demo and the UI show (``rows``,
        ``probes``, ``idle``: the bills, read here when not given)."""
        rows = self.ledger_rows() if rows is None else rows
        out = summarize(rows, self.probe_rows() if probes is None else probes,
                        self.idle_rows() if idle is None else idle).to_dict()
        started = min((r.started_at for r in rows), default=now)
        out.update(
            lost=sum(r.outcome == Outcome.LOST.value for r in rows),
            failures=sum(r.outcome == Outcome.FAILED.value for r in rows),
            abandoned=sum(r.outcome == Outcome.ABANDONED.value for r in rows),
            # time spent on steps that were kept (the goodput numerator)
            useful_step_seconds=round(sum(r.steps_done * (r.step_seconds or 0.0) for r in rows), 3),
            wall_seconds=round(max(0.0, max((r.ended_at for r in rows), default=now) - started), 3),
            rows=[r.to_dict() for r in rows],
        )
        return out

    # ------------------------------------------------------------------ the timeline
    def attempts(self, now: float, checkpoints: list[dict[str, Any]] | None = None,
                 ledger: list[LedgerRow] | None = None) -> list[AttemptView]:
        """Every attempt of the job, oldest first, merged from launch record, status, heartbeat and ledger
        (and its committed checkpoints, for its pace past the warm-up: ``checkpoints`` as
        :meth:`checkpoints` returns them, read here when not given; ``ledger``: its rows, read when not given)."""
        listing = self.store.list(JobLayout.ATTEMPTS_PREFIX)  # one listing for the four kinds of object
        launches, statuses, beats = self.launches(listing), self.statuses(listing), self.heartbeats(listing)
        live = self.live_prices(listing)
        rows = {r.attempt_id: r for r in (self.ledger_rows() if ledger is None else ledger)}
        checkpoints = self.checkpoints() if checkpoints is None else checkpoints
        marks = _checkpoint_marks(checkpoints)
        writes_by = {c["writer"]: c["save_seconds"] for c in sorted(checkpoints, key=lambda c: c["time"] or 0.0)
                     if c.get("writer") and c.get("save_seconds") is not None}
        killed = self._kills(listing, [a for a in statuses if a not in rows])
        out = []
        for aid in sorted(set(launches) | set(rows) | set(statuses)):
            launch, st, hb, row = launches.get(aid, {}), statuses.get(aid), beats.get(aid), rows.get(aid)
            offer = launch.get("offer") or {}
            started = row.started_at if row else launch.get("billed_from") or (st.started_at if st else None)
            ended = row.ended_at if row else (st.ended_at if st else None)
            outcome = row.outcome if row else (st.outcome if st else "running")
            if row is None and st is not None and not st.before_kill(killed.get(aid), launch.get("end_step")):
                # the status its kill brought about, before anyone billed it: billed abandoned, to the kill
                outcome, ended = Outcome.ABANDONED.value, min(ended, killed[aid])
            # a running attempt is priced as its market's history had it at the trigger's last read, else
            # at its launch; its ledger row then bills the whole run, and an ended one is priced to its end
            # until its row lands (as the row will bill it: a new instance's minimum included)
            price = row.price_per_hour if row else (
                live[aid].price_per_hour if aid in live else offer.get("price_per_hour"))
            running = outcome == "running"
            until = now if running else ended
            minimum = 0.0 if running or launch.get("reused_instance", True) else AWS_MINIMUM_BILLED_SECONDS
            billed = row.billed_seconds if row else (
                None if started is None or until is None else round(max(until - started, minimum, 0.0), 3))
            cost = row.cost if row else (billed / 3600.0 * price if billed is not None and price is not None else None)
            resume = launch.get("resume_step")
            # the writer id its checkpoints carry (CheckpointStore's: the attempt id made key-safe)
            writer = safe_id(aid)
            steady, warmup, steady_steps = _steady_window(hb, marks.get(writer, []))
            writes = writes_by.get(writer)
            out.append(AttemptView(
                attempt_id=aid,
                segment_index=row.segment_index if row else launch.get("segment_index"),
                instance_id=row.instance_id if row else launch.get("instance_id"),
                instance_type=row.instance_type if row else offer.get("instance_type"),
                zone=row.zone if row else offer.get("zone"),
                market=row.market if row else offer.get("market"),
                price_per_hour=price,
                on_demand_price_per_hour=row.on_demand_price_per_hour if row else offer.get("on_demand_price_per_hour"),
                started_at=started,
                ended_at=ended,
                outcome=outcome,
                resume_step=resume,
                end_step=launch.get("end_step"),
                current_step=hb.step if hb else None,
                steps_done=row.steps_done if row else (max(0, hb.step - resume) if hb and resume is not None else None),
                steps_lost=row.steps_lost if row else None,
                cost=cost,
                step_seconds=row.step_seconds if row and row.step_seconds else (hb.step_time_ewma if hb else None),
                new_instance=(row.new_instance if row
                              else (not launch.get("reused_instance", False) if launch else None)),
                notice_at=row.notice_at if row else (hb.notice_at if hb and outcome == "running" else None),
                last_beat_at=hb.time if hb else None,
                save_seconds=hb.save_cost_seconds if hb else None,
                first_step_at=hb.first_step_at if hb else None,
                pace_seconds=_pace(hb),
                pace_steps=(hb.step - hb.first_step) if hb and hb.first_step is not None else 0,
                steady_seconds=steady,
                steady_steps=steady_steps,
                warmup_seconds=warmup,
                beat_step=hb.step if hb else None,
                write_seconds=writes,
                billed_seconds=billed,
            ))
        return sorted(out, key=lambda a: (a.started_at if a.started_at is not None else float("inf"), a.attempt_id))

    def progress_series(self, attempts: list[AttemptView], checkpoints: list[dict[str, Any]], now: float,
                        bills: Iterable[LedgerRow] = ()) -> list[dict]:
        """Points ``(time, committed step, cost so far)`` for the chart: one per checkpoint, attempt start and
        end, and other bill's start and end (``bills``: idle and probe rows, which the job's cost holds too).

        Cost between points grows with the attempts that were running then (each billed from its start) and
        with each other bill over its own time, so that a finished job's last point is its cost.
        """
        bills = [b for b in bills if b.ended_at >= b.started_at]
        times = sorted({c["time"] for c in checkpoints} | {a.ended_at for a in attempts if a.ended_at}
                       | {a.started_at for a in attempts if a.started_at} | ({now} if any(
                           a.outcome == "running" for a in attempts) else set())
                       | {b.started_at for b in bills} | {b.ended_at for b in bills})
        points = []
        # retention prunes old checkpoints, so progress also comes from each ended attempt's kept steps
        kept = [(a.ended_at, (a.resume_step or 0) + (a.steps_done or 0)) for a in attempts
                if a.ended_at is not None and a.outcome != "running"]
        for t in times:
            step = max([c["step"] for c in checkpoints if c["time"] <= t] + [s for e, s in kept if e <= t] + [0])
            cost = 0.0
            for a in attempts:
                if a.started_at is None or a.price_per_hour is None or a.started_at > t:
                    continue
                if a.ended_at is not None and a.ended_at <= t:
                    cost += a.cost or 0.0
                else:
                    cost += (t - a.started_at) / 3600.0 * a.price_per_hour
            for b in bills:
                if b.started_at <= t:
                    span = b.ended_at - b.started_at
                    cost += b.cost if t >= b.ended_at or span <= 0 else b.cost * (t - b.started_at) / span
            points.append({"time": t, "step": step, "cost": round(cost, 6)})
        return points

    # ------------------------------------------------------------------ everything, for the UI

    def measured_step_profile(self) -> dict[str, float]:
        """Seconds per step per GPU model this job's attempts measured (the median of their ledger rows'
        step times, by the GPU of the offer each was launched on); empty before any step was timed."""
        launches = self.launches()
        seen: dict[str, list[float]] = {}
        for row in self.ledger_rows():
            offer = (launches.get(row.attempt_id) or {}).get("offer") or {}
            gpu = offer.get("gpu_name") if isinstance(offer, dict) else None
            if row.step_seconds and row.step_seconds > 0 and row.steps_done > 0 and isinstance(gpu, str) and gpu:
                seen.setdefault(gpu, []).append(float(row.step_seconds))
        return {gpu: statistics.median(values) for gpu, values in seen.items()}

    def measured_overheads(self, now: float) -> dict[str, float]:
        """The overheads this job measured itself (what it can teach the deployment's later jobs,
        :mod:`airflow_spot.storage.overhead_history`); empty before it has trained."""
        paces = _paces(self.attempts(now, self.checkpoints()), now)
        step = robust_step_seconds(paces)
        return measure_overheads(paces, step).measured_fields() if step else {}

    def overhead_prior(self) -> dict[str, float]:
        """What the deployment's other jobs measured (empty when there is no readable history)."""
        if self._prior is None:  # prior_for skips (and logs) a history it cannot read
            self._prior = prior_for(self.store, exclude_job=job_name(self.uri))
        return self._prior

    def snapshot(self, now: float, total_steps: int | None = None, mtbf_seconds: float | None = None,
                 with_estimate: bool = True, skip_unreadable: bool = False) -> dict[str, Any]:
        """Where the job stands: progress, cost, savings, attempts, checkpoints, chart points, estimate.

        ``unreadable`` lists the objects found but not decoded (``{"key", "error"}``: left out of the
        figures), ``broken_checkpoints`` the checkpoints whose manifest does not verify (left out of
        ``checkpoints``).

        :param with_estimate: False leaves ``estimate`` None (a list of jobs does not show it, and the
            estimate reads the deployment's overhead history).
        :param skip_unreadable: True reads the ledger with :meth:`readable_ledger_rows` (a row that does
            not decode is left out and listed in ``unreadable``: what the UI shows); False with
            :meth:`ledger_rows`, which raises on such a row.

        :param mtbf_seconds: a prior for the current pool's mean time between preemptions, when the caller
            knows one better than the operator's in the segment requests (the estimate benchmark: the
            injector's); like that one, it is blended with the preemptions the job has seen.
        """
        self.unreadable = []
        summary = self.summary()
        requests = self.requests()
        statuses = self.checkpoint_statuses()
        checkpoints = self.checkpoints(statuses)
        ledger = self.readable_ledger_rows() if skip_unreadable else self.ledger_rows()
        attempts = self.attempts(now, checkpoints, ledger)
        if summary and not summary_stands(summary, attempts):
            summary = None  # a cleared run trains on: the old summary is no final account of it
        probes, idle_bills = self.probe_rows(), self.idle_rows()
        totals = self.totals(now, ledger, probes, idle_bills)
        record = self.job_record() or {}
        if total_steps is None:
            total_steps = (summary or {}).get("total_steps") or record.get("total_steps") or next(
                (r.total_steps for r in reversed(requests) if r.total_steps), None)
        committed = max((c["step"] for c in checkpoints), default=None)
        running = [a for a in attempts if a.outcome == "running"]
        current = max([committed or 0] + [a.current_step or 0 for a in running])
        # the running attempt's cost so far belongs in "cost so far", at its price so far (AttemptView.price_per_hour),
        # and so does an ended one whose ledger row has not landed yet (priced to its end, as the row will be)
        billed_ids = {r.attempt_id for r in ledger}
        unbilled = [a for a in attempts if a.attempt_id not in billed_ids]
        live_cost = sum(a.cost or 0.0 for a in unbilled)
        # and its on-demand credit, as its row will credit it: the figures do not jump when the row lands
        live_on_demand = sum(_live_credit(a, attempts, committed) for a in unbilled)
        cost = totals["cost"] + live_cost
        on_demand = totals["on_demand_cost"] + live_on_demand
        # a finished job's headline is the finish task's final account, as the list shows it
        final = (final_figures(summary) if summary else None) or {}
        if summary:
            state = finished_state(summary)
        else:
            state = "running" if running else ("waiting" if attempts else "not started")
        segment_ends = sorted({r.end_step for r in requests})
        estimate = None
        if total_steps and with_estimate:
            paces = _paces(attempts, now)
            ended = [a.ended_at for a in attempts if a.ended_at is not None]
            idle = max(0.0, now - max(ended)) if ended and not running else 0.0
            # the progress read is the running attempt's heartbeat's: it trained on since that beat
            beat_age = (max(0.0, now - running[-1].last_beat_at)
                        if running and running[-1].last_beat_at is not None and running[-1].notice_at is None
                        and running[-1].beat_step is not None and running[-1].beat_step >= current else 0.0)
            mtbf = _mtbf(requests, attempts, now, mtbf_seconds)
            offer_price = running[-1].price_per_hour if running else (attempts[-1].price_per_hour if attempts else None)
            segments_left = sum(1 for end in segment_ends if end > current) - (1 if running else 0)
            if segment_ends and segment_ends[-1] < total_steps:  # segments not requested yet
                per = max(1, segment_ends[0] - (requests[0].start_step if requests else 0))
                segments_left += -(-(total_steps - max(segment_ends[-1], current)) // per)
            estimate = estimate_remaining(
                paces, done_steps=min(current, total_steps), total_steps=total_steps,
                segments_left=max(0, segments_left), mtbf_seconds=mtbf, price_per_hour=offer_price,
                idle_seconds=idle, beat_age_seconds=beat_age,
                notice_window_seconds=requests[-1].notice_window_seconds if requests else 0.0,
                prior=self.overhead_prior(),
            ).to_dict()
        return {
            "job_uri": self.uri,
            "state": state,
            "total_steps": total_steps,
            "committed_step": committed,
            "current_step": current,
            "progress": round(min(1.0, current / total_steps), 4) if total_steps else None,
            **money_figures(cost, on_demand),
            "transfer_dollars": totals["transfer_dollars"],
            "probes": totals["probes"],
            "probe_dollars": totals["probe_dollars"],
            "idle_dollars": totals["idle_dollars"],
            "preemptions": sum(a.is_preemption for a in attempts),
            **final,
            "steps_lost": totals["steps_lost"],
            "attempts": [a.to_dict() for a in attempts],
            "checkpoints": checkpoints,
            "broken_checkpoints": self.broken_checkpoints(statuses),
            "unreadable": list(self.unreadable),
            "series": self.progress_series(attempts, checkpoints, now, probes + idle_bills),
            "estimate": estimate,
            "summary": summary,
            "gpus": record.get("gpus"),
            "backend": record.get("backend"),
        }

