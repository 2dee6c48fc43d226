"""The Airflow layer's view of the cost ledger: one row per attempt, kept in the job's store.

Rows are written by ``execute_complete`` (every outcome) and read back to count the job's preemptions and
a segment's user-code failures (the retry budgets) and to sum the job (the final task). The billing and
totals maths live in :mod:`airflow_spot.policy.ledger`, the reading and the job's totals in
:mod:`airflow_spot.storage.job_view` (the UI reads them there too); this module only builds rows from what
the attempt left behind.
"""
from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable, Iterable
from typing import Any

from airflow_spot.operators.attempt_record import AttemptLaunch
from airflow_spot.policy.ledger import AWS_MINIMUM_BILLED_SECONDS, LedgerRow, totals
from airflow_spot.storage.job_view import JobView
from airflow_spot.storage.ledger_store import LedgerStore
from airflow_spot.storage.object_store import ObjectNotFound, ObjectStore
from airflow_spot.storage.protocol import JobLayout, Outcome, SchemaError

log = logging.getLogger(__name__)


def billing_market(hook):
    """The hook's market, to price finished attempts; None (the launch price) when it cannot be built."""
    try:
        return hook.get_market()
    except Exception as exc:  # noqa: BLE001 - the row is still written, at the launch price
        log.warning("could not build the market to price the attempt (%s); billing the launch price", exc)
        return None


def billed_price(market, offer, start: float, end: float) -> float | None:
    """The $/h the attempt pays by the market's price over its run (``MarketSource.billed_price``); the
    launch price without a market; None when the market cannot say now (logged)."""
    if market is None:
        return offer.price_per_hour
    try:
        return float(market.billed_price(offer, start, end))
    except Exception as exc:  # noqa: BLE001 - a row at the launch price beats no row
        log.warning("could not read the price of %s (%s) over the attempt (%s); billing the launch price "
                    "$%.4f/h", offer.pool, getattr(offer.market, "value", offer.market), exc, offer.price_per_hour)
        return None


def record_attempt(
    store: ObjectStore,
    launch: AttemptLaunch,
    outcome: Outcome,
    event: dict[str, Any],
    *,
    steps_after: int | None,
    now: float,
    market=None,
) -> dict[str, Any]:
    """Write (idempotently: one key per attempt) and return the ledger row of one finished attempt.

    Kept progress is the job's newest checkpoint now minus where the attempt resumed; lost steps are
    the ones its last heartbeat reported beyond that checkpoint. ``market`` prices the run
    (:func:`billed_price`); without one the row keeps the launch price. When the market cannot say now,
    a row already written for the attempt keeps its price (a second write changes nothing), else the
    launch price is billed.
    """
    offer = launch.offer_obj
    ended = float(event.get("ended_at") or now)
    committed = max(steps_after if steps_after is not None else 0, launch.resume_step)
    last_step = event.get("last_step")
    ended = max(ended, launch.billed_from)
    ledger = LedgerStore(store)
    price = billed_price(market, offer, launch.billed_from, ended)
    if price is None:  # the history is out of reach now: a row written before (the trigger's) keeps its price
        try:
            earlier = ledger.read(launch.attempt_id)
        except ValueError:  # an unreadable row is rewritten whole
            earlier = None
        price = earlier.price_per_hour if earlier is not None else offer.price_per_hour
    row = LedgerRow(
        attempt_id=launch.attempt_id,
        instance_id=launch.instance_id,
        instance_type=offer.instance_type,
        zone=offer.zone,
        market=offer.market,
        price_per_hour=price,
        on_demand_price_per_hour=offer.on_demand_price_per_hour,
        started_at=launch.billed_from,
        ended_at=ended,
        steps_done=committed - launch.resume_step,
        outcome=outcome.value,
        region=offer.region,
        segment_index=launch.segment_index,
        new_instance=not launch.reused_instance,
        steps_lost=max(0, int(last_step) - committed) if last_step is not None else 0,
        gpu_count=offer.gpu_count,
        step_seconds=event.get("step_time_ewma"),
        notice_at=event.get("notice_at"),
        transfer_dollars=launch.transfer_dollars + (ended - launch.billed_from) / 3600.0 * launch.remote_dollars_per_hour,
    )
    ledger.write(row)
    return row.to_dict()


def account_abandoned(
    store: ObjectStore, launch: AttemptLaunch, *, now: float, killed_at: float | None = None, market=None,
) -> dict[str, Any] | None:
    """Write the ledger row of an attempt nobody waited for (its task killed, its try gone; see
    ``Outcome.ABANDONED``) so that its instance time is billed; None when it has a row already.

    An attempt that left a status before ``killed_at`` (when the caller ended its instance; None: it did
    not) ends as that status says: it ran to its end, only its accounting was missed. Any other ends
    ``abandoned``: at ``killed_at``, else at its last sign of life, its newest heartbeat (what its instance
    ran after that is not known here and not billed). A status the kill itself brought about (the agent
    saves and reports ``preempted`` on a termination) is no preemption. Its kept steps are the ones it
    committed itself, never a later attempt's.
    """
    ledger = LedgerStore(store)
    try:
        if ledger.read(launch.attempt_id) is not None:
            return None
    except ValueError:  # a torn row is rewritten whole
        pass
    layout = JobLayout(store)
    recorded_kill = layout.read_kill(launch.attempt_id)  # its task was killed (the trigger's or worker's on_kill)
    status, hb = _readable(layout.read_status, launch.attempt_id), _readable(layout.read_heartbeat, launch.attempt_id)
    own_end = status is not None and status.outcome in {o.value for o in Outcome}
    if own_end and not status.completed_through(launch.end_step):
        # before any recorded kill (the agent's word, else the clocks); the caller's own termination is placed
        # by the clocks only when the agent has not answered a recorded kill (a caller records its kill first)
        answered = recorded_kill is not None and status.kill_seen is not None
        own_end = status.before_kill(recorded_kill) and (answered or killed_at is None or status.ended_at < killed_at)
    if recorded_kill is not None:
        killed_at = recorded_kill if killed_at is None else min(killed_at, recorded_kill)
    if own_end:
        outcome, end = Outcome(status.outcome), status.ended_at
    else:
        outcome = Outcome.ABANDONED
        end = killed_at if killed_at is not None else (hb.time if hb is not None else launch.billed_from)
    committed = next((s.last_committed_step for s in (status, hb) if s is not None and s.last_committed_step
                      is not None), None)
    event = {
        "ended_at": end,
        "last_step": hb.step if hb is not None else None,
        "step_time_ewma": hb.step_time_ewma if hb is not None else None,
        "notice_at": hb.notice_at if hb is not None and own_end else None,
    }
    steps_after = min(committed, launch.end_step) if committed is not None else None
    row = record_attempt(store, launch, outcome, event, steps_after=steps_after, now=now, market=market)
    log.warning("attempt %s on %s was not accounted for: billed as %s, %.0f s", launch.attempt_id,
                launch.instance_id, outcome.value, row["billed_seconds"])
    return row


def unaccounted_launches(store: ObjectStore, keep: Callable[[AttemptLaunch], bool]) -> list[AttemptLaunch]:
    """The launched attempts without a ledger row that ``keep`` accepts (a run's, an instance's): nobody
    waited for them (``Outcome.ABANDONED``: a segment marked failed or success while it ran in a worker, a
    try whose worker went and was never retried, a DAG run deleted under it). Empty when the ledger is torn
    (whoever bills stops on it too; nothing is billed twice); an unreadable launch record is skipped."""
    view = JobView(store)
    try:
        accounted = {r.attempt_id for r in view.ledger_rows()}
    except ValueError as exc:
        log.warning("attempts not checked for missing ledger rows: %s", exc)
        return []
    launches = []
    for attempt_id in sorted(set(view.attempt_ids()) - accounted):
        try:
            launch = AttemptLaunch.read(store, attempt_id)
        except Exception as exc:  # noqa: BLE001 - torn, or the store did not answer: the others are still billed
            log.warning("attempt %s has an unreadable launch record (%s); not billed", attempt_id, exc)
            continue
        if launch is not None and keep(launch):
            launches.append(launch)
    return launches


def record_kills(store: ObjectStore, launches: Iterable[AttemptLaunch], at: float) -> None:
    """Record the kill of each attempt still running on an instance the caller is about to end, as a
    segment's on_kill does: its agent then says that the status it writes on the termination (which reads
    ``preempted``) is the kill's doing, and no clock of the instance's decides it. Best effort."""
    layout = JobLayout(store)
    for launch in launches:
        try:
            layout.write_kill(launch.attempt_id, at)
        except Exception as exc:  # noqa: BLE001 - the clocks decide then; the termination comes first
            log.warning("kill of attempt %s not recorded (%s: %s)", launch.attempt_id, type(exc).__name__, exc)


#: how long a biller that has just ended instances waits for their agents' statuses: on EC2 a termination
#: returns at once and the training process's emergency save (inside the shutdown) lands after; the status
#: then says what it kept. Below the triggerer's ``on_kill_timeout`` (30 s by default).
STATUS_WAIT_SECONDS = 20.0


def wait_for_statuses(store: ObjectStore, attempt_ids: Iterable[str], timeout: float = STATUS_WAIT_SECONDS,
                      poll: float = 0.5) -> None:
    """Wait, at most ``timeout`` seconds, until each attempt that trained (it has a heartbeat: a process that
    may save on its way out) has its agent's status, which the agent writes once the emergency save
    committed. Best effort: an attempt whose agent never answers (the instance lost) is billed from its
    heartbeat after the wait; a record that cannot be read is read again."""
    layout = JobLayout(store)

    def answered(attempt_id: str) -> bool:
        try:
            return layout.read_status(attempt_id) is not None
        except Exception:  # noqa: BLE001 - torn or not answering: read again
            return False

    def trained(attempt_id: str) -> bool:
        try:
            return layout.read_heartbeat(attempt_id) is not None
        except Exception:  # noqa: BLE001 - unknown: wait for it
            return True

    waiting = [a for a in attempt_ids if not answered(a) and trained(a)]
    deadline = time.monotonic() + timeout
    while waiting and time.monotonic() < deadline:
        time.sleep(poll)
        waiting = [a for a in waiting if not answered(a)]


def bill_abandoned(store: ObjectStore, launches: Iterable[AttemptLaunch], terminated: set[str],
                   terminated_at: float, market=None) -> int:
    """Bill each of ``launches`` (:func:`unaccounted_launches`) with :func:`account_abandoned`, the ones on an
    instance in ``terminated`` as ended at ``terminated_at`` at the latest. Best effort; returns how many
    rows were written."""
    launches = list(launches)
    ended = [launch.attempt_id for launch in launches if launch.instance_id in terminated]
    if ended:  # their emergency saves land in the shutdown: bill what the statuses then say was kept
        wait_for_statuses(store, ended)
    billed = 0
    now = time.time()
    for launch in launches:
        try:
            billed += account_abandoned(store, launch, now=now, market=market, killed_at=(
                terminated_at if launch.instance_id in terminated else None)) is not None
        except Exception as exc:  # noqa: BLE001 - the caller's summary and the instances' end come first
            log.warning("attempt %s not billed (%s: %s)", launch.attempt_id, type(exc).__name__, exc)
    return billed


def bill_idle(store: ObjectStore, instance_ids: Iterable[str], rows: list[LedgerRow], terminated_at: float,
              market=None) -> float:
    """Bill each warm instance terminated at ``terminated_at`` (its warm time was no good offer any more, the
    job moved, or the job ended) from its last attempt's end: an attempt reusing a warm instance pays the
    idle time before it, an instance nobody reused paid none. ``market`` prices the idle time as an
    attempt's run is priced (:func:`billed_price`: a spot price that moved while it idled); without one, or
    when it cannot say, the last attempt's price. Best effort; returns the dollars billed."""
    billed = 0.0
    for instance_id in instance_ids:
        own = [r for r in rows if r.instance_id == instance_id]
        last = max(own, key=lambda r: r.ended_at, default=None)
        # where its bill so far ends: a short first attempt paid the launch's minimum past its own end
        paid_to = max((r.started_at + AWS_MINIMUM_BILLED_SECONDS for r in own if r.new_instance), default=0.0)
        if last is None or _ended_with(last) or terminated_at <= max(last.ended_at, paid_to):
            continue  # no attempt of its own (the attempt's row bills it), ended with its attempt, or paid
        try:
            started = max(last.ended_at, paid_to)
            row = LedgerRow(
                attempt_id=f"idle.{instance_id}", instance_id=instance_id, instance_type=last.instance_type,
                zone=last.zone, market=last.market,
                price_per_hour=_idle_price(store, market, last, started, terminated_at),
                on_demand_price_per_hour=last.on_demand_price_per_hour, started_at=started,
                ended_at=terminated_at, steps_done=0, outcome="idle", region=last.region,
                segment_index=last.segment_index, new_instance=False, gpu_count=last.gpu_count)
            if LedgerStore(store).write_idle(row) is not None:
                billed += row.cost
                log.info("warm instance %s idle %.0f s after its last attempt until terminated: $%.4f billed",
                         instance_id, row.billed_seconds, row.cost)
        except Exception as exc:  # noqa: BLE001 - only the bill is missing; the termination stands
            log.warning("idle time of %s not billed (%s: %s)", instance_id, type(exc).__name__, exc)
    return billed


def bill_unrecorded(store: ObjectStore, instances, rows: list[LedgerRow], launches: Iterable[AttemptLaunch],
                    ended_now: set[str], at: float, market=None) -> float:
    """Bill each of the job's instances that neither a ledger row nor an unaccounted launch record names: its
    launcher died between the launch and the record (a worker lost, a task killed in that window), so no
    attempt ran on it, only its agent waiting for a request. It is billed as idle time from its launch (with
    the launch's 60 s minimum) to its end: ``at`` for those in ``ended_now`` (the caller just ended them),
    else the end its backend reports. ``launches`` must hold every unaccounted launch on these instances
    (a named instance is some attempt's to bill). Once per instance (``idle.<instance>``). Best effort;
    returns the dollars billed."""
    named = {r.instance_id for r in rows} | {launch.instance_id for launch in launches}
    billed = 0.0
    for info in instances:
        if info.instance_id in named or info.launched_at is None:
            continue
        end = at if info.instance_id in ended_now else info.terminated_at
        if end is None or end < info.launched_at:
            continue  # still running, or the backend does not say when it ended: whoever ends it bills it
        offer = info.offer
        try:
            price = billed_price(market, offer, info.launched_at, end)
            row = LedgerRow(
                attempt_id=f"idle.{info.instance_id}", instance_id=info.instance_id,
                instance_type=offer.instance_type, zone=offer.zone, market=getattr(offer.market, "value", offer.market),
                price_per_hour=offer.price_per_hour if price is None else price,
                on_demand_price_per_hour=offer.on_demand_price_per_hour, started_at=info.launched_at, ended_at=end,
                steps_done=0, outcome="idle", region=offer.region, new_instance=True, gpu_count=offer.gpu_count)
            if LedgerStore(store).write_idle(row) is not None:
                billed += row.cost
                log.warning("instance %s ran %.0f s with no attempt recorded (its launcher died before writing "
                            "the launch record): $%.4f billed as idle", info.instance_id, row.billed_seconds, row.cost)
        except Exception as exc:  # noqa: BLE001 - only the bill is missing
            log.warning("unrecorded instance %s not billed (%s: %s)", info.instance_id, type(exc).__name__, exc)
    return billed


def _ended_with(row: LedgerRow) -> bool:
    """Whether the instance ended with this attempt, never warm after it: preempted or lost, or abandoned
    (its killer ended it; the shutdown's seconds after the kill are not billed)."""
    return row.is_preemption or row.outcome == Outcome.ABANDONED.value


def _idle_price(store: ObjectStore, market, last: LedgerRow, start: float, end: float) -> float:
    """The $/h of an instance's idle time: the market's price over it for the offer its last attempt was
    launched at; the last attempt's price without a market, a readable launch record or an answer."""
    if market is None:
        return last.price_per_hour
    try:
        launch = AttemptLaunch.read(store, last.attempt_id)
    except Exception as exc:  # noqa: BLE001 - the bill keeps the last attempt's price
        log.warning("launch record of %s unreadable (%s); its instance's idle time is billed at the attempt's "
                    "price", last.attempt_id, exc)
        return last.price_per_hour
    if launch is None:
        return last.price_per_hour
    price = billed_price(market, launch.offer_obj, start, end)
    return last.price_per_hour if price is None else price


def bill_idle_exits(store: ObjectStore, rows: list[LedgerRow], market=None) -> float:
    """Bill each instance whose agent exited after its last attempt, from that attempt's end to the agent's
    exit, when nobody billed it yet: its agent shut it down after its idle timeout, or it was ended under
    an idle agent without a task's :func:`bill_idle` (a spot reclaim of a warm instance, a stop). An
    instance a task terminated was billed by that task first (:func:`bill_idle` writes once per instance).
    The instance's shutdown after the agent's exit (seconds) is not billed. Best effort.

    Runs at every segment start, so it reads only the agents that may owe a bill: of instances whose last
    attempt was not preempted, those not billed idle yet (one listing), not every instance the job had."""
    last: dict[str, LedgerRow] = {}
    for row in rows:
        if row.instance_id and (row.instance_id not in last or row.ended_at > last[row.instance_id].ended_at):
            last[row.instance_id] = row
    try:
        billed = set(store.list(JobLayout.IDLE_PREFIX))
        exits = JobLayout(store).agent_exits(i for i, row in last.items()
                                             if not _ended_with(row) and JobLayout.idle_key(i) not in billed)
    except Exception as exc:  # noqa: BLE001 - only the bill is missing
        log.warning("instances that ended after their last attempt not billed (%s: %s)", type(exc).__name__, exc)
        return 0.0
    return sum(bill_idle(store, [instance_id], rows, at, market) for instance_id, at in sorted(exits.items()))


def refresh_summary(store: ObjectStore, now: float) -> dict[str, Any] | None:
    """Bring a job summary the finish task wrote (``JobLayout.SUMMARY_KEY``) up to the ledger after bills
    written later (``airflow-spot reap``): its totals are recomputed, what the finish task said of the run
    stays. Returns the summary written, None when there is none to refresh. The summary XCom (the list's
    row) is the caller's to rewrite (``commands.airflow_lookups.update_summary_xcoms``)."""
    try:
        summary = json.loads(store.get_bytes(JobLayout.SUMMARY_KEY))
    except ObjectNotFound:
        return None
    summary.update(summarize(store, now=now))
    store.put_bytes(JobLayout.SUMMARY_KEY, json.dumps(summary, sort_keys=True, indent=2).encode())
    return summary


def _readable(read, attempt_id: str):
    try:
        return read(attempt_id)
    except SchemaError:  # a torn status or heartbeat tells nothing: the row is built without it
        return None


def read_rows(store: ObjectStore) -> list[LedgerRow]:
    return JobView(store).ledger_rows()


def count(
    store: ObjectStore,
    outcomes: Iterable[Outcome],
    segment_index: int | None = None,
    since: float | None = None,
) -> int:
    """Rows with one of ``outcomes`` (of one segment, if given) that ended at or after ``since``."""
    return JobView(store).count(outcomes, segment_index=segment_index, since=since)


def job_totals(store: ObjectStore) -> dict[str, Any]:
    view = JobView(store)
    return totals(view.ledger_rows(), view.probe_rows(), view.idle_rows()).to_dict()


def summarize(store: ObjectStore, now: float) -> dict[str, Any]:
    """Ledger totals plus the counts and times the final task and the demo print (see ``JobView.totals``)."""
    return JobView(store).totals(now)
