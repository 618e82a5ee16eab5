"""Largest remainders: the rounding statements' per-person splits and the comparison's parts
share (`billing.rounding`)."""

from __future__ import annotations

import math
from fractions import Fraction

import pytest
from hypothesis import given
from hypothesis import strategies as st

from billing.rounding import largest_remainders

parts = st.lists(
    st.fractions(min_value=-1000, max_value=1000, max_denominator=997), min_size=1, max_size=20
)


@given(parts=parts)
def test_the_parts_add_up_and_each_is_its_floor_or_ceiling(parts: list[Fraction]) -> None:
    total = round(sum(parts, Fraction(0)))
    units = largest_remainders(dict(enumerate(parts)), total)
    assert sum(units.values()) == total
    for index, part in enumerate(parts):
        assert units[index] in (math.floor(part), math.ceil(part))


def test_the_largest_remainders_win_and_ties_go_in_key_order() -> None:
    units = largest_remainders({"a": Fraction(1, 3), "b": Fraction(1, 3), "c": Fraction(4, 3)}, 2)
    assert units == {"a": 1, "b": 0, "c": 1}
    assert largest_remainders({"x": Fraction(7, 10), "y": Fraction(13, 10)}, 2) == {"x": 1, "y": 1}


def test_a_total_no_rounding_could_give_is_refused() -> None:
    with pytest.raises(ValueError, match="5 is not a rounding of the parts' sum"):
        largest_remainders({"a": Fraction(1, 2), "b": Fraction(1, 2)}, 5)
