"""Money's rounding, owned here once (issue 37): each currency's minor unit (its ISO 4217
exponent, `MINOR_UNITS`, `minor_unit`), rounding an exact amount to it (`round_money`), and
sharing a rounded amount out so that the parts add up to it (`apportion`, by
`largest_remainders`, which the comparison also uses to show hours that add up).
`billing.pricing` and `billing.selectors` call these (and keep their names importable);
`tests/billing/test_money_owner.py` fails if the exponent table is written again.
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Mapping
from decimal import Decimal
from fractions import Fraction
from typing import Any, TypeVar

K = TypeVar("K", bound=Hashable)

# ISO 4217 currencies whose minor unit is not the cent: the number of decimals (the exponent)
# of those that have another; every other currency has two.
MINOR_UNITS = {"JPY": 0, "KRW": 0, "ISK": 0, "CLP": 0, "BHD": 3, "KWD": 3, "JOD": 3, "OMR": 3}
DEFAULT_EXPONENT = 2


def currency_exponent(currency: str) -> int:
    """How many decimals `currency`'s amounts have: 2 for USD, 0 for JPY, 3 for KWD."""
    return MINOR_UNITS.get(currency.upper(), DEFAULT_EXPONENT)


def minor_unit(currency: str) -> Decimal:
    """The currency's smallest amount: 0.01 USD, 1 JPY, 0.001 KWD (as `round_money` rounds)."""
    return Decimal(1).scaleb(-currency_exponent(currency))


def round_money(amount: Decimal | Fraction, currency: str) -> Decimal:
    """`amount`, exact, rounded half-up (half away from zero) to the currency's minor unit."""
    exponent = minor_unit(currency)
    units = Fraction(amount) / Fraction(exponent)
    rounded = math.floor(abs(units) + Fraction(1, 2))
    return (Decimal(rounded if units >= 0 else -rounded) * exponent).quantize(exponent)


def apportion(total: Decimal, shares: Mapping[Any, Fraction], currency: str) -> dict[Any, Decimal]:
    """`total` (a rounded amount) shared out among `shares` (exact amounts adding up to it
    before its rounding) in whole minor units of `currency`, so that the parts add up to
    `total` exactly: each share rounded down, and the units left over given to the shares
    that lost the most by it (the largest remainders; ties in key order)."""
    unit = Fraction(minor_unit(currency))
    scaled = {key: share / unit for key, share in shares.items()}
    try:
        units = largest_remainders(scaled, int(Fraction(total) / unit))
    except ValueError:
        raise ValueError(f"{total} {currency} is not the rounded sum of the shares given") from None
    return {key: Decimal(count) * minor_unit(currency) for key, count in units.items()}


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
