"""What stranded gangs' held devices cost (issue 20): `inventory.stranded` priced by rate card.

Each model's hours are priced by the rate card in force today (`billing.pricing.RateCards`: a
MIG profile's own card per hour of the slice, else the model's per hour of its unit), at the
card's full price: the idle discount a statement later gives (its idle factor) depends on
samples not rolled up yet. Amounts are exact until rounded once per gang and currency. Hours
of a model with no rate card are not priced, and are reported as such.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from datetime import datetime
from decimal import Decimal
from fractions import Fraction
from typing import Any

from billing.models import SLICE_HOUR
from billing.pricing import RateCards, round_money
from inventory.models import Cluster
from inventory.stranded import StrandedGang, stranded_gangs
from metering.hours import MS_PER_HOUR, hours_from_ms
from teams.models import Team


@dataclass(frozen=True)
class PricedGang:
    """A stranded gang and what its devices have cost since it became partial."""

    gang: StrandedGang
    # Unit-hours held since it became partial (GPU-hours for GPUs), to the millionth.
    unit_hours: Decimal
    # Currency code → amount, rounded to its minor unit; one entry per currency of the cards.
    cost: dict[str, Decimal]
    # Unit-hours of models that no rate card prices.
    unpriced_unit_hours: Decimal


def priced_stranded_gangs(
    *, user: Any, now: datetime, cluster: Cluster | None = None, team: Team | None = None
) -> list[PricedGang]:
    """`inventory.stranded.stranded_gangs`, each with what it has cost (see the module)."""
    cards = RateCards(first_day=now.date(), last_day=now.date())
    priced = []
    for gang in stranded_gangs(user=user, now=now, cluster=cluster, team=team):
        exact: dict[str, Fraction] = defaultdict(Fraction)
        unpriced_ms = Decimal(0)
        for line in gang.held:
            card = cards.on(line.product_name, line.profile, now.date())
            if card is None or not line.product_name:
                unpriced_ms += line.unit_ms
                continue
            hours = Fraction(line.unit_ms) / MS_PER_HOUR
            if card.rate_unit == SLICE_HOUR and line.device_share:
                hours /= Fraction(line.device_share)  # hours of one slice
            exact[card.currency] += Fraction(card.per_gpu_hour) * hours
        priced.append(
            PricedGang(
                gang=gang,
                unit_hours=_hours(sum((line.unit_ms for line in gang.held), Decimal(0))),
                cost={
                    currency: round_money(amount, currency)
                    for currency, amount in sorted(exact.items())
                },
                unpriced_unit_hours=_hours(unpriced_ms),
            )
        )
    return priced


def _hours(unit_ms: Decimal) -> Decimal:
    return hours_from_ms(unit_ms)
