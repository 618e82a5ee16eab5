"""Hours before a device gained its UUID are rolled up again where a Prometheus engine meters
its cluster: the engine keeps DCGM's series by UUID, so those hours have readings under the
new meter id. Samples-metered clusters need nothing (samples sent under the UUID before were
set aside, and adopting them marks their hours). Through the sync's watch events, on
PostgreSQL."""

from __future__ import annotations

from datetime import datetime, timedelta

import pytest
from pytest_django.fixtures import SettingsWrapper

from inventory.models import Allocation
from metering.hours import hours_between
from metering.models import DirtyHour
from tests.metering.test_meter_id_day import DAY, NOON, UUID, claim, resource_slice, watch

pytestmark = pytest.mark.django_db


SINCE = DAY + timedelta(hours=3)


def marked_after_the_uuid_came(
    settings: SettingsWrapper, source: str, *, since: datetime = SINCE, republished: bool = False
) -> set[datetime]:
    """The hours marked by the slice updated with the UUID at noon (or deleted and published
    again with it: a new device row), after a claim held the device (then without one) since
    `since` and its marks were cleared (rolled up)."""
    settings.TALLY_METERING_SOURCE = source
    watch(("ADDED", resource_slice(1), since), ("ADDED", claim(), since))
    DirtyHour.objects.all().delete()
    if republished:
        watch(("DELETED", resource_slice(1), NOON), ("ADDED", resource_slice(2, UUID), NOON))
    else:
        watch(("MODIFIED", resource_slice(2, UUID), NOON))
    allocation = Allocation.objects.get()
    assert allocation.device is not None and allocation.device.meter_id == UUID
    return set(DirtyHour.objects.values_list("hour", flat=True))


@pytest.mark.parametrize("republished", [False, True], ids=["updated", "republished"])
def test_a_prometheus_metered_clusters_hours_before_the_uuid_are_marked(
    settings: SettingsWrapper, republished: bool
) -> None:
    marked = marked_after_the_uuid_came(settings, "prometheus", republished=republished)
    assert hours_between(SINCE, NOON) <= marked
    assert NOON in marked  # from the change on, as for every cluster
    assert min(marked) == SINCE


def test_a_samples_metered_clusters_hours_before_the_uuid_are_left(
    settings: SettingsWrapper,
) -> None:
    marked = marked_after_the_uuid_came(settings, "samples")
    assert NOON in marked
    assert min(marked) == NOON


def test_hours_older_than_a_late_sample_may_be_are_not_marked(settings: SettingsWrapper) -> None:
    settings.TALLY_INGEST_MAX_AGE_DAYS = 1
    settings.TALLY_SAMPLE_RETENTION_DAYS = 30
    since = NOON - timedelta(hours=30)
    marked = marked_after_the_uuid_came(settings, "prometheus", since=since)
    assert min(marked) == NOON - timedelta(days=1)
    assert hours_between(NOON - timedelta(days=1), NOON) <= marked
