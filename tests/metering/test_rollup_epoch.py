"""The rollup reads allocations' bounds as milliseconds made in the database
(`metering.rollup._EpochMs`): the same whole milliseconds `epoch_ms` makes of them, sub-
millisecond digits cut, before the epoch too."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest
from django.db import connection

from metering import rollup
from metering.hours import epoch_ms

pytestmark = pytest.mark.django_db


@pytest.mark.parametrize(
    "moment",
    [
        datetime(2026, 3, 2, tzinfo=UTC),
        datetime(2026, 3, 2, 12, 0, 0, 999, tzinfo=UTC),
        datetime(2026, 3, 2, 12, 0, 0, 999_999, tzinfo=UTC),
        datetime(2026, 3, 2, 12, 0, 1, 1_000, tzinfo=UTC),
        datetime(1969, 12, 31, 23, 59, 59, 999_500, tzinfo=UTC),
        datetime(2300, 1, 1, 0, 0, 0, 123_456, tzinfo=UTC) - timedelta(microseconds=1),
    ],
)
def test_milliseconds_made_in_the_database_are_epoch_ms(moment: datetime) -> None:
    sql = rollup._EpochMs.template % {"expressions": "CAST(%s AS timestamptz)"}
    with connection.cursor() as cursor:
        cursor.execute(f"SELECT {sql}", [moment])
        assert cursor.fetchone()[0] == epoch_ms(moment)
