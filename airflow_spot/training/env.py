"""Environment variables through which the agent hands one segment to the user's training command.

The agent sets them from the :class:`~airflow_spot.storage.protocol.SegmentRequest`; ``SpotSession.from_env``
reads them. A script run by hand without them trains in a local directory (see ``SpotSession.from_env``).
"""
from __future__ import annotations

JOB_URI = "SPOT_JOB_URI"  # job root: checkpoints/ and control/ live under it
ATTEMPT_ID = "SPOT_ATTEMPT_ID"  # heartbeat key and checkpoint writer identity
START_STEP = "SPOT_START_STEP"
END_STEP = "SPOT_END_STEP"  # exclusive; the session commits a checkpoint at end and exits 0
NOTICE_FILE = "SPOT_NOTICE_FILE"  # a file whose appearance means "preemption notice" (local backend)
IMDS_URL = "SPOT_IMDS_URL"  # base URL of EC2 instance metadata, e.g. http://169.254.169.254
NOTICE_POLL_SECONDS = "SPOT_NOTICE_POLL_SECONDS"
NOTICE_WINDOW_SECONDS = "SPOT_NOTICE_WINDOW_SECONDS"  # notice to kill: an emergency save must commit within it
MTBF_SECONDS = "SPOT_MTBF_SECONDS"  # prior mean time between preemptions of the pool
CKPT_MIN_INTERVAL = "SPOT_CKPT_MIN_INTERVAL"
CKPT_MAX_INTERVAL = "SPOT_CKPT_MAX_INTERVAL"
CKPT_KEEP = "SPOT_CKPT_KEEP"
CKPT_POLICY = "SPOT_CKPT_POLICY"  # name in policy.checkpoint_interval (daly | young | fixed)
HEARTBEAT_SECONDS = "SPOT_HEARTBEAT_SECONDS"
WARM_START_URI = "SPOT_WARM_START_URI"  # another job's checkpoint root to start from when this job has none
TOTAL_STEPS = "SPOT_TOTAL_STEPS"  # length of the whole job: a segment ending there never hands off
# Warm process (training/handoff.py): the agent's hand-off directory for this process, and how long the
# process waits there for the next segment after committing its end checkpoint.
HANDOFF_DIR = "SPOT_HANDOFF_DIR"
HANDOFF_WAIT = "SPOT_HANDOFF_WAIT"
COMMAND_TOKEN = "SPOT_COMMAND_TOKEN"  # the agent's mark on every process of one command (see handoff.py)
OUTCOME_FILE = "SPOT_OUTCOME_FILE"  # the session writes "preempted" there when a notice ended the attempt
WARM_PROCESS = "SPOT_WARM_PROCESS"  # "0" in a request's env opts out of the warm process
