"""Checks of a spot training job's arguments, run when the DAG file is parsed.

Each failure raises :class:`SpotTrainingConfigError` (a ``ValueError``) naming the argument, the value and
the fix, so a typo shows up as a DAG import error instead of an expensive failed run.
"""
from __future__ import annotations

import dataclasses
import functools
import json
import shlex
from datetime import timedelta
from typing import Any
from urllib.parse import urlparse

from airflow_spot.backends.base import backend_class, backend_names
from airflow_spot.policy.offers import GpuRequest, Market
from airflow_spot.storage.object_store import uri_problem

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


def validate_gpus(gpus: Any) -> GpuRequest:
    if gpus is None:
        return GpuRequest()
    if isinstance(gpus, GpuRequest):
        return gpus
    if isinstance(gpus, dict):
        fields = [f.name for f in dataclasses.fields(GpuRequest)]
        unknown = sorted(set(gpus) - set(fields))
        if unknown:
            raise SpotTrainingConfigError(f"gpus: unknown keys {unknown}; valid: {', '.join(fields)}")
        try:
            return GpuRequest.from_dict(gpus)
        except (TypeError, ValueError) as exc:
            raise SpotTrainingConfigError(f"gpus: {exc}") from exc
    raise SpotTrainingConfigError(f"gpus must be a GpuRequest or a dict of its fields, got {gpus!r}")


def validate_gpus_offered(request: GpuRequest, market_options: dict[str, Any] | None = None) -> None:
    """Fail at parse time when no GPU instance type at all can satisfy ``request``.

    The check uses the bundled catalog (local data, no cloud call while a DAG file is parsed), which lists
    the NVIDIA training instance types of AWS: a request nobody sells (e.g. 64 GPUs of 500 GiB) would
    otherwise wait in every segment for an offer that never comes. Only the hardware is checked here
    (count, memory, names); prices, regions, zones and markets move, and are checked when a segment plans.

    :param request: what each instance needs.
    :param market_options: the job's market options; a ``catalog_path`` there replaces the bundled catalog.
    """
    from airflow_spot.market.catalog import CatalogMarket, instance_architecture

    catalog_path = (market_options or {}).get("catalog_path")
    architectures = (market_options or {}).get("architectures") or ("x86_64",)
    try:
        market = CatalogMarket(catalog_path=catalog_path, architectures=("x86_64", "arm64"))
        offers = market.offers_of_every_count()
    except (OSError, ValueError) as exc:
        raise SpotTrainingConfigError(f"market_options: cannot read the catalog {catalog_path!r}: {exc}") from exc
    loose = {"max_price_per_hour": None, "regions": (), "markets": tuple(Market)}
    loose.update({"zones": ()} if hasattr(request, "zones") else {})
    hardware = dataclasses.replace(request, **loose)
    fits = [o for o in offers if hardware.matches(o)]
    if any(instance_architecture(o.instance_type) in architectures for o in fits):
        return
    if fits:
        raise SpotTrainingConfigError(
            f"gpus: only Graviton (arm64) instance types offer {request.count} GPU(s)"
            + (f" named {list(request.names)}" if request.names else "")
            + f", e.g. {fits[0].instance_type}, and the job's image is {list(architectures)}: give the job an arm64 "
            "image and market_options={'architectures': ['arm64']}, or ask for other GPUs")
    shapes = sorted({(o.gpu_count, o.gpu_memory_gib, o.gpu_name) for o in offers})
    biggest = max(shapes, key=lambda s: (s[0], s[1]))
    counts = sorted({s[0] for s in shapes})
    raise SpotTrainingConfigError(
        f"gpus: no instance type offers {request.count} GPU(s) with >= {request.min_memory_gib:g} GiB each"
        + (f" named {list(request.names)}" if request.names else "")
        + (f" ({hardware.describe_mismatch(offers)})" if hasattr(hardware, "describe_mismatch") else "")
        + f"; instance types come with {counts} GPUs, the largest is "
        f"{biggest[0]} x {biggest[2]} with {biggest[1]:g} GiB each: lower gpus count or min_memory_gib"
    )


@functools.lru_cache(maxsize=4)
def _catalog_zones(catalog_path: str | None) -> dict[str, str]:
    """``{zone id: region}`` of the catalog."""
    from airflow_spot.market.catalog import CATALOG_PATH, read_catalog

    return {r.zone_id: r.region for r in read_catalog(catalog_path or CATALOG_PATH)}


def validate_places(request: GpuRequest, backend: str = "local", market_options: dict[str, Any] | None = None) -> None:
    """Fail at parse time on a region or zone no offer of the job's market can ever be in. The bundled
    catalog (the ``local`` backend's market, or ``catalog_path``'s) knows its regions and names zones by id
    (``use1-az1``); the ``ec2`` market takes AWS regions and names zones as EC2 reports them to the account
    (``us-east-1a``, ``us-west-2-lax-1a``: a zone's name starts with its region's). Without this a spot
    zone that matches nothing leaves only on-demand offers, silently."""
    if not request.regions and not request.zones:
        return  # nothing to check, and no botocore to load at every parse
    options = market_options or {}
    kind = options.get("kind") or ("ec2" if backend == "ec2" else "catalog")
    if kind == "ec2":
        from airflow_spot.market.aws_regions import known_regions

        regions = known_regions()
        unknown = sorted(set(request.regions) - regions)
        if unknown:
            raise SpotTrainingConfigError(f"gpus: unknown AWS region(s) {unknown} in regions; valid regions include "
                                          f"{', '.join(sorted(regions))}")
        unnamed = [z for z in request.zones if not any(z.startswith(r) and len(z) > len(r) for r in regions)]
        if unnamed:
            raise SpotTrainingConfigError(
                f"gpus: zones {unnamed} are not zone names of an AWS region; the ec2 market names zones as EC2 "
                "reports them to this account (us-east-1a), and zone ids (use1-az1) map to different names in each "
                "account: give zone names (aws ec2 describe-availability-zones lists both)")
        return
    try:
        known = _catalog_zones(options.get("catalog_path"))
    except (OSError, ValueError):
        return  # validate_gpus_offered reports an unreadable catalog
    catalog_regions = set(known.values())
    unknown = sorted(set(request.regions) - catalog_regions)
    if unknown:
        raise SpotTrainingConfigError(f"gpus: regions {unknown} are not in the {backend} backend's catalog; its "
                                      f"regions: {', '.join(sorted(catalog_regions))}")
    missing = [z for z in request.zones if z not in known]
    if missing:
        # the regions meant: a zone name's, a zone id's (by its prefix, use1-), the request's
        regions = ({r for z in missing for r in catalog_regions if z.startswith(r)}
                   | {region for zone, region in known.items() for z in missing
                      if zone.split("-az")[0] == z.split("-az")[0]}
                   | set(request.regions))
        near = sorted(z for z, region in known.items() if region in regions)
        raise SpotTrainingConfigError(
            f"gpus: zones {missing} are not zones of the {backend} backend's catalog, which names zones by id"
            + (f"; its zones there: {near[:24]}" if near else "")
            + " (airflow-spot offers lists the zones of each offer)")


def segment_bounds(total_steps: int, steps_per_segment: int) -> list[tuple[int, int]]:
    """``[start, end)`` of every segment; the last one may be shorter."""
    return [(s, min(s + steps_per_segment, total_steps)) for s in range(0, total_steps, steps_per_segment)]
