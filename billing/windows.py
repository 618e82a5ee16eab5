"""The one window vocabulary of the API and the portal (issue 35): `start` and `end` (a UTC date
or a whole UTC hour, `end` exclusive), or `period` (a billing period by its label, `2026-11` or
`2026-W47`, its id or its start date), with an optional prefix where a query holds two windows
(`before_start`, `after_period`).

Every endpoint and page that takes a window parses it here, so they accept the same spellings
and refuse the same windows with the same words: a bound that is no moment, a period that is
none, a period given with a bound, and a window that ends before it starts (reversed) or where
it starts (empty). Each error is keyed by the parameter at fault.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from datetime import date, datetime
from typing import Any

from django.db.models import Q, QuerySet

from billing.models import Period
from billing.periods import PricingError, is_period_label, parse_period
from metering.moments import MOMENT_HELP, parse_moment
from teams.api import next_day, start_of_day

START, END, PERIOD = "start", "end", "period"

PERIOD_HELP = (
    "A billing period: its name as the commands give it (2026-11, or 2026-W47 when "
    "TALLY_BILLING_PERIOD=week), its id, or its start as a UTC date (2026-10-01)."
)
START_HELP = f"The window's start, inclusive: {MOMENT_HELP}."
END_HELP = f"The window's end, exclusive: {MOMENT_HELP}; after start."
WINDOW_PERIOD_HELP = f"The window of one billing period, instead of start/end. {PERIOD_HELP}"


class WindowError(ValueError):
    """A window that cannot be used; `errors` maps each parameter at fault to the reason."""

    def __init__(self, errors: dict[str, str]) -> None:
        super().__init__("; ".join(f"{name}: {reason}" for name, reason in errors.items()))
        self.errors = errors


@dataclass(frozen=True)
class Window:
    """`[start, end)` in UTC; a missing bound leaves that side open."""

    start: datetime | None = None
    end: datetime | None = None

    @property
    def given(self) -> bool:
        return self.start is not None or self.end is not None

    def q(self, field: str) -> Q:
        """Rows whose `field` lies in the window."""
        q = Q()
        if self.start is not None:
            q &= Q(**{f"{field}__gte": self.start})
        if self.end is not None:
            q &= Q(**{f"{field}__lt": self.end})
        return q

    def filter(self, queryset: QuerySet[Any], field: str) -> QuerySet[Any]:
        return queryset.filter(self.q(field)) if self.given else queryset


def period_lookups(value: str) -> dict[str, Any]:
    """Lookups on Period for a period given by name (`2026-11`, `2026-W47`), id, or start date
    (the period starting that day); `ValueError` saying why `value` is none of them."""
    value = value.strip()
    if value.isascii() and value.isdigit():
        return {"pk": int(value)}
    # Before dates: Python reads 2026-W47 as a date too (its Monday).
    if is_period_label(value):
        try:
            start, _ = parse_period(value)
        except PricingError as exc:
            raise ValueError(str(exc)) from None
        return {"start": start}
    try:
        day = start_of_day(date.fromisoformat(value))
    except ValueError:
        raise ValueError(f"{value!r} is not a period. {PERIOD_HELP}") from None
    after = next_day(day)
    return {"start__gte": day, **({"start__lt": after} if after else {})}


def period_window(value: str) -> tuple[datetime, datetime]:
    """The bounds of the period `value` names (`period_lookups`): a label's own bounds, stored
    or not yet; an id or a start date those of the stored period; `ValueError` otherwise."""
    if is_period_label(value.strip()):
        try:
            return parse_period(value)
        except PricingError as exc:
            raise ValueError(str(exc)) from None
    period = Period.objects.filter(**period_lookups(value)).order_by("start").first()
    if period is None:
        raise ValueError(f"there is no period {value.strip()!r}. {PERIOD_HELP}")
    return period.start, period.end


def parse_window(
    params: Mapping[str, Any],
    *,
    prefix: str = "",
    with_period: bool = True,
    required: bool = False,
) -> Window:
    """The window that `params` (a query's parameters) give as `<prefix>start`,
    `<prefix>end` and, `with_period`, `<prefix>period`; blank values count as absent. With
    `required`, both bounds (or a period) must be given. `WindowError` naming each parameter
    at fault: a bound that is no moment, a period with a bound, a reversed or empty window."""
    names = {key: f"{prefix}{key}" for key in (START, END, PERIOD)}
    given = {
        key: str(params.get(name) or "").strip()
        for key, name in names.items()
        if with_period or key != PERIOD
    }
    errors: dict[str, str] = {}
    if given.get(PERIOD):
        if given[START] or given[END]:
            both = f"{names[START]}/{names[END]}"
            raise WindowError({names[PERIOD]: f"give a period or {both}, not both"})
        try:
            first, last = period_window(given[PERIOD])
        except ValueError as exc:
            raise WindowError({names[PERIOD]: str(exc)}) from None
        return Window(first, last)
    bounds: dict[str, datetime] = {}
    for key in (START, END):
        if not given[key]:
            if required:
                errors[names[key]] = f"required: {MOMENT_HELP}" + (
                    f", or give {names[PERIOD]}" if with_period else ""
                )
            continue
        try:
            bounds[key] = parse_moment(given[key])
        except ValueError as exc:
            errors[names[key]] = str(exc)
    start, end = bounds.get(START), bounds.get(END)
    if start is not None and end is not None:
        if end < start:
            errors[names[END]] = (
                f"the window is reversed: {names[END]} {end:%Y-%m-%dT%H:%MZ} is before "
                f"{names[START]} {start:%Y-%m-%dT%H:%MZ}"
            )
        elif end == start:
            errors[names[END]] = (
                f"the window is empty: {names[END]} equals {names[START]} "
                f"({start:%Y-%m-%dT%H:%MZ}); the end is exclusive"
            )
    if errors:
        raise WindowError(errors)
    return Window(start, end)
