"""Rate-card rules: what a card's values may be, and a card may change only where it prices no
closed period the same way.

Every entry point that changes rate cards (the policy file, the admin, `save_rate_card`) asks
`rate_card_value_errors` of the values, and `rate_change_error` with the closed periods it
read (locked, when the change is about to be written).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from datetime import UTC, date, datetime, time
from decimal import Decimal
from typing import Any, NamedTuple, Protocol

from billing.currencies import currency_error
from billing.models import Period, RateCard
from billing.periods import PricingError
from db.locks import advisory_xact_lock

# A device's `profile` attribute as drivers publish it (3g.40gb, 1g.10gb+me): one word.
_PROFILE = re.compile(r"\S+\Z")


def rate_card_value_errors(values: Mapping[str, Any]) -> dict[str, str]:
    """What is wrong with a rate card's values, by field (`RateCard`'s names), in field order;
    empty when nothing is. A field absent or None (not given, or not parsed) is not checked.

    The one set of rules the admin's form, `save_rate_card` and the policy file apply (the
    policy file reports each message under its own key's path).
    """
    errors: dict[str, str] = {}
    product_name, profile = values.get("product_name"), values.get("profile")
    if product_name is not None and not product_name:
        errors["product_name"] = "must not be empty"
    if profile and not _PROFILE.match(profile):
        errors["profile"] = f"{profile!r} is not a device profile such as 3g.40gb (one word)"
    currency = values.get("currency")
    if currency is not None and (error := currency_error(currency)):
        errors["currency"] = error
    per_gpu_hour = values.get("per_gpu_hour")
    if per_gpu_hour is not None and per_gpu_hour <= 0:
        errors["per_gpu_hour"] = f"must be positive, got {per_gpu_hour}"
    idle_factor = values.get("idle_factor")
    if idle_factor is not None and not 0 <= idle_factor <= 1:
        errors["idle_factor"] = f"{idle_factor} is not between 0 and 1"
    valid_from, valid_until = values.get("valid_from"), values.get("valid_until")
    if valid_from is not None and valid_until is not None and valid_until <= valid_from:
        errors["valid_until"] = f"{valid_until} is not after from ({valid_from})"
    return errors


class RateCardValueError(PricingError):
    """Rate card values that `rate_card_value_errors` refuses; `errors` by field."""

    def __init__(self, errors: Mapping[str, str]) -> None:
        self.errors = dict(errors)
        super().__init__("; ".join(f"{field}: {message}" for field, message in errors.items()))


def overlap(start: date, end: date | None, other_start: date, other_end: date | None) -> bool:
    """Whether `[start, end)` and `[other_start, other_end)` share a day; None: open-ended."""
    return start < (other_end or date.max) and other_start < (end or date.max)


class ClosedPeriod(NamedTuple):
    """A closed billing period as days: `[start, end)`, UTC."""

    name: str
    start: date
    end: date

    @classmethod
    def of(cls, period: Period) -> ClosedPeriod:
        start, end = period.start.astimezone(UTC), period.end.astimezone(UTC)
        return cls(period.label, start.date(), end.date())


class RateLike(Protocol):
    """What prices usage: a stored `RateCard` or a declared `RateSpec`."""

    @property
    def product_name(self) -> str: ...
    @property
    def profile(self) -> str: ...
    @property
    def currency(self) -> str: ...
    @property
    def valid_from(self) -> date: ...
    @property
    def valid_until(self) -> date | None: ...
    @property
    def per_gpu_hour(self) -> Decimal: ...
    @property
    def idle_factor(self) -> Decimal: ...


class _Pricing(NamedTuple):
    """How a rate card priced one closed period: the days it covered there, at what price."""

    period: ClosedPeriod
    start: date
    end: date
    per_gpu_hour: Decimal
    idle_factor: Decimal


def closed_periods(*, lock: bool = False) -> list[ClosedPeriod]:
    """The closed billing periods, oldest first; with `lock`, every period is locked so that
    none closes, priced with a rate card about to change, before this transaction commits
    (`close_period` locks its period first), and other writers of rate cards wait until it
    does (`overlapping_card` then sees all their cards)."""
    if lock:
        advisory_xact_lock("billing.rate_cards", [0])
    periods = Period.objects.select_for_update() if lock else Period.objects.all()
    return [ClosedPeriod.of(period) for period in periods.order_by("start") if period.is_closed]


def open_since(*, lock: bool = False) -> datetime | None:
    """Where the hours no closed period holds begin: the end of the last closed period, None
    while none is closed. With `lock`, as `closed_periods`: none closes before this commits."""
    periods = closed_periods(lock=lock)
    if not periods:
        return None
    return datetime.combine(max(period.end for period in periods), time(), UTC)


def rate_change_error(
    *, before: RateLike | None, after: RateLike | None, periods: list[ClosedPeriod]
) -> str | None:
    """Why changing a rate card from `before` to `after` (None: no card) would price one of the
    closed `periods` differently, or None when it would not: the days the card covers in each
    closed period, and its price and idle factor there, must stay as they are."""
    stored, wanted = _pricing(before, periods), _pricing(after, periods)
    if stored == wanted:
        return None
    card = before or after
    assert card is not None  # None twice prices nothing: equal
    label = (
        f"the rate for {f'{card.product_name} {card.profile}'.strip()} ({card.currency}) "
        f"from {card.valid_from}"
    )
    if not stored:
        latest = max(entry.period.end for entry in wanted)
        return f"{label} would price {_periods_phrase(wanted)}; start it on {latest} or later"
    if after is None:
        return f"{label} was used by {_periods_phrase(stored)}; it is never deleted"
    return (
        f"{label} was used by {_periods_phrase(stored)}; add a new entry from a later date instead"
    )


def _pricing(card: RateLike | None, periods: list[ClosedPeriod]) -> tuple[_Pricing, ...]:
    if card is None:
        return ()
    return tuple(
        _Pricing(
            period=period,
            start=max(card.valid_from, period.start),
            end=min(card.valid_until or date.max, period.end),
            per_gpu_hour=card.per_gpu_hour,
            idle_factor=card.idle_factor,
        )
        for period in periods
        if overlap(card.valid_from, card.valid_until, period.start, period.end)
    )


def _periods_phrase(pricing: tuple[_Pricing, ...]) -> str:
    names = [entry.period.name for entry in pricing]
    return f"the closed period{'s' if len(names) > 1 else ''} {', '.join(names)}"


def overlapping_card(card: RateLike, *, pk: int | None = None) -> RateCard | None:
    """A stored card (other than the one numbered `pk`) of `card`'s model and profile valid on
    a day `card` is, in any currency, or None: a GPU-hour has one price a day, as the policy
    file's rule says."""
    others = RateCard.objects.filter(product_name=card.product_name, profile=card.profile)
    if pk is not None:
        others = others.exclude(pk=pk)
    for other in others.order_by("valid_from", "currency"):
        if overlap(card.valid_from, card.valid_until, other.valid_from, other.valid_until):
            return other
    return None


def validity(card: RateLike) -> str:
    """`from 2026-01-01 until 2026-07-01`, or `from 2026-01-01 on`."""
    until = f" until {card.valid_until}" if card.valid_until else " on"
    return f"from {card.valid_from}{until}"


def overlap_error(card: RateLike, other: RateCard) -> str:
    return (
        f"valid {validity(card)}, which overlaps the rate card {other} (valid "
        f"{validity(other)}) for the same model and profile: one price a day, in any "
        "currency; end one card the day the other starts"
    )
