"""What running outside the checkpoint store's region costs, derived from the checkpoint's size."""
from __future__ import annotations

import pytest

from airflow_spot.policy.transfer import GIB, TransferCost, saves_per_hour, transfer_cost


def test_a_move_restores_the_checkpoint_once_and_every_save_writes_it_back():
    cost = transfer_cost(50 * GIB, dollars_per_gib=0.02, seconds_per_gib=4.0, saves_per_hour=4.0)
    # the restore: 50 GiB at $0.02 and 4 s; the saves back: 4 an hour of 50 GiB at $0.02
    assert cost == TransferCost(seconds=200.0, dollars=pytest.approx(1.0), dollars_per_hour=pytest.approx(4.0))


def test_the_flat_part_is_added_to_the_part_that_grows_with_the_checkpoint():
    cost = transfer_cost(GIB / 4, seconds=30.0, dollars=0.5, seconds_per_gib=8.0, dollars_per_gib=0.02)
    assert cost == TransferCost(seconds=pytest.approx(32.0), dollars=pytest.approx(0.505), dollars_per_hour=0.0)


def test_before_the_first_checkpoint_there_is_nothing_to_restore_or_save():
    assert transfer_cost(None, seconds=10.0, dollars_per_gib=0.02, seconds_per_gib=5.0,
                         saves_per_hour=4.0) == TransferCost(10.0, 0.0, 0.0)


def test_a_segment_boundary_is_a_save():
    assert saves_per_hour(900, 1.0) == pytest.approx(4.0)  # 900 steps of 1 s: a save every 15 min
    assert saves_per_hour(900, None) == 0.0  # the job's speed not measured yet


@pytest.mark.parametrize("kwargs, name", [
    ({"dollars_per_gib": -0.02}, "dollars_per_gib"),
    ({"seconds": "60"}, "seconds"),
    ({"seconds_per_gib": float("nan")}, "seconds_per_gib"),
    ({"dollars": True}, "dollars"),
    ({"saves_per_hour": -1.0}, "saves_per_hour"),
])
def test_bad_figures_are_named(kwargs, name):
    with pytest.raises(ValueError, match=f"{name} must be a number >= 0"):
        transfer_cost(GIB, **kwargs)
