"""``airflow-spot checkpoints list|verify|restore``: inspect and repair a job's checkpoints.

``URI`` is the job's ``checkpoint_uri`` (its ``checkpoints/`` prefix is used when it has one) or that
prefix itself; ``file://``, plain paths and ``s3://`` work (S3 through boto3, so ``AWS_ENDPOINT_URL_S3``
or ``--endpoint-url`` point it at MinIO or moto).

* ``list URI``: one line per checkpoint, oldest first: step, save time (UTC), size, writer, payload digest
  (``block 8 MiB`` or ``sha256``: an airflow-spot from before block digests reads only the latter), ``ok``
  or what is wrong, and which one a resume would use. Payloads are re-hashed unless ``--quick``.
* ``verify URI``: exit 0 when every checkpoint verifies (manifest checksum, directory name, payload size
  and sha256); otherwise print each broken one and exit 1.
* ``restore --step N URI``: make the newest verified checkpoint at step N the one the next resume uses, by
  moving every newer checkpoint (and every broken one at step N) under ``quarantine/`` in the same store.
  Nothing is deleted: move a directory back from ``quarantine/`` to undo. Stop the job first, or its next
  save lands after step N again. ``--dry-run`` only prints the moves. With ``--to PATH`` the store is left
  as it is and step N's payload is copied to ``PATH`` (a file, or a directory to hold ``state.pt``).
"""
from __future__ import annotations

import argparse
import datetime as dt
import os
import shutil
import sys

from airflow_spot.storage.checkpoint import DIGEST_ENV, QUARANTINE, CheckpointStatus, CheckpointStore
from airflow_spot.storage.object_store import StoreConfigError, open_existing_store, store_errors

EXIT_OK, EXIT_BROKEN, EXIT_USAGE = 0, 1, 2


def add_arguments(parser: argparse.ArgumentParser) -> None:
    actions = parser.add_subparsers(dest="action", required=True, metavar="ACTION")
    for name, help_text in (
        ("list", "show every checkpoint with its step, time, size, writer and whether it verifies"),
        ("verify", "exit non-zero naming each checkpoint that does not verify"),
        ("restore", "make step N the one a resume uses (newer checkpoints move to quarantine/), or copy it out"),
    ):
        p = actions.add_parser(name, help=help_text, description=help_text)
        p.add_argument("uri", metavar="URI", help="the job's checkpoint_uri (file:///path, a path, or s3://bucket/prefix)")
        p.add_argument("--endpoint-url", default=None, help="S3 endpoint (default: AWS_ENDPOINT_URL_S3 / boto3's)")
        if name == "list":
            p.add_argument("--quick", action="store_true", help="check manifests only, do not re-hash the payloads")
        if name == "restore":
            p.add_argument("--step", type=int, required=True, metavar="N", help="the step to resume from")
            p.add_argument("--to", default=None, metavar="PATH",
                           help="copy step N's payload to PATH instead of changing the store")
            p.add_argument("--dry-run", action="store_true", help="print what would move, move nothing")


def open_checkpoints(uri: str, endpoint_url: str | None = None) -> CheckpointStore:
    """The checkpoint store for a job URI, or for a URI that already is a job's ``checkpoints/`` prefix."""
    store = open_existing_store(uri, endpoint_url, "the job's checkpoint_uri (the folder that holds its "
                                                   "checkpoints/) or that checkpoints/ folder")
    nested = store.child("checkpoints")
    return CheckpointStore(nested if nested.list() else store, writer="cli")


def run(args: argparse.Namespace) -> int:
    try:
        ckpts = open_checkpoints(args.uri, args.endpoint_url)
        if args.action == "list":
            return _list(ckpts, verify_payloads=not args.quick)
        if args.action == "verify":
            return _verify(ckpts)
        return _restore(ckpts, args.step, args.to, args.dry_run)
    except StoreConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except store_errors() as exc:
        print(f"error: cannot read {args.uri}: {type(exc).__name__}: {exc}", file=sys.stderr)
        return EXIT_BROKEN


def _resume_choice(statuses: list[CheckpointStatus]) -> CheckpointStatus | None:
    good = [s for s in statuses if s.ok]
    return good[-1] if good else None


def _list(ckpts: CheckpointStore, verify_payloads: bool) -> int:
    statuses = ckpts.inspect(verify_payloads=verify_payloads)
    if not statuses:
        print(f"no checkpoints under {ckpts.store.uri}")
        return EXIT_OK
    chosen = _resume_choice(statuses)
    print(f"checkpoints under {ckpts.store.uri} (oldest first; '*' = the one a resume uses)")
    print(f"  {'STEP':>10}  {'SAVED (UTC)':<19}  {'SIZE':>10}  {'WRITER':<20}  {'DIGEST':<15}  STATUS")
    blocks = 0
    for s in statuses:
        m = s.manifest
        saved = dt.datetime.fromtimestamp(m.created_at, dt.UTC).strftime("%Y-%m-%d %H:%M:%S") if m else "?"
        size = _human(m.size) if m else "?"
        writer = m.writer if m else "?"
        block = max((f.sha256_block for f in m.files), default=0) if m else 0
        blocks += bool(block)
        digest = ("?" if m is None else f"block {_human(block).replace('.0 ', ' ')}" if block else "sha256")
        state = "ok" if s.ok else f"BROKEN: {s.problem}"
        mark = "*" if s is chosen else " "
        print(f"{mark} {s.step:>10}  {saved:<19}  {size:>10}  {writer:<20}  {digest:<15}  {state}  [{s.directory}]")
    if chosen is None:
        print("no checkpoint verifies: a resume refuses to start (see `airflow-spot checkpoints verify`)")
    if blocks:
        print(f"{blocks} checkpoint(s) name a block SHA-256 (manifest schema 3), which an airflow-spot from before "
              f"block digests cannot read; while such versions remain, set {DIGEST_ENV}=sha256 on the Airflow "
              "workers so that new saves name a whole-file sha256")
    return EXIT_OK


def _verify(ckpts: CheckpointStore) -> int:
    statuses = ckpts.inspect(verify_payloads=True)
    broken = [s for s in statuses if not s.ok]
    for s in broken:
        print(f"BROKEN step {s.step} [{s.directory}]: {s.problem}")
    chosen = _resume_choice(statuses)
    if not statuses:
        print(f"no checkpoints under {ckpts.store.uri}")
    elif broken:
        resume = f"a resume uses step {chosen.step}" if chosen else "a resume refuses to start (no checkpoint verifies)"
        print(f"{len(broken)} of {len(statuses)} checkpoints under {ckpts.store.uri} are broken; {resume}. "
              f"To resume from an older good step: airflow-spot checkpoints restore --step N {ckpts.store.uri}")
        return EXIT_BROKEN
    else:
        print(f"all {len(statuses)} checkpoints under {ckpts.store.uri} verify; a resume uses step {chosen.step}")
    return EXIT_OK


def _restore(ckpts: CheckpointStore, step: int, to: str | None, dry_run: bool) -> int:
    statuses = ckpts.inspect(verify_payloads=True)
    at_step = [s for s in statuses if s.step == step and s.ok]
    if not at_step:
        good = sorted({s.step for s in statuses if s.ok})
        print(f"error: no verified checkpoint at step {step} under {ckpts.store.uri}; "
              f"verified steps: {good or 'none'}", file=sys.stderr)
        return EXIT_USAGE
    chosen = at_step[-1]
    if to is not None:
        target = os.path.join(to, chosen.manifest.files[0].name) if os.path.isdir(to) else to
        entry = chosen.manifest.files[0]
        ckpts.fetch_verified(chosen.manifest, entry, lambda path: shutil.copyfile(path, target))
        print(f"copied step {step} ({chosen.directory}/{entry.name}, verified) to {target}; the store is unchanged")
        return EXIT_OK
    doomed = [s for s in statuses if s.step > step or (s.step == step and not s.ok)]
    for s in doomed:
        why = "broken" if not s.ok else "newer"
        print(f"{'would move' if dry_run else 'moving'} step {s.step} [{s.directory}] ({why}) "
              f"to {QUARANTINE}/{s.directory}")
        if not dry_run:
            ckpts.quarantine(s.directory)
    if dry_run:
        return EXIT_OK
    now = ckpts.latest_step()
    if now != step:  # a writer saved meanwhile: say so rather than claim success
        print(f"error: after the moves a resume would use step {now}, not {step}; is the job still running?",
              file=sys.stderr)
        return EXIT_BROKEN
    print(f"a resume now starts from step {step} ({chosen.directory}); moved {len(doomed)} checkpoint(s) under "
          f"{ckpts.store.uri}/{QUARANTINE}/ (move them back to undo)")
    return EXIT_OK


def _human(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n} B"
