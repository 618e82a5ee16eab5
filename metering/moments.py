"""Moments people give: a day or a whole UTC hour, as the API, the portal and the commands
take a window's bound or a week's first day, checked against the years Tally can count in.

One parser for all of them, so that `?since=`, `?start=` and `--before` accept the same
spellings and refuse the same values with the same words. The range is what keeps the
arithmetic after parsing (a window's end, the period holding a bound, the week before a
week) inside the calendar: Python's datetimes end at year 9999 and begin at year 1, and a
date at either edge (`0001-01-01`, `9999-W52`) used to overflow into a 500.

Pure functions; no model, so every module of every app can use them.
"""

from __future__ import annotations

from datetime import UTC, date, datetime, time

from metering.hours import EPOCH, hour_start

# Usage is counted in milliseconds from the Unix epoch: nothing is recorded before it.
EARLIEST = EPOCH
# Years after 9998 leave no room for the arithmetic every window does (its period's end, the
# next week, a window of up to 400 days): the year 9999 is refused outright, not by chance.
LATEST = datetime(9999, 1, 1, tzinfo=UTC)
RANGE_HELP = f"from {EARLIEST:%Y-%m-%d} to {LATEST:%Y-%m-%d}"
MOMENT_HELP = "a UTC date (2026-11-02, midnight) or a whole UTC hour (2026-11-02T14:00Z)"
DAY_HELP = "a day like 2026-11-23 (YYYY-MM-DD)"


def within_range(moment: datetime, value: str) -> datetime:
    """`moment` (parsed from `value`) when it lies in `[EARLIEST, LATEST]`; else `ValueError`
    saying so, in the words of `value` as given."""
    if not EARLIEST <= moment <= LATEST:
        raise ValueError(f"{value!r} is out of range: Tally counts time {RANGE_HELP} (UTC)")
    return moment


def parse_moment(value: str) -> datetime:
    """A window bound: a date (its midnight UTC) or an aware or naive (UTC) time on a whole
    hour, in range; `ValueError` saying why `value` is not one (usage is kept per hour)."""
    text = value.strip()
    try:
        moment = datetime.fromisoformat(text.replace("z", "Z"))
        moment = moment.replace(tzinfo=UTC) if moment.tzinfo is None else moment.astimezone(UTC)
    except (ValueError, OverflowError):
        raise ValueError(f"{value!r} is not {MOMENT_HELP}") from None
    within_range(moment, value)
    if moment != hour_start(moment):
        raise ValueError(
            f"{value!r} is not on a whole UTC hour: usage is kept per hour, give {MOMENT_HELP}"
        )
    return moment


def parse_day(value: str) -> datetime:
    """00:00 UTC of the day `value` (YYYY-MM-DD), in range; `ValueError` saying why not."""
    try:
        day = date.fromisoformat(value.strip())
    except ValueError:
        raise ValueError(f"{value!r} is not {DAY_HELP}") from None
    return within_range(datetime.combine(day, time(), UTC), value)
