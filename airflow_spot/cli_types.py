"""argparse value types shared by the ``airflow-spot`` subcommands: each names the flag in its error."""
from __future__ import annotations

import argparse
import json
from collections.abc import Callable


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
