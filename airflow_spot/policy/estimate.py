"""Step-time estimates: an EWMA of measured step times, and a fit of step time across GPU types.

Online, the operators smooth a job's step times with :class:`StepTimeEwma`. Offline, ``airflow-spot
estimate`` fits ``log t = a - b * log x`` by least squares over the GPU types a job was measured on
(``x`` = the GPU's relative throughput estimate): ``b = 1`` means the job speeds up exactly as the
estimates say, ``b < 1`` that it is partly bound by something else (input pipeline, host). With one
measurement ``b`` is taken as 1. Pure maths, no I/O.
"""
from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass


@dataclass
class StepTimeEwma:
    """Exponentially weighted mean of step times; ``alpha`` is the weight of the newest sample."""

    alpha: float = 0.1
    value: float | None = None
    samples: int = 0

    def __post_init__(self) -> None:
        if not 0 < self.alpha <= 1:
            raise ValueError(f"alpha must be in (0, 1], got {self.alpha!r}")

    def update(self, seconds: float) -> float:
        if not (seconds >= 0 and math.isfinite(seconds)):
            raise ValueError(f"step time must be a finite number >= 0, got {seconds!r}")
        self.value = seconds if self.value is None else self.alpha * seconds + (1 - self.alpha) * self.value
        self.samples += 1
        return self.value


@dataclass(frozen=True)
class StepTimeModel:
    """``t(x) = exp(a) * x ** -b`` seconds per step on an instance of relative throughput ``x``."""

    a: float
    b: float

    def step_seconds(self, relative_throughput: float) -> float:
        if relative_throughput <= 0:
            raise ValueError(f"relative_throughput must be > 0, got {relative_throughput!r}")
        return math.exp(self.a) * relative_throughput ** (-self.b)


def fit_step_time(measured: Mapping[float, float]) -> StepTimeModel:
    """Least squares of ``log t`` on ``log x`` over ``{relative throughput: seconds per step}``.

    :raises ValueError: with no measurement, or a non-positive value.
    """
    if not measured:
        raise ValueError("need at least one measured step time (relative throughput -> seconds)")
    pts = []
    for x, t in measured.items():
        if not (x > 0 and t > 0):
            raise ValueError(f"throughput and step time must be positive, got {x!r} -> {t!r}")
        pts.append((math.log(x), math.log(t)))
    xs = [p[0] for p in pts]
    if len(pts) == 1 or max(xs) - min(xs) < 1e-12:
        b = 1.0
    else:
        mx, my = sum(xs) / len(xs), sum(p[1] for p in pts) / len(pts)
        b = -sum((x - mx) * (y - my) for x, y in pts) / sum((x - mx) ** 2 for x in xs)
    a = sum(y + b * x for x, y in pts) / len(pts)
    return StepTimeModel(a=a, b=b)
