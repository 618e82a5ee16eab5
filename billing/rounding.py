"""Rounding parts so that they add up to their rounded total (largest remainders)."""

from __future__ import annotations

import math
from collections.abc import Hashable, Mapping
from fractions import Fraction
from typing import TypeVar

K = TypeVar("K", bound=Hashable)


def largest_remainders(scaled: Mapping[K, Fraction], total: int) -> dict[K, int]:
    """Whole numbers for `scaled` (exact parts, in the units to round to) that add up to
    `total` (their sum, rounded): each part rounded down, and the units left over given to the
    parts that lost the most by it (ties in key order). `total` must be within one unit per
    part of the floors' sum, as a rounding of the parts' sum is."""
    floors = {key: math.floor(part) for key, part in scaled.items()}
    left = total - sum(floors.values())
    if not 0 <= left <= len(scaled):
        raise ValueError(f"{total} is not a rounding of the parts' sum")
    ranked = sorted(scaled, key=lambda key: (-(scaled[key] - floors[key]), key))
    for key in ranked[:left]:
        floors[key] += 1
    return floors
