"""``airflow-spot availability show|compact|prune``: what a deployment's jobs observed of the spot pools.

``URI`` is an availability log (:mod:`airflow_spot.storage.availability`): the deployment's
(``_availability`` beside the job roots, ``AIRFLOW_SPOT_AVAILABILITY_URI``, or the operator's
``availability_uri``), or a job's root: then its own log under ``control/availability/`` and its ledger
(its instances' launches and preemptions), what its decisions read besides the deployment's log.
``file://``, plain paths and ``s3://`` work (S3 through boto3: ``AWS_ENDPOINT_URL_S3`` or
``--endpoint-url`` for MinIO or moto).

* ``show URI``: per pool, what the decision would conclude now from the whole log (up / down / unknown,
  seen up or down since when, the outages measured and their mean), and the events of the log's last
  ``--hours`` (24; 0: all of it), their count and the newest, for the pools that have any. On a job's root
  an observation its log and its ledger both hold (a launch; an instance running on into the next
  attempt) is counted once, and the ledger's events are the job's own.
* ``compact URI``: delete the events no decision reads (the repeats inside a run of one pool's events
  that all say it held capacity, but one every 6 h; :meth:`AvailabilityLog.compact`) older than
  ``--older-than-hours`` (6). Each job's finish task does this to the deployment's log; given a job's
  root, this compacts that job's own log.
* ``prune URI --older-than-days D``: delete the events older than ``D`` days (``--dry-run``: count them).
  A decision reads every event of the log, so a log nobody prunes costs more to read as it
  grows; on S3 a lifecycle rule on the prefix does the same without anyone running this.
"""
from __future__ import annotations

import argparse
import datetime as dt
import statistics
import sys
import time
from collections import Counter
from urllib.parse import urlparse

from airflow_spot.policy.decision import DecisionParams
from airflow_spot.policy.observations import PoolEvent, ledger_events, pool_views
from airflow_spot.storage.availability import COMPACT_AFTER_HOURS, AvailabilityLog, _entry_time
from airflow_spot.storage.ledger_store import LedgerStore
from airflow_spot.storage.object_store import (
    ObjectStore,
    StoreConfigError,
    open_existing_store,
    store_error_hint,
    store_errors,
    uri_problem,
)
from airflow_spot.storage.protocol import JobLayout

EXIT_OK, EXIT_FAILED, EXIT_USAGE = 0, 1, 2


def add_arguments(parser: argparse.ArgumentParser) -> None:
    actions = parser.add_subparsers(dest="action", required=True, metavar="ACTION")
    for name, help_text in (
        ("show", "per pool: believed state now, observed up-time, outages and events"),
        ("compact", "delete the events no decision reads (repeats inside a pool's run of ups)"),
        ("prune", "delete events older than --older-than-days"),
    ):
        p = actions.add_parser(name, help=help_text, description=help_text)
        p.add_argument("uri", metavar="URI",
                       help="the availability log (e.g. s3://bucket/my-dag/_availability) or a job's root")
        p.add_argument("--endpoint-url", default=None, help="S3 endpoint (default: AWS_ENDPOINT_URL_S3 / boto3's)")
        if name == "show":
            p.add_argument("--hours", type=float, default=24.0, help="read the events of the last H hours (0: all)")
        elif name == "compact":
            p.add_argument("--older-than-hours", type=float, default=COMPACT_AFTER_HOURS, metavar="H",
                           help=f"leave the events of the last H hours alone (default {COMPACT_AFTER_HOURS:g}: "
                                "an event can be written late)")
            p.add_argument("--dry-run", action="store_true", help="count what would be deleted, delete nothing")
        else:
            p.add_argument("--older-than-days", type=float, required=True, metavar="D",
                           help="delete the events older than D days")
            p.add_argument("--dry-run", action="store_true", help="count what would be deleted, delete nothing")


def open_log(uri: str, endpoint_url: str | None = None) -> tuple[AvailabilityLog, ObjectStore | None]:
    """The log at ``uri``; for a job's root, its own log (``control/availability/``) and the job's store
    (whose ledger holds its instances' launches and preemptions)."""
    if not (isinstance(uri, str) and uri.strip()):
        raise StoreConfigError(f"the availability log URI must be a non-empty string, got {uri!r}")
    scheme = urlparse(uri).scheme if isinstance(uri, str) else ""
    if scheme and scheme not in ("file", "s3"):
        raise StoreConfigError(f"unsupported availability log URI scheme {scheme!r} in {uri!r}; give file:///path, "
                               "s3://bucket/prefix or a path")
    problem = uri_problem(uri) if isinstance(uri, str) and uri else None
    if problem:  # its other messages speak of a checkpoint URI
        raise StoreConfigError(problem.replace("checkpoint URI", "availability log URI"))
    store = open_existing_store(uri, endpoint_url, "the availability log (e.g. the _availability folder beside "
                                                   "the job roots) or a job's root")
    own = store.child(JobLayout.AVAILABILITY_PREFIX)
    if own.list() or store.list("control/"):
        return AvailabilityLog(own), store
    problem = _not_a_log(store)
    if problem:
        raise StoreConfigError(problem)
    return AvailabilityLog(store), None


def _not_a_log(store: ObjectStore) -> str | None:
    """Why ``store`` holds something other than one log (``<pool>/<entry>.json``), or None.

    A folder above a log (a DAG's root: job roots, ``_availability``, ``_overheads``) would be read as one
    log mixing every log under it, and pruned by the times in its file names: ``_overheads`` entries and
    other time-named records would go too."""
    keys = store.list()
    if not keys:
        return None  # an empty log: nothing written yet
    foreign = [k for k in keys if k.count("/") != 1]
    if not foreign and any(_entry_time(k) is not None for k in keys):
        return None
    # the logs beneath: a deep key whose last two parts are <pool>/<entry>; a job's own log by its root
    logs = sorted({k.rsplit("/", 2)[0].removesuffix("/" + JobLayout.AVAILABILITY_PREFIX.rstrip("/"))
                   for k in foreign if k.count("/") >= 2 and AvailabilityLog._parse_name(k) is not None})
    hint = ""
    if logs:
        more = f" (and {len(logs) - 3} more)" if len(logs) > 3 else ""
        hint = "; logs and job roots under it: " + ", ".join(f"{store.uri}/{x}" for x in logs[:3]) + more
    odd = foreign or keys  # deeper keys, else keys that are no event
    what = f"{odd[0]}" + (f" and {len(odd) - 1} more" if len(odd) > 1 else "")
    return (f"{store.uri} is not an availability log: it holds {what}, where a log holds only <pool>/<event>.json "
            "entries. Give the log itself (the _availability folder beside the job roots, or "
            f"AIRFLOW_SPOT_AVAILABILITY_URI) or a job's root{hint}. Nothing was read or deleted")


#: how an error line starts, as the other subcommands' and argparse's own do
_ERROR = "airflow-spot availability: error:"

def run(args: argparse.Namespace, now: float | None = None) -> int:
    now = time.time() if now is None else now
    try:
        if args.action == "show":
            if not args.hours >= 0:
                raise StoreConfigError(f"--hours must be >= 0, got {args.hours}")
            return _show(*open_log(args.uri, args.endpoint_url), now, args.hours)
        if args.action == "compact":
            if not args.older_than_hours >= 0:
                raise StoreConfigError(f"--older-than-hours must be >= 0, got {args.older_than_hours}")
            log = open_log(args.uri, args.endpoint_url)[0]
            n = log.compact(before=now - args.older_than_hours * 3600, dry_run=args.dry_run)
            print(f"{'would delete' if args.dry_run else 'deleted'} {n} events no decision reads (older than "
                  f"{args.older_than_hours:g} h) under {log.store.uri}")
            return EXIT_OK
        if not args.older_than_days > 0:
            raise StoreConfigError(f"--older-than-days must be > 0, got {args.older_than_days} "
                                   "(a decision reads the recent events: keep a week or more)")
        return _prune(open_log(args.uri, args.endpoint_url)[0], now, args.older_than_days, args.dry_run)
    except StoreConfigError as exc:
        print(f"{_ERROR} {exc}", file=sys.stderr)
        return EXIT_USAGE
    except BrokenPipeError:
        raise  # our reader went away (| head): not the store's fault; the command line ends quietly
    except store_errors() as exc:
        print(f"{_ERROR} cannot read {args.uri}: {type(exc).__name__}: {exc}{store_error_hint(exc)}", file=sys.stderr)
        return EXIT_FAILED


def _when(at: float | None, now: float) -> str:
    if at is None:
        return "-"
    stamp = dt.datetime.fromtimestamp(at, dt.UTC).strftime("%m-%d %H:%M")
    return f"{stamp} ({_ago(now - at)} ago)"


def _ago(seconds: float) -> str:
    seconds = max(0.0, seconds)
    if seconds < 3600:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h" if seconds < 86400 else f"{seconds / 86400:.1f} d"


def _own_events(log_events: list, ledger: list, own_job: str, tolerance: float = 120.0) -> list:
    """A job root's events, each once: its own log's, and of its ledger's what the log lacks.

    The job's log holds every launch of a new spot instance (and its refusals and probes); its ledger a row
    per attempt, which :func:`ledger_events` turns into an event where the instance started (the same
    launch again, a few seconds apart, or ``running`` for a reused instance) and one where it ended
    (``running`` again at the instant the next attempt on that instance starts, or ``preempted``, which
    the job's own log lacks). Read together for counting, these would be the same observations twice:
    a ledger launch is left out when the log has a launch of the pool within ``tolerance`` seconds (each
    log launch stands for one ledger launch), and repeats of one pool, kind and time are left out. The
    ledger's events are ``own_job``'s."""
    out = list(log_events)
    launches: dict[str, list[float]] = {}
    for e in log_events:
        if e.kind == "launched":
            launches.setdefault(e.pool, []).append(e.at)
    seen = {(e.pool, e.kind, e.at) for e in log_events}
    for e in sorted(ledger, key=lambda e: e.at):
        if e.kind == "launched":
            near = [t for t in launches.get(e.pool, ()) if abs(t - e.at) <= tolerance]
            if near:
                launches[e.pool].remove(min(near, key=lambda t: abs(t - e.at)))
                continue
        if (e.pool, e.kind, e.at) in seen:
            continue
        seen.add((e.pool, e.kind, e.at))
        out.append(PoolEvent(e.pool, e.kind, e.at, own_job))
    return out


def _show(log: AvailabilityLog, job_store: ObjectStore | None, now: float, hours: float) -> int:
    # the states come from the whole log, as a decision reads it (a pool up for days, its repeats compacted,
    # is up since days); ``hours`` limits only the events listed and counted
    since = now - hours * 3600 if hours else None
    history = log.read(until=now)
    where = log.store.uri
    own_job = None  # on a job root: the job's id in its own log ("" when it has none)
    if job_store is not None:
        ledger = [e for e in ledger_events(LedgerStore(job_store).rows()) if e.at <= now]
        own_job = Counter(e.job for e in history).most_common(1)[0][0] if history else ""
        # a decision reads the ledger's events beside the log's (so the states below do too), but they
        # repeat the log's launches and each other: each observation is counted and listed once
        counted = _own_events(history, ledger, own_job)
        history += ledger
        history.sort(key=lambda e: (e.at, e.pool, e.kind))
        counted.sort(key=lambda e: (e.at, e.pool, e.kind))
        where = f"{where} and the job's ledger"
    else:
        counted = history
    events = [e for e in counted if since is None or e.at >= since]
    span = f"the last {hours:g} h" if hours else "all of it"
    if not events:
        print(f"no events under {where} in {span}")
        return EXIT_OK
    params = DecisionParams()
    shown = {e.pool for e in events}
    views = {pool: v for pool, v in pool_views(history, now, recheck_seconds=params.recheck_seconds,
                                                 watch_seconds=params.watch_seconds).items() if pool in shown}
    jobs = {e.job for e in events}
    print(f"{len(events)} events of {len(views)} pools from {len(jobs)} job(s) under {where} ({span}); "
          "states as a decision would read them now")
    print(f"  {'POOL':<32} {'STATE':<8} {'UP SINCE':<24} {'DOWN SINCE':<24} {'OUTAGES':>7} {'MEAN':>7} "
          f"{'EVENTS':>6}  NEWEST")
    by_pool: dict[str, list] = {}
    for e in events:
        by_pool.setdefault(e.pool, []).append(e)
    for pool, v in sorted(views.items()):
        evs = by_pool[pool]
        newest = evs[-1]
        mean = _ago(statistics.mean(v.outages)) if v.outages else "-"
        who = "this job" if not newest.job or newest.job == own_job else newest.job
        print(f"  {pool:<32} {v.state:<8} {_when(v.up_since, now):<24} {_when(v.down_since, now):<24} "
              f"{len(v.outages):>7} {mean:>7} {len(evs):>6}  {newest.kind} {_ago(now - newest.at)} ago "
              f"({who})")
    return EXIT_OK


def _prune(log: AvailabilityLog, now: float, days: float, dry_run: bool) -> int:
    n = log.prune(before=now - days * 86400, dry_run=dry_run)
    print(f"{'would delete' if dry_run else 'deleted'} {n} events older than {days:g} days under {log.store.uri}")
    return EXIT_OK
