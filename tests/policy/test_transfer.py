"""What an attempt outside the checkpoint store's region pays, derived from the checkpoint's size."""
from __future__ import annotations

import pytest

from airflow_spot.policy.transfer import GIB, TransferCost, transfer_cost


def test_each_gib_of_checkpoint_is_restored_once_and_saved_back_once():
    cost = transfer_cost(50 * GIB, dollars_per_gib=0.02, seconds_per_gib=4.0)
    # restore + one save back: 100 GiB at $0.02; only the restore delays the start: 50 GiB at 4 s
    assert cost == TransferCost(seconds=200.0, dollars=pytest.approx(2.0))


def test_the_flat_part_is_added_to_the_part_that_grows_with_the_checkpoint():
    cost = transfer_cost(GIB / 4, seconds=30.0, dollars=0.5, seconds_per_gib=8.0, dollars_per_gib=0.02)
    assert cost.seconds == pytest.approx(32.0) and cost.dollars == pytest.approx(0.51)


def test_before_the_first_checkpoint_there_is_nothing_to_restore():
    assert transfer_cost(None, seconds=10.0, dollars_per_gib=0.02, seconds_per_gib=5.0) == TransferCost(10.0, 0.0)


@pytest.mark.parametrize("kwargs, name", [
    ({"dollars_per_gib": -0.02}, "dollars_per_gib"),
    ({"seconds": "60"}, "seconds"),
    ({"seconds_per_gib": float("nan")}, "seconds_per_gib"),
    ({"dollars": True}, "dollars"),
])
def test_bad_figures_are_named(kwargs, name):
    with pytest.raises(ValueError, match=f"{name} must be a number >= 0"):
        transfer_cost(GIB, **kwargs)
