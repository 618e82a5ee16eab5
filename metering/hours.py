"""GPU time's units and usage arithmetic: milliseconds since the Unix epoch (how samples and
the rollup count time, in integers) and UTC hours (what usage rows and dirty marks are kept
per); the one place that says what idle time is and how milliseconds become hours.

Usage of a device (a `UsageHour` row, a statement line, any sum of them) splits its allocated
time into three parts: allocated = utilised + idle + unmeasured. Idle time is therefore
allocated less utilised less unmeasured (`idle_of`; `idle_expression` in a query). Hours are
milliseconds over `MS_PER_HOUR` (`hours_from_ms`), kept to `KEPT_HOURS` (statements, the
comparison, alerts, gangs) or shown to `SHOWN_HOURS` (pages, the week report).
`tests/billing/test_usage_owner.py` fails if the idle formula is written anywhere else.

Pure functions and constants, no model: every billing module can use them.
"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from decimal import ROUND_HALF_UP, Decimal
from fractions import Fraction
from typing import Final, TypeVar

from django.conf import settings
from django.db.models import F
from django.db.models.expressions import CombinedExpression

EPOCH: Final = datetime(1970, 1, 1, tzinfo=UTC)  # the Unix epoch, never another origin
ONE_MS: Final = timedelta(milliseconds=1)
HOUR: Final = timedelta(hours=1)
MS_PER_HOUR: Final = 3_600_000
# The precisions of hours: as stored and billed (statement lines, comparisons, alerts), and as
# pages, the week report and its CSV show them.
KEPT_HOURS: Final = Decimal("0.000001")
SHOWN_HOURS: Final = Decimal("0.01")
# Utilisation is summed in millionths of a percent, each reading rounded to one (half to even,
# as PostgreSQL's round() of a double and Python's round() do): sums of integers, exact in any
# order, and finer than any source measures (`metering.rollup`, `metering.reading_sums`).
UTIL_SCALE: Final = 1_000_000

_Amount = TypeVar("_Amount", int, Decimal, Fraction)


def idle_of(allocated: _Amount, utilised: _Amount, unmeasured: _Amount) -> _Amount:
    """Idle time: held and measured but not used, allocated less utilised less unmeasured (in
    whatever the three are counted in: milliseconds, hours)."""
    return allocated - utilised - unmeasured


def idle_expression(
    allocated: str = "allocated_gpu_ms",
    utilised: str = "utilised_gpu_ms",
    unmeasured: str = "unmeasured_gpu_ms",
) -> CombinedExpression:
    """`idle_of` in a query: over a `UsageHour` row's fields by default, or over the named
    fields or annotations (wrap it in `Sum` to add rows up)."""
    return F(allocated) - F(utilised) - F(unmeasured)


def hours_from_ms(
    milliseconds: int | Decimal,
    places: Decimal | None = KEPT_HOURS,
    rounding: str = ROUND_HALF_UP,
) -> Decimal:
    """`milliseconds` in hours, rounded to `places` (`KEPT_HOURS`, `SHOWN_HOURS`; None: not
    rounded) by `rounding`."""
    hours = Decimal(milliseconds) / MS_PER_HOUR
    return hours if places is None else hours.quantize(places, rounding)


def epoch_ms(moment: datetime) -> int:
    """Whole milliseconds from the epoch to the aware `moment` (sub-millisecond digits cut)."""
    return (moment - EPOCH) // ONE_MS


def hour_start(moment: datetime) -> datetime:
    """The start of the UTC hour that holds `moment`."""
    return moment.astimezone(UTC).replace(minute=0, second=0, microsecond=0)


def hour_at(hours_since_epoch: int) -> datetime:
    """The start of the UTC hour numbered `hours_since_epoch` (`ts_ms // MS_PER_HOUR`)."""
    return EPOCH + timedelta(hours=hours_since_epoch)


def hours_between(start: datetime, end: datetime) -> set[datetime]:
    """The starts of the UTC hours that `[start, end)` reaches into."""
    hours, hour = set(), hour_start(start)
    while hour < end:
        hours.add(hour)
        hour += HOUR
    return hours


def sample_hold_ms() -> int:
    """How long a sample's utilisation holds at most when no later sample of its device comes
    sooner (TALLY_SAMPLE_HOLD_SECONDS, read per call so tests can change it), in ms."""
    return int(settings.TALLY_SAMPLE_HOLD_SECONDS) * 1000
