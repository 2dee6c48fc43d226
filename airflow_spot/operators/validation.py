"""Checks of a spot training job's arguments, run when the DAG file is parsed.

Each failure raises :class:`SpotTrainingConfigError` (a ``ValueError``) naming the argument, the value and
the fix, so a typo shows up as a DAG import error instead of an expensive failed run.
"""
from __future__ import annotations

import shlex
import shutil
from datetime import timedelta
from typing import Any
from urllib.parse import urlparse

from airflow_spot.backends.base import backend_names
from airflow_spot.policy.offers import GpuRequest

SUPPORTED_SCHEMES = ("file", "s3")


class SpotTrainingConfigError(ValueError):
    """An argument of a spot training job is wrong; the message says which and how to fix it."""


def _templated(value: Any) -> bool:
    return isinstance(value, str) and ("{{" in value or "{%" in value)


def validate_steps(total_steps: Any, steps_per_segment: Any) -> None:
    for name, v in (("total_steps", total_steps), ("steps_per_segment", steps_per_segment)):
        if isinstance(v, bool) or not isinstance(v, int):
            raise SpotTrainingConfigError(f"{name} must be an integer, got {v!r}")
        if v <= 0:
            raise SpotTrainingConfigError(f"{name} must be a positive number of training steps, got {v}")
    if steps_per_segment > total_steps:
        raise SpotTrainingConfigError(
            f"steps_per_segment={steps_per_segment} is larger than total_steps={total_steps}; "
            "use steps_per_segment <= total_steps (one segment: steps_per_segment=total_steps)"
        )


def validate_backend(backend: Any) -> None:
    valid = backend_names()
    if backend not in valid:
        raise SpotTrainingConfigError(f"unknown backend {backend!r}; valid backends: {', '.join(valid)}")


def normalize_command(command: Any, backend: str) -> list[str]:
    """Return the command as an argv list; a string is split like a shell would (no shell runs it)."""
    if isinstance(command, str):
        command = shlex.split(command)
    if not isinstance(command, (list, tuple)) or not command:
        raise SpotTrainingConfigError(
            f"command must be a non-empty list of arguments, e.g. ['python', 'train.py'], got {command!r}"
        )
    if not all(isinstance(a, str) and a for a in command):
        raise SpotTrainingConfigError(f"every argument of command must be a non-empty string, got {command!r}")
    program = command[0]
    # The local backend runs the command on this machine, so a missing program is knowable now.
    if backend == "local" and not _templated(program) and shutil.which(program) is None:
        raise SpotTrainingConfigError(
            f"command {program!r} was not found on PATH; give the full path of the program or install it"
        )
    return list(command)


def validate_checkpoint_uri(uri: Any) -> None:
    if not isinstance(uri, str) or not uri.strip():
        raise SpotTrainingConfigError(f"checkpoint_uri must be a non-empty string, got {uri!r}")
    head = uri.split("{{", 1)[0]
    parsed = urlparse(head)
    if "://" not in head:
        if _templated(uri) and not head:
            return  # the scheme itself comes from a template; checked at run time
        raise SpotTrainingConfigError(
            f"checkpoint_uri {uri!r} has no scheme; use file:///absolute/path or s3://bucket/prefix"
        )
    if parsed.scheme not in SUPPORTED_SCHEMES:
        raise SpotTrainingConfigError(
            f"checkpoint_uri {uri!r} has unsupported scheme {parsed.scheme!r}; use one of: "
            + ", ".join(f"{s}://" for s in SUPPORTED_SCHEMES)
        )
    if parsed.scheme == "file" and parsed.netloc:
        raise SpotTrainingConfigError(f"file checkpoint URIs must be absolute (file:///path), got {uri!r}")
    if parsed.scheme == "s3" and not parsed.netloc and not _templated(uri):
        raise SpotTrainingConfigError(f"s3 checkpoint URIs need a bucket (s3://bucket/prefix), got {uri!r}")


def validate_deadline(deadline: Any) -> None:
    if deadline is None:
        return
    if not isinstance(deadline, timedelta):
        raise SpotTrainingConfigError(
            f"deadline must be a datetime.timedelta from the job's start (or None), got {deadline!r}"
        )
    if deadline <= timedelta(0):
        raise SpotTrainingConfigError(f"deadline must be positive, got {deadline}")


def validate_budget(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise SpotTrainingConfigError(f"{name} must be an integer >= 0, got {value!r}")


def validate_gpus(gpus: Any) -> GpuRequest:
    if gpus is None:
        return GpuRequest()
    if isinstance(gpus, GpuRequest):
        return gpus
    if isinstance(gpus, dict):
        try:
            return GpuRequest.from_dict(gpus)
        except (TypeError, ValueError) as exc:
            raise SpotTrainingConfigError(f"gpus: {exc}") from exc
    raise SpotTrainingConfigError(f"gpus must be a GpuRequest or a dict of its fields, got {gpus!r}")


def segment_bounds(total_steps: int, steps_per_segment: int) -> list[tuple[int, int]]:
    """``[start, end)`` of every segment; the last one may be shorter."""
    return [(s, min(s + steps_per_segment, total_steps)) for s in range(0, total_steps, steps_per_segment)]
