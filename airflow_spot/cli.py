"""``airflow-spot``: demo, simulate, estimate, reap, offers, checkpoints, availability.

Each subcommand lives in the module that owns its subject and exposes ``add_arguments(parser)`` and
``run(args) -> int``; this file only wires them, importing lazily so ``--help`` stays fast.
"""
from __future__ import annotations

import argparse
import importlib
import os
import sys

#: exit status after stdout was closed by the reader (``airflow-spot ... | head``): 128 + SIGPIPE, what a
#: program that the shell sees killed by SIGPIPE reports
EXIT_BROKEN_PIPE = 141

SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "demo": ("airflow_spot.demo", "train a small torch model through injected preemptions under Airflow"),
    "simulate": ("airflow_spot.simulate.command", "replay a job through the policies on real spot traces"),
    "estimate": ("airflow_spot.simulate.estimate_command", "estimate time and cost of a job per offer"),
    "reap": ("airflow_spot.commands.reap", "find and terminate leftover instances"),
    "offers": ("airflow_spot.commands.offers", "rank the offers a GPU request gets now ($/h, $/step, risk)"),
    "checkpoints": ("airflow_spot.storage.checkpoints_command", "list, verify or restore a job's checkpoints"),
    "availability": ("airflow_spot.storage.availability_command",
                     "show, compact or prune what a deployment's jobs observed of the spot pools"),
}


def _description() -> str:
    """The module docstring's first line as plain text (no reST ``literal`` markup)."""
    return __doc__.splitlines()[0].replace("``", "")


def _version() -> str:
    """The installed distribution's version."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("airflow-spot")
    except PackageNotFoundError:
        return "unknown (the airflow-spot distribution is not installed)"


def build_parser(argv: list[str]) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="airflow-spot", description=_description())
    parser.add_argument("--version", action="version", version=f"%(prog)s {_version()}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    chosen = next((a for a in argv if not a.startswith("-")), None)
    for name, (module, help_text) in SUBCOMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        if name == chosen:  # only import the one being run
            mod = importlib.import_module(module)
            mod.add_arguments(p)
            p.set_defaults(_run=mod.run)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = build_parser(argv).parse_args(argv)
    try:
        code = int(args._run(args) or 0)
        sys.stdout.flush()  # a closed pipe shows here, not at exit, while it can still be handled
    except BrokenPipeError:
        _silence_stdout()
        return EXIT_BROKEN_PIPE
    return code


def _silence_stdout() -> None:
    """Point stdout at /dev/null: what is still buffered for a reader that went away (``| head``) is
    dropped instead of failing again, with a traceback, when Python flushes stdout at exit."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, sys.stdout.fileno())
    except (AttributeError, OSError, ValueError):  # a stdout without a file descriptor (tests)
        sys.stdout = open(os.devnull, "w")  # noqa: SIM115 - lives until exit
    finally:
        os.close(devnull)


if __name__ == "__main__":
    sys.exit(main())
