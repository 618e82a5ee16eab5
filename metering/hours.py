"""GPU time's units: milliseconds since the Unix epoch (how samples and the rollup count
time, in integers) and UTC hours (what usage rows and dirty marks are kept per).

Pure functions and constants, no model: every billing module can use them.
"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Final

from django.conf import settings

EPOCH: Final = datetime(1970, 1, 1, tzinfo=UTC)  # the Unix epoch, never another origin
ONE_MS: Final = timedelta(milliseconds=1)
HOUR: Final = timedelta(hours=1)
MS_PER_HOUR: Final = 3_600_000


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
