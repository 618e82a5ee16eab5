"""Usage arithmetic has one owner (issue 37): idle = allocated - utilised - unmeasured is
written once, in `metering.hours` (`idle_of`, `idle_expression` for queries), and every other
module calls it. This test reads the product's source and fails where the subtraction is
written again, in Python, in an ORM expression (`F("allocated...") - F("utilised...") - ...`)
or in raw SQL."""

from __future__ import annotations

import ast
import inspect
import re
from decimal import Decimal
from fractions import Fraction
from pathlib import Path

from django.db.models import F

from metering.hours import KEPT_HOURS, SHOWN_HOURS, hours_from_ms, idle_expression, idle_of

ROOT = Path(__file__).resolve().parents[2]
# The product's packages (bench/ keeps its own hand-priced oracle on purpose: it checks the
# statements against arithmetic written apart from them).
PACKAGES: tuple[str, ...] = ("agent", "core", "db", "teams", "inventory", "metering")
PACKAGES += ("billing", "quota", "frontend", "demo", "config")
OWNER = Path(inspect.getsourcefile(idle_of) or "").resolve()

# allocated ... - ... utilised/unmeasured ... - ... unmeasured/utilised, in SQL text.
SQL_COPY = re.compile(
    r"allocated\w*\s*-\s*[\w.\"]*(utilised|unmeasured)\w*\"?\s*-\s*[\w.\"]*(utilised|unmeasured)",
    re.IGNORECASE,
)


def _mentions(node: ast.AST, word: str) -> bool:
    return word in ast.unparse(node).lower()


def copies_in(source: str) -> list[int]:
    """The lines of `source` that write allocated - utilised - unmeasured (either order of the
    last two), as Python arithmetic or expressions, or inside a string (SQL)."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if (
            isinstance(node, ast.BinOp)
            and isinstance(node.op, ast.Sub)
            and isinstance(node.left, ast.BinOp)
            and isinstance(node.left.op, ast.Sub)
        ):
            first, second, third = node.left.left, node.left.right, node.right
            parts = {w for w in ("utilised", "unmeasured") if _mentions(second, w)}
            parts |= {w for w in ("utilised", "unmeasured") if _mentions(third, w)}
            if _mentions(first, "allocated") and parts == {"utilised", "unmeasured"}:
                found.append(node.lineno)
        elif (
            isinstance(node, ast.Constant)
            and isinstance(node.value, str)
            and SQL_COPY.search(node.value)
        ):
            found.append(node.lineno)
    return found


def _product_files() -> list[Path]:
    return [
        path
        for package in PACKAGES
        if (ROOT / package).is_dir()
        for path in sorted((ROOT / package).rglob("*.py"))
        if "migrations" not in path.parts
    ]


def test_the_idle_formula_is_written_only_by_its_owner() -> None:
    files = _product_files()
    assert OWNER in files and len(files) > 100
    copies = [
        f"{path.relative_to(ROOT)}:{line}"
        for path in files
        if path != OWNER
        for line in copies_in(path.read_text())
    ]
    assert copies == [], f"write `metering.hours.idle_of` / `idle_expression` instead: {copies}"
    # The owner does write it (the check would notice its own formula).
    assert copies_in(OWNER.read_text())


def test_the_check_notices_every_form_of_a_copy() -> None:
    assert copies_in("idle = row.allocated_ms - row.utilised_ms - row.unmeasured_ms") == [1]
    assert copies_in("x = (\n a['allocated'] - a['unmeasured'] - a['utilised'])") == [2]
    assert copies_in('q = Sum(F("allocated_gpu_ms") - F("utilised_gpu_ms") - F("x_unmeasured"))')
    assert copies_in('sql = "SELECT u.allocated_gpu_ms - u.utilised_gpu_ms - u.unmeasured_gpu_ms"')
    # Measured time (allocated less unmeasured) and unrelated sums are not the formula.
    assert copies_in("measured = allocated - unmeasured") == []
    assert copies_in("left = allocated - used - reserved") == []


def test_the_owner_computes_idle_in_python_and_in_a_query() -> None:
    assert idle_of(3_600_000, 1_000_000, 600_000) == 2_000_000
    assert idle_of(Decimal("2.5"), Decimal("1"), Decimal("0.25")) == Decimal("1.25")
    assert idle_of(Fraction(1), Fraction(1, 3), Fraction(1, 6)) == Fraction(1, 2)
    assert idle_expression() == F("allocated_gpu_ms") - F("utilised_gpu_ms") - F(
        "unmeasured_gpu_ms"
    )
    assert idle_expression("a", "u", "m") == F("a") - F("u") - F("m")


def test_hours_from_milliseconds() -> None:
    assert hours_from_ms(5_400_000) == Decimal("1.500000")
    assert hours_from_ms(1, places=None) == Decimal(1) / 3_600_000
    # 18 s is 0.005 h: half up by default, half even where a page asks for it.
    assert hours_from_ms(18_000, SHOWN_HOURS) == Decimal("0.01")
    assert hours_from_ms(18_000, SHOWN_HOURS, "ROUND_HALF_EVEN") == Decimal("0.00")
    assert Decimal("0.000001") == KEPT_HOURS
