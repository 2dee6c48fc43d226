"""``airflow-spot checkpoints list|verify|restore``: inspect and repair a job's checkpoints.

``URI`` is the job's ``checkpoint_uri`` (its ``checkpoints/`` prefix is used when it has one) or that
prefix itself; ``file://``, plain paths and ``s3://`` work (S3 through boto3, so ``AWS_ENDPOINT_URL_S3``
or ``--endpoint-url`` point it at MinIO or moto).

* ``list URI``: one line per checkpoint, oldest first: step, save time (UTC), size, writer, payload digest
  (``block 8 MiB`` or ``sha256``: an airflow-spot from before block digests reads only the latter; ``--verbose``
  says what that means for an upgrade or a rollback), ``ok`` or what is wrong, and which one a resume would
  use. Payloads are re-hashed unless ``--quick``, which checks manifests and payload sizes only (status
  ``ok (quick)``: ``verify`` may still find a payload whose digest is wrong).
* ``verify URI``: exit 0 when every checkpoint verifies (manifest checksum, directory name, payload size
  and sha256); otherwise print each broken one and exit 1.
* ``restore --step N URI``: make the newest verified checkpoint at step N the one the next resume uses, by
  moving every newer checkpoint (and every broken one at step N) under ``quarantine/`` in the same store.
  Nothing is deleted: move a directory back from ``quarantine/`` to undo. Stop the job first, or its next
  save lands after step N again. ``--dry-run`` only prints the moves (or the copy). With ``--to PATH`` the store is left
  as it is and step N's payload is copied to ``PATH`` (a file in an existing folder, or a directory to hold
  ``state.pt``); a sharded checkpoint's files all go into the folder ``PATH``, where ``dcp.load`` reads them.

A URI that holds no job store (neither ``checkpoints/`` nor ``control/`` under it, and no checkpoint of its
own) is an error (exit 2) naming the expected layout, rather than an empty store.
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime as dt
import os
import re
import shutil
import sys
import uuid
from urllib.parse import urlparse

from airflow_spot.storage.checkpoint import DIGEST_ENV, MANIFEST, QUARANTINE, CheckpointStatus, CheckpointStore
from airflow_spot.storage.object_store import (
    ObjectNotFound, StoreConfigError, open_existing_store, store_error_hint, store_errors,
)

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
            p.add_argument("--quick", action="store_true",
                           help="check manifests and payload sizes only, do not re-hash the payloads")
            p.add_argument("--verbose", action="store_true",
                           help="also say what the payload digests mean for upgrading or rolling back airflow-spot")
        if name == "restore":
            p.add_argument("--step", type=int, required=True, metavar="N", help="the step to resume from")
            p.add_argument("--to", default=None, metavar="PATH",
                           help="copy step N's payload to PATH instead of changing the store")
            p.add_argument("--force", action="store_true",
                           help="with --to: replace a file already at PATH (without it the copy refuses to)")
            p.add_argument("--dry-run", action="store_true",
                           help="print what would move (or, with --to, be copied), change nothing")


#: a key of a checkpoint store: a checkpoint's directory (committed or not) or the quarantine
_CHECKPOINT_KEY = re.compile(rf"^(\d{{12}}-[^/]+|{QUARANTINE})/")
#: a key that marks the folder before it as a job store (for the hint when a URI names a folder above one)
_JOB_KEY = re.compile(rf"^(.+)/(?:control/job\.json|checkpoints/\d{{12}}-[^/]+/{MANIFEST})$")


def open_checkpoints(uri: str, endpoint_url: str | None = None) -> CheckpointStore:
    """The checkpoint store for a job URI, or for a URI that already is a job's ``checkpoints/`` prefix.

    :raises StoreConfigError: when ``uri`` holds no job store (no ``checkpoints/``, no ``control/``, no
        checkpoint directory of its own), naming the layout expected and any job stores found under it."""
    what = "the job's checkpoint_uri (the folder that holds its checkpoints/) or that checkpoints/ folder"
    store = open_existing_store(uri, endpoint_url, what)
    nested = store.child("checkpoints")
    if nested.list():
        return CheckpointStore(nested, writer="cli")
    if store.list("control/"):
        return CheckpointStore(nested, writer="cli")  # a job that has not saved yet
    if urlparse(uri).path.rstrip("/").rsplit("/", 1)[-1] == "checkpoints":
        return CheckpointStore(store, writer="cli")  # a job's checkpoints/ folder, still empty
    keys = store.list()
    if any(_CHECKPOINT_KEY.match(k) for k in keys):
        return CheckpointStore(store, writer="cli")  # the checkpoints/ prefix itself
    found = sorted({m.group(1) for m in map(_JOB_KEY.match, keys) if m})
    hint = ""
    if found:
        more = f" (and {len(found) - 3} more)" if len(found) > 3 else ""
        hint = "; job stores under it: " + ", ".join(f"{store.uri}/{f}" for f in found[:3]) + more
    elif any(k == "job.json" or k.startswith(("ledger/", "attempts/", "instances/")) for k in keys):
        hint = f"; this is a job's control/ folder: give the folder above it, {store.uri.rstrip('/').rsplit('/', 1)[0]}"
    raise StoreConfigError(
        f"{store.uri} is not a job store: it holds neither checkpoints/ nor control/. Give the job's "
        "checkpoint_uri as rendered for its run, usually <root>/<dag_id>/<run_id> (the folder that holds "
        f"checkpoints/ and control/), or its checkpoints/ folder{hint}"
    )


#: how an error line starts, as the other subcommands' and argparse's own do
_ERROR = "airflow-spot checkpoints: error:"

def run(args: argparse.Namespace) -> int:
    try:
        ckpts = open_checkpoints(args.uri, args.endpoint_url)
        if args.action == "list":
            return _list(ckpts, verify_payloads=not args.quick, verbose=args.verbose)
        if args.action == "verify":
            return _verify(ckpts)
        return _restore(ckpts, args.step, args.to, args.dry_run, args.force)
    except StoreConfigError as exc:
        print(f"{_ERROR} {exc}", file=sys.stderr)
        return EXIT_USAGE
    except BrokenPipeError:
        raise  # our reader went away (| head): not the store's fault; the command line ends quietly
    except store_errors() as exc:
        print(f"{_ERROR} cannot read {args.uri}: {type(exc).__name__}: {exc}{store_error_hint(exc)}", file=sys.stderr)
        return EXIT_BROKEN


def _resume_choice(statuses: list[CheckpointStatus]) -> CheckpointStatus | None:
    good = [s for s in statuses if s.ok]
    return good[-1] if good else None


def _list(ckpts: CheckpointStore, verify_payloads: bool, verbose: bool = False) -> int:
    statuses = ckpts.inspect(verify_payloads=verify_payloads)
    if not verify_payloads:  # as a resume's planning does: a payload that is missing or cut short is broken
        statuses = [dataclasses.replace(s, problem=_size_problem(ckpts, s)) if s.ok else s for s in statuses]
    if not statuses:
        print(f"no checkpoints yet under {ckpts.store.uri}")
        return EXIT_OK
    chosen = _resume_choice(statuses)
    ok = "ok" if verify_payloads else "ok (quick)"
    rows = []
    blocks = 0
    for s in statuses:
        m = s.manifest
        block = max((f.sha256_block for f in m.files), default=0) if m else 0
        blocks += bool(block)
        rows.append((
            "*" if s is chosen else " ",
            str(s.step),
            dt.datetime.fromtimestamp(m.created_at, dt.UTC).strftime("%Y-%m-%d %H:%M:%S") if m else "?",
            _human(m.size) if m else "?",
            m.writer if m else "?",
            "?" if m is None else f"block {_human(block).replace('.0 ', ' ')}" if block else "sha256",
            ok if s.ok else f"BROKEN: {s.problem}",
            s.directory,
        ))
    header = ("", "STEP", "SAVED (UTC)", "SIZE", "WRITER", "DIGEST", "STATUS", "")
    # every column as wide as its widest cell; STATUS (free text when broken) and the directory follow unpadded
    widths = [max(len(r[i]) for r in (header, *rows)) for i in range(6)]
    right = (False, True, False, True, False, False)

    def cells(r: tuple[str, ...]) -> str:
        return "  ".join(c.rjust(w) if rj else c.ljust(w) for c, w, rj in zip(r[1:6], widths[1:], right[1:]))

    print(f"checkpoints under {ckpts.store.uri} (oldest first; '*' = the one a resume uses)")
    print(f"  {cells(header)}  STATUS")
    for r in rows:
        print(f"{r[0]} {cells(r)}  {r[6]}  [{r[7]}]")
    if chosen is None:
        print("no checkpoint verifies: a resume refuses to start (see `airflow-spot checkpoints verify`)")
    if not verify_payloads:
        print(f"'{ok}': manifest and payload size checked, payload digest not read; "
              f"`airflow-spot checkpoints verify {ckpts.store.uri}` re-hashes the payloads")
    if verbose and blocks:
        print(f"{blocks} checkpoint(s) name a block SHA-256 (manifest schema 3), which an airflow-spot from before "
              f"block digests cannot read; while such versions remain, set {DIGEST_ENV}=sha256 on the Airflow "
              "workers so that new saves name a whole-file sha256")
    return EXIT_OK


def _size_problem(ckpts: CheckpointStore, status: CheckpointStatus) -> str | None:
    """What is wrong with a checkpoint's payload files short of their digests: missing, or another size."""
    for entry in status.manifest.files:
        key = f"{status.directory}/{entry.name}"
        try:
            size = ckpts.store.size(key)
        except ObjectNotFound:
            return f"checkpoint {key}: file is missing"
        if size != entry.size:
            return f"checkpoint {key}: size {size} != {entry.size} in manifest"
    return None


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


def _restore(ckpts: CheckpointStore, step: int, to: str | None, dry_run: bool, force: bool = False) -> int:
    statuses = ckpts.inspect(verify_payloads=True)
    at_step = [s for s in statuses if s.step == step and s.ok]
    if not at_step:
        good = sorted({s.step for s in statuses if s.ok})
        print(f"{_ERROR} no verified checkpoint at step {step} under {ckpts.store.uri}; "
              f"verified steps: {good or 'none'}", file=sys.stderr)
        return EXIT_USAGE
    chosen = at_step[-1]
    if to is not None:
        return _copy_out(ckpts, chosen, to, dry_run, force)
    doomed = [s for s in statuses if s.step > step or (s.step == step and not s.ok)]
    if not doomed:
        print(f"step {step} ({chosen.directory}) is already the newest usable checkpoint under {ckpts.store.uri}: "
              "a resume starts from it; nothing was moved")
        return EXIT_OK
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
        print(f"{_ERROR} after the moves a resume would use step {now}, not {step}; is the job still running?",
              file=sys.stderr)
        return EXIT_BROKEN
    print(f"a resume now starts from step {step} ({chosen.directory}); moved {len(doomed)} checkpoint(s) under "
          f"{ckpts.store.uri}/{QUARANTINE}/ (move them back to undo)")
    return EXIT_OK


class _TargetError(Exception):
    """The copy's target could not be written (kept apart from the store's own errors)."""


def _copy_out(ckpts: CheckpointStore, chosen: CheckpointStatus, to: str, dry_run: bool = False,
              force: bool = False) -> int:
    """``restore --to``: copy ``chosen``'s verified payload to ``to`` (a file, or a folder to hold it),
    through a temporary file beside the target, so a failed copy leaves any file already there as it was.
    A file already at the target is replaced only with ``force`` (it may be the user's only other copy).
    ``dry_run``: say what would be copied, write nothing."""
    if chosen.manifest.layout is not None:
        return _copy_out_folder(ckpts, chosen, to, dry_run, force)
    entry = chosen.manifest.files[0]
    target = os.path.abspath(os.path.join(to, entry.name) if os.path.isdir(to) else to)
    folder = os.path.dirname(target)
    step = chosen.step
    if not os.path.isdir(folder):
        what = "is not a folder" if os.path.exists(folder) else "does not exist"
        print(f"{_ERROR} cannot write {target}: its folder {folder} {what}; create it (mkdir -p {folder}) or give "
              f"--to an existing folder. Nothing was copied; step {step} verifies and the store is unchanged",
              file=sys.stderr)
        return EXIT_USAGE
    if os.path.isdir(target):
        print(f"{_ERROR} cannot write {target}: a folder is there; give --to that folder's parent or a file path. "
              f"Nothing was copied; step {step} verifies and the store is unchanged", file=sys.stderr)
        return EXIT_USAGE
    exists = os.path.exists(target)
    if exists and not force and not dry_run:
        print(f"{_ERROR} {target} exists; give --force to replace it, or --to another path. Nothing was copied; "
              f"step {step} verifies and the store is unchanged", file=sys.stderr)
        return EXIT_USAGE
    if dry_run:
        replaces = ("" if not exists else " (replacing the file there)" if force
                    else " (a file is there: the copy needs --force to replace it)")
        print(f"would copy step {step} ({chosen.directory}/{entry.name}, verified) to {target}{replaces}; "
              "nothing was copied and the store is unchanged")
        return EXIT_OK
    partial = os.path.join(folder, f".{os.path.basename(target)}.partial-{uuid.uuid4().hex[:8]}")

    def copy(path: str) -> None:
        try:
            shutil.copyfile(path, partial)
            os.replace(partial, target)
        except OSError as exc:
            raise _TargetError(exc) from exc
        finally:
            if os.path.exists(partial):
                os.unlink(partial)

    try:
        ckpts.fetch_verified(chosen.manifest, entry, copy)
    except _TargetError as exc:
        cause = exc.__cause__
        print(f"{_ERROR} cannot write {target}: {getattr(cause, 'strerror', None) or cause}; give --to a path you "
              f"can write. Nothing was copied; step {step} verifies and the store is unchanged", file=sys.stderr)
        return EXIT_USAGE
    print(f"copied step {step} ({chosen.directory}/{entry.name}, verified) to {target}; the store is unchanged")
    return EXIT_OK


def _copy_out_folder(ckpts: CheckpointStore, chosen: CheckpointStatus, to: str, dry_run: bool, force: bool) -> int:
    """``restore --to`` of a sharded checkpoint: every file, verified, into the folder ``to`` (created), under the
    names torch.distributed.checkpoint reads (``dcp.load(..., checkpoint_id=to)``; ``state.pt`` beside them)."""
    folder, step, names = os.path.abspath(to), chosen.step, [e.name for e in chosen.manifest.files]
    if os.path.exists(folder) and not os.path.isdir(folder):
        print(f"{_ERROR} step {step} is a sharded checkpoint of {len(names)} files: give --to a folder, not the file "
              f"{folder}. Nothing was copied; the store is unchanged", file=sys.stderr)
        return EXIT_USAGE
    there = [n for n in names if os.path.exists(os.path.join(folder, n))]
    if there and not force and not dry_run:
        print(f"{_ERROR} {folder} already holds {there}; give --force to replace them, or --to another folder. "
              f"Nothing was copied; step {step} verifies and the store is unchanged", file=sys.stderr)
        return EXIT_USAGE
    if dry_run:
        print(f"would copy step {step} ({chosen.directory}: {len(names)} files, verified) into {folder}; nothing was "
              "copied and the store is unchanged")
        return EXIT_OK
    try:
        os.makedirs(folder, exist_ok=True)
    except OSError as exc:
        print(f"{_ERROR} cannot create {folder}: {exc.strerror or exc}; nothing was copied", file=sys.stderr)
        return EXIT_USAGE
    # verified into a temporary folder first, so a failed copy leaves the files already in ``folder`` as they were
    partial = os.path.join(folder, f".partial-{uuid.uuid4().hex[:8]}")
    try:
        os.mkdir(partial)
        ckpts.fetch_all(chosen.manifest, partial)
        for name in names:
            os.replace(os.path.join(partial, name), os.path.join(folder, name))
    except OSError as exc:
        print(f"{_ERROR} cannot write into {folder}: {exc.strerror or exc}; give --to a folder you can write",
              file=sys.stderr)
        return EXIT_USAGE
    finally:
        shutil.rmtree(partial, ignore_errors=True)
    print(f"copied step {step} ({chosen.directory}: {len(names)} files, verified) into {folder}; the store is "
          "unchanged")
    return EXIT_OK


def _human(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n} B"
