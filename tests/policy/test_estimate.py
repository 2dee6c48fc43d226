from __future__ import annotations

import math

import pytest

from airflow_spot.policy.estimate import StepTimeEwma, fit_step_time


def test_ewma():
    e = StepTimeEwma(alpha=0.5)
    assert e.update(2.0) == 2.0
    assert e.update(4.0) == 3.0
    assert e.update(3.0) == 3.0 and e.samples == 3
    with pytest.raises(ValueError):
        e.update(float("nan"))
    with pytest.raises(ValueError):
        StepTimeEwma(alpha=0)


def test_fit_recovers_a_known_power_law():
    # t = 0.5 * x ** -0.8
    m = fit_step_time({x: 0.5 * x ** -0.8 for x in (0.4, 1.0, 2.2)})
    assert m.b == pytest.approx(0.8) and math.exp(m.a) == pytest.approx(0.5)
    assert m.step_seconds(4.0) == pytest.approx(0.5 * 4.0 ** -0.8)


def test_fit_with_one_measurement_scales_by_throughput():
    m = fit_step_time({1.0: 0.6})
    assert m.b == 1.0 and m.step_seconds(2.0) == pytest.approx(0.3)
    with pytest.raises(ValueError, match="at least one"):
        fit_step_time({})
    with pytest.raises(ValueError):
        fit_step_time({1.0: -1.0})
