"""Billing periods as people name them: calendar months in UTC or ISO weeks, by
TALLY_BILLING_PERIOD. Pure functions of dates and the setting; no model, so every billing
module (its models included) can use them.
"""

from __future__ import annotations

import re
from datetime import UTC, date, datetime, timedelta

from django.conf import settings

from metering.moments import within_range

MONTH, WEEK = "month", "week"
PERIOD_LENGTHS = (MONTH, WEEK)
_MONTH_TEXT = re.compile(r"(\d{4})-(\d{2})")
_WEEK_TEXT = re.compile(r"(\d{4})-[Ww](\d{2})")
_EXAMPLES = {MONTH: "2026-11", WEEK: "2026-W47"}


class PricingError(ValueError):
    """A pricing step that cannot be done; the message says why."""


def period_length() -> str:
    """`month` or `week`, from TALLY_BILLING_PERIOD (read per call, so tests can change it)."""
    return str(settings.TALLY_BILLING_PERIOD)


def period_bounds(moment: datetime, *, length: str | None = None) -> tuple[datetime, datetime]:
    """The period `[start, end)` that holds `moment`: its calendar month in UTC, or its ISO
    week (from Monday 00:00 UTC) when the length (default TALLY_BILLING_PERIOD) is `week`."""
    length = length or period_length()
    day = moment.astimezone(UTC).replace(hour=0, minute=0, second=0, microsecond=0)
    if length == WEEK:
        start = day - timedelta(days=day.weekday())
        return start, start + timedelta(days=7)
    if length != MONTH:
        raise PricingError(f"unknown period length {length!r}; use {' or '.join(PERIOD_LENGTHS)}")
    start = day.replace(day=1)
    end = (
        start.replace(year=start.year + 1, month=1)
        if start.month == 12
        else start.replace(month=start.month + 1)
    )
    return start, end


def period_label(start: datetime, end: datetime) -> str:
    """How people name a period: `2026-11` for a calendar month, `2026-W47` for an ISO week,
    else its days (a period stored before the length was changed)."""
    start = start.astimezone(UTC)
    if (start, end) == period_bounds(start, length=MONTH):
        return f"{start:%Y-%m}"
    if (start, end) == period_bounds(start, length=WEEK):
        year, week, _ = start.isocalendar()
        return f"{year}-W{week:02d}"
    return f"{start:%Y-%m-%d}..{end.astimezone(UTC):%Y-%m-%d}"


def is_period_label(text: str) -> bool:
    """Whether `text` is written as a period label (`2026-11`, `2026-W47`), of either length:
    `parse_period` then says whether it is one of the configured length."""
    text = text.strip()
    return bool(_MONTH_TEXT.fullmatch(text) or _WEEK_TEXT.fullmatch(text))


def length_of(start: datetime, end: datetime) -> str | None:
    """`month` or `week` for a stored period of that length, else None."""
    for length in PERIOD_LENGTHS:
        if (start, end) == period_bounds(start, length=length):
            return length
    return None


def parse_period(text: str) -> tuple[datetime, datetime]:
    """The bounds of the period named `text` (`2026-11` for a month, `2026-W47` for an ISO
    week), which must be of the configured length: a week named where billing is monthly
    would bill a span no statement covers."""
    length = period_length()
    text = text.strip()
    month, week = _MONTH_TEXT.fullmatch(text), _WEEK_TEXT.fullmatch(text)
    wanted = f"give the period as {_EXAMPLES[length]}"
    if month is None and week is None:
        raise PricingError(
            f"{text!r} is not a period; billing periods are {length}s: {wanted} "
            f"({'YYYY-MM' if length == MONTH else 'YYYY-Www, an ISO week'})"
        )
    if (length == MONTH and week) or (length == WEEK and month):
        other = WEEK if week else MONTH
        raise PricingError(
            f"{text!r} names a {other}, but billing periods are {length}s "
            f"(TALLY_BILLING_PERIOD={length}): {wanted}"
        )
    try:
        if month is not None:
            first = date(int(month[1]), int(month[2]), 1)
        else:
            assert week is not None
            first = date.fromisocalendar(int(week[1]), int(week[2]), 1)
    except ValueError as exc:
        raise PricingError(f"{text!r} is not a {length}: {exc}") from None
    try:
        start = within_range(datetime(first.year, first.month, first.day, tzinfo=UTC), text)
    except ValueError as exc:
        raise PricingError(str(exc)) from None
    return period_bounds(start)
