"""``airflow-spot estimate``: rank instance types for a job before it starts (the offline estimate).

The job's step time comes from a short profiling run — measured here (``--profile-command``, run for a
few hundred steps under the training session, warm-up excluded) or given for one or more GPU models
(``--measured V100=0.42``) — and is scaled to every offer's GPU by the catalog's relative throughput
(:mod:`airflow_spot.market.throughput`). Each offer gets the job's time, its expected cost (preemption
overhead included) and an uncertainty (see :func:`airflow_spot.policy.estimate.rank_offers_for_job`)::

    airflow-spot estimate --steps 200000 --measured V100=0.42 --gpus 1 --top 10
    airflow-spot estimate --steps 200000 --profile-command "python train.py" --profile-as T4
"""
from __future__ import annotations

import argparse
import json
import math
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable

from airflow_spot.cli_types import canonical_gpu_name
from airflow_spot.market.throughput import instance_throughput
from airflow_spot.policy.estimate import WARMUP_STEPS, fit_step_time, rank_offers_for_job
from airflow_spot.policy.offers import GpuRequest, Market

#: seconds between two looks at the profiling run's heartbeat
PROFILE_POLL_SECONDS = 0.05


#: the longest step (a day) and restart overhead (a day) taken; far above these the figures are typos and
#: print hundreds of digits
MAX_STEP_SECONDS = 86_400.0
MAX_RESTART_OVERHEAD_SECONDS = 86_400.0
#: the longest job an estimate is given for, in hours on its fastest offer (about 11 years)
MAX_JOB_HOURS = 100_000.0


class EstimateError(ValueError):
    """A bad argument or a profiling run that measured nothing; the message says what to change."""


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--steps", type=int, required=True, help="training steps of the whole job")
    p.add_argument("--measured", action="append", default=[], metavar="GPU=SECONDS",
                   help="seconds per step measured on one GPU of that type, e.g. V100=0.42 (any case; repeat "
                        "for several types)")
    p.add_argument("--profile-command", default=None,
                   help="measure here: run this training command (a SpotSession script) for --profile-steps steps")
    p.add_argument("--profile-as", default=None, metavar="GPU",
                   help="the GPU model the profiling machine counts as (e.g. T4); required with --profile-command")
    p.add_argument("--profile-steps", type=int, default=200, help="steps of the profiling run")
    p.add_argument("--profile-timeout", type=float, default=600.0, help="seconds the profiling run may take")
    p.add_argument("--gpus", type=int, default=1, help="GPUs per instance")
    p.add_argument("--min-memory-gib", dest="min_memory_gib", type=float, default=0.0, metavar="GIB",
                   help="minimum memory per GPU (--min-memory is the same)")
    p.add_argument("--min-memory", dest="min_memory_gib", type=float, default=argparse.SUPPRESS,
                   help=argparse.SUPPRESS)  # the spelling of `offers`
    p.add_argument("--regions", default="", help="comma-separated regions (default: all)")
    p.add_argument("--restart-overhead-seconds", type=float, default=600.0,
                   help="seconds a new instance works for nothing (boot, restore, warm-up; default 600)")
    p.add_argument("--top", type=int, default=15, help="show this many offers, cheapest expected cost first")
    p.add_argument("--json", dest="json_out", action="store_true", help="print the ranking as JSON")


def parse_measured(items: list[str]) -> dict[str, float]:
    """``["V100=0.42", ...]`` -> ``{"V100": 0.42}``, with errors that name the bad item."""
    out: dict[str, float] = {}
    for item in items:
        gpu, sep, secs = item.partition("=")
        gpu = gpu.strip()
        if not sep or not gpu:
            raise EstimateError(f"--measured {item!r}: expected GPU=SECONDS, e.g. V100=0.42")
        try:
            gpu = canonical_gpu_name(gpu)
        except ValueError as exc:
            raise EstimateError(f"--measured {item!r}: {exc}") from None
        try:
            value = float(secs)
        except ValueError:
            raise EstimateError(f"--measured {item!r}: {secs!r} is not a number of seconds") from None
        if not (value > 0 and math.isfinite(value)):
            raise EstimateError(f"--measured {item!r}: seconds per step must be a positive, finite number, "
                                f"got {value:g}")
        if value > MAX_STEP_SECONDS:
            raise EstimateError(f"--measured {item!r}: seconds per step must be at most {MAX_STEP_SECONDS:,.0f} "
                                f"(a day), got {value:g}; give the seconds of one step, not of the run")
        if out.get(gpu, value) != value:  # two figures for one GPU: which one was meant is a guess
            raise EstimateError(f"--measured gives {gpu} twice ({out[gpu]:g} and {value:g} s); give one figure per "
                                "GPU model (e.g. their mean)")
        out[gpu] = value
    return out


def profile_step_seconds(
    command: list[str], steps: int, *, warmup_steps: int = WARMUP_STEPS, timeout: float = 600.0,
    env: dict[str, str] | None = None, poll: Callable[[float], None] = time.sleep,
) -> float:
    """Run ``command`` for ``steps`` steps as a one-segment job in a scratch store and measure its pace.

    The training session's heartbeats are read every :data:`PROFILE_POLL_SECONDS`; the step time is the
    slope between the first heartbeat past ``warmup_steps`` and the last one (restore, allocator and
    kernel warm-up excluded). Falls back to the session's own EWMA when too few heartbeats landed.

    :raises EstimateError: the command is not found, fails, times out or reports no steps.
    """
    from airflow_spot.storage.object_store import open_store
    from airflow_spot.storage.protocol import JobLayout
    from airflow_spot.training import env as E

    if shutil.which(command[0]) is None:
        raise EstimateError(f"--profile-command: {command[0]!r} was not found on PATH")
    if steps <= warmup_steps + 1:
        raise EstimateError(f"--profile-steps must exceed the {warmup_steps} warm-up steps, got {steps}")
    with tempfile.TemporaryDirectory(prefix="spot-profile-") as tmp:
        store = open_store(f"file://{tmp}")
        layout = JobLayout(store)
        run_env = {**os.environ, **(env or {}), E.JOB_URI: store.uri, E.ATTEMPT_ID: "profile",
                   E.START_STEP: "0", E.END_STEP: str(steps), E.TOTAL_STEPS: str(steps),
                   E.HEARTBEAT_SECONDS: "0.05", E.WARM_PROCESS: "0"}
        # stderr to a file, not a pipe read at the end: a chatty script (logging, warnings, progress bars)
        # would fill the pipe and block until the timeout
        errors = open(os.path.join(tmp, "stderr.txt"), "w+b")  # noqa: SIM115 - closed below, after the run
        proc = subprocess.Popen(command, env=run_env, stdout=subprocess.DEVNULL, stderr=errors)
        samples: list[tuple[int, float]] = []
        deadline = time.monotonic() + timeout
        last = None
        while proc.poll() is None:
            if time.monotonic() > deadline:
                proc.kill()
                proc.wait()
                errors.close()
                raise EstimateError(f"--profile-command ran longer than --profile-timeout={timeout:g} s")
            hb = layout.read_heartbeat("profile")
            if hb is not None and (not samples or hb.step > samples[-1][0]):
                samples.append((hb.step, hb.time))
            last = hb or last
            poll(PROFILE_POLL_SECONDS)
        errors.seek(max(0, os.fstat(errors.fileno()).st_size - 4000))
        err = errors.read().decode(errors="replace")
        errors.close()
        if proc.returncode != 0:
            raise EstimateError(f"--profile-command exited {proc.returncode}:\n{err[-2000:]}")
        last = layout.read_heartbeat("profile") or last
    warm = [s for s in samples if s[0] > warmup_steps and s[0] < steps]
    if len(warm) >= 2 and warm[-1][1] > warm[0][1]:
        return (warm[-1][1] - warm[0][1]) / (warm[-1][0] - warm[0][0])
    if last is not None and last.step_time_ewma:
        return float(last.step_time_ewma)
    raise EstimateError("--profile-command reported no step: does it train through SpotSession.steps()?")


def rank(args: argparse.Namespace) -> tuple[list, object]:
    """The ranking of the market's offers for ``args``; raises :class:`EstimateError` on bad arguments."""
    from airflow_spot.market import get_market

    if args.steps <= 0:
        raise EstimateError(f"--steps must be a positive number of training steps, got {args.steps}")
    if args.gpus < 1:
        raise EstimateError(f"--gpus must be at least 1, got {args.gpus}")
    if args.top < 1:
        raise EstimateError(f"--top is how many offers to show and must be at least 1, got {args.top}")
    if not 0 <= args.restart_overhead_seconds < math.inf:  # also NaN
        raise EstimateError(f"--restart-overhead-seconds is the time a new instance works for nothing and must be "
                            f"a finite number >= 0, got {args.restart_overhead_seconds}")
    if args.restart_overhead_seconds > MAX_RESTART_OVERHEAD_SECONDS:
        raise EstimateError(f"--restart-overhead-seconds is the time a new instance works for nothing and must be "
                            f"at most {MAX_RESTART_OVERHEAD_SECONDS:,.0f} (a day), got "
                            f"{args.restart_overhead_seconds:g}")
    if not args.min_memory_gib >= 0:
        raise EstimateError(f"--min-memory-gib must be >= 0, got {args.min_memory_gib}")
    measured = parse_measured(args.measured)
    if args.profile_as and args.profile_command is None:
        raise EstimateError("--profile-as names the GPU a profiling run stands for, and no --profile-command was "
                            "given: add --profile-command CMD, or give the figure as --measured GPU=SECONDS")
    if args.profile_command is not None:
        if not args.profile_as:
            raise EstimateError("--profile-command needs --profile-as GPU: which GPU model the run stands for")
        try:
            profile_as = canonical_gpu_name(args.profile_as)
        except ValueError as exc:
            raise EstimateError(f"--profile-as: {exc}") from None
        if profile_as in measured:
            raise EstimateError(f"--measured gives {profile_as} a step time and --profile-as {args.profile_as} "
                                "measures it again: give one figure per GPU model (drop one of them)")
        if not 0 < args.profile_timeout < math.inf:  # also NaN, which would never time out
            raise EstimateError(f"--profile-timeout is the seconds the profiling run may take and must be > 0, "
                                f"got {args.profile_timeout}")
        try:
            command = shlex.split(args.profile_command)
        except ValueError as exc:  # an unclosed quote
            raise EstimateError(f"--profile-command {args.profile_command!r} cannot be split into words ({exc}); "
                                "quote it as a shell would") from None
        if not command:
            raise EstimateError("--profile-command is empty; give the training command, e.g. \"python train.py\"")
        measured[profile_as] = profile_step_seconds(command, args.profile_steps, timeout=args.profile_timeout)
    if not measured:
        raise EstimateError("give a step time: --measured GPU=SECONDS, or --profile-command CMD --profile-as GPU")
    # GPU models with one throughput figure (T4 and T4g) are one point of the fit: their log-mean, as a
    # least-squares fit in log space would place them
    logs: dict[float, list[float]] = {}
    for g, t in measured.items():
        logs.setdefault(instance_throughput(g, 1), []).append(math.log(t))
    by_throughput = {x: math.exp(sum(ys) / len(ys)) for x, ys in logs.items()}
    model = fit_step_time(by_throughput)
    regions = list(dict.fromkeys(r.strip() for r in args.regions.split(",") if r.strip()))
    if args.regions.strip() and not regions:
        raise EstimateError(f"--regions {args.regions!r} names no region; give e.g. us-east-1,us-west-2, or leave it "
                            "out for every region")
    try:
        market = get_market("local", regions=regions or None)
        offers = market.offers(GpuRequest(count=args.gpus, min_memory_gib=args.min_memory_gib))
    except ValueError as exc:
        text = str(exc)
        raise EstimateError(f"--regions: {text}" if regions and "regions" in text else text) from exc
    if not offers:
        # say what the catalog has in the regions asked, so the fix is a choice, not a guess
        shapes = {(o.gpu_count, o.gpu_memory_gib) for o in market.offers_of_every_count()}
        where = f" in regions {regions}" if regions else " in the catalog"
        raise EstimateError(
            f"no offer has {args.gpus} GPU(s) with >= {args.min_memory_gib:g} GiB each{where}; instances there "
            f"have {sorted({n for n, _ in shapes})} GPUs, at most "
            f"{max((m for _, m in shapes), default=0):g} GiB each: loosen --gpus, --min-memory-gib or --regions")
    ranked = rank_offers_for_job(offers, args.steps, model, list(by_throughput),
                                 overhead_seconds=args.restart_overhead_seconds)
    shortest = min((e.hours for e in ranked), default=0.0)
    if not shortest <= MAX_JOB_HOURS:  # also NaN
        raise EstimateError(f"the job of --steps {args.steps} would take {shortest:.3g} hours even on its fastest "
                            f"offer, more than {MAX_JOB_HOURS:,.0f} (about 11 years): check --steps (the whole "
                            f"job's steps) and the step time (--measured: the seconds of one step)")
    return ranked, model


def run(args: argparse.Namespace) -> int:
    try:
        ranked, model = rank(args)
    except EstimateError as exc:
        print(f"airflow-spot estimate: {exc}", file=sys.stderr)
        return 2
    if args.json_out:
        print(json.dumps([e.to_dict() for e in ranked[: args.top]], indent=2))
        return 0
    print(f"step time fit: t = {model.step_seconds(1.0):.4f} s on a V100 x throughput^{0.0 - model.b:.2f}")
    if model.b < 0:  # the GPU the catalog calls faster measured slower: the ranking below trusts that fit
        print("warning: the measurements say the faster GPUs are slower for this job (a positive exponent); "
              "check that each --measured figure is the step time of the same job and batch on that GPU",
              file=sys.stderr)
    print(f"{'instance':<16}{'market':<11}{'zone':<14}{'GPU':<10}{'$/h':>8}{'hours':>9}{'expected $':>12}{'+-':>6}")
    for e in ranked[: args.top]:
        o = e.offer
        print(f"{o.instance_type:<16}{Market(o.market).value:<11}{o.zone:<14}{o.gpu_name:<10}{o.price_per_hour:>8.3f}"
              f"{e.hours:>9.2f}{e.expected_cost:>12.2f}{100 * e.uncertainty:>5.0f}%")
    print("+-: the profile's own noise on a measured GPU model; with the catalog's throughput figures "
          "(about 25 %) on the others")
    return 0
