"""Checks of a spot training job's arguments, run when the DAG file is parsed.

Each failure raises :class:`SpotTrainingConfigError` (a ``ValueError``) naming the argument, the value and
the fix, so a typo shows up as a DAG import error instead of an expensive failed run.
"""
from __future__ import annotations

import json
import logging
import re
import shlex
from datetime import timedelta
from typing import Any
from urllib.parse import urlparse

from airflow_spot.backends.base import backend_class, backend_names
from airflow_spot.storage.object_store import uri_problem

SUPPORTED_SCHEMES = ("file", "s3")


class SpotTrainingConfigError(ValueError):
    """An argument of a spot training job is wrong; the message says which and how to fix it."""


def _templated(value: Any) -> bool:
    return isinstance(value, str) and ("{{" in value or "{%" in value)


#: most segments one job may have. Each segment is a task of the DAG, and building them is worse than
#: linear in their number (Airflow's ``>>`` hashes the DAG, all its task ids included, at every edge):
#: measured on a 2-CPU machine, 2000 segments build in 2-3 s, 4000 in 5-10 s, 12800 in 24 s, 100000 in
#: over 10 minutes, past the dag-processor's 30 s import timeout (and the DAG's serialisation after it takes
#: about as long again). At 15-30 minutes a segment, 2000 segments are three weeks or more of training. The
#: refusal sits where parsing nears the timeout, so a DAG that parses today keeps parsing.
MAX_SEGMENTS = 10000
#: above this many a DAG still parses, slowly (a warning in the DAG processor's log says what to change)
WARN_SEGMENTS = 2000


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
    segments = -(-total_steps // steps_per_segment)
    if segments > MAX_SEGMENTS:
        raise SpotTrainingConfigError(
            f"total_steps={total_steps} in segments of steps_per_segment={steps_per_segment} is {segments} "
            f"segments, more than the {MAX_SEGMENTS} a job may have (each is a task of the DAG, and so many make "
            f"the DAG file too slow to parse); use steps_per_segment >= {-(-total_steps // MAX_SEGMENTS)}. A segment "
            "should be minutes to hours of training (15-30 minutes is best: decisions come at segment ends); it "
            "is not the checkpoint interval, which the training session sets on its own within each segment"
        )
    if segments > WARN_SEGMENTS:
        logging.getLogger(__name__).warning(
            "total_steps=%d in segments of steps_per_segment=%d is %d segments: the DAG takes seconds to parse; "
            "steps_per_segment >= %d keeps it under %d (a segment should be minutes to hours of training)",
            total_steps, steps_per_segment, segments, -(-total_steps // WARN_SEGMENTS), WARN_SEGMENTS)


def validate_backend(backend: Any) -> None:
    valid = backend_names()
    if backend not in valid:
        raise SpotTrainingConfigError(f"unknown backend {backend!r}; valid backends: {', '.join(valid)}")


_TEMPLATE_SPAN = re.compile(r"\{\{.*?\}\}|\{%.*?%\}|\{#.*?#\}", re.S)


def split_command(command: str) -> list[str]:
    """Split a command string like a shell would (no shell runs it), a Jinja span (``{{ ds }}``,
    ``{% ... %}``) kept whole inside its argument: Airflow renders each argument of the list on its own,
    and a span cut at its spaces (``'{{'``, ``'ds'``, ``'}}'``) would not render. A rendered value is one
    argument, whatever spaces it holds (as a quoted shell variable)."""
    spans: list[str] = []

    def hide(match: re.Match) -> str:
        spans.append(match.group(0))
        return f"\x00{len(spans) - 1}\x00"

    args = shlex.split(_TEMPLATE_SPAN.sub(hide, command))
    return [re.sub("\x00(\\d+)\x00", lambda m: spans[int(m.group(1))], arg) for arg in args]


def normalize_command(command: Any, backend: str) -> list[str]:
    """Return the command as an argv list; a string is split like a shell would (no shell runs it), its
    Jinja spans kept whole (:func:`split_command`)."""
    if isinstance(command, str):
        command = split_command(command)
    if not isinstance(command, (list, tuple)) or not command:
        raise SpotTrainingConfigError(
            f"command must be a non-empty list of arguments, e.g. ['python', 'train.py'], got {command!r}"
        )
    if not all(isinstance(a, str) and a for a in command):
        raise SpotTrainingConfigError(f"every argument of command must be a non-empty string, got {command!r}")
    program = command[0]
    # Each backend says what it can check now (local: the program is on PATH of this machine).
    problem = None if _templated(program) else backend_class(backend).command_problem(list(command))
    if problem:
        raise SpotTrainingConfigError(problem)
    return list(command)


def validate_checkpoint_uri(uri: Any) -> None:
    if not isinstance(uri, str) or not uri.strip():
        raise SpotTrainingConfigError(f"checkpoint_uri must be a non-empty string, got {uri!r}")
    head = uri.split("{{", 1)[0]
    parsed = urlparse(head)
    if "://" not in head:
        if _templated(uri) and not head:
            return  # the scheme itself comes from a template; checked at run time
        if parsed.scheme and head.startswith(parsed.scheme + ":"):  # "s3:/bad": a scheme, but no "//"
            raise SpotTrainingConfigError(f"checkpoint_uri: {uri_problem(head)}")
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
    if parsed.scheme == "file" and uri_problem(head.split("{", 1)[0]):  # a '#' or '?' would cut the path
        raise SpotTrainingConfigError(f"checkpoint_uri: {uri_problem(head.split('{', 1)[0])}")
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


def validate_task_id(task_id: Any) -> None:
    if not isinstance(task_id, str) or not task_id.strip():
        raise SpotTrainingConfigError(f"task_id must be a non-empty string naming the job, e.g. 'train', "
                                      f"got {task_id!r}")


def validate_json_options(name: str, value: Any) -> None:
    """``backend_options``/``market_options``/``segment_options``: a dict that survives JSON (trigger kwargs)."""
    if value is None:
        return
    if not isinstance(value, dict) or not all(isinstance(k, str) for k in value):
        raise SpotTrainingConfigError(f"{name} must be a dict with string keys (or None), got {value!r}")
    try:
        json.dumps(value)
    except (TypeError, ValueError) as exc:
        if name == "segment_options":  # timedelta etc. are fine here: they are operator arguments
            return
        raise SpotTrainingConfigError(f"{name} must hold plain JSON values (str, number, list, dict): {exc}") from None


def validate_option_names(backend: str, backend_options: dict | None, market_options: dict | None) -> None:
    """Keys of ``backend_options`` / ``market_options`` that the backend or market class does not take fail
    here, at parse time, naming the ones it does; otherwise a misspelt key is a TypeError on a worker at
    the first segment. ``clients`` is the Airflow layer's to give, not an option."""
    import inspect

    from airflow_spot.backends.base import backend_class
    from airflow_spot.market.base import market_class

    market = dict(market_options or {})
    try:
        backend_cls = backend_class(backend)
    except ValueError as exc:
        raise SpotTrainingConfigError(str(exc)) from None
    try:
        market_cls = market_class(backend, market.get("kind"))
    except ValueError as exc:
        raise SpotTrainingConfigError(f"market_options: {exc}") from None
    for name, options, cls, extra in (("backend_options", backend_options, backend_cls, set()),
                                      ("market_options", market, market_cls, {"kind"})):
        params = inspect.signature(cls.__init__).parameters
        if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
            continue
        valid = sorted(extra | set(params) - {"self", "clients"})
        unknown = sorted(set(options or {}) - set(valid))
        if unknown:
            raise SpotTrainingConfigError(f"{name}: unknown keys {unknown} for {cls.__name__} (backend "
                                          f"{backend!r}); valid: {', '.join(valid)}")
    options = dict(backend_options or {})
    if not any("{{" in str(v) for v in options.values()):  # a templated value is known only when rendered
        problem = backend_cls.options_problem(options)
        if problem:
            raise SpotTrainingConfigError(f"backend_options: {problem}")


def validate_env(env: Any) -> None:
    if env is None:
        return
    if not isinstance(env, dict) or not all(isinstance(k, str) and k and "=" not in k for k in env):
        raise SpotTrainingConfigError(
            f"env must be a dict of variable names to values, e.g. {{'WANDB_MODE': 'offline'}}, got {env!r}"
        )
    bad = {k: v for k, v in env.items() if not isinstance(v, (str, int, float)) or isinstance(v, bool)}
    if bad:
        raise SpotTrainingConfigError(f"env values must be strings (or numbers), got {bad!r}")


def validate_optional_str(name: str, value: Any, example: str) -> None:
    if value is not None and (not isinstance(value, str) or not value):
        raise SpotTrainingConfigError(f"{name} must be a non-empty string (or None), e.g. {example!r}, got {value!r}")


def validate_retry_delay(retry_delay: Any) -> None:
    if not isinstance(retry_delay, timedelta) or retry_delay < timedelta(0):
        raise SpotTrainingConfigError(
            f"retry_delay (wait before retrying a failed training command) must be a datetime.timedelta >= 0, "
            f"e.g. timedelta(seconds=30), got {retry_delay!r}"
        )


def validate_step_profile(profile: Any) -> dict[str, float]:
    """``{"T4": 0.42}``: seconds per step measured per GPU model of the catalog (empty when not given)."""
    from airflow_spot.market.throughput import RELATIVE_THROUGHPUT_PER_GPU

    if profile is None:
        return {}
    if not isinstance(profile, dict):
        raise SpotTrainingConfigError(f"step_profile must be a dict like {{'T4': 0.42}}, got {profile!r}")
    out = {}
    for gpu, seconds in profile.items():
        if gpu not in RELATIVE_THROUGHPUT_PER_GPU:
            raise SpotTrainingConfigError(
                f"step_profile: unknown GPU {gpu!r}; known: {', '.join(RELATIVE_THROUGHPUT_PER_GPU)}")
        if isinstance(seconds, bool) or not isinstance(seconds, (int, float)) or not 0 < seconds < float("inf"):
            raise SpotTrainingConfigError(f"step_profile[{gpu!r}] must be seconds per step > 0, got {seconds!r}")
        out[str(gpu)] = float(seconds)
    return out


def segment_bounds(total_steps: int, steps_per_segment: int) -> list[tuple[int, int]]:
    """``[start, end)`` of every segment; the last one may be shorter."""
    return [(s, min(s + steps_per_segment, total_steps)) for s in range(0, total_steps, steps_per_segment)]


# The GPU, market and place checks live in gpu_checks.py, which imports SpotTrainingConfigError from here; old
# import paths keep working.
from airflow_spot.operators.gpu_checks import (  # noqa: E402, F401
    _canonical_gpu_names, _catalog_zones, _check_gpu_names, validate_deadline_feasible, validate_gpus,
    validate_gpus_offered, validate_market_regions, validate_places,
)
