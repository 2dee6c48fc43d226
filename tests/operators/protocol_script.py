"""A training command that speaks the airflow-spot protocol without torch (fast to start, for tests).

It trains nothing: each "step" sleeps, writes a heartbeat, and the script commits a checkpoint (through
the real CheckpointStore) when it reaches ``SPOT_END_STEP`` or sees the preemption notice file — exactly
what ``SpotSession`` does for a torch script. ``--fail`` makes it crash like a broken script, ``--hang-at``
hang like a deadlocked one whose heartbeat thread goes on.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

from airflow_spot.storage.checkpoint import CheckpointStore
from airflow_spot.storage.object_store import open_store
from airflow_spot.storage.protocol import PREEMPTED_EXIT_CODE, Heartbeat, JobLayout
from airflow_spot.training import env as E


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--step-seconds", type=float, default=0.02)
    p.add_argument("--fail", default=None, help="print this to stderr and exit 3")
    p.add_argument("--hang-at", type=int, default=None,
                   help="stop stepping at this step but go on heartbeating (a hung collective or data loader)")
    args = p.parse_args()
    if args.fail:
        print(f"Traceback (most recent call last):\nValueError: {args.fail}", file=sys.stderr, flush=True)
        return 3
    store = open_store(os.environ[E.JOB_URI])
    attempt = os.environ[E.ATTEMPT_ID]
    end = int(os.environ[E.END_STEP])
    notice = os.environ.get(E.NOTICE_FILE)
    ckpt = CheckpointStore(store.child("checkpoints"), writer=attempt)
    layout = JobLayout(store)
    step = max(ckpt.latest_step() or 0, int(os.environ[E.START_STEP]))

    first_step_at = None  # as SpotSession's heartbeats: when the attempt finished its first step

    def beat(**kw) -> None:
        layout.write_heartbeat(Heartbeat(attempt, step, time.time(), args.step_seconds, first_step_at=first_step_at,
                                         **kw))

    def commit() -> None:
        ckpt.save(step, lambda f: f.write(str(step).encode()))
        beat(last_committed_step=step)

    while step < end:
        if notice and os.path.exists(notice):
            commit()
            return PREEMPTED_EXIT_CODE
        if step == args.hang_at:
            time.sleep(args.step_seconds)
            beat()
            continue
        time.sleep(args.step_seconds)
        step += 1
        first_step_at = first_step_at or time.time()
        beat()
    commit()
    return 0


if __name__ == "__main__":
    sys.exit(main())
