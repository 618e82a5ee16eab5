"""What billed hours count, in words: `GPU-hours`, `TPU chip-hours`, `Gaudi card-hours`.

A usage row's and a statement line's figures are hours of their device's unit
(`inventory.models.Unit`); hours of different units are never added up into one number.
"""

from __future__ import annotations

from inventory.models import Unit
from inventory.profiles import hours_label, unit_order

__all__ = ["hours_label", "units_label"]


def units_label(units: list[str]) -> str:
    """Hours of several units, as a total of them is named: `GPU-hours + TPU chip-hours`, so
    a sum across units says what it adds up."""
    labels = dict.fromkeys(hours_label(unit) for unit in sorted(set(units), key=unit_order))
    return " + ".join(labels) or hours_label(Unit.GPU)
