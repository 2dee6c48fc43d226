"""Parse-time checks of ``SpotTraining``'s ``segment_options``: unknown, doubled or wrongly typed options fail
when the DAG file is parsed, naming the fix, not later inside a segment task.

Its own module because these checks are about option values, apart from building the task group in
``operators/training.py``, which imports them (``_check_task_kwargs`` stays there: it reads ``SpotTraining``'s
own signature).
"""
from __future__ import annotations

import math
from typing import Any

from airflow_spot.operators.segment import SpotSegmentOperator
from airflow_spot.operators.validation import SpotTrainingConfigError


#: SpotSegmentOperator arguments SpotTraining sets itself (from its own arguments)
_SET_BY_SPOT_TRAINING = frozenset({
    "task_id", "command", "checkpoint_uri", "start_step", "end_step", "total_steps", "segment_index", "job_name",
    "gpus", "backend", "backend_options", "market_options", "env", "cwd", "warm_start_uri", "deadline",
    "max_preemptions", "code_retries", "retries", "retry_delay", "aws_conn_id",
})


#: segment_options that are seconds (> 0), and the smallest heartbeat window: the agent heartbeats every
#: ~2 s at most, a slow step or a big save can hold one back much longer, and a window of a few polls would
#: declare a healthy attempt lost (a false recovery restarts a healthy job)
_SECONDS_OPTIONS = ("poll_interval", "startup_timeout", "heartbeat_timeout", "max_attempt_seconds",
                    "stall_timeout", "idle_timeout_seconds", "notice_window_seconds", "checkpoint_min_interval",
                    "checkpoint_max_interval", "capacity_recheck_seconds", "max_capacity_wait_seconds",
                    "restart_overhead_seconds")
MIN_HEARTBEAT_TIMEOUT = 10.0


def _check_segment_switches(options: dict[str, Any]) -> None:
    """An on/off option (``deferrable``, ``probe_spot``...: the operator's arguments that default to True or
    False) takes True or False: a string such as ``"false"`` would read as true."""
    import inspect

    switches = {name for name, p in inspect.signature(SpotSegmentOperator.__init__).parameters.items()
                if isinstance(p.default, bool)} | {"deferrable"}  # None there: the deployment's default
    for name in sorted(switches & set(options)):
        if options[name] is not None and not isinstance(options[name], bool):
            raise SpotTrainingConfigError(f"segment_options[{name!r}] must be True or False, got {options[name]!r}")


def _check_segment_numbers(options: dict[str, Any]) -> None:
    for name in _SECONDS_OPTIONS:
        value = options.get(name)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < math.inf:
            raise SpotTrainingConfigError(f"segment_options[{name!r}] must be a finite number of seconds > 0, "
                                          f"got {value!r}")
    poll = float(options.get("poll_interval", 5.0))
    window = float(options.get("heartbeat_timeout", 300.0))
    if window < max(MIN_HEARTBEAT_TIMEOUT, 3 * poll):
        raise SpotTrainingConfigError(
            f"segment_options['heartbeat_timeout']={window:g} s would call an attempt lost after a few missed "
            f"heartbeats; use at least {max(MIN_HEARTBEAT_TIMEOUT, 3 * poll):g} s (10 s and 3 x poll_interval)"
        )
    low, high = options.get("checkpoint_min_interval"), options.get("checkpoint_max_interval")
    if low is not None and high is not None and low > high:
        raise SpotTrainingConfigError(
            f"segment_options: checkpoint_min_interval={low:g} is above checkpoint_max_interval={high:g}"
        )
    transfers = ("transfer_seconds", "transfer_dollars", "transfer_seconds_per_gib", "transfer_dollars_per_gib")
    for name in transfers:
        value = options.get(name, 0.0)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0:
            raise SpotTrainingConfigError(f"segment_options[{name!r}] must be a number >= 0, got {value!r}")
    region = options.get("checkpoint_region")
    if region is not None and (not isinstance(region, str) or not region.strip()):
        raise SpotTrainingConfigError(f"segment_options['checkpoint_region'] must be a region name such as "
                                      f"'us-east-1', or 'auto' for the S3 bucket's own, got {region!r}")
    if region is None and any(options.get(name) for name in transfers):
        raise SpotTrainingConfigError(
            f"segment_options {' / '.join(transfers)} price attempts outside the checkpoint store's region; say "
            "which region that is with segment_options['checkpoint_region'] ('auto' asks S3 for the bucket's)"
        )
    keep = options.get("keep_checkpoints")
    if keep is not None and (isinstance(keep, bool) or not isinstance(keep, int) or keep < 1):
        raise SpotTrainingConfigError(f"segment_options['keep_checkpoints'] must be an integer >= 1, got {keep!r}")


def _check_segment_options(options: dict[str, Any], task_kwargs: dict[str, Any]) -> None:
    """Unknown or doubled ``segment_options`` and a wrong ``retry_policy`` fail now, naming the fix."""
    import inspect

    from airflow.sdk import BaseOperator as SdkBaseOperator
    from airflow.sdk import RetryPolicy

    own = set(inspect.signature(SpotSegmentOperator.__init__).parameters) - {"self", "kwargs"}
    valid = sorted(own - _SET_BY_SPOT_TRAINING)
    doubled = sorted(set(options) & _SET_BY_SPOT_TRAINING)
    if doubled:
        raise SpotTrainingConfigError(
            f"segment_options {doubled} are arguments of SpotTraining itself; pass them to SpotTraining directly"
        )
    base = set(inspect.signature(SdkBaseOperator.__init__).parameters)
    unknown = sorted(set(options) - own - base)
    if "reuse_tolerance" in unknown:
        raise SpotTrainingConfigError(
            "segment_options['reuse_tolerance'] is gone: whether a warm spot instance gives way to a cheaper "
            "pool is now the policy's decision, the same the simulator replays (policy/decision.py: move_targets, "
            "which tries the cheaper pools before letting the instance go); remove the option"
        )
    if unknown:
        raise SpotTrainingConfigError(f"unknown segment_options {unknown}; valid: {', '.join(valid)}")
    both = sorted(set(options) & set(task_kwargs))
    if both:
        raise SpotTrainingConfigError(f"{both} given both in segment_options and as SpotTraining arguments; keep one")
    _check_segment_numbers(options)
    _check_segment_switches(options)
    policy = options.get("retry_policy", task_kwargs.get("retry_policy"))
    if policy is not None and not isinstance(policy, RetryPolicy):
        raise SpotTrainingConfigError(
            f"retry_policy must be an airflow.sdk RetryPolicy, e.g. ExceptionRetryPolicy(rules=[RetryRule(...)]), "
            f"got {policy!r}; it is asked before the segment's own policy (preemptions retry at once)"
        )
