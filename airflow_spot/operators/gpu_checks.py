"""GPU checks of a spot training job, run when the DAG file is parsed: the GPU request against what the
market offers (counts, memory, model names), its regions and zones, and whether the deadline can be met.
"""
from __future__ import annotations

import dataclasses
import functools
from datetime import timedelta
from typing import Any

from airflow_spot.policy.offers import GpuRequest, Market


def validate_gpus(gpus: Any) -> GpuRequest:
    if gpus is None:
        return GpuRequest()
    if isinstance(gpus, GpuRequest):
        try:
            return _canonical_gpu_names(gpus)
        except ValueError as exc:  # "a10g" allowed and "A10G" excluded
            raise SpotTrainingConfigError(f"gpus: {exc}") from exc
    if isinstance(gpus, dict):
        fields = [f.name for f in dataclasses.fields(GpuRequest)]
        unknown = sorted(set(gpus) - set(fields))
        if unknown:
            raise SpotTrainingConfigError(f"gpus: unknown keys {unknown}; valid: {', '.join(fields)}")
        try:
            return _canonical_gpu_names(GpuRequest.from_dict(gpus))
        except (TypeError, ValueError) as exc:
            raise SpotTrainingConfigError(f"gpus: {exc}") from exc
    raise SpotTrainingConfigError(f"gpus must be a GpuRequest or a dict of its fields, got {gpus!r}")


def _canonical_gpu_names(request: GpuRequest) -> GpuRequest:
    """``names`` and ``exclude_names`` spelt as the markets spell them (``a10g`` -> ``A10G``), as the command
    line's ``--gpu-names`` are (``cli_types.canonical_gpu_name``): a GPU model is matched whatever its case,
    in a DAG as in ``airflow-spot offers``. A name no known model folds to is left as it is, for
    :func:`validate_gpus_offered` to report with the closest known names."""
    from airflow_spot.market.throughput import RELATIVE_THROUGHPUT_PER_GPU

    folded: dict[str, list[str]] = {}
    for known in RELATIVE_THROUGHPUT_PER_GPU:
        folded.setdefault(known.casefold(), []).append(known)

    def canonical(name: str) -> str:
        same = folded.get(name.casefold(), [])
        return same[0] if name not in RELATIVE_THROUGHPUT_PER_GPU and len(same) == 1 else name

    names = tuple(canonical(n) for n in request.names)
    exclude = tuple(canonical(n) for n in request.exclude_names)
    if (names, exclude) == (request.names, request.exclude_names):
        return request
    return dataclasses.replace(request, names=names, exclude_names=exclude)


def validate_deadline_feasible(total_steps: int, deadline: timedelta | None, request: GpuRequest,
                               step_profile: Any, market_options: dict[str, Any] | None = None) -> None:
    """With a declared ``step_profile`` and a deadline: fail at parse time when the profile says the work
    alone outlasts the deadline on the fastest instance type the request allows (the bundled catalog's, with
    the market's ``throughput_overrides``), as ``simulate`` refuses such a deadline. Without a profile the
    job's pace is not known before it runs."""
    from airflow_spot.market.catalog import CatalogMarket
    from airflow_spot.operators.planning import profile_step_seconds

    if deadline is None or not step_profile:
        return
    profile = validate_step_profile(step_profile)
    options = market_options or {}
    try:
        offers = CatalogMarket(catalog_path=options.get("catalog_path"), architectures=("x86_64", "arm64"),
                               throughput_overrides=options.get("throughput_overrides")).offers_of_every_count()
    except (OSError, ValueError, TypeError):
        return  # validate_gpus_offered says what is wrong with the catalog
    loose = {"max_price_per_hour": None, "regions": (), "markets": tuple(Market), "zones": ()}
    fits = [o for o in offers if dataclasses.replace(request, **loose).matches(o)]
    if not fits:
        return
    fastest = max(fits, key=lambda o: o.relative_throughput)
    per_step = profile_step_seconds(profile, fastest, offers)
    if per_step is None:
        return
    least = total_steps * per_step
    if least >= deadline.total_seconds():
        raise SpotTrainingConfigError(
            f"deadline {deadline} cannot be met: the declared step_profile predicts {per_step:.3g} s per step on "
            f"the fastest instance type the request allows ({fastest.instance_type}, {fastest.gpu_name}), so "
            f"{total_steps} steps take at least {least / 3600:.2f} h before any start-up; give a deadline of "
            f"more than that, fewer steps, or faster GPUs")


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
    _check_gpu_names(request, offers, market_options)
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
    shaped = dataclasses.replace(hardware, names=(), exclude_names=())
    if request.names and any(shaped.matches(o) for o in offers):
        # the GPU models are what no offer has: the fix is the names (or the count), not less memory
        wanted = sorted({(o.gpu_name, o.gpu_count, o.gpu_memory_gib) for o in offers if o.gpu_name in request.names})
        fitting = sorted({o.gpu_name for o in offers if shaped.matches(o)} - set(request.exclude_names))
        raise SpotTrainingConfigError(
            f"gpus: no instance type offers {request.count} GPU(s) with >= {request.min_memory_gib:g} GiB each "
            f"named {list(request.names)}; "
            + (f"those GPUs come as {', '.join(f'{n} x {g} ({m:g} GiB each)' for g, n, m in wanted)}"
               if wanted else "no instance type of the catalog has those GPUs")
            + f", and the GPUs offered {request.count} per instance with >= {request.min_memory_gib:g} GiB each are "
            f"{fitting}: choose names among those"
            + (", or a count and min_memory_gib that the named GPUs come with" if wanted else ""))
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


def _check_gpu_names(request: GpuRequest, offers: list, market_options: dict[str, Any] | None) -> None:
    """A GPU name in ``names`` or ``exclude_names`` that no market can ever offer is a typo: the markets
    offer only GPU models with a throughput figure (``market/throughput.py``, plus the market's
    ``throughput_overrides``), and the catalog's. Said here with the closest known names, as the command line
    says it for ``--gpu-names``; otherwise a name among several is silently never matched (or never excluded),
    and a single one reads as "no instance type offers N GPU(s)"."""
    import difflib

    from airflow_spot.market.throughput import RELATIVE_THROUGHPUT_PER_GPU

    overrides = (market_options or {}).get("throughput_overrides")
    known = list(RELATIVE_THROUGHPUT_PER_GPU)
    known += sorted(({str(n) for n in (overrides if isinstance(overrides, dict) else ())}
                     | {o.gpu_name for o in offers}) - set(known))
    for field in ("names", "exclude_names"):
        unknown = [n for n in getattr(request, field) if n not in known]
        if not unknown:
            continue
        folded = {k.casefold(): k for k in reversed(known)}
        hints = []
        for name in unknown:
            close = difflib.get_close_matches(name.casefold(), list(folded), n=3, cutoff=0.6)
            hints.append(f"{name!r} (did you mean {' or '.join(repr(folded[c]) for c in close)}?)" if close
                         else repr(name))
        offered = sorted({o.gpu_name for o in offers if o.gpu_count == request.count
                          and o.gpu_memory_gib >= request.min_memory_gib})
        raise SpotTrainingConfigError(
            f"gpus: unknown GPU name{'s' if len(unknown) > 1 else ''} {', '.join(hints)} in {field}; valid GPU "
            f"names (matched whatever their case): {', '.join(known)}"
            + (f"; those offered {request.count} per instance with >= {request.min_memory_gib:g} GiB each: "
               f"{offered}" if offered and field == "names" else ""))


@functools.lru_cache(maxsize=4)
def _catalog_zones(catalog_path: str | None) -> dict[str, str]:
    """``{zone id: region}`` of the catalog."""
    from airflow_spot.market.catalog import CATALOG_PATH, read_catalog

    return {r.zone_id: r.region for r in read_catalog(catalog_path or CATALOG_PATH)}


def validate_market_regions(backend: str, backend_options: dict[str, Any] | None,
                            market_options: dict[str, Any] | None) -> None:
    """Fail at parse time when the ``ec2`` market may offer a region the ``ec2`` backend cannot launch into
    (the first such offer ranked first would fail its segment, hours into the job). Without ``regions`` in
    ``market_options`` the market takes the backend's (:func:`airflow_spot.hooks.spot.market_options_for`)."""
    market_options, backend_options = market_options or {}, backend_options or {}
    if backend != "ec2" or market_options.get("kind") not in (None, "ec2") or "regions" not in market_options:
        return

    def listed(value: Any) -> set[str] | None:
        items = [value] if isinstance(value, str) else value
        if not isinstance(items, (list, tuple)) or any("{{" in str(v) for v in items):
            return None  # malformed (the backend's or market's own check says so) or known only when rendered
        return {str(v) for v in items}

    market = listed(market_options["regions"])
    launchable = listed(backend_options.get("regions", ["us-east-1"]))
    if market is None or launchable is None:
        return
    if market - launchable:
        raise SpotTrainingConfigError(
            f"market_options regions {sorted(market)} include {sorted(market - launchable)}, which the ec2 backend "
            f"cannot launch into (backend_options regions {sorted(launchable)}): list the same regions in both, or "
            "leave regions out of market_options (it then offers from the backend's)")


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


# Imported last: validation.py re-exports the names above at its end, so either module may be imported first.
from airflow_spot.operators.validation import SpotTrainingConfigError, validate_step_profile  # noqa: E402
