"""AWS region names, checked against botocore's endpoint data (no API call), shared by the EC2 market and backend."""
from __future__ import annotations

import functools


@functools.lru_cache(maxsize=1)
def known_regions() -> frozenset[str]:
    """EC2 regions botocore knows in every partition (no API call)."""
    import botocore.session

    session = botocore.session.get_session()
    regions: set[str] = set()
    for partition in session.get_available_partitions():
        regions.update(session.get_available_regions("ec2", partition_name=partition))
    return frozenset(regions)


def validate_regions(regions: list[str]) -> tuple[str, ...]:
    """The regions, checked against botocore's list, so a typo fails with the valid names instead of a
    connection error at the first call."""
    if not regions or not all(isinstance(r, str) and r for r in regions):
        raise ValueError(f"regions must be a non-empty list of AWS region names, e.g. ['us-east-1'], got {regions!r}")
    known = known_regions()
    unknown = sorted(set(regions) - known)
    if unknown:
        raise ValueError(f"unknown AWS region(s) {unknown}; valid regions include: {', '.join(sorted(known))}")
    return tuple(dict.fromkeys(regions))
