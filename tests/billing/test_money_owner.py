"""Money has one owner (issue 37): `billing.rounding` holds each currency's exponent (its ISO
4217 minor unit), rounds to it and shares a rounded amount out by largest remainders; the
pricing, the selectors, the week report and the pages call it. This test reads the product's
source and fails where a table of currency exponents is written again, or read past the
owner's functions."""

from __future__ import annotations

import ast
import inspect
from decimal import Decimal
from fractions import Fraction
from pathlib import Path

from billing import pricing, selectors
from billing.currencies import ISO_4217
from billing.rounding import (
    MINOR_UNITS,
    apportion,
    currency_exponent,
    minor_unit,
    round_money,
)
from tests.billing.test_usage_owner import _product_files

OWNER = Path(inspect.getsourcefile(round_money) or "").resolve()


def exponent_tables(source: str) -> list[int]:
    """The lines of `source` with a dict of two or more ISO 4217 codes to integers (a table
    of exponents), or a read of such a table by name (`MINOR_UNITS[...]`, `.get(...)`)."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Dict):
            codes = [
                key.value
                for key, value in zip(node.keys, node.values, strict=True)
                if isinstance(key, ast.Constant)
                and key.value in ISO_4217
                and isinstance(value, ast.Constant)
                and isinstance(value.value, int)
            ]
            if len(codes) >= 2:
                found.append(node.lineno)
        elif isinstance(node, ast.Name) and node.id == "MINOR_UNITS":
            found.append(node.lineno)
    return found


def test_the_currency_exponent_table_is_written_once() -> None:
    files = _product_files()
    assert OWNER in files
    elsewhere = [
        f"{path}:{line}"
        for path in files
        if path != OWNER
        for line in exponent_tables(path.read_text())
    ]
    assert elsewhere == [], f"use billing.rounding (currency_exponent, minor_unit): {elsewhere}"
    # The owner's table, once: the dict and its name on one line, and its one reader.
    owner = exponent_tables(OWNER.read_text())
    assert len(owner) == 3 and len(set(owner)) == 2


def test_the_check_notices_a_copy() -> None:
    assert exponent_tables('PLACES = {"JPY": 0, "KWD": 3}') == [1]
    assert exponent_tables("x = MINOR_UNITS.get(code, 2)") == [1]
    assert exponent_tables('LABELS = {"JPY": "yen", "USD": "dollar"}') == []


def test_one_rounding_everywhere() -> None:
    # The names the other modules used stay importable, and are the owner's.
    assert pricing.round_money is round_money and pricing.MINOR_UNITS is MINOR_UNITS
    assert selectors.minor_unit is minor_unit and selectors.apportion is apportion
    assert [currency_exponent(c) for c in ("USD", "jpy", "KWD", "EUR")] == [2, 0, 3, 2]
    assert [minor_unit(c) for c in ("USD", "JPY", "KWD")] == [
        Decimal("0.01"),
        Decimal(1),
        Decimal("0.001"),
    ]
    assert round_money(Fraction(5, 2), "JPY") == Decimal(3)
    assert round_money(Fraction(-1, 200), "USD") == Decimal("-0.01")
    parts = apportion(Decimal("1.00"), {"a": Fraction(1, 3), "b": Fraction(2, 3)}, "USD")
    assert parts == {"a": Decimal("0.33"), "b": Decimal("0.67")}
