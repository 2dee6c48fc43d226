"""GpuRequest refuses what a DAG author may mistype, naming the field, the value and the fix."""
from __future__ import annotations

import re

import pytest

from airflow_spot.policy.offers import GpuRequest, Market


@pytest.mark.parametrize("field, value", [("names", "A10G"), ("exclude_names", "K80"), ("regions", "us-east-1"),
                                          ("zones", "use1-az1")])
def test_a_bare_string_is_refused_with_the_list_to_write_not_split_into_letters(field, value):
    message = f"GpuRequest.{field} must be a list of non-empty strings, e.g. {[value]!r}, not the bare string {value!r}"
    for make in (lambda: GpuRequest(**{field: value}), lambda: GpuRequest.from_dict({field: value})):
        with pytest.raises(ValueError, match=re.escape(message)):
            make()


@pytest.mark.parametrize("value", [None, 5, ["A10G", ""], ["A10G", 3], {"A10G": 1}])
def test_a_names_field_that_is_no_list_of_strings_is_refused(value):
    with pytest.raises(ValueError, match=re.escape("GpuRequest.names must be a list of non-empty strings, e.g. "
                                                   "['A10G', 'L4'], got")):
        GpuRequest.from_dict({"names": value})


def test_lists_and_sets_become_tuples_sets_in_a_stable_order():
    r = GpuRequest.from_dict({"names": ["L4", "A10G"], "regions": {"us-west-2", "us-east-1"}})
    assert r.names == ("L4", "A10G") and r.regions == ("us-east-1", "us-west-2")
    assert GpuRequest.from_dict(r.to_dict()) == r


@pytest.mark.parametrize(
    "field, value, message",
    [
        ("count", "1", "GpuRequest.count must be a positive integer (GPUs per instance), e.g. count=1, got the "
                       "string '1' (write the number without quotes)"),
        ("count", True, "GpuRequest.count must be a positive integer (GPUs per instance), e.g. count=1, "
                        "got True (bool)"),
        ("count", 1.0, "got 1.0 (float)"),
        ("count", 0, "GpuRequest.count must be a positive integer (GPUs per instance), e.g. count=1, got 0"),
        ("count", None, "got None (NoneType)"),
        ("min_memory_gib", "16", "GpuRequest.min_memory_gib must be a number >= 0 (GiB of memory per GPU), e.g. "
                                 "min_memory_gib=16, got the string '16' (write the number without quotes)"),
        ("min_memory_gib", False, "GpuRequest.min_memory_gib must be a number >= 0"),
        ("min_memory_gib", float("nan"), "got nan (float)"),
        ("min_memory_gib", -1, "GpuRequest.min_memory_gib must be a number >= 0 (GiB of memory per GPU), e.g. "
                               "min_memory_gib=16, got -1"),
        ("max_price_per_hour", "2", "GpuRequest.max_price_per_hour must be a number > 0 ($/h of the whole "
                                    "instance) or None for no cap, e.g. max_price_per_hour=2.5, got the string '2'"),
        ("max_price_per_hour", True, "max_price_per_hour must be a number > 0"),
        ("max_price_per_hour", 0, "max_price_per_hour must be a number > 0"),
    ],
)
def test_numeric_fields_are_type_checked_with_the_fix(field, value, message):
    for make in (lambda: GpuRequest(**{field: value}), lambda: GpuRequest.from_dict({field: value})):
        with pytest.raises(ValueError, match=re.escape(message)):
            make()


def test_numbers_in_range_are_accepted_as_given():
    r = GpuRequest(count=8, min_memory_gib=80, max_price_per_hour=12)
    assert (r.count, r.min_memory_gib, r.max_price_per_hour) == (8, 80, 12)
    assert GpuRequest(min_memory_gib=15.5, max_price_per_hour=None).min_memory_gib == 15.5


def test_markets_must_be_a_list():
    with pytest.raises(ValueError, match=re.escape("GpuRequest.markets must be a list, e.g. ['spot', 'on-demand']")):
        GpuRequest(markets=5)
    assert GpuRequest.from_dict({"markets": ["spot"]}).markets == (Market.SPOT,)
