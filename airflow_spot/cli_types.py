"""argparse value types and checks shared by the ``airflow-spot`` subcommands: each names the flag in its error."""
from __future__ import annotations

import argparse
import json
from collections.abc import Callable, Iterable


def json_object(flag: str) -> Callable[[str], dict]:
    """A ``type=`` for a flag whose value is a JSON object (backend or market options)."""

    def parse(text: str) -> dict:
        try:
            value = json.loads(text)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(f"{flag} must be a JSON object: {exc}") from None
        if not isinstance(value, dict):
            raise argparse.ArgumentTypeError(f"{flag} must be a JSON object, got {text!r}")
        return value

    return parse


#: help of ``--aws-conn-id`` (``offers``, ``reap``)
AWS_CONN_ID_HELP = ("Airflow AWS connection for cloud backends (default: aws_default); 'none': no connection, "
                    "boto3's default credential chain (environment, ~/.aws, instance profile)")


def aws_conn_id(text: str) -> str | None:
    """A ``type=`` for ``--aws-conn-id``: an Airflow connection id, or ``none`` (any case) for ``None``,
    which makes the Amazon provider's hooks use boto3's default credential chain."""
    value = text.strip()
    if not value:
        raise argparse.ArgumentTypeError(
            "--aws-conn-id must name an Airflow AWS connection (e.g. aws_default), or be 'none' for boto3's "
            "default credential chain; got an empty string")
    return None if value.lower() == "none" else value


def known_gpu_names(extra: Iterable[str] = ()) -> list[str]:
    """The GPU models the markets know (those with a throughput figure), plus ``extra`` (a market's
    ``throughput_overrides``), in the throughput table's order."""
    from airflow_spot.market.throughput import RELATIVE_THROUGHPUT_PER_GPU

    names = list(RELATIVE_THROUGHPUT_PER_GPU)
    return names + [str(n) for n in extra if n not in RELATIVE_THROUGHPUT_PER_GPU]


def canonical_gpu_name(name: str, known: Iterable[str] | None = None) -> str:
    """``name`` spelt as the catalog spells it (``v100`` -> ``V100``, ``a100-80gb`` -> ``A100-80GB``).

    :raises ValueError: an unknown name; the message suggests the closest known ones and lists them all.
    """
    import difflib

    known = list(known_gpu_names() if known is None else known)
    if name in known:
        return name
    folded = {}
    for k in known:
        folded.setdefault(k.casefold(), []).append(k)
    same = folded.get(name.casefold(), [])
    if len(same) == 1:
        return same[0]
    close = difflib.get_close_matches(name.casefold(), list(folded), n=3)
    hint = f" (did you mean {' or '.join(repr(folded[c][0]) for c in close)}?)" if close else ""
    raise ValueError(f"unknown GPU {name!r}{hint}; valid GPU names: {', '.join(known)}")


def canonical_gpu_names(flag: str, names: Iterable[str], known: Iterable[str] | None = None) -> list[str]:
    """:func:`canonical_gpu_name` of each of ``names``; the error names ``flag``."""
    known = list(known_gpu_names() if known is None else known)
    out = []
    for name in names:
        try:
            out.append(canonical_gpu_name(name, known))
        except ValueError as exc:
            raise ValueError(f"{flag}: {exc}") from None
    return out


#: the most $/h a price flag takes for one instance: the dearest GPU instances cost under $100/h on demand, so
#: anything near this is a typo (a price per month, a stray exponent), and far above it the figures overflow
MAX_PRICE_PER_HOUR = 10_000.0


def check_price(flag: str, value: float | None, what: str = "$/h of one instance") -> None:
    """Refuse a price that is not a plausible $/h: not a number, not > 0, or above
    :data:`MAX_PRICE_PER_HOUR` (``1e300`` printed 300-digit costs); the message names ``flag``."""
    if value is None:
        return
    if not value > 0:  # also NaN
        raise ValueError(f"{flag} is {what} and must be > 0, got {value}")
    if not value <= MAX_PRICE_PER_HOUR:
        raise ValueError(f"{flag} is {what} and must be at most {MAX_PRICE_PER_HOUR:,.0f} (no GPU instance costs "
                         f"that much an hour: a typo, or a price per month?), got {value:g}")
